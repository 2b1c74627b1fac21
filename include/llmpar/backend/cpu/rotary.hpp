// llmpar/backend/cpu/rotary.hpp — rotary position embeddings on q and k, in place
// (math/rotary.hpp has the convention and the frequencies).
//
// qkv (B, T, R) as the attention kernels read it (core/attention_shape.hpp): the q of the
// query heads and the k of the kv heads are the first (heads + kv_heads) · hs channels
// of a row, each head rotated alike; v is not touched. Row b·T + t is at position
// positions.position_of(t): t, or under context parallelism that row's place in the
// whole sequence.
//
// The cos/sin table (T, hs/2) is built once per call, from f32 angles as Hugging Face
// builds its own, and shared by every row and head: T · hs/2 cos and sin against
// B · T · (heads + kv_heads) · hs/2 rotations. Rows are split among threads; each
// element is written by one thread once, so the result does not depend on the thread
// count.
#pragma once

#include <cmath>
#include <cstdint>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/math/rotary.hpp"

namespace llmpar::backend::cpu {

// Rotates q and k of qkv by +angle (forward) or, with inverse, by -angle (the backward:
// carries dq and dk of the rotated values back to the projection's).
template <class T>
void rotary(T* qkv, const AttentionShape& shape, const math::RopeConfig& rope, bool inverse,
            const ChunkPositions& positions = {}) {
  using Acc = acc_t<T>;
  shape.check("rotary");
  LLMPAR_CHECK(shape.head_dim % 2 == 0, "rotary: the head size ", shape.head_dim,
               " is odd; rotary embeddings rotate pairs of channels, so choose an even head size");
  const std::int64_t half = shape.head_dim / 2, T_len = shape.seq, rows = shape.batch * shape.seq;
  const std::int64_t R = shape.row(), slots = shape.heads + shape.kv_heads;
  if (rows == 0) return;
  Buffer<Acc> table(2 * T_len * half);  // (T, hs/2) cos, then (T, hs/2) sin
  Acc* LLMPAR_RESTRICT cos_t = table.data();
  Acc* LLMPAR_RESTRICT sin_t = cos_t + T_len * half;
  for (std::int64_t i = 0; i < half; ++i) {
    const float f = math::rope_inv_freq(i, shape.head_dim, rope);
    for (std::int64_t t = 0; t < T_len; ++t) {
      const float angle = static_cast<float>(positions.position_of(t)) * f;
      cos_t[t * half + i] = static_cast<Acc>(std::cos(static_cast<Acc>(angle)));
      sin_t[t * half + i] =
          static_cast<Acc>(inverse ? -std::sin(static_cast<Acc>(angle)) : std::sin(static_cast<Acc>(angle)));
    }
  }
#pragma omp parallel for schedule(static) if (rows * slots * half >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    const Acc* LLMPAR_RESTRICT c = cos_t + (r % T_len) * half;  // (hs/2)
    const Acc* LLMPAR_RESTRICT s = sin_t + (r % T_len) * half;
    for (std::int64_t j = 0; j < slots; ++j) {
      T* LLMPAR_RESTRICT x = qkv + r * R + j * shape.head_dim;  // one head of q or k
#pragma omp simd
      for (std::int64_t i = 0; i < half; ++i) {
        Acc x0 = load(x, i), x1 = load(x, i + half);
        math::rotate_pair(x0, x1, c[i], s[i]);
        store(x, i, x0);
        store(x, i + half, x1);
      }
    }
  }
}

}  // namespace llmpar::backend::cpu
