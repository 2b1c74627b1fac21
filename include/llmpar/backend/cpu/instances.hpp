// llmpar/backend/cpu/instances.hpp — the CPU kernels compiled once per program.
//
// Two ways to compile the CPU backend, as for backend::Cuda (backend/cuda/backend.hpp):
//   - Header-only (the default): every translation unit that trains compiles the
//     kernels it calls, and nothing else is needed.
//   - Compiled (config.hpp): the program's translation units define LLMPAR_COMPILED,
//     so they see the explicit instantiation declarations below for float, bf16 and
//     f16 (and compile no kernel of those types), and one source per type expands
//     LLMPAR_CPU_INSTANTIATE_KERNELS(T) at global scope (src/cpu_kernels_*.cpp, in
//     the llmpar_compiled library that this project's programs link): the kernels are
//     compiled three times, not once per test, example and benchmark. double (the
//     gradient checks' type) stays header-only either way.
//
// The list names every kernel that backend::Cpu (backend/cpu/backend.hpp) and
// optim::AdamW's CPU part run, by the signature it is defined with.
#pragma once

#include <cstdint>

#include "llmpar/backend/cpu/adamw.hpp"
#include "llmpar/backend/cpu/attention.hpp"
#include "llmpar/backend/cpu/bias.hpp"
#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/backend/cpu/convert.hpp"
#include "llmpar/backend/cpu/cross_entropy.hpp"
#include "llmpar/backend/cpu/elementwise.hpp"
#include "llmpar/backend/cpu/embedding.hpp"
#include "llmpar/backend/cpu/gelu.hpp"
#include "llmpar/backend/cpu/gemm.hpp"
#include "llmpar/backend/cpu/layernorm.hpp"
#include "llmpar/backend/cpu/reduce.hpp"
#include "llmpar/backend/cpu/rmsnorm.hpp"
#include "llmpar/backend/cpu/rotary.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/slice.hpp"
#include "llmpar/math/adamw.hpp"

// The kernels over storage type T (float, bf16 or f16, the last two unqualified):
// MODE is `extern` (declarations) or empty (the definitions). A GEMM into f32 main
// gradients (gemm<T, float>) is listed by LLMPAR_CPU_KERNELS_MAIN_GRAD_ for the 16-bit
// types only, since for float it is gemm<float, float>.
#define LLMPAR_CPU_KERNELS_(MODE, T)                                                                                   \
  namespace llmpar::backend::cpu {                                                                                     \
  MODE template void gemm<T, T>(Context&, T*, const T*, const T*, const T*, std::int64_t, std::int64_t, std::int64_t,  \
                                GemmOp);                                                                               \
  MODE template void layernorm_forward<T>(T*, acc_t<T>*, acc_t<T>*, const T*, const T*, const T*, std::int64_t,        \
                                          std::int64_t, float);                                                        \
  MODE template void layernorm_backward<T>(T*, acc_t<T>*, acc_t<T>*, const T*, const T*, const T*, const acc_t<T>*,    \
                                           const acc_t<T>*, std::int64_t, std::int64_t);                               \
  MODE template void rmsnorm_forward<T>(T*, acc_t<T>*, const T*, const T*, std::int64_t, std::int64_t, float);         \
  MODE template void rmsnorm_backward<T>(T*, acc_t<T>*, const T*, const T*, const T*, const acc_t<T>*, std::int64_t,   \
                                         std::int64_t);                                                                \
  MODE template void residual_rmsnorm_forward<T>(T*, acc_t<T>*, T*, const T*, const T*, std::int64_t, std::int64_t,    \
                                                 float);                                                               \
  MODE template void residual_rmsnorm_backward<T>(T*, acc_t<T>*, const T*, const T*, const T*, const T*,               \
                                                  const acc_t<T>*, std::int64_t, std::int64_t);                        \
  MODE template void attention_forward<T>(T*, acc_t<T>*, const T*, const AttentionShape&);                             \
  MODE template void attention_backward<T>(T*, const T*, const T*, const T*, const acc_t<T>*, const AttentionShape&);  \
  MODE template void gelu_forward<T>(T*, const T*, std::int64_t);                                                      \
  MODE template void gelu_backward<T>(T*, const T*, const T*, std::int64_t);                                           \
  MODE template void add<T>(T*, const T*, const T*, std::int64_t);                                                     \
  MODE template void add_inplace<T>(T*, const T*, std::int64_t);                                                       \
  MODE template void scale_inplace<T>(T*, acc_t<T>, std::int64_t);                                                     \
  MODE template void bias_backward<T>(acc_t<T>*, const T*, std::int64_t, std::int64_t);                                \
  MODE template void encoder_forward<T>(T*, const std::int32_t*, const T*, const T*, std::int64_t, std::int64_t,       \
                                        std::int64_t, RowSlice);                                                       \
  MODE template void encoder_backward<T>(acc_t<T>*, acc_t<T>*, const T*, const std::int32_t*, std::int64_t,            \
                                         std::int64_t, std::int64_t, RowSlice);                                        \
  MODE template void cross_entropy_forward_backward<T>(T*, acc_t<T>*, const std::int32_t*, std::int64_t, std::int64_t, \
                                                       std::int64_t, acc_t<T>);                                        \
  MODE template void cross_entropy_forward<T>(acc_t<T>*, const T*, const std::int32_t*, std::int64_t, std::int64_t,    \
                                              std::int64_t);                                                           \
  MODE template void vocab_parallel_cross_entropy_stats<T>(acc_t<T>*, const T*, const std::int32_t*, std::int64_t,     \
                                                           std::int64_t, std::int64_t, std::int64_t);                  \
  MODE template void vocab_parallel_cross_entropy_finish<T>(T*, acc_t<T>*, const T*, const acc_t<T>*, int,             \
                                                            const std::int32_t*, std::int64_t, std::int64_t,           \
                                                            std::int64_t, std::int64_t, acc_t<T>);                     \
  MODE template void convert<T, float>(T*, const float*, std::int64_t);                                                \
  MODE template void convert<T, bf16>(T*, const bf16*, std::int64_t);                                                  \
  MODE template void convert<T, f16>(T*, const f16*, std::int64_t);                                                    \
  MODE template double sum_of_squares<T>(const T*, std::int64_t);                                                      \
  MODE template void detail::adamw_elements<float, T>(float*, T*, float*, float*, const float*, std::int64_t,          \
                                                      const math::AdamWParams&, int, float, const char*);              \
  }

#define LLMPAR_CPU_KERNELS_MAIN_GRAD_(MODE, T)                                                                  \
  namespace llmpar::backend::cpu {                                                                              \
  MODE template void gemm<T, float>(Context&, float*, const T*, const T*, const T*, std::int64_t, std::int64_t, \
                                    std::int64_t, GemmOp);                                                      \
  }

// The gated units (SwiGLU, GeGLU) and the rotary embedding over T (what a Llama block
// adds to GPT-2's kernels), compiled in a translation unit of their own
// (src/cpu_kernels_glu.cpp): GELU and the gates share math::exp, and compiled beside
// the other kernels they changed GCC's inlining of it there, which moved fp16 tp 2
// runs of train_gpt by an ulp from step 5. Kept apart, the other kernels compile as
// they did, and their numbers do not depend on what else a unit holds.
#define LLMPAR_CPU_GLU_KERNELS_(MODE, T)                                                                         \
  namespace llmpar::backend::cpu {                                                                               \
  MODE template void glu_forward<T>(T*, const T*, std::int64_t, std::int64_t, math::Gate);                       \
  MODE template void glu_backward<T>(T*, const T*, const T*, std::int64_t, std::int64_t, math::Gate);            \
  MODE template void rotary<T>(T*, const AttentionShape&, const math::RopeConfig&, bool, const ChunkPositions&); \
  }
#define LLMPAR_CPU_INSTANTIATE_GLU_KERNELS(T) LLMPAR_CPU_GLU_KERNELS_(, T)

// LLMPAR_CPU_INSTANTIATE_KERNELS(T): compiles every CPU kernel over storage type T
// (float, bf16 or f16, the last two unqualified) in this translation unit. Expand it at
// global scope in one .cpp per type of a program whose translation units define
// LLMPAR_COMPILED.
#define LLMPAR_CPU_INSTANTIATE_KERNELS(T) LLMPAR_CPU_INSTANTIATE_KERNELS_##T
#define LLMPAR_CPU_INSTANTIATE_KERNELS_float LLMPAR_CPU_KERNELS_(, float)
#define LLMPAR_CPU_INSTANTIATE_KERNELS_bf16 \
  LLMPAR_CPU_KERNELS_(, bf16)               \
  LLMPAR_CPU_KERNELS_MAIN_GRAD_(, bf16)
#define LLMPAR_CPU_INSTANTIATE_KERNELS_f16 \
  LLMPAR_CPU_KERNELS_(, f16)               \
  LLMPAR_CPU_KERNELS_MAIN_GRAD_(, f16)

#if defined(LLMPAR_COMPILED)
LLMPAR_CPU_KERNELS_(extern, float)
LLMPAR_CPU_KERNELS_(extern, bf16)
LLMPAR_CPU_KERNELS_(extern, f16)
LLMPAR_CPU_KERNELS_MAIN_GRAD_(extern, bf16)
LLMPAR_CPU_KERNELS_MAIN_GRAD_(extern, f16)
LLMPAR_CPU_GLU_KERNELS_(extern, float)
LLMPAR_CPU_GLU_KERNELS_(extern, bf16)
LLMPAR_CPU_GLU_KERNELS_(extern, f16)
#endif
