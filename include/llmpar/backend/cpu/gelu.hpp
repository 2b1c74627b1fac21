// llmpar/backend/cpu/gelu.hpp — element-wise GELU (tanh approximation), forward and backward.
//
// The formula is math::gelu_tanh / math::gelu_tanh_grad, shared with CUDA. Both loops
// are `parallel for simd`: the float path of that math is built from a libm-free exp,
// so GCC turns the loop into vector code instead of one scalar tanh per element
// (several times faster; GELU runs on the 4C-wide MLP activation of every token, in
// forward and backward). Element-wise, so the result does not depend on the thread
// count.
//
// Aliasing: out may equal x, and dx may equal dout (in place), since each element is
// read before it is written and no other element is touched; otherwise no overlap.
// Convention: dx is overwritten, not accumulated.
#pragma once

#include <cstdint>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/math/activation.hpp"

namespace llmpar::backend::cpu {

// out[i] = gelu(x[i]) for i in [0, n).
template <class T>
void gelu_forward(T* out, const T* x, std::int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (std::int64_t i = 0; i < n; ++i) store(out, i, math::gelu_tanh(load(x, i)));
}

// dx[i] = dout[i] * gelu'(x[i]) for i in [0, n).
template <class T>
void gelu_backward(T* dx, const T* LLMPAR_RESTRICT x, const T* dout, std::int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (std::int64_t i = 0; i < n; ++i) store(dx, i, load(dout, i) * math::gelu_tanh_grad(load(x, i)));
}

}  // namespace llmpar::backend::cpu
