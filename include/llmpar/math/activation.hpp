// llmpar/math/activation.hpp — GELU (GPT-2's tanh approximation) and its derivative.
//
//   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//
// Written once as host/device functions: the CPU kernels and the CUDA kernels call
// these, so the two backends cannot drift apart in the formula.
//
// Why it is not spelled with tanh: 0.5 (1 + tanh(u)) is exactly the logistic function
// s = 1 / (1 + e), e = e^(-2u), so gelu(x) = x s. One exp is several times cheaper
// than one tanh, and on the host an exp built from multiplies, adds, conversions and
// integer bit operations lets a CPU loop over a tensor vectorize (glibc's vector
// exp/tanh are only declared under -ffast-math, which llmpar does not impose on its
// users). The derivative reuses s:
//   d gelu/dx = s + x * 2 s (1 - s) * sqrt(2/pi) (1 + 3 * 0.044715 x^2),
// with 1 - s computed as e s, which has no cancellation as s -> 1.
//
// Everything here is branch-free on purpose, down to how values are clamped: a
// conditional in the element math is what stops a compiler from vectorizing the loop
// that calls it (see clamp_magnitude).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "llmpar/config.hpp"
#include "llmpar/core/bits.hpp"

namespace llmpar::math {

namespace detail {

// x with its magnitude limited to bound (finite, > 0), sign kept; NaN becomes +-bound.
//
// Why on the bits: a float select such as `x > b ? b : x` gives the compiler a path on
// which everything downstream is a constant; GCC then evaluates those paths apart and
// the loop has control flow, which (with trapping math, the default) it will not
// vectorize. An integer min on the magnitude bits is branch-free and keeps the sign
// as data, so no downstream value becomes constant.
LLMPAR_HOST_DEVICE float clamp_magnitude(float x, float bound) {
  const std::uint32_t raw = bits::of(x);
  const std::uint32_t magnitude = raw & 0x7FFFFFFFu;
  const std::uint32_t limit = bits::of(bound);
  const std::uint32_t clamped = magnitude < limit ? magnitude : limit;
  return bits::to_float((raw & 0x80000000u) | clamped);
}

LLMPAR_HOST_DEVICE double clamp_magnitude(double x, double bound) {
  const std::uint64_t raw = bits::of(x);
  const std::uint64_t magnitude = raw & 0x7FFFFFFFFFFFFFFFull;
  const std::uint64_t limit = bits::of(bound);
  const std::uint64_t clamped = magnitude < limit ? magnitude : limit;
  return bits::to_double((raw & 0x8000000000000000ull) | clamped);
}

// e^x in float to about 1 ulp (Cephes' expf polynomial), built from multiplies, adds,
// conversions and integer operations on the bits, with no branch and no libm call, so
// that a loop around it vectorizes. Overflows to +inf, underflows through subnormals to 0,
// and returns NaN for NaN.
LLMPAR_HOST_DEVICE float exp_f32(float x) {
  // |x| <= 104 covers all of float's range (e^104 overflows, e^-104 underflows to 0)
  // and keeps n = round(x / ln 2) in [-150, 150], where 2^n is built without overflow.
  constexpr float kMaxMagnitude = 104.0f;
  constexpr float kLog2e = 1.44269504088896341f;
  // ln 2 split so that n * kLn2Hi is exact for every n in range (Cody-Waite).
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  // Quiet-NaN bits for a NaN x, else 0 (a 32-bit select: a bool would mix element
  // widths in the loop, which also stops vectorization).
  const std::uint32_t nan_bits =
      (bits::of(x) & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : 0u;
  const float xc = clamp_magnitude(x, kMaxMagnitude);
  // n = floor(t + 1/2) by truncation and a fix-up for negative t: std::floor does not
  // vectorize without -fno-trapping-math, a float->int conversion does.
  const float t = xc * kLog2e + 0.5f;
  const std::int32_t truncated = static_cast<std::int32_t>(t);
  const std::int32_t ni = truncated - (static_cast<float>(truncated) > t ? 1 : 0);
  const float n = static_cast<float>(ni);
  float r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;  // |r| <= ln(2)/2
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n as two normal powers of two (exponent fields 52..202): the first product is
  // exact, the second rounds once (to inf, or to a subnormal or 0, where e^x does).
  const std::int32_t half = ni >> 1;
  const float scale_lo = bits::to_float(static_cast<std::uint32_t>(half + 127) << 23);
  const float scale_hi = bits::to_float(static_cast<std::uint32_t>(ni - half + 127) << 23);
  const float result = p * scale_lo * scale_hi;
  // Setting the quiet-NaN bits turns any finite result into NaN; no branch needed.
  return bits::to_float(bits::of(result) | nan_bits);
}

}  // namespace detail

// e^x for float or double: CUDA's expf/exp on the device, the vectorizable polynomial
// for float on the host, std::exp for double on the host (tests need double accuracy).
template <class T>
LLMPAR_HOST_DEVICE T exp(T x) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "llmpar::math::exp computes in float or double; convert bf16/f16 to float first");
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) return ::expf(x);
  else return ::exp(x);
#else
  if constexpr (std::is_same_v<T, float>) return detail::exp_f32(x);
  else return std::exp(x);
#endif
}

namespace detail {

template <class T>
struct GeluParts {
  T s;            // logistic(2u) == 0.5 (1 + tanh(u))
  T one_minus_s;  // 1 - s, without cancellation
};

template <class T>
LLMPAR_HOST_DEVICE GeluParts<T> gelu_parts(T x) {
  constexpr T kSqrt2OverPi = static_cast<T>(0.79788456080286535587989211986876);
  constexpr T kCubic = static_cast<T>(0.044715);
  // Past |2u| = 80 (float) or 700 (double) s is 0 or 1 to working precision; the clamp
  // keeps e finite, so e * s below is never inf * 0. NaN x still gives NaN: x
  // multiplies every result.
  constexpr T kMaxExponent = static_cast<T>(std::is_same_v<T, float> ? 80 : 700);
  const T u = kSqrt2OverPi * (x + kCubic * x * x * x);
  const T e = math::exp(clamp_magnitude(static_cast<T>(-2) * u, kMaxExponent));
  const T s = static_cast<T>(1) / (static_cast<T>(1) + e);
  return {s, e * s};  // 1 - s == e / (1 + e), without cancellation as s -> 1
}

}  // namespace detail

// GELU, tanh approximation (GPT-2, PyTorch approximate="tanh"). T is float or double.
template <class T>
LLMPAR_HOST_DEVICE T gelu_tanh(T x) {
  return x * detail::gelu_parts(x).s;
}

// d gelu_tanh(x) / dx.
template <class T>
LLMPAR_HOST_DEVICE T gelu_tanh_grad(T x) {
  constexpr T kSqrt2OverPi = static_cast<T>(0.79788456080286535587989211986876);
  constexpr T kCubic3 = static_cast<T>(3 * 0.044715);
  const detail::GeluParts<T> g = detail::gelu_parts(x);
  const T du_dx = kSqrt2OverPi * (static_cast<T>(1) + kCubic3 * x * x);
  return g.s + x * static_cast<T>(2) * g.s * g.one_minus_s * du_dx;
}

}  // namespace llmpar::math
