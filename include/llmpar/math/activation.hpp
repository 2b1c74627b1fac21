// llmpar/math/activation.hpp — GELU (GPT-2's tanh approximation) and its derivative.
//
//   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//
// Written once as host/device functions: the CPU kernels and the CUDA kernels call
// these, so the two backends cannot drift apart in the formula.
//
// Why it is not spelled with tanh: 0.5 (1 + tanh(u)) is exactly the logistic function
// s = 1 / (1 + e^(-2u)), so gelu(x) = x s. One exp is several times cheaper than one
// tanh, and on the host an exp built from multiplies, adds, floor and a bit cast lets
// a CPU loop over a tensor vectorize (glibc's vector exp/tanh are only declared under
// -ffast-math, which llmpar does not impose on its users). The derivative reuses s:
//   d gelu/dx = s + x * 2 s (1 - s) * sqrt(2/pi) (1 + 3 * 0.044715 x^2),
// with 1 - s taken as e s when e = e^(-2u) < 1, so neither s -> 1 (cancellation) nor
// e -> inf (inf * 0) loses the result.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "llmpar/config.hpp"

namespace llmpar::math {

namespace detail {

LLMPAR_HOST_DEVICE float bits_as_float(std::int32_t bits) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(bits);
#else
  return __builtin_bit_cast(float, bits);
#endif
}

// e^x in float to about 1 ulp (Cephes' expf polynomial), written without libm calls
// so that a loop around it vectorizes. Overflows to +inf above ln(FLT_MAX), flushes
// to 0 below ln(FLT_MIN) (no subnormal results), and returns NaN for NaN.
LLMPAR_HOST_DEVICE float exp_f32(float x) {
  constexpr float kMaxArg = 88.72283905206835f;   // ln(FLT_MAX)
  constexpr float kMinArg = -87.33654475055310f;  // ln(FLT_MIN)
  constexpr float kLog2e = 1.44269504088896341f;
  // ln 2 split so that n * kLn2Hi is exact for every n in range (Cody-Waite).
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  // Clamp with comparisons that send NaN to a bound (maxps/minps semantics), so the
  // float->int conversion below always sees a finite value; NaN is restored at the end.
  float xc = x < kMaxArg ? x : kMaxArg;
  xc = xc > kMinArg ? xc : kMinArg;
  const float n = std::floor(xc * kLog2e + 0.5f);
  float r = xc - n * kLn2Hi;
  r = r - n * kLn2Lo;  // |r| <= ln(2)/2
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n with n in [-126, 128], as two normal powers of two so no exponent field
  // overflows; both multiplications are exact.
  const std::int32_t ni = static_cast<std::int32_t>(n);
  const std::int32_t half = ni >> 1;
  const float scale_lo = bits_as_float((half + 127) << 23);
  const float scale_hi = bits_as_float((ni - half + 127) << 23);
  float result = p * scale_lo * scale_hi;
  constexpr std::int32_t kInfBits = 0x7F800000;
  result = x > kMaxArg ? bits_as_float(kInfBits) : result;
  result = x < kMinArg ? 0.0f : result;
  return x != x ? x : result;
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
  const T u = kSqrt2OverPi * (x + kCubic * x * x * x);
  const T e = math::exp(static_cast<T>(-2) * u);
  const T s = static_cast<T>(1) / (static_cast<T>(1) + e);
  return {s, e < static_cast<T>(1) ? e * s : static_cast<T>(1) - s};
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
