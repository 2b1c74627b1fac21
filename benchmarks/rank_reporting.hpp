// rank_reporting.hpp — running Google Benchmark on every rank of a multi-process job:
// every rank must run every benchmark (their collectives must match), and only rank 0
// may print. What bench_mpi_overhead and bench_data_parallel share.
#pragma once

#include <benchmark/benchmark.h>

#include <vector>

namespace llmpar::bench {

// A reporter that prints nothing (ranks other than 0).
class QuietReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

// Runs the registered benchmarks on this rank; rank 0 reports to the console.
inline void run_benchmarks_on_rank(int rank) {
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    QuietReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
}

}  // namespace llmpar::bench
