// llmpar/backend/cpu/rmsnorm.hpp — RMSNorm (LLaMA) forward and backward over rows of C.
//
//   out = x * rstd * weight,   rstd = 1 / sqrt(mean(x^2) + eps)
//
// The same structure as backend/cpu/layernorm.hpp, minus the mean and the bias. The mean
// square is a plain sum of squares: it has no cancellation (every term is >= 0), so
// unlike LayerNorm's variance it needs no Welford merge to stay accurate in float.
//
// Forward: one row per iteration of a parallel loop; rstd is saved for backward (null
// when no backward will run).
//
// Backward: with g = dout * weight and n = x * rstd,
//   dx = rstd * (g - n * mean(g * n)),   dweight += sum_r dout * n.
// dx needs whole-row sums, dweight whole-column sums, so they are two loops in one
// parallel region; as in LayerNorm, a thread owns whole column tiles and visits the rows
// in order, so every column's sum is the same sequence of additions for any thread count.
//
// Conventions: dx is overwritten; dweight (acc_t<T>) is accumulated into (+=).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::backend::cpu {

// out, x: (rows, C); weight: (C); rstd: (rows) or null.
template <class T>
void rmsnorm_forward(T* LLMPAR_RESTRICT out, acc_t<T>* LLMPAR_RESTRICT rstd, const T* LLMPAR_RESTRICT x,
                     const T* LLMPAR_RESTRICT weight, std::int64_t rows, std::int64_t C, float eps = 1e-5f) {
  using Acc = acc_t<T>;
  LLMPAR_CHECK(rows >= 0 && C >= 1, "rmsnorm_forward: rows = ", rows, ", C = ", C, "; need rows >= 0 and C >= 1");
  LLMPAR_CHECK(eps >= 0.0f, "rmsnorm_forward: eps = ", eps, "; it must be >= 0");
#pragma omp parallel for schedule(static) if (rows * C >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* LLMPAR_RESTRICT xr = x + r * C;  // (C)
    T* LLMPAR_RESTRICT o = out + r * C;       // (C)
    Acc sum_sq = 0;
#pragma omp simd reduction(+ : sum_sq)
    for (std::int64_t c = 0; c < C; ++c) sum_sq += load(xr, c) * load(xr, c);
    const Acc s = Acc(1) / std::sqrt(sum_sq / static_cast<Acc>(C) + static_cast<Acc>(eps));
#pragma omp simd
    for (std::int64_t c = 0; c < C; ++c) store(o, c, load(xr, c) * s * load(weight, c));
    if (rstd != nullptr) rstd[r] = s;
  }
}

// dx, dout, x: (rows, C); dweight, weight: (C); rstd: (rows) from forward.
template <class T>
void rmsnorm_backward(T* LLMPAR_RESTRICT dx, acc_t<T>* LLMPAR_RESTRICT dweight, const T* LLMPAR_RESTRICT dout,
                      const T* LLMPAR_RESTRICT x, const T* LLMPAR_RESTRICT weight, const acc_t<T>* LLMPAR_RESTRICT rstd,
                      std::int64_t rows, std::int64_t C) {
  using Acc = acc_t<T>;
  LLMPAR_CHECK(rows >= 0 && C >= 1, "rmsnorm_backward: rows = ", rows, ", C = ", C, "; need rows >= 0 and C >= 1");
  const std::int64_t tiles = ceil_div(C, kColumnTile);
#pragma omp parallel if (rows * C >= kMinParallelWork)
  {
    // dweight += sum_r dout * norm; rows in order within a tile.
#pragma omp for schedule(static) nowait
    for (std::int64_t tile = 0; tile < tiles; ++tile) {
      const std::int64_t c0 = tile * kColumnTile;
      const std::int64_t n = std::min(kColumnTile, C - c0);
      Acc dw[kColumnTile] = {};
      for (std::int64_t r = 0; r < rows; ++r) {
        const T* LLMPAR_RESTRICT xr = x + r * C + c0;
        const T* LLMPAR_RESTRICT gr = dout + r * C + c0;
        const Acc s = rstd[r];
#pragma omp simd
        for (std::int64_t j = 0; j < n; ++j) dw[j] += load(gr, j) * (load(xr, j) * s);
      }
#pragma omp simd
      for (std::int64_t j = 0; j < n; ++j) dweight[c0 + j] += dw[j];
    }

    // dx = rstd * (g - norm * mean(g * norm)), g = dout * weight.
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* LLMPAR_RESTRICT xr = x + r * C;
      const T* LLMPAR_RESTRICT gr = dout + r * C;
      T* LLMPAR_RESTRICT dxr = dx + r * C;
      const Acc s = rstd[r];
      Acc sum_g_norm = 0;
#pragma omp simd reduction(+ : sum_g_norm)
      for (std::int64_t c = 0; c < C; ++c) {
        const Acc g = load(gr, c) * load(weight, c);
        sum_g_norm += g * (load(xr, c) * s);
      }
      const Acc mean_g_norm = sum_g_norm / static_cast<Acc>(C);
#pragma omp simd
      for (std::int64_t c = 0; c < C; ++c) {
        const Acc norm = load(xr, c) * s;
        const Acc g = load(gr, c) * load(weight, c);
        store(dxr, c, (g - norm * mean_g_norm) * s);
      }
    }
  }
}

}  // namespace llmpar::backend::cpu
