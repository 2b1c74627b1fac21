// llmpar/nn/vocab_parallel.hpp — the token table split by vocabulary over a
// tensor-parallel group, the LM head tied to it, and the loss that never gathers the
// logits (Megatron-LM's VocabParallelEmbedding and vocab-parallel cross-entropy).
//
// The table (Vp, C) is split by rows: rank i holds token ids [i·Vp/tp, (i+1)·Vp/tp)
// (a RowSlice), initialised at those rows of the serial table.
//
//   embedding  each rank looks up the tokens it holds (zero for the others), rank 0 adds
//              the position rows, and the partial rows are summed over the group (an
//              all-reduce; a reduce-scatter under sequence parallelism, which leaves each
//              rank its rows). Every sum has one token term and one position term, so
//              the embedding is the serial one bit for bit.
//   LM head    logits (rows, Vp/tp) = x · wte_localᵀ: each rank computes its columns.
//   loss       per row each rank reduces its columns to a softmax state (max, sum) and
//              the target's logit if it holds it; the group all-gathers those three
//              numbers per row and every rank combines them in rank order, so every rank
//              has the same loss, and writes the dlogits of its own columns. The (rows,
//              Vp) logits are never gathered: per rank, the logits and their gradient
//              take 1/tp of the memory, and the wire carries 3 numbers per row and rank.
//   backward   dx = Σ_ranks dlogits_local · wte_local (reduce_rows: all-reduce, or
//              reduce-scatter under sequence parallelism); dwte_local += dlogitsᵀ · x and
//              the embedding's scatter-add into the rows this rank holds.
//
// Unsplit (one rank), every call is the serial layer: the fused cross-entropy and the
// whole table, no communication. The padded vocabulary (Vp >= V, rows of zeros that make
// the GEMMs aligned) must divide by tp; its padding columns never enter the loss, on
// whichever rank they fall.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "llmpar/backend/backend.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/slice.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/tensor_parallel.hpp"

namespace llmpar::nn {

template <class T, class Backend = backend::Cpu>
class VocabParallelEmbedding {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;

  // A table of padded_vocab rows of width dim, of which the first `vocab` are tokens.
  VocabParallelEmbedding(const std::string& name, std::int64_t vocab, std::int64_t padded_vocab, std::int64_t dim,
                         float init_std, TensorParallelGroup tp)
      : tp_((tp.check_divides(padded_vocab, "the padded vocabulary"), tp.check_reaches<Space>(name), tp)),
        vocab_(vocab),
        dim_(dim),
        slice_{tp.rank() * (padded_vocab / tp.size()), padded_vocab / tp.size()},
        weight_(name, {padded_vocab, dim}, Init::normal(init_std), true, tp.along(0)) {}

  // Under sequence parallelism the layer needs two (B·S, C) buffers for partial sums and
  // gathered rows; a model that already has such scratch (dead while the embedding and
  // the head run) lends it here instead of the layer allocating its own.
  void use_scratch(Buffer<T, Space>* partial, Buffer<T, Space>* gathered) {
    partial_ = partial;
    gathered_ = gathered;
  }

  // Sets this rank's padding rows (ids >= vocab) to zero; call after the store has
  // initialised the weights. They are never looked up and their logits never enter the
  // loss, so they stay zero.
  void zero_padding() {
    const std::int64_t first_padding = std::clamp<std::int64_t>(vocab_ - slice_.first, 0, slice_.count);
    Space::zero(weight_.value + first_padding * dim_,
                static_cast<std::size_t>((slice_.count - first_padding) * dim_) * sizeof(T));
  }

  // out (this rank's rows of B·S, C) = wte[tokens] (+ positions[t]). tokens: (B, S) in the
  // backend's memory; positions: (>= S, C), or null for none.
  void forward(Context& ctx, T* out, const std::int32_t* tokens, std::int64_t batch, std::int64_t seq,
               const T* positions) {
    const std::int64_t rows = batch * seq;
    if (!tp_.split()) {
      Backend::encoder_forward(ctx, out, tokens, weight_.value, positions, batch, seq, dim_);
      return;
    }
    T* partial = out;
    if (tp_.sequence_parallel()) {
      partial_->reserve(rows * dim_);
      partial = partial_->data();
    }
    Backend::encoder_forward(ctx, partial, tokens, weight_.value, tp_.rank() == 0 ? positions : nullptr, batch, seq,
                             dim_, slice_);
    Backend::synchronize(ctx);  // the reduction reads what the kernel wrote
    tp_.reduce_rows(out, partial, rows, dim_);
  }

  // dwte (this rank's rows) += dout at its tokens; dpositions (>= S, C) += dout summed
  // over the batch (the same on every rank), or null. dout: this rank's rows.
  void backward(Context& ctx, const T* dout, const std::int32_t* tokens, std::int64_t batch, std::int64_t seq,
                Acc* dpositions) {
    const std::int64_t rows = batch * seq;
    const T* full = dout;
    if (tp_.sequence_parallel()) {
      gathered_->reserve(rows * dim_);
      Backend::synchronize(ctx);
      full = tp_.gather_rows(gathered_->data(), dout, rows, dim_);
    }
    Backend::encoder_backward(ctx, weight_.grad, dpositions, full, tokens, batch, seq, dim_, slice_);
  }

  // logits (rows, Vp/tp) = x (rows, C) · wte_localᵀ: this rank's columns of the tied LM
  // head. x holds every row.
  void head_forward(Context& ctx, T* logits, const T* x, std::int64_t rows) const {
    Backend::template gemm<T>(ctx, logits, x, weight_.value, nullptr, rows, slice_.count, dim_,
                              {.trans_a = false, .trans_b = true, .accumulate = false});
  }

  // dx (this rank's rows, C) = Σ_ranks dlogits_local · wte_local; dwte_local +=
  // dlogits_localᵀ · x. dlogits: (rows, Vp/tp); x: every row; dx: (rows, C) unless the
  // group splits the sequence, then this rank's rows.
  void head_backward(Context& ctx, T* dx, const T* dlogits, const T* x, std::int64_t rows) {
    T* partial = dx;
    if (tp_.sequence_parallel()) {
      partial_->reserve(rows * dim_);
      partial = partial_->data();
    }
    Backend::template gemm<T>(ctx, partial, dlogits, weight_.value, nullptr, rows, dim_, slice_.count, {});
    Backend::template gemm<T>(ctx, weight_.grad, dlogits, x, nullptr, slice_.count, dim_, rows,
                              {.trans_a = true, .trans_b = false, .accumulate = true});
    if (!tp_.split()) return;
    Backend::synchronize(ctx);
    tp_.reduce_rows(dx, partial, rows, dim_);
  }

  // losses (rows) of logits (rows, Vp/tp), this rank's columns; the same on every rank.
  // Training (dloss given, d(total)/d(loss_r)): the logits are overwritten by their
  // gradient. Evaluation (no dloss): the logits are left as they are. targets: (rows) in
  // the backend's memory, in [0, vocab).
  void loss(Context& ctx, Acc* losses, T* logits, const std::int32_t* targets, std::int64_t rows,
            std::optional<Acc> dloss) {
    if (!tp_.split()) {
      if (dloss)
        Backend::cross_entropy_forward_backward(ctx, logits, losses, targets, rows, vocab_, slice_.count, *dloss);
      else
        Backend::cross_entropy_forward(ctx, losses, logits, targets, rows, vocab_, slice_.count);
      return;
    }
    constexpr int kStats = Backend::kVocabStats;
    stats_.reserve(rows * kStats);
    all_stats_.reserve(tp_.size() * rows * kStats);
    Backend::vocab_parallel_cross_entropy_stats(ctx, stats_.data(), logits, targets, rows, vocab_, slice_.first,
                                                slice_.count);
    Backend::synchronize(ctx);
    tp_.all_gather(all_stats_.data(), stats_.data(), rows * kStats);
    Backend::vocab_parallel_cross_entropy_finish(ctx, dloss ? logits : nullptr, losses, logits, all_stats_.data(),
                                                 tp_.size(), targets, rows, vocab_, slice_.first, slice_.count,
                                                 dloss.value_or(Acc(0)));
  }

  // host_row (Vp) = one row of logits, every column: this rank's logits_row (Vp/tp)
  // gathered over the group (for sampling; training never gathers logits).
  void download_row(Context& ctx, T* host_row, const T* logits_row) {
    if (!tp_.split()) {
      Backend::download(ctx, host_row, logits_row, slice_.count);
      return;
    }
    row_.reserve(slice_.count * tp_.size());
    Backend::synchronize(ctx);
    tp_.all_gather(row_.data(), logits_row, slice_.count);
    Backend::download(ctx, host_row, row_.data(), slice_.count * tp_.size());
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    visit(weight_);
  }

  const Parameter<T>& weight() const { return weight_; }
  // The token ids [first, first + count) this rank holds: its columns of the logits.
  RowSlice slice() const { return slice_; }
  // Bytes of the scratch this layer owns (partial sums and gathered rows unless a model
  // lent its own, the loss's stats, a gathered row of logits).
  std::size_t activation_bytes() const {
    return own_partial_.bytes() + own_gathered_.bytes() + stats_.bytes() + all_stats_.bytes() + row_.bytes();
  }

 private:
  TensorParallelGroup tp_;
  std::int64_t vocab_;
  std::int64_t dim_;
  RowSlice slice_;
  Parameter<T> weight_;            // (Vp/tp, C) of the full (Vp, C)
  Buffer<T, Space> own_partial_;   // (B·S, C) sequence parallelism: partial sums before a reduce-scatter
  Buffer<T, Space> own_gathered_;  // (B·S, C) sequence parallelism: every row of the embedding's gradient
  Buffer<T, Space>* partial_ = &own_partial_;
  Buffer<T, Space>* gathered_ = &own_gathered_;
  Buffer<Acc, Space> stats_;      // (B·S, kVocabStats) this rank's softmax states
  Buffer<Acc, Space> all_stats_;  // (tp, B·S, kVocabStats) every rank's
  Buffer<T, Space> row_;          // (Vp) one gathered row of logits
};

}  // namespace llmpar::nn
