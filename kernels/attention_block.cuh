// llmpar/kernels/attention_block.cuh — attention one block at a time on CUDA: the
// queries of one chunk of a sequence against the keys and values of another, as ring
// attention (context parallelism, nn/context_parallel.hpp) computes it.
//
// The CUDA twin of backend/cpu/attention_block.hpp, with its layouts and its contract
// (core/attention_shape.hpp: AttentionShape, AttentionBlock, AttentionState): the
// forward keeps each query row's flash-attention state across blocks (o unnormalised
// (B, S, NH hs), the running max m and sum l (B, NH, S), all float), folded in by
// attention_block_forward once per block, from attention_state_init's (0, -inf, 0) to
// attention_state_finish's out = o / l and lse = m + log l. The backward needs only the
// final lse and D = dout . out (attention_dsum); each block adds its dq into a float
// (B, S, NH hs) buffer and its dk, dv into a float (B, kv_seq, 2 KVH hs) buffer (dk at
// g hs, dv at KVH hs + g hs of a row), so blocks accumulate in the order they are queued.
// A block is the diagonal one (causal: key j visible to query i iff j <= i, both counted
// from the block's first row) or one whose keys all precede its queries (no mask).
//
// Why these kernels are kernels/attention.cuh's SIMT kernels with other addresses: a
// block is a whole-sequence attention problem of len rows in which the queries come
// from rows [q_first, q_first + len) of qkv, the keys and values from rows
// [kv_first, kv_first + len) of a buffer with its own row stride and column offsets,
// and the output and its gradients are read-modify-written instead of written. So the
// same tiles (Tiles<kHs>), the same shared-memory staging (load_tile), the same
// lane-per-key dot products and lane-per-column accumulators (dot_rows, axpy_lanes),
// the same D kernel (dsum_kernel, as is) and the same head-size buckets and masks
// (with_head_size, with_mask) are reused from there; what is new is where each row
// is, and that o, m, l (forward) and dq, dk, dv (backward) start from what the buffers
// hold. Grids, as there:
//   - forward: one CTA per (query tile of the block, b*NH + h); each warp loads its
//     rows' o, m and l into registers, streams the block's key tiles of kv head
//     h % KVH, and stores them back;
//   - dk, dv: one CTA per (key tile of the block, b*KVH + g); the group's query heads
//     inside each query tile, in order, summed in registers, then added once to dkv;
//   - dq: one CTA per (query tile, b*NH + h), the key tiles in order, added once to dq.
// Each element of every output belongs to one thread of one CTA, so the adds need no
// atomics and every sum has a fixed order: results are bitwise reproducible, and agree
// with the CPU kernels to float rounding (their tiles differ). Not done: the
// tensor-core forward (mma.sync) of attention.cuh for 16-bit storage; a fused dq/dk/dv.
//
// Validation without a GPU: test_cuda_emulation_attention_block (a cpu test) runs these
// kernels in the host emulation (tests/cuda_emulation) against the CPU block kernels and,
// composed into rings of 2 and 4 ranks, against the whole-sequence CPU kernels;
// tests/cuda/test_cuda_attention_block.cu does the same on a GPU.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "llmpar/backend/cuda/check.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/kernels/attention.cuh"
#include "llmpar/kernels/common.cuh"
#include "llmpar/math/exp.hpp"
#include "llmpar/math/online_softmax.hpp"

namespace llmpar::kernels {

namespace detail::attn_block {

using attn::kKeyTile;
using attn::kRowTile;
using attn::kThreads;
using attn::kWarps;
using attn::Tiles;

// CTAs per SM each kernel asks registers for (__launch_bounds__' second argument), as
// Tiles' for the whole-sequence kernels: 0 leaves the count to ptxas, and where it chose
// 168 registers and spilled (nvcc 13, sm_90a: the forward at kHs 32 and 256, dk/dv at
// 64, which keep more addresses live than their whole-sequence twins), 2 lets them have
// 255, with nothing spilled.
template <int kHs>
struct MinBlocks {
  static constexpr int kForward = kHs == 32 || kHs == 256 ? 2 : Tiles<kHs>::kForwardMinBlocks;
  static constexpr int kDq = Tiles<kHs>::kDqMinBlocks;
  static constexpr int kDkv = kHs == 64 ? 2 : Tiles<kHs>::kDkvMinBlocks;
};

// Checks what the block kernels take, on the host: the whole-sequence kernels' head
// sizes and grid limits (a block's len <= seq rows needs no more), and the block's fit.
inline void check_block(const char* who, const AttentionShape& shape, const AttentionBlock& blk) {
  attn::check_shape(who, shape);
  blk.check(shape, who);
}

#if defined(LLMPAR_DEVICE_CODE)

// o (n_o) = 0, m (n_ml) = -inf, l (n_ml) = 0. Grid-stride: any grid covers them. (A
// template, Acc = float, so that every translation unit may define it.)
template <class Acc>
__global__ void __launch_bounds__(kThreads)
    state_init_kernel(Acc* LLMPAR_RESTRICT o, Acc* LLMPAR_RESTRICT m, Acc* LLMPAR_RESTRICT l, std::int64_t n_o,
                      std::int64_t n_ml) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_o; i += stride)
    o[i] = Acc(0);
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_ml; i += stride) {
    m[i] = Acc(-INFINITY);
    l[i] = Acc(0);
  }
}

// The block's keys and values folded into the state of its queries.
// Grid: (B*NH, query tiles of the block), the last tile (most keys, causal) first.
// Block: kThreads. Dynamic shared memory: kForwardSmem floats.
// st.o: (B, S, NH hs); st.m, st.l: (B, NH, S); qkv: (B, S, R); kv: (B, kv_seq, kv_stride).
template <class T, int kHs, AttentionMask kMask>
__global__ void __launch_bounds__(kThreads, MinBlocks<kHs>::kForward)
    block_forward_kernel(float* LLMPAR_RESTRICT st_o, float* LLMPAR_RESTRICT st_m, float* LLMPAR_RESTRICT st_l,
                         const T* LLMPAR_RESTRICT qkv, const T* LLMPAR_RESTRICT kv, AttentionShape shape,
                         AttentionBlock blk) {
  using Tl = Tiles<kHs>;
  constexpr int kRows = Tl::kRowsPerWarp;
  constexpr int kE = Tl::kPerLane;
  constexpr int kPadded = Tl::kPadded;
  constexpr bool kCausal = kMask == AttentionMask::causal;
  float* qs = dynamic_shared_memory<float>();  // (kQueryTile, kHs) this CTA's q rows
  float* ks = qs + Tl::kQueryTile * kHs;       // (kKeyTile, kPadded) key tile
  float* vs = ks + kKeyTile * kPadded;         // (kKeyTile, kHs) value tile
  float* ps = vs + kKeyTile * kHs;             // (kWarps, kRows, kKeyTile) weights

  const std::int64_t S = shape.seq, R = shape.row(), Q = shape.q_dim(), L = blk.len;
  const int hs = static_cast<int>(shape.head_dim);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t bh = blockIdx.x;
  const std::int64_t b = bh / shape.heads;
  const std::int64_t h = bh % shape.heads;
  const std::int64_t g = shape.kv_head_of(h);
  const std::int64_t i0 = static_cast<std::int64_t>(gridDim.y - 1 - blockIdx.y) * Tl::kQueryTile;  // block rows
  const int ni = static_cast<int>(std::min<std::int64_t>(Tl::kQueryTile, L - i0));
  const std::int64_t qrow0 = b * S + blk.q_first;                           // the block's first query row
  const T* qh = qkv + qrow0 * R + shape.q_col(h);                           // (L, hs) at stride R
  const T* kv_rows = kv + (b * blk.kv_seq + blk.kv_first) * blk.kv_stride;  // (L, kv_stride)
  const T* kh = kv_rows + blk.k_offset + g * hs;                            // (L, hs) at stride kv_stride
  const T* vh = kv_rows + blk.v_offset + g * hs;                            // (L, hs) at stride kv_stride
  const std::int64_t state0 = (b * shape.heads + h) * S + blk.q_first;      // m, l of the block's first row
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));

  attn::load_tile<kHs, Tl::kQueryTile, kHs>(qs, qh + i0 * R, R, ni, hs);

  const std::int64_t r0 = i0 + warp * kRows;  // this warp's first row, in the block
  const float* qw = qs + warp * kRows * kHs;  // (kRows, kHs) this warp's q rows
  float* pw = ps + warp * kRows * kKeyTile;   // (kRows, kKeyTile) this warp's weights
  float o[kRows][kE];                         // unnormalised output, columns lane + 32 e
  math::OnlineSoftmax<float> state[kRows];    // identical in every lane
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const bool row_ok = r0 + r < L;
    const float* orow = st_o + (qrow0 + r0 + r) * Q + h * hs;
#pragma unroll
    for (int e = 0; e < kE; ++e) o[r][e] = row_ok && lane + kWarp * e < hs ? orow[lane + kWarp * e] : 0.0f;
    if (row_ok) {
      state[r].max = st_m[state0 + r0 + r];
      state[r].sum = st_l[state0 + r0 + r];
    }
  }
  const std::int64_t key_end = kCausal ? std::min<std::int64_t>(L, i0 + Tl::kQueryTile) : L;

  for (std::int64_t j0 = 0; j0 < key_end; j0 += kKeyTile) {
    const int nj = static_cast<int>(std::min<std::int64_t>(kKeyTile, L - j0));
    __syncthreads();  // the previous tile's ks and vs are no longer read
    attn::load_tile<kHs, kKeyTile, kPadded>(ks, kh + j0 * blk.kv_stride, blk.kv_stride, nj, hs);
    attn::load_tile<kHs, kKeyTile, kHs>(vs, vh + j0 * blk.kv_stride, blk.kv_stride, nj, hs);
    __syncthreads();                               // ks, vs (and, at the first tile, qs) are written
    if (r0 >= L) continue;                         // this warp's rows are all padding
    if (kCausal && j0 > r0 + kRows - 1) continue;  // every key is after every row of this warp

    float s[kRows] = {};  // s[r] = q_r . k_{j0 + lane}
    attn::dot_rows<kHs, kRows>(s, qw, ks + lane * kPadded);
    const std::int64_t j = j0 + lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool valid = lane < nj && (!kCausal || j <= r0 + r);
      const float x = valid ? s[r] * scale : -INFINITY;
      const float tile_max = warp_max(x);
      math::OnlineSoftmax<float>& sm = state[r];
      if (tile_max > sm.max) {
        const float factor = sm.rescale(tile_max);
#pragma unroll
        for (int e = 0; e < kE; ++e) o[r][e] *= factor;
      }
      // A masked key weighs 0 (never exp(-inf - max): max is -inf while nothing is seen).
      const float p = valid ? math::exp(x - sm.max) : 0.0f;
      sm.sum += warp_sum(p);
      pw[r * kKeyTile + lane] = p;
    }
    __syncwarp();  // pw is written
    attn::axpy_lanes<kHs, kRows, kHs>(o, pw, vs, lane);
    __syncwarp();  // pw is read before the next tile overwrites it
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r0 + r >= L) break;
    float* orow = st_o + (qrow0 + r0 + r) * Q + h * hs;  // (hs)
#pragma unroll
    for (int e = 0; e < kE; ++e)
      if (lane + kWarp * e < hs) orow[lane + kWarp * e] = o[r][e];
    if (lane == 0) {
      st_m[state0 + r0 + r] = state[r].max;
      st_l[state0 + r0 + r] = state[r].sum;
    }
  }
}

// out = o / l, lse = m + log l: one warp per (b, h, t) row, lane l on columns l, l + 32, ...
// Grid: ceil(B*NH*S / kWarps). out: (B, S, NH hs); lse, st.m, st.l: (B, NH, S); st.o as out.
template <class T>
__global__ void __launch_bounds__(kThreads)
    state_finish_kernel(T* LLMPAR_RESTRICT out, float* LLMPAR_RESTRICT lse, const float* LLMPAR_RESTRICT st_o,
                        const float* LLMPAR_RESTRICT st_m, const float* LLMPAR_RESTRICT st_l, std::int64_t rows,
                        AttentionShape shape) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  if (row >= rows) return;  // the whole warp: its lanes share the row
  const std::int64_t bh = row / shape.seq;
  const std::int64_t t = row % shape.seq;
  const std::int64_t offset =
      ((bh / shape.heads) * shape.seq + t) * shape.q_dim() + (bh % shape.heads) * shape.head_dim;
  const math::OnlineSoftmax<float> st{st_m[row], st_l[row]};
  const float inv = 1.0f / st.sum;
  for (int d = lane; d < shape.head_dim; d += kWarp) out[offset + d] = store<T>(st_o[offset + d] * inv);
  if (lane == 0) lse[row] = st.log_sum_exp();
}

// dq += the block's query gradients. Grid: (B*NH, query tiles of the block), last tile
// first. Dynamic shared memory: kDqSmem floats. dq, dout: (B, S, NH hs); qkv: (B, S, R);
// kv: (B, kv_seq, kv_stride); lse, dsum: (B, NH, S).
template <class T, int kHs, AttentionMask kMask>
__global__ void __launch_bounds__(kThreads, MinBlocks<kHs>::kDq)
    block_backward_dq_kernel(float* LLMPAR_RESTRICT dq, const T* LLMPAR_RESTRICT dout, const T* LLMPAR_RESTRICT qkv,
                             const T* LLMPAR_RESTRICT kv, const float* LLMPAR_RESTRICT lse,
                             const float* LLMPAR_RESTRICT dsum, AttentionShape shape, AttentionBlock blk) {
  using Tl = Tiles<kHs>;
  constexpr int kRows = Tl::kRowsPerWarp;
  constexpr int kE = Tl::kPerLane;
  constexpr int kPadded = Tl::kPadded;
  constexpr bool kCausal = kMask == AttentionMask::causal;
  float* qs = dynamic_shared_memory<float>();  // (kQueryTile, kHs) q rows
  float* gs = qs + Tl::kQueryTile * kHs;       // (kQueryTile, kHs) dout rows
  float* ks = gs + Tl::kQueryTile * kHs;       // (kKeyTile, kPadded) key tile
  float* vs = ks + kKeyTile * kPadded;         // (kKeyTile, kPadded) value tile
  float* dss = vs + kKeyTile * kPadded;        // (kWarps, kRows, kKeyTile) ds * scale

  const std::int64_t S = shape.seq, R = shape.row(), Q = shape.q_dim(), L = blk.len;
  const int hs = static_cast<int>(shape.head_dim);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t bh = blockIdx.x;
  const std::int64_t b = bh / shape.heads;
  const std::int64_t h = bh % shape.heads;
  const std::int64_t g = shape.kv_head_of(h);
  const std::int64_t i0 = static_cast<std::int64_t>(gridDim.y - 1 - blockIdx.y) * Tl::kQueryTile;
  const int ni = static_cast<int>(std::min<std::int64_t>(Tl::kQueryTile, L - i0));
  const std::int64_t qrow0 = b * S + blk.q_first;
  const T* kv_rows = kv + (b * blk.kv_seq + blk.kv_first) * blk.kv_stride;  // (L, kv_stride)
  const T* kh = kv_rows + blk.k_offset + g * hs;                            // (L, hs) at stride kv_stride
  const T* vh = kv_rows + blk.v_offset + g * hs;
  const std::int64_t state0 = (b * shape.heads + h) * S + blk.q_first;  // lse, dsum of the block's first row
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));

  attn::load_tile<kHs, Tl::kQueryTile, kHs>(qs, qkv + (qrow0 + i0) * R + shape.q_col(h), R, ni, hs);
  attn::load_tile<kHs, Tl::kQueryTile, kHs>(gs, dout + (qrow0 + i0) * Q + h * hs, Q, ni, hs);

  const std::int64_t r0 = i0 + warp * kRows;   // this warp's first row, in the block
  const float* qw = qs + warp * kRows * kHs;   // (kRows, kHs)
  const float* gw = gs + warp * kRows * kHs;   // (kRows, kHs)
  float* dsw = dss + warp * kRows * kKeyTile;  // (kRows, kKeyTile)
  float l[kRows];                              // lse of each row (0 for padding rows)
  float D[kRows];                              // dout . out of each row
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const bool row_ok = r0 + r < L;
    l[r] = row_ok ? lse[state0 + r0 + r] : 0.0f;
    D[r] = row_ok ? dsum[state0 + r0 + r] : 0.0f;
  }
  float acc[kRows][kE] = {};
  const std::int64_t key_end = kCausal ? std::min<std::int64_t>(L, i0 + Tl::kQueryTile) : L;

  for (std::int64_t j0 = 0; j0 < key_end; j0 += kKeyTile) {
    const int nj = static_cast<int>(std::min<std::int64_t>(kKeyTile, L - j0));
    __syncthreads();  // the previous tile's ks and vs are no longer read
    attn::load_tile<kHs, kKeyTile, kPadded>(ks, kh + j0 * blk.kv_stride, blk.kv_stride, nj, hs);
    attn::load_tile<kHs, kKeyTile, kPadded>(vs, vh + j0 * blk.kv_stride, blk.kv_stride, nj, hs);
    __syncthreads();  // ks, vs (and, at the first tile, qs and gs) are written
    if (r0 >= L) continue;
    if (kCausal && j0 > r0 + kRows - 1) continue;

    float s[kRows] = {};   // q_r . k_{j0 + lane}
    float dp[kRows] = {};  // dout_r . v_{j0 + lane}
    attn::dot_rows<kHs, kRows>(s, qw, ks + lane * kPadded);
    attn::dot_rows<kHs, kRows>(dp, gw, vs + lane * kPadded);
    const std::int64_t j = j0 + lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool valid = lane < nj && (!kCausal || j <= r0 + r);
      const float p = valid ? math::exp(s[r] * scale - l[r]) : 0.0f;
      dsw[r * kKeyTile + lane] = p * (dp[r] - D[r]) * scale;
    }
    __syncwarp();  // dsw is written
    attn::axpy_lanes<kHs, kRows, kPadded>(acc, dsw, ks, lane);
    __syncwarp();  // dsw is read before the next tile overwrites it
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r0 + r >= L) break;
    float* drow = dq + (qrow0 + r0 + r) * Q + h * hs;  // (hs) dq of the row
#pragma unroll
    for (int e = 0; e < kE; ++e)
      if (lane + kWarp * e < hs) drow[lane + kWarp * e] += acc[r][e];
  }
}

// dk, dv += the block's key and value gradients, each kv head's summed over the query
// heads h = g, g + KVH, ... that read it. Grid: (B*KVH, key tiles of kKeyTileBwd), the
// first key tile first. Dynamic shared memory: kDkvSmem floats. dkv: (B, kv_seq, 2 KVH hs);
// the rest as block_backward_dq_kernel.
template <class T, int kHs, AttentionMask kMask>
__global__ void __launch_bounds__(kThreads, MinBlocks<kHs>::kDkv)
    block_backward_dkv_kernel(float* LLMPAR_RESTRICT dkv, const T* LLMPAR_RESTRICT dout, const T* LLMPAR_RESTRICT qkv,
                              const T* LLMPAR_RESTRICT kv, const float* LLMPAR_RESTRICT lse,
                              const float* LLMPAR_RESTRICT dsum, AttentionShape shape, AttentionBlock blk) {
  using Tl = Tiles<kHs>;
  constexpr int kKeys = Tl::kKeysPerWarp;
  constexpr int kE = Tl::kPerLane;
  constexpr int kPadded = Tl::kPadded;
  constexpr bool kCausal = kMask == AttentionMask::causal;
  float* kown = dynamic_shared_memory<float>();  // (kKeyTileBwd, kHs) this CTA's key rows
  float* vown = kown + Tl::kKeyTileBwd * kHs;    // (kKeyTileBwd, kHs) its value rows
  float* qs = vown + Tl::kKeyTileBwd * kHs;      // (kRowTile, kPadded) query tile
  float* gs = qs + kRowTile * kPadded;           // (kRowTile, kPadded) dout tile
  float* ps = gs + kRowTile * kPadded;           // (kWarps, kKeys, kRowTile) p
  float* dss = ps + Tl::kKeyTileBwd * kRowTile;  // (kWarps, kKeys, kRowTile) ds * scale
  float* ls = dss + Tl::kKeyTileBwd * kRowTile;  // (kRowTile) lse of the tile's rows
  float* Ds = ls + kRowTile;                     // (kRowTile) D of the tile's rows

  const std::int64_t S = shape.seq, R = shape.row(), Q = shape.q_dim(), KV = shape.kv_dim(), L = blk.len;
  const std::int64_t NH = shape.heads, KVH = shape.kv_heads;
  const int hs = static_cast<int>(shape.head_dim);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t bg = blockIdx.x;
  const std::int64_t b = bg / KVH;
  const std::int64_t g = bg % KVH;                                                  // the kv head
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.y) * Tl::kKeyTileBwd;  // in the block
  const int nj = static_cast<int>(std::min<std::int64_t>(Tl::kKeyTileBwd, L - j0));
  const std::int64_t qrow0 = b * S + blk.q_first;
  const std::int64_t krow0 = b * blk.kv_seq + blk.kv_first;  // the block's first key row
  const T* kv_rows = kv + (krow0 + j0) * blk.kv_stride;      // (nj, kv_stride) this CTA's keys
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));

  attn::load_tile<kHs, Tl::kKeyTileBwd, kHs>(kown, kv_rows + blk.k_offset + g * hs, blk.kv_stride, nj, hs);
  attn::load_tile<kHs, Tl::kKeyTileBwd, kHs>(vown, kv_rows + blk.v_offset + g * hs, blk.kv_stride, nj, hs);

  const std::int64_t k0 = j0 + warp * kKeys;    // this warp's first key, in the block
  const float* kw = kown + warp * kKeys * kHs;  // (kKeys, kHs)
  const float* vw = vown + warp * kKeys * kHs;  // (kKeys, kHs)
  float* pw = ps + warp * kKeys * kRowTile;     // (kKeys, kRowTile)
  float* dsw = dss + warp * kKeys * kRowTile;   // (kKeys, kRowTile)
  float dk[kKeys][kE] = {};                     // summed over the tiles and the group
  float dv[kKeys][kE] = {};

  // Causal: rows before j0 see none of these keys, so the first query tile is the one
  // holding row j0. Each query tile is visited once per query head of kv head g, in order.
  for (std::int64_t i0 = kCausal ? j0 - j0 % kRowTile : 0; i0 < L; i0 += kRowTile) {
    for (std::int64_t h = g; h < NH; h += KVH) {
      const T* qh = qkv + qrow0 * R + shape.q_col(h);               // (L, hs) at stride R
      const T* gh = dout + qrow0 * Q + h * hs;                      // (L, hs) at stride Q
      const float* lse_h = lse + (b * NH + h) * S + blk.q_first;    // (L)
      const float* dsum_h = dsum + (b * NH + h) * S + blk.q_first;  // (L)
      const int ni = static_cast<int>(std::min<std::int64_t>(kRowTile, L - i0));
      __syncthreads();  // the previous query tile (of this head or the one before) is no longer read
      attn::load_tile<kHs, kRowTile, kPadded>(qs, qh + i0 * R, R, ni, hs);
      attn::load_tile<kHs, kRowTile, kPadded>(gs, gh + i0 * Q, Q, ni, hs);
      if (threadIdx.x < kRowTile) {
        const int t = static_cast<int>(threadIdx.x);
        ls[t] = t < ni ? lse_h[i0 + t] : 0.0f;
        Ds[t] = t < ni ? dsum_h[i0 + t] : 0.0f;
      }
      __syncthreads();                                  // the query tile (and, at the first, kown and vown) is written
      if (k0 >= L) continue;                            // this warp's keys are all padding
      if (kCausal && k0 > i0 + kRowTile - 1) continue;  // every key is after every row of the tile

      float s[kKeys] = {};   // k_{k0 + k} . q_{i0 + lane}
      float dp[kKeys] = {};  // v_{k0 + k} . dout_{i0 + lane}
      attn::dot_rows<kHs, kKeys>(s, kw, qs + lane * kPadded);
      attn::dot_rows<kHs, kKeys>(dp, vw, gs + lane * kPadded);
      const std::int64_t i = i0 + lane;
      const float lv = ls[lane];
      const float Di = Ds[lane];
#pragma unroll
      for (int k = 0; k < kKeys; ++k) {
        const std::int64_t j = k0 + k;
        const bool valid = lane < ni && j < L && (!kCausal || j <= i);
        const float p = valid ? math::exp(s[k] * scale - lv) : 0.0f;
        pw[k * kRowTile + lane] = p;
        dsw[k * kRowTile + lane] = p * (dp[k] - Di) * scale;
      }
      __syncwarp();  // pw, dsw are written
      attn::axpy_lanes<kHs, kKeys, kPadded>(dv, pw, gs, lane);
      attn::axpy_lanes<kHs, kKeys, kPadded>(dk, dsw, qs, lane);
      __syncwarp();  // pw, dsw are read before the next tile overwrites them
    }
  }

#pragma unroll
  for (int k = 0; k < kKeys; ++k) {
    const std::int64_t j = k0 + k;
    if (j >= L) break;
    float* dk_row = dkv + (krow0 + j) * 2 * KV + g * hs;  // (hs) dk of key j
    float* dv_row = dk_row + KV;                          // (hs) dv of key j
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      if (lane + kWarp * e >= hs) continue;
      dk_row[lane + kWarp * e] += dk[k][e];
      dv_row[lane + kWarp * e] += dv[k][e];
    }
  }
}

template <class T, int kHs, AttentionMask kMask>
void launch_block_forward(cudaStream_t stream, const AttentionState<float>& st, const T* qkv, const T* kv,
                          const AttentionShape& shape, const AttentionBlock& blk) {
  using Tl = Tiles<kHs>;
  auto* kernel = &block_forward_kernel<T, kHs, kMask>;
  attn::allow_shared_memory(kernel, Tl::kForwardSmem * 4, "attention block_forward_kernel");
  const dim3 grid(static_cast<unsigned>(shape.batch * shape.heads),
                  static_cast<unsigned>(ceil_div(blk.len, Tl::kQueryTile)));
  launch_kernel(kernel, grid, kThreads, Tl::kForwardSmem * sizeof(float), stream, st.o, st.m, st.l, qkv, kv, shape,
                blk);
  LLMPAR_CHECK_LAUNCH("attention block_forward_kernel");
}

template <class T, int kHs, AttentionMask kMask>
void launch_block_backward(cudaStream_t stream, float* dq, float* dkv, const T* dout, const T* qkv, const T* kv,
                           const float* lse, const float* dsum, const AttentionShape& shape,
                           const AttentionBlock& blk) {
  using Tl = Tiles<kHs>;
  auto* dkv_kernel = &block_backward_dkv_kernel<T, kHs, kMask>;
  attn::allow_shared_memory(dkv_kernel, Tl::kDkvSmem * 4, "attention block_backward_dkv_kernel");
  const dim3 dkv_grid(static_cast<unsigned>(shape.batch * shape.kv_heads),
                      static_cast<unsigned>(ceil_div(blk.len, Tl::kKeyTileBwd)));
  launch_kernel(dkv_kernel, dkv_grid, kThreads, Tl::kDkvSmem * sizeof(float), stream, dkv, dout, qkv, kv, lse, dsum,
                shape, blk);
  LLMPAR_CHECK_LAUNCH("attention block_backward_dkv_kernel");

  auto* dq_kernel = &block_backward_dq_kernel<T, kHs, kMask>;
  attn::allow_shared_memory(dq_kernel, Tl::kDqSmem * 4, "attention block_backward_dq_kernel");
  const dim3 dq_grid(static_cast<unsigned>(shape.batch * shape.heads),
                     static_cast<unsigned>(ceil_div(blk.len, Tl::kQueryTile)));
  launch_kernel(dq_kernel, dq_grid, kThreads, Tl::kDqSmem * sizeof(float), stream, dq, dout, qkv, kv, lse, dsum, shape,
                blk);
  LLMPAR_CHECK_LAUNCH("attention block_backward_dq_kernel");
}

// The grid of a kernel run one warp per row over `rows` rows (finish, dsum).
inline unsigned row_grid(std::int64_t rows) { return static_cast<unsigned>(ceil_div(rows, kWarps)); }

#endif  // LLMPAR_DEVICE_CODE

}  // namespace detail::attn_block

#if defined(LLMPAR_DEVICE_CODE)

// st.o (B, S, NH hs) = 0, st.m (B, NH, S) = -inf, st.l (B, NH, S) = 0.
inline void attention_state_init(cudaStream_t stream, const AttentionState<float>& st, const AttentionShape& shape) {
  namespace ab = detail::attn_block;
  detail::attn::check_shape("attention_state_init", shape);
  const std::int64_t n_o = shape.batch * shape.seq * shape.q_dim(), n_ml = shape.batch * shape.heads * shape.seq;
  if (n_o == 0) return;
  const std::int64_t ctas = std::min<std::int64_t>(ceil_div(n_o, ab::kThreads), 65535);
  launch_kernel(&ab::state_init_kernel<float>, static_cast<unsigned>(ctas), ab::kThreads, 0, stream, st.o, st.m, st.l,
                n_o, n_ml);
  LLMPAR_CHECK_LAUNCH("attention state_init_kernel");
}

// The block's keys and values folded into the state of its queries (the module note).
// qkv: (B, S, R) with S = shape.seq; kv: (B, blk.kv_seq, blk.kv_stride), k at
// blk.k_offset + g hs and v at blk.v_offset + g hs of a row (qkv itself or a packed copy).
template <Storage T>
void attention_block_forward(cudaStream_t stream, const AttentionState<float>& st, const T* qkv, const T* kv,
                             const AttentionShape& shape, const AttentionBlock& blk) {
  namespace attn = detail::attn;
  detail::attn_block::check_block("attention_block_forward", shape, blk);
  if (shape.batch == 0 || blk.len == 0) return;
  const AttentionMask mask = blk.causal ? AttentionMask::causal : AttentionMask::none;
  attn::with_head_size_and_mask(attn::SimtHeadSizes{}, shape.head_dim, mask, [&](auto kHs, auto kMask) {
    detail::attn_block::launch_block_forward<T, decltype(kHs)::value, decltype(kMask)::value>(stream, st, qkv, kv,
                                                                                              shape, blk);
  });
}

// out (B, S, NH hs) = o / l and lse (B, NH, S) = m + log l, once every block is in.
template <Storage T>
void attention_state_finish(cudaStream_t stream, T* out, float* lse, const AttentionState<float>& st,
                            const AttentionShape& shape) {
  namespace ab = detail::attn_block;
  detail::attn::check_shape("attention_state_finish", shape);
  const std::int64_t rows = shape.batch * shape.heads * shape.seq;
  if (rows == 0) return;
  launch_kernel(&ab::state_finish_kernel<T>, ab::row_grid(rows), ab::kThreads, 0, stream, out, lse, st.o, st.m, st.l,
                rows, shape);
  LLMPAR_CHECK_LAUNCH("attention state_finish_kernel");
}

// dsum (B, NH, S) = dout . out per query row and head (the backward's D): the
// whole-sequence backward's D kernel.
template <Storage T>
void attention_dsum(cudaStream_t stream, float* dsum, const T* dout, const T* out, const AttentionShape& shape) {
  namespace ab = detail::attn_block;
  detail::attn::check_shape("attention_dsum", shape);
  const std::int64_t rows = shape.batch * shape.heads * shape.seq;
  if (rows == 0) return;
  launch_kernel(&detail::attn::dsum_kernel<T>, ab::row_grid(rows), ab::kThreads, 0, stream, dsum, dout, out, rows,
                shape);
  LLMPAR_CHECK_LAUNCH("attention dsum_kernel");
}

// dq (B, S, NH hs) += the block's query gradients; dkv (B, blk.kv_seq, 2 KVH hs) += its
// key gradients (at g hs of a row) and value gradients (at KVH hs + g hs), each kv head's
// summed over its query heads. lse and dsum are the final ones (B, NH, S); the rest as
// attention_block_forward. dq and dkv must not alias the inputs.
template <Storage T>
void attention_block_backward(cudaStream_t stream, float* dq, float* dkv, const T* dout, const T* qkv, const T* kv,
                              const float* lse, const float* dsum, const AttentionShape& shape,
                              const AttentionBlock& blk) {
  namespace attn = detail::attn;
  detail::attn_block::check_block("attention_block_backward", shape, blk);
  if (shape.batch == 0 || blk.len == 0) return;
  const AttentionMask mask = blk.causal ? AttentionMask::causal : AttentionMask::none;
  attn::with_head_size_and_mask(attn::SimtHeadSizes{}, shape.head_dim, mask, [&](auto kHs, auto kMask) {
    detail::attn_block::launch_block_backward<T, decltype(kHs)::value, decltype(kMask)::value>(
        stream, dq, dkv, dout, qkv, kv, lse, dsum, shape, blk);
  });
}

#endif  // LLMPAR_DEVICE_CODE

}  // namespace llmpar::kernels
