// llmpar/backend/cpu/common.hpp — what every CPU kernel shares.
//
// Kernels store T and compute in acc_t<T> (core/dtype.hpp): double for double storage
// (reference tests), float for everything else (float, bf16, f16). Conversions go
// through static_cast so bf16/f16 storage works unchanged. Parameter gradients are
// acc_t<T> too, whatever T is (f32 main grads).
//
// The work constants are here too so that all kernels make the same trade-offs:
// below kMinParallelWork elements an OpenMP fork/join costs more than it saves;
// deterministic accumulation hands each thread whole column tiles of kColumnTile
// elements (a whole number of cache lines, so on 64-byte aligned rows no two threads
// write the same line).
#pragma once

#include <cstdint>
#include <type_traits>

#include "llmpar/config.hpp"
#include "llmpar/core/dtype.hpp"

namespace llmpar::backend::cpu {

template <class T>
inline constexpr bool kCpuStorage = std::is_same_v<T, double> || kIsFloating<T>;

using llmpar::acc_t;

// Element i of a T array as acc_t<T>, and the store of one (round to nearest even).
// bf16 and f16 go through their 16-bit patterns: the same conversions as
// static_cast, but GCC's vectorizer handles loads and stores of std::uint16_t in an
// `omp simd` loop where it gives up on the 16-bit structs (each struct store becomes a
// per-lane temporary it cannot vectorise), and an element-wise kernel whose loop is
// scalar runs its math (GELU's exp) several times slower.
template <class T>
inline acc_t<T> load(const T* LLMPAR_RESTRICT p, std::int64_t i) {
  if constexpr (std::is_same_v<T, bf16>)
    return llmpar::detail::bf16_bits_to_float(reinterpret_cast<const std::uint16_t*>(p)[i]);
  else if constexpr (std::is_same_v<T, f16>)
    return llmpar::detail::f16_bits_to_float(reinterpret_cast<const std::uint16_t*>(p)[i]);
  else
    return p[i];
}
template <class T>
inline void store(T* LLMPAR_RESTRICT p, std::int64_t i, acc_t<T> v) {
  if constexpr (std::is_same_v<T, bf16>)
    reinterpret_cast<std::uint16_t*>(p)[i] = llmpar::detail::float_to_bf16_bits(v);
  else if constexpr (std::is_same_v<T, f16>)
    reinterpret_cast<std::uint16_t*>(p)[i] = llmpar::detail::float_to_f16_bits(v);
  else
    p[i] = v;
}

// Fewer elements than this run on the calling thread.
inline constexpr std::int64_t kMinParallelWork = std::int64_t{1} << 15;

// Columns per tile when threads own disjoint column slices (64 floats = 4 cache lines).
inline constexpr std::int64_t kColumnTile = 64;

constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace llmpar::backend::cpu
