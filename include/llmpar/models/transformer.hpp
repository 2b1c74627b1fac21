// llmpar/models/transformer.hpp — a decoder-only language model around a stack of
// blocks: token embedding (and, optionally, a learned position table), L blocks, a final
// norm, an LM head tied to the token table, and the cross-entropy loss.
//
// What differs between GPT-2, a LLaMA-style model or a user's model is the block, the
// final norm, whether positions come from a table, and the names; a Spec says those
// (models::GPT2Spec in gpt2.hpp; examples/custom_layer.hpp has a user's), and this one
// class is the rest. A block is any nn::Layer constructed as Block(name, config, tp)
// (a TensorParallelGroup); it may also take the model's shared backward scratch
// (use_scratch / backward(..., scratch)) and report its activation_bytes().
//
//   struct Spec {
//     using Config = ...;                  // layers, dim, max_seq, vocab, padded_vocab,
//                                          // init_std, validate()
//     template <class T, class B> using Block = ...;
//     template <class T, class B> using Norm = ...;   // nn::LayerNorm, nn::RMSNorm, ...
//     static constexpr const char* kTokenTable = "wte";
//     static constexpr const char* kPositionTable = "wpe";  // or nullptr: none
//     static constexpr const char* kBlockPrefix = "h.";     // block l is named "h.<l>"
//     template <class T, class B> static Norm<T, B> final_norm(const Config&);
//   };
//
// Why it is built this way:
//  - Each block owns the activations its backward needs (llm.c style) and a model-owned
//    scratch holds gradients that are dead once a block's backward returns, so the
//    memory a step needs is visible in one place (activation_bytes()).
//  - Parameters are reached only through parameters(visit); the model binds them into a
//    flat ParameterStore and initialises them from (seed, name, index), so any split over
//    ranks starts from exactly the serial model's weights.
//  - The backend is a policy tag: the same source runs on the CPU and on a GPU, with
//    every tensor in the backend's memory. Inputs arrive on the host and are checked
//    there before they are copied in.
//  - Under tensor parallelism (a TensorParallelGroup of tp ranks) the blocks split as
//    they are written to, and the token table, the tied LM head and the loss split the
//    vocabulary (nn::VocabParallelEmbedding): no rank ever holds the (B·S, Vp) logits.
//    With sequence parallelism the norm and residual regions hold B·S/tp rows.
//  - Units (nn/units.hpp) for data parallelism: 0 is the token table with the tied LM
//    head and the position table, 1..L the blocks, L+1 the final norm. The hooks are
//    called around each use, so a ZeRO strategy can reduce, bind or gather per unit.
//  - The vocabulary is padded (GPT-2: 50257 -> 50304) so the LM-head GEMM has aligned
//    rows; padded logits never enter the loss and get zero gradient.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "llmpar/backend/backend.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/slice.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/nn/units.hpp"
#include "llmpar/nn/vocab_parallel.hpp"

namespace llmpar::models {

namespace detail {
// Gradients that live only while one block's backward runs; shared by all blocks.
template <class T, class Space>
struct BlockScratch {
  Buffer<T, Space> wide0;              // (rows, 4C)
  Buffer<T, Space> qkv;                // (rows, 3C)
  Buffer<T, Space> c0, c1;             // (rows, C)
  Buffer<T, Space> gathered, partial;  // (rows, C), sequence parallelism only: gathered
                                       // rows and partial sums before a reduce-scatter
  void reserve(std::int64_t rows, std::int64_t dim, bool sequence_parallel = false) {
    wide0.reserve(rows * 4 * dim);
    qkv.reserve(rows * 3 * dim);
    c0.reserve(rows * dim);
    c1.reserve(rows * dim);
    if (sequence_parallel) {
      gathered.reserve(rows * dim);
      partial.reserve(rows * dim);
    }
  }
  std::size_t bytes() const {
    return wide0.bytes() + qkv.bytes() + c0.bytes() + c1.bytes() + gathered.bytes() + partial.bytes();
  }
};
}  // namespace detail

template <class T, class Backend, class Spec>
class Transformer {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using BackendTag = Backend;
  using value_type = T;  // storage and compute type of weights and activations
  using Config = typename Spec::Config;
  using Block = typename Spec::template Block<T, Backend>;
  using Norm = typename Spec::template Norm<T, Backend>;
  // A learned position table (GPT-2), or none (positions inside the blocks: rotary).
  static constexpr bool kPositionTable = Spec::kPositionTable != nullptr;

  // tp: the tensor-parallel group the model is split over (default: none): the blocks
  // split as they are written to, the token table, LM head and loss split the
  // vocabulary; the position table and the final norm are whole on every rank.
  Transformer(const Config& cfg, std::uint64_t seed, nn::TensorParallelGroup tp = {})
      : cfg_(cfg),
        tp_(tp),
        embedding_((cfg.validate(), Spec::kTokenTable), cfg.vocab, cfg.padded_vocab, cfg.dim, cfg.init_std, tp),
        norm_(Spec::template final_norm<T, Backend>(cfg)) {
    if constexpr (kPositionTable)
      positions_ = nn::Parameter<T>(Spec::kPositionTable, {cfg.max_seq, cfg.dim}, nn::Init::normal(0.01f), true);
    blocks_.reserve(static_cast<std::size_t>(cfg.layers));
    for (std::int64_t l = 0; l < cfg.layers; ++l)
      blocks_.emplace_back(std::string(Spec::kBlockPrefix) + std::to_string(l), cfg, tp);
    if constexpr (requires(Block & b, detail::BlockScratch<T, Space> * s) { b.use_scratch(s); })
      for (auto& block : blocks_) block.use_scratch(&scratch_);
    embedding_.use_scratch(&scratch_.partial, &scratch_.gathered);
    nn::mark_sequence_parallel<T>(norm_, tp);
    store_.bind(*this);
    store_.initialize(seed);
    // Padded token rows are never looked up and never produce a logit that matters:
    // keep them at zero so they cannot perturb anything.
    embedding_.zero_padding();
  }
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  // Training forward: returns the mean loss over B·S tokens and leaves ∂loss/∂logits
  // (times loss_scale, for gradient accumulation) ready for backward().
  Acc forward(Context& ctx, const std::int32_t* tokens, const std::int32_t* targets, std::int64_t batch,
              std::int64_t seq, Acc loss_scale = Acc(1)) {
    compute_logits(ctx, tokens, batch, seq);
    const std::int64_t rows = batch * seq;
    copy_targets(ctx, targets, rows);
    embedding_.loss(ctx, losses_.data(), logits_.data(), targets_.data(), rows, loss_scale / static_cast<Acc>(rows));
    backward_ready_ = true;
    return mean_loss(ctx, rows);
  }

  // Accumulates ∂loss/∂parameter into the gradients (zero them first with zero_grad()).
  void backward(Context& ctx) {
    LLMPAR_CHECK(backward_ready_,
                 "backward() needs a training forward() first (evaluate() and logits() keep no gradient state)");
    backward_ready_ = false;
    const std::int64_t batch = batch_, seq = seq_, rows = batch * seq, C = cfg_.dim, L = cfg_.layers;
    const std::int64_t local = tp_.local_rows(rows);
    scratch_.c0.reserve(rows * C);
    dres_[0].reserve(local * C);
    dres_[1].reserve(local * C);
    // LM head, tied to the token table: this rank's vocabulary columns, dnorm summed over
    // the group.
    T* dnorm = scratch_.c0.data();  // (Rl, C)
    const int norm_unit = static_cast<int>(L) + 1;
    nn::before_backward(hooks_, 0);
    embedding_.head_backward(ctx, dnorm, logits_.data(), norm_out_.data(), rows);
    nn::before_backward(hooks_, norm_unit);
    norm_.backward(ctx, dres_[0].data(), dnorm, residual(L), local);
    nn::after_backward(hooks_, norm_unit);
    for (std::int64_t l = L - 1; l >= 0; --l) {
      T* dout = dres_[(L - 1 - l) % 2].data();
      T* dx = dres_[(L - l) % 2].data();
      Block& block = blocks_[static_cast<std::size_t>(l)];
      nn::before_backward(hooks_, static_cast<int>(l) + 1);
      if constexpr (requires { block.backward(ctx, dx, dout, residual(l), batch, seq, scratch_); })
        block.backward(ctx, dx, dout, residual(l), batch, seq, scratch_);  // with the shared scratch
      else
        block.backward(ctx, dx, dout, residual(l), batch, seq);
      nn::after_backward(hooks_, static_cast<int>(l) + 1);
    }
    embedding_.backward(ctx, dres_[L % 2].data(), tokens_.data(), batch, seq,
                        kPositionTable ? positions_.grad : nullptr);
    nn::after_backward(hooks_, 0);
  }

  // Mean loss without touching any gradient state.
  Acc evaluate(Context& ctx, const std::int32_t* tokens, const std::int32_t* targets, std::int64_t batch,
               std::int64_t seq) {
    compute_logits(ctx, tokens, batch, seq);
    backward_ready_ = false;
    copy_targets(ctx, targets, batch * seq);
    embedding_.loss(ctx, losses_.data(), logits_.data(), targets_.data(), batch * seq, std::nullopt);
    return mean_loss(ctx, batch * seq);
  }

  // This rank's logits (B, S, padded_vocab / tp) of a batch, in the backend's memory:
  // the columns vocab_slice() (all of them unsplit); only ids < vocab are meaningful.
  const T* logits(Context& ctx, const std::int32_t* tokens, std::int64_t batch, std::int64_t seq) {
    compute_logits(ctx, tokens, batch, seq);
    backward_ready_ = false;
    return logits_.data();
  }
  // host_row (padded_vocab) = every column of the logits at `row` (b·S + t) of a batch,
  // gathered over the tensor-parallel group when the vocabulary is split (sampling).
  void logits_row(Context& ctx, T* host_row, const std::int32_t* tokens, std::int64_t batch, std::int64_t seq,
                  std::int64_t row) {
    LLMPAR_CHECK(row >= 0 && row < batch * seq, "logits_row: row ", row, " is outside the batch's ", batch * seq,
                 " rows");
    const T* local = logits(ctx, tokens, batch, seq);
    embedding_.download_row(ctx, host_row, local + row * embedding_.slice().count);
  }
  RowSlice vocab_slice() const { return embedding_.slice(); }

  // Zeroes every gradient, in the backend's stream order (no device-wide wait). Under a
  // ZeRO stage that shards gradients the data-parallel strategy zeroes its own.
  void zero_grad(Context& ctx) {
    if (store_.has_grads()) Backend::zero(ctx, store_.grads(), store_.flat_size());
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    for (int u = 0; u < num_units(); ++u) unit_parameters(u, visit);
  }
  // Units (nn/units.hpp): 0 the embedding (token table, tied LM head, position table),
  // 1..L the blocks, L+1 the final norm.
  int num_units() const { return static_cast<int>(cfg_.layers) + 2; }
  template <class Visit>
  void unit_parameters(int unit, Visit&& visit) {
    if (unit == 0) {
      embedding_.parameters(visit);
      if constexpr (kPositionTable) visit(positions_);
    } else if (unit <= cfg_.layers) {
      blocks_[static_cast<std::size_t>(unit - 1)].parameters(visit);
    } else {
      norm_.parameters(visit);
    }
  }
  void set_unit_hooks(nn::UnitHooks* hooks) { hooks_ = hooks; }

  nn::ParameterStore<T, Space>& parameter_store() { return store_; }
  nn::TensorParallelGroup tensor_parallel() const { return tp_; }
  const Config& config() const { return cfg_; }
  // Parameters of the whole model (not this rank's share of a split one).
  std::int64_t num_parameters() const { return store_.full_numel(); }

  // Bytes of activations and activation gradients currently allocated.
  std::size_t activation_bytes() const {
    std::size_t n = residual_.bytes() + norm_out_.bytes() + norm_local_.bytes() + logits_.bytes() + losses_.bytes() +
                    dres_[0].bytes() + dres_[1].bytes() + scratch_.bytes() + norm_.activation_bytes() +
                    embedding_.activation_bytes();
    if constexpr (requires(const Block& b) { b.activation_bytes(); })
      for (const auto& b : blocks_) n += b.activation_bytes();
    return n;
  }

 private:
  T* residual(std::int64_t l) { return residual_.data() + l * tp_.local_rows(batch_ * seq_) * cfg_.dim; }

  void compute_logits(Context& ctx, const std::int32_t* tokens, std::int64_t batch, std::int64_t seq) {
    LLMPAR_CHECK(batch > 0, "batch size is ", batch, "; it must be positive");
    LLMPAR_CHECK(seq > 0 && seq <= cfg_.max_seq, "sequence length ", seq, " is outside [1, ", cfg_.max_seq,
                 "]; the model was built for at most --seq ", cfg_.max_seq);
    tp_.check_sequence(seq);
    batch_ = batch;
    seq_ = seq;
    const std::int64_t rows = batch * seq, C = cfg_.dim, L = cfg_.layers;
    const std::int64_t local = tp_.local_rows(rows);
    for (std::int64_t i = 0; i < rows; ++i)
      LLMPAR_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab, "token id ", tokens[i], " at position ", i,
                   " is outside the vocabulary [0, ", cfg_.vocab, ")");
    tokens_.reserve(rows);
    Backend::upload(ctx, tokens_.data(), tokens, rows);
    residual_.reserve((L + 1) * local * C);
    norm_out_.reserve(rows * C);
    logits_.reserve(rows * embedding_.slice().count);
    losses_.reserve(rows);
    const int norm_unit = static_cast<int>(L) + 1;
    nn::before_forward(hooks_, 0);
    embedding_.forward(ctx, residual(0), tokens_.data(), batch, seq, kPositionTable ? positions_.value : nullptr);
    nn::after_forward(hooks_, 0);
    for (std::int64_t l = 0; l < L; ++l) {
      nn::before_forward(hooks_, static_cast<int>(l) + 1);
      blocks_[static_cast<std::size_t>(l)].forward(ctx, residual(l + 1), residual(l), batch, seq);
      nn::after_forward(hooks_, static_cast<int>(l) + 1);
    }
    nn::before_forward(hooks_, norm_unit);
    nn::before_forward(hooks_, 0);  // the LM head is the token table
    if (tp_.sequence_parallel()) {
      // The final norm on this rank's rows, then every row gathered for the LM head.
      norm_local_.reserve(local * C);
      norm_.forward(ctx, norm_local_.data(), residual(L), local);
      Backend::synchronize(ctx);
      tp_.gather_rows(norm_out_.data(), norm_local_.data(), rows, C);
    } else {
      norm_.forward(ctx, norm_out_.data(), residual(L), rows);
    }
    embedding_.head_forward(ctx, logits_.data(), norm_out_.data(), rows);
    nn::after_forward(hooks_, norm_unit);
    nn::after_forward(hooks_, 0);
  }

  // Targets are checked on the host, then copied into the backend's memory.
  void copy_targets(Context& ctx, const std::int32_t* targets, std::int64_t rows) {
    for (std::int64_t i = 0; i < rows; ++i)
      LLMPAR_CHECK(targets[i] >= 0 && targets[i] < cfg_.vocab, "target id ", targets[i], " at position ", i,
                   " is outside the vocabulary [0, ", cfg_.vocab, ")");
    targets_.reserve(rows);
    Backend::upload(ctx, targets_.data(), targets, rows);
  }

  // The mean of the per-token losses, summed on the host in position order (the same
  // order on every backend).
  Acc mean_loss(Context& ctx, std::int64_t rows) {
    host_losses_.reserve(rows);
    Backend::download(ctx, host_losses_.data(), losses_.data(), rows);
    Acc sum = 0;
    for (std::int64_t i = 0; i < rows; ++i) sum += host_losses_[i];
    return sum / static_cast<Acc>(rows);
  }

  Config cfg_;
  nn::TensorParallelGroup tp_;
  nn::VocabParallelEmbedding<T, Backend> embedding_;  // (Vp, C) split by rows; also the LM head
  nn::Parameter<T> positions_;                        // (max_seq, C) when Spec has a position table
  std::vector<Block> blocks_;
  Norm norm_;  // the final norm
  nn::ParameterStore<T, Space> store_;
  nn::UnitHooks* hooks_ = nullptr;

  std::int64_t batch_ = 0, seq_ = 0;
  bool backward_ready_ = false;
  Buffer<std::int32_t, Space> tokens_;   // (B, S)
  Buffer<std::int32_t, Space> targets_;  // (B, S)
  Buffer<T, Space> residual_;            // (L+1, Rl, C): the input of every block, and the last output
                                         // (Rl = B·S, or this rank's B·S/tp under sequence parallelism)
  Buffer<T, Space> norm_out_;            // (B, S, C)
  Buffer<T, Space> norm_local_;          // (Rl, C) sequence parallelism only: this rank's normed rows
  Buffer<T, Space> logits_;              // (B, S, Vp/tp); holds ∂loss/∂logits after a training forward
  Buffer<Acc, Space> losses_;            // (B, S)
  Buffer<Acc> host_losses_;              // (B, S) on the host
  Buffer<T, Space> dres_[2];             // (Rl, C) ping-pong residual gradients
  detail::BlockScratch<T, Space> scratch_;
};

}  // namespace llmpar::models
