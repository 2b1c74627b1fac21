// llmpar/backend/cpu/gelu.hpp — element-wise GELU (tanh approximation) and the gated linear
// units (SwiGLU, GeGLU), forward and backward.
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

namespace detail {
template <math::Gate G, class T>
void glu_forward_rows(T* act, const T* pre, std::int64_t rows, std::int64_t hidden) {
#pragma omp parallel for schedule(static) if (rows * hidden >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* g = pre + r * 2 * hidden;
    const T* u = g + hidden;
    T* a = act + r * hidden;
#pragma omp simd
    for (std::int64_t j = 0; j < hidden; ++j) store(a, j, math::gate<G>(load(g, j)) * load(u, j));
  }
}
template <math::Gate G, class T>
void glu_backward_rows(T* dpre, const T* dact, const T* pre, std::int64_t rows, std::int64_t hidden) {
#pragma omp parallel for schedule(static) if (rows * hidden >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* g = pre + r * 2 * hidden;
    const T* u = g + hidden;
    const T* d = dact + r * hidden;
    T* dg = dpre + r * 2 * hidden;
    T* du = dg + hidden;
#pragma omp simd
    for (std::int64_t j = 0; j < hidden; ++j) {
      const acc_t<T> x = load(g, j), dy = load(d, j);
      store(dg, j, dy * load(u, j) * math::gate_grad<G>(x));
      store(du, j, dy * math::gate<G>(x));
    }
  }
}
}  // namespace detail

// act (rows, hidden) = gate(g) · u, where each row of pre (rows, 2·hidden) holds the
// hidden gate inputs g followed by the hidden up values u. act must not overlap pre.
template <class T>
void glu_forward(T* act, const T* pre, std::int64_t rows, std::int64_t hidden, math::Gate gate) {
  if (gate == math::Gate::silu)
    detail::glu_forward_rows<math::Gate::silu>(act, pre, rows, hidden);
  else
    detail::glu_forward_rows<math::Gate::gelu>(act, pre, rows, hidden);
}

// dpre (rows, 2·hidden) = [dact · u · gate'(g), dact · gate(g)] per row (overwritten),
// from dact (rows, hidden) and the forward's pre. dpre must not overlap dact or pre.
template <class T>
void glu_backward(T* dpre, const T* dact, const T* pre, std::int64_t rows, std::int64_t hidden, math::Gate gate) {
  if (gate == math::Gate::silu)
    detail::glu_backward_rows<math::Gate::silu>(dpre, dact, pre, rows, hidden);
  else
    detail::glu_backward_rows<math::Gate::gelu>(dpre, dact, pre, rows, hidden);
}

}  // namespace llmpar::backend::cpu
