// llmpar/math/online_softmax.hpp — the running (max, sum) of a softmax, and its exp.
//
// Softmax, log-sum-exp, cross-entropy and attention all need max_i x_i and
// sum_i exp(x_i - max) over a row. Computing them in one pass, as a running state that
// rescales its sum whenever the max grows (Milakov & Gimelshein 2018, "Online
// normalizer calculation for softmax"), lets a kernel stream a row once: the
// attention kernels never store a T x T matrix, the cross-entropy kernel reads a
// 50k-wide row once for its statistics. Two states over disjoint parts of a row
// `combine` into the state of the whole row, which is what lets a row be split over
// tiles, threads, or vocabulary-parallel ranks.
//
// Written once as host/device functions: the CPU kernels and the CUDA kernels share
// it. Only <cmath> functions and literals are used (no std::numeric_limits), so nvcc
// accepts every line in device code.
#pragma once

#include <cmath>
#include <cstdint>

#include "llmpar/config.hpp"
#include "llmpar/core/dtype.hpp"

namespace llmpar::math {

// exp for softmax-family kernels. float: a Cephes-style range reduction plus a
// degree-6 polynomial (within 2 ulp of expf over the whole normal range), written
// branch-free so that a `#pragma omp simd` loop calling it vectorises; glibc's expf
// does not vectorise without -ffast-math, and exp is the one transcendental in every
// score these kernels touch. Inputs below ln(2^-126) return exactly 0 (the subnormal
// tail is flushed; softmax weights that small are zero at float precision anyway),
// -inf gives 0, +inf gives +inf, NaN stays NaN. double: std::exp, because double
// instantiations exist to be the accurate reference (finite-difference gradients).
LLMPAR_HOST_DEVICE float fast_exp(float x) {
  constexpr float kLo = -87.33654475f;  // ln(2^-126): below it the result is subnormal
  constexpr float kHi = 88.72283905f;   // ln(FLT_MAX): above it the result overflows
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  // n = round(x / ln 2), kept in the low mantissa bits of t; r = x - n ln 2 in
  // [-ln2/2, ln2/2], with ln 2 split in two so that n * ln2_hi is exact. Inputs
  // outside [kLo, kHi] are not clamped: whatever they compute is replaced by the final
  // select (clamping with float ternaries would stop GCC from vectorising the caller).
  const float t = x * 1.44269504088896341f + kRound;
  const float n = t - kRound;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n built from its exponent bits. In range, n is in [-126, 128]; 2^128 is split
  // as 2^127 * 2 so that exp just below ln(FLT_MAX) stays finite.
  const std::int32_t n_int = static_cast<std::int32_t>(::llmpar::detail::float_bits(t) & 0x7FFFFFu) - 0x400000;
  const std::int32_t n_hi = n_int > 127 ? 127 : n_int;
  const float scale = ::llmpar::detail::bits_float(static_cast<std::uint32_t>(n_hi + 127) << 23);
  const float tail = n_int > 127 ? 2.0f : 1.0f;
  const float y = p * scale * tail;
  // The range select works on bits: a float ternary here would stop vectorisation.
  const bool below = x < kLo, above = x > kHi;  // both false for NaN: y is NaN
  const std::uint32_t keep = (below | above) ? 0u : 0xFFFFFFFFu;
  const std::uint32_t inf = above ? 0x7F800000u : 0u;
  return ::llmpar::detail::bits_float((::llmpar::detail::float_bits(y) & keep) | inf);
}

LLMPAR_HOST_DEVICE double fast_exp(double x) { return std::exp(x); }

// The running softmax normaliser of a sequence: after pushing x_1..x_n,
// max = max_i x_i and sum = sum_i exp(x_i - max). The empty state is (-inf, 0).
//
// Exactness and order. `push` and `combine` compute the same quantity; in exact
// arithmetic every order and grouping gives the same (max, sum). In floating point:
//   - `max` is always exact (a max of the inputs, independent of order);
//   - `combine(a, b)` is bitwise commutative: each side is rescaled to the common
//     max by its own factor exp(its max - common max), which is exactly 1 for the
//     side holding the max, and the two terms are added;
//   - it is not associative in the last bits, so a reduction across threads or
//     ranks that must be reproducible combines in a fixed order (llmpar combines in
//     ascending rank / tile order: ((s0 + s1) + s2) + ...), like any float sum.
template <class Acc>
struct OnlineSoftmax {
  // -INFINITY, not numeric_limits, so that device code can use it.
  Acc max = -INFINITY;
  Acc sum = 0;

  // Adds one element. exp(-inf - m) = 0, so a -inf element leaves the sum unchanged
  // (but it is skipped explicitly: -inf - -inf would be NaN on an empty state).
  LLMPAR_HOST_DEVICE void push(Acc x) {
    if (x > max) {
      sum = sum * std::exp(max - x) + Acc(1);
      max = x;
    } else if (x != Acc(-INFINITY)) {
      sum += std::exp(x - max);
    }
  }

  // Merges the state of a disjoint part of the same row (see the order note above).
  LLMPAR_HOST_DEVICE void combine(const OnlineSoftmax& other) {
    const Acc m = max > other.max ? max : other.max;
    if (m == Acc(-INFINITY)) return;  // both empty
    sum = scaled_sum(m) + other.scaled_sum(m);
    max = m;
  }

  // Moves the reference point to new_max (>= max) and returns the factor by which
  // anything accumulated with weights exp(x_i - old max) must be multiplied: the
  // flash-attention output accumulator rescales by it when a tile raises the max.
  // The factor is exactly 1 when the max does not change.
  LLMPAR_HOST_DEVICE Acc rescale(Acc new_max) {
    const Acc factor = max == new_max ? Acc(1) : std::exp(max - new_max);
    sum *= factor;
    max = new_max;
    return factor;
  }

  // log(sum_i exp(x_i)) = max + log(sum); -inf for the empty state.
  LLMPAR_HOST_DEVICE Acc log_sum_exp() const { return max + std::log(sum); }

 private:
  LLMPAR_HOST_DEVICE Acc scaled_sum(Acc m) const { return max == m ? sum : sum * std::exp(max - m); }
};

}  // namespace llmpar::math
