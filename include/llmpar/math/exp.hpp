// llmpar/math/exp.hpp — e^x for the shared element math, on host and device.
//
// Softmax, cross-entropy, flash attention and GELU all take one exp per element, in
// `#pragma omp simd` loops on the host. glibc's expf vectorises only under -ffast-math,
// which llmpar does not impose on its users, so the host float exp is written here from
// multiplies, adds, compares and integer operations on the bits, with no branch and no
// libm call: a loop around it vectorises. On the device CUDA's expf is already a few
// instructions (within 2 ulp) and is used as is. double is the library exp on both:
// double instantiations exist to be the accurate reference.
//
// The host float algorithm:
//   n = round(x / ln 2),  r = x - n ln 2 in [-ln2/2, ln2/2]      (ln 2 held in two parts)
//   e^r = 1 + j,  j = r + r^2 q(r),  q of degree 4 fitted to e^r in relative error on
//         that interval (approximation error under 0.05 ulp; the rest is rounding)
//   e^x = 2^n (1 + j) = (s + s j) t,  2^n = s t,  t = 2^64 for n > 0, else 1.
// The split keeps s and s (1 + j) normal for every n of a normal result, -126 to 128
// (2^128 itself is not a float), so the one rounding is that of s + s j and the product
// by t is exact or overflows.
//
// Range. Over the whole normal range of e^x, x from ln(FLT_MIN) = -87.34 to
// ln(FLT_MAX) = 88.72, results are within 1.1 ulp (checked for every float: 1.02 ulp
// with FMA contraction, 0.99 without); above it +inf, from the same float as expf. Below
// ln(FLT_MIN) the result is 0: subnormal results are flushed, on purpose. Softmax
// weights that small are zero at float precision anyway, and GELU clamps its argument
// to +-80, so nothing llmpar computes needs them; but an x86 core takes a slow path for
// every subnormal it computes, and a version that rounded into the subnormal range (as
// expf does, down to -103.97) ran 2.8x slower per element there, which softmax rows
// reach whenever they are peaked (attention on a few keys, low-temperature sampling).
// Here those lanes' 2^n wraps around to 0, an infinity or another power of two, and the
// result is selected away; only where the wrap lands back on the smallest exponents, x
// within ln(2)/2 below -(126 + 256 k) ln 2 (k = 0, 1, ...), does a discarded lane
// compute a subnormal. Zeroing its 2^n there as well measured 1% slower in the
// cross-entropy loop on ordinary rows and 1% faster on very peaked ones, so it is not
// done. -inf gives 0, +inf gives +inf, NaN stays NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "llmpar/config.hpp"
#include "llmpar/core/bits.hpp"

namespace llmpar::math {

namespace detail {

// e^x in float, branch-free (see the note at the top). Host and device, though the
// device's math::exp uses CUDA's expf.
LLMPAR_HOST_DEVICE float exp_branch_free(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  // 1.5 * 2^23 + 127: adding it rounds x / ln 2 to an integer n and leaves n + 127, the
  // biased exponent of 2^n, in the low mantissa bits of the sum.
  constexpr float kRound = 12583039.0f;
  // ln 2 = kLn2Hi + kLn2Lo to 6e-14; kLn2Hi has 15 significant bits, so n * kLn2Hi is
  // exact for every n that reaches the result.
  constexpr float kLn2Hi = 0x1.62e4p-1f;
  constexpr float kLn2Lo = 0x1.7f7d1cp-20f;
  // The smallest float whose e^x is normal, and the largest whose e^x rounds to a float.
  constexpr float kMinArg = -0x1.5d589ep+6f;  // -87.3365402
  constexpr float kMaxArg = 0x1.62e42ep+6f;   // 88.7228317

  const float z = x * kLog2e + kRound;
  const float n = z - kRound;
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  // q in Estrin's form: as many FMAs as Horner's, half the dependency depth.
  const float r2 = r * r;
  const float q01 = 0x1.fffffcp-2f + 0x1.555492p-3f * r;
  const float q234 = (0x1.5558f2p-5f + 0x1.1239d8p-7f * r) + 0x1.6a245ap-10f * r2;
  const float j = r + (q01 + q234 * r2) * r2;  // e^r - 1

  // 2^n = s t. z's bits are 0x4B400000 + n + 127, so shifted left by 23 they are
  // (n + 127) << 23 (mod 2^32): the bits of 2^n for n in [-126, 127]. For n > 0, 64 of
  // the exponent move into t, so n = 128 (x above 127.5 ln 2 = 88.38, where e^x is
  // still finite) does not make s infinite.
  const std::uint32_t moved = n > 0.0f ? (64u << 23) : 0u;
  const float s = bits::to_float((bits::of(z) << 23) - moved);
  const float t = bits::to_float(0x3F800000u + moved);
  const float y = (s + s * j) * t;

  // Outside [kMinArg, kMaxArg] the result is 0 or +inf, selected on the bits (a float
  // ternary here would stop vectorisation). Below kMinArg, where n < -126, s's exponent
  // bits have wrapped around (see the note at the top). NaN compares false both ways:
  // it is kept, and is NaN in y through j.
  const bool below = x < kMinArg;
  const bool above = x > kMaxArg;
  const std::uint32_t keep = (below | above) ? 0u : 0xFFFFFFFFu;
  const std::uint32_t inf = above ? 0x7F800000u : 0u;
  return bits::to_float((bits::of(y) & keep) | inf);
}

}  // namespace detail

// e^x for float or double: CUDA's expf/exp on the device; on the host the branch-free
// float exp above (vectorisable) and std::exp for double.
template <class T>
LLMPAR_HOST_DEVICE T exp(T x) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "llmpar::math::exp computes in float or double; convert bf16/f16 to float first");
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>)
    return ::expf(x);
  else
    return ::exp(x);
#else
  if constexpr (std::is_same_v<T, float>)
    return detail::exp_branch_free(x);
  else
    return std::exp(x);
#endif
}

}  // namespace llmpar::math
