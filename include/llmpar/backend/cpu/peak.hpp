// llmpar/backend/cpu/peak.hpp — the measured GEMM peak of this CPU: the denominator of
// MFU.
//
// MFU is model FLOPs per second over the peak the machine can reach. On a CPU there is
// no data sheet to read that peak from (clocks, cores shared with other tenants, which
// ISA oneDNN uses), so it is measured, and a measurement has to be an upper bound: a
// peak that a training step's own GEMMs can exceed is not a peak (a step then reports
// MFU above 100%). Three things make a quick measurement low, and each is handled:
//  - cold start: the first GEMMs run while OpenMP's threads are being created, pages
//    are faulted in and the cores clock up. A warm-up of at least kWarmupSeconds runs
//    before anything is timed.
//  - shapes: a library is fastest on some shapes and slower on others. The peak is the
//    best over square products of 1024 and 2048 *and* every GEMM shape of the model's
//    own step (the caller passes them, linear_layer_shapes() gives a linear layer's
//    three), in the run's precision, so no GEMM of the step can be faster than it.
//  - noise: a core shared with another process slows some repetitions. Each shape is
//    repeated for at least min_seconds (and at least kMinRepeats times) and its best
//    repetition counts.
// It runs on the calling thread's OpenMP team, i.e. the run's own threads; ranks of one
// process measure at the same time and add their results (examples/train_gpt).
#pragma once

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "llmpar/backend/cpu/gemm.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/tensor.hpp"

namespace llmpar::backend::cpu {

struct GemmPeak {
  double gflops = 0.0;  // the best throughput seen
  DType dtype = DType::f32;
  GemmShape shape;             // the shape that reached it
  std::string implementation;  // how that shape ran (Context::implementation)
  int shapes = 0;              // shapes measured
  int threads = 0;             // OpenMP threads of the measuring team
  double seconds = 0.0;        // the measurement's wall time, warm-up included

  // "171.3 GFLOP/s: best bf16 GEMM of 9 shapes (2048x2048x2048, native brg:..., 2 threads, 1.4 s)"
  std::string describe() const {
    char line[512];
    std::snprintf(
        line, sizeof line, "%.1f GFLOP/s: best %s GEMM of %d shapes (%lldx%lldx%lld, %s, %d thread%s, %.1f s)", gflops,
        std::string(name_of(dtype)).c_str(), shapes, static_cast<long long>(shape.m), static_cast<long long>(shape.n),
        static_cast<long long>(shape.k), implementation.c_str(), threads, threads == 1 ? "" : "s", seconds);
    return line;
  }
};

inline constexpr double kWarmupSeconds = 0.3;
inline constexpr int kMinRepeats = 3;

// The GEMM peak in storage type T (float, bf16 or f16; f32 accumulation), over square
// products of 1024 and 2048 and `shapes`.
template <class T>
GemmPeak measure_gemm_peak(Context& ctx, std::span<const GemmShape> shapes = {}, double min_seconds = 0.1) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  std::vector<GemmShape> all{{1024, 1024, 1024, {}}, {2048, 2048, 2048, {}}};
  all.insert(all.end(), shapes.begin(), shapes.end());
  std::int64_t a_max = 0, b_max = 0, c_max = 0;
  for (const GemmShape& s : all) {
    LLMPAR_CHECK(s.m > 0 && s.n > 0 && s.k > 0, "measure_gemm_peak: shape ", s.m, "x", s.n, "x", s.k,
                 " is empty; every GEMM shape needs positive sizes");
    a_max = std::max(a_max, s.m * s.k);
    b_max = std::max(b_max, s.k * s.n);
    c_max = std::max(c_max, s.m * s.n);
  }
  // Small non-zero values (never zeros: some kernels are faster on them). C is T, as the
  // step's forward and input-gradient GEMMs write it, and f32 for accumulating shapes,
  // as its weight-gradient GEMMs write their main grads.
  Buffer<T> a(a_max), b(b_max), c(c_max);
  Buffer<float> c32(c_max);
  for (std::int64_t i = 0; i < a_max; ++i) a[i] = static_cast<T>(static_cast<float>(i % 7 + 1) * 0.01f);
  for (std::int64_t i = 0; i < b_max; ++i) b[i] = static_cast<T>(static_cast<float>(i % 5 + 1) * 0.01f);
  c.zero();
  c32.zero();
  auto run = [&](const GemmShape& s) {
    if (s.op.accumulate)
      ctx.gemm<T, float>(c32.data(), a.data(), b.data(), nullptr, s.m, s.n, s.k, s.op);
    else
      ctx.gemm<T, T>(c.data(), a.data(), b.data(), nullptr, s.m, s.n, s.k, s.op);
  };
  auto seconds_since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };

  const auto warm = clock::now();
  while (seconds_since(warm) < kWarmupSeconds) run(all[1]);

  GemmPeak peak;
  peak.dtype = dtype_of<T>();
  peak.shapes = static_cast<int>(all.size());
  peak.threads = omp_get_max_threads();
  for (const GemmShape& s : all) {
    run(s);  // creates the primitive
    const auto t_shape = clock::now();
    double best = 0.0;
    for (int r = 0; r < kMinRepeats || seconds_since(t_shape) < min_seconds; ++r) {
      const auto t0 = clock::now();
      run(s);
      best = std::max(best, s.flops() / seconds_since(t0) * 1e-9);
    }
    if (best > peak.gflops) {
      peak.gflops = best;
      peak.shape = s;
    }
  }
  peak.implementation = peak.shape.op.accumulate
                            ? ctx.implementation<T, float>(peak.shape.m, peak.shape.n, peak.shape.k, peak.shape.op)
                            : ctx.implementation<T, T>(peak.shape.m, peak.shape.n, peak.shape.k, peak.shape.op);
  peak.seconds = seconds_since(start);
  return peak;
}

}  // namespace llmpar::backend::cpu
