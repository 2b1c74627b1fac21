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
#include "llmpar/core/bits.hpp"

namespace llmpar::math {

// exp for softmax-family kernels. float: Cephes expf's range reduction and degree-7
// polynomial (within 2 ulp of expf), written branch-free and in few instructions so
// that a `#pragma omp simd` loop calling it vectorises and stays cheap; glibc's expf
// does not vectorise without -ffast-math, and exp is the one transcendental in every
// score these kernels touch. Edges: below ln(2^-126) the result is exactly 0 (the
// subnormal tail is flushed: softmax weights that small are zero at float precision
// anyway); above 127.5 ln 2 = 88.376 it is +inf (expf overflows a little later, at
// 88.723; softmax arguments are <= 0); -inf gives 0, NaN stays NaN. double: std::exp,
// because double instantiations exist to be the accurate reference (finite-difference
// gradients).
LLMPAR_HOST_DEVICE float fast_exp(float x) {
  constexpr float kLo = -87.33654475f;   // ln(2^-126): below it the result is subnormal
  constexpr float kHi = 88.37626266f;    // 127.5 ln 2: from here n = 128, 2^n overflows
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  // n = round(x / ln 2), held in the low mantissa bits of t; r = x - n ln 2 in
  // [-ln2/2, ln2/2], with ln 2 split in two so that n * ln2_hi is exact. Inputs
  // outside [kLo, kHi] are not clamped: whatever they compute is replaced by the final
  // select (clamping with float ternaries would stop GCC from vectorising the caller).
  const float t = x * 1.44269504088896341f + kRound;
  const float n = t - kRound;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  // exp(r) = 1 + r + r^2 q(r), q of degree 5 evaluated in Estrin's form: the same
  // number of FMAs as Horner's but half the dependency depth, which is what bounds a
  // vectorised loop of exps.
  const float r2 = r * r;
  const float r4 = r2 * r2;
  const float q01 = 5.0000001201e-1f + 1.6666665459e-1f * r;
  const float q23 = 4.1665795894e-2f + 8.3334519073e-3f * r;
  const float q45 = 1.3981999507e-3f + 1.9875691500e-4f * r;
  const float q = q01 + r2 * q23 + r4 * q45;
  const float p = 1.0f + (r + r2 * q);
  // 2^n from its exponent bits: t's bits are 0x4B400000 + n, so shifting them left by
  // 23 leaves exactly n << 23 (mod 2^32, two's complement), and n + 127 is in
  // [1, 254] inside [kLo, kHi].
  const std::uint32_t t_bits = ::llmpar::bits::of(t);
  const float y = p * ::llmpar::bits::to_float((t_bits << 23) + (127u << 23));
  // The range select works on bits: a float ternary here would stop vectorisation.
  const bool below = x < kLo;  // below and above are both false for NaN: y is NaN
  const bool above = x > kHi;
  const std::uint32_t keep = (below | above) ? 0u : 0xFFFFFFFFu;
  const std::uint32_t inf = above ? 0x7F800000u : 0u;
  return ::llmpar::bits::to_float((::llmpar::bits::of(y) & keep) | inf);
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
