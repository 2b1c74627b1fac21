// llmpar/core/bits.hpp — reinterpret float and double bits, on host and device.
//
// The one place for these casts: dtype conversions and the branch-free element math
// both need them, and CUDA spells them as intrinsics while the host uses the builtin
// behind std::bit_cast (usable in a header compiled by either compiler).
#pragma once

#include <cstdint>

#include "llmpar/config.hpp"

namespace llmpar::bits {

LLMPAR_HOST_DEVICE std::uint32_t of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return __builtin_bit_cast(std::uint32_t, x);
#endif
}

LLMPAR_HOST_DEVICE std::uint64_t of(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(__double_as_longlong(x));
#else
  return __builtin_bit_cast(std::uint64_t, x);
#endif
}

LLMPAR_HOST_DEVICE float to_float(std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  return __builtin_bit_cast(float, b);
#endif
}

LLMPAR_HOST_DEVICE double to_double(std::uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(b));
#else
  return __builtin_bit_cast(double, b);
#endif
}

}  // namespace llmpar::bits
