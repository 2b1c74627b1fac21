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
//  - µP (GPT2Config::mup) is three numbers the parts already take: the hidden matrices'
//    init std and learning-rate scale (nn::Parameter::lr_scale), set by the block, and
//    the factor on the tied head's logits (GPT2Config::output_multiplier, applied by the
//    Transformer). Nothing else of the model changes, so at the base width it is the
//    standard model bit for bit.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "llmpar/backend/backend.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/models/transformer.hpp"
#include "llmpar/nn/layernorm.hpp"
#include "llmpar/nn/linear.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/nn/vocab_parallel.hpp"
#include "llmpar/pipeline/partition.hpp"

namespace llmpar::models {

struct GPT2Config {
  std::int64_t layers = 12;
  std::int64_t heads = 12;
  std::int64_t dim = 768;
  std::int64_t max_seq = 1024;        // rows of the position table; the longest sequence
  std::int64_t vocab = 50257;         // real vocabulary
  std::int64_t padded_vocab = 50304;  // rows of the token table, >= vocab
  float init_std = 0.02f;
  // µP (Yang et al. 2022, "Tensor Programs V", the Adam variant of its Table 3; the
  // `mup` package's MuAdamW with decoupled_wd=True and a MuSharedReadout for the tied
  // head): hyper-parameters tuned at width mup_base_dim transfer to any dim. With the
  // width multiplier m = dim / mup_base_dim:
  //  - hidden matrices (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj weights): init
  //    std init_std / sqrt(m) (the residual projections keep their extra
  //    1 / sqrt(2 layers)), learning rate lr / m, the decoupled weight decay (lr wd p)
  //    scaling with it;
  //  - embeddings (wte, wpe), biases, LayerNorm gains and biases: as without µP;
  //  - the logits of the head tied to wte times 1 / m (the output multiplier of a shared
  //    readout; the Transformer scales the head's input rows, and their gradient);
  //  - attention keeps its 1 / sqrt(d_head) scale. µP's 1 / d_head is for a head
  //    dimension that grows with width; grow width by adding heads at a fixed d_head
  //    (--heads with --dim) and the two differ by a constant that tuning at the base
  //    width has absorbed. (Growing d_head instead is outside what µP transfers here.)
  // At dim == mup_base_dim every rule is the identity: the model, its losses and its
  // gradients are the standard model's bit for bit.
  bool mup = false;
  std::int64_t mup_base_dim = 128;  // the width at which µP is the standard parametrisation

  // Named presets: "gpt2-tiny" (byte vocabulary, trains in a minute on a laptop core),
  // and the four GPT-2 sizes of Radford et al. (2019): "gpt2-124m", "gpt2-350m",
  // "gpt2-774m", "gpt2-1.5b" (the 1.5B model has 25 heads: tp 1, 5 or 25).
  static GPT2Config preset(std::string_view name) {
    if (name == "gpt2-tiny")
      return {.layers = 4, .heads = 4, .dim = 128, .max_seq = 64, .vocab = 256, .padded_vocab = 256};
    if (name == "gpt2-124m") return {};
    if (name == "gpt2-350m") return {.layers = 24, .heads = 16, .dim = 1024};
    if (name == "gpt2-774m") return {.layers = 36, .heads = 20, .dim = 1280};
    if (name == "gpt2-1.5b") return {.layers = 48, .heads = 25, .dim = 1600};
    LLMPAR_FAIL("unknown model preset '", name,
                "'; use gpt2-tiny, gpt2-124m, gpt2-350m, gpt2-774m or gpt2-1.5b, or give --layers --heads --dim --seq "
                "--vocab");
  }

  // The (in, out) sizes of the linear layers one of `tp` tensor-parallel ranks holds:
  // a block's qkv, attention projection, MLP up and down projections, and the tied head.
  // A step's GEMM shapes are their forward, input- and weight-gradient products.
  std::array<std::pair<std::int64_t, std::int64_t>, 5> linear_sizes(int tp = 1) const {
    const std::int64_t C = dim;
    return {{{C, 3 * C / tp}, {C / tp, C}, {C, 4 * C / tp}, {4 * C / tp, C}, {C, padded_vocab / tp}}};
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
    LLMPAR_CHECK(std::isfinite(init_std) && init_std > 0.0f, "init_std (--init-std) is ", init_std,
                 "; give a positive standard deviation (GPT-2's is 0.02)");
    LLMPAR_CHECK(!mup || mup_base_dim > 0, "mup_base_dim (--mup-base-dim) is ", mup_base_dim,
                 "; µP needs a positive base width, the width at which it equals the standard parametrisation "
                 "(e.g. 128, or the --dim the hyper-parameters were tuned at)");
  }

  // The init std that keeps GPT-2's 0.02 in proportion at every width: sqrt(2 / (5·dim))
  // (Nguyen & Salazar 2019's "small init", GPT-NeoX's and Pythia's), 0.0228 at GPT-2's
  // 768 channels and 0.091 at 48. A fixed 0.02 starts a narrow model with attention
  // logits near zero, a saddle its attention leaves late and at a seed's whim: measured on
  // 103k parameters (3 layers x 48 channels, 2M bytes), 0.02 trained to 2.16 with four
  // seeds 6% apart, 0.1 to 1.91 with them 0.5% apart (docs/scaling.md).
  static float small_init_std(std::int64_t dim) {
    return static_cast<float>(std::sqrt(0.4 / static_cast<double>(dim)));
  }

  // µP's width multiplier dim / mup_base_dim (1 without µP).
  double width_mult() const { return mup ? static_cast<double>(dim) / static_cast<double>(mup_base_dim) : 1.0; }
  // The factor on the LM head's logits: µP's output multiplier 1 / width_mult (1 without).
  double output_multiplier() const { return 1.0 / width_mult(); }
  // The init std of the hidden matrices (before the residual projections' 1 / sqrt(2
  // layers)) and their learning-rate scale: init_std / sqrt(width_mult) and
  // 1 / width_mult under µP; init_std and 1 without.
  float hidden_init_std() const { return mup ? static_cast<float>(init_std / std::sqrt(width_mult())) : init_std; }
  float hidden_lr_scale() const { return mup ? static_cast<float>(1.0 / width_mult()) : 1.0f; }

  // Parameters: token and position tables, 12·C² + 13·C per block, the final norm.
  // (The planner and the pipeline partition count them here, nowhere else.)
  std::int64_t block_parameters() const { return 12 * dim * dim + 13 * dim; }
  std::int64_t embedding_parameters() const { return padded_vocab * dim + max_seq * dim; }  // wte, wpe
  std::int64_t head_parameters() const { return padded_vocab * dim + 2 * dim; }  // ln_f, and the head tied to wte
  std::int64_t num_parameters() const { return embedding_parameters() + layers * block_parameters() + 2 * dim; }
};

// One pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(·)).
template <class T, class Backend = backend::Cpu>
class GPT2Block {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Norm = nn::LayerNorm<T, Backend>;

  // What forward keeps for backward, one per micro-batch in flight (nn/layer.hpp). Cl =
  // C / tp; Rl = B·S, or B·S / tp under sequence parallelism. Under selective
  // recomputation att_out and lse stay empty: they live in the scratch and are
  // recomputed from qkv_out before backward.
  struct Saved {
    typename Norm::Saved ln1, ln2;
    Buffer<T, Space> ln1_out;   // (Rl, C)
    Buffer<T, Space> qkv_out;   // (B, S, 3Cl)
    Buffer<T, Space> att_out;   // (B, S, Cl)
    Buffer<Acc, Space> lse;     // (B, NH/tp, S)
    Buffer<T, Space> x_mid;     // (Rl, C)  residual after attention
    Buffer<T, Space> ln2_out;   // (Rl, C)
    Buffer<T, Space> fc_out;    // (B, S, 4Cl)
    Buffer<T, Space> gelu_out;  // (B, S, 4Cl)
    std::size_t bytes() const {
      return ln1.bytes() + ln2.bytes() + ln1_out.bytes() + qkv_out.bytes() + att_out.bytes() + lse.bytes() +
             x_mid.bytes() + ln2_out.bytes() + fc_out.bytes() + gelu_out.bytes();
    }
  };

  // tp: the tensor-parallel group the block is split over (default: none). Attention
  // splits its heads (q, k, v of heads/tp heads per rank; c_proj row-parallel), the MLP
  // its hidden size (c_fc column-parallel, c_proj row-parallel); the LayerNorms and the
  // residual stream are whole on every rank.
  // Under µP (cfg.mup) the four matrices start at cfg.hidden_init_std() and train at
  // cfg.hidden_lr_scale() times the learning rate; their biases are untouched.
  GPT2Block(const std::string& name, const GPT2Config& cfg, nn::TensorParallelGroup tp = {})
      : tp_(tp),
        dim_(cfg.dim),
        heads_((tp.check_divides(cfg.heads, "heads"), cfg.heads / tp.size())),
        local_dim_(cfg.dim / tp.size()),
        ln1_(name + ".ln_1", cfg.dim),
        qkv_(name + ".attn.c_attn", cfg.dim, 3 * cfg.dim, true, cfg.hidden_init_std(), tp, 3),
        proj_(name + ".attn.c_proj", cfg.dim, cfg.dim, true,
              cfg.hidden_init_std() / std::sqrt(2.0f * static_cast<float>(cfg.layers)), tp),
        ln2_(name + ".ln_2", cfg.dim),
        fc_(name + ".mlp.c_fc", cfg.dim, 4 * cfg.dim, true, cfg.hidden_init_std(), tp),
        fc_proj_(name + ".mlp.c_proj", 4 * cfg.dim, cfg.dim, true,
                 cfg.hidden_init_std() / std::sqrt(2.0f * static_cast<float>(cfg.layers)), tp) {
    // Under sequence parallelism each rank normalises its rows only: the LayerNorms'
    // gradients are partial sums, summed over the group once per step.
    nn::mark_sequence_parallel<T>(ln1_, tp);
    nn::mark_sequence_parallel<T>(ln2_, tp);
    const float lr_scale = cfg.hidden_lr_scale();
    for (nn::Parameter<T>* w :
         {&qkv_.linear().weight(), &proj_.linear().weight(), &fc_.linear().weight(), &fc_proj_.linear().weight()})
      w->lr_scale = lr_scale;
  }

  // The scratch the forward uses to gather rows under sequence parallelism (the model
  // shares its own; a block alone uses one it owns).
  void use_scratch(detail::BlockScratch<T, Space>* scratch) { shared_ = scratch; }
  // Selective recomputation (Korthikanti et al. 2022): the attention core's outputs are
  // not kept; backward recomputes them from qkv_out (the same kernel on the same input:
  // bitwise the same gradients).
  void set_selective_recompute(bool on) { selective_ = on; }

  // out (B, S, C) = block(x (B, S, C)); keeps what backward needs in saved. Under
  // sequence parallelism x and out are this rank's rows of (B·S, C) (tp_.local_rows).
  void forward(Context& ctx, Saved& sv, T* out, const T* x, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_;
    const bool sp = tp_.sequence_parallel();
    detail::BlockScratch<T, Space>& s = scratch();
    reserve(sv, batch, seq);
    s.reserve(rows, C, sp);
    ln1_.forward(ctx, sv.ln1, sv.ln1_out.data(), x, local);
    sync(ctx);
    qkv_.forward(ctx, sv.qkv_out.data(), tp_.gather_rows(s.gathered.data(), sv.ln1_out.data(), rows, C), rows);
    T* att_out = attention(ctx, sv, batch, seq);
    T* attn_partial = sp ? s.partial.data() : sv.x_mid.data();
    proj_.forward_partial(ctx, attn_partial, att_out, rows);
    tp_.reduce_rows(sv.x_mid.data(), attn_partial, rows, C);  // "g"
    Backend::add_inplace(ctx, sv.x_mid.data(), x, local * C);
    ln2_.forward(ctx, sv.ln2, sv.ln2_out.data(), sv.x_mid.data(), local);
    sync(ctx);
    fc_.forward_gelu(ctx, sv.gelu_out.data(), sv.fc_out.data(),
                     tp_.gather_rows(s.gathered.data(), sv.ln2_out.data(), rows, C), rows);
    T* mlp_partial = sp ? s.partial.data() : out;
    fc_proj_.forward_partial(ctx, mlp_partial, sv.gelu_out.data(), rows);
    tp_.reduce_rows(out, mlp_partial, rows, C);  // "g"
    Backend::add_inplace(ctx, out, sv.x_mid.data(), local * C);
  }

  // The weight gradients' operands, kept from the input-gradient pass to the weight pass
  // of a zero-bubble schedule (pipeline::zb_h1): each linear layer's dy, and the inputs
  // the Saved does not hold (gathered rows under sequence parallelism, the attention
  // output under selective recomputation).
  struct Deferred {
    Buffer<T, Space> dy_fc_proj, dy_fc, dy_proj, dy_qkv;  // (B·S, C), (B·S, 4Cl), (B·S, C), (B·S, 3Cl)
    Buffer<T, Space> x_fc, x_proj, x_qkv;                 // (B·S, C), (B·S, Cl), (B·S, C) when not in Saved
    std::size_t bytes() const {
      return dy_fc_proj.bytes() + dy_fc.bytes() + dy_proj.bytes() + dy_qkv.bytes() + x_fc.bytes() + x_proj.bytes() +
             x_qkv.bytes();
    }
  };

  // dx (B, S, C) = ∂loss/∂x given dout = ∂loss/∂out; parameter gradients accumulate
  // (under sequence parallelism, the LayerNorms' only over this rank's rows: see
  // parallel::GradSync). dx, dout, x: this rank's rows. With `defer`, the four linear
  // layers' weight gradients are not computed: their operands go into *defer for
  // backward_weights (the LayerNorms' gradients are computed here either way).
  void backward(Context& ctx, Saved& sv, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq,
                detail::BlockScratch<T, Space>& s, Deferred* defer = nullptr) {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_, Cl = local_dim_;
    const bool sp = tp_.sequence_parallel();
    s.reserve(rows, C, sp);
    const T* att_out = selective_ ? attention(ctx, sv, batch, seq) : sv.att_out.data();
    const Acc* lse = selective_ ? s.lse.data() : sv.lse.data();
    // Keeps n elements of src in dst for the weight pass.
    auto keep = [&](Buffer<T, Space>& dst, const T* src, std::int64_t n) {
      dst.reserve(n);
      Backend::copy(ctx, dst.data(), src, n);
    };
    sync(ctx);
    // MLP. The row-parallel layer sees every row of dout ("g" backward).
    const T* dy = tp_.gather_rows(s.gathered.data(), dout, rows, C);
    if (defer) {
      fc_proj_.linear().input_backward_through_gelu(ctx, s.wide0.data(), dy, sv.fc_out.data(), rows);
      keep(defer->dy_fc_proj, dy, rows * C);
    } else {
      fc_proj_.backward_through_gelu(ctx, s.wide0.data(), dy, sv.gelu_out.data(), sv.fc_out.data(), rows);
    }
    sync(ctx);
    T* dln2 = sp ? s.partial.data() : s.c0.data();
    const T* x_fc = tp_.gather_rows(s.gathered.data(), sv.ln2_out.data(), rows, C);
    if (defer) {
      fc_.linear().input_backward(ctx, dln2, s.wide0.data(), rows);
      sync(ctx);
      keep(defer->dy_fc, s.wide0.data(), rows * 4 * Cl);
      if (sp) keep(defer->x_fc, x_fc, rows * C);
    } else {
      fc_.backward_partial(ctx, dln2, s.wide0.data(), x_fc, rows);
    }
    tp_.reduce_rows(s.c0.data(), dln2, rows, C);  // "f" backward
    T* dx_mid = s.c1.data();
    ln2_.backward(ctx, sv.ln2, dx_mid, s.c0.data(), sv.x_mid.data(), local);
    Backend::add_inplace(ctx, dx_mid, dout, local * C);  // the residual path
    sync(ctx);
    // Attention.
    const T* dy_proj = tp_.gather_rows(s.gathered.data(), dx_mid, rows, C);
    if (defer) {
      proj_.linear().input_backward(ctx, s.c0.data(), dy_proj, rows);
      keep(defer->dy_proj, dy_proj, rows * C);
      if (selective_) keep(defer->x_proj, att_out, rows * Cl);
    } else {
      proj_.backward(ctx, s.c0.data(), dy_proj, att_out, rows);
    }
    Backend::attention_backward(ctx, s.qkv.data(), s.c0.data(), sv.qkv_out.data(), att_out, lse, batch, seq, local_dim_,
                                heads_);
    T* dln1 = sp ? s.partial.data() : s.c0.data();
    const T* x_qkv = tp_.gather_rows(s.gathered.data(), sv.ln1_out.data(), rows, C);
    if (defer) {
      qkv_.linear().input_backward(ctx, dln1, s.qkv.data(), rows);
      sync(ctx);
      keep(defer->dy_qkv, s.qkv.data(), rows * 3 * Cl);
      if (sp) keep(defer->x_qkv, x_qkv, rows * C);
    } else {
      qkv_.backward_partial(ctx, dln1, s.qkv.data(), x_qkv, rows);
    }
    tp_.reduce_rows(s.c0.data(), dln1, rows, C);  // "f" backward
    ln1_.backward(ctx, sv.ln1, dx, s.c0.data(), x, local);
    Backend::add_inplace(ctx, dx, dx_mid, local * C);  // the residual path
  }

  // The weight pass after backward(..., defer): the four linear layers' weight and bias
  // gradients, in the order backward computes them, from the same operands (bitwise the
  // gradients of the undivided backward).
  void backward_weights(Context& ctx, const Saved& sv, const Deferred& d, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq;
    const bool sp = tp_.sequence_parallel();
    fc_proj_.linear().weight_bias_backward(ctx, d.dy_fc_proj.data(), sv.gelu_out.data(), rows);
    fc_.linear().weight_bias_backward(ctx, d.dy_fc.data(), sp ? d.x_fc.data() : sv.ln2_out.data(), rows);
    proj_.linear().weight_bias_backward(ctx, d.dy_proj.data(), selective_ ? d.x_proj.data() : sv.att_out.data(), rows);
    qkv_.linear().weight_bias_backward(ctx, d.dy_qkv.data(), sp ? d.x_qkv.data() : sv.ln1_out.data(), rows);
  }

  // The Layer concept's backward (nn/layer.hpp): the same, with a scratch this block
  // owns, allocated on first use; GPT2 itself passes its shared scratch to the overload
  // above.
  void backward(Context& ctx, Saved& sv, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq) {
    backward(ctx, sv, dx, dout, x, batch, seq, scratch());
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

  // Bytes of the scratch this block owns (a block used alone; the model's is shared).
  std::size_t scratch_bytes() const { return own_scratch_.bytes(); }

 private:
  detail::BlockScratch<T, Space>& scratch() { return shared_ != nullptr ? *shared_ : own_scratch_; }
  // Host-side communication reads what the kernels wrote: wait for them first.
  void sync(Context& ctx) const {
    if (tp_.split()) Backend::synchronize(ctx);
  }

  // The attention core on sv.qkv_out, into sv (kept) or the scratch (selective
  // recomputation); returns its output.
  T* attention(Context& ctx, Saved& sv, std::int64_t batch, std::int64_t seq) {
    detail::BlockScratch<T, Space>& s = scratch();
    const std::int64_t rows = batch * seq;
    Buffer<T, Space>& out = selective_ ? s.att_out : sv.att_out;
    Buffer<Acc, Space>& lse = selective_ ? s.lse : sv.lse;
    out.reserve(rows * local_dim_);
    lse.reserve(batch * heads_ * seq);
    Backend::attention_forward(ctx, out.data(), lse.data(), sv.qkv_out.data(), batch, seq, local_dim_, heads_);
    return out.data();
  }

  void reserve(Saved& sv, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_, Cl = local_dim_;
    sv.ln1_out.reserve(local * C);
    sv.qkv_out.reserve(rows * 3 * Cl);
    sv.x_mid.reserve(local * C);
    sv.ln2_out.reserve(local * C);
    sv.fc_out.reserve(rows * 4 * Cl);
    sv.gelu_out.reserve(rows * 4 * Cl);
  }

  nn::TensorParallelGroup tp_;
  std::int64_t dim_;
  std::int64_t heads_;      // this rank's heads: NH / tp
  std::int64_t local_dim_;  // this rank's attention channels and a quarter of its MLP width: C / tp
  bool selective_ = false;
  Norm ln1_;
  nn::ColumnParallelLinear<T, Backend> qkv_;
  nn::RowParallelLinear<T, Backend> proj_;
  Norm ln2_;
  nn::ColumnParallelLinear<T, Backend> fc_;
  nn::RowParallelLinear<T, Backend> fc_proj_;
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

// GPT-2: the Transformer of GPT2Blocks (models/transformer.hpp). GPT2<float>,
// GPT2<bf16, backend::Cuda>, or GPT2<Policy>: a composed policy names the storage type
// and the backend, and the Trainer runs that policy.
template <class TypeOrPolicy, class Backend = backend::Cpu>
using GPT2 = Transformer<TypeOrPolicy, Backend, GPT2Spec>;

}  // namespace llmpar::models
