// llmpar/checkpoint/hf_gpt2-inl.hpp — the bodies of hf_gpt2.hpp's Hugging Face GPT-2 import and export,
// and of the folder reading and writing every family shares.
//
// hf_gpt2.hpp includes this file unless LLMPAR_COMPILED is defined; a program that
// defines it compiles this file once, in the compiled part of llmpar (src/), where
// LLMPAR_INLINE is empty (config.hpp).
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "llmpar/checkpoint/hf_gpt2.hpp"

namespace llmpar::checkpoint::hf {

// ---- folders: config.json, the tensors of a file or a folder, writing a folder --------------

LLMPAR_INLINE detail::ConfigJson detail::ConfigJson::read(const std::string& folder) {
  namespace fs = std::filesystem;
  ConfigJson c;
  c.path = (fs::path(folder) / "config.json").string();
  LLMPAR_CHECK(fs::is_directory(folder), folder,
               " is not a directory; give the folder that save_pretrained wrote (config.json and model.safetensors)");
  std::ifstream in(c.path);
  LLMPAR_CHECK(in.good(), folder, " has no config.json (", c.path,
               "); give the folder that save_pretrained wrote, or a .safetensors file with the model's flags");
  std::ostringstream text;
  text << in.rdbuf();
  c.json = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  LLMPAR_CHECK(c.json.is_object(), c.path, " is not a JSON object (a config.json that save_pretrained wrote)");
  return c;
}

LLMPAR_INLINE std::string detail::ConfigJson::model_type() const {
  if (has("model_type")) return text("model_type", "");
  if (has("architectures") && json["architectures"].is_array() && !json["architectures"].empty() &&
      json["architectures"][0].is_string()) {
    const std::string a = json["architectures"][0].get<std::string>();
    if (a.starts_with("GPT2")) return "gpt2";
    if (a.starts_with("Llama")) return "llama";
    return a;
  }
  return "";
}

LLMPAR_INLINE std::int64_t detail::ConfigJson::integer(const char* key) const {
  LLMPAR_CHECK(has(key), path, " has no \"", key, "\", which the model's shape needs");
  const nlohmann::json& v = json[key];
  LLMPAR_CHECK(v.is_number_integer() || (v.is_number_float() && v.get<double>() == std::floor(v.get<double>())), path,
               ": \"", key, "\" is ", v.dump(), ", not an integer");
  return v.is_number_integer() ? v.get<std::int64_t>() : static_cast<std::int64_t>(v.get<double>());
}

LLMPAR_INLINE double detail::ConfigJson::number(const char* key, double fallback) const {
  if (!has(key)) return fallback;
  const nlohmann::json& v = json[key];
  LLMPAR_CHECK(v.is_number(), path, ": \"", key, "\" is ", v.dump(), ", not a number");
  return v.get<double>();
}

LLMPAR_INLINE bool detail::ConfigJson::boolean(const char* key, bool fallback) const {
  if (!has(key)) return fallback;
  const nlohmann::json& v = json[key];
  LLMPAR_CHECK(v.is_boolean(), path, ": \"", key, "\" is ", v.dump(), ", not true or false");
  return v.get<bool>();
}

LLMPAR_INLINE std::string detail::ConfigJson::text(const char* key, const std::string& fallback) const {
  if (!has(key)) return fallback;
  const nlohmann::json& v = json[key];
  LLMPAR_CHECK(v.is_string(), path, ": \"", key, "\" is ", v.dump(), ", not a string");
  return v.get<std::string>();
}

LLMPAR_INLINE void detail::write_folder(const std::string& dir, std::span<const safetensors::TensorRef> tensors,
                                        const nlohmann::ordered_json& config) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  LLMPAR_CHECK(fs::is_directory(dir), "cannot create the directory ", dir, " (", ec.message(),
               "); check the path and its permissions");
  const std::string weights = (fs::path(dir) / "model.safetensors").string();
  const std::string config_path = (fs::path(dir) / "config.json").string();
  safetensors::write(weights + ".partial", tensors, {{"format", "pt"}}, safetensors::Sync::yes);
  fs::rename(weights + ".partial", weights, ec);
  LLMPAR_CHECK(!ec, "cannot rename ", weights, ".partial to ", weights, " (", ec.message(), ")");
  checkpoint::detail::write_synced(config_path + ".partial", config.dump(2) + "\n");
  fs::rename(config_path + ".partial", config_path, ec);
  LLMPAR_CHECK(!ec, "cannot rename ", config_path, ".partial to ", config_path, " (", ec.message(), ")");
}

LLMPAR_INLINE Tensors Tensors::open(const std::string& path) {
  namespace fs = std::filesystem;
  Tensors t;
  t.path_ = path;
  if (!fs::is_directory(path)) {
    t.files_.push_back(std::make_unique<safetensors::File>(safetensors::File::open(path)));
    for (const safetensors::TensorInfo& info : t.files_.back()->tensors())
      t.entries_.push_back({&info, t.files_.back().get()});
    return t;
  }
  const fs::path single = fs::path(path) / "model.safetensors";
  const fs::path index_path = fs::path(path) / "model.safetensors.index.json";
  if (fs::exists(single)) return open(single.string());
  LLMPAR_CHECK(fs::exists(index_path), path,
               " holds neither model.safetensors nor model.safetensors.index.json (what save_pretrained writes); a "
               "pytorch_model.bin is not read: save the model again with safe_serialization=True");
  std::ifstream in(index_path);
  std::ostringstream text;
  text << in.rdbuf();
  const nlohmann::json index = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  const std::string index_name = index_path.string();
  LLMPAR_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), index_name,
               " is not a safetensors index (a JSON object with a \"weight_map\" of tensor names to shard files)");
  std::map<std::string, const safetensors::File*> shards;
  for (const auto& [name, shard] : index["weight_map"].items()) {
    LLMPAR_CHECK(shard.is_string(), index_name, ": the shard of tensor '", name, "' is ", shard.dump(),
                 ", not a file name");
    const std::string file = shard.get<std::string>();
    LLMPAR_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", index_name,
                 ": the shard of tensor '", name, "' is '", file, "', not a file in the folder");
    auto it = shards.find(file);
    if (it == shards.end()) {
      t.files_.push_back(
          std::make_unique<safetensors::File>(safetensors::File::open((fs::path(path) / file).string())));
      it = shards.emplace(file, t.files_.back().get()).first;
    }
    const safetensors::TensorInfo* info = it->second->find(name);
    LLMPAR_CHECK(info != nullptr, index_name, " puts tensor '", name, "' in ", it->second->path(),
                 ", which has no such tensor; the folder holds shards of another save (save it again)");
    t.entries_.push_back({info, it->second});
  }
  LLMPAR_CHECK(!t.entries_.empty(), index_name, " names no tensor");
  return t;
}

LLMPAR_INLINE void Tensors::check_float(const Entry& e) {
  const DType d = e.info->dtype;
  LLMPAR_CHECK(d == DType::f32 || d == DType::f16 || d == DType::bf16, e.file->path(), ": tensor '", e.info->name,
               "' is ", safetensors::format_name(d), "; weights are read from F32, F16 or BF16");
}

LLMPAR_INLINE void Tensors::read_f32(const Entry& e, std::int64_t n, float* out) {
  check_float(e);
  LLMPAR_CHECK(n >= 0 && n <= e.info->numel(), e.file->path(), ": tensor '", e.info->name, "' holds ", e.info->numel(),
               " elements, not the ", n, " asked for");
  std::vector<std::byte> bytes(static_cast<std::size_t>(n) * size_of(e.info->dtype));
  e.file->read_into(*e.info, 0, bytes.size(), bytes.data());
  detail::to_f32(e.info->dtype, bytes, out, n);
}

// ---- GPT-2 ------------------------------------------------------------------------------------

LLMPAR_INLINE models::GPT2Config read_gpt2_config(const std::string& folder) {
  const detail::ConfigJson c = detail::ConfigJson::read(folder);
  const std::string type = c.model_type();
  LLMPAR_CHECK(type == "gpt2", c.path, " is the config of a '", type.empty() ? "(no model_type)" : type,
               "' model, not GPT-2 (model_type \"gpt2\")",
               type == "llama" ? "; read it with read_llama_config (hf_llama.hpp)" : "");
  models::GPT2Config cfg;
  cfg.layers = c.integer("n_layer");
  cfg.heads = c.integer("n_head");
  cfg.dim = c.integer("n_embd");
  cfg.max_seq = c.integer("n_positions");
  cfg.vocab = c.integer("vocab_size");
  cfg.padded_vocab = models::GPT2Config::pad_vocab(cfg.vocab);
  cfg.init_std = static_cast<float>(c.number("initializer_range", 0.02));
  // What transformers' GPT-2 may compute and llmpar's does not.
  const std::string act = c.text("activation_function", "gelu_new");
  LLMPAR_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", c.path, ": activation_function is \"", act,
               "\"; llmpar's GPT-2 computes GELU's tanh approximation (\"gelu_new\")");
  const std::int64_t inner = c.integer("n_inner", 4 * cfg.dim);
  LLMPAR_CHECK(inner == 4 * cfg.dim, c.path, ": n_inner is ", inner,
               "; llmpar's GPT-2 has an MLP of 4 n_embd = ", 4 * cfg.dim, " units");
  const double eps = c.number("layer_norm_epsilon", 1e-5);
  LLMPAR_CHECK(std::abs(eps - 1e-5) <= 1e-11, c.path, ": layer_norm_epsilon is ", eps,
               "; llmpar's GPT-2 LayerNorms use 1e-5");
  LLMPAR_CHECK(c.boolean("scale_attn_weights", true), c.path,
               ": scale_attn_weights is false; llmpar's GPT-2 scales attention scores by 1 / sqrt(head size)");
  LLMPAR_CHECK(!c.boolean("scale_attn_by_inverse_layer_idx", false), c.path,
               ": scale_attn_by_inverse_layer_idx is true; llmpar's GPT-2 does not scale scores by the layer");
  LLMPAR_CHECK(c.boolean("tie_word_embeddings", true), c.path,
               ": tie_word_embeddings is false; llmpar's GPT-2 ties its head to wte");
  detail::validate_read(cfg, c.path);
  return cfg;
}

LLMPAR_INLINE checkpoint::Snapshot read_gpt2(const std::string& path, const models::GPT2Config& cfg) {
  using detail::shape_text;
  using Entry = Tensors::Entry;
  cfg.validate();
  check_standard_logits(cfg, "Hugging Face GPT-2 weights cannot be read into");
  const Tensors file = Tensors::open(path);
  const std::vector<Gpt2Tensor> table = gpt2_tensors(cfg);
  std::map<std::string, std::size_t, std::less<>> index;  // HF name -> table entry
  for (std::size_t k = 0; k < table.size(); ++k) index.emplace(table[k].theirs, k);

  // Every tensor of the file: one we need (at most once), a buffer, the tied head, or
  // an error. The depth first: a file of another --layers fails with that, not with the
  // first tensor the model lacks.
  std::int64_t file_layers = 0;
  for (const Entry& t : file.entries()) {
    std::string_view name = t.info->name;
    if (name.substr(0, detail::kPrefix.size()) == detail::kPrefix) name.remove_prefix(detail::kPrefix.size());
    if (const auto layer = detail::layer_of(name)) file_layers = std::max(file_layers, *layer + 1);
  }
  LLMPAR_CHECK(file_layers > 0, path, " holds no GPT-2 block (no tensor named h.0.*): not a GPT-2 file");
  LLMPAR_CHECK(file_layers == cfg.layers, path, " holds ", file_layers, file_layers == 1 ? " block" : " blocks",
               " (tensors h.0.* to h.", file_layers - 1, ".*) but the model has ", cfg.layers, " layers; use --layers ",
               file_layers);
  std::vector<const Entry*> found(table.size(), nullptr);
  const Entry* head = nullptr;
  for (const Entry& t : file.entries()) {
    std::string_view name = t.info->name;
    if (name.substr(0, detail::kPrefix.size()) == detail::kPrefix) name.remove_prefix(detail::kPrefix.size());
    if (detail::is_buffer(name)) continue;
    if (name == "lm_head.weight") {
      head = &t;
      continue;
    }
    const auto it = index.find(name);
    LLMPAR_CHECK(it != index.end(), path, " holds the tensor '", t.info->name,
                 "', which is not part of GPT-2 (a GPT2Model or GPT2LMHeadModel file of transformers); another "
                 "architecture?");
    LLMPAR_CHECK(found[it->second] == nullptr, path, " holds GPT-2's '", table[it->second].theirs, "' twice (as '",
                 found[it->second]->info->name, "' and '", t.info->name, "')");
    found[it->second] = &t;
  }
  for (std::size_t k = 0; k < table.size(); ++k)
    LLMPAR_CHECK(found[k] != nullptr, path, " has no tensor '", table[k].theirs, "' (nor '", detail::kPrefix,
                 table[k].theirs, "'), which GPT-2 of ", cfg.layers, " layers needs; the file is incomplete");

  // Shapes: the vocabulary and the width first (wte says both), then every tensor.
  const auto check_shape = [&](std::size_t k) {
    const Gpt2Tensor& e = table[k];
    const safetensors::TensorInfo& t = *found[k]->info;
    const std::vector<std::int64_t> want = detail::dims_of(e.hf_shape);
    const bool ok = e.mapping == Mapping::position_rows
                        ? t.shape.size() == 2 && t.shape[0] >= want[0] && t.shape[1] == want[1]
                        : t.shape == want;
    LLMPAR_CHECK(ok, found[k]->file->path(), ": tensor '", t.name, "' has shape ", shape_text(t.shape),
                 " but the model (--vocab ", cfg.vocab, " --dim ", cfg.dim, " --seq ", cfg.max_seq, ") needs ",
                 shape_text(want), e.mapping == Mapping::position_rows ? " (or more rows)" : "", "; use ",
                 detail::fix_for(e, t.shape, cfg));
    Tensors::check_float(*found[k]);
  };
  for (std::size_t k = 0; k < table.size(); ++k) check_shape(k);

  checkpoint::Snapshot s;
  std::int64_t total = 0;
  for (const Gpt2Tensor& e : table) total += e.shape.numel();
  s.data[0].assign(static_cast<std::size_t>(total), 0.0f);
  std::vector<float> values;
  std::int64_t at = 0;
  for (std::size_t k = 0; k < table.size(); ++k) {
    const Gpt2Tensor& e = table[k];
    const std::int64_t n = e.hf_shape.numel();  // wpe: its first max_seq rows
    float* out = s.data[0].data() + at;
    if (e.mapping == Mapping::transposed) {
      values.resize(static_cast<std::size_t>(n));
      Tensors::read_f32(*found[k], n, values.data());
      detail::transpose(values.data(), e.hf_shape[0], e.hf_shape[1], out);
    } else {
      Tensors::read_f32(*found[k], n, out);  // wte: the padding rows after it stay zero
    }
    s.pieces.push_back({e.ours, e.shape, nn::Split{}, 0, e.shape.numel()});
    at += e.shape.numel();
  }
  if (head != nullptr) {
    const safetensors::TensorInfo& wte = *found[0]->info;
    const safetensors::TensorInfo& lm = *head->info;
    LLMPAR_CHECK(lm.dtype == wte.dtype && lm.shape == wte.shape, head->file->path(), ": lm_head.weight is ",
                 safetensors::format_name(lm.dtype), " ", shape_text(lm.shape), " but '", wte.name, "' is ",
                 safetensors::format_name(wte.dtype), " ", shape_text(wte.shape),
                 "; GPT-2 ties its head to the token table (an untied head cannot be loaded)");
    std::vector<std::byte> table_bytes(static_cast<std::size_t>(wte.end - wte.begin));
    std::vector<std::byte> head_bytes(table_bytes.size());
    found[0]->file->read_into(wte, 0, table_bytes.size(), table_bytes.data());
    head->file->read_into(lm, 0, head_bytes.size(), head_bytes.data());
    LLMPAR_CHECK(table_bytes == head_bytes, head->file->path(), ": lm_head.weight differs from '", wte.name,
                 "'; GPT-2 ties its head to the token table, and a model with an untied head cannot be loaded");
  }
  s.state = {{"source", path}};  // the moments stay empty: weights only
  return s;
}

namespace detail {

// write_gpt2's tensors: HF's names, shapes and order, their values in `data`.
inline std::vector<safetensors::TensorRef> gpt2_refs(const checkpoint::Source& source, const models::GPT2Config& cfg,
                                                     std::vector<std::vector<float>>& data) {
  cfg.validate();
  check_standard_logits(cfg, "Hugging Face GPT-2 weights cannot be written from");
  const std::vector<Gpt2Tensor> table = gpt2_tensors(cfg);
  data.assign(table.size(), {});
  std::vector<float> ours;
  std::vector<safetensors::TensorRef> refs;
  for (std::size_t k = 0; k < table.size(); ++k) {
    const Gpt2Tensor& e = table[k];
    ours.resize(static_cast<std::size_t>(e.shape.numel()));
    source.fill(checkpoint::Kind::param, e.ours, e.shape, nn::Split{}, 0, e.shape.numel(), ours.data());
    std::vector<float>& out = data[k];
    out.resize(static_cast<std::size_t>(e.hf_shape.numel()));
    if (e.mapping == Mapping::transposed) {
      transpose(ours.data(), e.shape[0], e.shape[1], out.data());
    } else {
      std::copy(ours.begin(), ours.begin() + static_cast<std::ptrdiff_t>(out.size()), out.begin());  // wte: unpadded
    }
    refs.push_back({e.theirs, DType::f32, dims_of(e.hf_shape), out.data()});
  }
  return refs;
}

}  // namespace detail

LLMPAR_INLINE void write_gpt2(const std::string& path, const checkpoint::Source& source,
                              const models::GPT2Config& cfg) {
  std::vector<std::vector<float>> data;
  safetensors::write(path, detail::gpt2_refs(source, cfg, data), {{"format", "pt"}});
}

LLMPAR_INLINE void write_gpt2_folder(const std::string& dir, const checkpoint::Source& source,
                                     const models::GPT2Config& cfg) {
  std::vector<std::vector<float>> data;
  const std::vector<safetensors::TensorRef> refs = detail::gpt2_refs(source, cfg, data);
  // GPT2LMHeadModel of our model: GELU-tanh, LayerNorm epsilon 1e-5, an MLP of 4 C, no
  // dropout (llmpar trains without), the head tied to wte.
  nlohmann::ordered_json config = {{"architectures", nlohmann::ordered_json::array({"GPT2LMHeadModel"})},
                                   {"model_type", "gpt2"},
                                   {"vocab_size", cfg.vocab},
                                   {"n_positions", cfg.max_seq},
                                   {"n_ctx", cfg.max_seq},
                                   {"n_embd", cfg.dim},
                                   {"n_layer", cfg.layers},
                                   {"n_head", cfg.heads},
                                   {"n_inner", nullptr},
                                   {"activation_function", "gelu_new"},
                                   {"layer_norm_epsilon", 1e-5},
                                   {"initializer_range", detail::json_number(cfg.init_std)},
                                   {"resid_pdrop", 0.0},
                                   {"embd_pdrop", 0.0},
                                   {"attn_pdrop", 0.0},
                                   {"scale_attn_weights", true},
                                   {"scale_attn_by_inverse_layer_idx", false},
                                   {"reorder_and_upcast_attn", false},
                                   {"tie_word_embeddings", true},
                                   {"torch_dtype", "float32"}};
  // transformers' default bos and eos ids are GPT-2's <|endoftext|>, 50256: left so when
  // the vocabulary holds it, none where it does not (a byte vocabulary).
  if (cfg.vocab <= 50256) config["bos_token_id"] = config["eos_token_id"] = nullptr;
  detail::write_folder(dir, refs, config);
}

}  // namespace llmpar::checkpoint::hf
