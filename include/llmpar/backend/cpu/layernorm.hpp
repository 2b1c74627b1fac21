// llmpar/backend/cpu/layernorm.hpp — LayerNorm forward and backward over rows of C.
//
//   out = (x - mean) * rstd * weight + bias,   rstd = 1 / sqrt(var + eps)  (biased var)
//
// Forward: one row per iteration of a parallel loop. Row statistics are exact-enough
// and vectorized at once: the row is cut into chunks of kStatChunk elements that stay
// in L1; each chunk gets a corrected two-pass mean and M2 with SIMD reductions, and
// the chunks are merged with the shared math::Welford combine — the same merge the
// CUDA kernel does across lanes, so large-mean rows stay accurate in float. mean and
// rstd are saved for backward (either may be null when no backward will run).
//
// Backward: dx needs whole-row reductions, dweight/dbias need whole-column sums, so
// they are two loops in one parallel region. The column sums must not depend on the
// thread count (serial equivalence): a thread owns whole column tiles and visits the
// rows in order, summing into a tile-local accumulator that is added to dweight/dbias
// once. Every column's sum is thus the same sequence of additions for any number of
// threads. The price is a second read of x and dout (about 1.5x the minimal traffic),
// which buys no workspace and no dependence on the thread count.
//
// Conventions: dx is overwritten; dweight and dbias (acc_t<T>: f32 main grads for
// 16-bit storage) are accumulated into (+=).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/math/welford.hpp"

namespace llmpar::backend::cpu {

namespace detail {

// Elements per statistics chunk: a few KiB, so the chunk's second pass reads L1.
inline constexpr std::int64_t kStatChunk = 256;

// Mean and M2 of x[0, C) as a Welford state.
template <class T>
math::Welford<acc_t<T>> row_statistics(const T* LLMPAR_RESTRICT x, std::int64_t C) {
  using Acc = acc_t<T>;
  math::Welford<Acc> total;
  for (std::int64_t c0 = 0; c0 < C; c0 += kStatChunk) {
    const std::int64_t n = std::min(kStatChunk, C - c0);
    const T* LLMPAR_RESTRICT xc = x + c0;
    Acc sum = 0;
#pragma omp simd reduction(+ : sum)
    for (std::int64_t i = 0; i < n; ++i) sum += load(xc, i);
    const Acc chunk_mean = sum / static_cast<Acc>(n);
    Acc m2 = 0;
    Acc dev = 0;
#pragma omp simd reduction(+ : m2, dev)
    for (std::int64_t i = 0; i < n; ++i) {
      const Acc d = load(xc, i) - chunk_mean;
      m2 += d * d;
      dev += d;
    }
    // Corrected two-pass: removes the error of a chunk mean that is not exact.
    m2 -= dev * dev / static_cast<Acc>(n);
    total.combine(math::Welford<Acc>{chunk_mean, m2 > Acc(0) ? m2 : Acc(0), n});
  }
  return total;
}

}  // namespace detail

// out, x: (rows, C); weight, bias: (C); mean, rstd: (rows) or null.
template <class T>
void layernorm_forward(T* LLMPAR_RESTRICT out, acc_t<T>* LLMPAR_RESTRICT mean, acc_t<T>* LLMPAR_RESTRICT rstd,
                       const T* LLMPAR_RESTRICT x, const T* LLMPAR_RESTRICT weight, const T* LLMPAR_RESTRICT bias,
                       std::int64_t rows, std::int64_t C, float eps = 1e-5f) {
  using Acc = acc_t<T>;
  LLMPAR_CHECK(rows >= 0 && C >= 1, "layernorm_forward: rows = ", rows, ", C = ", C, "; need rows >= 0 and C >= 1");
  LLMPAR_CHECK(eps >= 0.0f, "layernorm_forward: eps = ", eps, "; it must be >= 0");
#pragma omp parallel for schedule(static) if (rows * C >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* LLMPAR_RESTRICT xr = x + r * C;
    T* LLMPAR_RESTRICT o = out + r * C;
    const math::Welford<Acc> stats = detail::row_statistics(xr, C);
    const Acc m = stats.mean;
    const Acc s = Acc(1) / std::sqrt(stats.variance() + static_cast<Acc>(eps));
#pragma omp simd
    for (std::int64_t c = 0; c < C; ++c) {
      const Acc norm = (load(xr, c) - m) * s;
      store(o, c, norm * load(weight, c) + load(bias, c));
    }
    if (mean != nullptr) mean[r] = m;
    if (rstd != nullptr) rstd[r] = s;
  }
}

// dx, dout, x: (rows, C); dweight, dbias, weight: (C); mean, rstd: (rows) from forward.
template <class T>
void layernorm_backward(T* LLMPAR_RESTRICT dx, acc_t<T>* LLMPAR_RESTRICT dweight, acc_t<T>* LLMPAR_RESTRICT dbias,
                        const T* LLMPAR_RESTRICT dout, const T* LLMPAR_RESTRICT x, const T* LLMPAR_RESTRICT weight,
                        const acc_t<T>* LLMPAR_RESTRICT mean, const acc_t<T>* LLMPAR_RESTRICT rstd, std::int64_t rows,
                        std::int64_t C) {
  using Acc = acc_t<T>;
  LLMPAR_CHECK(rows >= 0 && C >= 1, "layernorm_backward: rows = ", rows, ", C = ", C, "; need rows >= 0 and C >= 1");
  const std::int64_t tiles = ceil_div(C, kColumnTile);
#pragma omp parallel if (rows * C >= kMinParallelWork)
  {
    // dweight += sum_r dout * norm, dbias += sum_r dout; rows in order within a tile.
#pragma omp for schedule(static) nowait
    for (std::int64_t tile = 0; tile < tiles; ++tile) {
      const std::int64_t c0 = tile * kColumnTile;
      const std::int64_t n = std::min(kColumnTile, C - c0);
      Acc dw[kColumnTile] = {};
      Acc db[kColumnTile] = {};
      for (std::int64_t r = 0; r < rows; ++r) {
        const T* LLMPAR_RESTRICT xr = x + r * C + c0;
        const T* LLMPAR_RESTRICT gr = dout + r * C + c0;
        const Acc m = mean[r];
        const Acc s = rstd[r];
#pragma omp simd
        for (std::int64_t j = 0; j < n; ++j) {
          const Acc g = load(gr, j);
          db[j] += g;
          dw[j] += g * ((load(xr, j) - m) * s);
        }
      }
#pragma omp simd
      for (std::int64_t j = 0; j < n; ++j) {
        dweight[c0 + j] += dw[j];
        dbias[c0 + j] += db[j];
      }
    }

    // dx = rstd * (g - mean(g) - norm * mean(g * norm)), g = dout * weight.
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* LLMPAR_RESTRICT xr = x + r * C;
      const T* LLMPAR_RESTRICT gr = dout + r * C;
      T* LLMPAR_RESTRICT dxr = dx + r * C;
      const Acc m = mean[r];
      const Acc s = rstd[r];
      Acc sum_g = 0;
      Acc sum_g_norm = 0;
#pragma omp simd reduction(+ : sum_g, sum_g_norm)
      for (std::int64_t c = 0; c < C; ++c) {
        const Acc norm = (load(xr, c) - m) * s;
        const Acc g = load(gr, c) * load(weight, c);
        sum_g += g;
        sum_g_norm += g * norm;
      }
      const Acc mean_g = sum_g / static_cast<Acc>(C);
      const Acc mean_g_norm = sum_g_norm / static_cast<Acc>(C);
#pragma omp simd
      for (std::int64_t c = 0; c < C; ++c) {
        const Acc norm = (load(xr, c) - m) * s;
        const Acc g = load(gr, c) * load(weight, c);
        store(dxr, c, (g - mean_g - norm * mean_g_norm) * s);
      }
    }
  }
}

}  // namespace llmpar::backend::cpu
