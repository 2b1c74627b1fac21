// llmpar/core/dtype.hpp — f32, bf16 and f16 on host and device, and the runtime tag.
//
// bf16 and f16 are 16-bit storage types with round-to-nearest-even conversions from
// float, written once as host/device functions so that a value rounded by a CPU kernel
// is bit-identical to one rounded by a CUDA kernel. Arithmetic happens in float: these
// types only convert. DType is the one runtime-to-type boundary (checkpoints and
// collectives name their element type with it).
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>

#include "llmpar/config.hpp"
#include "llmpar/core/bits.hpp"

namespace llmpar {

namespace detail {

// float -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN of the same sign.
// Written as a select rather than an early return, so that loops over it vectorise.
LLMPAR_HOST_DEVICE std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t x = bits::of(f);
  const std::uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (x >> 16) | 0x0040u;
  return static_cast<std::uint16_t>((x & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

LLMPAR_HOST_DEVICE float bf16_bits_to_float(std::uint16_t h) {
  return bits::to_float(static_cast<std::uint32_t>(h) << 16);
}

// float -> IEEE binary16 bits, round to nearest even, with subnormals, inf and NaN.
// Each range's result is computed and one is selected (no early returns), so that
// loops over the conversion vectorise; equal, bit for bit over every float, to the
// case-by-case conversion (checked exhaustively when this form was written).
//  - NaN -> a quiet NaN of the same sign; from 65520 up (rounds past 65504) -> inf.
//  - below 2^-14, a subnormal half: adding 0.5 = 2^-1 in float rounds |f| to a multiple
//    of 2^-24 (to nearest even, the FPU's rounding), which leaves the half's bits in the
//    low mantissa bits of the sum.
//  - normal: the exponent rebased from 127 to 15, and the 13 dropped bits rounded to
//    nearest even (a carry out of the mantissa correctly bumps the exponent).
LLMPAR_HOST_DEVICE std::uint16_t float_to_f16_bits(float f) {
  const std::uint32_t all = bits::of(f);
  const std::uint32_t sign = (all >> 16) & 0x8000u;
  const std::uint32_t x = all & 0x7FFFFFFFu;
  const std::uint32_t special = x > 0x7F800000u ? 0x7E00u : 0x7C00u;
  const std::uint32_t subnormal = bits::of(bits::to_float(x) + 0.5f) - 0x3F000000u;
  const std::uint32_t normal = (x - (112u << 23) + 0xFFFu + ((x >> 13) & 1u)) >> 13;
  const std::uint32_t r = x >= 0x477FF000u ? special : (x < 0x38800000u ? subnormal : normal);
  return static_cast<std::uint16_t>(sign | r);
}

// IEEE binary16 bits -> float (exact), as a select of the three cases like the above.
LLMPAR_HOST_DEVICE float f16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1Fu;
  const std::uint32_t mantissa = h & 0x3FFu;
  const float subnormal =
      bits::to_float(sign | bits::of(static_cast<float>(mantissa) * 5.9604644775390625e-08f));  // 2^-24
  const float special = bits::to_float(sign | 0x7F800000u | (mantissa << 13));
  const float normal = bits::to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  return exponent == 0 ? subnormal : (exponent == 31 ? special : normal);
}

}  // namespace detail

// Brain float 16: 8 exponent bits, 7 mantissa bits.
struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  LLMPAR_HOST_DEVICE explicit bf16(float f) : bits(detail::float_to_bf16_bits(f)) {}
  LLMPAR_HOST_DEVICE explicit operator float() const { return detail::bf16_bits_to_float(bits); }
  LLMPAR_HOST_DEVICE static bf16 from_bits(std::uint16_t b) {
    bf16 v;
    v.bits = b;
    return v;
  }
};

// IEEE binary16: 5 exponent bits, 10 mantissa bits, max 65504.
struct f16 {
  std::uint16_t bits;

  f16() = default;
  LLMPAR_HOST_DEVICE explicit f16(float f) : bits(detail::float_to_f16_bits(f)) {}
  LLMPAR_HOST_DEVICE explicit operator float() const { return detail::f16_bits_to_float(bits); }
  LLMPAR_HOST_DEVICE static f16 from_bits(std::uint16_t b) {
    f16 v;
    v.bits = b;
    return v;
  }
};

static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16>);
static_assert(sizeof(f16) == 2 && std::is_trivially_copyable_v<f16>);

// Converts between any two of float, bf16, f16 (float is the hub).
template <class To, class From>
LLMPAR_HOST_DEVICE To convert(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<To, float>) {
    return static_cast<float>(x);
  } else if constexpr (std::is_same_v<From, float>) {
    return To(x);
  } else {
    return To(static_cast<float>(x));
  }
}

// The type a value stored as T is computed and accumulated in: double for double (the
// finite-difference tests of whole layers), float for everything else (float, bf16,
// f16). It is also the type of every parameter gradient ("main grads", f32 whatever the
// storage type: precision/policy.hpp says why) and of the statistics kernels keep for
// backward (LayerNorm mean and 1/std, attention log-sum-exp, losses).
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The runtime element-type tag.
enum class DType : std::uint8_t { f32, bf16, f16, i32, i64, u8 };

template <class T>
inline constexpr bool kIsFloating = std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

namespace detail {
template <class T>
inline constexpr bool kNoDType = false;
}  // namespace detail

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>)
    return DType::f32;
  else if constexpr (std::is_same_v<T, bf16>)
    return DType::bf16;
  else if constexpr (std::is_same_v<T, f16>)
    return DType::f16;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return DType::i32;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return DType::i64;
  else if constexpr (std::is_same_v<T, std::uint8_t> || std::is_same_v<T, std::byte>)
    return DType::u8;
  else
    static_assert(detail::kNoDType<T>,
                  "llmpar: this element type has no DType; use float, bf16, f16, int32, int64 or bytes");
}

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "?";
}

}  // namespace llmpar
