// llmpar/kernels/rotary.cuh — rotary position embeddings on q and k, in place: the CUDA
// twin of backend/cpu/rotary.hpp (math/rotary.hpp has the convention and frequencies).
//
// qkv (B, T, R) as the attention kernels read it (core/attention_shape.hpp): the first
// (heads + kv_heads) · hs channels of a row are the q and k heads, each rotated alike;
// v is not touched. Row b·T + t is at position positions.position_of(t) (t, or under
// context parallelism that row's place in the whole sequence).
//
// One thread per channel pair (i, i + hs/2) of one head of one row, in a grid-stride
// loop: it reads the two elements, rotates them in float and writes them back, so each
// element is read and written once by one thread and the kernel is a memory-bound
// stream of 2 · B · T · (heads + kv_heads) · hs elements. The angle is the CPU kernel's
// f32 product of the position and math::rope_inv_freq (computed per thread: a powf
// and a sincosf, cheaper than a table's loads); its cosine and sine are the device's
// sincosf, within 2 ulp of the host's, so the result agrees with the CPU kernel to
// float rounding, not bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/kernels/common.cuh"
#include "llmpar/kernels/elementwise.cuh"
#include "llmpar/math/rotary.hpp"

namespace llmpar::kernels {

namespace detail::rope {

// sign: +1 forward, -1 the backward (rotation by -angle).
template <Storage T>
__global__ void __launch_bounds__(detail::ew::kElementwiseThreads)
    rotary_kernel(T* qkv, AttentionShape shape, math::RopeConfig rope, ChunkPositions positions, float sign) {
  const std::int64_t half = shape.head_dim / 2, slots = shape.heads + shape.kv_heads;
  const std::int64_t per_row = slots * half;  // pairs of one row
  const std::int64_t total = shape.batch * shape.seq * per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < total; p += stride) {
    const std::int64_t r = p / per_row, within = p - r * per_row;
    const std::int64_t slot = within / half, i = within - slot * half;
    const float angle =
        static_cast<float>(positions.position_of(r % shape.seq)) * math::rope_inv_freq(i, shape.head_dim, rope);
    float s, c;
    sincosf(angle, &s, &c);
    T* x = qkv + r * shape.row() + slot * shape.head_dim;  // (hs) one head of q or k
    float x0 = load(x[i]), x1 = load(x[i + half]);
    math::rotate_pair(x0, x1, c, sign * s);
    x[i] = store<T>(x0);
    x[i + half] = store<T>(x1);
  }
}

}  // namespace detail::rope

// Rotates q and k of qkv by +angle, or with inverse by -angle (the backward).
template <Storage T>
void rotary(cudaStream_t stream, T* qkv, const AttentionShape& shape, const math::RopeConfig& rope, bool inverse,
            const ChunkPositions& positions = {}) {
  shape.check("rotary");
  LLMPAR_CHECK(shape.head_dim % 2 == 0, "rotary: the head size ", shape.head_dim,
               " is odd; rotary embeddings rotate pairs of channels, so choose an even head size");
  const std::int64_t pairs = shape.batch * shape.seq * (shape.heads + shape.kv_heads) * (shape.head_dim / 2);
  if (pairs == 0) return;
  detail::ew::check_pointer("rotary", "qkv", qkv);
  detail::rope::rotary_kernel<T><<<detail::ew::grid_for(pairs), detail::ew::kElementwiseThreads, 0, stream>>>(
      qkv, shape, rope, positions, inverse ? -1.0f : 1.0f);
  LLMPAR_CHECK_LAUNCH("rotary");
}

}  // namespace llmpar::kernels
