// The CPU's gated-unit kernels (SwiGLU, GeGLU) over float, bf16 and f16, compiled once
// for a program built with LLMPAR_COMPILED, apart from the other kernels
// (include/llmpar/backend/cpu/instances.hpp says why).
#include "llmpar/backend/cpu/instances.hpp"

LLMPAR_CPU_INSTANTIATE_GLU_KERNELS(float)
LLMPAR_CPU_INSTANTIATE_GLU_KERNELS(bf16)
LLMPAR_CPU_INSTANTIATE_GLU_KERNELS(f16)
