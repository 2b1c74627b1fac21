// bench_comm — ThreadComm's operations as Google Benchmark cases.
//
// Every operation of bench_collectives (all_reduce, reduce_scatter, all_gather,
// broadcast, reduce, all_to_all, sendrecv; out of place, float) at 2 and 4 ranks and
// 4 KiB, 1 MiB and 64 MiB, with nccl-tests' size conventions and algbw/busbw counters
// (GB/s, from comm_bench.hpp); bytes_per_second is algbw in bytes.
//
// Google Benchmark's loop runs on the calling thread only, while a collective needs
// every rank. So each case starts its rank threads once (comm::run_threads) and keeps
// them for all its iterations: rank 0 runs the loop, and before each iteration
// broadcasts to the others whether there is one (1) or the case is over (0). That
// control message also lines the ranks up; the operation after it is timed on rank 0
// (manual time), so the control traffic is not counted.
//
// bench_collectives prints the nccl-tests table for any size range; this program is
// for comparing runs with Google Benchmark's tools (--benchmark_format=json, compare.py).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <llmpar/comm/thread_comm.hpp>
#include <span>
#include <string>
#include <vector>

#include "comm_bench.hpp"

using namespace llmpar;
using bench::Test;

namespace {

void run_case(benchmark::State& state, Test t) {
  const int ranks = static_cast<int>(state.range(0));
  const bench::Shape shape = bench::shape_of(t, static_cast<std::size_t>(state.range(1)), sizeof(float), ranks);
  double seconds = 0;  // the operations' time on rank 0
  try {
    comm::run_threads(ranks, [&](comm::ThreadComm& world) {
      std::vector<float> send(shape.send, 1.0f + static_cast<float>(world.rank())), recv(shape.recv, 0.0f);
      const bench::Views<float> v{send, recv};
      auto once = [&] { bench::issue(world, t, v, false, comm::ReduceOp::sum, 0); };
      once();  // warm-up
      std::vector<std::int32_t> more(1, 0);
      if (world.rank() != 0) {
        while (true) {
          world.broadcast(more, 0);
          if (!more[0]) return;
          once();
        }
      }
      for (auto _ : state) {
        more[0] = 1;
        world.broadcast(more, 0);
        const auto start = std::chrono::steady_clock::now();
        once();
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        state.SetIterationTime(elapsed);
        seconds += elapsed;
      }
      more[0] = 0;
      world.broadcast(more, 0);
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(shape.bytes));
  const double per_op = seconds / static_cast<double>(state.iterations());
  state.counters["algbw"] = bench::algbw(shape, per_op);  // GB/s
  state.counters["busbw"] = bench::busbw(t, ranks, shape, per_op);
}

void register_cases() {
  constexpr std::int64_t kSizes[] = {std::int64_t{4} << 10, std::int64_t{1} << 20, std::int64_t{64} << 20};
  for (Test t : bench::kTests) {
    for (std::int64_t ranks : {2, 4}) {
      for (std::int64_t bytes : kSizes) {
        auto* b = benchmark::RegisterBenchmark(std::string(bench::name_of(t)).c_str(), run_case, t)
                      ->Args({ranks, bytes})
                      ->ArgNames({"ranks", "bytes"})
                      ->UseManualTime()
                      ->Unit(benchmark::kMicrosecond);
        // Enough for a stable figure while `llmpar.sh bench` stays quick: the large
        // size takes tens of milliseconds per operation.
        if (bytes >= (std::int64_t{64} << 20))
          b->Iterations(3);
        else
          b->MinTime(0.03);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  // `llmpar.sh bench ARGS` gives every benchmark program the same arguments: flags for
  // bench_collectives are not this program's, but say so rather than drop them quietly.
  for (int i = 1; i < argc; ++i) std::fprintf(stderr, "bench_comm: ignoring argument '%s'\n", argv[i]);
  register_cases();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
