// llmpar/backend/cpu/bias.hpp — the bias gradient: a column sum over rows.
//
// dbias(N) += Σ_rows dout(rows, N), summed and stored in acc_t<T> (f32 main grads for
// 16-bit dout). Threads own disjoint column blocks and walk the
// rows in order, so the sum is the same bit for bit whatever the thread count (the
// serial-equivalence tests rely on this), and the inner loop runs over contiguous
// columns, which vectorises.
#pragma once

#include <algorithm>
#include <cstdint>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"

namespace llmpar::backend::cpu {

template <class T>
void bias_backward(acc_t<T>* LLMPAR_RESTRICT dbias, const T* LLMPAR_RESTRICT dout, std::int64_t rows, std::int64_t n) {
  using Acc = acc_t<T>;
  constexpr std::int64_t kBlock = kColumnTile;
  const std::int64_t blocks = ceil_div(n, kBlock);
#pragma omp parallel for schedule(static)
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    const std::int64_t j0 = blk * kBlock;
    const std::int64_t j1 = std::min(n, j0 + kBlock);
    Acc acc[kBlock] = {};
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* row = dout + r * n;
#pragma omp simd
      for (std::int64_t j = j0; j < j1; ++j) acc[j - j0] += load(row, j);
    }
    for (std::int64_t j = j0; j < j1; ++j) dbias[j] += acc[j - j0];
  }
}

}  // namespace llmpar::backend::cpu
