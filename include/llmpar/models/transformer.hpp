// llmpar/models/transformer.hpp — a decoder-only language model around a stack of
// blocks: token embedding (and, optionally, a learned position table), L blocks, a final
// norm, an LM head (tied to the token table, or a table of its own), and the
// cross-entropy loss.
//
// What differs between GPT-2, a LLaMA-style model or a user's model is the block, the
// final norm, whether positions come from a table, and the names; a Spec says those
// (models::GPT2Spec in gpt2.hpp; examples/custom_layer.hpp has a user's), and this one
// class is the rest. A block is any nn::Layer constructed as Block(name, config, tp)
// (a TensorParallelGroup), which the model checks at compile time, naming what is
// missing (detail::check_block). It may also take the model's shared scratch
// (use_scratch, an nn::BlockScratch; backward(..., scratch)), report its own
// scratch_bytes(), and support selective recomputation (set_selective_recompute).
//
//   struct Spec {
//     using Config = ...;                  // layers, dim, max_seq, vocab, padded_vocab,
//                                          // init_std, validate()
//     template <class T, class B> using Block = ...;
//     template <class T, class B> using Norm = ...;   // nn::LayerNorm, nn::RMSNorm, ...
//     static constexpr const char* kTokenTable = "wte";
//     static constexpr const char* kPositionTable = "wpe";  // or nullptr: none
//     static constexpr const char* kBlockPrefix = "h.";     // block l is named "h.<l>"
//     static constexpr const char* kHeadTable = nullptr;    // tied to kTokenTable, or the
//                                                           // untied head's name (optional)
//     template <class T, class B> static Norm<T, B> final_norm(const Config&);
//   };
//
// A Config may also have output_multiplier(): a factor on the LM head's logits (µP's
// 1 / width multiplier, GPT2Config::mup); without it the factor is 1.
//
// Why it is built this way:
//  - The model is a sequence of chunks (pipeline/partition.hpp): this rank's runs of
//    blocks, the first virtual stage with the embedding in front, the last with the
//    final norm, the LM head and the loss. forward_chunk/backward_chunk run one
//    micro-batch through one chunk; the whole model (no pipeline) is one chunk, and
//    forward()/backward() are that one-stage schedule. What a micro-batch's backward
//    needs is a Stash the caller owns (one per micro-batch in flight: the block's
//    Saved values, the residual stream, the logits); a model-owned scratch holds
//    gradients that are dead once a block's backward returns.
//  - Recomputation (set_recompute): full keeps only each block's input (the residual
//    stream) and reruns the block's forward into one shared Saved just before its
//    backward; selective asks the blocks to drop their attention core's outputs. The
//    same kernels on the same inputs: gradients bitwise equal to no recomputation.
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
//    head and the position table, 1..L the blocks, L+1 the final norm (of the whole
//    model; a pipeline rank numbers what it holds). The hooks are called around each
//    use, so a ZeRO strategy can reduce, bind or gather per unit.
//  - Under a pipeline the last stage holds a copy of the token table for the tied LM
//    head (tied_copy()), initialised from the same name; its gradient is summed with the
//    first stage's over the embedding group, so the two stay identical (Megatron-LM).
//    An untied head (Spec::kHeadTable, Llama 3) is a vocabulary-parallel table of its
//    own on the last stage, in a unit of its own; nothing is summed between stages.
//  - The vocabulary is padded (GPT-2: 50257 -> 50304) so the LM-head GEMM has aligned
//    rows; padded logits never enter the loss and get zero gradient.
//  - An output multiplier s (µP) scales the head's input rows, not the logits: logits
//    = (s x) wteᵀ, so dwte += dlogitsᵀ (s x) needs nothing more and dx = s (dlogits
//    wte) one more scaling of the rows. That is B·S·C elements twice, against B·S·Vp
//    for the logits, the same kernels on both backends, and every consumer of the
//    logits (the fused and the vocabulary-parallel loss, evaluation, sampling) sees
//    the multiplied ones. (The `mup` package's MuSharedReadout scales its input too.)
//    With s = 1 nothing runs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "llmpar/backend/backend.hpp"
#include "llmpar/comm/grid.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/slice.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/nn/context_parallel.hpp"
#include "llmpar/nn/layer.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/scratch.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/nn/units.hpp"
#include "llmpar/nn/vocab_parallel.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/parallel/layout.hpp"
#include "llmpar/pipeline/partition.hpp"

namespace llmpar::models {

namespace detail {
// Gradients that live only while one block's backward runs; shared by all blocks.
template <class T, class Space, class Acc = acc_t<T>>
using BlockScratch = nn::BlockScratch<T, Space, Acc>;

// The block contract, checked where the Transformer takes a Spec's Block: an nn::Layer
// of T on Backend (nn::check_layer names a missing member), constructed as
// Block(name, config, tp).
template <class Block, class Backend, class T, class Config>
consteval bool check_block() {
  static_assert(nn::check_layer<Block, Backend, T>());
  static_assert(std::is_constructible_v<Block, const std::string&, const Config&, nn::TensorParallelGroup>,
                "llmpar::models::Transformer: the Spec's Block cannot be constructed as Block(const std::string& "
                "name, const Spec::Config& config, nn::TensorParallelGroup tp); give it that constructor (name "
                "prefixes its parameters' names, tp is the group it splits over: {} when not split)");
  return true;
}

// A block whose backward can leave its weight gradients for a later pass (the
// zero-bubble schedule's W): a Deferred type, backward(..., scratch, Deferred*) and
// backward_weights(ctx, saved, deferred, batch, seq).
template <class Block, class T, class Space>
concept SplitsBackward = requires(Block& b, typename Block::Context& ctx, typename Block::Saved& sv,
                                  typename Block::Deferred& d, T* dx, const T* dout, BlockScratch<T, Space>& s) {
  { d.bytes() } -> std::convertible_to<std::size_t>;
  b.backward(ctx, sv, dx, dout, dout, std::int64_t{}, std::int64_t{}, s, &d);
  b.backward_weights(ctx, sv, d, std::int64_t{}, std::int64_t{});
};

template <class Block, bool kSplits>
struct DeferredOf {
  struct type {  // a block that cannot defer: nothing kept
    std::size_t bytes() const { return 0; }
  };
};
template <class Block>
struct DeferredOf<Block, true> {
  using type = typename Block::Deferred;
};

// A model's first template argument: its storage type (the backend is then the second),
// or a composed policy, which names both (the storage type is its precision's Compute
// type) and stays the model's Policy, the one the Trainer runs. So a trainer names its
// policy once: models::GPT2<Policy> model(cfg, seed, grid, layout).
template <class X, class BackendArg>
struct ModelTypes {
  using T = X;
  using Backend = BackendArg;
  using Policy = void;  // none: the Trainer takes the one T and the backend imply
};
template <ComposedPolicy P, class BackendArg>
struct ModelTypes<P, BackendArg> {
  static_assert(std::is_same_v<BackendArg, backend::Cpu> || std::is_same_v<BackendArg, typename P::backend>,
                "llmpar::models: a model of a composed policy takes its backend from the policy; leave the second "
                "argument out (models::GPT2<Policy>)");
  using T = typename P::precision::Compute;
  using Backend = typename P::backend;
  using Policy = P;
};

}  // namespace detail

// The pipeline partition a layout names for a model of `cfg`: its --partition rule (even,
// balanced parameters, or explicit counts) over the blocks, the embedding on the first
// stage and the head on the last. "parameters" needs the counts from the Config
// (block_parameters(), embedding_parameters(), head_parameters(): GPT2Config has them).
template <class Config>
pipeline::Partition partition_of(const Config& cfg, const parallel::LayoutConfig& layout) {
  if constexpr (requires {
                  cfg.block_parameters();
                  cfg.embedding_parameters();
                  cfg.head_parameters();
                }) {
    return layout.partition_of(std::vector<std::int64_t>(static_cast<std::size_t>(cfg.layers), cfg.block_parameters()),
                               cfg.embedding_parameters(), cfg.head_parameters());
  } else {
    LLMPAR_CHECK(layout.partition != "parameters",
                 "--partition parameters balances the stages' parameters, but this model's Config does not count "
                 "them (block_parameters(), embedding_parameters(), head_parameters()); use --partition even, or "
                 "explicit layer counts");
    return layout.partition_of(std::vector<std::int64_t>(static_cast<std::size_t>(cfg.layers), 1), 0, 0);
  }
}

// The model's code, a function of its storage type, backend and Spec alone: models of
// one (T, Backend, Spec) under different composed policies (one per ZeRO stage, say)
// share it, and Transformer adds the Policy only.
template <class T, class Backend, class Spec>
class TransformerCore {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using BackendTag = Backend;
  using value_type = T;  // storage and compute type of weights and activations
  using Config = typename Spec::Config;
  using Block = typename Spec::template Block<T, Backend>;
  using Norm = typename Spec::template Norm<T, Backend>;
  static_assert(detail::check_block<Block, Backend, T, Config>());
  using Embedding = nn::VocabParallelEmbedding<T, Backend>;
  // A learned position table (GPT-2), or none (positions inside the blocks: rotary).
  static constexpr bool kPositionTable = Spec::kPositionTable != nullptr;
  // The name of an LM head of its own (Spec::kHeadTable), or null: the head is always
  // the token table. With a name, Config::tie_embeddings (when it has one) can still tie
  // them (Llama 3.2 1B does).
  static constexpr const char* kHeadTable = [] {
    if constexpr (requires { Spec::kHeadTable; })
      return Spec::kHeadTable;
    else
      return static_cast<const char*>(nullptr);
  }();
  // Whether the blocks can defer their weight gradients (the zero-bubble schedule).
  static constexpr bool kSplitsBackward = detail::SplitsBackward<Block, T, Space>;

  using Deferred = typename detail::DeferredOf<Block, kSplitsBackward>::type;

  // One micro-batch's activations through one chunk of this rank (what its backward
  // needs), owned by the caller: the pipeline executor keeps one per micro-batch in
  // flight. Rl = B·S, or B·S / tp under sequence parallelism.
  struct Stash {
    int chunk = -1;
    std::int64_t batch = 0, seq = 0;
    bool backward_ready = false;
    Buffer<std::int32_t, Space> tokens;         // (B, S) first virtual stage
    Buffer<T, Space> residual;                  // (n + 1, Rl, C): the chunk's input and each block's output
    std::vector<typename Block::Saved> blocks;  // one per block of the chunk (none under full recomputation)
    typename Norm::Saved norm;                  // last virtual stage: the final norm's
    Buffer<T, Space> norm_out;                  // (B·S, C)
    Buffer<T, Space> norm_local;                // (Rl, C) sequence parallelism only
    Buffer<T, Space> logits;                    // (B·S, Vp/tp); ∂loss/∂logits after a training forward
    Buffer<Acc, Space> losses;                  // (B·S)
    std::vector<Deferred> deferred;             // zero-bubble schedules: the weight pass's operands, per block
    bool weights_pending = false;
    std::size_t bytes() const {
      std::size_t n = tokens.bytes() + residual.bytes() + norm.bytes() + norm_out.bytes() + norm_local.bytes() +
                      logits.bytes() + losses.bytes();
      for (const auto& b : blocks) n += b.bytes();
      if constexpr (kSplitsBackward)
        for (const auto& d : deferred) n += d.bytes();
      return n;
    }
  };
  // What a chunk's forward computes beyond the activations.
  enum class Pass : std::uint8_t {
    train,     // the loss and ∂loss/∂logits, ready for backward
    evaluate,  // the loss only
    logits,    // the logits only
  };

  // tp: the tensor-parallel group the model is split over (default: none): the blocks
  // split as they are written to, the token table, LM head and loss split the
  // vocabulary; the position table and the final norm are whole on every rank.
  // placement: the pipeline chunks this rank holds (default: the whole model).
  // cp: the context-parallel group (default: none): this rank holds its chunks of every
  // sequence (nn/context_parallel.hpp), and its blocks' attention runs over the group.
  TransformerCore(const Config& cfg, std::uint64_t seed, nn::TensorParallelGroup tp = {},
                  pipeline::Placement placement = {}, nn::ContextParallelGroup cp = {})
      : cfg_((cfg.validate(), cfg)),
        tied_(ties_head_of(cfg)),
        tp_(tp),
        cp_(cp),
        placement_(place(std::move(placement), cfg.layers)),
        output_multiplier_(output_multiplier_of(cfg)) {
    const pipeline::Placement& pl = placement_;
    if (pl.first() || (pl.last() && tied_))
      table_.emplace(Spec::kTokenTable, cfg.vocab, cfg.padded_vocab, cfg.dim, cfg.init_std, tp);
    if (pl.last() && !tied_) head_.emplace(kHeadTable, cfg.vocab, cfg.padded_vocab, cfg.dim, cfg.init_std, tp);
    if constexpr (kPositionTable)
      if (pl.first())
        positions_ = nn::Parameter<T>(Spec::kPositionTable, {cfg.max_seq, cfg.dim},
                                      nn::Init::normal(cfg.init_std / 2.0f), true);  // GPT-2's 0.01 at 0.02
    if (pl.last()) norm_.emplace(Spec::template final_norm<T, Backend>(cfg));
    for (int c = 0; c < pl.chunks; ++c) {
      chunk_first_.push_back(static_cast<std::int64_t>(blocks_.size()));
      for (std::int64_t l = pl.begin(c); l < pl.end(c); ++l)
        blocks_.emplace_back(std::string(Spec::kBlockPrefix) + std::to_string(l), cfg, tp);
    }
    chunk_first_.push_back(static_cast<std::int64_t>(blocks_.size()));
    if constexpr (requires(Block & b, detail::BlockScratch<T, Space> * s) { b.use_scratch(s); })
      for (auto& block : blocks_) block.use_scratch(&scratch_);
    if (cp_.split()) {
      if constexpr (requires(Block & b) { b.set_context_parallel(cp_); }) {
        for (auto& block : blocks_) block.set_context_parallel(cp_);
      } else {
        LLMPAR_FAIL("context parallelism (--cp ", cp_.size(),
                    ") needs blocks whose attention runs over the cp group (set_context_parallel; "
                    "models::PreNormBlock of nn::SelfAttention has it); this model's blocks do not");
      }
    }
    if (table_) table_->use_scratch(&scratch_.partial, &scratch_.gathered);
    if (head_) head_->use_scratch(&scratch_.partial, &scratch_.gathered);
    if (norm_) nn::mark_sequence_parallel<T>(*norm_, tp);
    number_units();
    store_.bind(*this);
    store_.initialize(seed);
    // Padded token rows are never looked up and never produce a logit that matters:
    // keep them at zero so they cannot perturb anything.
    if (table_) table_->zero_padding();
    if (head_) head_->zero_padding();
  }
  // This rank's model of `grid`: split over grid.tp(), holding pipeline stage
  // grid.coords().pp's layers of an even partition, no sequence parallelism.
  TransformerCore(const Config& cfg, std::uint64_t seed, comm::Grid<comm::Comm>& grid)
      : TransformerCore(cfg, seed, grid, layout_of_grid(grid)) {}
  // This rank's model of `grid` at `layout` (its tp and pp those of the grid): split
  // over grid.tp() with the layout's sequence parallelism, holding pipeline stage
  // grid.coords().pp's chunks of the layout's partition and virtual stages.
  TransformerCore(const Config& cfg, std::uint64_t seed, comm::Grid<comm::Comm>& grid,
                  const parallel::LayoutConfig& layout)
      : TransformerCore(cfg, seed, nn::TensorParallelGroup(&grid.tp(), layout.sp), placement_of(cfg, grid, layout),
                        context_parallel_of(grid, layout)) {}
  TransformerCore(const TransformerCore&) = delete;
  TransformerCore& operator=(const TransformerCore&) = delete;

  // ---- the whole model in one call (no pipeline): the one-stage schedule on a stash of
  // the model's own.

  // Training forward: returns the mean loss over B·S tokens and leaves ∂loss/∂logits
  // (times loss_scale, for gradient accumulation) ready for backward().
  Acc forward(Context& ctx, const std::int32_t* tokens, const std::int32_t* targets, std::int64_t batch,
              std::int64_t seq, Acc loss_scale = Acc(1)) {
    require_whole("forward");
    return forward_chunk(ctx, 0, own_, tokens, targets, batch, seq, Pass::train, loss_scale);
  }
  // Accumulates ∂loss/∂parameter into the gradients (zero them first with zero_grad()).
  void backward(Context& ctx) {
    require_whole("backward");
    backward_chunk(ctx, own_, nullptr, nullptr);
  }
  // Mean loss without touching any gradient state.
  Acc evaluate(Context& ctx, const std::int32_t* tokens, const std::int32_t* targets, std::int64_t batch,
               std::int64_t seq) {
    require_whole("evaluate");
    return forward_chunk(ctx, 0, own_, tokens, targets, batch, seq, Pass::evaluate);
  }
  // This rank's logits (B, S, padded_vocab / tp) of a batch, in the backend's memory:
  // the columns vocab_slice() (all of them unsplit); only ids < vocab are meaningful.
  const T* logits(Context& ctx, const std::int32_t* tokens, std::int64_t batch, std::int64_t seq) {
    require_whole("logits");
    LLMPAR_CHECK(!cp_.split(), "logits() of whole sequences: under context parallelism (--cp ", cp_.size(),
                 ") each rank holds only its chunks of them; sample from a model without --cp");
    forward_chunk(ctx, 0, own_, tokens, nullptr, batch, seq, Pass::logits);
    return own_.logits.data();
  }
  // host_row (padded_vocab) = every column of the logits at `row` (b·S + t) of a batch,
  // gathered over the tensor-parallel group when the vocabulary is split (sampling).
  void logits_row(Context& ctx, T* host_row, const std::int32_t* tokens, std::int64_t batch, std::int64_t seq,
                  std::int64_t row) {
    LLMPAR_CHECK(row >= 0 && row < batch * seq, "logits_row: row ", row, " is outside the batch's ", batch * seq,
                 " rows");
    const T* local = logits(ctx, tokens, batch, seq);
    head().download_row(ctx, host_row, local + row * head().slice().count);
  }
  RowSlice vocab_slice() const { return head().slice(); }

  // ---- one chunk at a time (pipeline/executor.hpp runs any schedule with these).

  int num_chunks() const { return placement_.chunks; }
  const pipeline::Placement& placement() const { return placement_; }
  bool holds_first(int chunk) const { return chunk == 0 && placement_.first(); }
  bool holds_last(int chunk) const { return chunk == placement_.chunks - 1 && placement_.last(); }
  // Elements of the activation a chunk receives and sends for micro-batches of (batch,
  // seq) tokens: (Rl, C), Rl this rank's rows (B·S, over cp and, with sp, over tp).
  std::int64_t activation_size(std::int64_t batch, std::int64_t seq) const {
    return local_activation_size(batch, cp_.local(seq));
  }
  // Where chunk c's input goes for a micro-batch (a chunk not holding the embedding:
  // the previous virtual stage's output is received here).
  T* input(Stash& st, int chunk, std::int64_t batch, std::int64_t seq) {
    prepare(st, chunk, batch, seq);
    return st.residual.data();
  }
  // The chunk's output (the next virtual stage's input) after forward_chunk.
  const T* output(const Stash& st) const {
    return st.residual.data() + blocks_in(st.chunk) * local_activation_size(st.batch, st.seq);
  }

  // Forward of one micro-batch through chunk c into st. Tokens and targets are (batch,
  // seq), whole sequences; under context parallelism this rank takes its chunks of them
  // (and its loss is the mean over its chunks' targets). The first virtual stage embeds
  // `tokens` (host); the others read input(st, ...). The last virtual stage returns the
  // mean loss over the B·S targets (host; Pass::train also leaves ∂loss/∂logits times
  // loss_scale in st), the others 0.
  Acc forward_chunk(Context& ctx, int chunk, Stash& st, const std::int32_t* tokens, const std::int32_t* targets,
                    std::int64_t batch, std::int64_t seq, Pass pass, Acc loss_scale = Acc(1)) {
    LLMPAR_CHECK(batch > 0, "batch size is ", batch, "; it must be positive");
    LLMPAR_CHECK(seq > 0 && seq <= cfg_.max_seq, "sequence length ", seq, " is outside [1, ", cfg_.max_seq,
                 "]; the model was built for at most --seq ", cfg_.max_seq);
    cp_.check_sequence(seq);
    tp_.check_sequence(cp_.local(seq));
    if (holds_first(chunk)) check_ids(tokens, batch * seq, "token");
    if (holds_last(chunk) && pass != Pass::logits) check_ids(targets, batch * seq, "target");
    if (cp_.split()) {  // this rank's chunks of every sequence
      tokens = take_chunks(cp_tokens_, tokens, batch, seq);
      targets = take_chunks(cp_targets_, targets, batch, seq);
    }
    prepare(st, chunk, batch, seq);
    seq = st.seq;  // this rank's rows of each sequence from here on
    st.backward_ready = false;
    const std::int64_t rows = batch * seq, C = cfg_.dim, local = tp_.local_rows(rows);
    const bool full = recompute_ == recompute::Mode::full;
    if (holds_first(chunk)) {
      st.tokens.reserve(rows);
      Backend::upload(ctx, st.tokens.data(), tokens, rows);
      nn::before_forward(hooks_, embedding_unit_);
      table_->forward(ctx, residual(st, 0), st.tokens.data(), batch, seq, position_rows(ctx, seq));
      nn::after_forward(hooks_, embedding_unit_);
    }
    const std::int64_t first = chunk_first_[static_cast<std::size_t>(chunk)], n = blocks_in(chunk);
    for (std::int64_t i = 0; i < n; ++i) {
      const int unit = block_unit(first + i);
      nn::before_forward(hooks_, unit);
      block(first + i).forward(ctx, full ? recompute_saved_ : st.blocks[static_cast<std::size_t>(i)],
                               residual(st, i + 1), residual(st, i), batch, seq);
      nn::after_forward(hooks_, unit);
    }
    if (!holds_last(chunk)) return Acc(0);
    st.norm_out.reserve(rows * C);
    st.logits.reserve(rows * head().slice().count);
    nn::before_forward(hooks_, norm_unit_);
    nn::before_forward(hooks_, head_unit_);  // the LM head (the token table when tied)
    if (tp_.sequence_parallel()) {
      // The final norm on this rank's rows, then every row gathered for the LM head.
      st.norm_local.reserve(local * C);
      norm_->forward(ctx, st.norm, st.norm_local.data(), residual(st, n), local);
      scale_head_rows(ctx, st.norm_local.data(), local);
      Backend::synchronize(ctx);
      tp_.gather_rows(st.norm_out.data(), st.norm_local.data(), rows, C);
    } else {
      norm_->forward(ctx, st.norm, st.norm_out.data(), residual(st, n), rows);
      scale_head_rows(ctx, st.norm_out.data(), rows);
    }
    head().head_forward(ctx, st.logits.data(), st.norm_out.data(), rows);
    nn::after_forward(hooks_, norm_unit_);
    nn::after_forward(hooks_, head_unit_);
    if (pass == Pass::logits) return Acc(0);
    targets_.reserve(rows);
    Backend::upload(ctx, targets_.data(), targets, rows);
    st.losses.reserve(rows);
    head().loss(ctx, st.losses.data(), st.logits.data(), targets_.data(), rows,
                pass == Pass::train ? std::optional<Acc>(loss_scale / static_cast<Acc>(rows)) : std::nullopt);
    st.backward_ready = pass == Pass::train;
    return mean_loss(ctx, st.losses.data(), rows);
  }

  // Backward of st's micro-batch through its chunk: parameter gradients accumulate.
  // dout: ∂loss/∂output from the next virtual stage (null on the last, which starts from
  // its loss); dx: where ∂loss/∂input goes for the previous virtual stage (null on the
  // first, which ends in the embedding). defer_weights (a zero-bubble schedule's input-
  // gradient pass): the blocks' weight gradients wait in st for weight_chunk.
  void backward_chunk(Context& ctx, Stash& st, const T* dout, T* dx_out, bool defer_weights = false) {
    LLMPAR_CHECK(st.chunk >= 0 && (st.backward_ready || !holds_last(st.chunk)),
                 "backward() needs a training forward() first (evaluate() and logits() keep no gradient state)");
    st.backward_ready = false;
    const int chunk = st.chunk;
    const std::int64_t batch = st.batch, seq = st.seq, rows = batch * seq, C = cfg_.dim;
    const std::int64_t local = tp_.local_rows(rows);
    dres_[0].reserve(local * C);
    dres_[1].reserve(local * C);
    const std::int64_t first = chunk_first_[static_cast<std::size_t>(chunk)], n = blocks_in(chunk);
    if (holds_last(chunk)) {
      // LM head (tied to the token table, or its own): this rank's vocabulary columns,
      // dnorm summed over the group.
      scratch_.c0.reserve(rows * C);
      T* dnorm = scratch_.c0.data();  // (Rl, C)
      nn::before_backward(hooks_, head_unit_);
      head().head_backward(ctx, dnorm, st.logits.data(), st.norm_out.data(), rows);
      scale_head_rows(ctx, dnorm, local);  // ∂loss/∂norm_out = s ∂loss/∂(s norm_out)
      if (head_unit_ != embedding_unit_) nn::after_backward(hooks_, head_unit_);
      nn::before_backward(hooks_, norm_unit_);
      norm_->backward(ctx, st.norm, dres_[0].data(), dnorm, residual(st, n), local);
      nn::after_backward(hooks_, norm_unit_);
      dout = dres_[0].data();
    }
    LLMPAR_CHECK(dout != nullptr, "backward of chunk ", chunk, " needs the gradient of its output");
    const bool full = recompute_ == recompute::Mode::full;
    if (defer_weights) {
      if constexpr (kSplitsBackward) {
        LLMPAR_CHECK(!full,
                     "the zero-bubble schedule keeps each block's activations until its weight pass, which "
                     "full recomputation does not keep; use --recompute selective or none with --schedule zb");
        st.deferred.resize(static_cast<std::size_t>(n));
        st.weights_pending = true;
      } else {
        LLMPAR_FAIL(
            "the zero-bubble schedule splits each block's backward into its input and weight gradients; "
            "this block has no Deferred type and backward_weights (models::GPT2Block has): use --schedule "
            "1f1b");
      }
    }
    for (std::int64_t i = n - 1; i >= 0; --i) {
      T* dx = i == 0 && dx_out != nullptr ? dx_out : (dout == dres_[0].data() ? dres_[1].data() : dres_[0].data());
      Block& b = block(first + i);
      const int unit = block_unit(first + i);
      nn::before_backward(hooks_, unit);
      typename Block::Saved& saved = full ? recompute_saved_ : st.blocks[static_cast<std::size_t>(i)];
      if (full) {  // rebuild what forward would have kept, from the block's input
        recompute_out_.reserve(local * C);
        b.forward(ctx, saved, recompute_out_.data(), residual(st, i), batch, seq);
      }
      if constexpr (kSplitsBackward) {
        b.backward(ctx, saved, dx, dout, residual(st, i), batch, seq, scratch_,
                   defer_weights ? &st.deferred[static_cast<std::size_t>(i)] : nullptr);
      } else if constexpr (requires { b.backward(ctx, saved, dx, dout, residual(st, i), batch, seq, scratch_); }) {
        b.backward(ctx, saved, dx, dout, residual(st, i), batch, seq, scratch_);  // with the shared scratch
      } else {
        b.backward(ctx, saved, dx, dout, residual(st, i), batch, seq);
      }
      if (!defer_weights) nn::after_backward(hooks_, unit);
      dout = dx;
    }
    if (holds_first(chunk)) {
      // The embedding's unit is open already when it is also the head's (tied, one stage).
      if (embedding_unit_ != head_unit_ || !holds_last(chunk)) nn::before_backward(hooks_, embedding_unit_);
      table_->backward(ctx, dout, st.tokens.data(), batch, seq, position_grads(ctx, seq));
      if (kPositionTable && cp_.split()) add_position_grads(ctx, seq);
      nn::after_backward(hooks_, embedding_unit_);
    }
  }

  // The weight pass of a backward_chunk(..., defer_weights): every block's weight
  // gradients, in the order the undivided backward computes them.
  void weight_chunk(Context& ctx, Stash& st) {
    LLMPAR_CHECK(st.weights_pending, "weight pass of chunk ", st.chunk, " without its input-gradient pass first");
    st.weights_pending = false;
    if constexpr (kSplitsBackward) {
      const std::int64_t first = chunk_first_[static_cast<std::size_t>(st.chunk)], n = blocks_in(st.chunk);
      for (std::int64_t i = n - 1; i >= 0; --i) {
        block(first + i).backward_weights(ctx, st.blocks[static_cast<std::size_t>(i)],
                                          st.deferred[static_cast<std::size_t>(i)], st.batch, st.seq);
        nn::after_backward(hooks_, block_unit(first + i));
      }
    }
  }

  // What blocks recompute in backward (the recompute:: policy; the Trainer sets it).
  void set_recompute(recompute::Mode mode) {
    if (mode == recompute::Mode::selective) {
      if constexpr (nn::HasSelectiveRecompute<Block>) {
        for (auto& b : blocks_) b.set_selective_recompute(true);
      } else {
        LLMPAR_FAIL(
            "selective recomputation needs a block with set_selective_recompute(bool) (which parts of "
            "attention it recomputes is the block's); this block has none: use recompute::Full or None");
      }
    } else if constexpr (nn::HasSelectiveRecompute<Block>) {
      for (auto& b : blocks_) b.set_selective_recompute(false);
    }
    recompute_ = mode;
  }
  recompute::Mode recompute() const { return recompute_; }

  // Zeroes every gradient, in the backend's stream order (no device-wide wait). Under a
  // ZeRO stage that shards gradients the data-parallel strategy zeroes its own.
  void zero_grad(Context& ctx) {
    if (store_.has_grads()) Backend::zero(ctx, store_.grads(), store_.flat_size());
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    for (int u = 0; u < num_units(); ++u) unit_parameters(u, visit);
  }
  // Units (nn/units.hpp), in forward order, of what this rank holds: the embedding
  // (token table, the tied LM head when the same rank holds both ends, the position
  // table), the blocks, the final norm, and on a last pipeline stage that does not hold
  // the embedding the LM head's copy of the token table. The whole model: 0 the
  // embedding, 1..L the blocks, L+1 the final norm.
  int num_units() const { return static_cast<int>(units_.size()); }
  template <class Visit>
  void unit_parameters(int unit, Visit&& visit) {
    const Unit& u = units_[static_cast<std::size_t>(unit)];
    switch (u.kind) {
      case UnitKind::embedding:
        table_->parameters(visit);
        if constexpr (kPositionTable) visit(positions_);
        break;
      case UnitKind::block:
        block(u.block).parameters(visit);
        break;
      case UnitKind::norm:
        norm_->parameters(visit);
        break;
      case UnitKind::head:
        head().parameters(visit);
        break;
    }
  }
  void set_unit_hooks(nn::UnitHooks* hooks) { hooks_ = hooks; }

  // The LM head's copy of the token table on a last pipeline stage that does not hold
  // the embedding (one parameter of the serial model held twice: its gradient is summed
  // over the embedding group, and it is counted once in the gradient norm); null
  // otherwise.
  const nn::Parameter<T>* tied_copy() const {
    return tied_ && placement_.last() && !placement_.first() ? &table_->weight() : nullptr;
  }
  // Whether the LM head is the token table (whose copies on the first and last pipeline
  // stage are summed over the embedding group), or a table of its own.
  bool ties_head() const { return tied_; }
  // The token table when this rank holds one (the embedding or the head's copy).
  const nn::Parameter<T>* token_table() const { return table_ ? &table_->weight() : nullptr; }

  nn::ParameterStore<T, Space>& parameter_store() { return store_; }
  nn::TensorParallelGroup tensor_parallel() const { return tp_; }
  const Config& config() const { return cfg_; }
  // The factor on the LM head's logits (Config::output_multiplier(), 1 when it has none).
  Acc output_multiplier() const { return output_multiplier_; }
  // Parameters of the whole model (not this rank's share of a split one): the serial
  // model's count, whatever this rank holds.
  std::int64_t num_parameters() const { return serial_parameters_; }

  // Bytes of activations and activation gradients the model itself holds (its own
  // stash, the scratch, the recomputation buffers); a pipeline executor's stashes are
  // counted by the executor.
  std::size_t activation_bytes() const {
    std::size_t n = own_.bytes() + targets_.bytes() + dres_[0].bytes() + dres_[1].bytes() + scratch_.bytes() +
                    recompute_saved_.bytes() + recompute_out_.bytes() + host_losses_.bytes();
    if (table_) n += table_->activation_bytes();
    if (head_) n += head_->activation_bytes();
    if constexpr (requires(const Block& b) { b.scratch_bytes(); })
      for (const auto& b : blocks_) n += b.scratch_bytes();
    return n;
  }

 private:
  static parallel::LayoutConfig layout_of_grid(comm::Grid<comm::Comm>& grid) {
    parallel::LayoutConfig l;
    l.tp = grid.tp().size();
    l.pp = grid.pp().size();
    return l;
  }
  static pipeline::Placement placement_of(const Config& cfg, comm::Grid<comm::Comm>& grid,
                                          const parallel::LayoutConfig& layout) {
    LLMPAR_CHECK(layout.tp == grid.tp().size() && layout.pp == grid.pp().size(), "the layout is tp ", layout.tp,
                 " x pp ", layout.pp, " but the grid's groups are tp ", grid.tp().size(), " x pp ", grid.pp().size(),
                 "; build the Grid from the layout: comm::Grid(world, {.tp = layout.tp, .pp = layout.pp})");
    return {.stages = layout.pp,
            .chunks = layout.virtual_stages,
            .rank = grid.coords().pp,
            .partition = partition_of(cfg, layout)};
  }

  enum class UnitKind : std::uint8_t { embedding, block, norm, head };
  struct Unit {
    UnitKind kind;
    std::int64_t block = 0;  // local block index
  };

  static Acc output_multiplier_of(const Config& c) {
    if constexpr (requires { c.output_multiplier(); })
      return static_cast<Acc>(c.output_multiplier());
    else
      return Acc(1);
  }
  // rows (rows, C) of the head's input, or of its gradient, times the output multiplier.
  void scale_head_rows(Context& ctx, T* x, std::int64_t rows) {
    if (output_multiplier_ != Acc(1)) Backend::scale_inplace(ctx, x, output_multiplier_, rows * cfg_.dim);
  }

  static pipeline::Placement place(pipeline::Placement p, std::int64_t layers) {
    if (p.partition.bounds.empty() && p.whole()) p = pipeline::Placement::whole_model(layers);
    p.validate(layers);
    return p;
  }
  void number_units() {
    if (placement_.first()) embedding_unit_ = add_unit({UnitKind::embedding});
    block_unit_base_ = static_cast<int>(units_.size());
    for (std::size_t b = 0; b < blocks_.size(); ++b) add_unit({UnitKind::block, static_cast<std::int64_t>(b)});
    if (placement_.last()) {
      norm_unit_ = add_unit({UnitKind::norm});
      head_unit_ = placement_.first() && tied_ ? embedding_unit_ : add_unit({UnitKind::head});
    }
    // The serial model's parameter count, from the shapes of unsplit layers (built
    // only to be counted: a layer allocates nothing until the store binds it).
    auto count = [](auto&& layer) {
      std::int64_t n = 0;
      layer.parameters([&](nn::Parameter<T>& p) { n += p.full_numel(); });
      return n;
    };
    serial_parameters_ =
        count(Embedding(Spec::kTokenTable, cfg_.vocab, cfg_.padded_vocab, cfg_.dim, cfg_.init_std, {})) +
        cfg_.layers * count(Block(std::string(Spec::kBlockPrefix) + "0", cfg_)) +
        count(Spec::template final_norm<T, Backend>(cfg_)) + (kPositionTable ? cfg_.max_seq * cfg_.dim : 0) +
        (tied_ ? 0 : cfg_.padded_vocab * cfg_.dim);
  }
  int add_unit(Unit u) {
    units_.push_back(u);
    return static_cast<int>(units_.size()) - 1;
  }
  int block_unit(std::int64_t local) const { return block_unit_base_ + static_cast<int>(local); }
  Block& block(std::int64_t local) { return blocks_[static_cast<std::size_t>(local)]; }
  std::int64_t blocks_in(int chunk) const {
    return chunk_first_[static_cast<std::size_t>(chunk) + 1] - chunk_first_[static_cast<std::size_t>(chunk)];
  }
  void require_whole(const char* what) const {
    LLMPAR_CHECK(placement_.whole(), what, "() runs the whole model, but this rank holds pipeline stage ",
                 placement_.rank, " of ", placement_.stages, "; run the pipeline's schedule (pipeline::Executor)");
  }
  // st for a micro-batch of (batch, seq) tokens: its seq is this rank's rows of each.
  void prepare(Stash& st, int chunk, std::int64_t batch, std::int64_t seq) {
    LLMPAR_CHECK(chunk >= 0 && chunk < placement_.chunks, "chunk ", chunk, " is not one of this rank's ",
                 placement_.chunks);
    st.chunk = chunk;
    st.batch = batch;
    st.seq = cp_.local(seq);
    const std::int64_t n = blocks_in(chunk);
    st.residual.reserve((n + 1) * activation_size(batch, seq));
    if (recompute_ != recompute::Mode::full)
      st.blocks.resize(static_cast<std::size_t>(n));
    else
      st.blocks.clear();
  }
  // The LM head's table: the untied head's, or the token table (last stage).
  Embedding& head() { return tied_ ? *table_ : *head_; }
  const Embedding& head() const { return tied_ ? *table_ : *head_; }
  static bool ties_head_of(const Config& c) {
    if constexpr (kHeadTable == nullptr)
      return true;
    else if constexpr (requires { c.tie_embeddings; })
      return c.tie_embeddings;
    else
      return false;
  }
  T* residual(Stash& st, std::int64_t i) { return st.residual.data() + i * local_activation_size(st.batch, st.seq); }
  // (Rl, C) of micro-batches of `batch` sequences of which this rank holds `seq` rows.
  std::int64_t local_activation_size(std::int64_t batch, std::int64_t seq) const {
    return tp_.local_rows(batch * seq) * cfg_.dim;
  }
  static nn::ContextParallelGroup context_parallel_of(comm::Grid<comm::Comm>& grid,
                                                      const parallel::LayoutConfig& layout) {
    LLMPAR_CHECK(layout.cp == grid.cp().size(), "the layout is cp ", layout.cp, " but the grid's cp group has ",
                 grid.cp().size(), " ranks; build the Grid from the layout (.cp = layout.cp)");
    return nn::ContextParallelGroup(&grid.cp(), layout.cp_comm);
  }
  // buffer (batch, seq / cp) = this rank's chunks of ids (batch, seq); returns it.
  const std::int32_t* take_chunks(std::vector<std::int32_t>& buffer, const std::int32_t* ids, std::int64_t batch,
                                  std::int64_t seq) const {
    if (ids == nullptr) return nullptr;
    buffer.resize(static_cast<std::size_t>(batch * cp_.local(seq)));
    cp_.take_chunks(buffer.data(), ids, batch, seq);
    return buffer.data();
  }
  // The position table's rows of this rank's `seq` rows per sequence: the table itself,
  // or under context parallelism its rows at this rank's two chunks; null without one.
  const T* position_rows(Context& ctx, std::int64_t seq) {
    if constexpr (kPositionTable) {
      if (!cp_.split()) return positions_.value;
      const ChunkPositions at = cp_.positions(seq * cp_.size());
      const std::int64_t C = cfg_.dim;
      cp_positions_.reserve(seq * C);
      Backend::copy(ctx, cp_positions_.data(), positions_.value + at.first * C, at.chunk * C);
      Backend::copy(ctx, cp_positions_.data() + at.chunk * C, positions_.value + at.second * C, at.chunk * C);
      return cp_positions_.data();
    } else {
      static_cast<void>(ctx), static_cast<void>(seq);
      return nullptr;
    }
  }
  // Where the embedding's backward adds the position rows' gradients: the table's, or
  // under context parallelism a buffer of this rank's rows (add_position_grads adds them).
  Acc* position_grads(Context& ctx, std::int64_t seq) {
    if constexpr (kPositionTable) {
      if (!cp_.split()) return positions_.grad;
      cp_position_grads_.reserve(seq * cfg_.dim);
      Backend::zero(ctx, cp_position_grads_.data(), seq * cfg_.dim);
      return cp_position_grads_.data();
    } else {
      static_cast<void>(ctx), static_cast<void>(seq);
      return nullptr;
    }
  }
  void add_position_grads(Context& ctx, std::int64_t seq) {
    const ChunkPositions at = cp_.positions(seq * cp_.size());
    const std::int64_t C = cfg_.dim;
    Backend::add_inplace(ctx, positions_.grad + at.first * C, cp_position_grads_.data(), at.chunk * C);
    Backend::add_inplace(ctx, positions_.grad + at.second * C, cp_position_grads_.data() + at.chunk * C, at.chunk * C);
  }

  void check_ids(const std::int32_t* ids, std::int64_t rows, const char* what) const {
    for (std::int64_t i = 0; i < rows; ++i)
      LLMPAR_CHECK(ids[i] >= 0 && ids[i] < cfg_.vocab, what, " id ", ids[i], " at position ", i,
                   " is outside the vocabulary [0, ", cfg_.vocab, ")");
  }

  // The mean of the per-token losses, summed on the host in position order (the same
  // order on every backend).
  Acc mean_loss(Context& ctx, const Acc* losses, std::int64_t rows) {
    host_losses_.reserve(rows);
    Backend::download(ctx, host_losses_.data(), losses, rows);
    Acc sum = 0;
    for (std::int64_t i = 0; i < rows; ++i) sum += host_losses_[i];
    return sum / static_cast<Acc>(rows);
  }

  Config cfg_;
  bool tied_;  // the LM head is the token table
  nn::TensorParallelGroup tp_;
  nn::ContextParallelGroup cp_;
  std::vector<std::int32_t> cp_tokens_, cp_targets_;  // (B, S / cp) this rank's chunks
  Buffer<T, Space> cp_positions_;                     // (S / cp, C) the position rows of those chunks
  Buffer<Acc, Space> cp_position_grads_;              // (S / cp, C) their gradients
  pipeline::Placement placement_;
  Acc output_multiplier_;                  // on the LM head's logits (µP: 1 / width multiplier)
  std::optional<Embedding> table_;         // (Vp, C) split by rows; also a tied LM head (first or last stage)
  std::optional<Embedding> head_;          // (Vp, C) an untied LM head (last stage)
  nn::Parameter<T> positions_;             // (max_seq, C) when Spec has a position table (first stage)
  std::vector<Block> blocks_;              // this rank's, chunk by chunk
  std::vector<std::int64_t> chunk_first_;  // chunk c holds blocks_[chunk_first_[c], chunk_first_[c+1])
  std::optional<Norm> norm_;               // the final norm (last stage)
  std::vector<Unit> units_;
  int embedding_unit_ = -1, block_unit_base_ = 0, norm_unit_ = -1, head_unit_ = -1;
  std::int64_t serial_parameters_ = 0;
  nn::ParameterStore<T, Space> store_;
  nn::UnitHooks* hooks_ = nullptr;
  recompute::Mode recompute_ = recompute::Mode::none;

  Stash own_;                              // the whole model's forward()/backward()
  Buffer<std::int32_t, Space> targets_;    // (B, S) the last stage's loss
  Buffer<Acc> host_losses_;                // (B, S) on the host
  Buffer<T, Space> dres_[2];               // (Rl, C) ping-pong residual gradients
  typename Block::Saved recompute_saved_;  // full recomputation: the one block's Saved being rebuilt
  Buffer<T, Space> recompute_out_;         // (Rl, C) its (discarded) output
  detail::BlockScratch<T, Space> scratch_;
};

// A model: the Transformer of Spec's blocks over storage type X and BackendArg, or of a
// composed policy X (detail::ModelTypes), which it keeps as its Policy for the Trainer.
template <class X, class BackendArg, class Spec>
class Transformer : public TransformerCore<typename detail::ModelTypes<X, BackendArg>::T,
                                           typename detail::ModelTypes<X, BackendArg>::Backend, Spec> {
 public:
  using Core = TransformerCore<typename detail::ModelTypes<X, BackendArg>::T,
                               typename detail::ModelTypes<X, BackendArg>::Backend, Spec>;
  // The composed policy the model was declared with (void when declared by storage type).
  using Policy = typename detail::ModelTypes<X, BackendArg>::Policy;
  using Core::Core;
};

}  // namespace llmpar::models
