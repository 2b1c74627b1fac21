// llmpar/nn/context_parallel.hpp — context parallelism: every sequence split over the cp
// ranks of a group, in load-balanced causal chunks, and the attention core across them.
//
// A sequence of T tokens is cut into 2·cp chunks of T / (2 cp); rank r holds chunks r
// and 2·cp − 1 − r, one from each end (Megatron-Core's and torchtitan's layout). Under
// a causal mask a query chunk attends to the chunks at or before it, so chunk i costs
// i + 1 blocks and every rank's pair costs 2·cp + 1: the work is even. Each rank keeps
// T / cp rows of every activation; only attention needs the other ranks' rows, and it
// gets them one of two ways (CpComm, train_gpt's --cp-comm):
//   - ring (Liu et al. 2023; Megatron-Core's p2p, torchtitan's): cp − 1 steps, each
//     passing the K/V block in hand to the next rank while attending to it, and in
//     backward the dK/dV of each block travelling with it back to its owner. Any head
//     count; the traffic is K/V only, hidden behind the blocks' compute.
//   - all-to-all (DeepSpeed-Ulysses, Jacobs et al. 2023; Megatron-Core's a2a): one
//     all-to-all turns this rank's rows of every head into every row of 1/cp of the
//     heads, the whole-sequence kernel runs on those, and one more turns its output
//     back. cp divides the kv heads (of a tp rank); two exchanges forward (qkv, the
//     output) and three backward (the output, its gradient, qkv's), not hidden, but the
//     whole-sequence kernel on whole heads (no block kernels, no per-step latency).
// detail::ContextParallelCore is both, on any backend with their kernels.
//
// The tokens and targets arrive whole (every cp rank of a data-parallel replica reads
// the same sequences) and each rank takes its chunks (take_chunks); positions follow
// the chunks (position_of: the rotary angles, a learned position table's rows). Each
// rank's loss is the mean over its T / cp tokens, so the mean of the cp ranks' losses
// and gradients (the data-parallel strategy reduces over dp × cp) is the serial run's.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "llmpar/comm/communicator.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/nn/scratch.hpp"

namespace llmpar::nn {

// How attention reaches the other cp ranks' rows (above).
enum class CpComm { ring, all_to_all };

// train_gpt's names: "ring" and "a2a" (Megatron-Core's --cp-comm-type a2a).
inline std::string_view cp_comm_name(CpComm c) { return c == CpComm::ring ? "ring" : "a2a"; }
inline CpComm parse_cp_comm(std::string_view name) {
  LLMPAR_CHECK(name == "ring" || name == "a2a", "--cp-comm ", name,
               " is not a context-parallel exchange; use ring (K/V blocks passed round the cp ranks) or a2a "
               "(all-to-all over the heads)");
  return name == "ring" ? CpComm::ring : CpComm::all_to_all;
}

// Fails naming the heads when the all-to-all over `cp` ranks cannot give each a share
// of the `kv_heads` a tp rank holds (kv heads / tp), with the query heads that read
// them.
inline void check_cp_heads(CpComm how, int cp, std::int64_t kv_heads, int tp) {
  LLMPAR_CHECK(how != CpComm::all_to_all || kv_heads % cp == 0, "--cp-comm a2a splits the heads over the cp ranks, ",
               "but --cp ", cp, " does not divide the ", kv_heads, " kv heads",
               tp > 1 ? " of a tp rank (kv heads / --tp)" : "", "; use --cp-comm ring, or a --cp that divides them");
}

class ContextParallelGroup {
 public:
  ContextParallelGroup() = default;
  explicit ContextParallelGroup(comm::Comm* group, CpComm how = CpComm::ring)
      : group_(group && group->size() > 1 ? group : nullptr), how_(how) {}

  bool split() const { return group_ != nullptr; }
  int size() const { return group_ ? group_->size() : 1; }
  int rank() const { return group_ ? group_->rank() : 0; }
  comm::Comm* communicator() const { return group_; }
  CpComm how() const { return how_; }

  // Fails naming the sequence length when it cannot be cut into 2·cp chunks.
  void check_sequence(std::int64_t seq) const {
    LLMPAR_CHECK(!split() || seq % (2 * size()) == 0, "sequence length ", seq, " is not divisible by 2 x --cp ", size(),
                 " = ", 2 * size(),
                 " (context parallelism cuts each sequence into 2 x cp chunks); use a --seq that is a multiple of ",
                 2 * size());
  }
  // Fails naming the heads when the all-to-all cannot give every cp rank a share of
  // this rank's kv heads (check_cp_heads).
  void check_heads(std::int64_t kv_heads, int tp) const {
    if (split()) check_cp_heads(how_, size(), kv_heads, tp);
  }
  // Rows per sequence this rank holds: seq / cp.
  std::int64_t local(std::int64_t seq) const { return seq / size(); }
  // The global chunk index of this rank's first (half 0) or second (half 1) chunk.
  int chunk_of(int half) const { return half == 0 ? rank() : 2 * size() - 1 - rank(); }
  int chunk_of(int cp_rank, int half) const { return half == 0 ? cp_rank : 2 * size() - 1 - cp_rank; }
  // The positions of this rank's rows of a sequence of `seq` tokens.
  ChunkPositions positions(std::int64_t seq) const {
    if (!split()) return {};
    const std::int64_t c = seq / (2 * size());
    return {c, chunk_of(0) * c, chunk_of(1) * c};
  }
  // local (batch, seq / cp) = this rank's chunks of every sequence of full (batch, seq).
  template <class T>
  void take_chunks(T* local, const T* full, std::int64_t batch, std::int64_t seq) const {
    check_sequence(seq);
    const std::int64_t c = seq / (2 * size()), rows = seq / size();
    for (std::int64_t b = 0; b < batch; ++b)
      for (int half = 0; half < 2; ++half)
        for (std::int64_t t = 0; t < c; ++t) local[b * rows + half * c + t] = full[b * seq + chunk_of(half) * c + t];
  }

 private:
  comm::Comm* group_ = nullptr;
  CpComm how_ = CpComm::ring;
};

namespace detail {

// The attention core of one rank under context parallelism: this rank's queries against
// the keys of whole sequences. A layer (nn::SelfAttention) calls
//   prepare(qkv)                  once the projection and positions wrote its rows;
//   forward(out, lse, qkv)        the core (again under selective recomputation);
//   backward(dqkv, dout, qkv, out, lse)
// where qkv is what prepare left (the ring: this rank's rows, untouched; the
// all-to-all: every row of its 1/cp of the heads, in place: what the layer keeps), out
// and dout this rank's rows of (B·S, Cl), dqkv its rows of (B·S, Rl), and lse opaque
// (B·NH/tp·S values, in either's own order). `local` is this rank's heads and rows.
template <class T, class Backend>
class ContextParallelCore {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Scratch = BlockScratch<T, typename Backend::Space>;

  // What each needs of the backend; the communicators carry float, bf16 and f16.
  static constexpr bool kRing =
      !std::is_same_v<T, double> && requires(Context & c, const AttentionState<Acc>& st, const T* p, T* q, Acc* a) {
    Backend::attention_block_forward(c, st, p, p, AttentionShape{}, AttentionBlock{});
    Backend::attention_block_backward(c, a, a, p, p, p, a, a, AttentionShape{}, AttentionBlock{});
    Backend::copy_2d(c, q, 0, p, 0, 0, 0);
  };
  static constexpr bool kAllToAll = !std::is_same_v<T, double> && requires(Context & c, const T* p, T* q) {
    Backend::copy_2d(c, q, 0, p, 0, 0, 0);
  };
  static constexpr bool supports(CpComm how) { return how == CpComm::ring ? kRing : kAllToAll; }

  static void prepare(Context& ctx, const ContextParallelGroup& cp, T* qkv, const AttentionShape& local, Scratch& s) {
    if (cp.how() == CpComm::all_to_all) to_heads(ctx, cp, qkv, qkv, local, groups_qkv(local), s.cp);
  }

  static void forward(Context& ctx, const ContextParallelGroup& cp, T* out, Acc* lse, const T* qkv,
                      const AttentionShape& local, Scratch& s) {
    if (cp.how() == CpComm::ring)
      ring_forward(ctx, cp, out, lse, qkv, local, s.cp);
    else
      all_to_all_forward(ctx, cp, out, lse, qkv, local, s.cp);
  }

  static void backward(Context& ctx, const ContextParallelGroup& cp, T* dqkv, const T* dout, const T* qkv, const T* out,
                       const Acc* lse, const AttentionShape& local, Scratch& s) {
    if (cp.how() == CpComm::ring)
      ring_backward(ctx, cp, dqkv, dout, qkv, out, lse, local, s.cp);
    else
      all_to_all_backward(ctx, cp, dqkv, dout, qkv, out, lse, local, s.cp);
  }

 private:
  using Buffers = ContextParallelScratch<T, typename Backend::Space, Acc>;

  // ---- Ring attention.

  // The blocks of ring step `step` (the K/V of cp rank (r - step) mod cp): each of this
  // rank's two query chunks against each of that rank's two key chunks at or before it.
  template <class F>
  static void for_each_block(const ContextParallelGroup& cp, int step, const AttentionShape& local, F&& f) {
    const int src = (cp.rank() - step + cp.size()) % cp.size();
    const std::int64_t c = local.seq / 2, KV = local.kv_heads * local.head_dim;
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b) {
        const int qa = cp.chunk_of(a), kb = cp.chunk_of(src, b);
        if (kb > qa) continue;  // every key after every query: masked
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
  static int next_rank(const ContextParallelGroup& cp) { return (cp.rank() + 1) % cp.size(); }
  static int prev_rank(const ContextParallelGroup& cp) { return (cp.rank() - 1 + cp.size()) % cp.size(); }
  // Starts passing n elements of `here` to the next rank and receiving the previous
  // rank's into `there`.
  template <class E>
  static comm::Comm::Request pass(const ContextParallelGroup& cp, const E* here, E* there, std::size_t n) {
    comm::Comm& group = *cp.communicator();
    return group.p2p_async({group.send_op(std::span<const E>(here, n), next_rank(cp)),
                            group.recv_op(std::span<E>(there, n), prev_rank(cp))});
  }
  // kv (B·S, 2 KVl) = the k and v columns of this rank's qkv rows.
  static void pack_kv(Context& ctx, T* kv, const T* qkv, const AttentionShape& local) {
    const std::int64_t Q = local.heads * local.head_dim, KV = local.kv_heads * local.head_dim;
    Backend::copy_2d(ctx, kv, 2 * KV, qkv + Q, Q + 2 * KV, local.batch * local.seq, 2 * KV);
  }

  // Every cp rank's K/V block in turn: cp steps, each attending to the block in hand
  // while it passes to the next rank (and the previous rank's arrives).
  static void ring_forward(Context& ctx, const ContextParallelGroup& cp, T* out, Acc* lse, const T* qkv,
                           const AttentionShape& local, Buffers& ring) {
    if constexpr (kRing) {
      const std::int64_t rows = local.batch * local.seq, KV = local.kv_heads * local.head_dim;
      const std::int64_t states = local.batch * local.heads * local.seq;
      for (auto& b : ring.kv) b.reserve(rows * 2 * KV);
      ring.o.reserve(rows * local.heads * local.head_dim);
      ring.m.reserve(states);
      ring.l.reserve(states);
      const AttentionState<Acc> st{ring.o.data(), ring.m.data(), ring.l.data()};
      Backend::attention_state_init(ctx, st, local);
      pack_kv(ctx, ring.kv[0].data(), qkv, local);
      const auto n = static_cast<std::size_t>(rows * 2 * KV);
      for (int step = 0; step < cp.size(); ++step) {
        T* here = ring.kv[step % 2].data();
        std::optional<comm::Comm::Request> passing;
        Backend::synchronize(ctx);  // the block in hand is written before it is sent
        if (step + 1 < cp.size()) passing = pass(cp, here, ring.kv[(step + 1) % 2].data(), n);
        for_each_block(cp, step, local, [&](const AttentionBlock& blk) {
          Backend::attention_block_forward(ctx, st, qkv, here, local, blk);
        });
        if (passing) passing->wait();
      }
      Backend::attention_state_finish(ctx, out, lse, st, local);
    } else {
      unsupported(ctx, cp, out, lse, qkv, local, ring);
    }
  }

  // dqkv from dout: each K/V block travels the ring again, and its dK/dV one step
  // behind it: at step s a rank computes its share of the block in hand into a fresh
  // buffer while the K/V block moves on and the share the previous ranks summed for it
  // arrives, adds that, and passes the sum on with the next step's exchange (hidden
  // behind that step's compute). After the last step every block's sum goes home to
  // its owner. dq stays. Each step's sends and receives are one batch, so a ring of
  // engines that hold a send until its receive is posted (NCCL) cannot deadlock.
  static void ring_backward(Context& ctx, const ContextParallelGroup& cp, T* dqkv, const T* dout, const T* qkv,
                            const T* out, const Acc* lse, const AttentionShape& local, Buffers& ring) {
    if constexpr (kRing) {
      const int P = cp.size();
      const std::int64_t rows = local.batch * local.seq, Q = local.heads * local.head_dim,
                         KV = local.kv_heads * local.head_dim, R = Q + 2 * KV;
      for (auto& b : ring.kv) b.reserve(rows * 2 * KV);
      for (auto& b : ring.dkv) b.reserve(rows * 2 * KV);
      ring.dq.reserve(rows * Q);
      ring.dsum.reserve(local.batch * local.heads * local.seq);
      Backend::attention_dsum(ctx, ring.dsum.data(), dout, out, local);
      Backend::zero(ctx, ring.dq.data(), rows * Q);
      pack_kv(ctx, ring.kv[0].data(), qkv, local);
      const auto n = static_cast<std::size_t>(rows * 2 * KV);
      comm::Comm& group = *cp.communicator();
      Acc* arrived = ring.dkv[2].data();  // the previous ranks' sum for the block in hand; at the end, this rank's
      for (int step = 0; step <= P; ++step) {
        Acc* sum = ring.dkv[step % 2].data();               // this step's block: this rank's share, then the sum
        const Acc* done = ring.dkv[(step + 1) % 2].data();  // the previous step's block's sum, passed on
        std::vector<comm::Op> ops;
        if (step > 0) {
          ops.push_back(group.send_op(std::span<const Acc>(done, n), next_rank(cp)));
          ops.push_back(group.recv_op(std::span<Acc>(arrived, n), prev_rank(cp)));
        }
        if (step + 1 < P) {  // the keys and values move on while this block's gradients are computed
          ops.push_back(group.send_op(std::span<const T>(ring.kv[step % 2].data(), n), next_rank(cp)));
          ops.push_back(group.recv_op(std::span<T>(ring.kv[(step + 1) % 2].data(), n), prev_rank(cp)));
        }
        Backend::synchronize(ctx);  // what the batch sends is written
        comm::Comm::Request exchange = group.p2p_async(ops);
        if (step < P) {
          Backend::zero(ctx, sum, rows * 2 * KV);
          for_each_block(cp, step, local, [&](const AttentionBlock& blk) {
            Backend::attention_block_backward(ctx, ring.dq.data(), sum, dout, qkv, ring.kv[step % 2].data(), lse,
                                              ring.dsum.data(), local, blk);
          });
        }
        exchange.wait();
        if (step > 0 && step < P) Backend::add_inplace(ctx, sum, arrived, rows * 2 * KV);
      }
      // dqkv's q columns = dq, its k and v columns = this rank's block's sum (arrived),
      // each through T.
      ring.stage.reserve(rows * std::max(Q, 2 * KV));
      Backend::convert(ctx, ring.stage.data(), ring.dq.data(), rows * Q);
      Backend::copy_2d(ctx, dqkv, R, ring.stage.data(), Q, rows, Q);
      Backend::convert(ctx, ring.stage.data(), arrived, rows * 2 * KV);
      Backend::copy_2d(ctx, dqkv + Q, R, ring.stage.data(), 2 * KV, rows, 2 * KV);
    } else {
      unsupported(ctx, cp, dqkv, dout, qkv, out, lse, local, ring);
    }
  }

  // ---- All-to-all over the heads.
  //
  // A row of qkv (or of the core's output) is `groups` equal blocks of kv_heads heads
  // each: the query heads in heads / kv_heads blocks (query head h reads kv head
  // h % kv_heads), then k, then v. cp rank p takes part p of every block, kv_heads / cp
  // heads of each: its query heads then read its own kv heads, as a tp rank's do
  // (nn::Split's groups), and its part is a qkv row of heads / cp and kv_heads / cp.
  static std::int64_t groups_qkv(const AttentionShape& l) { return l.heads / l.kv_heads + 2; }
  static std::int64_t groups_out(const AttentionShape& l) { return l.heads / l.kv_heads; }
  // cp rank p's heads of every row.
  static AttentionShape heads_shape(const ContextParallelGroup& cp, const AttentionShape& l) {
    return {l.batch, l.seq * cp.size(), l.heads / cp.size(), l.kv_heads / cp.size(), l.head_dim};
  }

  // How `groups` blocks of a row split over the cp ranks: N rows (B·S) of groups·block,
  // part = block / cp of each block per rank, W = groups·part per rank; c rows per
  // chunk, `whole` rows per whole sequence.
  struct HeadParts {
    int P;
    std::int64_t batch, seq, N, block, part, W, groups, c, whole;
    std::int64_t count() const { return N * groups * block; }  // one rank's elements, sent or received
  };
  static HeadParts head_parts(const ContextParallelGroup& cp, const AttentionShape& l, std::int64_t groups) {
    const int P = cp.size();
    const std::int64_t block = l.kv_heads * l.head_dim;
    return {P, l.batch, l.seq, l.batch * l.seq, block, block / P, groups * (block / P), groups, l.seq / 2, l.seq * P};
  }
  // f(packed, row) for part p of block g: its offset in the exchange buffer ([cp rank
  // p][row][its part of every block], rows W apart) and in a row (rows groups·block apart).
  template <class F>
  static void for_each_part(const HeadParts& h, F&& f) {
    for (int p = 0; p < h.P; ++p)
      for (std::int64_t g = 0; g < h.groups; ++g) f(p * h.N * h.W + g * h.part, g * h.block + p * h.part);
  }
  // f(packed, at) for each chunk of c rows cp rank q holds: its offset in the exchange
  // buffer ([cp rank q][q's rows]) and in the whole sequences (q's chunk_of(q, half)).
  template <class F>
  static void for_each_chunk(const ContextParallelGroup& cp, const HeadParts& h, F&& f) {
    for (int q = 0; q < h.P; ++q)
      for (std::int64_t s = 0; s < h.batch; ++s)
        for (int half = 0; half < 2; ++half)
          f((q * h.N + s * h.seq + half * h.c) * h.W, (s * h.whole + cp.chunk_of(q, half) * h.c) * h.W);
  }

  // heads (B·T, groups·part) = every row, in sequence order, of this rank's part of
  // rows (B·S, groups·block): the cp ranks' rows of its heads. heads may be rows.
  static void to_heads(Context& ctx, const ContextParallelGroup& cp, T* heads, const T* rows, const AttentionShape& l,
                       std::int64_t groups, Buffers& b) {
    if constexpr (kAllToAll) {
      const HeadParts h = head_parts(cp, l, groups);
      T* send = reserve(b.send, h);
      for_each_part(h, [&](std::int64_t packed, std::int64_t row) {
        Backend::copy_2d(ctx, send + packed, h.W, rows + row, h.groups * h.block, h.N, h.part);
      });
      const T* recv = exchange(ctx, cp, b, h);
      for_each_chunk(cp, h, [&](std::int64_t packed, std::int64_t at) {
        Backend::copy(ctx, heads + at, recv + packed, h.c * h.W);
      });
    } else {
      unsupported(ctx, cp, heads, rows, l, groups, b);
    }
  }

  // rows (B·S, groups·block) = this rank's rows, every cp rank's part of them, from
  // heads (B·T, groups·part): to_heads backwards. rows may not be heads.
  static void to_rows(Context& ctx, const ContextParallelGroup& cp, T* rows, const T* heads, const AttentionShape& l,
                      std::int64_t groups, Buffers& b) {
    if constexpr (kAllToAll) {
      const HeadParts h = head_parts(cp, l, groups);
      T* send = reserve(b.send, h);
      for_each_chunk(cp, h, [&](std::int64_t packed, std::int64_t at) {
        Backend::copy(ctx, send + packed, heads + at, h.c * h.W);
      });
      const T* recv = exchange(ctx, cp, b, h);
      for_each_part(h, [&](std::int64_t packed, std::int64_t row) {
        Backend::copy_2d(ctx, rows + row, h.groups * h.block, recv + packed, h.W, h.N, h.part);
      });
    } else {
      unsupported(ctx, cp, rows, heads, l, groups, b);
    }
  }
  static T* reserve(Buffer<T, typename Backend::Space>& buffer, const HeadParts& h) {
    buffer.reserve(h.count());
    return buffer.data();
  }
  // The packed send buffer to every cp rank, each rank's block into recv; returns recv.
  static const T* exchange(Context& ctx, const ContextParallelGroup& cp, Buffers& b, const HeadParts& h) {
    const auto n = static_cast<std::size_t>(h.count());
    b.recv.reserve(h.count());
    Backend::synchronize(ctx);  // the packed buffer is written before the engine reads it
    cp.communicator()->all_to_all(std::span<const T>(b.send.data(), n), std::span<T>(b.recv.data(), n));
    return b.recv.data();
  }

  // qkv: every row of this rank's heads (prepare); out and lse: this rank's rows.
  static void all_to_all_forward(Context& ctx, const ContextParallelGroup& cp, T* out, Acc* lse, const T* qkv,
                                 const AttentionShape& local, Buffers& b) {
    const AttentionShape h = heads_shape(cp, local);
    b.out.reserve(local.batch * local.seq * local.heads * local.head_dim);
    Backend::attention_forward(ctx, b.out.data(), lse, qkv, h);  // lse: (B, NH/tp/cp, T), this rank's heads
    to_rows(ctx, cp, out, b.out.data(), local, groups_out(local), b);
  }

  static void all_to_all_backward(Context& ctx, const ContextParallelGroup& cp, T* dqkv, const T* dout, const T* qkv,
                                  const T* out, const Acc* lse, const AttentionShape& local, Buffers& b) {
    const AttentionShape h = heads_shape(cp, local);
    const std::int64_t rows = local.batch * local.seq, Cl = local.heads * local.head_dim;
    b.out.reserve(rows * Cl);
    b.dout.reserve(rows * Cl);
    b.dqkv.reserve(rows * (Cl + 2 * local.kv_heads * local.head_dim));
    to_heads(ctx, cp, b.out.data(), out, local, groups_out(local), b);
    to_heads(ctx, cp, b.dout.data(), dout, local, groups_out(local), b);
    Backend::attention_backward(ctx, b.dqkv.data(), b.dout.data(), qkv, b.out.data(), lse, h);
    to_rows(ctx, cp, dqkv, b.dqkv.data(), local, groups_qkv(local), b);
  }

  template <class... Args>
  [[noreturn]] static void unsupported(Args&&...) {
    LLMPAR_FAIL("context parallelism needs the backend's kernels for it (", Backend::kName, ")");
  }
};

}  // namespace detail
}  // namespace llmpar::nn
