// The CPU kernels over f16, compiled once for a program built with LLMPAR_COMPILED
// (include/llmpar/backend/cpu/instances.hpp).
#include "llmpar/backend/cpu/instances.hpp"

LLMPAR_CPU_INSTANTIATE_KERNELS(f16)
