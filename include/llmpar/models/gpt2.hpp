// llmpar/models/gpt2.hpp — GPT-2: learned positions, pre-LayerNorm blocks, GELU-tanh
// MLP, weight-tied LM head. Explicit forward and backward per layer, no tape.
//
// Why it is built this way:
//  - Each block owns the activations its backward needs (llm.c style) and a model-owned
//    scratch holds the gradients that are dead once a block's backward returns, so the
//    memory a step needs is visible in one place and a recompute policy can later drop
//    a block's activations without touching the others.
//  - Parameters are reached only through parameters(visit); the model binds them into a
//    flat ParameterStore and initialises them from (seed, name, index), so any future
//    split over ranks starts from exactly these weights.
//  - The element type is a template parameter: float trains; double exists so that the
//    whole model's gradient is checked against finite differences in the tests.
//  - The backend is a policy tag (backend/backend.hpp): the same source runs on the CPU
//    (backend::Cpu, the default) and on a GPU (backend::Cuda), with every tensor in the
//    backend's memory and every kernel the backend's. Inputs arrive on the host and are
//    checked there before they are copied in.
//  - The vocabulary is padded (50257 -> 50304) so the LM-head GEMM has aligned rows;
//    padded logits never enter the loss and get zero gradient.
//  - Under tensor parallelism (a TensorParallelGroup of tp ranks) the blocks split their
//    heads and MLP width, and the token table, the tied LM head and the loss split the
//    vocabulary (nn::VocabParallelEmbedding): no rank ever holds the (B·S, Vp) logits.
//    With sequence parallelism the LayerNorm and residual regions hold B·S/tp rows.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "llmpar/backend/backend.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/nn/layernorm.hpp"
#include "llmpar/nn/linear.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/nn/vocab_parallel.hpp"

namespace llmpar::models {

struct GPT2Config {
  std::int64_t layers = 12;
  std::int64_t heads = 12;
  std::int64_t dim = 768;
  std::int64_t max_seq = 1024;        // rows of the position table; the longest sequence
  std::int64_t vocab = 50257;         // real vocabulary
  std::int64_t padded_vocab = 50304;  // rows of the token table, >= vocab
  float init_std = 0.02f;

  // Named presets: "gpt2-tiny" (byte vocabulary, trains in a minute on a laptop core),
  // "gpt2-124m" (the GPT-2 small of Radford et al.).
  static GPT2Config preset(std::string_view name) {
    if (name == "gpt2-tiny")
      return {.layers = 4, .heads = 4, .dim = 128, .max_seq = 64, .vocab = 256, .padded_vocab = 256};
    if (name == "gpt2-124m") return {};
    LLMPAR_FAIL("unknown model preset '", name,
                "'; use gpt2-tiny or gpt2-124m, or give --layers --heads --dim --seq --vocab");
  }

  // The token table padded to a multiple of 128 rows.
  static std::int64_t pad_vocab(std::int64_t v) { return (v + 127) / 128 * 128; }

  void validate() const {
    LLMPAR_CHECK(layers > 0, "layers is ", layers, "; a GPT needs at least 1 layer");
    LLMPAR_CHECK(heads > 0, "heads is ", heads, "; use at least 1 attention head");
    LLMPAR_CHECK(dim > 0 && dim % heads == 0, "dim ", dim, " is not divisible by heads ", heads,
                 "; choose dim as a multiple of heads (e.g. ", heads * std::max<std::int64_t>(1, dim / heads), ")");
    LLMPAR_CHECK(max_seq > 0, "seq is ", max_seq, "; the sequence length must be positive");
    LLMPAR_CHECK(vocab > 0 && vocab <= 65536, "vocab is ", vocab,
                 "; it must be in [1, 65536] (tokens are stored as uint16)");
    LLMPAR_CHECK(padded_vocab >= vocab, "padded_vocab ", padded_vocab, " is smaller than vocab ", vocab);
  }

  // Parameters: token and position tables, 12·C² + 13·C per block, the final norm.
  std::int64_t num_parameters() const {
    return padded_vocab * dim + max_seq * dim + layers * (12 * dim * dim + 13 * dim) + 2 * dim;
  }
};

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

// One pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(·)).
template <class T, class Backend = backend::Cpu>
class GPT2Block {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;

  // tp: the tensor-parallel group the block is split over (default: none). Attention
  // splits its heads (q, k, v of heads/tp heads per rank; c_proj row-parallel), the MLP
  // its hidden size (c_fc column-parallel, c_proj row-parallel); the LayerNorms and the
  // residual stream are whole on every rank.
  GPT2Block(const std::string& name, const GPT2Config& cfg, nn::TensorParallelGroup tp = {})
      : tp_(tp),
        dim_(cfg.dim),
        heads_((tp.check_divides(cfg.heads, "heads"), cfg.heads / tp.size())),
        local_dim_(cfg.dim / tp.size()),
        ln1_(name + ".ln_1", cfg.dim),
        qkv_(name + ".attn.c_attn", cfg.dim, 3 * cfg.dim, true, cfg.init_std, tp, 3),
        proj_(name + ".attn.c_proj", cfg.dim, cfg.dim, true,
              cfg.init_std / std::sqrt(2.0f * static_cast<float>(cfg.layers)), tp),
        ln2_(name + ".ln_2", cfg.dim),
        fc_(name + ".mlp.c_fc", cfg.dim, 4 * cfg.dim, true, cfg.init_std, tp),
        fc_proj_(name + ".mlp.c_proj", 4 * cfg.dim, cfg.dim, true,
                 cfg.init_std / std::sqrt(2.0f * static_cast<float>(cfg.layers)), tp) {
    // Under sequence parallelism each rank normalises its rows only: the LayerNorms'
    // gradients are partial sums, summed over the group once per step.
    nn::mark_sequence_parallel<T>(ln1_, tp);
    nn::mark_sequence_parallel<T>(ln2_, tp);
  }

  // The scratch the forward uses to gather rows under sequence parallelism (the model
  // shares its own; a block alone uses one it owns).
  void use_scratch(detail::BlockScratch<T, Space>* scratch) { shared_ = scratch; }

  // out (B, S, C) = block(x (B, S, C)); keeps what backward needs. Under sequence
  // parallelism x and out are this rank's rows of (B·S, C) (tp_.local_rows).
  void forward(Context& ctx, T* out, const T* x, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_;
    const bool sp = tp_.sequence_parallel();
    detail::BlockScratch<T, Space>& s = scratch();
    reserve(batch, seq);
    s.reserve(rows, C, sp);
    ln1_.forward(ctx, ln1_out_.data(), x, local);
    sync(ctx);
    qkv_.forward(ctx, qkv_out_.data(), tp_.gather_rows(s.gathered.data(), ln1_out_.data(), rows, C), rows);
    Backend::attention_forward(ctx, att_out_.data(), lse_.data(), qkv_out_.data(), batch, seq, local_dim_, heads_);
    T* attn_partial = sp ? s.partial.data() : x_mid_.data();
    proj_.forward_partial(ctx, attn_partial, att_out_.data(), rows);
    tp_.reduce_rows(x_mid_.data(), attn_partial, rows, C);  // "g"
    Backend::add_inplace(ctx, x_mid_.data(), x, local * C);
    ln2_.forward(ctx, ln2_out_.data(), x_mid_.data(), local);
    sync(ctx);
    fc_.forward_gelu(ctx, gelu_out_.data(), fc_out_.data(), tp_.gather_rows(s.gathered.data(), ln2_out_.data(), rows, C),
                     rows);
    T* mlp_partial = sp ? s.partial.data() : out;
    fc_proj_.forward_partial(ctx, mlp_partial, gelu_out_.data(), rows);
    tp_.reduce_rows(out, mlp_partial, rows, C);  // "g"
    Backend::add_inplace(ctx, out, x_mid_.data(), local * C);
  }

  // dx (B, S, C) = ∂loss/∂x given dout = ∂loss/∂out; parameter gradients accumulate
  // (under sequence parallelism, the LayerNorms' only over this rank's rows: see
  // nn::sum_sequence_parallel_gradients). dx, dout, x: this rank's rows.
  void backward(Context& ctx, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq,
                detail::BlockScratch<T, Space>& s) {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_;
    const bool sp = tp_.sequence_parallel();
    s.reserve(rows, C, sp);
    sync(ctx);
    // MLP. The row-parallel layer sees every row of dout ("g" backward).
    const T* dy = tp_.gather_rows(s.gathered.data(), dout, rows, C);
    fc_proj_.backward_through_gelu(ctx, s.wide0.data(), dy, gelu_out_.data(), fc_out_.data(), rows);
    sync(ctx);
    T* dln2 = sp ? s.partial.data() : s.c0.data();
    fc_.backward_partial(ctx, dln2, s.wide0.data(), tp_.gather_rows(s.gathered.data(), ln2_out_.data(), rows, C),
                         rows);
    tp_.reduce_rows(s.c0.data(), dln2, rows, C);  // "f" backward
    T* dx_mid = s.c1.data();
    ln2_.backward(ctx, dx_mid, s.c0.data(), x_mid_.data(), local);
    Backend::add_inplace(ctx, dx_mid, dout, local * C);  // the residual path
    sync(ctx);
    // Attention.
    proj_.backward(ctx, s.c0.data(), tp_.gather_rows(s.gathered.data(), dx_mid, rows, C), att_out_.data(), rows);
    Backend::attention_backward(ctx, s.qkv.data(), s.c0.data(), qkv_out_.data(), att_out_.data(), lse_.data(), batch,
                                seq, local_dim_, heads_);
    T* dln1 = sp ? s.partial.data() : s.c0.data();
    qkv_.backward_partial(ctx, dln1, s.qkv.data(), tp_.gather_rows(s.gathered.data(), ln1_out_.data(), rows, C),
                          rows);
    tp_.reduce_rows(s.c0.data(), dln1, rows, C);  // "f" backward
    ln1_.backward(ctx, dx, s.c0.data(), x, local);
    Backend::add_inplace(ctx, dx, dx_mid, local * C);  // the residual path
  }

  // The Layer concept's backward (nn/layer.hpp): the same, with a scratch this block
  // owns, allocated on first use; GPT2 itself passes its shared scratch to the overload
  // above.
  void backward(Context& ctx, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq) {
    backward(ctx, dx, dout, x, batch, seq, scratch());
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    ln1_.parameters(visit);
    qkv_.parameters(visit);
    proj_.parameters(visit);
    ln2_.parameters(visit);
    fc_.parameters(visit);
    fc_proj_.parameters(visit);
  }

  std::size_t activation_bytes() const {
    return ln1_out_.bytes() + qkv_out_.bytes() + att_out_.bytes() + lse_.bytes() + x_mid_.bytes() + ln2_out_.bytes() +
           fc_out_.bytes() + gelu_out_.bytes() + ln1_.activation_bytes() + ln2_.activation_bytes();
  }

 private:
  detail::BlockScratch<T, Space>& scratch() { return shared_ != nullptr ? *shared_ : own_scratch_; }
  // Host-side communication reads what the kernels wrote: wait for them first.
  void sync(Context& ctx) const {
    if (tp_.split()) Backend::synchronize(ctx);
  }

  void reserve(std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_, Cl = local_dim_;
    ln1_out_.reserve(local * C);
    qkv_out_.reserve(rows * 3 * Cl);
    att_out_.reserve(rows * Cl);
    lse_.reserve(batch * heads_ * seq);
    x_mid_.reserve(local * C);
    ln2_out_.reserve(local * C);
    fc_out_.reserve(rows * 4 * Cl);
    gelu_out_.reserve(rows * 4 * Cl);
  }

  nn::TensorParallelGroup tp_;
  std::int64_t dim_;
  std::int64_t heads_;      // this rank's heads: NH / tp
  std::int64_t local_dim_;  // this rank's attention channels and a quarter of its MLP width: C / tp
  nn::LayerNorm<T, Backend> ln1_;
  nn::ColumnParallelLinear<T, Backend> qkv_;
  nn::RowParallelLinear<T, Backend> proj_;
  nn::LayerNorm<T, Backend> ln2_;
  nn::ColumnParallelLinear<T, Backend> fc_;
  nn::RowParallelLinear<T, Backend> fc_proj_;
  // Activations kept for backward (Cl = C / tp; Rl = B·S, or B·S / tp under sequence
  // parallelism).
  Buffer<T, Space> ln1_out_;   // (Rl, C)
  Buffer<T, Space> qkv_out_;   // (B, S, 3Cl)
  Buffer<T, Space> att_out_;   // (B, S, Cl)
  Buffer<Acc, Space> lse_;     // (B, NH/tp, S)
  Buffer<T, Space> x_mid_;     // (Rl, C)  residual after attention
  Buffer<T, Space> ln2_out_;   // (Rl, C)
  Buffer<T, Space> fc_out_;    // (B, S, 4Cl)
  Buffer<T, Space> gelu_out_;  // (B, S, 4Cl)
  detail::BlockScratch<T, Space> own_scratch_;        // a block used alone
  detail::BlockScratch<T, Space>* shared_ = nullptr;  // the model's, when it set one
};

template <class T, class Backend = backend::Cpu>
class GPT2 {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using BackendTag = Backend;

  // tp: the tensor-parallel group the model is split over (default: none): the blocks
  // split heads and MLP width, the token table, LM head and loss the vocabulary; the
  // position table and the final LayerNorm are whole on every rank.
  GPT2(const GPT2Config& cfg, std::uint64_t seed, nn::TensorParallelGroup tp = {})
      : cfg_(cfg),
        tp_(tp),
        wte_((cfg.validate(), "wte"), cfg.vocab, cfg.padded_vocab, cfg.dim, cfg.init_std, tp),
        wpe_("wpe", {cfg.max_seq, cfg.dim}, nn::Init::normal(0.01f), true),
        lnf_("ln_f", cfg.dim) {
    blocks_.reserve(static_cast<std::size_t>(cfg.layers));
    for (std::int64_t l = 0; l < cfg.layers; ++l) blocks_.emplace_back("h." + std::to_string(l), cfg, tp);
    for (auto& block : blocks_) block.use_scratch(&scratch_);
    wte_.use_scratch(&scratch_.partial, &scratch_.gathered);
    nn::mark_sequence_parallel<T>(lnf_, tp);
    store_.bind(*this);
    store_.initialize(seed);
    // Padded token rows are never looked up and never produce a logit that matters:
    // keep them at zero so they cannot perturb anything.
    wte_.zero_padding();
  }
  GPT2(const GPT2&) = delete;
  GPT2& operator=(const GPT2&) = delete;

  // Training forward: returns the mean loss over B·S tokens and leaves ∂loss/∂logits
  // (times loss_scale, for gradient accumulation) ready for backward().
  Acc forward(Context& ctx, const std::int32_t* tokens, const std::int32_t* targets, std::int64_t batch,
              std::int64_t seq, Acc loss_scale = Acc(1)) {
    compute_logits(ctx, tokens, batch, seq);
    const std::int64_t rows = batch * seq;
    copy_targets(ctx, targets, rows);
    wte_.loss(ctx, losses_.data(), logits_.data(), targets_.data(), rows, loss_scale / static_cast<Acc>(rows));
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
    scratch_.reserve(rows, C, tp_.sequence_parallel());
    dres_[0].reserve(local * C);
    dres_[1].reserve(local * C);
    // LM head, tied to wte: this rank's vocabulary columns, dlnf summed over the group.
    T* dlnf = scratch_.c0.data();  // (Rl, C)
    wte_.head_backward(ctx, dlnf, logits_.data(), lnf_out_.data(), rows);
    lnf_.backward(ctx, dres_[0].data(), dlnf, residual(L), local);
    for (std::int64_t l = L - 1; l >= 0; --l) {
      T* dout = dres_[(L - 1 - l) % 2].data();
      T* dx = dres_[(L - l) % 2].data();
      blocks_[static_cast<std::size_t>(l)].backward(ctx, dx, dout, residual(l), batch, seq, scratch_);
    }
    wte_.backward(ctx, dres_[L % 2].data(), tokens_.data(), batch, seq, wpe_.grad);
  }

  // Mean loss without touching any gradient state.
  Acc evaluate(Context& ctx, const std::int32_t* tokens, const std::int32_t* targets, std::int64_t batch,
               std::int64_t seq) {
    compute_logits(ctx, tokens, batch, seq);
    backward_ready_ = false;
    copy_targets(ctx, targets, batch * seq);
    wte_.loss(ctx, losses_.data(), logits_.data(), targets_.data(), batch * seq, std::nullopt);
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
    wte_.download_row(ctx, host_row, local + row * wte_.slice().count);
  }
  RowSlice vocab_slice() const { return wte_.slice(); }

  void zero_grad() { store_.zero_grad(); }

  template <class Visit>
  void parameters(Visit&& visit) {
    wte_.parameters(visit);
    visit(wpe_);
    for (auto& block : blocks_) block.parameters(visit);
    lnf_.parameters(visit);
  }

  nn::ParameterStore<T, Space>& parameter_store() { return store_; }
  nn::TensorParallelGroup tensor_parallel() const { return tp_; }
  const GPT2Config& config() const { return cfg_; }
  // Parameters of the whole model (not this rank's share of a split one).
  std::int64_t num_parameters() const { return store_.full_numel(); }

  // Bytes of activations and activation gradients currently allocated.
  std::size_t activation_bytes() const {
    std::size_t n = residual_.bytes() + lnf_out_.bytes() + lnf_local_.bytes() + logits_.bytes() + losses_.bytes() +
                    dres_[0].bytes() + dres_[1].bytes() + scratch_.bytes() + lnf_.activation_bytes() +
                    wte_.activation_bytes();
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
    lnf_out_.reserve(rows * C);
    logits_.reserve(rows * wte_.slice().count);
    losses_.reserve(rows);
    wte_.forward(ctx, residual(0), tokens_.data(), batch, seq, wpe_.value);
    for (std::int64_t l = 0; l < L; ++l)
      blocks_[static_cast<std::size_t>(l)].forward(ctx, residual(l + 1), residual(l), batch, seq);
    if (tp_.sequence_parallel()) {
      // The final norm on this rank's rows, then every row gathered for the LM head.
      lnf_local_.reserve(local * C);
      lnf_.forward(ctx, lnf_local_.data(), residual(L), local);
      Backend::synchronize(ctx);
      tp_.gather_rows(lnf_out_.data(), lnf_local_.data(), rows, C);
    } else {
      lnf_.forward(ctx, lnf_out_.data(), residual(L), rows);
    }
    wte_.head_forward(ctx, logits_.data(), lnf_out_.data(), rows);
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

  GPT2Config cfg_;
  nn::TensorParallelGroup tp_;
  nn::VocabParallelEmbedding<T, Backend> wte_;  // (Vp, C) split by rows; also the LM head
  nn::Parameter<T> wpe_;                        // (max_seq, C)
  std::vector<GPT2Block<T, Backend>> blocks_;
  nn::LayerNorm<T, Backend> lnf_;
  nn::ParameterStore<T, Space> store_;

  std::int64_t batch_ = 0, seq_ = 0;
  bool backward_ready_ = false;
  Buffer<std::int32_t, Space> tokens_;   // (B, S)
  Buffer<std::int32_t, Space> targets_;  // (B, S)
  Buffer<T, Space> residual_;            // (L+1, Rl, C): the input of every block, and the last output
                                         // (Rl = B·S, or this rank's B·S/tp under sequence parallelism)
  Buffer<T, Space> lnf_out_;             // (B, S, C)
  Buffer<T, Space> lnf_local_;           // (Rl, C) sequence parallelism only: this rank's normed rows
  Buffer<T, Space> logits_;              // (B, S, Vp/tp); holds ∂loss/∂logits after a training forward
  Buffer<Acc, Space> losses_;            // (B, S)
  Buffer<Acc> host_losses_;              // (B, S) on the host
  Buffer<T, Space> dres_[2];             // (B, S, C) ping-pong residual gradients
  detail::BlockScratch<T, Space> scratch_;
};

}  // namespace llmpar::models
