// llmpar/backend/cpu/attention.hpp — causal multi-head self-attention, flash style.
//
//   out[b,t,h] = sum_{s<=t} softmax_s(q_t . k_s / sqrt(hs)) v_s      (per head h)
//
// Layout (core/attention_shape.hpp): qkv (B, T, R) straight from one fused linear, per
// row the q of NH heads, the k of KVH heads and their v, head h at columns
// [h*hs, (h+1)*hs) of each part; out (B, T, NH*hs) with q's head layout. GPT-2's is
// KVH = NH (R = 3C, llm.c's layout); grouped-query attention is KVH < NH, query head
// h reading kv head h % KVH. Nothing of size T x T is ever stored:
//
// Forward (FlashAttention, Dao et al. 2022). Queries are cut into tiles of kTile rows;
// for each query tile the key/value tiles at or before it are visited in order and
// every row keeps a math::OnlineSoftmax state plus an unnormalised output row, both
// rescaled when a tile raises the row's max. Tiles strictly above the diagonal are
// never touched and, in the diagonal tile, each row stops at its own position (rounded
// up to 16 keys in the score kernel), so the work is the causal T^2/2. The forward saves only out and lse =
// log-sum-exp of each row's scaled scores, which is all the backward needs to recompute probabilities.
//
// Backward (FlashAttention-2). With D_t = dout_t . out_t, for each key tile (outer)
// and the query rows at or after it (inner): p = exp(s - lse), dv += p dout,
// dp = dout . v, ds = p (dp - D), dq += ds k scale, dk += ds q scale. One (b, kv head)
// is one task: its thread runs the kv head's query heads one after another and owns
// their dq and the kv head's dk and dv, so nothing races and nothing needs atomics; dq is
// summed over key tiles in tile order, dk and dv over the group's heads in head order.
//
// Determinism: tiles are fixed by kTile, never by the thread count, and each output
// element is produced by one thread in one fixed order, so results are bitwise
// identical for any OMP_NUM_THREADS.
//
// Speed. A head's q/k/v rows sit R apart in qkv, so each tile is first packed into a
// contiguous acc_t<T> block (which also converts bf16/f16 once); the key and value
// tiles that rows are dotted with (q.k, dout.v) are packed transposed, (hs, kTile).
// All inner work is then two register-blocked row kernels that GCC vectorises:
// `dot_cols` (one row against up to 64 keys: broadcast a[d], FMA into 64 accumulators
// held in registers; no horizontal sums, no FMA latency chain) and `axpy_rows` (a row
// accumulates w[c] * row_c, four rows folded per pass). The backward's dk/dv updates
// read the tile's p and ds stored transposed, so they are axpy_rows too. hs = 32, 64
// and 128 are compiled with hs known; other head sizes run the same code with hs at
// run time. exp is math::exp (math/exp.hpp: branch-free on the host, so the loops over
// a row's scores vectorise). kTile = 64: a packed k^T and v tile (2 x 64 x hs floats,
// 32 KiB at hs = 64) stays in L1/L2 while a tile's rows use it.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/math/exp.hpp"
#include "llmpar/math/online_softmax.hpp"

namespace llmpar::backend::cpu {

namespace detail::attn {

// Query rows per query tile and keys per key tile (equal, so every row of a visited
// tile has at least one unmasked key: the diagonal tile starts at the row's tile).
inline constexpr std::int64_t kTile = 64;

static_assert(kTile == 64, "dot_cols dispatches 16, 32, 48 or 64 keys: a tile of 64");

// s[c] = scale * sum_d a[d] * bt[d * kTile + c] for c in [0, kCols).
// a: (hs); bt: (hs, kTile), a key tile transposed; s: (kCols).
// The kCols accumulators stay in registers: each step broadcasts one a[d] and does
// kCols / simd-width independent FMAs with contiguous loads, so there is no
// horizontal reduction and no FMA latency chain (a dot product per key would have
// both).
template <int kHs, int kCols, class Acc>
inline void dot_cols_fixed(Acc* LLMPAR_RESTRICT s, const Acc* LLMPAR_RESTRICT a, const Acc* LLMPAR_RESTRICT bt,
                           std::int64_t hs_runtime, Acc scale) {
  const std::int64_t hs = kHs > 0 ? kHs : hs_runtime;
  Acc acc[kCols] = {};
  for (std::int64_t d = 0; d < hs; ++d) {
    const Acc x = a[d];
    const Acc* LLMPAR_RESTRICT row = bt + d * kTile;
#pragma omp simd
    for (int c = 0; c < kCols; ++c) acc[c] += x * row[c];
  }
#pragma omp simd
  for (int c = 0; c < kCols; ++c) s[c] = acc[c] * scale;
}

// As dot_cols_fixed for the first n keys, rounded up to a block of 16 (the keys past
// n are computed from the tile's zero padding or from masked keys, and ignored).
template <int kHs, class Acc>
inline void dot_cols(Acc* LLMPAR_RESTRICT s, const Acc* LLMPAR_RESTRICT a, const Acc* LLMPAR_RESTRICT bt,
                     std::int64_t n, std::int64_t hs, Acc scale) {
  switch ((n + 15) / 16) {
    case 1:
      dot_cols_fixed<kHs, 16>(s, a, bt, hs, scale);
      break;
    case 2:
      dot_cols_fixed<kHs, 32>(s, a, bt, hs, scale);
      break;
    case 3:
      dot_cols_fixed<kHs, 48>(s, a, bt, hs, scale);
      break;
    default:
      dot_cols_fixed<kHs, 64>(s, a, bt, hs, scale);
      break;
  }
}

// acc += sum_c w[c] * (b + c*hs) for c in [0, n).   acc: (hs), w: (n), b: (n, hs)
template <int kHs, class Acc>
inline void axpy_rows(Acc* LLMPAR_RESTRICT acc, const Acc* LLMPAR_RESTRICT w, const Acc* LLMPAR_RESTRICT b,
                      std::int64_t n, std::int64_t hs_runtime) {
  const std::int64_t hs = kHs > 0 ? kHs : hs_runtime;
  std::int64_t c = 0;
  for (; c + 4 <= n; c += 4) {
    const Acc* LLMPAR_RESTRICT b0 = b + c * hs;
    const Acc* LLMPAR_RESTRICT b1 = b0 + hs;
    const Acc* LLMPAR_RESTRICT b2 = b1 + hs;
    const Acc* LLMPAR_RESTRICT b3 = b2 + hs;
    const Acc w0 = w[c], w1 = w[c + 1], w2 = w[c + 2], w3 = w[c + 3];
#pragma omp simd
    for (std::int64_t d = 0; d < hs; ++d) acc[d] += w0 * b0[d] + w1 * b1[d] + w2 * b2[d] + w3 * b3[d];
  }
  for (; c < n; ++c) {
    const Acc* LLMPAR_RESTRICT b0 = b + c * hs;
    const Acc w0 = w[c];
#pragma omp simd
    for (std::int64_t d = 0; d < hs; ++d) acc[d] += w0 * b0[d];
  }
}

// Copies n rows of one head into a contiguous block, converting to Acc.
// dst: (n, hs); src: rows `stride` elements apart.
template <class T, class Acc>
inline void pack_rows(Acc* LLMPAR_RESTRICT dst, const T* LLMPAR_RESTRICT src, std::int64_t n, std::int64_t hs,
                      std::int64_t stride) {
  for (std::int64_t r = 0; r < n; ++r) {
    const T* LLMPAR_RESTRICT row = src + r * stride;
    Acc* LLMPAR_RESTRICT out = dst + r * hs;
#pragma omp simd
    for (std::int64_t d = 0; d < hs; ++d) out[d] = load(row, d);
  }
}

// Packs n rows of one head transposed and zero-pads to a full tile.
// dst: (hs, kTile); src: rows `stride` elements apart.
template <class T, class Acc>
inline void pack_transposed(Acc* LLMPAR_RESTRICT dst, const T* LLMPAR_RESTRICT src, std::int64_t n, std::int64_t hs,
                            std::int64_t stride) {
  for (std::int64_t r = 0; r < n; ++r) {
    const T* LLMPAR_RESTRICT row = src + r * stride;
    for (std::int64_t d = 0; d < hs; ++d) dst[d * kTile + r] = load(row, d);
  }
  if (n < kTile) {
    for (std::int64_t d = 0; d < hs; ++d) std::fill(dst + d * kTile + n, dst + (d + 1) * kTile, Acc(0));
  }
}

// Inverse of pack_rows: dst rows `stride` apart; src: (n, hs).
template <class T, class Acc>
inline void unpack_rows(T* LLMPAR_RESTRICT dst, const Acc* LLMPAR_RESTRICT src, std::int64_t n, std::int64_t hs,
                        std::int64_t stride) {
  for (std::int64_t r = 0; r < n; ++r) {
    T* LLMPAR_RESTRICT row = dst + r * stride;
    const Acc* LLMPAR_RESTRICT in = src + r * hs;
#pragma omp simd
    for (std::int64_t d = 0; d < hs; ++d) store(row, d, in[d]);
  }
}

// The ni rows of a query tile (q, (ni, hs)) folded over one key tile of nj keys (kt,
// (hs, kTile) transposed; v, (nj, hs)): each row's scores, its running max and sum
// (state, rescaled when the tile raises the max) and its unnormalised output (o,
// (ni, hs)). Causal: row r sees the tile's keys up to diag + r (diag = the query
// tile's first position minus the key tile's). s: (kTile) one row's scores. The
// whole-sequence forward and the block forward (attention_block.hpp) share it.
template <int kHs, class Acc>
inline void forward_key_tile(Acc* LLMPAR_RESTRICT o, math::OnlineSoftmax<Acc>* LLMPAR_RESTRICT state,
                             const Acc* LLMPAR_RESTRICT q, const Acc* LLMPAR_RESTRICT kt, const Acc* LLMPAR_RESTRICT v,
                             Acc* LLMPAR_RESTRICT s, std::int64_t ni, std::int64_t nj, std::int64_t hs, Acc scale,
                             bool causal, std::int64_t diag) {
  for (std::int64_t r = 0; r < ni; ++r) {
    const std::int64_t n = causal ? std::min(nj, diag + r + 1) : nj;
    dot_cols<kHs>(s, q + r * hs, kt, n, hs, scale);
    Acc tile_max = s[0];
#pragma omp simd reduction(max : tile_max)
    for (std::int64_t c = 0; c < n; ++c) tile_max = std::max(tile_max, s[c]);
    math::OnlineSoftmax<Acc>& st = state[r];
    Acc* LLMPAR_RESTRICT orow = o + r * hs;
    if (tile_max > st.max) {
      const Acc factor = st.rescale(tile_max);
#pragma omp simd
      for (std::int64_t d = 0; d < hs; ++d) orow[d] *= factor;
    }
    const Acc m = st.max;
    Acc sum = 0;
#pragma omp simd reduction(+ : sum)
    for (std::int64_t c = 0; c < n; ++c) {
      s[c] = math::exp(s[c] - m);
      sum += s[c];
    }
    st.sum += sum;
    axpy_rows<kHs>(orow, s, v, n, hs);
  }
}

// One (query tile [i0, i0 + ni), key tile [j0, j0 + nj)) pair of one query head's
// backward: dq += ds k scale for the tile's rows, dv += p dout and dk += ds q scale for
// its keys. q, go (dout), dq: (rows, hs) and lse, D: (rows) of the head, by row; k, dk,
// dv: (keys, hs) by key; kt, vt: the key tile's k and v transposed. Causal: row i sees
// keys up to i (i0 >= j0). p, dp: (kTile) one row's; pt, dst: (kTile keys, kTile rows).
// The whole-sequence backward and the block backward share it.
template <int kHs, class Acc>
inline void backward_tile_pair(Acc* LLMPAR_RESTRICT dq, Acc* LLMPAR_RESTRICT dk, Acc* LLMPAR_RESTRICT dv,
                               const Acc* LLMPAR_RESTRICT q, const Acc* LLMPAR_RESTRICT go,
                               const Acc* LLMPAR_RESTRICT k, const Acc* LLMPAR_RESTRICT kt,
                               const Acc* LLMPAR_RESTRICT vt, const Acc* LLMPAR_RESTRICT lse,
                               const Acc* LLMPAR_RESTRICT D, Acc* LLMPAR_RESTRICT p, Acc* LLMPAR_RESTRICT dp,
                               Acc* LLMPAR_RESTRICT pt, Acc* LLMPAR_RESTRICT dst, std::int64_t i0, std::int64_t ni,
                               std::int64_t j0, std::int64_t nj, std::int64_t hs, Acc scale, bool causal) {
  const Acc* LLMPAR_RESTRICT kj = k + j0 * hs;  // (nj, hs)
  for (std::int64_t r = 0; r < ni; ++r) {
    const std::int64_t i = i0 + r;
    const std::int64_t n = causal ? std::min(nj, i - j0 + 1) : nj;  // causal: keys j0 .. i
    dot_cols<kHs>(p, q + i * hs, kt, n, hs, scale);
    dot_cols<kHs>(dp, go + i * hs, vt, n, hs, Acc(1));
    const Acc l = lse[i];
    const Acc Di = D[i];
#pragma omp simd
    for (std::int64_t c = 0; c < n; ++c) {
      p[c] = math::exp(p[c] - l);
      dp[c] = p[c] * (dp[c] - Di) * scale;
    }
    axpy_rows<kHs>(dq + i * hs, dp, kj, n, hs);
    for (std::int64_t c = 0; c < n; ++c) {
      pt[c * kTile + r] = p[c];
      dst[c * kTile + r] = dp[c];
    }
  }
  // Key c of this tile is seen by rows r >= c - (i0 - j0) of the query tile (causal).
  for (std::int64_t c = 0; c < nj; ++c) {
    const std::int64_t r0 = causal ? std::max<std::int64_t>(0, j0 + c - i0) : 0;
    if (r0 >= ni) continue;
    axpy_rows<kHs>(dv + (j0 + c) * hs, pt + c * kTile + r0, go + (i0 + r0) * hs, ni - r0, hs);
    axpy_rows<kHs>(dk + (j0 + c) * hs, dst + c * kTile + r0, q + (i0 + r0) * hs, ni - r0, hs);
  }
}

// One query tile [i0, i0 + ni) of query head h of batch b. scratch: 4 * kTile * hs + kTile.
template <int kHs, class T>
void forward_tile(T* LLMPAR_RESTRICT out, acc_t<T>* LLMPAR_RESTRICT lse, const T* LLMPAR_RESTRICT qkv, std::int64_t b,
                  std::int64_t h, std::int64_t i0, const AttentionShape& shape, acc_t<T>* LLMPAR_RESTRICT scratch) {
  using Acc = acc_t<T>;
  const std::int64_t hs = kHs > 0 ? kHs : shape.head_dim;
  const std::int64_t T_len = shape.seq, R = shape.row(), g = shape.kv_head_of(h);
  const Acc scale = Acc(1) / std::sqrt(static_cast<Acc>(hs));
  const std::int64_t ni = std::min(kTile, T_len - i0);
  const T* LLMPAR_RESTRICT rows = qkv + b * T_len * R;  // (T, R) of batch b
  const T* LLMPAR_RESTRICT qh = rows + shape.q_col(h);  // this head's q columns
  const T* LLMPAR_RESTRICT kh = rows + shape.k_col(g);  // its kv head's k columns
  const T* LLMPAR_RESTRICT vh = rows + shape.v_col(g);  // and v columns

  Acc* LLMPAR_RESTRICT q = scratch;          // (ni, hs)
  Acc* LLMPAR_RESTRICT o = q + kTile * hs;   // (ni, hs) unnormalised output
  Acc* LLMPAR_RESTRICT kt = o + kTile * hs;  // (hs, kTile) key tile, transposed
  Acc* LLMPAR_RESTRICT v = kt + kTile * hs;  // (nj, hs)
  Acc* LLMPAR_RESTRICT s = v + kTile * hs;   // (kTile) scores, then weights, of one row
  math::OnlineSoftmax<Acc> state[kTile];     // (ni)

  pack_rows(q, qh + i0 * R, ni, hs, R);
  std::fill(o, o + ni * hs, Acc(0));
  for (std::int64_t j0 = 0; j0 <= i0; j0 += kTile) {
    const std::int64_t nj = std::min(kTile, T_len - j0);
    pack_transposed(kt, kh + j0 * R, nj, hs, R);
    pack_rows(v, vh + j0 * R, nj, hs, R);
    forward_key_tile<kHs>(o, state, q, kt, v, s, ni, nj, hs, scale, true, i0 - j0);  // causal: keys j0 .. i0 + r
  }
  for (std::int64_t r = 0; r < ni; ++r) {
    const Acc inv = Acc(1) / state[r].sum;
    Acc* LLMPAR_RESTRICT orow = o + r * hs;
#pragma omp simd
    for (std::int64_t d = 0; d < hs; ++d) orow[d] *= inv;
    lse[(b * shape.heads + h) * T_len + i0 + r] = state[r].log_sum_exp();
  }
  unpack_rows(out + (b * T_len + i0) * shape.q_dim() + h * hs, o, ni, hs, shape.q_dim());
}

template <int kHs, class T>
void forward(T* out, acc_t<T>* lse, const T* qkv, const AttentionShape& shape) {
  using Acc = acc_t<T>;
  const std::int64_t hs = shape.head_dim, T_len = shape.seq, BH = shape.batch * shape.heads;
  const std::int64_t tiles = ceil_div(T_len, kTile);
  const std::int64_t tasks = BH * tiles;
  const std::int64_t per_thread = 4 * kTile * hs + kTile;
  const bool parallel = tasks > 1 && BH * T_len * T_len / 2 * hs >= kMinParallelWork;
  const int threads = parallel ? omp_get_max_threads() : 1;
  Buffer<Acc> scratch(threads * per_thread);
#pragma omp parallel num_threads(threads) if (parallel)
  {
    Acc* mine = scratch.data() + omp_get_thread_num() * per_thread;
    // Tiles far down the sequence see the most keys: hand them out first.
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < tasks; ++task) {
      const std::int64_t tile = tiles - 1 - task / BH;
      const std::int64_t bh = task % BH;
      forward_tile<kHs>(out, lse, qkv, bh / shape.heads, bh % shape.heads, tile * kTile, shape, mine);
    }
  }
}

// One kv head g of batch b, and the group() query heads that read it (h = g, g + KVH,
// ...), in that order. scratch: backward_scratch(T, hs).
template <int kHs, class T>
void backward_kv_head(T* LLMPAR_RESTRICT dqkv, const T* LLMPAR_RESTRICT dout, const T* LLMPAR_RESTRICT qkv,
                      const T* LLMPAR_RESTRICT out, const acc_t<T>* LLMPAR_RESTRICT lse, std::int64_t b, std::int64_t g,
                      const AttentionShape& shape, acc_t<T>* LLMPAR_RESTRICT scratch) {
  using Acc = acc_t<T>;
  const std::int64_t hs = kHs > 0 ? kHs : shape.head_dim;
  const std::int64_t T_len = shape.seq, R = shape.row(), Q = shape.q_dim();
  const Acc scale = Acc(1) / std::sqrt(static_cast<Acc>(hs));
  const T* LLMPAR_RESTRICT rows = qkv + b * T_len * R;  // (T, R) of batch b
  T* LLMPAR_RESTRICT drows = dqkv + b * T_len * R;      // (T, R)
  const T* LLMPAR_RESTRICT kh = rows + shape.k_col(g);  // (T, hs) at stride R
  const T* LLMPAR_RESTRICT vh = rows + shape.v_col(g);

  Acc* LLMPAR_RESTRICT q = scratch;               // (T, hs) of the query head in hand
  Acc* LLMPAR_RESTRICT k = q + T_len * hs;        // (T, hs)
  Acc* LLMPAR_RESTRICT go = k + T_len * hs;       // (T, hs) dout of the query head
  Acc* LLMPAR_RESTRICT dq = go + T_len * hs;      // (T, hs)
  Acc* LLMPAR_RESTRICT dk = dq + T_len * hs;      // (T, hs) summed over the group
  Acc* LLMPAR_RESTRICT dv = dk + T_len * hs;      // (T, hs) summed over the group
  Acc* LLMPAR_RESTRICT D = dv + T_len * hs;       // (T) dout_t . out_t
  Acc* LLMPAR_RESTRICT o = D + T_len;             // (hs) one row of out
  Acc* LLMPAR_RESTRICT kt = o + hs;               // (hs, kTile) key tile, transposed
  Acc* LLMPAR_RESTRICT vt = kt + hs * kTile;      // (hs, kTile) value tile, transposed
  Acc* LLMPAR_RESTRICT pt = vt + hs * kTile;      // (kTile keys, kTile rows) p^T
  Acc* LLMPAR_RESTRICT dst = pt + kTile * kTile;  // (kTile keys, kTile rows) (ds * scale)^T
  Acc* LLMPAR_RESTRICT p = dst + kTile * kTile;   // (kTile) p of one row
  Acc* LLMPAR_RESTRICT dp = p + kTile;            // (kTile) dp, then ds * scale, of one row

  pack_rows(k, kh, T_len, hs, R);
  std::fill(dk, dk + 2 * T_len * hs, Acc(0));  // dk, dv
  for (std::int64_t h = g; h < shape.heads; h += shape.kv_heads) {
    const std::int64_t row0 = b * T_len * Q + h * hs;                           // head offset in (B, T, Q)
    const Acc* LLMPAR_RESTRICT lse_head = lse + (b * shape.heads + h) * T_len;  // (T)
    pack_rows(q, rows + shape.q_col(h), T_len, hs, R);
    pack_rows(go, dout + row0, T_len, hs, Q);
    for (std::int64_t t = 0; t < T_len; ++t) {
      pack_rows(o, out + row0 + t * Q, 1, hs, Q);
      const Acc* LLMPAR_RESTRICT gt = go + t * hs;
      Acc sum = 0;
#pragma omp simd reduction(+ : sum)
      for (std::int64_t d = 0; d < hs; ++d) sum += gt[d] * o[d];
      D[t] = sum;
    }
    std::fill(dq, dq + T_len * hs, Acc(0));

    for (std::int64_t j0 = 0; j0 < T_len; j0 += kTile) {
      const std::int64_t nj = std::min(kTile, T_len - j0);
      pack_transposed(kt, kh + j0 * R, nj, hs, R);
      pack_transposed(vt, vh + j0 * R, nj, hs, R);
      for (std::int64_t i0 = j0; i0 < T_len; i0 += kTile)
        backward_tile_pair<kHs>(dq, dk, dv, q, go, k, kt, vt, lse_head, D, p, dp, pt, dst, i0,
                                std::min(kTile, T_len - i0), j0, nj, hs, scale, true);
    }
    unpack_rows(drows + shape.q_col(h), dq, T_len, hs, R);
  }
  unpack_rows(drows + shape.k_col(g), dk, T_len, hs, R);
  unpack_rows(drows + shape.v_col(g), dv, T_len, hs, R);
}

inline std::int64_t backward_scratch(std::int64_t T_len, std::int64_t hs) {
  return 6 * T_len * hs + T_len + hs + 2 * hs * kTile + 2 * kTile * kTile + 2 * kTile;
}

template <int kHs, class T>
void backward(T* dqkv, const T* dout, const T* qkv, const T* out, const acc_t<T>* lse, const AttentionShape& shape) {
  using Acc = acc_t<T>;
  const std::int64_t hs = shape.head_dim, T_len = shape.seq;
  const std::int64_t tasks = shape.batch * shape.kv_heads;
  const std::int64_t per_thread = backward_scratch(T_len, hs);
  const bool parallel = tasks > 1 && shape.batch * shape.heads * T_len * T_len / 2 * hs >= kMinParallelWork;
  const int threads = parallel ? static_cast<int>(std::min<std::int64_t>(omp_get_max_threads(), tasks)) : 1;
  Buffer<Acc> scratch(threads * per_thread);
#pragma omp parallel num_threads(threads) if (parallel)
  {
    Acc* mine = scratch.data() + omp_get_thread_num() * per_thread;
#pragma omp for schedule(static)
    for (std::int64_t task = 0; task < tasks; ++task) {
      backward_kv_head<kHs>(dqkv, dout, qkv, out, lse, task / shape.kv_heads, task % shape.kv_heads, shape, mine);
    }
  }
}

// Calls f(std::integral_constant<int, kHs>{}) with the head size compiled for hs, or 0
// (the head size at run time).
template <class F>
void with_head_size(std::int64_t hs, F&& f) {
  switch (hs) {
    case 32:
      f(std::integral_constant<int, 32>{});
      break;
    case 64:
      f(std::integral_constant<int, 64>{});
      break;
    case 128:
      f(std::integral_constant<int, 128>{});
      break;
    default:
      f(std::integral_constant<int, 0>{});
      break;
  }
}

}  // namespace detail::attn

// out: (B, T, NH·hs); lse: (B, NH, T) log-sum-exp of each row's scaled scores;
// qkv: (B, T, (NH + 2 KVH)·hs) (core/attention_shape.hpp). Scores are scaled by
// 1/sqrt(hs).
template <class T>
void attention_forward(T* out, acc_t<T>* lse, const T* qkv, const AttentionShape& shape) {
  shape.check("attention_forward");
  if (shape.batch == 0 || shape.seq == 0) return;
  detail::attn::with_head_size(shape.head_dim,
                               [&](auto hs) { detail::attn::forward<decltype(hs)::value>(out, lse, qkv, shape); });
}

// Overwrites dqkv: (B, T, (NH + 2 KVH)·hs). dout, out: (B, T, NH·hs); qkv as forward's;
// lse: (B, NH, T) as saved by attention_forward on the same qkv.
template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const acc_t<T>* lse,
                        const AttentionShape& shape) {
  shape.check("attention_backward");
  if (shape.batch == 0 || shape.seq == 0) return;
  detail::attn::with_head_size(
      shape.head_dim, [&](auto hs) { detail::attn::backward<decltype(hs)::value>(dqkv, dout, qkv, out, lse, shape); });
}

}  // namespace llmpar::backend::cpu
