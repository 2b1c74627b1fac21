// llmpar/backend/cpu/elementwise.hpp — residual add, add in place, scale in place.
//
// Memory-bound streams: `parallel for simd` over the flat range, computing in acc_t<T>
// (so bf16/f16 storage rounds once per element). Each element is independent, so the
// result is the same for any thread count. Small tensors stay on the calling thread
// (kMinParallelWork), where a fork/join would cost more than the work.
//
// Aliasing: out may equal a or b in add(); anything else must not overlap.
#pragma once

#include <cstdint>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"

namespace llmpar::backend::cpu {

// out[i] = a[i] + b[i] (the residual connection).
template <class T>
void add(T* out, const T* a, const T* b, std::int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (std::int64_t i = 0; i < n; ++i) store(out, i, load(a, i) + load(b, i));
}

// a[i] += b[i] (gradient of a residual branch into the stream).
template <class T>
void add_inplace(T* LLMPAR_RESTRICT a, const T* LLMPAR_RESTRICT b, std::int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (std::int64_t i = 0; i < n; ++i) store(a, i, load(a, i) + load(b, i));
}

// a[i] *= s (gradient clipping, loss-scale removal, averaging).
template <class T>
void scale_inplace(T* LLMPAR_RESTRICT a, acc_t<T> s, std::int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (std::int64_t i = 0; i < n; ++i) store(a, i, load(a, i) * s);
}

}  // namespace llmpar::backend::cpu
