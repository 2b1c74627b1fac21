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

// Fewer elements than this run on the calling thread.
inline constexpr std::int64_t kMinParallelWork = std::int64_t{1} << 15;

// Columns per tile when threads own disjoint column slices (64 floats = 4 cache lines).
inline constexpr std::int64_t kColumnTile = 64;

constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace llmpar::backend::cpu
