// bench_context_parallel — how much of context parallelism's communication is exposed:
// a Llama-like attention layer (8 query heads, grouped-query kv heads, no biases, fp32,
// batch 1) under context parallelism on cp = 2 and 4 ranks, its forward and backward
// with the real exchanges (nn::SelfAttention over a ContextParallelGroup: ring attention,
// and the all-to-all over the heads where cp divides the kv heads), against the same
// kernels with no communication at all.
//
//   build/benchmarks/bench_context_parallel                          # thread ranks, cp 2 and 4
//   OMP_NUM_THREADS=1 mpirun -np 2 build/benchmarks/bench_context_parallel   # cp 2 processes
//   ... --seq 8192 --passes 5                     # other sequence lengths, more timed passes
//
// Under mpirun every process runs every case with the same fixed iterations (their
// exchanges must match), cp is the number of processes, and rank 0 reports.
//
// How compute and communication are told apart. The layer runs on TimedCpu, backend::Cpu
// with its attention kernels (state init, block forward, state finish, dsum, block
// backward) wrapped: each wrapper notes where the ring core begins and ends, and, in one
// untimed pass, records its call with its arguments. Then:
//   core_ms      the ring core, forward + backward, with the real communication: from the
//                forward's state init to its state finish, and from the backward's dsum
//                to the next GEMM (the QKV projection's backward);
//   compute_ms   the recorded kernel calls of one pass replayed back to back with no
//                communication: the same blocks (the same causal and full blocks of
//                every ring step), on the same buffers, in the same order; every rank
//                replays at once (ranks share the cores as in core_ms), timed from a
//                barrier to a barrier after the last rank's replay: the ring's steps
//                line the ranks up, so it cannot finish before the slowest rank either;
//   exposed_ms   core_ms - compute_ms: what the ring's waits cost, with its local copies
//                and sums (packing K/V, zeroing and adding the dK/dV sums, dQ/dK/dV
//                back into dqkv; by their element counts about 1% of compute here);
//   waiting_ms   core_ms less the time inside its kernels in the same passes: the
//                ring's waits (and copies) measured in the run itself; exposed_ms less
//                waiting_ms is how much slower the kernels ran beside the communication
//                (the copies on the same cores, cold caches after the projections, noise);
//   comm_ms      the ring's exchanges alone (the same p2p passes of the same sizes, no
//                kernels between them): what there was to hide;
//   layer_ms     the whole layer (QKV and output projections included) with the ring;
//   MiB_sent     bytes one rank sends per layer, forward + backward: the K/V block
//                (B·T/cp rows of 2·KVH·hs values of T) cp - 1 times in forward and again
//                in backward, and its dK/dV (f32) cp times in backward.
// The all-to-all (".../a2a") runs the whole-sequence kernels (attention_forward and
// _backward over 1/cp of the heads), between exchanges that nothing hides: its core_ms
// is the time between the projections' GEMMs (the exchanges, their packing and the
// kernels), compute_ms the two kernels replayed, comm_ms its five all-to-alls alone
// (qkv and the output forward; the output, its gradient and qkv's backward), MiB_sent
// the (cp - 1)/cp of them that leaves the rank.
// Each is the median of the timed passes on a rank, averaged over the ranks.
//
// The replay is honest compute, not an estimate from the serial layer: a block's cost
// does not depend on which rank's keys it holds, and the blocks are those the ring ran.
// Positions are left out (nn::NoPositions): rotary angles are elementwise and local.
// Thread ranks exchange by copying in the p2p call itself (comm/thread_comm.hpp: the
// second side to arrive copies), so on threads nothing overlaps and the copies show up
// as exposed. Whether an MPI process moves a message while its kernels run depends on
// the MPI and its transport; what it did not move shows up in the wait. With fewer
// cores than cp ranks, a rank also waits for its neighbour's core.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <llmpar/llmpar.hpp>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "rank_reporting.hpp"

#if defined(LLMPAR_WITH_MPI)
#include <llmpar/comm/mpi_comm.hpp>
#endif

using namespace llmpar;

namespace {

using Clock = std::chrono::steady_clock;
using T = float;
using Acc = backend::Cpu::Acc<T>;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// What TimedCpu's wrappers note on one rank.
struct KernelLog {
  bool recording = false;
  std::vector<std::function<void()>> calls;  // the recorded pass's core kernels
  bool in_core = false;
  Clock::time_point core_start;
  double core_seconds = 0.0;    // inside the ring core since the last reset
  double kernel_seconds = 0.0;  // inside its kernels since the last reset
  bool between_gemms = false;   // the all-to-all: the core is what runs between GEMMs

  void open() {
    if (!in_core) core_start = Clock::now(), in_core = true;
  }
  void close() {
    if (in_core) core_seconds += seconds_since(core_start), in_core = false;
  }
};

class TimedContext : public backend::cpu::Context {
 public:
  KernelLog log;
  backend::cpu::Context& base() { return *this; }
};

// backend::Cpu with the ring core's kernels noted in the context's log.
struct TimedCpu : backend::Cpu {
  using Context = TimedContext;
  using Cpu = backend::Cpu;

  template <class E, class TC = E>
  static void gemm(Context& ctx, TC* c, const E* a, const E* b, const E* bias, std::int64_t m, std::int64_t n,
                   std::int64_t k, GemmOp op) {
    ctx.log.close();  // the backward core ends where the QKV projection's backward begins
    Cpu::gemm<E, TC>(ctx, c, a, b, bias, m, n, k, op);
    if (ctx.log.between_gemms) ctx.log.open();
  }
  template <class E>
  static void attention_forward(Context& ctx, E* out, Acc<E>* lse, const E* qkv, const AttentionShape& shape) {
    run(ctx, [&ctx, out, lse, qkv, shape] { Cpu::attention_forward(ctx.base(), out, lse, qkv, shape); });
  }
  template <class E>
  static void attention_backward(Context& ctx, E* dqkv, const E* dout, const E* qkv, const E* out, const Acc<E>* lse,
                                 const AttentionShape& shape) {
    run(ctx, [&ctx, dqkv, dout, qkv, out, lse, shape] {
      Cpu::attention_backward(ctx.base(), dqkv, dout, qkv, out, lse, shape);
    });
  }
  template <class A>
  static void attention_state_init(Context& ctx, const AttentionState<A>& st, const AttentionShape& shape) {
    ctx.log.open();
    run(ctx, [&ctx, st, shape] { Cpu::attention_state_init(ctx.base(), st, shape); });
  }
  template <class E>
  static void attention_block_forward(Context& ctx, const AttentionState<Acc<E>>& st, const E* qkv, const E* kv,
                                      const AttentionShape& shape, const AttentionBlock& block) {
    run(ctx,
        [&ctx, st, qkv, kv, shape, block] { Cpu::attention_block_forward(ctx.base(), st, qkv, kv, shape, block); });
  }
  template <class E>
  static void attention_state_finish(Context& ctx, E* out, Acc<E>* lse, const AttentionState<Acc<E>>& st,
                                     const AttentionShape& shape) {
    run(ctx, [&ctx, out, lse, st, shape] { Cpu::attention_state_finish(ctx.base(), out, lse, st, shape); });
    ctx.log.close();
  }
  template <class E>
  static void attention_dsum(Context& ctx, Acc<E>* dsum, const E* dout, const E* out, const AttentionShape& shape) {
    ctx.log.open();
    run(ctx, [&ctx, dsum, dout, out, shape] { Cpu::attention_dsum(ctx.base(), dsum, dout, out, shape); });
  }
  template <class E>
  static void attention_block_backward(Context& ctx, Acc<E>* dq, Acc<E>* dkv, const E* dout, const E* qkv, const E* kv,
                                       const Acc<E>* lse, const Acc<E>* dsum, const AttentionShape& shape,
                                       const AttentionBlock& block) {
    run(ctx, [&ctx, dq, dkv, dout, qkv, kv, lse, dsum, shape, block] {
      Cpu::attention_block_backward(ctx.base(), dq, dkv, dout, qkv, kv, lse, dsum, shape, block);
    });
  }

 private:
  template <class F>
  static void run(Context& ctx, F&& kernel) {
    if (ctx.log.recording) ctx.log.calls.emplace_back(kernel);
    const Clock::time_point t0 = Clock::now();
    kernel();
    ctx.log.kernel_seconds += seconds_since(t0);
  }
};

// The command line's choices (main's --seq and --passes).
struct Options {
  std::vector<std::int64_t> seqs{2048, 4096};
  int passes = 3;  // timed passes of each measurement, after a warm-up and a recorded pass
};

struct Case {
  int cp = 2;
  int passes = 3;
  std::int64_t dim = 256, heads = 8, kv_heads = 2, seq = 2048;
  nn::CpComm how = nn::CpComm::ring;
  std::string name(const std::string& engine) const {
    return engine + "/cp:" + std::to_string(cp) + "/C:" + std::to_string(dim) + "/kvh:" + std::to_string(kv_heads) +
           "/T:" + std::to_string(seq) + (how == nn::CpComm::ring ? "" : "/a2a");
  }
  std::int64_t rows() const { return seq / cp; }  // batch 1
  std::int64_t head_dim() const { return dim / heads; }
  // Elements of one rank's K/V block: B·T/cp rows of 2·KVH·hs (batch 1).
  std::size_t block() const { return static_cast<std::size_t>(rows() * 2 * kv_heads * head_dim()); }
  // Elements of one rank's qkv rows and of its output rows (the all-to-all's exchanges).
  std::size_t qkv() const { return static_cast<std::size_t>(rows() * (heads + 2 * kv_heads) * head_dim()); }
  std::size_t output() const { return static_cast<std::size_t>(rows() * dim); }
  double mib_sent() const {
    if (how == nn::CpComm::all_to_all) return (2.0 * qkv() + 3.0 * output()) * sizeof(T) * (cp - 1) / cp / (1 << 20);
    const double n = static_cast<double>(block());
    return ((2.0 * (cp - 1)) * n * sizeof(T) + cp * n * sizeof(Acc)) / (1 << 20);
  }
};

struct Measured {
  float layer_ms = 0, core_ms = 0, waiting_ms = 0, compute_ms = 0, comm_ms = 0;
};

float median_ms(std::vector<double> s) {
  std::sort(s.begin(), s.end());
  return static_cast<float>(s[s.size() / 2] * 1e3);
}

// The ring's exchanges with nothing between them, batched as nn/context_parallel.hpp
// batches them: forward passes the K/V block cp - 1 times; backward has cp + 1 steps,
// each one batch of the previous step's dK/dV sum (from step 1) and the K/V block in
// hand (up to step cp - 2).
void exchanges_alone(comm::Comm& cp, std::vector<T>& kv, std::vector<T>& kv_in, std::vector<Acc>& dkv,
                     std::vector<Acc>& dkv_in) {
  const int P = cp.size(), next = (cp.rank() + 1) % P, prev = (cp.rank() + P - 1) % P;
  for (int step = 0; step + 1 < P; ++step) cp.p2p({cp.send_op(kv, next), cp.recv_op(kv_in, prev)});
  for (int step = 0; step <= P; ++step) {
    std::vector<comm::Op> ops;
    if (step > 0) ops.insert(ops.end(), {cp.send_op(dkv, next), cp.recv_op(dkv_in, prev)});
    if (step + 1 < P) ops.insert(ops.end(), {cp.send_op(kv, next), cp.recv_op(kv_in, prev)});
    cp.p2p(ops);
  }
}

// The all-to-all's exchanges with nothing between them: qkv and the output forward, the
// output, its gradient and qkv's gradient backward (nn/context_parallel.hpp).
void all_to_alls_alone(comm::Comm& cp, std::vector<T>& send, std::vector<T>& recv, const Case& c) {
  for (std::size_t n : {c.qkv(), c.output(), c.output(), c.output(), c.qkv()})
    cp.all_to_all(std::span<const T>(send.data(), n), std::span<T>(recv.data(), n));
}

// One rank's measurements; `world` is the cp group.
Measured run_rank(comm::Comm& world, const Case& c) {
  TimedContext ctx;
  ctx.log.between_gemms = c.how == nn::CpComm::all_to_all;
  nn::SelfAttention<T, TimedCpu> layer("attn.qkv", "attn.proj",
                                       {.dim = c.dim, .heads = c.heads, .kv_heads = c.kv_heads, .bias = false});
  nn::ParameterStore<T> store;
  store.bind(layer);
  store.initialize(1337);
  const nn::ContextParallelGroup cp(&world, c.how);
  cp.check_sequence(c.seq);
  layer.set_context_parallel(cp);
  const std::int64_t seq = cp.local(c.seq), rows = seq;  // batch 1
  std::vector<T> x(static_cast<std::size_t>(rows * c.dim)), dout(x.size()), out(x.size()), dx(x.size());
  const auto stream = rng::Stream::named(7 + static_cast<std::uint64_t>(world.rank()), "bench activations");
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<T>(stream.normal(2 * i));
    dout[i] = static_cast<T>(1e-2 * stream.normal(2 * i + 1));
  }
  typename nn::SelfAttention<T, TimedCpu>::Saved saved;
  auto pass = [&] {
    layer.forward(ctx, saved, out.data(), x.data(), 1, seq);
    layer.backward(ctx, saved, dx.data(), dout.data(), x.data(), 1, seq);
    ctx.log.close();  // the all-to-all's core opens after the last GEMM
  };
  pass();  // warm-up: buffers, GEMM primitives
  ctx.log.recording = true;
  pass();
  ctx.log.recording = false;
  // The ring's kernels per pass: state init, finish and dsum, and each of the 2 cp + 1
  // blocks (nn/context_parallel.hpp) forward and backward; the all-to-all's: the
  // whole-sequence forward and backward.
  const bool ring = c.how == nn::CpComm::ring;
  const std::size_t core_calls = ring ? 3 + 2 * static_cast<std::size_t>(2 * c.cp + 1) : 2;
  LLMPAR_CHECK(ctx.log.calls.size() == core_calls, "the recorded pass ran ", ctx.log.calls.size(),
               " attention kernels, but ", nn::cp_comm_name(c.how), " on cp ", c.cp, " runs ", core_calls,
               "; the layer's core is no longer the one this benchmark times");

  std::vector<T> kv(c.block()), kv_in(c.block());
  std::vector<Acc> dkv(c.block()), dkv_in(c.block());
  std::vector<T> send(c.qkv()), recv(c.qkv());
  const auto exchanges = [&] {
    if (ring)
      exchanges_alone(world, kv, kv_in, dkv, dkv_in);
    else
      all_to_alls_alone(world, send, recv, c);
  };
  exchanges();  // warm-up
  // The three measurements in turn, so that they see the same state of the machine.
  std::vector<double> layer_s, core_s, waiting_s, compute_s, comm_s;
  for (int i = 0; i < c.passes; ++i) {
    world.barrier();
    ctx.log.core_seconds = ctx.log.kernel_seconds = 0.0;
    Clock::time_point t0 = Clock::now();
    pass();
    layer_s.push_back(seconds_since(t0));
    core_s.push_back(ctx.log.core_seconds);
    waiting_s.push_back(ctx.log.core_seconds - ctx.log.kernel_seconds);
    world.barrier();
    t0 = Clock::now();
    for (const auto& call : ctx.log.calls) call();
    world.barrier();  // until every rank has replayed: the ring cannot finish before the slowest
    compute_s.push_back(seconds_since(t0));
    world.barrier();
    t0 = Clock::now();
    exchanges();
    comm_s.push_back(seconds_since(t0));
  }
  std::vector<float> m{median_ms(layer_s), median_ms(core_s), median_ms(waiting_s), median_ms(compute_s),
                       median_ms(comm_s)};
  world.all_reduce(std::span<float>(m), comm::ReduceOp::avg);
  return {m[0], m[1], m[2], m[3], m[4]};
}

// On the MPI world when there is one (its size is cp), else on c.cp thread ranks.
Measured run_case(comm::Comm* mpi_world, const Case& c) {
  if (mpi_world) return run_rank(*mpi_world, c);
  Measured out;
  std::mutex mutex;
  comm::ThreadOptions options;
  options.omp_threads_per_rank = std::max(1, omp_get_max_threads() / c.cp);
  comm::run_threads(
      c.cp,
      [&](comm::ThreadComm& thread_world) {
        comm::Comm world(std::move(thread_world));
        const Measured m = run_rank(world, c);
        const std::lock_guard<std::mutex> lock(mutex);
        if (world.rank() == 0) out = m;
      },
      options);
  return out;
}

void register_case(const std::string& engine, comm::Comm* mpi_world, const Case& c) {
  benchmark::RegisterBenchmark(c.name(engine).c_str(),
                               [mpi_world, c](benchmark::State& state) {
                                 Measured m;
                                 for (auto _ : state) {
                                   m = run_case(mpi_world, c);
                                   state.SetIterationTime(m.core_ms * 1e-3);
                                 }
                                 state.counters["layer_ms"] = m.layer_ms;
                                 state.counters["core_ms"] = m.core_ms;
                                 state.counters["compute_ms"] = m.compute_ms;
                                 state.counters["exposed_ms"] = m.core_ms - m.compute_ms;
                                 state.counters["exposed/compute"] = (m.core_ms - m.compute_ms) / m.compute_ms;
                                 state.counters["waiting_ms"] = m.waiting_ms;
                                 state.counters["comm_ms"] = m.comm_ms;
                                 state.counters["MiB_sent"] = c.mib_sent();
                               })
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

// cp 2 and 4 (under mpirun: the world's size), two layer widths (C 256 with 2 kv heads,
// C 512 with 4), each sequence length of the options; ring attention, and the
// all-to-all where cp divides the kv heads.
void register_all(const std::string& engine, comm::Comm* mpi_world, const Options& o) {
  const std::vector<int> cps = mpi_world ? std::vector<int>{mpi_world->size()} : std::vector<int>{2, 4};
  for (int cp : cps)
    for (const auto& [dim, kv_heads] : {std::pair<std::int64_t, std::int64_t>{256, 2}, {512, 4}})
      for (std::int64_t seq : o.seqs)
        for (nn::CpComm how : {nn::CpComm::ring, nn::CpComm::all_to_all})
          if (how == nn::CpComm::ring || kv_heads % cp == 0)
            register_case(
                engine, mpi_world,
                {.cp = cp, .passes = o.passes, .dim = dim, .heads = 8, .kv_heads = kv_heads, .seq = seq, .how = how});
}

// Google Benchmark's flags are taken first; the rest must be these. Empty after --help
// or a bad flag, with the exit code in *exit_code.
std::optional<Options> parse_options(int argc, char** argv, int* exit_code) {
  Options o;
  CLI::App app{"bench_context_parallel: context parallelism's exposed communication per layer (ring and all-to-all)"};
  app.add_option("--seq", o.seqs, "Sequence lengths (tokens; batch 1), each a multiple of 2 x cp")
      ->capture_default_str();
  app.add_option("--passes", o.passes, "Timed passes per measurement (the median is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    *exit_code = app.exit(e);
    return std::nullopt;
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
#if defined(LLMPAR_WITH_MPI)
    if (comm::launched_by_mpi()) {
      comm::MpiEnvironment mpi(argc, argv);
      comm::Comm world(comm::MpiComm::world());
      LLMPAR_CHECK(world.size() > 1, "bench_context_parallel under mpirun needs 2 processes or more (one per cp rank)");
      benchmark::Initialize(&argc, argv);
      int exit_code = 0;
      const std::optional<Options> o = parse_options(argc, argv, &exit_code);
      if (!o) return exit_code;
      register_all("mpi", &world, *o);
      bench::run_benchmarks_on_rank(world.rank());
      benchmark::Shutdown();
      return 0;
    }
#endif
    benchmark::Initialize(&argc, argv);
    int exit_code = 0;
    const std::optional<Options> o = parse_options(argc, argv, &exit_code);
    if (!o) return exit_code;
    register_all("threads", nullptr, *o);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_context_parallel: %s\n", e.what());
    return 1;
  }
}
