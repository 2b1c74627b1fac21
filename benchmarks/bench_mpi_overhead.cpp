// bench_mpi_overhead — what MpiComm adds to MPI: MpiComm::all_reduce against a raw
// MPI_Allreduce on the same buffers (f32 sum, out of place), at 1 KiB, 1 MiB, 16 MiB
// and 64 MiB. MpiComm's synchronous path is meant to stay within 5% of the raw call.
//
//   OMP_NUM_THREADS=1 mpirun -np 4 build/benchmarks/bench_mpi_overhead
//
// Without mpirun it is a world of one process (MPI's singleton start), which measures
// the fixed cost of a call. Every rank runs every benchmark with the same fixed number
// of iterations (collectives must match across ranks); rank 0 reports, the others stay
// silent. Each benchmark runs 3 times; the `_min` row is the best of them.
#include <benchmark/benchmark.h>

#include <cstdio>

#if defined(LLMPAR_WITH_MPI)

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <llmpar/comm/mpi_comm.hpp>
#include <utility>
#include <vector>

#include "rank_reporting.hpp"

namespace {

using llmpar::comm::MpiComm;

struct Sizes {
  std::size_t bytes;
  benchmark::IterationCount iterations;
};
constexpr Sizes kSizes[] = {{1 << 10, 4000}, {1 << 20, 200}, {16 << 20, 20}, {64 << 20, 8}};

// One communicator for the whole run (made after MPI_Init, destroyed before MPI_Finalize).
MpiComm* g_world = nullptr;

struct Buffers {
  explicit Buffers(std::size_t bytes) : send(bytes / sizeof(float), 1.0f), recv(send.size()) {}
  std::vector<float> send, recv;
};

template <class Call>
void time_all_reduce(benchmark::State& state, Call&& call) {
  Buffers b(static_cast<std::size_t>(state.range(0)));
  for (int i = 0; i < 3; ++i) call(b);  // warm up: connections, pages, algorithm selection
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto _ : state) call(b);
  state.SetBytesProcessed(state.iterations() * state.range(0));
  state.counters["ranks"] = g_world->size();
}

void BM_raw_MPI_Allreduce(benchmark::State& state) {
  time_all_reduce(state, [](Buffers& b) {
    MPI_Allreduce(b.send.data(), b.recv.data(), static_cast<int>(b.send.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  });
}

void BM_MpiComm_all_reduce(benchmark::State& state) {
  time_all_reduce(state, [](Buffers& b) { g_world->all_reduce(b.send, b.recv); });
}

double best(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

void register_all() {
  for (const Sizes& s : kSizes)
    for (auto [name, fn] : {std::pair{"raw_MPI_Allreduce", &BM_raw_MPI_Allreduce},
                            std::pair{"MpiComm_all_reduce", &BM_MpiComm_all_reduce}})
      benchmark::RegisterBenchmark(name, fn)
          ->Arg(static_cast<std::int64_t>(s.bytes))
          ->Iterations(s.iterations)
          ->Repetitions(3)
          ->ComputeStatistics("min", best)
          ->DisplayAggregatesOnly(true)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    llmpar::comm::MpiEnvironment mpi(argc, argv);
    MpiComm world = MpiComm::world();
    g_world = &world;
    benchmark::Initialize(&argc, argv);
    register_all();
    llmpar::bench::run_benchmarks_on_rank(world.rank());
    benchmark::Shutdown();
    g_world = nullptr;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

#else

int main() {
  std::printf("bench_mpi_overhead: skipped (llmpar was built without MPI: LLMPAR_MPI=OFF)\n");
  return 0;
}

#endif
