// bench_data_parallel — a training step of a small GPT (L=4, H=8, C=512, T=128, 12.6M
// parameters, micro-batch 4 per rank) over 2 data-parallel ranks, for every ZeRO stage,
// with the gradient buckets reduced during backward (overlap:1) and after it
// (overlap:0); and stage 0 over bucket sizes of 1 to 64 MiB (how the default was chosen).
// Counters: ms/step (median of the timed steps), exposed_comm_ms (what the compute
// thread waited for communication: the part overlap did not hide) and its share of the
// step.
//
//   build/benchmarks/bench_data_parallel                      # 2 thread ranks
//   OMP_NUM_THREADS=1 mpirun -np 2 build/benchmarks/bench_data_parallel   # 2 processes
//
// Under mpirun every process runs every benchmark with the same fixed iterations (the
// collectives must match); rank 0 reports. Thread ranks share the process's cores: each
// gets half of its OpenMP threads.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <llmpar/llmpar.hpp>
#include <string>
#include <vector>

#include "rank_reporting.hpp"

#if defined(LLMPAR_WITH_MPI)
#include <llmpar/comm/mpi_comm.hpp>
#endif

using namespace llmpar;

namespace {

constexpr int kSteps = 4;  // timed steps per configuration, after one warm-up step
constexpr int kRanks = 2;

comm::Comm* g_mpi_world = nullptr;  // set when started by mpirun

struct Measured {
  double ms = 0.0, exposed_comm_ms = 0.0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <int kStage>
Measured run_rank(comm::Comm& world, bool overlap, double bucket_mb) {
  using Policy = Compose<backend::Cpu, parallel::Data<zero::Stage<kStage>>>;
  using Model = models::GPT2<float>;
  const models::GPT2Config cfg{.layers = 4, .heads = 8, .dim = 512, .max_seq = 128, .vocab = 256, .padded_vocab = 256};
  comm::Grid grid(world, {});
  backend::cpu::Context ctx;
  Model model(cfg, 1337);
  std::vector<std::uint16_t> tokens(1 << 18);
  const auto stream = rng::Stream::named(1, "bench tokens");
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint16_t>(stream.bits(i)[0] % cfg.vocab);
  const data::TokenDataset dataset = data::TokenDataset::from_tokens(tokens, 256, "bench tokens");
  data::DataLoader loader(dataset,
                          {.batch_size = 4, .seq_len = 128, .rank = grid.dp().rank(), .world = grid.dp().size()});
  parallel::LayoutConfig layout = parallel::layout_of<Policy>();
  layout.fit_world(world.size());
  layout.micro_batch = 4;
  layout.data = {.bucket_bytes = static_cast<std::int64_t>(bucket_mb * (1 << 20)), .overlap = overlap};
  train::Trainer<Model, Policy> trainer(ctx, model, {.lr = 1e-4f},
                                        {.peak_lr = 1e-4f, .warmup_steps = 0, .total_steps = kSteps + 1}, loader,
                                        {.steps = kSteps + 1, .layout = layout}, parallel::Groups::of(grid));
  trainer.step();  // warm-up: buffers, GEMM primitives, the stage-3 gather order
  std::vector<double> ms, comm;
  for (int s = 0; s < kSteps; ++s) {
    const train::StepStats st = trainer.step();
    ms.push_back(st.ms);
    comm.push_back(st.comm_ms);
  }
  return {median(ms), median(comm)};
}

template <int kStage>
Measured run_world(bool overlap, double bucket_mb) {
  if (g_mpi_world) return run_rank<kStage>(*g_mpi_world, overlap, bucket_mb);
  Measured out;
  comm::ThreadOptions options;
  options.omp_threads_per_rank = std::max(1, omp_get_max_threads() / kRanks);
  comm::run_threads(
      kRanks,
      [&](comm::ThreadComm& thread_world) {
        comm::Comm world(std::move(thread_world));
        const Measured m = run_rank<kStage>(world, overlap, bucket_mb);
        if (world.rank() == 0) out = m;
      },
      options);
  return out;
}

template <int kStage>
void register_stage(const std::string& engine, bool overlap, double bucket_mb, const std::string& suffix = "") {
  const std::string name = engine + "/zero:" + std::to_string(kStage) + "/overlap:" + (overlap ? "1" : "0") + suffix;
  benchmark::RegisterBenchmark(name.c_str(),
                               [overlap, bucket_mb](benchmark::State& state) {
                                 Measured m;
                                 for (auto _ : state) {
                                   m = run_world<kStage>(overlap, bucket_mb);
                                   state.SetIterationTime(m.ms * 1e-3);
                                 }
                                 state.counters["ms/step"] = m.ms;
                                 state.counters["exposed_comm_ms"] = m.exposed_comm_ms;
                                 state.counters["comm_share"] = m.exposed_comm_ms / m.ms;
                                 state.counters["bucket_MiB"] = bucket_mb;
                               })
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

void register_all(const std::string& engine) {
  const double kDefault = parallel::DataConfig{}.bucket_bytes / double(1 << 20);
  for (bool overlap : {true, false}) {
    register_stage<0>(engine, overlap, kDefault);
    register_stage<1>(engine, overlap, kDefault);
    register_stage<2>(engine, overlap, kDefault);
    register_stage<3>(engine, overlap, kDefault);
  }
  for (double mb : {1.0, 4.0, 64.0}) register_stage<0>(engine, true, mb, "/bucket_MiB:" + std::to_string(int(mb)));
}

}  // namespace

int main(int argc, char** argv) {
  try {
#if defined(LLMPAR_WITH_MPI)
    if (comm::launched_by_mpi()) {
      comm::MpiEnvironment mpi(argc, argv);
      comm::Comm world(comm::MpiComm::world());
      g_mpi_world = &world;
      benchmark::Initialize(&argc, argv);
      register_all("dp" + std::to_string(world.size()) + "_mpi");
      bench::run_benchmarks_on_rank(world.rank());
      benchmark::Shutdown();
      g_mpi_world = nullptr;
      return 0;
    }
#endif
    benchmark::Initialize(&argc, argv);
    register_all("dp2_threads");
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_data_parallel: %s\n", e.what());
    return 1;
  }
}
