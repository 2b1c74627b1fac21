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
#include "llmpar/models/prenorm_block.hpp"
#include "llmpar/models/transformer.hpp"
#include "llmpar/nn/attention.hpp"
#include "llmpar/nn/layernorm.hpp"
#include "llmpar/nn/mlp.hpp"
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

// GPT-2's block: the pre-norm block (models/prenorm_block.hpp) of LayerNorms, llmpar's
// attention and a GELU MLP of 4C, with GPT-2's parameter names and initialisation.
// Under µP (cfg.mup) the four matrices start at cfg.hidden_init_std() and train at
// cfg.hidden_lr_scale() times the learning rate; their biases are untouched.
template <class T, class Backend>
struct GPT2Parts {
  using Config = GPT2Config;
  using Norm = nn::LayerNorm<T, Backend>;
  using Attention = nn::SelfAttention<T, Backend>;
  using Mlp = nn::Mlp<T, Backend, nn::Gelu>;

  static Norm attention_norm(const std::string& block, const GPT2Config& cfg) { return Norm(block + ".ln_1", cfg.dim); }
  static Norm mlp_norm(const std::string& block, const GPT2Config& cfg) { return Norm(block + ".ln_2", cfg.dim); }
  static Attention attention(const std::string& block, const GPT2Config& cfg, nn::TensorParallelGroup tp) {
    Attention a(block + ".attn.c_attn", block + ".attn.c_proj",
                {.dim = cfg.dim,
                 .heads = cfg.heads,
                 .bias = true,
                 .init_std = cfg.hidden_init_std(),
                 .out_init_std = residual_std(cfg)},
                tp);
    a.qkv().linear().weight().lr_scale = cfg.hidden_lr_scale();
    a.proj().linear().weight().lr_scale = cfg.hidden_lr_scale();
    return a;
  }
  static Mlp mlp(const std::string& block, const GPT2Config& cfg, nn::TensorParallelGroup tp) {
    Mlp m(block + ".mlp.c_fc", block + ".mlp.c_proj",
          {.dim = cfg.dim,
           .hidden = 4 * cfg.dim,
           .bias = true,
           .init_std = cfg.hidden_init_std(),
           .out_init_std = residual_std(cfg)},
          tp);
    m.up().linear().weight().lr_scale = cfg.hidden_lr_scale();
    m.down().linear().weight().lr_scale = cfg.hidden_lr_scale();
    return m;
  }
  // GPT-2's scaling of the projections that write into the residual stream.
  static float residual_std(const GPT2Config& cfg) {
    return cfg.hidden_init_std() / std::sqrt(2.0f * static_cast<float>(cfg.layers));
  }
};

template <class T, class Backend = backend::Cpu>
using GPT2Block = PreNormBlock<GPT2Parts<T, Backend>, T, Backend>;

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
