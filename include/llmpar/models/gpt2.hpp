// llmpar/models/gpt2.hpp — GPT-2: learned positions, pre-LayerNorm blocks, GELU-tanh
// MLP, weight-tied LM head. Explicit forward and backward per layer, no tape.
//
// GPT2Block is the block; models::GPT2 is the Transformer (models/transformer.hpp, which
// says how the model around the blocks is built) of those blocks with GPT2Spec.
//  - The element type is a template parameter: float trains; double exists so that the
//    whole model's gradient is checked against finite differences in the tests.
//  - Under tensor parallelism a block splits its heads (q, k, v of heads/tp heads per
//    rank, the output projection row-parallel) and its MLP width (c_fc column-parallel,
//    c_proj row-parallel); with sequence parallelism its LayerNorms and residual adds
//    hold this rank's rows.
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
#include "llmpar/models/transformer.hpp"
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
  // parallel::GradSync). dx, dout, x: this rank's rows.
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

// What makes the Transformer GPT-2: its block, a final LayerNorm, a learned position
// table, and GPT-2's parameter names (initial values are drawn per name).
struct GPT2Spec {
  using Config = GPT2Config;
  template <class T, class Backend>
  using Block = GPT2Block<T, Backend>;
  template <class T, class Backend>
  using Norm = nn::LayerNorm<T, Backend>;
  static constexpr const char* kTokenTable = "wte";
  static constexpr const char* kPositionTable = "wpe";
  static constexpr const char* kBlockPrefix = "h.";
  template <class T, class Backend>
  static nn::LayerNorm<T, Backend> final_norm(const GPT2Config& cfg) {
    return nn::LayerNorm<T, Backend>("ln_f", cfg.dim);
  }
};

// GPT-2: the Transformer of GPT2Blocks (models/transformer.hpp).
template <class T, class Backend = backend::Cpu>
using GPT2 = Transformer<T, Backend, GPT2Spec>;

}  // namespace llmpar::models
