// llmpar/math/activation.hpp — GELU (GPT-2's tanh approximation), SiLU, and the gates of
// the gated linear units (SwiGLU, GeGLU), with their derivatives.
//
//   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//
// Written once as host/device functions: the CPU kernels and the CUDA kernels call
// these, so the two backends cannot drift apart in the formula.
//
// Why it is not spelled with tanh: 0.5 (1 + tanh(u)) is exactly the logistic function
// s = 1 / (1 + e), e = e^(-2u), so gelu(x) = x s. One exp is several times cheaper
// than one tanh, and math::exp (math/exp.hpp) is branch-free on the host, so a CPU loop
// over a tensor vectorizes (glibc's vector exp/tanh are only declared under
// -ffast-math, which llmpar does not impose on its users). The derivative reuses s:
//   d gelu/dx = s + x * 2 s (1 - s) * sqrt(2/pi) (1 + 3 * 0.044715 x^2),
// with 1 - s computed as e s, which has no cancellation as s -> 1.
//
// Everything here is branch-free on purpose, down to how values are clamped: a
// conditional in the element math is what stops a compiler from vectorizing the loop
// that calls it (see clamp_magnitude).
#pragma once

#include <cstdint>
#include <type_traits>

#include "llmpar/config.hpp"
#include "llmpar/core/bits.hpp"
#include "llmpar/math/exp.hpp"

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

// SiLU (swish): x σ(x), σ(x) = 1 / (1 + e^-x). T is float or double.
template <class T>
LLMPAR_HOST_DEVICE T silu(T x) {
  constexpr T kMaxExponent = static_cast<T>(std::is_same_v<T, float> ? 80 : 700);
  const T e = math::exp(detail::clamp_magnitude(-x, kMaxExponent));
  return x / (static_cast<T>(1) + e);
}

// d silu(x) / dx = σ (1 + x (1 - σ)), with 1 - σ computed as e σ (no cancellation).
template <class T>
LLMPAR_HOST_DEVICE T silu_grad(T x) {
  constexpr T kMaxExponent = static_cast<T>(std::is_same_v<T, float> ? 80 : 700);
  const T e = math::exp(detail::clamp_magnitude(-x, kMaxExponent));
  const T s = static_cast<T>(1) / (static_cast<T>(1) + e);
  return s * (static_cast<T>(1) + x * e * s);
}

// The gate of a gated linear unit (Shazeer 2020, "GLU Variants Improve Transformer"):
// act = gate(g) · u over the two halves g, u of a projection. silu: SwiGLU (LLaMA);
// gelu: GeGLU with GPT-2's tanh GELU (Gemma).
enum class Gate : std::uint8_t { silu, gelu };

template <Gate G, class T>
LLMPAR_HOST_DEVICE T gate(T x) {
  if constexpr (G == Gate::silu)
    return silu(x);
  else
    return gelu_tanh(x);
}
template <Gate G, class T>
LLMPAR_HOST_DEVICE T gate_grad(T x) {
  if constexpr (G == Gate::silu)
    return silu_grad(x);
  else
    return gelu_tanh_grad(x);
}

}  // namespace llmpar::math
