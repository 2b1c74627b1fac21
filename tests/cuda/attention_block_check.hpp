// tests/cuda/attention_block_check.hpp — what "the CUDA attention blocks are right"
// means (kernels/attention_block.cuh, backend::Cuda's ring-attention operations),
// written once for the two programs that check it: test_cuda_attention_block on a GPU
// and test_cuda_emulation_attention_block on the CPU (tests/cuda_emulation).
//
// Two kinds of case, each returning its worst ratios of error to tolerance:
//   - one block (BlockCase) against the CPU block kernels (backend/cpu/attention_block.hpp)
//     on the same stored inputs: the block's forward from a random state of every row
//     (o, m, l; rows outside the block must keep theirs), finish, dsum, and the block's
//     backward into random dq and dkv (the kernels add). Each operation is fed the CPU's
//     results of the ones before it, so each is checked on its own. The keys come from
//     qkv itself, from a packed (B, kv_seq, 2 KV) copy, or from a wider buffer with v
//     before k (kv_stride 2 KV + 8, k at KV + 8, v at 0): every AttentionBlock field moves.
//   - a ring (ring_case): a whole causal sequence cut into 2 cp chunks as
//     nn/context_parallel.hpp cuts it (rank r holds chunks r and 2 cp - 1 - r), every rank's
//     blocks run as ContextParallelCore runs them (the same for_each_block order), the
//     results put back in sequence order and compared with the whole-sequence CPU kernels
//     (backend/cpu/attention.hpp). The backward is fed the CPU forward's out and lse; each
//     key block's dk, dv are summed over the ranks in its owner's buffer.
// Tolerances, |got - ref| <= ulps ulp_T(ref) + rel max|ref| per tensor: kRel = 1e-5 for
// every float result (the state, lse, dsum, dq, dkv: computed in float from the same stored
// inputs on both sides, so they differ by float rounding in a different order only) and
// for T results (out, the ring's dqkv) 2 ulps of T on top where T is 16-bit (both sides
// round float values that differ in their last bits).
//
// The Device policy runs the operations and moves data (Dev below): the emulation's calls
// the kernels on host memory, the GPU test's calls backend::Cuda on device memory.
//   template <class E> E* put(const std::vector<E>&);       a device copy, alive as long as Dev
//   template <class E> std::vector<E> get(const E*, std::size_t n);
//   state_init(st, shape), block_forward(st, qkv, kv, shape, blk), state_finish(out, lse,
//   st, shape), dsum(dsum, dout, out, shape), block_backward(dq, dkv, dout, qkv, kv, lse,
//   dsum, shape, blk): the five operations, with backend::Cuda's arguments less the context.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_check.hpp"
#include "llmpar/backend/cpu/attention.hpp"
#include "llmpar/backend/cpu/attention_block.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"

namespace llmpar::attention_block_check {

namespace check = attention_check;

inline constexpr double kRel = 1e-5;

// Where a block's keys and values are read from.
enum class KvSource {
  qkv,     // qkv itself: kv_seq = S, kv_stride R, k at q_dim, v at q_dim + kv_dim
  packed,  // a (B, kv_seq, 2 KV) copy: k at 0, v at KV (what the ring passes)
  wide,    // a (B, kv_seq, 2 KV + 8) buffer, v at 0, k at KV + 8
};

inline const char* name_of(KvSource k) {
  return k == KvSource::qkv ? "qkv" : k == KvSource::packed ? "packed" : "wide";
}

struct BlockCase {
  AttentionShape shape;  // S = shape.seq query rows per sequence
  std::int64_t q_first, kv_seq, kv_first, len;
  bool causal;
  KvSource source;  // kv_seq must be S for KvSource::qkv
};

// The worst ratio of each output (<= 1 passes), by name.
struct Ratios {
  std::vector<std::pair<std::string, double>> items;
  void add(std::string name, double r) { items.emplace_back(std::move(name), r); }
  double worst() const {
    double w = 0;
    for (const auto& item : items) {
      if (std::isnan(item.second)) return INFINITY;
      w = std::fmax(w, item.second);
    }
    return w;
  }
  bool pass() const { return worst() <= 1.0; }
  std::string describe() const {
    std::string s;
    char buf[64];
    for (const auto& [n, r] : items) {
      std::snprintf(buf, sizeof buf, "%s%s %.3f", s.empty() ? "" : " ", n.c_str(), r);
      s += buf;
    }
    return s;
  }
};

template <class T>
const char* type_name() {
  return std::is_same_v<T, float> ? "f32" : std::is_same_v<T, bf16> ? "bf16" : "f16";
}

inline std::string shape_name(const AttentionShape& s) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "hs=%lld B=%lld S=%lld NH=%lld KVH=%lld", static_cast<long long>(s.head_dim),
                static_cast<long long>(s.batch), static_cast<long long>(s.seq), static_cast<long long>(s.heads),
                static_cast<long long>(s.kv_heads));
  return buf;
}

// Random floats: element i of the named stream, standard normal; |.| + offset if `positive`.
inline std::vector<float> random_floats(const char* name, std::size_t n, std::uint64_t seed, bool positive = false) {
  const rng::Stream stream = rng::Stream::named(seed, name);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto x = static_cast<float>(stream.normal(i));
    v[i] = positive ? 0.5f + std::fabs(x) : x;
  }
  return v;
}

template <class A>
double ratio_float(const std::vector<float>& got, const std::vector<A>& ref) {
  std::vector<double> r(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) r[i] = static_cast<double>(ref[i]);
  return check::worst_ratio<float, double>(got, r, 0.0, kRel);
}

template <class T>
double ratio_stored(const std::vector<T>& got, const std::vector<T>& ref) {
  return check::worst_ratio<T, double>(got, check::as_double(ref), check::storage_ulps<T>(), kRel);
}

// The state's running max where -inf is allowed: equal infinities count as exact.
inline double ratio_max(const std::vector<float>& got, const std::vector<float>& ref) {
  std::vector<float> g = got, r = ref;
  for (std::size_t i = 0; i < r.size(); ++i)
    if (std::isinf(r[i]) && g[i] == r[i]) g[i] = r[i] = 0.0f;
  return ratio_float(g, r);
}

template <class T, class Dev>
Ratios block_case(Dev& dev, const BlockCase& c) {
  namespace cpu = backend::cpu;
  const AttentionShape& s = c.shape;
  const std::int64_t B = s.batch, S = s.seq, Q = s.q_dim(), KV = s.kv_dim(), R = s.row();
  const std::uint64_t seed = 7919 * s.head_dim + 101 * S + 13 * c.q_first + c.kv_first + (c.causal ? 5 : 0);
  AttentionBlock blk{
      .q_first = c.q_first, .kv_seq = c.kv_seq, .kv_first = c.kv_first, .len = c.len, .causal = c.causal};
  if (c.source == KvSource::qkv) {
    LLMPAR_CHECK(c.kv_seq == S, "attention_block_check: keys from qkv need kv_seq = S");
    blk.kv_stride = R, blk.k_offset = Q, blk.v_offset = Q + KV;
  } else if (c.source == KvSource::packed) {
    blk.kv_stride = 2 * KV, blk.k_offset = 0, blk.v_offset = KV;
  } else {
    blk.kv_stride = 2 * KV + 8, blk.k_offset = KV + 8, blk.v_offset = 0;
  }
  const std::vector<T> qkv = check::random_tensor<T>("qkv", B * S * R, seed);
  const std::vector<T> kv_own =
      c.source == KvSource::qkv ? std::vector<T>{} : check::random_tensor<T>("kv", B * c.kv_seq * blk.kv_stride, seed);
  const std::vector<T>& kv = c.source == KvSource::qkv ? qkv : kv_own;
  const std::vector<T> dout = check::random_tensor<T>("dout", B * S * Q, seed);
  std::vector<float> o = random_floats("o", B * S * Q, seed), m = random_floats("m", B * s.heads * S, seed);
  std::vector<float> l = random_floats("l", B * s.heads * S, seed, true);
  const std::vector<float> dq0 = random_floats("dq", B * S * Q, seed);
  const std::vector<float> dkv0 = random_floats("dkv", B * c.kv_seq * 2 * KV, seed);

  // The CPU: forward, finish, dsum, backward.
  std::vector<float> ro = o, rm = m, rl = l;
  cpu::attention_block_forward<T>({ro.data(), rm.data(), rl.data()}, qkv.data(), kv.data(), s, blk);
  std::vector<T> rout(B * S * Q);
  std::vector<float> rlse(B * s.heads * S), rdsum(B * s.heads * S);
  cpu::attention_state_finish<T>(rout.data(), rlse.data(), {ro.data(), rm.data(), rl.data()}, s);
  cpu::attention_dsum<T>(rdsum.data(), dout.data(), rout.data(), s);
  std::vector<float> rdq = dq0, rdkv = dkv0;
  cpu::attention_block_backward<T>(rdq.data(), rdkv.data(), dout.data(), qkv.data(), kv.data(), rlse.data(),
                                   rdsum.data(), s, blk);

  // The device, each operation on the CPU's inputs.
  T* d_qkv = dev.put(qkv);
  const T* d_kv = c.source == KvSource::qkv ? d_qkv : dev.put(kv_own);
  const AttentionState<float> st{dev.put(o), dev.put(m), dev.put(l)};
  dev.block_forward(st, d_qkv, d_kv, s, blk);
  const AttentionState<float> rst{dev.put(ro), dev.put(rm), dev.put(rl)};
  T* d_out = dev.put(std::vector<T>(B * S * Q));
  float* d_lse = dev.put(std::vector<float>(B * s.heads * S));
  dev.state_finish(d_out, d_lse, rst, s);
  float* d_dsum = dev.put(std::vector<float>(B * s.heads * S));
  dev.dsum(d_dsum, dev.put(dout), dev.put(rout), s);
  float* d_dq = dev.put(dq0);
  float* d_dkv = dev.put(dkv0);
  dev.block_backward(d_dq, d_dkv, dev.put(dout), d_qkv, d_kv, dev.put(rlse), dev.put(rdsum), s, blk);

  Ratios r;
  r.add("o", ratio_float(dev.get(st.o, o.size()), ro));
  r.add("m", ratio_max(dev.get(st.m, m.size()), rm));
  r.add("l", ratio_float(dev.get(st.l, l.size()), rl));
  r.add("out", ratio_stored(dev.get(d_out, rout.size()), rout));
  r.add("lse", ratio_float(dev.get(d_lse, rlse.size()), rlse));
  r.add("dsum", ratio_float(dev.get(d_dsum, rdsum.size()), rdsum));
  r.add("dq", ratio_float(dev.get(d_dq, rdq.size()), rdq));
  r.add("dkv", ratio_float(dev.get(d_dkv, rdkv.size()), rdkv));
  return r;
}

template <class T>
std::string block_case_name(const BlockCase& c) {
  char buf[192];
  std::snprintf(buf, sizeof buf, "block %-4s %s rows %lld+%lld keys %lld of %lld %s %s", type_name<T>(),
                shape_name(c.shape).c_str(), static_cast<long long>(c.q_first), static_cast<long long>(c.len),
                static_cast<long long>(c.kv_first), static_cast<long long>(c.kv_seq), c.causal ? "causal" : "full",
                name_of(c.source));
  return buf;
}

// The rows of sequence position t of chunk `chunk` (c rows each) in a rank's local rows.
struct Ring {
  int cp;
  std::int64_t c;  // rows per chunk
  int chunk_of(int rank, int half) const { return half == 0 ? rank : 2 * cp - 1 - rank; }
  // ContextParallelCore::for_each_block: rank `rank`'s blocks against rank `src`'s keys.
  template <class F>
  void for_each_block(int rank, int src, const AttentionShape& local, F&& f) const {
    const std::int64_t KV = local.kv_dim();
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b) {
        const int qa = chunk_of(rank, a), kb = chunk_of(src, b);
        if (kb > qa) continue;
        f(AttentionBlock{.q_first = a * c,
                         .kv_seq = local.seq,
                         .kv_first = b * c,
                         .len = c,
                         .kv_stride = 2 * KV,
                         .k_offset = 0,
                         .v_offset = KV,
                         .causal = kb == qa});
      }
  }
  // Whole-sequence row of local row t of `rank`.
  std::int64_t position(int rank, std::int64_t t) const { return chunk_of(rank, t < c ? 0 : 1) * c + t % c; }
};

// Gathers (B, 2c, width) local rows of `rank` from (B, T, width) whole rows, or scatters back.
template <class E>
void gather_rows(std::vector<E>& local, const std::vector<E>& whole, const Ring& ring, int rank, std::int64_t B,
                 std::int64_t T, std::int64_t width, std::int64_t col = 0, std::int64_t whole_width = -1) {
  const std::int64_t W = whole_width < 0 ? width : whole_width, rows = 2 * ring.c;
  local.resize(B * rows * width);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < rows; ++t)
      for (std::int64_t d = 0; d < width; ++d)
        local[(b * rows + t) * width + d] = whole[(b * T + ring.position(rank, t)) * W + col + d];
}
template <class E>
void scatter_rows(std::vector<E>& whole, const std::vector<E>& local, const Ring& ring, int rank, std::int64_t B,
                  std::int64_t T, std::int64_t width, std::int64_t col = 0, std::int64_t whole_width = -1) {
  const std::int64_t W = whole_width < 0 ? width : whole_width, rows = 2 * ring.c;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < rows; ++t)
      for (std::int64_t d = 0; d < width; ++d)
        whole[(b * T + ring.position(rank, t)) * W + col + d] = local[(b * rows + t) * width + d];
}
// The same for (B, NH, T) per-row values (lse), whole <-> (B, NH, 2c) local.
template <class E>
void gather_heads(std::vector<E>& local, const std::vector<E>& whole, const Ring& ring, int rank,
                  const AttentionShape& whole_shape) {
  const std::int64_t BH = whole_shape.batch * whole_shape.heads, T = whole_shape.seq, rows = 2 * ring.c;
  local.resize(BH * rows);
  for (std::int64_t bh = 0; bh < BH; ++bh)
    for (std::int64_t t = 0; t < rows; ++t) local[bh * rows + t] = whole[bh * T + ring.position(rank, t)];
}
template <class E>
void scatter_heads(std::vector<E>& whole, const std::vector<E>& local, const Ring& ring, int rank,
                   const AttentionShape& whole_shape) {
  const std::int64_t BH = whole_shape.batch * whole_shape.heads, T = whole_shape.seq, rows = 2 * ring.c;
  for (std::int64_t bh = 0; bh < BH; ++bh)
    for (std::int64_t t = 0; t < rows; ++t) whole[bh * T + ring.position(rank, t)] = local[bh * rows + t];
}

// A causal whole sequence (shape.seq = T, a multiple of 2 cp) over a ring of cp ranks,
// against the whole-sequence CPU kernels.
template <class T, class Dev>
Ratios ring_case(Dev& dev, const AttentionShape& whole, int cp) {
  namespace cpu = backend::cpu;
  LLMPAR_CHECK(whole.seq % (2 * cp) == 0, "attention_block_check: T = ", whole.seq, " is not a multiple of 2 cp");
  const Ring ring{cp, whole.seq / (2 * cp)};
  const std::int64_t B = whole.batch, Tn = whole.seq, Q = whole.q_dim(), KV = whole.kv_dim(), R = whole.row();
  const AttentionShape local{B, 2 * ring.c, whole.heads, whole.kv_heads, whole.head_dim};
  const std::int64_t rows = B * local.seq, states = B * whole.heads * local.seq;
  const std::uint64_t seed = 31 * whole.head_dim + 7 * Tn + cp;
  const std::vector<T> qkv = check::random_tensor<T>("qkv", B * Tn * R, seed);
  const std::vector<T> dout = check::random_tensor<T>("dout", B * Tn * Q, seed);
  std::vector<T> ref_out(B * Tn * Q), ref_dqkv(B * Tn * R);
  std::vector<float> ref_lse(B * whole.heads * Tn);
  cpu::attention_forward<T>(ref_out.data(), ref_lse.data(), qkv.data(), whole);
  cpu::attention_backward<T>(ref_dqkv.data(), dout.data(), qkv.data(), ref_out.data(), ref_lse.data(), whole);

  // Each rank's rows and its packed keys and values.
  std::vector<T*> d_qkv(cp), d_kv(cp), d_dout(cp), d_ref_out(cp);
  std::vector<float*> d_ref_lse(cp), d_dkv(cp);
  for (int r = 0; r < cp; ++r) {
    std::vector<T> mine, kv;
    gather_rows(mine, qkv, ring, r, B, Tn, R);
    d_qkv[r] = dev.put(mine);
    gather_rows(kv, qkv, ring, r, B, Tn, 2 * KV, Q, R);
    d_kv[r] = dev.put(kv);
    gather_rows(mine, dout, ring, r, B, Tn, Q);
    d_dout[r] = dev.put(mine);
    gather_rows(mine, ref_out, ring, r, B, Tn, Q);
    d_ref_out[r] = dev.put(mine);
    std::vector<float> lse;
    gather_heads(lse, ref_lse, ring, r, whole);
    d_ref_lse[r] = dev.put(lse);
    d_dkv[r] = dev.put(std::vector<float>(rows * 2 * KV, 0.0f));
  }

  // Forward: every rank's steps, src = (r - step) mod cp, as ring_forward.
  std::vector<T> out(B * Tn * Q);
  std::vector<float> lse(B * whole.heads * Tn);
  for (int r = 0; r < cp; ++r) {
    const AttentionState<float> st{dev.put(std::vector<float>(rows * Q, NAN)), dev.put(std::vector<float>(states, NAN)),
                                   dev.put(std::vector<float>(states, NAN))};
    dev.state_init(st, local);
    for (int step = 0; step < cp; ++step) {
      const int src = (r - step + cp) % cp;
      ring.for_each_block(r, src, local,
                          [&](const AttentionBlock& blk) { dev.block_forward(st, d_qkv[r], d_kv[src], local, blk); });
    }
    T* d_out = dev.put(std::vector<T>(rows * Q));
    float* d_lse = dev.put(std::vector<float>(states));
    dev.state_finish(d_out, d_lse, st, local);
    scatter_rows(out, dev.get(d_out, rows * Q), ring, r, B, Tn, Q);
    scatter_heads(lse, dev.get(d_lse, states), ring, r, whole);
  }

  // Backward on the CPU's out and lse: dq stays with its rank, each key block's dk, dv
  // summed in its owner's buffer.
  std::vector<T> dqkv(B * Tn * R);
  for (int r = 0; r < cp; ++r) {
    float* d_dsum = dev.put(std::vector<float>(states));
    dev.dsum(d_dsum, d_dout[r], d_ref_out[r], local);
    float* d_dq = dev.put(std::vector<float>(rows * Q, 0.0f));
    for (int step = 0; step < cp; ++step) {
      const int src = (r - step + cp) % cp;
      ring.for_each_block(r, src, local, [&](const AttentionBlock& blk) {
        dev.block_backward(d_dq, d_dkv[src], d_dout[r], d_qkv[r], d_kv[src], d_ref_lse[r], d_dsum, local, blk);
      });
    }
    std::vector<T> dq(rows * Q);
    const std::vector<float> dq_f = dev.get(d_dq, rows * Q);
    for (std::size_t i = 0; i < dq.size(); ++i) dq[i] = convert<T>(dq_f[i]);
    scatter_rows(dqkv, dq, ring, r, B, Tn, Q, 0, R);
  }
  for (int r = 0; r < cp; ++r) {
    const std::vector<float> dkv_f = dev.get(d_dkv[r], rows * 2 * KV);
    std::vector<T> dkv(dkv_f.size());
    for (std::size_t i = 0; i < dkv.size(); ++i) dkv[i] = convert<T>(dkv_f[i]);
    scatter_rows(dqkv, dkv, ring, r, B, Tn, 2 * KV, Q, R);
  }

  Ratios res;
  res.add("out", ratio_stored(out, ref_out));
  res.add("lse", ratio_float(lse, ref_lse));
  res.add("dqkv", ratio_stored(dqkv, ref_dqkv));
  return res;
}

template <class T>
std::string ring_case_name(const AttentionShape& whole, int cp) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "ring  %-4s %s cp=%d (%d chunks of %lld) causal", type_name<T>(),
                shape_name(whole).c_str(), cp, 2 * cp, static_cast<long long>(whole.seq / (2 * cp)));
  return buf;
}

// The cases both programs run: grouped-query 4 on 2 and 4 on 1, multi-head; head sizes
// 32 and 64 (and 80, padded to the kernels' 128); causal diagonal blocks and unmasked
// blocks off the diagonal; several query and key tiles; keys from qkv, packed, wide.
inline std::vector<BlockCase> block_cases() {
  return {
      {{2, 48, 4, 2, 64}, 8, 40, 5, 33, false, KvSource::packed},   // GQA, off the diagonal
      {{1, 70, 4, 2, 64}, 3, 70, 3, 67, true, KvSource::qkv},       // GQA, diagonal: 2 query, 3 key tiles
      {{2, 40, 2, 2, 32}, 0, 50, 10, 40, false, KvSource::wide},    // MHA, v before k
      {{1, 45, 2, 2, 32}, 20, 45, 20, 25, true, KvSource::packed},  // MHA, diagonal of a packed copy
      {{1, 37, 4, 1, 32}, 4, 60, 21, 33, true, KvSource::wide},     // multi-query, causal off qkv
      {{1, 24, 4, 2, 80}, 2, 30, 7, 20, false, KvSource::packed},   // a padded head size
  };
}

struct RingCase {
  AttentionShape whole;
  int cp;
};
inline std::vector<RingCase> ring_cases() {
  return {
      {{1, 48, 4, 2, 64}, 1},  // 2 chunks
      {{1, 76, 4, 2, 64}, 2},  // 4 chunks of 19
      {{2, 72, 2, 2, 32}, 4},  // 8 chunks of 9
      {{1, 40, 4, 1, 32}, 2},  // multi-query, 4 chunks of 10
  };
}

}  // namespace llmpar::attention_block_check
