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

// Two ways to compile llmpar's host code. Header-only (the default): every
// translation unit compiles what it calls. Compiled: a program defines LLMPAR_COMPILED
// in every translation unit and links llmpar's compiled part (src/, the CMake target
// llmpar_compiled), which holds the policy-independent code once: the CPU kernels for
// float, bf16 and f16 (backend/cpu/instances.hpp declares them `extern template`) and
// the bodies that headers keep in a `-inl.hpp` file (included by the header unless
// LLMPAR_COMPILED is defined). Those bodies are LLMPAR_INLINE: `inline` when a header
// includes them, and ordinary definitions in the one source of src/ that compiles them
// (a program defining LLMPAR_COMPILED includes no `-inl.hpp` file itself). What is
// compiled once must mean the same in every translation unit of the program, whatever
// the unit's engines: no body there takes a comm::Comm, whose alternatives depend on
// LLMPAR_WITH_MPI and LLMPAR_WITH_NCCL (comm/init.hpp), which a CUDA program's units set
// and its CPU units may not.
#if defined(LLMPAR_COMPILED)
#define LLMPAR_INLINE
#else
#define LLMPAR_INLINE inline
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
