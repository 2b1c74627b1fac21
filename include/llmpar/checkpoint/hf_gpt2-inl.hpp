// llmpar/checkpoint/hf_gpt2-inl.hpp — the bodies of hf_gpt2.hpp's Hugging Face GPT-2 import and export.
//
// hf_gpt2.hpp includes this file unless LLMPAR_COMPILED is defined; a program that
// defines it compiles this file once, in the compiled part of llmpar (src/), where
// LLMPAR_INLINE is empty (config.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "llmpar/checkpoint/hf_gpt2.hpp"

namespace llmpar::checkpoint::hf {

LLMPAR_INLINE checkpoint::Snapshot read_gpt2(const std::string& path, const models::GPT2Config& cfg) {
  using detail::shape_text;
  cfg.validate();
  check_standard_logits(cfg, "Hugging Face GPT-2 weights cannot be read into");
  const safetensors::File file = safetensors::File::open(path);
  const std::vector<Gpt2Tensor> table = gpt2_tensors(cfg);
  std::map<std::string, std::size_t, std::less<>> index;  // HF name -> table entry
  for (std::size_t k = 0; k < table.size(); ++k) index.emplace(table[k].theirs, k);

  // Every tensor of the file: one we need (at most once), a buffer, the tied head, or
  // an error. The depth first: a file of another --layers fails with that, not with the
  // first tensor the model lacks.
  std::int64_t file_layers = 0;
  for (const safetensors::TensorInfo& t : file.tensors()) {
    std::string_view name = t.name;
    if (name.substr(0, detail::kPrefix.size()) == detail::kPrefix) name.remove_prefix(detail::kPrefix.size());
    if (const auto layer = detail::layer_of(name)) file_layers = std::max(file_layers, *layer + 1);
  }
  LLMPAR_CHECK(file_layers > 0, path, " holds no GPT-2 block (no tensor named h.0.*): not a GPT-2 file");
  LLMPAR_CHECK(file_layers == cfg.layers, path, " holds ", file_layers, file_layers == 1 ? " block" : " blocks",
               " (tensors h.0.* to h.", file_layers - 1, ".*) but the model has ", cfg.layers, " layers; use --layers ",
               file_layers);
  std::vector<const safetensors::TensorInfo*> found(table.size(), nullptr);
  const safetensors::TensorInfo* head = nullptr;
  for (const safetensors::TensorInfo& t : file.tensors()) {
    std::string_view name = t.name;
    if (name.substr(0, detail::kPrefix.size()) == detail::kPrefix) name.remove_prefix(detail::kPrefix.size());
    if (detail::is_buffer(name)) continue;
    if (name == "lm_head.weight") {
      head = &t;
      continue;
    }
    const auto it = index.find(name);
    LLMPAR_CHECK(it != index.end(), path, " holds the tensor '", t.name,
                 "', which is not part of GPT-2 (a GPT2Model or GPT2LMHeadModel file of transformers); another "
                 "architecture?");
    LLMPAR_CHECK(found[it->second] == nullptr, path, " holds GPT-2's '", table[it->second].theirs, "' twice (as '",
                 found[it->second]->name, "' and '", t.name, "')");
    found[it->second] = &t;
  }
  for (std::size_t k = 0; k < table.size(); ++k)
    LLMPAR_CHECK(found[k] != nullptr, path, " has no tensor '", table[k].theirs, "' (nor '", detail::kPrefix,
                 table[k].theirs, "'), which GPT-2 of ", cfg.layers, " layers needs; the file is incomplete");

  // Shapes: the vocabulary and the width first (wte says both), then every tensor.
  const auto check_shape = [&](std::size_t k) {
    const Gpt2Tensor& e = table[k];
    const safetensors::TensorInfo& t = *found[k];
    const std::vector<std::int64_t> want = detail::dims_of(e.hf_shape);
    const bool ok = e.mapping == Mapping::position_rows
                        ? t.shape.size() == 2 && t.shape[0] >= want[0] && t.shape[1] == want[1]
                        : t.shape == want;
    LLMPAR_CHECK(ok, path, ": tensor '", t.name, "' has shape ", shape_text(t.shape), " but the model (--vocab ",
                 cfg.vocab, " --dim ", cfg.dim, " --seq ", cfg.max_seq, ") needs ", shape_text(want),
                 e.mapping == Mapping::position_rows ? " (or more rows)" : "", "; use ",
                 detail::fix_for(e, t.shape, cfg));
    LLMPAR_CHECK(t.dtype == DType::f32 || t.dtype == DType::f16 || t.dtype == DType::bf16, path, ": tensor '", t.name,
                 "' is ", safetensors::format_name(t.dtype), "; GPT-2's weights are read from F32, F16 or BF16");
  };
  for (std::size_t k = 0; k < table.size(); ++k) check_shape(k);

  checkpoint::Snapshot s;
  std::int64_t total = 0;
  for (const Gpt2Tensor& e : table) total += e.shape.numel();
  s.data[0].assign(static_cast<std::size_t>(total), 0.0f);
  std::vector<std::byte> bytes;
  std::vector<float> values;
  std::int64_t at = 0;
  for (std::size_t k = 0; k < table.size(); ++k) {
    const Gpt2Tensor& e = table[k];
    const safetensors::TensorInfo& t = *found[k];
    const std::int64_t n = e.hf_shape.numel();  // wpe: its first max_seq rows
    bytes.resize(static_cast<std::size_t>(n) * size_of(t.dtype));
    file.read_into(t, 0, bytes.size(), bytes.data());
    float* out = s.data[0].data() + at;
    if (e.mapping == Mapping::transposed) {
      values.resize(static_cast<std::size_t>(n));
      detail::to_f32(t.dtype, bytes, values.data(), n);
      detail::transpose(values.data(), e.hf_shape[0], e.hf_shape[1], out);
    } else {
      detail::to_f32(t.dtype, bytes, out, n);  // wte: the padding rows after it stay zero
    }
    s.pieces.push_back({e.ours, e.shape, nn::Split{}, 0, e.shape.numel()});
    at += e.shape.numel();
  }
  if (head != nullptr) {
    const safetensors::TensorInfo& wte = *found[0];
    LLMPAR_CHECK(head->dtype == wte.dtype && head->shape == wte.shape, path, ": lm_head.weight is ",
                 safetensors::format_name(head->dtype), " ", shape_text(head->shape), " but '", wte.name, "' is ",
                 safetensors::format_name(wte.dtype), " ", shape_text(wte.shape),
                 "; GPT-2 ties its head to the token table (an untied head cannot be loaded)");
    std::vector<std::byte> table_bytes(static_cast<std::size_t>(wte.end - wte.begin));
    std::vector<std::byte> head_bytes(table_bytes.size());
    file.read_into(wte, 0, table_bytes.size(), table_bytes.data());
    file.read_into(*head, 0, head_bytes.size(), head_bytes.data());
    LLMPAR_CHECK(table_bytes == head_bytes, path, ": lm_head.weight differs from '", wte.name,
                 "'; GPT-2 ties its head to the token table, and a model with an untied head cannot be loaded");
  }
  s.state = {{"source", path}};  // the moments stay empty: weights only
  return s;
}

LLMPAR_INLINE void write_gpt2(const std::string& path, const checkpoint::Source& source,
                              const models::GPT2Config& cfg) {
  cfg.validate();
  check_standard_logits(cfg, "Hugging Face GPT-2 weights cannot be written from");
  const std::vector<Gpt2Tensor> table = gpt2_tensors(cfg);
  std::vector<std::vector<float>> data(table.size());
  std::vector<float> ours;
  std::vector<safetensors::TensorRef> refs;
  for (std::size_t k = 0; k < table.size(); ++k) {
    const Gpt2Tensor& e = table[k];
    ours.resize(static_cast<std::size_t>(e.shape.numel()));
    source.fill(checkpoint::Kind::param, e.ours, e.shape, nn::Split{}, 0, e.shape.numel(), ours.data());
    std::vector<float>& out = data[k];
    out.resize(static_cast<std::size_t>(e.hf_shape.numel()));
    if (e.mapping == Mapping::transposed) {
      detail::transpose(ours.data(), e.shape[0], e.shape[1], out.data());
    } else {
      std::copy(ours.begin(), ours.begin() + static_cast<std::ptrdiff_t>(out.size()), out.begin());  // wte: unpadded
    }
    refs.push_back({e.theirs, DType::f32, detail::dims_of(e.hf_shape), out.data()});
  }
  safetensors::write(path, refs, {{"format", "pt"}});
}

}  // namespace llmpar::checkpoint::hf
