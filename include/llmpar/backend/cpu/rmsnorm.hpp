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
// Fused with the residual add (Llama's pre-norm block, models/prenorm_block.hpp):
//   residual_rmsnorm_forward:  residual += delta, then out = RMSNorm(residual);
//   residual_rmsnorm_backward: dx = RMSNorm backward(dout) + dresidual.
// Each does the add on the row it normalises, while the row is in L1, instead of in a
// separate pass over (rows, C) (backend/cpu/elementwise.hpp's add_inplace): the stream
// is read and written once. They are the unfused sequences' float operations in the
// same order, with the same roundings to T (the sum is rounded to T before it is
// normalised; the norm's gradient is rounded to T before the residual gradient is
// added), so a model computes the same bits fused or not. Forward folds the add into
// the sum-of-squares loop, whose `omp simd` reduction then has the unfused loop's
// vector length and order (same types; tests/test_kernels_rmsnorm.cpp checks the bits).
// Backward adds in a loop of its own over the row, just written and still in L1: with
// FMA contraction on (CMakeLists.txt) a folded `(g - n * m) * s + dr` would become one
// fma, rounding once where the unfused sequence rounds twice. The loops that are the
// same in both are written once (detail::).
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

namespace detail {

// rstd of a row from its sum of squares.
template <class Acc>
inline Acc rmsnorm_rstd(Acc sum_sq, std::int64_t C, float eps) {
  return Acc(1) / std::sqrt(sum_sq / static_cast<Acc>(C) + static_cast<Acc>(eps));
}

// o (C) = xr * s * weight: the normalising loop of both forward kernels.
template <class T>
inline void rmsnorm_scale_row(T* LLMPAR_RESTRICT o, const T* LLMPAR_RESTRICT xr, const T* LLMPAR_RESTRICT weight,
                              acc_t<T> s, std::int64_t C) {
#pragma omp simd
  for (std::int64_t c = 0; c < C; ++c) store(o, c, load(xr, c) * s * load(weight, c));
}

inline void check_rmsnorm(const char* who, std::int64_t rows, std::int64_t C) {
  LLMPAR_CHECK(rows >= 0 && C >= 1, who, ": rows = ", rows, ", C = ", C, "; need rows >= 0 and C >= 1");
}

inline void check_rmsnorm_eps(const char* who, float eps) {
  LLMPAR_CHECK(eps >= 0.0f, who, ": eps = ", eps, "; it must be >= 0");
}

}  // namespace detail

// out, x: (rows, C); weight: (C); rstd: (rows) or null.
template <class T>
void rmsnorm_forward(T* LLMPAR_RESTRICT out, acc_t<T>* LLMPAR_RESTRICT rstd, const T* LLMPAR_RESTRICT x,
                     const T* LLMPAR_RESTRICT weight, std::int64_t rows, std::int64_t C, float eps = 1e-5f) {
  using Acc = acc_t<T>;
  detail::check_rmsnorm("rmsnorm_forward", rows, C);
  detail::check_rmsnorm_eps("rmsnorm_forward", eps);
#pragma omp parallel for schedule(static) if (rows * C >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* LLMPAR_RESTRICT xr = x + r * C;  // (C)
    Acc sum_sq = 0;
#pragma omp simd reduction(+ : sum_sq)
    for (std::int64_t c = 0; c < C; ++c) sum_sq += load(xr, c) * load(xr, c);
    const Acc s = detail::rmsnorm_rstd(sum_sq, C, eps);
    detail::rmsnorm_scale_row(out + r * C, xr, weight, s, C);
    if (rstd != nullptr) rstd[r] = s;
  }
}

// residual (rows, C) += delta (rows, C), rounded to T; out (rows, C) = RMSNorm(residual).
// weight: (C); rstd: (rows) or null. out must not overlap residual or delta.
template <class T>
void residual_rmsnorm_forward(T* LLMPAR_RESTRICT out, acc_t<T>* LLMPAR_RESTRICT rstd, T* LLMPAR_RESTRICT residual,
                              const T* LLMPAR_RESTRICT delta, const T* LLMPAR_RESTRICT weight, std::int64_t rows,
                              std::int64_t C, float eps = 1e-5f) {
  using Acc = acc_t<T>;
  detail::check_rmsnorm("residual_rmsnorm_forward", rows, C);
  detail::check_rmsnorm_eps("residual_rmsnorm_forward", eps);
#pragma omp parallel for schedule(static) if (rows * C >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    T* LLMPAR_RESTRICT res = residual + r * C;   // (C)
    const T* LLMPAR_RESTRICT d = delta + r * C;  // (C)
    // The sum, and rmsnorm_forward's sum of squares of its stored (rounded) value.
    Acc sum_sq = 0;
#pragma omp simd reduction(+ : sum_sq)
    for (std::int64_t c = 0; c < C; ++c) {
      store(res, c, load(res, c) + load(d, c));
      sum_sq += load(res, c) * load(res, c);
    }
    const Acc s = detail::rmsnorm_rstd(sum_sq, C, eps);
    detail::rmsnorm_scale_row(out + r * C, res, weight, s, C);
    if (rstd != nullptr) rstd[r] = s;
  }
}

namespace detail {

// Both backward kernels: dx = RMSNorm backward(dout), then dx += dresidual when it is
// not null, row by row.
template <class T>
void rmsnorm_backward_rows(T* LLMPAR_RESTRICT dx, acc_t<T>* LLMPAR_RESTRICT dweight, const T* LLMPAR_RESTRICT dout,
                           const T* LLMPAR_RESTRICT dresidual, const T* LLMPAR_RESTRICT x,
                           const T* LLMPAR_RESTRICT weight, const acc_t<T>* LLMPAR_RESTRICT rstd, std::int64_t rows,
                           std::int64_t C) {
  using Acc = acc_t<T>;
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
      if (dresidual != nullptr) {  // the residual path, as add_inplace(dx, dresidual) adds it
        const T* LLMPAR_RESTRICT dr = dresidual + r * C;
#pragma omp simd
        for (std::int64_t c = 0; c < C; ++c) store(dxr, c, load(dxr, c) + load(dr, c));
      }
    }
  }
}

}  // namespace detail

// dx, dout, x: (rows, C); dweight, weight: (C); rstd: (rows) from forward.
template <class T>
void rmsnorm_backward(T* LLMPAR_RESTRICT dx, acc_t<T>* LLMPAR_RESTRICT dweight, const T* LLMPAR_RESTRICT dout,
                      const T* LLMPAR_RESTRICT x, const T* LLMPAR_RESTRICT weight, const acc_t<T>* LLMPAR_RESTRICT rstd,
                      std::int64_t rows, std::int64_t C) {
  detail::check_rmsnorm("rmsnorm_backward", rows, C);
  detail::rmsnorm_backward_rows<T>(dx, dweight, dout, nullptr, x, weight, rstd, rows, C);
}

// dx (rows, C) = RMSNorm backward(dout) + dresidual: the gradient of x where x both
// feeds the norm and continues the residual stream (dresidual, rows x C, is the
// stream's gradient). dout, x: (rows, C); dweight, weight: (C); rstd: (rows) from
// forward. dx must not overlap dout, dresidual or x; dweight +=.
template <class T>
void residual_rmsnorm_backward(T* LLMPAR_RESTRICT dx, acc_t<T>* LLMPAR_RESTRICT dweight, const T* LLMPAR_RESTRICT dout,
                               const T* LLMPAR_RESTRICT dresidual, const T* LLMPAR_RESTRICT x,
                               const T* LLMPAR_RESTRICT weight, const acc_t<T>* LLMPAR_RESTRICT rstd, std::int64_t rows,
                               std::int64_t C) {
  detail::check_rmsnorm("residual_rmsnorm_backward", rows, C);
  LLMPAR_CHECK(rows == 0 || dresidual != nullptr,
               "residual_rmsnorm_backward: dresidual is null; pass the residual stream's gradient "
               "(or call rmsnorm_backward)");
  detail::rmsnorm_backward_rows<T>(dx, dweight, dout, dresidual, x, weight, rstd, rows, C);
}

}  // namespace llmpar::backend::cpu
