// llmpar/backend/cpu/attention_block.hpp — causal attention one block at a time: the
// queries of one chunk of a sequence against the keys and values of another, as ring
// attention (context parallelism, nn/context_parallel.hpp) computes it.
//
// A rank holding chunks of every sequence sees the other ranks' keys and values one
// block at a time. So the forward keeps each query row's flash-attention state (the
// running max m, the running sum l and the unnormalised output o, in acc_t<T>) across
// blocks: init, one attention_block_forward per (query chunk, key chunk) pair that the
// causal mask lets through, then finish (out = o / l, lse = m + log l). A block is the
// diagonal one (the same positions: causal inside it) or one whose keys all come before
// its queries (every key visible); a block whose keys all come after is never passed.
// The backward needs only the final lse and D = dout · out per row (attention_dsum):
// each block adds its dq into an acc_t<T> buffer of the rank's queries and its dk, dv
// into an acc_t<T> buffer of that block's keys (which travels back to their owner).
//
// Layouts (core/attention_shape.hpp): q from qkv (B, S, R) at q_col(h); keys and values
// from a buffer of rows kv_stride apart, k at k_offset + g·hs and v at v_offset + g·hs of
// a row (qkv itself: R, q_dim, q_dim + kv_dim; a packed copy: 2 kv_dim, 0, kv_dim);
// query head h reads kv head h % kv_heads. The block's rows are [q_first, q_first + len)
// of the queries' S rows per sequence and [kv_first, kv_first + len) of the keys' kv_seq.
//
// Work is cut as in backend/cpu/attention.hpp, whose tile functions (forward_key_tile,
// backward_tile_pair) do the arithmetic of both, with the same determinism: a forward
// task owns a (b, h, query tile), a backward task a (b, kv head) and its group's query
// heads, so nothing races and the result does not depend on the thread count. Blocks
// are accumulated in the order the caller passes them.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "llmpar/backend/cpu/attention.hpp"
#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/math/exp.hpp"
#include "llmpar/math/online_softmax.hpp"

namespace llmpar::backend::cpu {

namespace detail::attn {

template <int kHs, class T>
void block_forward_tile(const AttentionState<acc_t<T>>& st, const T* LLMPAR_RESTRICT qkv, const T* LLMPAR_RESTRICT kv,
                        std::int64_t b, std::int64_t h, std::int64_t i0, const AttentionShape& shape,
                        const AttentionBlock& blk, acc_t<T>* LLMPAR_RESTRICT scratch) {
  using Acc = acc_t<T>;
  const std::int64_t hs = kHs > 0 ? kHs : shape.head_dim;
  const std::int64_t S = shape.seq, R = shape.row(), Q = shape.q_dim(), g = shape.kv_head_of(h);
  const Acc scale = Acc(1) / std::sqrt(static_cast<Acc>(hs));
  const std::int64_t ni = std::min(kTile, blk.len - i0);
  const std::int64_t qrow = b * S + blk.q_first + i0;  // the tile's first query row
  const T* LLMPAR_RESTRICT qh = qkv + qrow * R + shape.q_col(h);
  const T* LLMPAR_RESTRICT kh = kv + (b * blk.kv_seq + blk.kv_first) * blk.kv_stride + blk.k_offset + g * hs;
  const T* LLMPAR_RESTRICT vh = kv + (b * blk.kv_seq + blk.kv_first) * blk.kv_stride + blk.v_offset + g * hs;
  Acc* LLMPAR_RESTRICT o_rows = st.o + qrow * Q + h * hs;                             // ni rows Q apart
  Acc* LLMPAR_RESTRICT m_rows = st.m + (b * shape.heads + h) * S + blk.q_first + i0;  // (ni)
  Acc* LLMPAR_RESTRICT l_rows = st.l + (b * shape.heads + h) * S + blk.q_first + i0;

  Acc* LLMPAR_RESTRICT q = scratch;          // (ni, hs)
  Acc* LLMPAR_RESTRICT o = q + kTile * hs;   // (ni, hs) unnormalised output
  Acc* LLMPAR_RESTRICT kt = o + kTile * hs;  // (hs, kTile) key tile, transposed
  Acc* LLMPAR_RESTRICT v = kt + kTile * hs;  // (nj, hs)
  Acc* LLMPAR_RESTRICT s = v + kTile * hs;   // (kTile) scores, then weights, of one row
  math::OnlineSoftmax<Acc> state[kTile];     // (ni)

  pack_rows(q, qh, ni, hs, R);
  for (std::int64_t r = 0; r < ni; ++r) {
    std::copy(o_rows + r * Q, o_rows + r * Q + hs, o + r * hs);
    state[r].max = m_rows[r];
    state[r].sum = l_rows[r];
  }
  const std::int64_t last = blk.causal ? i0 : blk.len - 1;  // the last key tile's first row bound
  for (std::int64_t j0 = 0; j0 <= last && j0 < blk.len; j0 += kTile) {
    const std::int64_t nj = std::min(kTile, blk.len - j0);
    pack_transposed(kt, kh + j0 * blk.kv_stride, nj, hs, blk.kv_stride);
    pack_rows(v, vh + j0 * blk.kv_stride, nj, hs, blk.kv_stride);
    forward_key_tile<kHs>(o, state, q, kt, v, s, ni, nj, hs, scale, blk.causal, i0 - j0);
  }
  for (std::int64_t r = 0; r < ni; ++r) {
    std::copy(o + r * hs, o + (r + 1) * hs, o_rows + r * Q);
    m_rows[r] = state[r].max;
    l_rows[r] = state[r].sum;
  }
}

// One kv head g of batch b over one block: its group's query heads in order.
template <int kHs, class T>
void block_backward_kv_head(acc_t<T>* LLMPAR_RESTRICT dq, acc_t<T>* LLMPAR_RESTRICT dkv, const T* LLMPAR_RESTRICT dout,
                            const T* LLMPAR_RESTRICT qkv, const T* LLMPAR_RESTRICT kv,
                            const acc_t<T>* LLMPAR_RESTRICT lse, const acc_t<T>* LLMPAR_RESTRICT dsum, std::int64_t b,
                            std::int64_t g, const AttentionShape& shape, const AttentionBlock& blk,
                            acc_t<T>* LLMPAR_RESTRICT scratch) {
  using Acc = acc_t<T>;
  const std::int64_t hs = kHs > 0 ? kHs : shape.head_dim;
  const std::int64_t S = shape.seq, R = shape.row(), Q = shape.q_dim(), KV = shape.kv_dim(), L = blk.len;
  const Acc scale = Acc(1) / std::sqrt(static_cast<Acc>(hs));
  const std::int64_t qrow0 = b * S + blk.q_first;  // the block's first query row
  const T* LLMPAR_RESTRICT kh = kv + (b * blk.kv_seq + blk.kv_first) * blk.kv_stride + blk.k_offset + g * hs;
  const T* LLMPAR_RESTRICT vh = kv + (b * blk.kv_seq + blk.kv_first) * blk.kv_stride + blk.v_offset + g * hs;
  // dkv (B, kv_seq, 2 KV): this head's dk at g·hs, dv at KV + g·hs of the block's rows.
  Acc* LLMPAR_RESTRICT dk_rows = dkv + (b * blk.kv_seq + blk.kv_first) * 2 * KV + g * hs;
  Acc* LLMPAR_RESTRICT dv_rows = dk_rows + KV;

  Acc* LLMPAR_RESTRICT q = scratch;               // (L, hs) of the query head in hand
  Acc* LLMPAR_RESTRICT k = q + L * hs;            // (L, hs)
  Acc* LLMPAR_RESTRICT go = k + L * hs;           // (L, hs) dout of the query head
  Acc* LLMPAR_RESTRICT dqh = go + L * hs;         // (L, hs)
  Acc* LLMPAR_RESTRICT dk = dqh + L * hs;         // (L, hs) summed over the group
  Acc* LLMPAR_RESTRICT dv = dk + L * hs;          // (L, hs) summed over the group
  Acc* LLMPAR_RESTRICT D = dv + L * hs;           // (L) dout · out
  Acc* LLMPAR_RESTRICT o = D + L;                 // unused: backward_scratch's shape
  Acc* LLMPAR_RESTRICT kt = o + hs;               // (hs, kTile) key tile, transposed
  Acc* LLMPAR_RESTRICT vt = kt + hs * kTile;      // (hs, kTile) value tile, transposed
  Acc* LLMPAR_RESTRICT pt = vt + hs * kTile;      // (kTile keys, kTile rows) p^T
  Acc* LLMPAR_RESTRICT dst = pt + kTile * kTile;  // (kTile keys, kTile rows) (ds * scale)^T
  Acc* LLMPAR_RESTRICT p = dst + kTile * kTile;   // (kTile) p of one row
  Acc* LLMPAR_RESTRICT dp = p + kTile;            // (kTile) dp, then ds * scale, of one row

  pack_rows(k, kh, L, hs, blk.kv_stride);
  std::fill(dk, dk + 2 * L * hs, Acc(0));  // dk, dv
  for (std::int64_t h = g; h < shape.heads; h += shape.kv_heads) {
    const Acc* LLMPAR_RESTRICT lse_h = lse + (b * shape.heads + h) * S + blk.q_first;  // (L)
    const Acc* LLMPAR_RESTRICT dsum_h = dsum + (b * shape.heads + h) * S + blk.q_first;
    pack_rows(q, qkv + qrow0 * R + shape.q_col(h), L, hs, R);
    pack_rows(go, dout + qrow0 * Q + h * hs, L, hs, Q);
    std::copy(dsum_h, dsum_h + L, D);
    std::fill(dqh, dqh + L * hs, Acc(0));
    for (std::int64_t j0 = 0; j0 < L; j0 += kTile) {
      const std::int64_t nj = std::min(kTile, L - j0);
      pack_transposed(kt, kh + j0 * blk.kv_stride, nj, hs, blk.kv_stride);
      pack_transposed(vt, vh + j0 * blk.kv_stride, nj, hs, blk.kv_stride);
      for (std::int64_t i0 = blk.causal ? j0 : 0; i0 < L; i0 += kTile)
        backward_tile_pair<kHs>(dqh, dk, dv, q, go, k, kt, vt, lse_h, D, p, dp, pt, dst, i0, std::min(kTile, L - i0),
                                j0, nj, hs, scale, blk.causal);
    }
    Acc* LLMPAR_RESTRICT dq_rows = dq + qrow0 * Q + h * hs;
    for (std::int64_t i = 0; i < L; ++i)
#pragma omp simd
      for (std::int64_t d = 0; d < hs; ++d) dq_rows[i * Q + d] += dqh[i * hs + d];
  }
  for (std::int64_t j = 0; j < L; ++j)
#pragma omp simd
    for (std::int64_t d = 0; d < hs; ++d) {
      dk_rows[j * 2 * KV + d] += dk[j * hs + d];
      dv_rows[j * 2 * KV + d] += dv[j * hs + d];
    }
}

}  // namespace detail::attn

// o = 0, m = -inf, l = 0 for every query row.
template <class Acc>
void attention_state_init(const AttentionState<Acc>& st, const AttentionShape& shape) {
  const std::int64_t rows = shape.batch * shape.seq;
  std::fill(st.o, st.o + rows * shape.q_dim(), Acc(0));
  std::fill(st.m, st.m + rows * shape.heads, Acc(-INFINITY));
  std::fill(st.l, st.l + rows * shape.heads, Acc(0));
}

// The block's keys and values folded into the state of its queries.
template <class T>
void attention_block_forward(const AttentionState<acc_t<T>>& st, const T* qkv, const T* kv, const AttentionShape& shape,
                             const AttentionBlock& blk) {
  using Acc = acc_t<T>;
  blk.check(shape, "attention_block_forward");
  if (shape.batch == 0 || blk.len == 0) return;
  const std::int64_t hs = shape.head_dim, BH = shape.batch * shape.heads;
  const std::int64_t tiles = ceil_div(blk.len, detail::attn::kTile), tasks = BH * tiles;
  const std::int64_t per_thread = 4 * detail::attn::kTile * hs + detail::attn::kTile;
  const bool parallel = tasks > 1 && BH * blk.len * blk.len * hs >= kMinParallelWork;
  const int threads = parallel ? omp_get_max_threads() : 1;
  Buffer<Acc> scratch(threads * per_thread);
  detail::attn::with_head_size(hs, [&](auto khs) {
#pragma omp parallel num_threads(threads) if (parallel)
    {
      Acc* mine = scratch.data() + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < tasks; ++task) {
        const std::int64_t tile = tiles - 1 - task / BH, bh = task % BH;
        detail::attn::block_forward_tile<decltype(khs)::value>(st, qkv, kv, bh / shape.heads, bh % shape.heads,
                                                               tile * detail::attn::kTile, shape, blk, mine);
      }
    }
  });
}

// out (B, S, heads·hs) = o / l and lse (B, heads, S) = m + log l, once every block is in.
template <class T>
void attention_state_finish(T* out, acc_t<T>* lse, const AttentionState<acc_t<T>>& st, const AttentionShape& shape) {
  using Acc = acc_t<T>;
  const std::int64_t hs = shape.head_dim, Q = shape.q_dim();
#pragma omp parallel for schedule(static) if (shape.batch * shape.seq * Q >= kMinParallelWork)
  for (std::int64_t bh = 0; bh < shape.batch * shape.heads; ++bh) {
    const std::int64_t b = bh / shape.heads, h = bh % shape.heads;
    for (std::int64_t t = 0; t < shape.seq; ++t) {
      const std::int64_t k = bh * shape.seq + t;
      const Acc inv = Acc(1) / st.l[k];
      const Acc* LLMPAR_RESTRICT o = st.o + (b * shape.seq + t) * Q + h * hs;
      T* LLMPAR_RESTRICT y = out + (b * shape.seq + t) * Q + h * hs;
      for (std::int64_t d = 0; d < hs; ++d) store(y, d, o[d] * inv);
      lse[k] = st.m[k] + std::log(st.l[k]);
    }
  }
}

// dsum (B, heads, S) = dout · out per query row and head (the backward's D).
template <class T>
void attention_dsum(acc_t<T>* dsum, const T* dout, const T* out, const AttentionShape& shape) {
  using Acc = acc_t<T>;
  const std::int64_t hs = shape.head_dim, Q = shape.q_dim();
#pragma omp parallel for schedule(static) if (shape.batch * shape.seq * Q >= kMinParallelWork)
  for (std::int64_t bh = 0; bh < shape.batch * shape.heads; ++bh) {
    const std::int64_t b = bh / shape.heads, h = bh % shape.heads;
    for (std::int64_t t = 0; t < shape.seq; ++t) {
      const std::int64_t at = (b * shape.seq + t) * Q + h * hs;
      Acc sum = 0;
      for (std::int64_t d = 0; d < hs; ++d) sum += load(dout + at, d) * load(out + at, d);
      dsum[bh * shape.seq + t] = sum;
    }
  }
}

// dq (B, S, heads·hs) += the block's query gradients; dkv (B, kv_seq, 2 kv_dim) += its
// key gradients (at g·hs of a row) and value gradients (at kv_dim + g·hs). lse and dsum
// are the final ones (B, heads, S).
template <class T>
void attention_block_backward(acc_t<T>* dq, acc_t<T>* dkv, const T* dout, const T* qkv, const T* kv,
                              const acc_t<T>* lse, const acc_t<T>* dsum, const AttentionShape& shape,
                              const AttentionBlock& blk) {
  using Acc = acc_t<T>;
  blk.check(shape, "attention_block_backward");
  if (shape.batch == 0 || blk.len == 0) return;
  const std::int64_t tasks = shape.batch * shape.kv_heads;
  const std::int64_t per_thread = detail::attn::backward_scratch(blk.len, shape.head_dim);
  const bool parallel = tasks > 1 && shape.batch * shape.heads * blk.len * blk.len * shape.head_dim >= kMinParallelWork;
  const int threads = parallel ? static_cast<int>(std::min<std::int64_t>(omp_get_max_threads(), tasks)) : 1;
  Buffer<Acc> scratch(threads * per_thread);
  detail::attn::with_head_size(shape.head_dim, [&](auto khs) {
#pragma omp parallel num_threads(threads) if (parallel)
    {
      Acc* mine = scratch.data() + omp_get_thread_num() * per_thread;
#pragma omp for schedule(static)
      for (std::int64_t task = 0; task < tasks; ++task)
        detail::attn::block_backward_kv_head<decltype(khs)::value>(
            dq, dkv, dout, qkv, kv, lse, dsum, task / shape.kv_heads, task % shape.kv_heads, shape, blk, mine);
    }
  });
}

}  // namespace llmpar::backend::cpu
