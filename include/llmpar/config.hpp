// llmpar/config.hpp — included first by every llmpar header.
//
// One macro decides how shared math is compiled: under nvcc it is __host__ __device__
// so the CUDA kernels call the same functions as the CPU kernels; without nvcc it is a
// plain `inline`, which lets the CPU-only CI unit-test every line of that math.
#pragma once

#include <cstddef>

#if defined(__CUDACC__)
#define LLMPAR_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LLMPAR_HOST_DEVICE inline
#endif

#if defined(__GNUC__) || defined(__clang__)
// A function on an error path: optimised for size, never inlined into its callers.
#define LLMPAR_COLD __attribute__((cold, noinline))
#define LLMPAR_RESTRICT __restrict__
#else
#define LLMPAR_COLD
#define LLMPAR_RESTRICT
#endif

namespace llmpar {

// The library's version (CMakeLists.txt's project VERSION; test_core checks they agree),
// recorded in every checkpoint.
inline constexpr const char* kVersion = "0.1.0";

// Alignment of every host allocation: one cache line, and a full AVX-512 vector.
inline constexpr std::size_t kHostAlignment = 64;

}  // namespace llmpar
