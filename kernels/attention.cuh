// llmpar/kernels/attention.cuh — multi-head and grouped-query self-attention on CUDA,
// flash style.
//
//   out[b,t,h] = sum_{s<=t} softmax_s(q_t . k_s / sqrt(hs)) v_s      (per query head h)
//
// The CUDA twin of backend/cpu/attention.hpp: the same layout (core/attention_shape.hpp:
// qkv (B, T, R), R = (NH + 2 KVH) hs, per row the q of the NH query heads, then the k of
// the KVH kv heads, then their v; query head h reads kv head g = h % KVH; out (B, T, NH hs);
// lse (B, NH, T)), the same math (math::OnlineSoftmax, math::exp) and the same outputs.
// Multi-head attention is KVH = NH (GPT-2, R = 3C), grouped-query KVH < NH (Llama 3),
// multi-query KVH = 1. The kernels take the AttentionShape itself and ask it for every
// column offset (q_col, k_col, v_col), so the layout is written in one place.
// Nothing of size T x T is stored. The mask is causal (GPT) or none (AttentionMask).
//
// Forward, SIMT path (float storage, 16-bit storage in views the tensor-core path
// cannot load, and the reference of that path). One CTA per (query tile, b*h), query
// head h: its kQueryTile query rows are staged in shared memory once; key and value
// tiles of 32 keys of h's kv head stream through shared memory in order. Each warp owns
// kRowsPerWarp query rows and each lane one key of the tile: a lane dots its key with
// all of the warp's rows (the rows are broadcast reads, its key row is padded to kHs + 1
// floats so the 32 lanes hit 32 banks), the warp reduces each row's tile max and sum
// with shuffles, and every lane keeps the same math::OnlineSoftmax state per row. For
// p . V the roles turn: a lane owns the columns d = lane + 32 e of each row's
// unnormalised output (registers) and reads the row's 32 weights back from a per-warp
// shared strip. Key tiles above the diagonal are never loaded, warps whose rows all
// precede a tile skip it, and the diagonal tile is masked per element. Rows are
// normalised at the end and lse = log-sum-exp is written.
//
// Forward, tensor-core path (bf16/f16 storage, every head size). Attention is two
// matrix products per tile; on CUDA cores in float it runs at a few percent of an
// H100/H200's bf16 tensor-core rate, so the 16-bit forward uses mma.sync
// (m16n8k16, f32 accumulate; sm_80 and newer). One CTA of 4 warps per (64 query rows,
// b*h); each warp owns 16 rows, the m of the mma. q, k and v tiles are staged in
// shared memory as stored (16-bit, rows padded by 16 bytes so ldmatrix is
// conflict-free); a warp's q fragments are loaded once into registers; key tiles of 64
// stream through. s = q k^T accumulates in f32 fragments; the online softmax runs on
// them in registers (each row lives in the 4 lanes of a group, its max and sum reduced
// with two shuffles; math::OnlineSoftmax as in the SIMT path); p is rounded to T in
// registers and is directly the A operand of o += p v (the accumulator layout of one
// mma is the A layout of the next), v coming through ldmatrix.trans. The one numerical
// difference from the SIMT path is that rounding of p (relative 2^-8 in bf16): the
// softmax sum uses p unrounded, as FlashAttention does. Causal: tiles above the diagonal
// are skipped, tiles touching it or the ragged end are masked per element; padding
// rows of k and v are zero-filled, padding query rows are never written. The launcher
// picks this path when it can (16-bit T, qkv 16-byte and out 4-byte
// aligned) and the SIMT path otherwise. The three inline-PTX wrappers (mma_m16n8k16,
// ldmatrix_x4, ldmatrix_x4_trans) are all it knows of the hardware. Not done yet:
// cp.async double buffering of the k/v tiles, a larger query tile (128 rows, 8 warps)
// and wgmma (sm_90a), which is what reaching half of an H200's peak would take; the
// backward is SIMT only.
//
// Validation without a GPU: every kernel here also runs on the CPU, compiled by the host
// compiler in the emulation of tests/cuda_emulation (one fiber per CUDA thread, real
// barriers and shuffles, mma and ldmatrix computed from the PTX ISA's fragment layouts
// in place of the inline PTX; LLMPAR_CUDA_EMULATION selects those, and launch_kernel and
// dynamic_shared_memory of common.cuh are the other seams). Its ctest,
// test_cuda_emulation_attention, checks them against the CPU kernel at every head size.
//
// Backward (FlashAttention-2), three kernels, all deterministic (no atomics):
//   1. D_t = dout_t . out_t, one warp per (query head, row), into the caller's workspace
//      (B, NH, T).
//   2. dK, dV: one CTA per (key tile, b*KVH + g), kv head g; the CTA's keys sit in shared
//      memory, and the query tiles from the one holding its first key on (all of them
//      without a mask) stream through it in order, 32 rows each, one row per lane, each
//      tile once per query head of g's group (h = g, g + KVH, ..., in order):
//      p = exp(s - lse), dp = dout . v, ds = p (dp - D) scale; dv += p dout, dk += ds q,
//      accumulated in registers by the warp that owns the key (lane = column, as in the
//      forward's p . V) across the whole group, and written once. Under grouped-query
//      attention a kv head's gradient is the sum over its NH / KVH query heads; summing
//      them in the CTA that owns the key tile, rather than in one CTA per query head, keeps
//      the sum in a fixed order without atomics or a (group x T x hs) workspace, and loads
//      the keys once per group. Heads inside tiles, not tiles inside heads: the group's q
//      and dout rows of a tile are neighbours in memory, and with the heads outside ptxas
//      (nvcc 13, sm_90a) spilled at kHs 64. The grid has KVH / NH as many CTAs, each with
//      NH / KVH times the work (Llama-3-8B's 32 heads on 8 at B = 4, T = 4096: 4096 CTAs,
//      enough for any GPU). With KVH = NH the group is one head and the kernel computes
//      what the multi-head one did, bit for bit.
//   3. dQ: one CTA per (query tile, b*NH + h), the forward's shape, visiting the key tiles
//      of h's kv head in order and recomputing p and ds; dq += ds k. Recomputing s in a
//      second kernel costs one more Q K^T, but it is what makes dq a fixed-order sum
//      without a (key tiles x T x hs) workspace or float atomics.
// Every sum runs in a fixed order fixed by the tile constants (never by timing), so
// results are bitwise reproducible run to run. The tiles differ from the CPU kernel's,
// so the two agree to float rounding, not bitwise.
//
// Head sizes: every multiple of 8 from 16 to 256, as FlashAttention (8 keeps every row
// 16-byte aligned). The per-lane column arrays and the tensor-core fragment arrays must
// live in registers, so kernels are compiled for a few head sizes kHs, the buckets
// SimtHeadSizes and TcHeadSizes, and a head of hs <= kHs columns runs the kernels of the
// smallest bucket that holds it: its rows are zero-padded to kHs columns in shared
// memory, where the padding adds exact zeros to every dot product and makes output
// columns that are never stored; global memory is addressed with the true hs, and scores
// are scaled by 1/sqrt(hs). with_head_size is the one place a run-time hs becomes a
// bucket. The buckets are the powers of two from 32 to 256, for both paths, a choice by
// measurement of what every .cu that includes this header pays per GPU architecture:
// nvcc 13 compiles all its kernels (3 storage types x 2 masks) for sm_90a in 25 s of CPU
// time with these buckets (91 kernels; the 4 tensor-core ones at 256 take 3.6 s), 17 s
// with the three head sizes before (71), and 34 s with FlashAttention's multiples of 32
// on the SIMT path and to 128 on tensor cores (163). 64 and 128, the head sizes models
// mostly use, are buckets and pay nothing for the others; a padded head (e.g. 80 in 128)
// pays the padding's flops instead. Rows per warp shrink with kHs so the SIMT
// accumulators fit the registers; no instantiation spills (nvcc -Xptxas -v, sm_90a and
// sm_80; the tensor-core forward at 256 uses 254 or 255 of the 255 registers a thread
// can have).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "llmpar/backend/cuda/check.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/kernels/common.cuh"
#include "llmpar/math/exp.hpp"
#include "llmpar/math/online_softmax.hpp"

namespace llmpar::kernels {

// Which keys a query row sees: causal = keys at or before it (GPT), none = all keys.
enum class AttentionMask { causal, none };

namespace detail::attn {

inline constexpr int kWarps = 4;                 // warps per CTA, every kernel
inline constexpr int kThreads = kWarps * kWarp;  // threads per CTA
inline constexpr int kKeyTile = kWarp;           // keys per streamed key tile (forward, dq): one per lane
inline constexpr int kRowTile = kWarp;           // query rows per streamed query tile (dk/dv): one per lane

// The supported head sizes hs: kHeadSizeStep, 2 kHeadSizeStep, ... up to kMaxHeadSize,
// from kMinHeadSize.
inline constexpr int kMinHeadSize = 16;
inline constexpr int kMaxHeadSize = 256;
inline constexpr int kHeadSizeStep = 8;

// The head sizes the kernels are compiled for (see "Head sizes" above), ascending; the
// last of each is the largest head size the path serves.
using SimtHeadSizes = std::integer_sequence<int, 32, 64, 128, 256>;
using TcHeadSizes = std::integer_sequence<int, 32, 64, 128, 256>;
inline constexpr int kTcMaxHeadSize = 256;

// Calls f(std::integral_constant<int, kHs>{}) for the first kHs of the list with
// hs <= kHs (the last if none: callers have checked hs) and returns its result: the one
// place where a run-time head size becomes a compile-time one.
template <int kHs, int... kLarger, class F>
decltype(auto) with_head_size(std::integer_sequence<int, kHs, kLarger...>, std::int64_t hs, F&& f) {
  if constexpr (sizeof...(kLarger) == 0) {
    return f(std::integral_constant<int, kHs>{});
  } else {
    if (hs <= kHs) return f(std::integral_constant<int, kHs>{});
    return with_head_size(std::integer_sequence<int, kLarger...>{}, hs, std::forward<F>(f));
  }
}

// The same for the mask: f(std::integral_constant<AttentionMask, mask>{}).
template <class F>
decltype(auto) with_mask(AttentionMask mask, F&& f) {
  if (mask == AttentionMask::causal) return f(std::integral_constant<AttentionMask, AttentionMask::causal>{});
  return f(std::integral_constant<AttentionMask, AttentionMask::none>{});
}

// Tile shapes of the SIMT kernels compiled for head size kHs.
template <int kHs>
struct Tiles {
  static_assert(kHs % kWarp == 0 && kHs >= kWarp && kHs <= kMaxHeadSize,
                "the SIMT attention kernels are compiled for multiples of 32 from 32 to 256");
  static constexpr int kPerLane = kHs / kWarp;  // columns per lane: d = lane + 32 e, e < kPerLane
  static constexpr int kPadded = kHs + 1;       // row stride of a tile read one row per lane (conflict-free)
  // Forward and dq: rows per warp and per CTA. The output accumulators (kRowsPerWarp x
  // kPerLane floats per lane) stay at most 32 floats so that, with the kernels' other
  // arrays, they fit the registers without spills at every kHs.
  static constexpr int kRowsPerWarp = kPerLane <= 2 ? 16 : kPerLane <= 4 ? 8 : 4;
  static constexpr int kQueryTile = kWarps * kRowsPerWarp;
  // dk/dv: keys per warp and per CTA, for the same reason (two accumulators, dk and dv).
  static constexpr int kKeysPerWarp = kPerLane <= 2 ? 16 : kPerLane <= 4 ? 8 : 4;
  static constexpr int kKeyTileBwd = kWarps * kKeysPerWarp;
  static_assert(kKeyTileBwd % kRowTile == 0 || kRowTile % kKeyTileBwd == 0,
                "a dk/dv key tile starts on a query tile boundary or inside one query tile");
  // The fewest rows any of the kernels' tiles has: a grid's y extent is T over it.
  static constexpr int kSmallestTile = std::min(kQueryTile, kKeyTileBwd);
  // CTAs per SM a kernel asks registers for (__launch_bounds__' second argument; 3 caps
  // a thread at 168 registers, 2 at 255). 0 leaves the count to ptxas, which weighs
  // occupancy against spills itself; where it chose a few bytes of spills (dq at kHs 64
  // and 256, dk/dv at 256 since its query-head loop; nvcc 13, sm_90a), the count is set
  // to where nothing spills. (dk/dv at 256 is held to 2 CTAs per SM by its 100 KiB of
  // shared memory anyway, so its 167 registers cost no occupancy.)
  static constexpr int kForwardMinBlocks = 0;
  static constexpr int kDqMinBlocks = kHs == 64 ? 2 : kHs == 256 ? 3 : 0;
  static constexpr int kDkvMinBlocks = kHs == 256 ? 3 : 0;

  // Shared memory of each kernel, in floats. Every part is a multiple of 4 floats, so
  // each part starts 16-byte aligned (float4 reads).
  static constexpr int kForwardSmem = kQueryTile * kHs          // q rows
                                      + kKeyTile * kPadded      // k tile
                                      + kKeyTile * kHs          // v tile
                                      + kQueryTile * kKeyTile;  // p, per warp
  static constexpr int kDqSmem = 2 * kQueryTile * kHs           // q, dout rows
                                 + 2 * kKeyTile * kPadded       // k, v tiles
                                 + kQueryTile * kKeyTile;       // ds, per warp
  static constexpr int kDkvSmem = 2 * kKeyTileBwd * kHs         // own k, v rows
                                  + 2 * kRowTile * kPadded      // q, dout tiles
                                  + 2 * kKeyTileBwd * kRowTile  // p, ds, per warp
                                  + 2 * kRowTile;               // lse, D of the tile's rows
  static_assert(kKeyTile * kPadded % 4 == 0 && kRowTile * kPadded % 4 == 0, "parts stay 16-byte aligned");
  static_assert(4 * kForwardSmem <= 163 * 1024 && 4 * kDqSmem <= 163 * 1024 && 4 * kDkvSmem <= 163 * 1024,
                "every kernel's shared memory fits an sm_80 CTA (163 KiB)");
};

#if defined(LLMPAR_DEVICE_CODE)

// dst: (kRows, kStride) floats in shared memory <- rows [0, n) of a head, hs stored
// elements each, `ld` elements apart in src; columns [hs, kHs) (the padding to the
// compiled head size) and rows [n, kRows) (ragged tails) are zero.
template <int kHs, int kRows, int kStride, class T>
__device__ __forceinline__ void load_tile(float* dst, const T* src, std::int64_t ld, int n, int hs) {
  for (int idx = threadIdx.x; idx < kRows * kHs; idx += blockDim.x) {
    const int r = idx / kHs;
    const int d = idx % kHs;
    dst[r * kStride + d] = r < n && d < hs ? load(src[r * ld + d]) : 0.0f;
  }
}

// acc[r] += sum_d a[r * kHs + d] * b[d], d in order, for r < kRows.
// a: (kRows, kHs) shared, the same rows for every lane (broadcast), 16-byte aligned;
// b: (kHs) this lane's own row (a padded tile row, so lanes hit distinct banks).
template <int kHs, int kRows>
__device__ __forceinline__ void dot_rows(float (&acc)[kRows], const float* a, const float* b) {
#pragma unroll 2
  for (int d = 0; d < kHs; d += 4) {
    const float b0 = b[d], b1 = b[d + 1], b2 = b[d + 2], b3 = b[d + 3];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float4 x = *reinterpret_cast<const float4*>(a + r * kHs + d);
      float s = acc[r];
      s = fmaf(x.x, b0, s);
      s = fmaf(x.y, b1, s);
      s = fmaf(x.z, b2, s);
      s = fmaf(x.w, b3, s);
      acc[r] = s;
    }
  }
}

// acc[r][e] += sum_{j < 32} w[r * 32 + j] * v[j * kStride + lane + 32 e], j in order.
// w: (kRows, 32) shared weights, broadcast, 16-byte aligned; v: (32, kStride) shared rows.
template <int kHs, int kRows, int kStride>
__device__ __forceinline__ void axpy_lanes(float (&acc)[kRows][kHs / kWarp], const float* w, const float* v, int lane) {
  constexpr int kE = kHs / kWarp;
#pragma unroll 2
  for (int j = 0; j < kWarp; j += 4) {
    float x[4][kE];  // (4 rows of v, this lane's columns)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
      for (int e = 0; e < kE; ++e) x[jj][e] = v[(j + jj) * kStride + lane + kWarp * e];
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float4 wr = *reinterpret_cast<const float4*>(w + r * kWarp + j);
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        float s = acc[r][e];
        s = fmaf(wr.x, x[0][e], s);
        s = fmaf(wr.y, x[1][e], s);
        s = fmaf(wr.z, x[2][e], s);
        s = fmaf(wr.w, x[3][e], s);
        acc[r][e] = s;
      }
    }
  }
}

// Grid: (B*NH, query tiles), the last query tile (most keys) at blockIdx.y = 0 so the
// longest CTAs start first. Block: kThreads. Dynamic shared memory: kForwardSmem floats.
// out: (B, T, NH hs); lse: (B, NH, T); qkv: (B, T, R); shape.head_dim <= kHs.
template <class T, int kHs, AttentionMask kMask>
__global__ void __launch_bounds__(kThreads, Tiles<kHs>::kForwardMinBlocks)
    forward_kernel(T* LLMPAR_RESTRICT out, float* LLMPAR_RESTRICT lse, const T* LLMPAR_RESTRICT qkv,
                   AttentionShape shape) {
  using Tl = Tiles<kHs>;
  constexpr int kRows = Tl::kRowsPerWarp;
  constexpr int kE = Tl::kPerLane;
  constexpr int kPadded = Tl::kPadded;
  constexpr bool kCausal = kMask == AttentionMask::causal;
  float* qs = dynamic_shared_memory<float>();  // (kQueryTile, kHs) this CTA's q rows
  float* ks = qs + Tl::kQueryTile * kHs;       // (kKeyTile, kPadded) key tile
  float* vs = ks + kKeyTile * kPadded;         // (kKeyTile, kHs) value tile
  float* ps = vs + kKeyTile * kHs;             // (kWarps, kRows, kKeyTile) weights

  const std::int64_t T_len = shape.seq, R = shape.row(), Q = shape.q_dim();
  const int hs = static_cast<int>(shape.head_dim);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t bh = blockIdx.x;
  const std::int64_t b = bh / shape.heads;
  const std::int64_t h = bh % shape.heads;
  const std::int64_t i0 = static_cast<std::int64_t>(gridDim.y - 1 - blockIdx.y) * Tl::kQueryTile;
  const int ni = static_cast<int>(std::min<std::int64_t>(Tl::kQueryTile, T_len - i0));
  const T* rows = qkv + b * T_len * R;                    // (T, R) of batch b
  const T* qh = rows + shape.q_col(h);                    // (T, hs) at stride R: this head's q
  const T* kh = rows + shape.k_col(shape.kv_head_of(h));  // its kv head's k
  const T* vh = rows + shape.v_col(shape.kv_head_of(h));  // and v
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));

  load_tile<kHs, Tl::kQueryTile, kHs>(qs, qh + i0 * R, R, ni, hs);

  const std::int64_t r0 = i0 + warp * kRows;  // this warp's first row
  const float* qw = qs + warp * kRows * kHs;  // (kRows, kHs) this warp's q rows
  float* pw = ps + warp * kRows * kKeyTile;   // (kRows, kKeyTile) this warp's weights
  float o[kRows][kE] = {};                    // unnormalised output, columns lane + 32 e
  math::OnlineSoftmax<float> state[kRows];    // identical in every lane
  const std::int64_t key_end = kCausal ? std::min<std::int64_t>(T_len, i0 + Tl::kQueryTile) : T_len;

  for (std::int64_t j0 = 0; j0 < key_end; j0 += kKeyTile) {
    const int nj = static_cast<int>(std::min<std::int64_t>(kKeyTile, T_len - j0));
    __syncthreads();  // the previous tile's ks and vs are no longer read
    load_tile<kHs, kKeyTile, kPadded>(ks, kh + j0 * R, R, nj, hs);
    load_tile<kHs, kKeyTile, kHs>(vs, vh + j0 * R, R, nj, hs);
    __syncthreads();                               // ks, vs (and, at the first tile, qs) are written
    if (r0 >= T_len) continue;                     // this warp's rows are all padding
    if (kCausal && j0 > r0 + kRows - 1) continue;  // every key is after every row of this warp

    float s[kRows] = {};  // s[r] = q_r . k_{j0 + lane}
    dot_rows<kHs, kRows>(s, qw, ks + lane * kPadded);
    const std::int64_t j = j0 + lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool valid = lane < nj && (!kCausal || j <= r0 + r);
      const float x = valid ? s[r] * scale : -INFINITY;
      const float tile_max = warp_max(x);
      math::OnlineSoftmax<float>& st = state[r];
      if (tile_max > st.max) {
        const float factor = st.rescale(tile_max);
#pragma unroll
        for (int e = 0; e < kE; ++e) o[r][e] *= factor;
      }
      // A masked key weighs 0 (never exp(-inf - max): max is -inf while nothing is seen).
      const float p = valid ? math::exp(x - st.max) : 0.0f;
      st.sum += warp_sum(p);
      pw[r * kKeyTile + lane] = p;
    }
    __syncwarp();  // pw is written
    axpy_lanes<kHs, kRows, kHs>(o, pw, vs, lane);
    __syncwarp();  // pw is read before the next tile overwrites it
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const std::int64_t i = r0 + r;
    if (i >= T_len) break;
    const float inv = 1.0f / state[r].sum;
    T* orow = out + (b * T_len + i) * Q + h * hs;  // (hs)
#pragma unroll
    for (int e = 0; e < kE; ++e)
      if (lane + kWarp * e < hs) orow[lane + kWarp * e] = store<T>(o[r][e] * inv);
    if (lane == 0) lse[bh * T_len + i] = state[r].log_sum_exp();
  }
}

// D[bh, t] = dout[b, t, head h] . out[b, t, head h]: one warp per row, lane l summing
// columns l, l + 32, ... in order (any hs: nothing is kept per column).
// Grid: ceil(B*NH*T / kWarps). dsum: (B, NH, T); dout, out: (B, T, NH hs).
template <class T>
__global__ void __launch_bounds__(kThreads)
    dsum_kernel(float* LLMPAR_RESTRICT dsum, const T* LLMPAR_RESTRICT dout, const T* LLMPAR_RESTRICT out,
                std::int64_t rows, AttentionShape shape) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  if (row >= rows) return;  // the whole warp: its lanes share the row
  const std::int64_t bh = row / shape.seq;
  const std::int64_t t = row % shape.seq;
  const std::int64_t offset =
      ((bh / shape.heads) * shape.seq + t) * shape.q_dim() + (bh % shape.heads) * shape.head_dim;
  float acc = 0.0f;
  for (int d = lane; d < shape.head_dim; d += kWarp) acc = fmaf(load(dout[offset + d]), load(out[offset + d]), acc);
  acc = warp_sum(acc);
  if (lane == 0) dsum[row] = acc;
}

// dq. Grid: (B*NH, query tiles), last tile first. Dynamic shared memory: kDqSmem floats.
// dqkv: (B, T, R), the q columns [0, NH hs) written; dout: (B, T, NH hs); qkv: (B, T, R);
// lse, dsum: (B, NH, T); shape.head_dim <= kHs.
template <class T, int kHs, AttentionMask kMask>
__global__ void __launch_bounds__(kThreads, Tiles<kHs>::kDqMinBlocks)
    backward_dq_kernel(T* LLMPAR_RESTRICT dqkv, const T* LLMPAR_RESTRICT dout, const T* LLMPAR_RESTRICT qkv,
                       const float* LLMPAR_RESTRICT lse, const float* LLMPAR_RESTRICT dsum, AttentionShape shape) {
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

  const std::int64_t T_len = shape.seq, R = shape.row(), Q = shape.q_dim();
  const int hs = static_cast<int>(shape.head_dim);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t bh = blockIdx.x;
  const std::int64_t b = bh / shape.heads;
  const std::int64_t h = bh % shape.heads;
  const std::int64_t i0 = static_cast<std::int64_t>(gridDim.y - 1 - blockIdx.y) * Tl::kQueryTile;
  const int ni = static_cast<int>(std::min<std::int64_t>(Tl::kQueryTile, T_len - i0));
  const T* rows = qkv + b * T_len * R;                    // (T, R) of batch b
  const T* qh = rows + shape.q_col(h);                    // (T, hs) at stride R: this head's q
  const T* kh = rows + shape.k_col(shape.kv_head_of(h));  // its kv head's k
  const T* vh = rows + shape.v_col(shape.kv_head_of(h));  // and v
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));

  load_tile<kHs, Tl::kQueryTile, kHs>(qs, qh + i0 * R, R, ni, hs);
  load_tile<kHs, Tl::kQueryTile, kHs>(gs, dout + (b * T_len + i0) * Q + h * hs, Q, ni, hs);

  const std::int64_t r0 = i0 + warp * kRows;   // this warp's first row
  const float* qw = qs + warp * kRows * kHs;   // (kRows, kHs)
  const float* gw = gs + warp * kRows * kHs;   // (kRows, kHs)
  float* dsw = dss + warp * kRows * kKeyTile;  // (kRows, kKeyTile)
  float l[kRows];                              // lse of each row (0 for padding rows)
  float D[kRows];                              // dout . out of each row
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const bool row_ok = r0 + r < T_len;
    l[r] = row_ok ? lse[bh * T_len + r0 + r] : 0.0f;
    D[r] = row_ok ? dsum[bh * T_len + r0 + r] : 0.0f;
  }
  float dq[kRows][kE] = {};
  const std::int64_t key_end = kCausal ? std::min<std::int64_t>(T_len, i0 + Tl::kQueryTile) : T_len;

  for (std::int64_t j0 = 0; j0 < key_end; j0 += kKeyTile) {
    const int nj = static_cast<int>(std::min<std::int64_t>(kKeyTile, T_len - j0));
    __syncthreads();  // the previous tile's ks and vs are no longer read
    load_tile<kHs, kKeyTile, kPadded>(ks, kh + j0 * R, R, nj, hs);
    load_tile<kHs, kKeyTile, kPadded>(vs, vh + j0 * R, R, nj, hs);
    __syncthreads();  // ks, vs (and, at the first tile, qs and gs) are written
    if (r0 >= T_len) continue;
    if (kCausal && j0 > r0 + kRows - 1) continue;

    float s[kRows] = {};   // q_r . k_{j0 + lane}
    float dp[kRows] = {};  // dout_r . v_{j0 + lane}
    dot_rows<kHs, kRows>(s, qw, ks + lane * kPadded);
    dot_rows<kHs, kRows>(dp, gw, vs + lane * kPadded);
    const std::int64_t j = j0 + lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool valid = lane < nj && (!kCausal || j <= r0 + r);
      const float p = valid ? math::exp(s[r] * scale - l[r]) : 0.0f;
      dsw[r * kKeyTile + lane] = p * (dp[r] - D[r]) * scale;
    }
    __syncwarp();  // dsw is written
    axpy_lanes<kHs, kRows, kPadded>(dq, dsw, ks, lane);
    __syncwarp();  // dsw is read before the next tile overwrites it
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const std::int64_t i = r0 + r;
    if (i >= T_len) break;
    T* drow = dqkv + (b * T_len + i) * R + shape.q_col(h);  // (hs) dq of row i
#pragma unroll
    for (int e = 0; e < kE; ++e)
      if (lane + kWarp * e < hs) drow[lane + kWarp * e] = store<T>(dq[r][e]);
  }
}

// dk, dv. Grid: (B*KVH, key tiles of kKeyTileBwd), the first key tile (most query rows
// under a causal mask) at blockIdx.y = 0. Dynamic shared memory: kDkvSmem floats.
// dqkv: (B, T, R), kv head g's k and v columns written, summed over the query heads
// h = g, g + KVH, ... that read it; the rest as backward_dq_kernel.
template <class T, int kHs, AttentionMask kMask>
__global__ void __launch_bounds__(kThreads, Tiles<kHs>::kDkvMinBlocks)
    backward_dkv_kernel(T* LLMPAR_RESTRICT dqkv, const T* LLMPAR_RESTRICT dout, const T* LLMPAR_RESTRICT qkv,
                        const float* LLMPAR_RESTRICT lse, const float* LLMPAR_RESTRICT dsum, AttentionShape shape) {
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

  const std::int64_t T_len = shape.seq, R = shape.row(), Q = shape.q_dim();
  const std::int64_t NH = shape.heads, KVH = shape.kv_heads;
  const int hs = static_cast<int>(shape.head_dim);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const std::int64_t bg = blockIdx.x;
  const std::int64_t b = bg / KVH;
  const std::int64_t g = bg % KVH;  // the kv head
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.y) * Tl::kKeyTileBwd;
  const int nj = static_cast<int>(std::min<std::int64_t>(Tl::kKeyTileBwd, T_len - j0));
  const T* rows = qkv + b * T_len * R;  // (T, R) of batch b
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));

  load_tile<kHs, Tl::kKeyTileBwd, kHs>(kown, rows + j0 * R + shape.k_col(g), R, nj, hs);
  load_tile<kHs, Tl::kKeyTileBwd, kHs>(vown, rows + j0 * R + shape.v_col(g), R, nj, hs);

  const std::int64_t k0 = j0 + warp * kKeys;    // this warp's first key
  const float* kw = kown + warp * kKeys * kHs;  // (kKeys, kHs)
  const float* vw = vown + warp * kKeys * kHs;  // (kKeys, kHs)
  float* pw = ps + warp * kKeys * kRowTile;     // (kKeys, kRowTile)
  float* dsw = dss + warp * kKeys * kRowTile;   // (kKeys, kRowTile)
  float dk[kKeys][kE] = {};                     // summed over the tiles and the group
  float dv[kKeys][kE] = {};

  // Under the causal mask rows before j0 see none of these keys: the first visited query
  // tile is the one holding row j0 (its rows before j0 are masked like any row before a key).
  // Each query tile is visited once per query head of kv head g, h = g, g + KVH, ... in
  // order, so dk and dv sum over the tiles in order and, within a tile, over the heads.
  for (std::int64_t i0 = kCausal ? j0 - j0 % kRowTile : 0; i0 < T_len; i0 += kRowTile) {
    for (std::int64_t h = g; h < NH; h += KVH) {
      const T* qh = rows + shape.q_col(h);                // (T, hs) at stride R
      const T* gh = dout + b * T_len * Q + h * hs;        // (T, hs) at stride Q
      const float* lse_h = lse + (b * NH + h) * T_len;    // (T)
      const float* dsum_h = dsum + (b * NH + h) * T_len;  // (T)
      const int ni = static_cast<int>(std::min<std::int64_t>(kRowTile, T_len - i0));
      __syncthreads();  // the previous query tile (of this head or the one before) is no longer read
      load_tile<kHs, kRowTile, kPadded>(qs, qh + i0 * R, R, ni, hs);
      load_tile<kHs, kRowTile, kPadded>(gs, gh + i0 * Q, Q, ni, hs);
      if (threadIdx.x < kRowTile) {
        const int t = static_cast<int>(threadIdx.x);
        ls[t] = t < ni ? lse_h[i0 + t] : 0.0f;
        Ds[t] = t < ni ? dsum_h[i0 + t] : 0.0f;
      }
      __syncthreads();                                  // the query tile (and, at the first, kown and vown) is written
      if (k0 >= T_len) continue;                        // this warp's keys are all padding
      if (kCausal && k0 > i0 + kRowTile - 1) continue;  // every key is after every row of the tile

      float s[kKeys] = {};   // k_{k0 + k} . q_{i0 + lane}
      float dp[kKeys] = {};  // v_{k0 + k} . dout_{i0 + lane}
      dot_rows<kHs, kKeys>(s, kw, qs + lane * kPadded);
      dot_rows<kHs, kKeys>(dp, vw, gs + lane * kPadded);
      const std::int64_t i = i0 + lane;
      const float l = ls[lane];
      const float Di = Ds[lane];
#pragma unroll
      for (int k = 0; k < kKeys; ++k) {
        const std::int64_t j = k0 + k;
        const bool valid = lane < ni && j < T_len && (!kCausal || j <= i);
        const float p = valid ? math::exp(s[k] * scale - l) : 0.0f;
        pw[k * kRowTile + lane] = p;
        dsw[k * kRowTile + lane] = p * (dp[k] - Di) * scale;
      }
      __syncwarp();  // pw, dsw are written
      axpy_lanes<kHs, kKeys, kPadded>(dv, pw, gs, lane);
      axpy_lanes<kHs, kKeys, kPadded>(dk, dsw, qs, lane);
      __syncwarp();  // pw, dsw are read before the next tile overwrites them
    }
  }

#pragma unroll
  for (int k = 0; k < kKeys; ++k) {
    const std::int64_t j = k0 + k;
    if (j >= T_len) break;
    T* dk_row = dqkv + (b * T_len + j) * R + shape.k_col(g);  // (hs) dk of key j
    T* dv_row = dqkv + (b * T_len + j) * R + shape.v_col(g);  // (hs) dv of key j
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      if (lane + kWarp * e >= hs) continue;
      dk_row[lane + kWarp * e] = store<T>(dk[k][e]);
      dv_row[lane + kWarp * e] = store<T>(dv[k][e]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Tensor-core path (bf16/f16 storage): the forward on mma.sync.
// ---------------------------------------------------------------------------------------

// Tensor-core primitives (inline PTX, sm_80 and newer, sm_90a included). Everything the
// tensor-core kernel knows about the hardware is in these three functions, with the
// fragment layouts of the PTX ISA (section 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16
// with floating point type" and 9.7.14.5.15 "Warp-level matrix load instruction:
// ldmatrix"). Lane l of a warp is in group g = l / 4 at position t = l % 4; a .b32
// register holds two 16-bit elements, the lower-indexed one in its low half. The host
// emulation (LLMPAR_CUDA_EMULATION) implements the same contracts on the CPU
// (tests/cuda_emulation/cuda_emulation.hpp).

// d (16x8, f32) += a (16x16, T, row-major) * b (16x8, T, column-major), one warp.
// Fragments of lane (g, t):
//   a[0] = A[g][2t, 2t+1]     a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   b0 = B[2t, 2t+1][g]       b1 = B[2t+8, 2t+9][g]
//   d[0], d[1] = D[g][2t, 2t+1]                          d[2], d[3] = D[g+8][2t, 2t+1]
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                             std::uint32_t b1) {
  static_assert(std::is_same_v<T, bf16> || std::is_same_v<T, f16>, "mma.m16n8k16 multiplies bf16 or f16");
#if defined(LLMPAR_CUDA_EMULATION)
  ::llmpar::emulation::mma_m16n8k16<T>(d, a, b0, b1);
#else
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// Four 8x8 matrices of 16-bit elements from shared memory, one warp: lanes 8j..8j+7
// give the addresses of the 8 rows (16 bytes each, 16-byte aligned) of matrix j, and
// r[j] of lane (g, t) receives row g, elements 2t and 2t+1 of matrix j.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
#if defined(LLMPAR_CUDA_EMULATION)
  ::llmpar::emulation::ldmatrix_x4(r, row, false);
#else
  const auto address = static_cast<std::uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
#endif
}

// The same, each matrix transposed: r[j] of lane (g, t) receives elements (2t, g) and
// (2t+1, g) of matrix j (row, column of the rows as addressed).
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row) {
#if defined(LLMPAR_CUDA_EMULATION)
  ::llmpar::emulation::ldmatrix_x4(r, row, true);
#else
  const auto address = static_cast<std::uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
#endif
}

// Tensor-core path: tiles and helpers.
inline constexpr int kTcWarps = 4;                   // warps per CTA
inline constexpr int kTcThreads = kTcWarps * kWarp;  // threads per CTA
inline constexpr int kTcRowsPerWarp = 16;            // query rows per warp: the m of m16n8k16
inline constexpr int kTcQueryTile = kTcWarps * kTcRowsPerWarp;
inline constexpr int kTcKeyTile = 64;  // keys per streamed key tile

template <int kHs>
struct TcTiles {
  static_assert(kHs % 16 == 0 && kHs >= 16 && kHs <= kTcMaxHeadSize,
                "the tensor-core attention kernel is compiled for multiples of 16 from 16 to 256");
  // Shared rows are kHs + 8 elements apart: the 8 rows one ldmatrix matrix reads are then
  // 16 bytes apart modulo 128 and fall in distinct banks; the stride stays a multiple
  // of 16 bytes, as ldmatrix and the 16-byte tile stores need.
  static constexpr int kStride = kHs + 8;
  static constexpr int kKSteps = kHs / 16;          // k steps of 16 in q k^T
  static constexpr int kKeyN = kTcKeyTile / 8;      // n tiles of 8 keys in s = q k^T
  static constexpr int kDimN = kHs / 8;             // n tiles of 8 columns in o = p v
  static constexpr int kPvSteps = kTcKeyTile / 16;  // k steps of 16 keys in p v
  // q tile, k tile, v tile, in 16-bit elements.
  static constexpr int kSmemElements = (kTcQueryTile + 2 * kTcKeyTile) * kStride;
  static constexpr int kSmemBytes = 2 * kSmemElements;
  static_assert(kStride * 2 % 16 == 0, "shared rows start 16-byte aligned");
  static_assert(kKeyN % 2 == 0 && kDimN % 2 == 0, "ldmatrix_x4 feeds two n tiles at a time");
  static_assert(kSmemBytes <= 163 * 1024, "the tensor-core forward's shared memory fits an sm_80 CTA");
  // CTAs per SM the kernel asks registers for, as Tiles' (ptxas spilled at kHs = 32).
  // At 256 the q fragments and the output accumulators take 192 of the thread's
  // registers; it uses 254 or 255 (sm_90a, nvcc 13) and does not spill.
  static constexpr int kMinBlocks = kHs == 32 ? 3 : 0;
};

// dst: (kRows, kStride) elements in shared memory <- rows [0, n) of a head, hs stored
// elements each, `ld` elements apart in src; columns [hs, kHs) (padding to the compiled
// head size) and rows [n, kRows) (ragged tails) are zero. Moves 16-byte chunks: src
// rows start 16-byte aligned (the launcher checks the base pointer; ld, hs and the head
// offsets are multiples of 8 elements, so a row is whole chunks).
template <int kHs, int kRows, int kStride, class T>
__device__ __forceinline__ void load_tile_b16(T* dst, const T* src, std::int64_t ld, int n, int hs) {
  static_assert(sizeof(T) == 2, "16-bit storage");
  constexpr int kChunks = kHs / 8;  // 16-byte chunks per row
  const int chunks = hs / 8;        // of them, the head's
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += blockDim.x) {
    const int r = idx / kChunks;
    const int c = idx % kChunks;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < n && c < chunks) v = *reinterpret_cast<const uint4*>(src + r * ld + 8 * c);
    *reinterpret_cast<uint4*>(dst + r * kStride + 8 * c) = v;
  }
}

// Two floats rounded to T (llmpar::convert, round to nearest even) in one .b32 register,
// lo in the low half: the packing of an mma operand.
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  return static_cast<std::uint32_t>(store<T>(lo).bits) | (static_cast<std::uint32_t>(store<T>(hi).bits) << 16);
}

// Max / sum over the 4 lanes of a group (the lanes holding one accumulator row).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
  return v + __shfl_xor_sync(0xFFFFFFFFu, v, 2);
}

// Grid: (B*NH, query tiles of kTcQueryTile), the last query tile first. Block:
// kTcThreads. Dynamic shared memory: TcTiles<kHs>::kSmemBytes.
// out: (B, T, NH hs), 4-byte aligned; lse: (B, NH, T); qkv: (B, T, R), 16-byte aligned;
// shape.head_dim <= kHs.
template <class T, int kHs, AttentionMask kMask>
__global__ void __launch_bounds__(kTcThreads, TcTiles<kHs>::kMinBlocks)
    forward_tc_kernel(T* LLMPAR_RESTRICT out, float* LLMPAR_RESTRICT lse, const T* LLMPAR_RESTRICT qkv,
                      AttentionShape shape) {
  using Tl = TcTiles<kHs>;
  constexpr int kStride = Tl::kStride;
  constexpr bool kCausal = kMask == AttentionMask::causal;
  T* qs = dynamic_shared_memory<T>();   // (kTcQueryTile, kStride) this CTA's q rows
  T* ks = qs + kTcQueryTile * kStride;  // (kTcKeyTile, kStride) key tile
  T* vs = ks + kTcKeyTile * kStride;    // (kTcKeyTile, kStride) value tile

  const std::int64_t T_len = shape.seq, R = shape.row(), Q = shape.q_dim();
  const int hs = static_cast<int>(shape.head_dim);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int g = lane / 4;  // accumulator rows g and g + 8 of the warp's 16
  const int t = lane % 4;  // accumulator columns 2t, 2t + 1 of each n tile
  const std::int64_t bh = blockIdx.x;
  const std::int64_t b = bh / shape.heads;
  const std::int64_t h = bh % shape.heads;
  const std::int64_t i0 = static_cast<std::int64_t>(gridDim.y - 1 - blockIdx.y) * kTcQueryTile;
  const int ni = static_cast<int>(std::min<std::int64_t>(kTcQueryTile, T_len - i0));
  const T* rows = qkv + b * T_len * R;                    // (T, R) of batch b
  const T* qh = rows + shape.q_col(h);                    // (T, hs) at stride R: this head's q
  const T* kh = rows + shape.k_col(shape.kv_head_of(h));  // its kv head's k
  const T* vh = rows + shape.v_col(shape.kv_head_of(h));  // and v
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));

  // ldmatrix row addresses of this lane. For an x4 load of a 16x16 block the lanes
  // 0-7, 8-15, 16-23, 24-31 address matrices 0-3; `lo8` is the row within a matrix.
  const int lo8 = lane % 8;
  const int m1 = (lane / 8) % 2;  // 1 for the lanes addressing matrices 1 and 3
  const int m2 = lane / 16;       // 1 for the lanes addressing matrices 2 and 3

  load_tile_b16<kHs, kTcQueryTile, kStride>(qs, qh + i0 * R, R, ni, hs);
  __syncthreads();  // qs is written
  // A fragments of this warp's 16 q rows, k step kk: matrices (rows 0-7, columns 0-7),
  // (rows 8-15, 0-7), (rows 0-7, 8-15), (rows 8-15, 8-15) are a[0..3].
  std::uint32_t qf[Tl::kKSteps][4];
#pragma unroll
  for (int kk = 0; kk < Tl::kKSteps; ++kk)
    ldmatrix_x4(qf[kk], qs + (warp * kTcRowsPerWarp + lo8 + 8 * m1) * kStride + 16 * kk + 8 * m2);

  const std::int64_t r0 = i0 + warp * kTcRowsPerWarp;  // this warp's first row
  float o[Tl::kDimN][4] = {};           // unnormalised output: o[n][i], row g + 8 (i / 2), column 8n + 2t + i % 2
  math::OnlineSoftmax<float> state[2];  // rows g and g + 8, identical in the 4 lanes of a group
  const std::int64_t key_end = kCausal ? std::min<std::int64_t>(T_len, i0 + kTcQueryTile) : T_len;

  for (std::int64_t j0 = 0; j0 < key_end; j0 += kTcKeyTile) {
    const int nj = static_cast<int>(std::min<std::int64_t>(kTcKeyTile, T_len - j0));
    __syncthreads();  // the previous tile's ks and vs are no longer read
    load_tile_b16<kHs, kTcKeyTile, kStride>(ks, kh + j0 * R, R, nj, hs);
    load_tile_b16<kHs, kTcKeyTile, kStride>(vs, vh + j0 * R, R, nj, hs);
    __syncthreads();  // ks and vs are written
    // Warp-uniform skips (mma.sync and ldmatrix need the whole warp).
    if (r0 >= T_len) continue;                              // this warp's rows are all padding
    if (kCausal && j0 > r0 + kTcRowsPerWarp - 1) continue;  // every key is after every row of this warp

    // s = q k^T: (16, kTcKeyTile) per warp, s[n][i] at row g + 8 (i / 2), key j0 + 8n + 2t + i % 2.
    // B = k^T is column-major in k's rows: the x4 matrices (keys 0-7, dims 0-7),
    // (keys 0-7, dims 8-15), (keys 8-15, dims 0-7), (keys 8-15, dims 8-15) are b0, b1 of
    // key tile 2 n2 and b0, b1 of key tile 2 n2 + 1.
    float s[Tl::kKeyN][4] = {};
#pragma unroll
    for (int kk = 0; kk < Tl::kKSteps; ++kk) {
#pragma unroll
      for (int n2 = 0; n2 < Tl::kKeyN / 2; ++n2) {
        std::uint32_t kb[4];
        ldmatrix_x4(kb, ks + (16 * n2 + lo8 + 8 * m2) * kStride + 16 * kk + 8 * m1);
        mma_m16n8k16<T>(s[2 * n2], qf[kk], kb[0], kb[1]);
        mma_m16n8k16<T>(s[2 * n2 + 1], qf[kk], kb[2], kb[3]);
      }
    }

    // Scale; mask keys past T (ragged tail) and, near the diagonal, keys after the row.
    // In tile coordinates (32-bit): key jj = 8n + 2t + i % 2 is valid when jj < nj and,
    // causal, jj <= row - j0 = diag + g + 8 (i / 2); diag is clamped where it is large
    // (no key of the tile is after the row then).
    const bool needs_mask = nj < kTcKeyTile || (kCausal && j0 + kTcKeyTile - 1 > r0);
    const int diag = static_cast<int>(std::min<std::int64_t>(r0 - j0, kTcKeyTile));
#pragma unroll
    for (int n = 0; n < Tl::kKeyN; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[n][i] *= scale;
        if (needs_mask) {
          const int jj = 8 * n + 2 * t + i % 2;
          if (jj >= nj || (kCausal && jj > diag + g + 8 * (i / 2))) s[n][i] = -INFINITY;
        }
      }
    }

    // Online softmax per row; s becomes p = exp(s - max), 0 for a masked key (never
    // exp(-inf - max): max is -inf while a row has seen nothing).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < Tl::kKeyN; ++n) tile_max = fmaxf(tile_max, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
      tile_max = quad_max(tile_max);
      math::OnlineSoftmax<float>& st = state[half];
      if (tile_max > st.max) {
        const float factor = st.rescale(tile_max);
#pragma unroll
        for (int n = 0; n < Tl::kDimN; ++n) {
          o[n][2 * half] *= factor;
          o[n][2 * half + 1] *= factor;
        }
      }
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < Tl::kKeyN; ++n) {
#pragma unroll
        for (int i = 2 * half; i < 2 * half + 2; ++i) {
          const float p = s[n][i] == -INFINITY ? 0.0f : math::exp(s[n][i] - st.max);
          s[n][i] = p;
          sum += p;
        }
      }
      st.sum += quad_sum(sum);
    }

    // o += p v. The A fragment of key step kk is the s fragments of key tiles 2 kk and
    // 2 kk + 1, rounded to T. B = v is row-major in v's rows: the transposed x4 matrices
    // (keys 0-7, dims 0-7), (keys 8-15, dims 0-7), (keys 0-7, dims 8-15),
    // (keys 8-15, dims 8-15) are b0, b1 of dim tile 2 n2 and b0, b1 of dim tile 2 n2 + 1.
#pragma unroll
    for (int kk = 0; kk < Tl::kPvSteps; ++kk) {
      const std::uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                   pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                   pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n2 = 0; n2 < Tl::kDimN / 2; ++n2) {
        std::uint32_t vb[4];
        ldmatrix_x4_trans(vb, vs + (16 * kk + lo8 + 8 * m1) * kStride + 16 * n2 + 8 * m2);
        mma_m16n8k16<T>(o[2 * n2], pa, vb[0], vb[1]);
        mma_m16n8k16<T>(o[2 * n2 + 1], pa, vb[2], vb[3]);
      }
    }
  }

  // Normalise and write rows g and g + 8 (columns 8n + 2t, 2t + 1 as one 4-byte store),
  // the head's columns: whole n tiles of 8, as hs is a multiple of 8.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t i = r0 + g + 8 * half;
    if (i >= T_len) continue;
    const float inv = 1.0f / state[half].sum;
    T* orow = out + (b * T_len + i) * Q + h * hs;  // (hs)
#pragma unroll
    for (int n = 0; n < Tl::kDimN; ++n)
      if (8 * n < hs)
        *reinterpret_cast<std::uint32_t*>(orow + 8 * n + 2 * t) =
            pack2<T>(o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
    if (t == 0) lse[bh * T_len + i] = state[half].log_sum_exp();
  }
}

// Lets `kernel` use `bytes` bytes of dynamic shared memory (above 48 KiB it must opt in).
template <class Kernel>
void allow_shared_memory(Kernel* kernel, int bytes, const char* name) {
  if (bytes > 48 * 1024)
    LLMPAR_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "allowing ",
                      name, " ", bytes, " bytes of shared memory (an sm_80 or newer GPU has enough)");
}

template <class T, int kHs, AttentionMask kMask>
void launch_forward(cudaStream_t stream, T* out, float* lse, const T* qkv, const AttentionShape& shape) {
  using Tl = Tiles<kHs>;
  auto* kernel = &forward_kernel<T, kHs, kMask>;
  allow_shared_memory(kernel, Tl::kForwardSmem * 4, "attention forward_kernel");
  const dim3 grid(static_cast<unsigned>(shape.batch * shape.heads),
                  static_cast<unsigned>(ceil_div(shape.seq, Tl::kQueryTile)));
  launch_kernel(kernel, grid, kThreads, Tl::kForwardSmem * sizeof(float), stream, out, lse, qkv, shape);
  LLMPAR_CHECK_LAUNCH("attention forward_kernel");
}

template <class T, int kHs, AttentionMask kMask>
void launch_forward_tc(cudaStream_t stream, T* out, float* lse, const T* qkv, const AttentionShape& shape) {
  using Tl = TcTiles<kHs>;
  auto* kernel = &forward_tc_kernel<T, kHs, kMask>;
  allow_shared_memory(kernel, Tl::kSmemBytes, "attention forward_tc_kernel");
  const dim3 grid(static_cast<unsigned>(shape.batch * shape.heads),
                  static_cast<unsigned>(ceil_div(shape.seq, kTcQueryTile)));
  launch_kernel(kernel, grid, kTcThreads, Tl::kSmemBytes, stream, out, lse, qkv, shape);
  LLMPAR_CHECK_LAUNCH("attention forward_tc_kernel");
}

template <class T, int kHs, AttentionMask kMask>
void launch_backward(cudaStream_t stream, T* dqkv, const T* dout, const T* qkv, const T* out, const float* lse,
                     float* workspace, const AttentionShape& shape) {
  using Tl = Tiles<kHs>;
  float* dsum = workspace;  // (B, NH, T)
  const std::int64_t rows = shape.batch * shape.heads * shape.seq;
  launch_kernel(&dsum_kernel<T>, static_cast<unsigned>(ceil_div(rows, kWarps)), kThreads, 0, stream, dsum, dout, out,
                rows, shape);
  LLMPAR_CHECK_LAUNCH("attention dsum_kernel");

  auto* dkv = &backward_dkv_kernel<T, kHs, kMask>;
  allow_shared_memory(dkv, Tl::kDkvSmem * 4, "attention backward_dkv_kernel");
  const dim3 dkv_grid(static_cast<unsigned>(shape.batch * shape.kv_heads),
                      static_cast<unsigned>(ceil_div(shape.seq, Tl::kKeyTileBwd)));
  launch_kernel(dkv, dkv_grid, kThreads, Tl::kDkvSmem * sizeof(float), stream, dqkv, dout, qkv, lse, dsum, shape);
  LLMPAR_CHECK_LAUNCH("attention backward_dkv_kernel");

  auto* dq = &backward_dq_kernel<T, kHs, kMask>;
  allow_shared_memory(dq, Tl::kDqSmem * 4, "attention backward_dq_kernel");
  const dim3 dq_grid(static_cast<unsigned>(shape.batch * shape.heads),
                     static_cast<unsigned>(ceil_div(shape.seq, Tl::kQueryTile)));
  launch_kernel(dq, dq_grid, kThreads, Tl::kDqSmem * sizeof(float), stream, dqkv, dout, qkv, lse, dsum, shape);
  LLMPAR_CHECK_LAUNCH("attention backward_dq_kernel");
}

// f(kHs, kMask) as integral constants: the compiled head size of `Sizes` that serves hs,
// and the mask.
template <class Sizes, class F>
void with_head_size_and_mask(Sizes sizes, std::int64_t hs, AttentionMask mask, F&& f) {
  with_head_size(sizes, hs, [&](auto kHs) { with_mask(mask, [&](auto kMask) { f(kHs, kMask); }); });
}

// Whether the tensor-core forward serves a call with 16-bit storage: hs <= 256 (all), and
// pointers aligned for its 16-byte loads of qkv rows and 4-byte stores of out pairs
// (cudaMalloc gives 256 bytes; an offset view may not, and then the SIMT path runs).
// Rows and head offsets are multiples of hs, hence of 8 elements: aligned with the base.
inline bool tensor_cores_serve(std::int64_t hs, const void* out, const void* qkv) {
  return hs <= kTcMaxHeadSize && reinterpret_cast<std::uintptr_t>(qkv) % 16 == 0 &&
         reinterpret_cast<std::uintptr_t>(out) % 4 == 0;
}

#endif  // LLMPAR_DEVICE_CODE

// Checks the shape on the host (AttentionShape::check, then what the CUDA kernels add:
// the head sizes they are compiled for and the grid's limits).
inline void check_shape(const char* who, const AttentionShape& shape) {
  shape.check(who);
  const std::int64_t hs = shape.head_dim, rows = shape.batch * shape.heads;
  LLMPAR_CHECK(hs % kHeadSizeStep == 0 && hs >= kMinHeadSize && hs <= kMaxHeadSize, who, ": head size head_dim = ", hs,
               " is not supported by the CUDA kernels; supported head sizes are the multiples of 8 from 16 to 256");
  // The forward and dq grids' x extent is B * NH (dk/dv's, B * KVH, is no larger).
  LLMPAR_CHECK(rows <= 0x7FFFFFFF, who, ": B * heads = ", rows, " exceeds the grid limit 2^31 - 1");
  // A grid's y extent is at most 65535 (T over the smallest tile of the kernels serving
  // hs; the tensor-core forward's 64 rows are never smaller) and the D kernel runs 4 rows
  // per CTA on a grid's x extent.
  const std::int64_t tile =
      with_head_size(SimtHeadSizes{}, hs, [](auto kHs) { return Tiles<decltype(kHs)::value>::kSmallestTile; });
  LLMPAR_CHECK(ceil_div(shape.seq, tile) <= 65535, who, ": T = ", shape.seq,
               " exceeds the longest supported sequence at head_dim = ", hs, ", ", 65535 * tile);
  LLMPAR_CHECK(ceil_div(rows * shape.seq, kWarps) <= 0x7FFFFFFF, who, ": B * heads * T = ", rows * shape.seq,
               " exceeds the grid limit of the backward's D kernel, ", std::int64_t{kWarps} * 0x7FFFFFFF);
}

}  // namespace detail::attn

// Floats of workspace attention_backward needs: D = dout . out, one per (b, query head, t).
inline std::int64_t attention_backward_workspace(const AttentionShape& shape) {
  detail::attn::check_shape("attention_backward_workspace", shape);
  return shape.batch * shape.heads * shape.seq;
}

#if defined(LLMPAR_DEVICE_CODE)

// out: (B, T, NH hs); lse: (B, NH, T) float log-sum-exp of each row's scaled scores;
// qkv: (B, T, (NH + 2 KVH) hs), core/attention_shape.hpp's layout (query head h reads kv
// head h % KVH). Scores are scaled by 1/sqrt(hs), hs = shape.head_dim a multiple of 8
// from 16 to 256.
template <Storage T>
void attention_forward(cudaStream_t stream, T* out, float* lse, const T* qkv, const AttentionShape& shape,
                       AttentionMask mask = AttentionMask::causal) {
  namespace attn = detail::attn;
  attn::check_shape("attention_forward", shape);
  if (shape.batch == 0 || shape.seq == 0) return;
  const std::int64_t hs = shape.head_dim;
  if constexpr (!std::is_same_v<T, float>) {
    if (attn::tensor_cores_serve(hs, out, qkv)) {
      attn::with_head_size_and_mask(attn::TcHeadSizes{}, hs, mask, [&](auto kHs, auto kMask) {
        attn::launch_forward_tc<T, decltype(kHs)::value, decltype(kMask)::value>(stream, out, lse, qkv, shape);
      });
      return;
    }
  }
  attn::with_head_size_and_mask(attn::SimtHeadSizes{}, hs, mask, [&](auto kHs, auto kMask) {
    attn::launch_forward<T, decltype(kHs)::value, decltype(kMask)::value>(stream, out, lse, qkv, shape);
  });
}

// Overwrites dqkv: (B, T, (NH + 2 KVH) hs), each kv head's dk and dv summed over the
// query heads that read it. dout, out: (B, T, NH hs); qkv as forward's; lse: (B, NH, T)
// from attention_forward on the same qkv with the same mask. dqkv must not alias the
// inputs. workspace: attention_backward_workspace(shape) floats, caller-owned, in use
// until the queued work has run.
template <Storage T>
void attention_backward(cudaStream_t stream, T* dqkv, const T* dout, const T* qkv, const T* out, const float* lse,
                        float* workspace, const AttentionShape& shape, AttentionMask mask = AttentionMask::causal) {
  namespace attn = detail::attn;
  attn::check_shape("attention_backward", shape);
  if (shape.batch == 0 || shape.seq == 0) return;
  LLMPAR_CHECK(workspace != nullptr, "attention_backward: workspace is null; pass a buffer of ",
               "attention_backward_workspace(shape) = ", shape.batch * shape.heads * shape.seq, " floats");
  attn::with_head_size_and_mask(attn::SimtHeadSizes{}, shape.head_dim, mask, [&](auto kHs, auto kMask) {
    attn::launch_backward<T, decltype(kHs)::value, decltype(kMask)::value>(stream, dqkv, dout, qkv, out, lse, workspace,
                                                                           shape);
  });
}

#endif  // LLMPAR_DEVICE_CODE

}  // namespace llmpar::kernels
