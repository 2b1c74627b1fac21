// llmpar/checkpoint/hf_llama.hpp — Llama in Hugging Face's layout, in and out: start a run
// from a LlamaForCausalLM folder that save_pretrained wrote (or the hub's), hand a trained
// models::Llama to transformers' from_pretrained.
//
// What differs from our layout, and nothing else (one table, llama_tensors(), says it for
// both directions, so an import and an export cannot drift apart):
//  - names: LlamaForCausalLM prefixes its body with "model." ("model.layers.0.mlp.
//    down_proj.weight" is our "layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"
//    our "embed_tokens"); its head is "lm_head.weight", ours "lm_head". A LlamaModel
//    file (no head, no prefix) reads too.
//  - fused projections: our self_attn.qkv_proj is HF's q_proj, k_proj and v_proj one
//    after another by rows, our mlp.gate_up_proj its gate_proj then up_proj.
//  - the query heads' order. Grouped-query attention shares each of kv_heads kv heads
//    among group = heads / kv_heads query heads. HF pairs query head h with kv head
//    h / group; llmpar pairs it with h % kv_heads (core/attention_shape.hpp says why:
//    tensor parallelism then cuts q, k and v alike). So our query head j·kv_heads + k
//    (j < group, k < kv_heads) is HF's k·group + j (hf_query_head): q_proj's row blocks
//    of head_dim rows are permuted so, and o_proj's column blocks (its inputs are the
//    query heads' outputs) the same way; k_proj and v_proj are as they are. The rotary
//    embedding needs no permutation: ours is HF's rotate-half convention (math/rotary.hpp).
//  - the token table and the head: HF has the real vocabulary's rows, we pad both to
//    padded_vocab with zero rows (never looked up, their logits never in the loss).
//  - a tied model (tie_embeddings, Llama 3.2's 1B and 3B) has no head of its own: its
//    file may omit lm_head.weight, or hold one equal to embed_tokens bit for bit; an
//    untied one must hold it.
//  - older files hold each layer's self_attn.rotary_emb.inv_freq: a buffer, ignored.
//
// config.json (read_llama_config, and write_llama's): hidden_size, intermediate_size,
// num_hidden_layers, num_attention_heads, num_key_value_heads, max_position_embeddings,
// vocab_size, rms_norm_eps, initializer_range, tie_word_embeddings, and the rotary
// embedding: rope_theta and rope_scaling (none, or Llama 3's {"rope_type": "llama3",
// "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
// or transformers 5's rope_parameters, which holds both. What llmpar's Llama does not
// compute is an error naming the key: a head_dim other than hidden_size /
// num_attention_heads, attention or MLP biases, an activation other than SiLU, another
// rope_type. Keys that are absent take transformers' defaults.
//
// Reading converts F32, F16 and BF16 to f32 and yields a checkpoint::Snapshot of whole
// tensors (moments zero), so Trainer::load_weights(checkpoint::Source::of(snapshot))
// fills a model at any layout (tp, pp, ZeRO), as read_gpt2's does. Every check a
// folder can fail (a missing, unknown or misshapen tensor, another depth) is an error
// naming the file, the tensor, both shapes and the flag that makes the model match
// (--layers, --kv-heads, --dim, --ffn-dim, --vocab). The weights show heads / kv_heads
// only (k_proj has kv_heads · dim / heads rows): --heads itself comes from config.json.
//
// Writing reads every tensor whole from a checkpoint::Source and stores the folder
// LlamaForCausalLM.from_pretrained loads: config.json and model.safetensors (F32, HF's
// names, the real vocabulary's rows, {"format": "pt"}), under temporary names renamed
// into place (hf_gpt2.hpp's detail::write_folder).
//
// family_of_folder says which reader a folder needs, from its config.json.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "llmpar/checkpoint/checkpoint.hpp"
#include "llmpar/checkpoint/hf_gpt2.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/models/llama.hpp"

namespace llmpar::checkpoint::hf {

// How one of our tensors is made of HF's.
enum class LlamaMapping {
  same,          // one HF tensor, the same shape and values
  vocab_rows,    // embed_tokens, lm_head: HF the first `vocab` of our padded_vocab rows
  stacked,       // gate_up_proj: HF's tensors one after another by rows (gate_proj, up_proj)
  qkv,           // qkv_proj: q_proj's head blocks of rows in our order (hf_query_head), then k_proj, v_proj
  head_columns,  // o_proj: its blocks of head_dim columns in our query heads' order
};

// What a dimension of an HF tensor counts: it says which flag changes it.
enum class LlamaExtent {
  dim,    // hidden_size, --dim
  vocab,  // vocab_size, --vocab
  ffn,    // intermediate_size, --ffn-dim
  q,      // num_attention_heads · head_dim (= hidden_size in llmpar)
  kv,     // num_key_value_heads · head_dim, --kv-heads
};

// One HF tensor of one of ours.
struct LlamaPart {
  std::string theirs;  // as LlamaForCausalLM names it: "model.layers.0.self_attn.q_proj.weight"
  Shape hf_shape;
  std::vector<LlamaExtent> extents;  // per dimension of hf_shape
};

// One of our tensors and the HF tensors it is made of, in the order they are stacked.
struct LlamaTensor {
  std::string ours;  // "layers.0.self_attn.qkv_proj.weight"
  Shape shape;       // ours, the full tensor
  LlamaMapping mapping = LlamaMapping::same;
  std::vector<LlamaPart> parts;
};

// The HF query head that is our query head `head` (see the design note): our
// j·kv_heads + k is HF's k·group + j. heads 4, kv_heads 2: ours 0, 1, 2, 3 are HF's 0, 2,
// 1, 3. Import and export both use it: ours[head] = HF's[hf_query_head(head)].
inline std::int64_t hf_query_head(std::int64_t head, const models::LlamaConfig& cfg) {
  const std::int64_t group = cfg.heads / cfg.kv_heads;
  return head % cfg.kv_heads * group + head / cfg.kv_heads;
}

// Every tensor of Llama under cfg, in our parameters' order (embed_tokens, layers.0 ...,
// norm.weight, lm_head unless tied).
inline std::vector<LlamaTensor> llama_tensors(const models::LlamaConfig& cfg) {
  using E = LlamaExtent;
  const std::int64_t C = cfg.dim, hd = cfg.head_dim(), q = cfg.heads * hd, kv = cfg.kv_heads * hd, F = cfg.ffn_dim;
  std::vector<LlamaTensor> t;
  t.push_back({"embed_tokens",
               Shape{cfg.padded_vocab, C},
               LlamaMapping::vocab_rows,
               {{"model.embed_tokens.weight", Shape{cfg.vocab, C}, {E::vocab, E::dim}}}});
  for (std::int64_t i = 0; i < cfg.layers; ++i) {
    const std::string ours = "layers." + std::to_string(i) + ".", theirs = "model." + ours;
    const auto vector = [&](const std::string& name) {
      t.push_back({ours + name, Shape{C}, LlamaMapping::same, {{theirs + name, Shape{C}, {E::dim}}}});
    };
    vector("input_layernorm.weight");
    t.push_back({ours + "self_attn.qkv_proj.weight",
                 Shape{q + 2 * kv, C},
                 LlamaMapping::qkv,
                 {{theirs + "self_attn.q_proj.weight", Shape{q, C}, {E::q, E::dim}},
                  {theirs + "self_attn.k_proj.weight", Shape{kv, C}, {E::kv, E::dim}},
                  {theirs + "self_attn.v_proj.weight", Shape{kv, C}, {E::kv, E::dim}}}});
    t.push_back({ours + "self_attn.o_proj.weight",
                 Shape{C, q},
                 LlamaMapping::head_columns,
                 {{theirs + "self_attn.o_proj.weight", Shape{C, q}, {E::dim, E::q}}}});
    vector("post_attention_layernorm.weight");
    t.push_back({ours + "mlp.gate_up_proj.weight",
                 Shape{2 * F, C},
                 LlamaMapping::stacked,
                 {{theirs + "mlp.gate_proj.weight", Shape{F, C}, {E::ffn, E::dim}},
                  {theirs + "mlp.up_proj.weight", Shape{F, C}, {E::ffn, E::dim}}}});
    t.push_back({ours + "mlp.down_proj.weight",
                 Shape{C, F},
                 LlamaMapping::same,
                 {{theirs + "mlp.down_proj.weight", Shape{C, F}, {E::dim, E::ffn}}}});
  }
  t.push_back({"norm.weight", Shape{C}, LlamaMapping::same, {{"model.norm.weight", Shape{C}, {E::dim}}}});
  if (!cfg.tie_embeddings)
    t.push_back({"lm_head",
                 Shape{cfg.padded_vocab, C},
                 LlamaMapping::vocab_rows,
                 {{"lm_head.weight", Shape{cfg.vocab, C}, {E::vocab, E::dim}}}});
  return t;
}

// The Llama of a config.json that LlamaForCausalLM.save_pretrained wrote (or the hub's),
// padded_vocab the vocabulary rounded up to a multiple of 128. See the design note for
// the keys read and the ones refused.
LLMPAR_INLINE models::LlamaConfig read_llama_config(const std::string& folder);

// The Llama in `folder` (model.safetensors, or model.safetensors.index.json and its
// shards; or a single .safetensors file), checked against cfg, as whole tensors in our
// names and layout, without moments. Load it with
// trainer.load_weights(checkpoint::Source::of(snapshot)), keeping the snapshot alive
// while the Source is used.
LLMPAR_INLINE checkpoint::Snapshot read_llama(const std::string& folder, const models::LlamaConfig& cfg);

// Llama under cfg, read whole from `source` (every element of every tensor), written as
// the folder `dir` (config.json, model.safetensors) that LlamaForCausalLM.from_pretrained
// loads.
LLMPAR_INLINE void write_llama(const std::string& dir, const checkpoint::Source& source,
                               const models::LlamaConfig& cfg);

// The model families llmpar reads from Hugging Face folders.
enum class Family { gpt2, llama };

// The family of the model in `folder`, from its config.json's model_type (or, without
// one, its architectures): read it with read_gpt2_config and read_gpt2, or
// read_llama_config and read_llama. Another family is an error naming it.
LLMPAR_INLINE Family family_of_folder(const std::string& folder);

}  // namespace llmpar::checkpoint::hf

// The bodies: compiled here (header-only), or once in a program that defines
// LLMPAR_COMPILED and links the compiled part of llmpar (config.hpp).
#if !defined(LLMPAR_COMPILED)
#include "llmpar/checkpoint/hf_llama-inl.hpp"
#endif
