// llmpar-plan — predicts, before a run, the memory per rank and the step time of a
// training layout on a cluster (plan/cost.hpp), and proves the predictions against runs.
//
//   llmpar-plan --model gpt2-1.5b --cluster h200x8x4 --global-batch 512
//       every valid layout of 32 GPUs, ranked by predicted step time, with the memory of
//       each rank, those that would not fit marked and why, and the best's command line
//   llmpar-plan --model gpt2-124m --cluster h100x8x1 --ranks 8 --tp 2 --pp 2 --zero 1 --batch 4 --global-batch 64
//       one layout (train_gpt's flags), every term of its memory and time
//   llmpar-plan --model llama-tiny --kv-heads 4 --seq 1024 --cluster cpu.json --cp 2 --global-batch 8
//       a Llama (train_gpt's --model llama-* and shape flags), searched at a fixed
//       context-parallel degree (without --cp the search tries every cp that cuts --seq)
//   llmpar-plan --calibrate cpu.json
//       measures this machine (GEMM curves per precision, memory bandwidth, the thread
//       communicator's busbw and latency) into a cluster file for --cluster
//   llmpar-plan --validate --cluster cpu.json [--out docs/planner-validation.md]
//       runs a grid of layouts with train_gpt on thread ranks and compares the
//       predicted memory (per term) and step time with the measured ones
//
// Layouts are checked with train_gpt's own checks (train_gpt::validate), so the planner
// lists exactly the layouts train_gpt accepts, and prints its flags. The model is
// train_gpt's too (train_gpt::is_llama, model_config, llama_config), seen by the cost
// model as a plan::ModelShape.
#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/backend/cpu/gemm.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/plan/cost.hpp"
#include "subprocess.hpp"
#include "train_gpt_options.hpp"

using namespace llmpar;
using train_gpt::Options;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

// The model train_gpt builds from the options (a GPT-2 or a Llama), as the cost model
// sees it, and its sequence length.
plan::ModelShape model_shape(const Options& o) {
  if (train_gpt::is_llama(o)) return train_gpt::llama_config(o);
  return train_gpt::model_config(o);
}
std::int64_t sequence_of(const Options& o) {
  if (train_gpt::is_llama(o)) return train_gpt::sequence_length(o, train_gpt::base_config<models::LlamaConfig>(o));
  return train_gpt::sequence_length(o, train_gpt::base_config<models::GPT2Config>(o));
}

// The tensor-parallel splits the model's layers make at construction (heads, kv heads,
// the MLP's hidden units, the padded vocabulary), checked here so that a layout is
// refused before it is listed.
void check_splits(const plan::ModelShape& cfg, int tp) {
  LLMPAR_CHECK(cfg.heads % tp == 0 && cfg.kv_heads % tp == 0, "--tp ", tp, " does not divide the model's ", cfg.heads,
               " heads", cfg.kv_heads != cfg.heads ? " and " + std::to_string(cfg.kv_heads) + " kv heads" : "");
  LLMPAR_CHECK(cfg.hidden % tp == 0, "--tp ", tp, " does not divide the model's ", cfg.hidden, " MLP hidden units");
  LLMPAR_CHECK(cfg.padded_vocab % tp == 0, "--tp ", tp, " does not divide the padded vocabulary ", cfg.padded_vocab);
}

// The planner's layout of train_gpt options at `world` ranks: train_gpt's own checks and
// its layout (parallel::LayoutConfig), and the model's tensor-parallel splits.
parallel::LayoutConfig planned_layout(const Options& o, int world) {
  train_gpt::validate(o, world);
  check_splits(model_shape(o), o.tp);
  return train_gpt::layout_of(o, world);
}

// An error's message without the file:line it was raised at and the failed check's
// expression: for a message quoted inside another.
std::string message_of(const std::exception& e) {
  std::string m = e.what();
  if (const auto* error = dynamic_cast<const Error*>(&e)) {
    const std::string at = llmpar::detail::concat(error->file(), ":", error->line(), ": ");
    if (m.starts_with(at)) m.erase(0, at.size());
    if (const auto check = m.rfind(" [check failed: "); check != std::string::npos) m.erase(check);
  }
  return m;
}

// The options of one rank without parallelism, and `cp` context-parallel ranks: what
// train_gpt's checks say of them is what they say of the model flags (and of context
// parallelism on this backend), before any layout is searched.
Options one_replica(const Options& o, int cp = 1) {
  Options one = o;
  one.tp = 1;
  one.sp = false;
  one.cp = cp;
  one.pp = 1;
  one.schedule = "1f1b";
  one.virtual_stages = 1;
  one.zero = 0;
  one.batch = 1;
  one.grad_accum.reset();
  one.global_batch.reset();
  one.recompute = "none";
  return one;
}

// train_gpt's flags for the model and layout of `o` (those that differ from its defaults).
std::vector<std::string> flags_of(const Options& o) {
  std::vector<std::string> f;
  auto add = [&](std::string flag, auto value) {
    f.push_back(std::move(flag));
    if constexpr (std::is_convertible_v<decltype(value), std::string>) {
      f.emplace_back(value);
    } else if constexpr (std::is_floating_point_v<decltype(value)>) {
      std::ostringstream s;  // enough digits to read back as the same float
      s << std::setprecision(std::numeric_limits<decltype(value)>::max_digits10) << value;
      f.push_back(s.str());
    } else {
      f.push_back(std::to_string(value));
    }
  };
  if (o.backend != "cpu") add("--backend", o.backend);
  add("--model", o.model);
  if (o.layers) add("--layers", *o.layers);
  if (o.heads) add("--heads", *o.heads);
  if (o.kv_heads) add("--kv-heads", *o.kv_heads);
  if (o.dim) add("--dim", *o.dim);
  if (o.ffn_dim) add("--ffn-dim", *o.ffn_dim);
  if (o.rope_theta) add("--rope-theta", *o.rope_theta);
  if (o.vocab) add("--vocab", *o.vocab);
  if (o.init_std) add("--init-std", *o.init_std);
  if (o.seq) add("--seq", *o.seq);
  if (o.tp > 1) add("--tp", o.tp);
  if (o.sp) f.emplace_back("--sp");
  if (o.cp > 1) add("--cp", o.cp);
  if (o.cp > 1 && o.cp_comm != "ring") add("--cp-comm", o.cp_comm);
  if (o.pp > 1) add("--pp", o.pp);
  if (o.pp > 1) add("--schedule", o.schedule);
  if (o.virtual_stages > 1) add("--virtual-stages", o.virtual_stages);
  if (o.zero > 0) add("--zero", o.zero);
  add("--batch", o.batch);
  if (o.global_batch)
    add("--global-batch", *o.global_batch);
  else if (o.grad_accum)
    add("--grad-accum", *o.grad_accum);
  if (o.precision != "fp32") add("--precision", o.precision);
  if (o.recompute != "none") add("--recompute", o.recompute);
  if (o.sample_tokens) add("--sample-tokens", *o.sample_tokens);
  return f;
}

// The command that runs a layout: train_gpt's flags, under mpirun on GPUs.
std::string command_line(const Options& o, int world, const plan::Cluster& c) {
  std::string s = c.shared_node ? "train_gpt" : "mpirun -np " + std::to_string(world) + " train_gpt";
  if (c.shared_node && world > 1) s += " --ranks " + std::to_string(world);
  for (const std::string& f : flags_of(o)) s += " " + f;
  return s;
}

std::string describe(const Options& o, int world) {
  std::ostringstream s;
  s << "tp " << o.tp << (o.sp ? " sp" : "")
    << (o.cp > 1 ? " cp " + std::to_string(o.cp) + (o.cp_comm != "ring" ? " " + o.cp_comm : "") : "") << " pp " << o.pp;
  if (o.pp > 1) s << " " << o.schedule << (o.virtual_stages > 1 ? " v" + std::to_string(o.virtual_stages) : "");
  s << " dp " << train_gpt::data_parallel_degree(o, world) << " z" << o.zero << " mb " << o.batch << " x"
    << train_gpt::accumulation_steps(o, world) << " " << o.precision;
  if (o.recompute != "none") s << " rc " << o.recompute;
  return s.str();
}

// ---- the search: every layout of the cluster's devices that train_gpt accepts.

struct Candidate {
  Options options;
  plan::Estimate estimate;
};

// Every layout of `world` ranks with the degrees plan::degree_choices gives (fixed_cp:
// --cp, or none to try every cp that cuts the sequence) that train_gpt accepts, ranked;
// context parallelism by ring and by all-to-all, or only by base.cp_comm when
// fixed_cp_comm (--cp-comm).
// Context parallelism is searched only where train_gpt runs it on the cluster's
// backend; `cp_note` then says why not.
std::vector<Candidate> search(const Options& base, int world, const plan::Cluster& c, std::optional<int> fixed_cp,
                              bool fixed_cp_comm, std::size_t* refused, std::string* cp_note) {
  std::vector<Candidate> out;
  const plan::ModelShape cfg = model_shape(base);
  const std::int64_t seq = sequence_of(base);
  std::vector<plan::Degrees> degrees = plan::degree_choices(c, world, seq, fixed_cp);
  int smallest_cp = 0;
  for (const plan::Degrees& d : degrees)
    if (d.cp > 1 && (smallest_cp == 0 || d.cp < smallest_cp)) smallest_cp = d.cp;
  if (smallest_cp > 1) {
    try {
      train_gpt::validate(one_replica(base, smallest_cp), smallest_cp);
    } catch (const std::exception& e) {
      LLMPAR_CHECK(!fixed_cp, "--cp ", *fixed_cp, " cannot run on ", c.name, ", whose layouts train_gpt runs with ",
                   "--backend ", base.backend, ": ", message_of(e));
      *cp_note = message_of(e);
      std::erase_if(degrees, [](const plan::Degrees& d) { return d.cp > 1; });
    }
  }
  *refused = 0;
  const std::vector<std::string> one_way{base.cp_comm}, both_ways{"ring", "a2a"};
  for (const plan::Degrees& d : degrees)
    for (const std::string& cp_comm : d.cp > 1 && !fixed_cp_comm ? both_ways : one_way)
      for (int sp = 0; sp <= (d.tp > 1 ? 1 : 0); ++sp)
        for (const char* schedule : {"1f1b", "interleaved", "zb"}) {
          if (d.pp == 1 && std::string(schedule) != "1f1b") continue;
          for (int zero = 0; zero <= 3; ++zero)
            for (std::int64_t mb : {1, 2, 4, 8, 16, 32})
              for (const char* rc : {"none", "selective", "full"}) {
                Options o = base;
                o.tp = d.tp;
                o.sp = sp == 1;
                o.cp = d.cp;
                o.cp_comm = cp_comm;
                o.pp = d.pp;
                o.schedule = schedule;
                o.virtual_stages = std::string(schedule) == "interleaved" ? 2 : 1;
                o.zero = zero;
                o.batch = mb;
                o.recompute = rc;
                if (d.pp > 1) o.sample_tokens = 0;
                try {
                  const parallel::LayoutConfig l = planned_layout(o, world);
                  out.push_back({o, plan::estimate(cfg, seq, l, c)});
                } catch (const std::exception&) {
                  ++*refused;
                }
              }
        }
  std::stable_sort(out.begin(), out.end(),
                   [](const Candidate& a, const Candidate& b) { return plan::listed_before(a.estimate, b.estimate); });
  return out;
}

void print_breakdown(const Options& o, int world, const plan::Cluster& c) {
  const plan::ModelShape cfg = model_shape(o);
  const std::int64_t seq = sequence_of(o);
  const parallel::LayoutConfig l = planned_layout(o, world);
  const plan::Estimate e = plan::estimate(cfg, seq, l, c);
  const plan::Memory& m = e.memory;
  const plan::Time& t = e.time;
  std::printf("layout: %s on %s (%d rank%s)\n", describe(o, world).c_str(), c.name.c_str(), world,
              world == 1 ? "" : "s");
  std::printf("memory per rank (pipeline rank %d, the most loaded):\n", e.memory_stage);
  for (const auto& [what, bytes] :
       {std::pair{"parameters", m.parameters}, std::pair{"gradients", m.gradients}, std::pair{"optimizer", m.optimizer},
        std::pair{"activations", m.activations}, std::pair{"workspace", m.workspace},
        std::pair{"communication", m.communication}, std::pair{"reserved", m.reserved}})
    std::printf("  %-14s %10.2f MiB\n", what, bytes / kMiB);
  std::printf("  %-14s %10.2f MiB (%.2f GiB)%s\n", "total", m.total() / kMiB, m.total() / kGiB,
              e.fits ? "" : (" - does not fit: " + e.why).c_str());
  std::printf("time per step:\n");
  for (const auto& [what, s] :
       {std::pair{"compute", t.compute}, std::pair{"  of it tp comm", t.tensor_comm},
        std::pair{"  of it cp comm", t.context_comm}, std::pair{"  of it pp comm", t.pipeline_comm},
        std::pair{"bubble", t.bubble}, std::pair{"dp comm", t.data_comm}, std::pair{"optimizer", t.optimizer},
        std::pair{"step", t.step}})
    std::printf("  %-14s %10.3f ms\n", what, s * 1e3);
  std::printf("  MFU %.1f%%, %.0f tokens/s\n", 100.0 * t.mfu, static_cast<double>(l.global_batch() * seq) / t.step);
  std::printf("command: %s\n", command_line(o, world, c).c_str());
}

// ---- --calibrate: this machine as a cluster of thread ranks.

// The median time of `body` over at least 5 calls and `seconds` of calls, after `warm`
// seconds of warm-up: what a training step sees of a kernel it calls among others, not
// the best time, which a kernel reaches only with its data hot and nothing beside it.
template <class Body>
double typical_seconds(Body&& body, double warm, double seconds) {
  using clock = std::chrono::steady_clock;
  const auto since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
  body();
  for (const auto t = clock::now(); since(t) < warm;) body();
  std::vector<double> times;
  for (const auto start = clock::now(); times.size() < 5 || since(start) < seconds;) {
    const auto t0 = clock::now();
    body();
    times.push_back(since(t0));
  }
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
  return times[times.size() / 2];
}

template <class T>
plan::Gemm measure_gemm_curve(backend::cpu::Context& ctx, const char* name) {
  // Products as a training step has them: tall ones (2048 rows, d wide, d deep: narrow
  // layers, tensor-parallel slices) and short ones (d rows of 1024 wide and deep: small
  // micro-batches, whose row count B·T is the small dimension, forward and in the
  // weight gradients' reduction).
  const std::vector<std::int64_t> sizes{32, 64, 128, 256, 512, 1024};
  constexpr std::int64_t kLong = 2048, kShort = 1024;
  const std::int64_t most = kLong * sizes.back();
  Buffer<T> a(most), b(most), out(most);
  for (std::int64_t i = 0; i < most; ++i) {
    a[i] = static_cast<T>(static_cast<float>(i % 7 + 1) * 0.01f);
    b[i] = static_cast<T>(static_cast<float>(i % 5 + 1) * 0.01f);
  }
  std::vector<double> size, achieved;
  auto measure = [&](std::int64_t m, std::int64_t n, std::int64_t k) {
    auto run = [&] { ctx.gemm<T, T>(out.data(), a.data(), b.data(), nullptr, m, n, k, {}); };
    const double typical = typical_seconds(run, 0.05, 0.1);
    const double flops = 2.0 * static_cast<double>(m * n * k) / typical;
    std::printf("  %s GEMM %lldx%lldx%lld: %8.1f GFLOP/s\n", name, static_cast<long long>(m), static_cast<long long>(n),
                static_cast<long long>(k), flops * 1e-9);
    size.push_back(static_cast<double>(std::min({m, n, k})));
    achieved.push_back(flops);
  };
  for (std::int64_t d : sizes) measure(kLong, d, d);
  for (std::int64_t d : sizes)
    if (d < kShort) measure(d, kShort, kShort);
  // peak · d / (d + half): the peak is the fastest size's; half is the median over the
  // smaller sizes of the half size each implies, d · (peak / achieved − 1) (robust to a
  // size that runs out of cache or is disturbed).
  const double peak = *std::max_element(achieved.begin(), achieved.end());
  std::vector<double> halves;
  for (std::size_t i = 0; i < size.size(); ++i)
    if (achieved[i] < peak) halves.push_back(size[i] * (peak / achieved[i] - 1.0));
  std::sort(halves.begin(), halves.end());
  const plan::Gemm g{peak, halves.empty() ? 0.0 : halves[halves.size() / 2]};
  std::printf("  %s curve: peak %.1f GFLOP/s, half size %.0f\n", name, g.peak_flops * 1e-9, g.half);
  return g;
}

// The element-wise kernels (GELU, LayerNorm, a residual add: the bytes they read and
// write per second) and the attention core (causal FLOPs per second, forward and
// backward) in storage type T, on activations of a small model's micro-batch.
template <class T>
plan::Kernels measure_kernels(backend::cpu::Context& ctx, const char* name) {
  using B = backend::Cpu;
  constexpr std::int64_t kB = 8, kT = 128, kC = 256, kHeads = 8, rows = kB * kT, n = rows * kC;
  Buffer<T> x(3 * n), y(3 * n), w(kC), bias(kC), dqkv(3 * n);
  Buffer<float> mean(rows), rstd(rows), lse(kB * kHeads * kT);
  for (std::int64_t i = 0; i < 3 * n; ++i) x[i] = static_cast<T>(0.01f * static_cast<float>(i % 17));
  for (std::int64_t i = 0; i < kC; ++i) {
    w[i] = static_cast<T>(1.0f);
    bias[i] = static_cast<T>(0.0f);
  }
  auto typical_of = [](auto&& body) { return typical_seconds(body, 0.0, 0.2); };
  const double elementwise = typical_of([&] {
    B::gelu_forward(ctx, y.data(), x.data(), n);
    B::layernorm_forward(ctx, y.data() + n, mean.data(), rstd.data(), x.data(), w.data(), bias.data(), rows, kC, 1e-5f);
    B::add_inplace(ctx, y.data() + 2 * n, x.data(), n);
  });
  const double attention = typical_of([&] {
    B::attention_forward(ctx, y.data(), lse.data(), x.data(), AttentionShape::mha(kB, kT, kC, kHeads));
    B::attention_backward(ctx, dqkv.data(), y.data(), x.data(), y.data(), lse.data(),
                          AttentionShape::mha(kB, kT, kC, kHeads));
  });
  // GELU reads and writes n, LayerNorm the same, the add reads 2n and writes n.
  const double bytes = 7.0 * static_cast<double>(n) * sizeof(T);
  // Forward 2·B·NH·T²·d causal FLOPs (half of 4·B·NH·T²·d), backward 2.5 times that.
  const double flops = 3.5 * 2.0 * kB * kT * kT * kC;
  const plan::Kernels k{bytes / elementwise, flops / attention};
  std::printf("  %s kernels: element-wise %.1f GB/s, attention %.1f GFLOP/s\n", name, k.elementwise * 1e-9,
              k.attention * 1e-9);
  return k;
}

// What a call costs beyond its work: a kernel on 256 elements, a GEMM of 8x8x8, each
// the best of many; and the throughput of twice as many single-thread ranks as cores
// against one per core (thread ranks on a shared node take turns).
struct CallCosts {
  double kernel = 0.0, gemm = 0.0, shared_ranks = 1.0, oversubscribed = 1.0;
};

CallCosts measure_call_costs(backend::cpu::Context& ctx, int cores) {
  using clock = std::chrono::steady_clock;
  auto per_call = [](auto&& body) {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = clock::now();
      for (int i = 0; i < 2000; ++i) body();
      best = std::min(best, std::chrono::duration<double>(clock::now() - t0).count() / 2000);
    }
    return best;
  };
  Buffer<float> a(256), b(256), c(256);
  a.zero();
  b.zero();
  CallCosts k;
  k.kernel = per_call([&] { backend::Cpu::add_inplace(ctx, a.data(), b.data(), 256); });
  k.gemm = per_call([&] { ctx.gemm<float, float>(c.data(), a.data(), b.data(), nullptr, 8, 8, 8, {}); });
  // Ranks of one thread each (or one rank of `threads`), busy with GEMMs of a small
  // layer's size and meeting after each, as ranks meet at their
  // collectives: the work done in a fixed time.
  auto throughput = [&](int ranks, int threads) {
    double flops = 0.0;
    std::mutex m;
    comm::run_threads(ranks,
                      [&](comm::ThreadComm& world) {
                        backend::cpu::Context mine;
                        constexpr std::int64_t d = 256;
                        Buffer<float> x(4 * d * d), y(d * d), z(4 * d * d);
                        x.zero();
                        y.zero();
                        world.barrier();
                        const auto t0 = clock::now();
                        double done = 0.0;
                        bool more = true;
                        while (more) {
                          mine.gemm<float, float>(z.data(), x.data(), y.data(), nullptr, 4 * d, d, d, {});
                          done += 2.0 * 4 * d * d * d;
                          // The meeting: rank 0's word on whether time is up, so all leave together.
                          float stop =
                              world.rank() == 0 && std::chrono::duration<double>(clock::now() - t0).count() > 0.4;
                          world.broadcast(std::span<float>(&stop, 1), 0);
                          more = stop == 0.0f;
                        }
                        std::lock_guard lock(m);
                        flops += done;
                      },
                      {.omp_threads_per_rank = threads});
    return flops;
  };
  const double one_rank = throughput(1, cores), per_core = throughput(cores, 1);
  k.shared_ranks = std::clamp(per_core / one_rank, 0.05, 2.0);
  k.oversubscribed = std::clamp(throughput(2 * cores, 1) / per_core, 0.05, 1.0);
  std::printf(
      "  call costs: a kernel %.1f us, a GEMM %.1f us; %d ranks of a thread run at %.2f of 1 rank of %d; %d ranks at "
      "%.2f of %d\n",
      k.kernel * 1e6, k.gemm * 1e6, cores, k.shared_ranks, cores, 2 * cores, k.oversubscribed, cores);
  return k;
}

double measure_bandwidth() {
  using clock = std::chrono::steady_clock;
  const std::int64_t n = std::int64_t{1} << 24;  // 64 MiB per array
  Buffer<float> a(n), b(n), c(n);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    b[i] = 1.0f;
    c[i] = 2.0f;
    a[i] = 0.0f;
  }
  double best = 1e30;
  for (int r = 0; r < 8; ++r) {
    const auto t0 = clock::now();
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
    best = std::min(best, std::chrono::duration<double>(clock::now() - t0).count());
  }
  const double bw = 3.0 * static_cast<double>(n) * sizeof(float) / best;
  std::printf("  memory bandwidth (triad, %d threads): %.1f GB/s\n", omp_get_max_threads(), bw * 1e-9);
  return bw;
}

// The thread communicator as training uses it: the busbw of a large all-reduce; the
// latency a ring step adds to a collective the ranks reach from compute (one GEMM
// each, then a small all-reduce: the wake-ups and uneven arrival, which a tight loop
// of collectives never sees); and what a collective issued by a communication thread
// costs the compute running beside it.
struct CommCalibration {
  plan::Link link;
  double collective_overhead = 0.0;
};

CommCalibration measure_thread_comm(int ranks) {
  using clock = std::chrono::steady_clock;
  auto since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
  const std::size_t n = std::size_t{1} << 21;  // 8 MiB of f32
  constexpr int kRounds = 40;
  constexpr std::int64_t kDim = 192;  // a GEMM of ~0.1-1 ms per rank
  double big = 1e30, sync_cost = 0.0, async_cost = 0.0;
  comm::run_threads(ranks, [&](comm::ThreadComm& world) {
    std::vector<float> data(n, 1.0f), small(1024, 1.0f);
    backend::cpu::Context ctx;
    Buffer<float> a(kDim * kDim), b(kDim * kDim), c(kDim * kDim);
    a.zero();
    b.zero();
    auto compute = [&] { ctx.gemm<float, float>(c.data(), a.data(), b.data(), nullptr, kDim, kDim, kDim, {}); };
    for (int r = 0; r < 6; ++r) {
      world.barrier();
      const auto t0 = clock::now();
      world.all_reduce(std::span<float>(data), comm::ReduceOp::sum);
      const double t = since(t0);
      if (world.rank() == 0) big = std::min(big, t);
    }
    // Compute alone, then compute with a small all-reduce after each GEMM.
    auto timed = [&](auto&& body) {
      double best = 1e30;
      for (int r = 0; r < 3; ++r) {
        world.barrier();
        const auto t0 = clock::now();
        for (int i = 0; i < kRounds; ++i) body();
        world.barrier();
        best = std::min(best, since(t0));
      }
      return best;
    };
    const double alone = timed(compute);
    const double with_sync = timed([&] {
      compute();
      world.all_reduce(std::span<float>(small), comm::ReduceOp::sum);
    });
    // Compute while a communication thread all-reduces a bucket per GEMM.
    comm::ThreadComm dup = world.split(0, world.rank(), "calibration");
    std::vector<float> bucket(std::size_t{1} << 16, 1.0f);
    double with_async = 1e30;
    for (int r = 0; r < 3; ++r) {
      world.barrier();
      const auto t0 = clock::now();
      std::thread comm_thread([&] {
        for (int i = 0; i < kRounds; ++i) dup.all_reduce(std::span<float>(bucket), comm::ReduceOp::sum);
      });
      for (int i = 0; i < kRounds; ++i) compute();
      comm_thread.join();
      world.barrier();
      with_async = std::min(with_async, since(t0));
    }
    if (world.rank() == 0) {
      sync_cost = std::max(0.0, (with_sync - alone) / kRounds);
      async_cost = std::max(0.0, (with_async - alone) / kRounds);
    }
  });
  CommCalibration out;
  out.link.busbw = static_cast<double>(n * sizeof(float)) * comm::bus_factor(comm::Collective::all_reduce, ranks) / big;
  out.link.latency = sync_cost / (2.0 * (ranks - 1));
  out.collective_overhead = async_cost;
  std::printf(
      "  thread communicator, %d ranks: all-reduce busbw %.1f GB/s; a collective between GEMMs adds %.1f us "
      "(%.1f us per ring step); one on a communication thread costs the compute %.1f us\n",
      ranks, out.link.busbw * 1e-9, sync_cost * 1e6, out.link.latency * 1e6, async_cost * 1e6);
  return out;
}

// One pass of every measurement.
plan::Cluster calibration_pass() {
  plan::Cluster c;
  const int cores = omp_get_max_threads();
  char host[256] = "cpu";
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) {
      const std::string name = line.substr(line.find(':') + 2);
      std::snprintf(host, sizeof host, "%s", name.c_str());
      break;
    }
  c.name = std::string("cpu: ") + host + ", " + std::to_string(cores) + " threads";
  c.nodes = 1;
  c.devices_per_node = cores;
  c.memory_bytes = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  c.reserved_bytes = 0.0;
  c.shared_node = true;
  c.overlap = 0.0;
  std::printf("calibrating %s\n", c.name.c_str());
  backend::cpu::Context ctx;
  c.fp32 = measure_gemm_curve<float>(ctx, "fp32");
  c.bf16 = measure_gemm_curve<bf16>(ctx, "bf16");
  c.fp16 = measure_gemm_curve<f16>(ctx, "fp16");
  c.fp32_kernels = measure_kernels<float>(ctx, "fp32");
  c.bf16_kernels = measure_kernels<bf16>(ctx, "bf16");
  c.fp16_kernels = measure_kernels<f16>(ctx, "fp16");
  c.memory_bandwidth = measure_bandwidth();
  const CallCosts calls = measure_call_costs(ctx, cores);
  c.kernel_overhead = calls.kernel;
  c.gemm_overhead = calls.gemm;
  c.shared_ranks = calls.shared_ranks;
  c.oversubscribed = calls.oversubscribed;
  const CommCalibration comm = measure_thread_comm(std::max(2, cores));
  c.intra = comm.link;
  c.inter = comm.link;
  c.collective_overhead = comm.collective_overhead;
  return c;
}

// The calibration: every figure the median of kCalibrationPasses passes. One pass's
// figures move by several percent from pass to pass (the ranks' fractions and the call
// costs most), enough to reorder layouts whose predicted times are that close.
constexpr int kCalibrationPasses = 3;

plan::Cluster calibrate() {
  std::vector<plan::Cluster> passes;
  for (int p = 0; p < kCalibrationPasses; ++p) {
    std::printf("pass %d/%d\n", p + 1, kCalibrationPasses);
    passes.push_back(calibration_pass());
  }
  std::vector<std::vector<double>> figures(passes.size());
  for (std::size_t p = 0; p < passes.size(); ++p)
    plan::Cluster::for_each_figure(passes[p], [&](const std::string&, double v, bool) { figures[p].push_back(v); });
  plan::Cluster c = passes.front();
  std::size_t i = 0;
  plan::Cluster::for_each_figure(c, [&](const std::string&, double& v, bool) {
    std::vector<double> values;
    for (const std::vector<double>& pass : figures) values.push_back(pass[i]);
    std::sort(values.begin(), values.end());
    v = values[values.size() / 2];
    ++i;
  });
  c.validate();
  std::printf("the median of %d passes: fp32 GEMM peak %.1f GFLOP/s, shared ranks %.3f, oversubscribed %.3f\n",
              kCalibrationPasses, c.fp32.peak_flops * 1e-9, c.shared_ranks, c.oversubscribed);
  return c;
}

// ---- --validate: the grid, run with train_gpt on thread ranks.

struct Measured {
  double parameters = 0, gradients = 0, optimizer = 0, activations = 0, buffers = 0;
  double step_ms = 0;
  double total() const { return parameters + gradients + optimizer + activations + buffers; }
};

Measured read_metrics(const std::string& path) {
  Measured m;
  std::ifstream in(path);
  LLMPAR_CHECK(in.good(), "cannot read train_gpt's metrics ", path);
  std::vector<double> ms;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    const std::string type = j.value("type", "");
    if (type == "memory" && j.value("when", "") == "after step 1") {
      m.parameters = j.at("parameters").get<double>();
      m.gradients = j.at("gradients").get<double>();
      m.optimizer = j.at("optimizer").get<double>();
      m.activations = j.at("activations").get<double>();
      m.buffers = j.at("buffers").get<double>();
    }
    if (type == "step" && j.at("step").get<int>() > 2) ms.push_back(j.at("ms").get<double>());
  }
  LLMPAR_CHECK(!ms.empty(), "train_gpt's metrics ", path, " hold no step after step 2");
  std::sort(ms.begin(), ms.end());
  m.step_ms = ms[ms.size() / 2];
  return m;
}

// Spearman's rank correlation (ties get their mean rank).
double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  auto ranks = [](const std::vector<double>& v) {
    std::vector<std::size_t> idx(v.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](std::size_t x, std::size_t y) { return v[x] < v[y]; });
    std::vector<double> r(v.size());
    for (std::size_t i = 0; i < idx.size();) {
      std::size_t j = i;
      while (j + 1 < idx.size() && v[idx[j + 1]] == v[idx[i]]) ++j;
      for (std::size_t k = i; k <= j; ++k) r[idx[k]] = 0.5 * static_cast<double>(i + j);
      i = j + 1;
    }
    return r;
  };
  const auto ra = ranks(a), rb = ranks(b);
  const double n = static_cast<double>(a.size());
  const double ma = std::accumulate(ra.begin(), ra.end(), 0.0) / n, mb = std::accumulate(rb.begin(), rb.end(), 0.0) / n;
  double sab = 0, saa = 0, sbb = 0;
  for (std::size_t i = 0; i < ra.size(); ++i) {
    sab += (ra[i] - ma) * (rb[i] - mb);
    saa += (ra[i] - ma) * (ra[i] - ma);
    sbb += (rb[i] - mb) * (rb[i] - mb);
  }
  return sab / std::sqrt(saa * sbb);
}

// One layout of the validation grid.
struct GridPoint {
  int ranks = 1;
  int tp = 1, pp = 1, virtual_stages = 1, zero = 0;
  bool sp = false;
  std::int64_t batch = 8, grad_accum = 1;
  const char* schedule = "1f1b";
  const char* precision = "fp32";
  const char* recompute = "none";

  Options options(Options o) const {
    o.tp = tp;
    o.sp = sp;
    o.pp = pp;
    o.schedule = schedule;
    o.virtual_stages = virtual_stages;
    o.zero = zero;
    o.batch = batch;
    o.grad_accum = grad_accum;
    o.precision = precision;
    o.recompute = recompute;
    return o;
  }
};

// Layouts of the validation grid: every parallelism, ZeRO stage, schedule, precision and
// recomputation mode, at one global batch of 8 sequences (32 layouts).
std::vector<GridPoint> validation_grid(bool quick) {
  std::vector<GridPoint> g{
      {.ranks = 1},
      {.ranks = 1, .batch = 4, .grad_accum = 2},
      {.ranks = 1, .precision = "bf16"},
      {.ranks = 1, .precision = "fp16"},
      {.ranks = 1, .recompute = "selective"},
      {.ranks = 1, .recompute = "full"},
      {.ranks = 2, .batch = 4},
      {.ranks = 2, .zero = 1, .batch = 4},
      {.ranks = 2, .zero = 2, .batch = 4},
      {.ranks = 2, .zero = 3, .batch = 4},
      {.ranks = 2, .zero = 3, .batch = 4, .precision = "bf16"},
      {.ranks = 2, .tp = 2},
      {.ranks = 2, .tp = 2, .sp = true},
      {.ranks = 2, .tp = 2, .sp = true, .precision = "bf16"},
      {.ranks = 2, .tp = 2, .recompute = "full"},
      {.ranks = 2, .pp = 2, .batch = 2, .grad_accum = 4},
      {.ranks = 2, .pp = 2, .batch = 2, .grad_accum = 4, .schedule = "gpipe"},
      {.ranks = 2, .pp = 2, .batch = 2, .grad_accum = 4, .schedule = "zb"},
      {.ranks = 2, .pp = 2, .virtual_stages = 2, .batch = 2, .grad_accum = 4, .schedule = "interleaved"},
      {.ranks = 2, .pp = 2, .batch = 1, .grad_accum = 8},
      {.ranks = 4, .tp = 2, .batch = 4},
      {.ranks = 4, .pp = 2, .zero = 1, .batch = 2, .grad_accum = 2},
      {.ranks = 4, .tp = 2, .pp = 2, .batch = 4, .grad_accum = 2},
      {.ranks = 4, .zero = 1, .batch = 2},
      {.ranks = 1, .batch = 1, .grad_accum = 8},
      {.ranks = 2, .pp = 2, .batch = 4, .grad_accum = 2, .schedule = "gpipe"},
      {.ranks = 2, .zero = 3, .batch = 1, .grad_accum = 4},
      // Layouts a planner must tell apart from the rest by more than the machine's
      // drift: a pipeline with one micro-batch (half of it idle), ZeRO 3 over four
      // ranks, 16-bit with full recomputation, ZeRO 2 reducing every micro-batch.
      {.ranks = 2, .pp = 2, .batch = 8, .grad_accum = 1},
      {.ranks = 2, .pp = 2, .batch = 4, .grad_accum = 2},
      {.ranks = 4, .zero = 3, .batch = 2},
      {.ranks = 1, .precision = "bf16", .recompute = "full"},
      {.ranks = 2, .zero = 2, .batch = 1, .grad_accum = 4},
  };
  if (quick) g = {g[0], g[3], g[5], g[8], g[9], g[12], g[17], g[18]};
  return g;
}

// A layout's measurements in the --measurements file: one JSON line per run.
std::string measurement_key(int ranks, const std::string& layout, std::int64_t steps) {
  return std::to_string(ranks) + " | " + layout + " | " + std::to_string(steps);
}

nlohmann::json to_json(const Measured& m) {
  return {{"parameters", m.parameters},   {"gradients", m.gradients}, {"optimizer", m.optimizer},
          {"activations", m.activations}, {"buffers", m.buffers},     {"step_ms", m.step_ms}};
}

Measured measured_of(const nlohmann::json& j) {
  return {.parameters = j.at("parameters"),
          .gradients = j.at("gradients"),
          .optimizer = j.at("optimizer"),
          .activations = j.at("activations"),
          .buffers = j.at("buffers"),
          .step_ms = j.at("step_ms")};
}

int validate(const std::string& exe, const plan::Cluster& c, const std::string& out_path,
             const std::string& measurements_path, bool quick, const Options& model, std::int64_t steps, int repeats,
             double tolerance) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("llmpar-plan-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const double peak_gflops = c.fp32.peak_flops * 1e-9;
  const std::vector<GridPoint> grid = validation_grid(quick);

  // Runs kept from earlier passes (--measurements): a grid run again with a changed
  // model or cluster file only trains what it does not have yet.
  std::map<std::string, std::vector<Measured>> runs;
  if (!measurements_path.empty()) {
    std::ifstream in(measurements_path);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("key")) runs[j.at("key").get<std::string>()].push_back(measured_of(j));
    }
  }
  // The machine's speed drifts (a shared VM: the same layout's step time varied by
  // 40% between passes a few minutes apart), so the grid runs `repeats` passes, each
  // layout once per pass (drift then touches every layout alike), and each layout keeps
  // its fastest median step.
  int failures = 0;
  std::vector<bool> failed(grid.size(), false);
  for (int pass = 0; pass < repeats; ++pass)
    for (std::size_t i = 0; i < grid.size(); ++i) {
      const Options o = grid[i].options(model);
      const int ranks = grid[i].ranks;
      const std::string key = measurement_key(ranks, describe(o, ranks), steps);
      if (failed[i] || static_cast<int>(runs[key].size()) > pass) continue;
      const std::string metrics = (dir / ("run" + std::to_string(i) + ".jsonl")).string();
      const std::string log = (dir / ("run" + std::to_string(i) + ".log")).string();
      std::vector<std::string> args{"--ranks", std::to_string(ranks)};
      for (const std::string& f : flags_of(o)) args.push_back(f);
      for (const std::string& a :
           {std::string("--steps"), std::to_string(steps), std::string("--eval-every"), std::string("0"),
            std::string("--sample-tokens"), std::string("0"), std::string("--peak-gflops"), std::to_string(peak_gflops),
            std::string("--metrics"), metrics})
        args.push_back(a);
      std::printf("pass %d/%d, run %2zu/%zu: --ranks %d %s ... ", pass + 1, repeats, i + 1, grid.size(), ranks,
                  describe(o, ranks).c_str());
      std::fflush(stdout);
      if (!tools::run_program(exe, args, log)) {
        std::printf("train_gpt failed (%s)\n", log.c_str());
        failed[i] = true;
        ++failures;
        continue;
      }
      const Measured once = read_metrics(metrics);
      std::printf("%.1f ms\n", once.step_ms);
      runs[key].push_back(once);
      if (!measurements_path.empty()) {
        nlohmann::json j = to_json(once);
        j["key"] = key;
        std::ofstream(measurements_path, std::ios::app) << j.dump() << "\n";
      }
    }

  std::vector<double> predicted_ms, measured_ms;
  std::ostringstream table;
  table << "| ranks | layout | predicted MiB | measured MiB | error | params | grads | optim | act+ws | buffers | "
           "predicted ms | measured ms |\n";
  table << "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  double worst = 0.0;
  for (std::size_t i = 0; i < grid.size(); ++i) {
    if (failed[i]) continue;
    const Options o = grid[i].options(model);
    const int ranks = grid[i].ranks;
    const std::vector<Measured>& passes = runs[measurement_key(ranks, describe(o, ranks), steps)];
    Measured m = passes.front();
    for (const Measured& once : passes) m.step_ms = std::min(m.step_ms, once.step_ms);
    const plan::ModelShape cfg = model_shape(o);
    const std::int64_t seq = sequence_of(o);
    const plan::Estimate e = plan::estimate(cfg, seq, planned_layout(o, ranks), c);
    // train_gpt's metrics are rank 0's: the first pipeline stage's memory.
    const plan::Memory pm = plan::rank_memory(cfg, seq, planned_layout(o, ranks), 0, c);
    const double error = pm.measured_total() / m.total() - 1.0;
    worst = std::max(worst, std::abs(error));
    predicted_ms.push_back(e.time.step * 1e3);
    measured_ms.push_back(m.step_ms);
    char row[1024];
    auto pair = [](double predicted, double measured) {
      char s[64];
      std::snprintf(s, sizeof s, "%.2f / %.2f", predicted / kMiB, measured / kMiB);
      return std::string(s);
    };
    std::snprintf(row, sizeof row, "| %d | %s | %.2f | %.2f | %+.1f%% | %s | %s | %s | %s | %s | %.1f | %.1f |\n",
                  ranks, describe(o, ranks).c_str(), pm.measured_total() / kMiB, m.total() / kMiB, 100 * error,
                  pair(pm.parameters, m.parameters).c_str(), pair(pm.gradients, m.gradients).c_str(),
                  pair(pm.optimizer, m.optimizer).c_str(), pair(pm.activations + pm.workspace, m.activations).c_str(),
                  pair(pm.communication, m.buffers).c_str(), e.time.step * 1e3, m.step_ms);
    table << row;
  }
  const double rho = predicted_ms.size() >= 2 ? spearman(predicted_ms, measured_ms) : 0.0;
  std::ostringstream summary;
  summary << "\n"
          << predicted_ms.size() << " layouts ran (" << failures << " failed); the largest memory error "
          << std::round(1000 * worst) / 10 << "% (target " << 100 * tolerance
          << "%); Spearman's rank correlation of predicted and measured step times " << std::round(1000 * rho) / 1000
          << " (target 0.8).\n";
  std::printf("%s%s", table.str().c_str(), summary.str().c_str());
  if (!out_path.empty()) {
    std::ofstream out(out_path);
    out << table.str() << summary.str();
    std::printf("table: %s\n", out_path.c_str());
  }
  std::filesystem::remove_all(dir);
  const bool ok = failures == 0 && worst <= tolerance && (quick || rho >= 0.8);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  o.precision = "";
  std::string cluster_name = "h100x8x1", calibrate_out, validate_out, measurements, train_gpt_exe;
  int ranks = 0, top = 15;
  bool validate_grid = false, quick = false;
  std::int64_t validate_steps = 20;
  int repeats = 2;
  double tolerance = 0.10;
  CLI::App app{"llmpar-plan: predict memory per rank and step time of training layouts (plan/cost.hpp)"};
  train_gpt::add_model_options(app, o);
  app.add_option("--seq", o.seq, "Sequence length (default: the preset's, at most 1024)");
  app.add_option("--cluster", cluster_name, "h100x8xN, h200x8xN, or a file from --calibrate")->capture_default_str();
  app.add_option("--global-batch", o.global_batch, "Sequences per optimizer step (the search keeps it fixed)");
  app.add_option("--precision", o.precision, "fp32, bf16 or fp16 (default: bf16 on GPUs, fp32 on a CPU)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--top", top, "Layouts to list")->capture_default_str();
  app.add_option("--ranks", ranks, "Estimate one layout of this many ranks (with the layout flags below)");
  app.add_option("--tp", o.tp, "One layout: tensor-parallel degree");
  app.add_flag("--sp", o.sp, "One layout: sequence parallelism");
  CLI::Option* cp_flag = app.add_option(
      "--cp", o.cp, "Context-parallel degree: one layout's, or the search's (default: every cp that cuts --seq)");
  CLI::Option* cp_comm_flag =
      app.add_option("--cp-comm", o.cp_comm,
                     "Context parallelism by ring or a2a: one layout's, or the search's (default: both)")
          ->check(CLI::IsMember({"ring", "a2a"}));
  app.add_option("--pp", o.pp, "One layout: pipeline stages");
  app.add_option("--schedule", o.schedule, "One layout: pipeline schedule");
  app.add_option("--virtual-stages", o.virtual_stages, "One layout: chunks per pipeline rank");
  app.add_option("--zero", o.zero, "One layout: ZeRO stage");
  app.add_option("--batch,--micro-batch", o.batch, "One layout: sequences per micro-batch");
  app.add_option("--grad-accum", o.grad_accum, "One layout: micro-batches per step");
  app.add_option("--recompute", o.recompute, "One layout: none, selective, full");
  app.add_option("--calibrate", calibrate_out, "Measure this machine and write its cluster file");
  app.add_flag("--validate", validate_grid, "Run the validation grid with train_gpt and compare");
  app.add_flag("--quick", quick, "--validate: 8 layouts, memory only (the ctest)");
  app.add_option("--steps", validate_steps, "--validate: steps per run")->capture_default_str();
  app.add_option("--repeat", repeats, "--validate: runs per layout (the fastest counts)")->capture_default_str();
  app.add_option("--tolerance", tolerance, "--validate: the largest memory error allowed")->capture_default_str();
  app.add_option("--out", validate_out, "--validate: also write the table (markdown) here");
  app.add_option("--measurements", measurements,
                 "--validate: keep every run's measurement in this JSON-lines file, and reuse those it holds");
  app.add_option("--train-gpt", train_gpt_exe, "--validate: the train_gpt program (default: beside this one)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (!calibrate_out.empty()) {
      const plan::Cluster c = calibrate();
      std::ofstream out(calibrate_out);
      LLMPAR_CHECK(out.good(), "--calibrate ", calibrate_out, ": cannot write the file");
      out << c.to_json().dump(2) << "\n";
      std::printf("cluster: %s\n", calibrate_out.c_str());
      return 0;
    }
    const plan::Cluster c = plan::Cluster::named(cluster_name);
    if (o.precision.empty()) o.precision = c.shared_node ? "fp32" : "bf16";
    o.backend = c.shared_node ? "cpu" : "cuda";
    if (validate_grid) {
      const std::string exe = train_gpt_exe.empty() ? tools::beside_this_program(argv[0], "train_gpt") : train_gpt_exe;
      LLMPAR_CHECK(std::filesystem::exists(exe), "--validate runs train_gpt, but ", exe,
                   " does not exist; build it, or give --train-gpt PATH");
      LLMPAR_CHECK(c.shared_node,
                   "--validate runs thread ranks on this machine: give --cluster the file "
                   "llmpar-plan --calibrate wrote here, not ",
                   c.name);
      // A model whose step takes long enough to time (about 0.1-0.5 s here) and small
      // enough for 24 runs in minutes.
      Options model;
      model.model = "gpt2-tiny";
      model.layers = 4;
      model.heads = 8;
      model.dim = 256;
      model.seq = 128;
      return validate(exe, c, validate_out, measurements, quick, model, validate_steps, quick ? 1 : repeats, tolerance);
    }
    if (!o.seq) {
      const std::int64_t longest = train_gpt::is_llama(o) ? train_gpt::base_config<models::LlamaConfig>(o).max_seq
                                                          : train_gpt::base_config<models::GPT2Config>(o).max_seq;
      o.seq = std::min<std::int64_t>(longest, 1024);
    }
    // The model flags (--model, --kv-heads, --ffn-dim, ...) with train_gpt's checks and
    // messages, before any layout.
    train_gpt::validate(one_replica(o), 1);
    if (ranks > 0) {
      print_breakdown(o, ranks, c);
      return 0;
    }
    LLMPAR_CHECK(o.global_batch.has_value(),
                 "give --global-batch (the search keeps the sequences per step fixed), "
                 "or --ranks N with a layout's flags to estimate one layout");
    const int world = c.shared_node ? c.devices_per_node : c.devices();
    std::size_t refused = 0;
    std::string cp_note;
    const std::vector<Candidate> all =
        search(o, world, c, cp_flag->count() > 0 ? std::optional<int>(o.cp) : std::nullopt, cp_comm_flag->count() > 0,
               &refused, &cp_note);
    const double parameters = static_cast<double>(model_shape(o).parameters);
    std::printf(
        "%s (%.*f%s parameters, seq %lld, global batch %lld) on %s: %zu layouts of %d ranks (%zu refused "
        "by train_gpt's checks)\n",
        o.model.c_str(), parameters < 1e9 ? 1 : 2, parameters < 1e9 ? parameters * 1e-6 : parameters * 1e-9,
        parameters < 1e9 ? "M" : "B", static_cast<long long>(*o.seq), static_cast<long long>(*o.global_batch),
        c.name.c_str(), all.size(), world, refused);
    if (!cp_note.empty()) std::printf("context parallelism not searched: train_gpt says: %s\n", cp_note.c_str());
    LLMPAR_CHECK(!all.empty(), "no layout of ", world, " ranks is valid for this model and global batch");
    std::printf("%4s  %-58s %10s %9s %7s %9s %9s  %s\n", "rank", "layout", "step (s)", "MFU", "bubble", "mem GiB",
                "comm (s)", "");
    int shown = 0;
    std::size_t fitting = 0;
    for (const Candidate& k : all) fitting += k.estimate.fits ? 1 : 0;
    for (const Candidate& k : all) {
      if (shown >= top && k.estimate.fits) continue;
      if (!k.estimate.fits && shown >= top + 5) break;
      const plan::Time& t = k.estimate.time;
      std::printf("%4d  %-58s %10.3f %8.1f%% %6.1f%% %9.2f %9.3f  %s\n", shown + 1, describe(k.options, world).c_str(),
                  t.step, 100 * t.mfu, 100 * t.bubble / t.step, k.estimate.memory.total() / kGiB,
                  t.data_comm + t.tensor_comm + t.context_comm + t.pipeline_comm,
                  k.estimate.fits ? "" : k.estimate.why.c_str());
      ++shown;
    }
    std::printf("%zu of %zu layouts fit in %.0f GiB per device.\n", fitting, all.size(), c.memory_bytes / kGiB);
    if (fitting > 0) {
      std::printf("best: %s\n", command_line(all.front().options, world, c).c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llmpar-plan: error: %s\n", e.what());
    return 1;
  }
}
