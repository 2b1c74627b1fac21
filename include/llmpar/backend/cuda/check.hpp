// llmpar/backend/cuda/check.hpp — LLMPAR_CHECK_CUDA, the CUDA member of the error macro family.
//
// A failed CUDA runtime call throws llmpar::Error with file:line, the call, the error's
// name and description, and any message parts the caller adds. The non-sticky error
// state that the runtime keeps for cudaGetLastError() is cleared on the way out, so a
// caller that catches the error and goes on does not see it again at its next launch
// check. (Sticky errors, such as an illegal address, leave the context unusable; every
// later call reports them again, which is the truth.)
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "llmpar/core/error.hpp"

namespace llmpar::detail {

template <class... Args>
[[noreturn]] void throw_cuda_error(const char* file, int line, const char* expr, cudaError_t status, Args&&... args) {
  static_cast<void>(cudaGetLastError());
  if constexpr (sizeof...(Args) == 0) {
    throw_error(file, line, expr, "CUDA error ", cudaGetErrorName(status), ": ", cudaGetErrorString(status));
  } else {
    throw_error(file, line, expr, "CUDA error ", cudaGetErrorName(status), ": ", cudaGetErrorString(status), "; ",
                std::forward<Args>(args)...);
  }
}

}  // namespace llmpar::detail

// LLMPAR_CHECK_CUDA(call, message parts...): throws llmpar::Error when `call` does not
// return cudaSuccess. The message parts are optional.
#define LLMPAR_CHECK_CUDA(call, ...)                                                                                 \
  do {                                                                                                               \
    const cudaError_t llmpar_cuda_status_ = (call);                                                                  \
    if (llmpar_cuda_status_ != cudaSuccess) [[unlikely]]                                                             \
      ::llmpar::detail::throw_cuda_error(__FILE__, __LINE__, #call, llmpar_cuda_status_ __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)
