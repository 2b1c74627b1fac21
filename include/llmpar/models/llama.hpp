// llmpar/models/llama.hpp — Llama (Touvron et al. 2023; Llama 3, Grattafiori et al.
// 2024): pre-RMSNorm blocks of grouped-query attention with rotary positions and a
// SwiGLU MLP, no biases, no position table, an LM head of its own or tied to the token
// table.
//
// LlamaBlock is models::PreNormBlock (models/prenorm_block.hpp) of LlamaParts: two
// nn::RMSNorms, nn::SelfAttention with kv_heads and nn::Rotary positions, nn::Mlp with
// nn::SwiGlu; models::Llama is the Transformer (models/transformer.hpp) of those blocks
// with LlamaSpec. So every strategy the Transformer has (tensor and sequence
// parallelism, pipelines and their schedules, ZeRO, recomputation, precisions,
// checkpoints) is Llama's too, with nothing written for Llama:
//  - Tensor parallelism splits the query heads and the kv heads (tp divides both: a kv
//    head is never split, and a rank's query heads read its own kv heads), and the MLP's
//    hidden units; the token table and the head split the vocabulary.
//  - The parameter names are Hugging Face's LlamaForCausalLM names without "model."
//    ("layers.3.self_attn.o_proj.weight"), except the fused projections:
//    self_attn.qkv_proj ((heads + 2 kv_heads) · head_dim, C) holds q_proj, k_proj and
//    v_proj one after another, mlp.gate_up_proj (2 ffn_dim, C) gate_proj then up_proj
//    (checkpoint/hf_llama.hpp converts, with the query heads' order).
//  - Initialisation: every matrix normal(0, init_std) (Hugging Face's initializer_range),
//    the two projections into the residual stream (o_proj, down_proj) with GPT-2's and
//    Megatron's extra 1 / sqrt(2 layers); RMSNorm gains ones.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "llmpar/backend/backend.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/math/rotary.hpp"
#include "llmpar/models/prenorm_block.hpp"
#include "llmpar/models/transformer.hpp"
#include "llmpar/nn/attention.hpp"
#include "llmpar/nn/mlp.hpp"
#include "llmpar/nn/rmsnorm.hpp"
#include "llmpar/nn/tensor_parallel.hpp"

namespace llmpar::models {

struct LlamaConfig {
  std::int64_t layers = 4;
  std::int64_t heads = 4;           // query heads
  std::int64_t kv_heads = 2;        // key/value heads, dividing heads (heads: multi-head attention)
  std::int64_t dim = 128;           // C; the head size is dim / heads
  std::int64_t ffn_dim = 384;       // the SwiGLU MLP's hidden units
  std::int64_t max_seq = 256;       // the longest sequence trained on
  std::int64_t vocab = 256;         // real vocabulary
  std::int64_t padded_vocab = 256;  // rows of the token table (and of the head), >= vocab
  float init_std = 0.02f;
  float norm_eps = 1e-5f;  // RMSNorm's epsilon (Hugging Face's rms_norm_eps)
  math::RopeConfig rope{.theta = 500000.0f};
  bool tie_embeddings = false;  // the LM head is the token table (Llama 3.2 1B and 3B)

  // Named presets: "llama-tiny" (byte vocabulary, GQA with 2 query heads per kv head,
  // trains in a minute on a laptop core) and two of Meta's shapes: "llama3.2-1b"
  // (tied head, rope scaling factor 32) and "llama3-8b".
  static LlamaConfig preset(std::string_view name) {
    if (name == "llama-tiny") return {};
    if (name == "llama3.2-1b")
      return {.layers = 16,
              .heads = 32,
              .kv_heads = 8,
              .dim = 2048,
              .ffn_dim = 8192,
              .max_seq = 131072,
              .vocab = 128256,
              .padded_vocab = 128256,
              .norm_eps = 1e-5f,
              .rope = {.theta = 500000.0f,
                       .factor = 32.0f,
                       .low_freq_factor = 1.0f,
                       .high_freq_factor = 4.0f,
                       .original_max_position = 8192},
              .tie_embeddings = true};
    if (name == "llama3-8b")
      return {.layers = 32,
              .heads = 32,
              .kv_heads = 8,
              .dim = 4096,
              .ffn_dim = 14336,
              .max_seq = 8192,
              .vocab = 128256,
              .padded_vocab = 128256,
              .norm_eps = 1e-5f,
              .rope = {.theta = 500000.0f}};
    LLMPAR_FAIL("unknown Llama preset '", name, "'; use llama-tiny, llama3.2-1b or llama3-8b");
  }
  static bool is_preset(std::string_view name) { return name.starts_with("llama"); }

  std::int64_t head_dim() const { return dim / heads; }

  void validate() const {
    LLMPAR_CHECK(layers > 0, "layers is ", layers, "; a Llama needs at least 1 layer");
    LLMPAR_CHECK(heads > 0, "heads is ", heads, "; use at least 1 attention head");
    LLMPAR_CHECK(dim > 0 && dim % heads == 0, "dim ", dim, " is not divisible by heads ", heads,
                 "; choose dim as a multiple of heads");
    LLMPAR_CHECK(kv_heads > 0 && heads % kv_heads == 0, "kv_heads (--kv-heads) is ", kv_heads,
                 "; it must divide heads ", heads,
                 " (grouped-query attention: heads / kv_heads query heads share a "
                 "kv head; kv_heads = heads is multi-head attention)");
    LLMPAR_CHECK(head_dim() % 2 == 0, "the head size dim / heads = ", head_dim(),
                 " is odd; rotary embeddings rotate pairs of channels, so choose an even head size");
    LLMPAR_CHECK(ffn_dim > 0, "ffn_dim (--ffn-dim) is ", ffn_dim, "; the MLP needs at least 1 hidden unit");
    LLMPAR_CHECK(max_seq > 0, "seq is ", max_seq, "; the sequence length must be positive");
    LLMPAR_CHECK(vocab > 0, "vocab is ", vocab, "; it must be positive");
    LLMPAR_CHECK(padded_vocab >= vocab, "padded_vocab ", padded_vocab, " is smaller than vocab ", vocab);
    LLMPAR_CHECK(std::isfinite(init_std) && init_std > 0.0f, "init_std (--init-std) is ", init_std,
                 "; give a positive standard deviation (Llama's is 0.02)");
    LLMPAR_CHECK(norm_eps > 0.0f, "norm_eps is ", norm_eps, "; RMSNorm needs a positive epsilon (Llama 3: 1e-5)");
    rope.validate();
  }

  // The (in, out) sizes of the linear layers one of `tp` tensor-parallel ranks holds:
  // a block's fused qkv, attention output, gate/up and down projections, and the head.
  std::array<std::pair<std::int64_t, std::int64_t>, 5> linear_sizes(int tp = 1) const {
    const std::int64_t C = dim;
    return {{{C, (heads + 2 * kv_heads) * head_dim() / tp},
             {C / tp, C},
             {C, 2 * ffn_dim / tp},
             {ffn_dim / tp, C},
             {C, padded_vocab / tp}}};
  }

  // Parameters: per block the attention's C·(heads + 2 kv_heads)·hs + C², the MLP's
  // 3·C·ffn_dim and two norms; the token table; the final norm and, untied, the head.
  std::int64_t block_parameters() const {
    return dim * (heads + 2 * kv_heads) * head_dim() + dim * dim + 3 * dim * ffn_dim + 2 * dim;
  }
  std::int64_t embedding_parameters() const { return padded_vocab * dim; }
  // What the last stage holds for the head (its matrix, tied or not, and the final norm).
  std::int64_t head_parameters() const { return padded_vocab * dim + dim; }
  std::int64_t num_parameters() const {
    return embedding_parameters() + layers * block_parameters() + dim + (tie_embeddings ? 0 : padded_vocab * dim);
  }
  float residual_std() const { return init_std / std::sqrt(2.0f * static_cast<float>(layers)); }
};

template <class T, class Backend>
struct LlamaParts {
  using Config = LlamaConfig;
  using Norm = nn::RMSNorm<T, Backend>;
  using Attention = nn::SelfAttention<T, Backend, nn::Rotary<Backend>>;
  using Mlp = nn::Mlp<T, Backend, nn::SwiGlu>;

  static Norm attention_norm(const std::string& block, const LlamaConfig& cfg) {
    return Norm(block + ".input_layernorm", cfg.dim, cfg.norm_eps);
  }
  static Norm mlp_norm(const std::string& block, const LlamaConfig& cfg) {
    return Norm(block + ".post_attention_layernorm", cfg.dim, cfg.norm_eps);
  }
  static Attention attention(const std::string& block, const LlamaConfig& cfg, nn::TensorParallelGroup tp) {
    return Attention(block + ".self_attn.qkv_proj", block + ".self_attn.o_proj",
                     {.dim = cfg.dim,
                      .heads = cfg.heads,
                      .kv_heads = cfg.kv_heads,
                      .bias = false,
                      .init_std = cfg.init_std,
                      .out_init_std = cfg.residual_std()},
                     tp, nn::Rotary<Backend>{cfg.rope});
  }
  static Mlp mlp(const std::string& block, const LlamaConfig& cfg, nn::TensorParallelGroup tp) {
    return Mlp(block + ".mlp.gate_up_proj", block + ".mlp.down_proj",
               {.dim = cfg.dim,
                .hidden = cfg.ffn_dim,
                .bias = false,
                .init_std = cfg.init_std,
                .out_init_std = cfg.residual_std()},
               tp);
  }
};

template <class T, class Backend = backend::Cpu>
using LlamaBlock = PreNormBlock<LlamaParts<T, Backend>, T, Backend>;

// What makes the Transformer a Llama: its block, a final RMSNorm, no position table, an
// untied head (unless LlamaConfig::tie_embeddings), and the names.
struct LlamaSpec {
  using Config = LlamaConfig;
  template <class T, class Backend>
  using Block = LlamaBlock<T, Backend>;
  template <class T, class Backend>
  using Norm = nn::RMSNorm<T, Backend>;
  static constexpr const char* kTokenTable = "embed_tokens";
  static constexpr const char* kPositionTable = nullptr;
  static constexpr const char* kHeadTable = "lm_head";
  static constexpr const char* kBlockPrefix = "layers.";
  template <class T, class Backend>
  static nn::RMSNorm<T, Backend> final_norm(const LlamaConfig& cfg) {
    return nn::RMSNorm<T, Backend>("norm", cfg.dim, cfg.norm_eps);
  }
};

// Llama: Llama<float>, Llama<bf16, backend::Cuda>, or Llama<Policy> (a composed policy).
template <class TypeOrPolicy, class Backend = backend::Cpu>
using Llama = Transformer<TypeOrPolicy, Backend, LlamaSpec>;

}  // namespace llmpar::models
