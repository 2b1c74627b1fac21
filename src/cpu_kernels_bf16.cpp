// The CPU kernels over bf16, compiled once for a program built with LLMPAR_COMPILED
// (include/llmpar/backend/cpu/instances.hpp).
#include "llmpar/backend/cpu/instances.hpp"

LLMPAR_CPU_INSTANTIATE_KERNELS(bf16)
