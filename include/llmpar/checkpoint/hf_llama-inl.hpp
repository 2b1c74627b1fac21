// llmpar/checkpoint/hf_llama-inl.hpp — the bodies of hf_llama.hpp's Hugging Face Llama import and export.
//
// hf_llama.hpp includes this file unless LLMPAR_COMPILED is defined; a program that
// defines it compiles this file once, in the compiled part of llmpar (src/), where
// LLMPAR_INLINE is empty (config.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "llmpar/checkpoint/hf_llama.hpp"

namespace llmpar::checkpoint::hf {

namespace detail {

inline constexpr std::string_view kLlamaPrefix = "model.";

// A name without LlamaForCausalLM's "model." prefix (what LlamaModel calls it).
inline std::string_view unprefixed(std::string_view name) {
  if (name.substr(0, kLlamaPrefix.size()) == kLlamaPrefix) name.remove_prefix(kLlamaPrefix.size());
  return name;
}

// transformers' per-layer buffer of older files: the rotary frequencies.
inline bool is_llama_buffer(std::string_view name) {
  std::string_view rest;
  return layer_of(name, &rest, "layers.") && rest == "self_attn.rotary_emb.inv_freq";
}

// The flag that makes cfg match a file whose tensor `part` has shape `got`.
inline std::string llama_fix_for(const LlamaPart& part, const std::vector<std::int64_t>& got,
                                 const models::LlamaConfig& cfg) {
  using llmpar::detail::concat;
  const std::vector<std::int64_t> want = dims_of(part.hf_shape);
  if (got.size() != want.size())
    return concat("a tensor of ", want.size(), " dimensions; this is not Llama's layout of ", part.theirs);
  // The width first: with another hidden_size every tensor differs.
  for (std::size_t d = 0; d < want.size(); ++d)
    if (part.extents[d] == LlamaExtent::dim && got[d] != want[d]) return concat("--dim ", got[d]);
  const std::int64_t hd = cfg.head_dim();
  for (std::size_t d = 0; d < want.size(); ++d) {
    if (got[d] == want[d]) continue;
    switch (part.extents[d]) {
      case LlamaExtent::dim:
        break;
      case LlamaExtent::vocab:
        return concat("--vocab ", got[d]);
      case LlamaExtent::ffn:
        return concat("--ffn-dim ", got[d]);
      case LlamaExtent::kv:
        if (got[d] % hd == 0)
          return concat("--kv-heads ", got[d] / hd, " (at --heads ", cfg.heads,
                        "; the weights say heads / kv_heads only, config.json says both)");
        return concat("--heads and --kv-heads with kv_heads · dim / heads = ", got[d]);
      case LlamaExtent::q:
        return concat("a config.json whose head_dim is hidden_size / num_attention_heads: this q_proj has ", got[d],
                      " rows for hidden_size ", cfg.dim,
                      ", which llmpar's Llama (heads of dim / heads channels) "
                      "cannot hold");
    }
  }
  return "the model's flags";
}

// Which way a permutation of the query heads goes.
enum class Toward { ours, hf };

// dst = src (heads · head_dim rows of `cols` values: q_proj) with its head blocks of rows
// in the other order: ours[h] = HF's[hf_query_head(h)].
inline void permute_query_rows(const float* src, float* dst, std::int64_t cols, const models::LlamaConfig& cfg,
                               Toward to) {
  const std::int64_t block = cfg.head_dim() * cols;
  for (std::int64_t h = 0; h < cfg.heads; ++h) {
    const std::int64_t hf = hf_query_head(h, cfg);
    const float* from = src + (to == Toward::ours ? hf : h) * block;
    std::copy(from, from + block, dst + (to == Toward::ours ? h : hf) * block);
  }
}

// dst = src (`rows` rows of heads · head_dim columns: o_proj) with its head blocks of
// columns in the other order.
inline void permute_query_columns(const float* src, float* dst, std::int64_t rows, const models::LlamaConfig& cfg,
                                  Toward to) {
  const std::int64_t hd = cfg.head_dim(), width = cfg.heads * hd;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t h = 0; h < cfg.heads; ++h) {
      const std::int64_t hf = hf_query_head(h, cfg);
      const float* from = src + r * width + (to == Toward::ours ? hf : h) * hd;
      std::copy(from, from + hd, dst + r * width + (to == Toward::ours ? h : hf) * hd);
    }
}

// The rotary embedding of a config.json: transformers 5's rope_parameters, or the
// rope_theta and rope_scaling before it (rope_scaling, when given, is what transformers
// uses).
inline math::RopeConfig read_rope(const ConfigJson& c, std::int64_t max_position) {
  const char* where = c.has("rope_scaling") ? "rope_scaling" : "rope_parameters";
  nlohmann::json p = nlohmann::json::object();
  if (c.has(where)) {
    p = c.json[where];
    LLMPAR_CHECK(p.is_object(), c.path, ": \"", where, "\" is ", p.dump(), ", not an object (or null)");
  }
  const auto number = [&](const char* key, double fallback, bool required) {
    const bool present = p.contains(key) && !p[key].is_null();
    LLMPAR_CHECK(present || !required, c.path, ": \"", where, "\" has no \"", key,
                 "\", which rope_type \"llama3\" needs");
    if (!present) return fallback;
    LLMPAR_CHECK(p[key].is_number(), c.path, ": \"", where, ".", key, "\" is ", p[key].dump(), ", not a number");
    return p[key].get<double>();
  };
  math::RopeConfig rope;
  rope.theta = static_cast<float>(number("rope_theta", c.number("rope_theta", 10000.0), false));
  std::string type = "default";
  for (const char* key : {"rope_type", "type"})
    if (p.contains(key) && p[key].is_string()) {
      type = p[key].get<std::string>();
      break;
    }
  if (type == "llama3") {
    rope.factor = static_cast<float>(number("factor", 0.0, true));
    rope.low_freq_factor = static_cast<float>(number("low_freq_factor", 0.0, true));
    rope.high_freq_factor = static_cast<float>(number("high_freq_factor", 0.0, true));
    rope.original_max_position =
        static_cast<std::int64_t>(number("original_max_position_embeddings", static_cast<double>(max_position), false));
  } else {
    LLMPAR_CHECK(type == "default", c.path, ": \"", where, "\" has rope_type \"", type,
                 "\"; llmpar's Llama computes rotary embeddings unscaled (\"default\") or with Llama 3's scaling "
                 "(\"llama3\")");
  }
  return rope;
}

// config.json for LlamaForCausalLM of cfg.
inline nlohmann::ordered_json llama_config_json(const models::LlamaConfig& cfg) {
  nlohmann::ordered_json scaling = nullptr;
  if (cfg.rope.scaled())
    scaling = {{"rope_type", "llama3"},
               {"factor", json_number(cfg.rope.factor)},
               {"low_freq_factor", json_number(cfg.rope.low_freq_factor)},
               {"high_freq_factor", json_number(cfg.rope.high_freq_factor)},
               {"original_max_position_embeddings", cfg.rope.original_max_position}};
  // No dropout (llmpar trains without), no biases, SiLU; the ids of special tokens are
  // the tokenizer's business and left out.
  return {{"architectures", nlohmann::ordered_json::array({"LlamaForCausalLM"})},
          {"model_type", "llama"},
          {"vocab_size", cfg.vocab},
          {"hidden_size", cfg.dim},
          {"intermediate_size", cfg.ffn_dim},
          {"num_hidden_layers", cfg.layers},
          {"num_attention_heads", cfg.heads},
          {"num_key_value_heads", cfg.kv_heads},
          {"head_dim", cfg.head_dim()},
          {"hidden_act", "silu"},
          {"max_position_embeddings", cfg.max_seq},
          {"initializer_range", json_number(cfg.init_std)},
          {"rms_norm_eps", json_number(cfg.norm_eps)},
          {"rope_theta", json_number(cfg.rope.theta)},
          {"rope_scaling", scaling},
          {"tie_word_embeddings", cfg.tie_embeddings},
          {"attention_bias", false},
          {"attention_dropout", 0.0},
          {"mlp_bias", false},
          {"pretraining_tp", 1},
          {"use_cache", true},
          {"torch_dtype", "float32"}};
}

}  // namespace detail

LLMPAR_INLINE models::LlamaConfig read_llama_config(const std::string& folder) {
  const detail::ConfigJson c = detail::ConfigJson::read(folder);
  const std::string type = c.model_type();
  LLMPAR_CHECK(type == "llama", c.path, " is the config of a '", type.empty() ? "(no model_type)" : type,
               "' model, not Llama (model_type \"llama\", architectures LlamaForCausalLM)",
               type == "gpt2" ? "; read it with read_gpt2_config (hf_gpt2.hpp)" : "");
  models::LlamaConfig cfg;
  cfg.layers = c.integer("num_hidden_layers");
  cfg.heads = c.integer("num_attention_heads");
  cfg.kv_heads = c.integer("num_key_value_heads", cfg.heads);
  cfg.dim = c.integer("hidden_size");
  cfg.ffn_dim = c.integer("intermediate_size");
  cfg.max_seq = c.integer("max_position_embeddings", 2048);
  cfg.vocab = c.integer("vocab_size");
  cfg.padded_vocab = models::GPT2Config::pad_vocab(cfg.vocab);
  cfg.init_std = static_cast<float>(c.number("initializer_range", 0.02));
  cfg.norm_eps = static_cast<float>(c.number("rms_norm_eps", 1e-6));
  cfg.tie_embeddings = c.boolean("tie_word_embeddings", false);
  LLMPAR_CHECK(cfg.heads > 0 && cfg.dim % cfg.heads == 0, c.path, ": hidden_size ", cfg.dim,
               " is not a multiple of num_attention_heads ", cfg.heads);
  const std::int64_t head_dim = c.integer("head_dim", cfg.dim / cfg.heads);
  LLMPAR_CHECK(head_dim == cfg.dim / cfg.heads, c.path, ": head_dim is ", head_dim, " but hidden_size ", cfg.dim,
               " / num_attention_heads ", cfg.heads, " = ", cfg.dim / cfg.heads,
               "; llmpar's Llama has heads of hidden_size / num_attention_heads channels");
  for (const char* bias : {"attention_bias", "mlp_bias"})
    LLMPAR_CHECK(!c.boolean(bias, false), c.path, ": ", bias,
                 " is true; llmpar's Llama has no biases (Meta's Llamas have none)");
  const std::string act = c.text("hidden_act", "silu");
  LLMPAR_CHECK(act == "silu", c.path, ": hidden_act is \"", act, "\"; llmpar's Llama's MLP is SwiGLU (\"silu\")");
  cfg.rope = detail::read_rope(c, cfg.max_seq);
  detail::validate_read(cfg, c.path);
  return cfg;
}

LLMPAR_INLINE checkpoint::Snapshot read_llama(const std::string& folder, const models::LlamaConfig& cfg) {
  using detail::shape_text;
  using Entry = Tensors::Entry;
  cfg.validate();
  const Tensors file = Tensors::open(folder);
  const std::vector<LlamaTensor> table = llama_tensors(cfg);
  struct Where {
    std::size_t tensor, part;
  };
  std::map<std::string, Where, std::less<>> index;  // HF name without "model." -> its place in the table
  for (std::size_t k = 0; k < table.size(); ++k)
    for (std::size_t p = 0; p < table[k].parts.size(); ++p)
      index.emplace(std::string(detail::unprefixed(table[k].parts[p].theirs)), Where{k, p});

  // The depth first: a folder of another --layers fails with that, not with the first
  // tensor the model lacks.
  std::int64_t file_layers = 0;
  for (const Entry& t : file.entries())
    if (const auto layer = detail::layer_of(detail::unprefixed(t.info->name), nullptr, "layers."))
      file_layers = std::max(file_layers, *layer + 1);
  LLMPAR_CHECK(file_layers > 0, folder,
               " holds no Llama block (no tensor named model.layers.0.*): not a Llama checkpoint");
  LLMPAR_CHECK(file_layers == cfg.layers, folder, " holds ", file_layers, file_layers == 1 ? " block" : " blocks",
               " (tensors model.layers.0.* to model.layers.", file_layers - 1, ".*) but the model has ", cfg.layers,
               " layers; use --layers ", file_layers);

  // Every tensor of the folder: one we need (at most once), a buffer, the tied head, or an error.
  std::vector<std::vector<const Entry*>> found(table.size());
  for (std::size_t k = 0; k < table.size(); ++k) found[k].assign(table[k].parts.size(), nullptr);
  const Entry* tied_head = nullptr;
  for (const Entry& t : file.entries()) {
    const std::string_view name = detail::unprefixed(t.info->name);
    if (detail::is_llama_buffer(name)) continue;
    if (cfg.tie_embeddings && name == "lm_head.weight") {
      tied_head = &t;
      continue;
    }
    const auto it = index.find(name);
    LLMPAR_CHECK(it != index.end() || !name.ends_with(".bias"), t.file->path(), " holds the bias '", t.info->name,
                 "'; llmpar's Llama has no biases (its config.json must have attention_bias and mlp_bias false)");
    LLMPAR_CHECK(it != index.end(), t.file->path(), " holds the tensor '", t.info->name,
                 "', which is not part of Llama (a LlamaForCausalLM or LlamaModel checkpoint of transformers); "
                 "another architecture?");
    const Entry*& slot = found[it->second.tensor][it->second.part];
    LLMPAR_CHECK(slot == nullptr, folder, " holds Llama's '", table[it->second.tensor].parts[it->second.part].theirs,
                 "' twice (as '", slot->info->name, "' and '", t.info->name, "')");
    slot = &t;
  }
  for (std::size_t k = 0; k < table.size(); ++k)
    for (std::size_t p = 0; p < table[k].parts.size(); ++p) {
      const std::string& theirs = table[k].parts[p].theirs;
      LLMPAR_CHECK(found[k][p] != nullptr || theirs != "lm_head.weight", folder,
                   " has no tensor 'lm_head.weight', which the model's untied head needs; a checkpoint without one "
                   "ties its head to embed_tokens (tie_word_embeddings true in its config.json, read by "
                   "read_llama_config): load it into a model with tie_embeddings");
      LLMPAR_CHECK(found[k][p] != nullptr, folder, " has no tensor '", theirs, "' (nor '", detail::unprefixed(theirs),
                   "'), which Llama of ", cfg.layers, " layers needs; the checkpoint is incomplete");
    }

  // Shapes and dtypes: the token table first (it says the vocabulary and the width).
  for (std::size_t k = 0; k < table.size(); ++k)
    for (std::size_t p = 0; p < table[k].parts.size(); ++p) {
      const LlamaPart& part = table[k].parts[p];
      const Entry& e = *found[k][p];
      const std::vector<std::int64_t> want = detail::dims_of(part.hf_shape);
      LLMPAR_CHECK(e.info->shape == want, e.file->path(), ": tensor '", e.info->name, "' has shape ",
                   shape_text(e.info->shape), " but the model (--layers ", cfg.layers, " --heads ", cfg.heads,
                   " --kv-heads ", cfg.kv_heads, " --dim ", cfg.dim, " --ffn-dim ", cfg.ffn_dim, " --vocab ", cfg.vocab,
                   ") needs ", shape_text(want), "; use ", detail::llama_fix_for(part, e.info->shape, cfg));
      Tensors::check_float(e);
    }

  checkpoint::Snapshot s;
  std::int64_t total = 0;
  for (const LlamaTensor& t : table) total += t.shape.numel();
  s.data[0].assign(static_cast<std::size_t>(total), 0.0f);
  std::vector<float> values;
  std::int64_t at = 0;
  for (std::size_t k = 0; k < table.size(); ++k) {
    const LlamaTensor& t = table[k];
    float* out = s.data[0].data() + at;
    const std::int64_t cols = t.shape.rank == 2 ? t.shape[1] : 1;
    std::int64_t row = 0;  // of `out` where the part goes (stacked, qkv)
    for (std::size_t p = 0; p < t.parts.size(); ++p) {
      const LlamaPart& part = t.parts[p];
      const std::int64_t n = part.hf_shape.numel();
      float* into = out + row * cols;
      const bool permuted = (t.mapping == LlamaMapping::qkv && p == 0) || t.mapping == LlamaMapping::head_columns;
      if (permuted) {
        values.resize(static_cast<std::size_t>(n));
        Tensors::read_f32(*found[k][p], n, values.data());
        if (t.mapping == LlamaMapping::qkv)
          detail::permute_query_rows(values.data(), into, cfg.dim, cfg, detail::Toward::ours);
        else
          detail::permute_query_columns(values.data(), into, part.hf_shape[0], cfg, detail::Toward::ours);
      } else {
        Tensors::read_f32(*found[k][p], n, into);  // a table: the padding rows after it stay zero
      }
      row += part.hf_shape[0];
    }
    s.pieces.push_back({t.ours, t.shape, nn::Split{}, 0, t.shape.numel()});
    at += t.shape.numel();
  }
  if (tied_head != nullptr) {
    const safetensors::TensorInfo& embed = *found[0][0]->info;
    const safetensors::TensorInfo& head = *tied_head->info;
    LLMPAR_CHECK(head.dtype == embed.dtype && head.shape == embed.shape, tied_head->file->path(), ": '", head.name,
                 "' is ", safetensors::format_name(head.dtype), " ", shape_text(head.shape), " but '", embed.name,
                 "' is ", safetensors::format_name(embed.dtype), " ", shape_text(embed.shape),
                 "; the model ties its head to embed_tokens (tie_embeddings), so they must be one tensor: load an "
                 "untied checkpoint into an untied model (tie_word_embeddings false)");
    std::vector<std::byte> embed_bytes(static_cast<std::size_t>(embed.end - embed.begin));
    std::vector<std::byte> head_bytes(embed_bytes.size());
    found[0][0]->file->read_into(embed, 0, embed_bytes.size(), embed_bytes.data());
    tied_head->file->read_into(head, 0, head_bytes.size(), head_bytes.data());
    LLMPAR_CHECK(embed_bytes == head_bytes, tied_head->file->path(), ": '", head.name, "' differs from '", embed.name,
                 "', but the model ties its head to embed_tokens (tie_embeddings); an untied checkpoint loads into "
                 "an untied model (tie_word_embeddings false)");
  }
  s.state = {{"source", folder}};  // the moments stay empty: weights only
  return s;
}

LLMPAR_INLINE void write_llama(const std::string& dir, const checkpoint::Source& source,
                               const models::LlamaConfig& cfg) {
  cfg.validate();
  const std::vector<LlamaTensor> table = llama_tensors(cfg);
  std::vector<std::vector<float>> data;  // per HF tensor
  std::vector<safetensors::TensorRef> refs;
  std::vector<float> ours;
  for (const LlamaTensor& t : table) {
    ours.resize(static_cast<std::size_t>(t.shape.numel()));
    source.fill(checkpoint::Kind::param, t.ours, t.shape, nn::Split{}, 0, t.shape.numel(), ours.data());
    const std::int64_t cols = t.shape.rank == 2 ? t.shape[1] : 1;
    std::int64_t row = 0;  // of `ours` where the part starts
    for (std::size_t p = 0; p < t.parts.size(); ++p) {
      const LlamaPart& part = t.parts[p];
      const float* from = ours.data() + row * cols;
      std::vector<float>& out = data.emplace_back(static_cast<std::size_t>(part.hf_shape.numel()));
      if (t.mapping == LlamaMapping::qkv && p == 0)
        detail::permute_query_rows(from, out.data(), cfg.dim, cfg, detail::Toward::hf);
      else if (t.mapping == LlamaMapping::head_columns)
        detail::permute_query_columns(from, out.data(), part.hf_shape[0], cfg, detail::Toward::hf);
      else
        std::copy(from, from + out.size(), out.begin());  // a table: its real vocabulary's rows
      row += part.hf_shape[0];
    }
  }
  std::size_t k = 0;
  for (const LlamaTensor& t : table)
    for (const LlamaPart& part : t.parts)
      refs.push_back({part.theirs, DType::f32, detail::dims_of(part.hf_shape), data[k++].data()});
  detail::write_folder(dir, refs, detail::llama_config_json(cfg));
}

LLMPAR_INLINE Family family_of_folder(const std::string& folder) {
  const detail::ConfigJson c = detail::ConfigJson::read(folder);
  const std::string type = c.model_type();
  if (type == "gpt2") return Family::gpt2;
  if (type == "llama") return Family::llama;
  LLMPAR_FAIL(c.path,
              type.empty() ? " has neither model_type nor architectures" : " is the config of a '" + type + "' model",
              "; llmpar reads Hugging Face GPT-2 (model_type \"gpt2\") and Llama (\"llama\") models");
}

}  // namespace llmpar::checkpoint::hf
