// llmpar/backend/cpu/embedding.hpp — token + position embedding (GPT-2's encoder).
//
//   out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]
//
// Forward is a gather, parallel over the B*T output rows. Backward is a scatter-add
// into dwte, where any number of positions can hit the same token row. Atomics or
// per-thread copies of dwte would make the sums depend on the thread count (or cost
// V*C memory per thread), so threads instead own whole column tiles of C and visit
// the positions in order: every element of dwte and dwpe receives the same additions
// in the same order for any number of threads, with no workspace.
//
// Tokens must be in [0, V) for the wte of V rows: the kernels do not know V and do
// not check, so tokens are validated where they enter the program (the data loader).
// Convention: dwte and dwpe (acc_t<T>: f32 main grads for 16-bit storage) are
// accumulated into (+=).
//
// Vocabulary parallel: with `slice` = the rows [first, first + count) of the full table
// that this rank holds, wte is those rows only; a token outside the slice contributes
// zero (its row is another rank's) and receives no gradient here. The position table
// is optional (wpe = nullptr: none): a split embedding adds it on one rank only, before
// the ranks' partial rows are summed.
#pragma once

#include <algorithm>
#include <cstdint>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/slice.hpp"

namespace llmpar::backend::cpu {

// out: (B, Tlen, C); tokens: (B, Tlen); wte: (slice.count or V, C); wpe: (>= Tlen, C) or null.
template <class T>
void encoder_forward(T* LLMPAR_RESTRICT out, const std::int32_t* LLMPAR_RESTRICT tokens, const T* LLMPAR_RESTRICT wte,
                     const T* LLMPAR_RESTRICT wpe, std::int64_t B, std::int64_t Tlen, std::int64_t C,
                     RowSlice slice = {}) {
  LLMPAR_CHECK(B >= 0 && Tlen >= 0 && C >= 0, "encoder_forward: B = ", B, ", Tlen = ", Tlen, ", C = ", C,
               "; sizes must be >= 0");
  const std::int64_t positions = B * Tlen;
#pragma omp parallel for schedule(static) if (positions * C >= kMinParallelWork)
  for (std::int64_t bt = 0; bt < positions; ++bt) {
    const std::int64_t t = bt % Tlen;
    T* LLMPAR_RESTRICT o = out + bt * C;
    const bool here = slice.holds(tokens[bt]);
    if (here && wpe != nullptr) {
      const T* LLMPAR_RESTRICT token_row = wte + (tokens[bt] - slice.first) * C;
      const T* LLMPAR_RESTRICT position_row = wpe + t * C;
#pragma omp simd
      for (std::int64_t c = 0; c < C; ++c) store(o, c, load(token_row, c) + load(position_row, c));
    } else if (here) {
      std::copy_n(wte + (tokens[bt] - slice.first) * C, C, o);
    } else if (wpe != nullptr) {
      std::copy_n(wpe + t * C, C, o);
    } else {
      std::fill_n(o, C, static_cast<T>(0.0f));
    }
  }
}

// dwte: (slice.count or V, C) +=; dwpe: (>= Tlen, C) += or null; dout: (B, Tlen, C);
// tokens: (B, Tlen).
template <class T>
void encoder_backward(acc_t<T>* LLMPAR_RESTRICT dwte, acc_t<T>* LLMPAR_RESTRICT dwpe, const T* LLMPAR_RESTRICT dout,
                      const std::int32_t* LLMPAR_RESTRICT tokens, std::int64_t B, std::int64_t Tlen, std::int64_t C,
                      RowSlice slice = {}) {
  using Acc = acc_t<T>;
  LLMPAR_CHECK(B >= 0 && Tlen >= 0 && C >= 0, "encoder_backward: B = ", B, ", Tlen = ", Tlen, ", C = ", C,
               "; sizes must be >= 0");
  const std::int64_t positions = B * Tlen;
  const std::int64_t tiles = ceil_div(C, kColumnTile);
#pragma omp parallel for schedule(static) if (positions * C >= kMinParallelWork)
  for (std::int64_t tile = 0; tile < tiles; ++tile) {
    const std::int64_t c0 = tile * kColumnTile;
    const std::int64_t n = std::min(kColumnTile, C - c0);
    for (std::int64_t bt = 0; bt < positions; ++bt) {
      const T* LLMPAR_RESTRICT g = dout + bt * C + c0;
      if (slice.holds(tokens[bt])) {
        Acc* LLMPAR_RESTRICT token_row = dwte + (tokens[bt] - slice.first) * C + c0;
#pragma omp simd
        for (std::int64_t j = 0; j < n; ++j) token_row[j] += load(g, j);
      }
      if (dwpe != nullptr) {
        Acc* LLMPAR_RESTRICT position_row = dwpe + (bt % Tlen) * C + c0;
#pragma omp simd
        for (std::int64_t j = 0; j < n; ++j) position_row[j] += load(g, j);
      }
    }
  }
}

}  // namespace llmpar::backend::cpu
