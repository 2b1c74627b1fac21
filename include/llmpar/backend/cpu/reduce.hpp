// llmpar/backend/cpu/reduce.hpp — deterministic sum of squares (gradient-norm clipping).
//
// The global gradient norm decides the clipping factor, so it must be the same number
// for any thread count, or a parallel run drifts away from the serial one. A reduction
// whose order follows the threads cannot promise that. Here the order is fixed by the
// data alone: x is cut into blocks of kReduceBlock elements, each block is summed in
// double on one thread in an order written out in the code, and the block sums
// are added in index order on the calling thread. Threads only decide who computes a
// block, never how it is added. Blocks are produced in batches of kReduceBatch so the
// partial sums live on the stack (no allocation) whatever n is.
//
// A sharded caller that keeps shard boundaries on multiples of kReduceBlock can
// reproduce the serial sum by combining block_sum_of_squares values in index order.
#pragma once

#include <algorithm>
#include <cstdint>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::backend::cpu {

// Elements per block (32 KiB of float: one thread's L1-sized slice).
inline constexpr std::int64_t kReduceBlock = 8192;
// Blocks per parallel batch (2M elements; the batch's partial sums take 2 KiB).
inline constexpr std::int64_t kReduceBatch = 256;

// Sum of x[i]^2 over one block (any n), in double, on the calling thread. The order
// of additions is spelled out (kReduceLanes running sums, element i into lane i mod
// kReduceLanes, lanes added pairwise) rather than left to the vectorizer, so it does
// not change with the pointer's alignment or the compiler's choice of vector width.
inline constexpr std::int64_t kReduceLanes = 8;

template <class T>
double block_sum_of_squares(const T* LLMPAR_RESTRICT x, std::int64_t n) {
  double lanes[kReduceLanes] = {};
  std::int64_t i = 0;
  for (; i + kReduceLanes <= n; i += kReduceLanes) {
#pragma omp simd
    for (std::int64_t l = 0; l < kReduceLanes; ++l) {
      const double v = static_cast<double>(static_cast<acc_t<T>>(x[i + l]));
      lanes[l] += v * v;
    }
  }
  for (std::int64_t l = 0; i + l < n; ++l) {
    const double v = static_cast<double>(static_cast<acc_t<T>>(x[i + l]));
    lanes[l] += v * v;
  }
  for (std::int64_t width = kReduceLanes / 2; width > 0; width /= 2) {
    for (std::int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

// Sum of x[i]^2 over [0, n), identical bit for bit for any number of threads.
template <class T>
double sum_of_squares(const T* LLMPAR_RESTRICT x, std::int64_t n) {
  LLMPAR_CHECK(n >= 0, "sum_of_squares: n = ", n, "; it must be >= 0");
  double total = 0.0;
  double partial[kReduceBatch];
  for (std::int64_t base = 0; base < n; base += kReduceBlock * kReduceBatch) {
    const std::int64_t blocks = std::min(kReduceBatch, ceil_div(n - base, kReduceBlock));
#pragma omp parallel for schedule(static) if (blocks > 1 && n >= kMinParallelWork)
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t begin = base + b * kReduceBlock;
      partial[b] = block_sum_of_squares(x + begin, std::min(kReduceBlock, n - begin));
    }
    for (std::int64_t b = 0; b < blocks; ++b) total += partial[b];
  }
  return total;
}

}  // namespace llmpar::backend::cpu
