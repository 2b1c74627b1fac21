// tests/cuda_emulation/cuda_runtime.h — stands in for the CUDA runtime's header in the
// host emulation of llmpar's kernels (cuda_emulation.hpp), so that a kernel header that
// includes <cuda_runtime.h> compiles with the host compiler alone, without a CUDA
// toolkit. Only a target that puts this folder on its include path and defines
// LLMPAR_CUDA_EMULATION sees it.
#pragma once

#if !defined(LLMPAR_CUDA_EMULATION)
#error "this <cuda_runtime.h> is the host emulation's: define LLMPAR_CUDA_EMULATION"
#endif

#include "cuda_emulation.hpp"
