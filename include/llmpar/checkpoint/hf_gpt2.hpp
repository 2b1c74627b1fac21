// llmpar/checkpoint/hf_gpt2.hpp — GPT-2 weights in Hugging Face's safetensors layout, in and
// out: start a run from the hub's gpt2 (or any transformers GPT-2), hand a trained model
// to transformers.
//
// What differs from our layout, and nothing else (one table, gpt2_tensors(), says it for
// both directions, so an import and an export cannot drift apart):
//  - names: HF's "wte.weight" and "wpe.weight" are our "wte" and "wpe"; a block's names
//    are ours. GPT2LMHeadModel.save_pretrained prefixes every name with "transformer.".
//  - every matrix of a block is a Conv1D in transformers, stored (in, out): the
//    transpose of nn::Linear's (out, in). c_attn's columns are q, then k, then v, like
//    our rows.
//  - the token table: HF has the real vocabulary's rows, we pad it to padded_vocab with
//    zero rows (never looked up, their logits never in the loss).
//  - the position table: a file's n_positions may exceed our max_seq (the hub's gpt2
//    has 1024); the first max_seq rows are taken, which is what the model would read at
//    positions 0 .. max_seq-1. Fewer rows than max_seq is an error.
//  - transformers' files may hold per-layer buffers (attn.bias, the causal mask, and
//    attn.masked_bias): not parameters, ignored. GPT2LMHeadModel may also store
//    lm_head.weight: GPT-2 ties it to wte, so it must equal wte bit for bit; an untied
//    head has no place in our model and is an error rather than silently dropped.
//
// Reading converts F32, F16 and BF16 to f32 and yields a checkpoint::Snapshot of whole
// tensors (moments zero), so Trainer::load_weights(checkpoint::Source::of(snapshot))
// fills a model at any layout (tp, pp, ZeRO) the way a checkpoint does. Every check a
// file can fail (a missing, unknown or misshapen tensor, another vocabulary, width or
// depth) is an error naming the file, the tensor, both shapes and the flag that would
// make the model match. The heads cannot be seen in the weights: --heads is unchecked.
//
// A µP model (GPT2Config::mup) wider than its base multiplies its logits by 1 / width
// multiplier, which HF's GPT-2 has no place for: reading into one and writing one are
// errors (at the base width µP is the standard model, and both work).
//
// Writing reads every tensor whole from a checkpoint::Source (a checkpoint directory's,
// or a one-rank snapshot's: it must hold every element), and stores F32 in HF's names
// (no prefix) and order, with the metadata {"format": "pt"} that transformers'
// from_pretrained expects of a safetensors file.
//
// Folders. What save_pretrained writes and from_pretrained reads is a folder:
// config.json, and model.safetensors or (above its max_shard_size) the shards that
// model.safetensors.index.json's weight_map names. This file holds what every family's
// folder shares (hf_llama.hpp's Llama uses it too): hf::Tensors, the tensors of a file or
// of a folder, read_gpt2 and read_llama's one way in; detail::ConfigJson, config.json's
// values read with an error naming the key, the value and the file; and
// detail::write_folder, which writes the two files under temporary names and renames
// them into place, so a folder never holds a half-written model.safetensors.
// read_gpt2 takes a file or a folder; read_gpt2_config reads a GPT-2 config.json (and
// refuses one whose model llmpar's GPT-2 does not compute: another activation, epsilon,
// MLP width or attention scaling); write_gpt2_folder writes a folder that
// GPT2LMHeadModel.from_pretrained loads.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "llmpar/checkpoint/checkpoint.hpp"
#include "llmpar/checkpoint/safetensors.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::checkpoint::hf {

// How one of our tensors is stored in HF's layout.
enum class Mapping {
  same,           // the same shape and values
  transposed,     // a Conv1D weight: HF (in, out), ours (out, in)
  vocab_rows,     // wte: HF the first `vocab` rows of our padded_vocab
  position_rows,  // wpe: HF n_positions >= max_seq rows, of which we hold the first max_seq
};

// One GPT-2 tensor in both namings.
struct Gpt2Tensor {
  std::string ours;    // "h.0.attn.c_attn.weight"
  std::string theirs;  // HF's name without the "transformer." prefix
  Shape shape;         // ours, the full tensor
  Shape hf_shape;      // what write_gpt2 stores (a file's wpe may have more rows)
  Mapping mapping = Mapping::same;
};

// Every tensor of GPT-2 under cfg, in HF's order (wte, wpe, h.0 ..., ln_f).
inline std::vector<Gpt2Tensor> gpt2_tensors(const models::GPT2Config& cfg) {
  const std::int64_t C = cfg.dim;
  std::vector<Gpt2Tensor> t;
  t.push_back({"wte", "wte.weight", Shape{cfg.padded_vocab, C}, Shape{cfg.vocab, C}, Mapping::vocab_rows});
  t.push_back({"wpe", "wpe.weight", Shape{cfg.max_seq, C}, Shape{cfg.max_seq, C}, Mapping::position_rows});
  // A block's tensors: (out, in) in multiples of C, in = 0 for a vector. Every matrix
  // of a GPT-2 block is a Conv1D.
  struct BlockTensor {
    const char* suffix;
    std::int64_t out, in;
  };
  static constexpr BlockTensor kBlock[] = {
      {"ln_1.weight", 1, 0},      {"ln_1.bias", 1, 0},          {"attn.c_attn.weight", 3, 1},
      {"attn.c_attn.bias", 3, 0}, {"attn.c_proj.weight", 1, 1}, {"attn.c_proj.bias", 1, 0},
      {"ln_2.weight", 1, 0},      {"ln_2.bias", 1, 0},          {"mlp.c_fc.weight", 4, 1},
      {"mlp.c_fc.bias", 4, 0},    {"mlp.c_proj.weight", 1, 4},  {"mlp.c_proj.bias", 1, 0},
  };
  for (std::int64_t i = 0; i < cfg.layers; ++i)
    for (const BlockTensor& b : kBlock) {
      const std::string name = "h." + std::to_string(i) + "." + b.suffix;
      if (b.in == 0)
        t.push_back({name, name, Shape{b.out * C}, Shape{b.out * C}, Mapping::same});
      else
        t.push_back({name, name, Shape{b.out * C, b.in * C}, Shape{b.in * C, b.out * C}, Mapping::transposed});
    }
  for (const char* name : {"ln_f.weight", "ln_f.bias"}) t.push_back({name, name, Shape{C}, Shape{C}, Mapping::same});
  return t;
}

namespace detail {

inline constexpr std::string_view kPrefix = "transformer.";

template <class Dims>
std::string shape_text(const Dims& dims) {
  std::ostringstream out;
  out << '(';
  for (std::size_t i = 0; i < dims.size(); ++i) out << (i ? "," : "") << dims[i];
  out << ')';
  return out.str();
}
inline std::string shape_text(const Shape& s) {
  return shape_text(std::vector<std::int64_t>(s.dims.begin(), s.dims.begin() + s.rank));
}

inline std::vector<std::int64_t> dims_of(const Shape& s) { return {s.dims.begin(), s.dims.begin() + s.rank}; }

// "h.12.attn.bias" -> 12 for a name under h.N. (else nullopt); `rest` gets what follows.
// `blocks` is the blocks' prefix (Llama's "layers.").
inline std::optional<std::int64_t> layer_of(std::string_view name, std::string_view* rest = nullptr,
                                            std::string_view blocks = "h.") {
  if (name.substr(0, blocks.size()) != blocks) return std::nullopt;
  const std::size_t first = blocks.size();
  std::size_t i = first;
  std::int64_t layer = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i < first + 10) layer = layer * 10 + (name[i++] - '0');
  if (i == first || i >= name.size() || name[i] != '.') return std::nullopt;
  if (rest != nullptr) *rest = name.substr(i + 1);
  return layer;
}

// transformers' per-layer buffers: the causal mask and the masked-score constant.
inline bool is_buffer(std::string_view name) {
  std::string_view rest;
  return layer_of(name, &rest) && (rest == "attn.bias" || rest == "attn.masked_bias");
}

// The flag that makes cfg match a file whose tensor `e` has shape `got`.
inline std::string fix_for(const Gpt2Tensor& e, const std::vector<std::int64_t>& got, const models::GPT2Config& cfg) {
  const std::int64_t C = cfg.dim;
  if (e.mapping == Mapping::vocab_rows && got.size() == 2) {
    if (got[0] != cfg.vocab) return llmpar::detail::concat("--vocab ", got[0]);
    return llmpar::detail::concat("--dim ", got[1]);
  }
  if (e.mapping == Mapping::position_rows && got.size() == 2) {
    if (got[1] != C) return llmpar::detail::concat("--dim ", got[1]);
    return llmpar::detail::concat("--seq ", got[0], " or less");
  }
  // A block's or ln_f's tensor: every dimension a multiple of C. The file's C is its first
  // dimension over that multiple, if the other dimensions agree with it.
  const std::vector<std::int64_t> want = dims_of(e.hf_shape);
  if (got.size() == want.size() && !got.empty() && got[0] % (want[0] / C) == 0) {
    const std::int64_t file_c = got[0] / (want[0] / C);
    bool agree = true;
    for (std::size_t d = 0; d < want.size(); ++d) agree = agree && got[d] == want[d] / C * file_c;
    if (agree) return llmpar::detail::concat("--dim ", file_c);
  }
  return "the model's --dim; but this shape is not GPT-2's layout of the tensor (a Conv1D weight is (in, out))";
}

// dst (cols, rows) = the transpose of src (rows, cols): a Conv1D weight to nn::Linear's
// layout, and back.
inline void transpose(const float* src, std::int64_t rows, std::int64_t cols, float* dst) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

// n f32 values from `bytes` of dtype `t` (F32, F16 or BF16).
inline void to_f32(DType t, const std::vector<std::byte>& bytes, float* out, std::int64_t n) {
  if (t == DType::f32) {
    std::memcpy(out, bytes.data(), static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    out[i] = t == DType::bf16 ? llmpar::detail::bf16_bits_to_float(h) : llmpar::detail::f16_bits_to_float(h);
  }
}

// config.json's number for a float of ours: the float's shortest decimal (1e-05, not
// the 9.99999974737875e-06 of the float widened to double), as transformers writes it.
inline double json_number(float v) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, v).ptr;
  double d = 0.0;
  std::from_chars(text, end, d);
  return d;
}

// A config.json that save_pretrained wrote, read a key at a time: a value of the wrong
// type is an error naming the key, the value and the file. A key that is absent (or
// null) takes the default transformers gives it, which is what from_pretrained would
// compute with.
struct ConfigJson {
  std::string path;  // FOLDER/config.json
  nlohmann::json json;

  static ConfigJson read(const std::string& folder);

  bool has(const char* key) const { return json.contains(key) && !json[key].is_null(); }
  // model_type, or the family of the first of `architectures` when it is absent ("" if neither).
  std::string model_type() const;
  // A value that must be there (transformers has no default for it, or llmpar needs it given).
  std::int64_t integer(const char* key) const;
  std::int64_t integer(const char* key, std::int64_t fallback) const { return has(key) ? integer(key) : fallback; }
  double number(const char* key, double fallback) const;
  bool boolean(const char* key, bool fallback) const;
  std::string text(const char* key, const std::string& fallback) const;
};

// cfg.validate(), its error prefixed with the config.json it was read from.
template <class Config>
void validate_read(const Config& cfg, const std::string& path) {
  try {
    cfg.validate();
  } catch (const Error& e) {
    LLMPAR_FAIL(path, " describes a model llmpar cannot build: ", e.what());
  }
}

// Writes `dir` as save_pretrained does: dir/model.safetensors (`tensors`, with the
// metadata {"format": "pt"}) and dir/config.json (`config`), each written under a
// temporary name, fsynced and renamed into place (the weights first). Creates dir.
LLMPAR_INLINE void write_folder(const std::string& dir, std::span<const safetensors::TensorRef> tensors,
                                const nlohmann::ordered_json& config);

}  // namespace detail

// The tensors of a Hugging Face model: one safetensors file, or a folder that
// save_pretrained wrote, holding model.safetensors or model.safetensors.index.json and
// the shards its weight_map names (each tensor in the shard the map says). Only the
// headers are read when it opens; a tensor's values when asked for.
class Tensors {
 public:
  struct Entry {
    const safetensors::TensorInfo* info;  // its name, dtype, shape
    const safetensors::File* file;        // the file holding it (file->path() names it in errors)
  };

  // `path`: a .safetensors file, or a folder.
  static Tensors open(const std::string& path);

  const std::string& path() const { return path_; }
  std::span<const Entry> entries() const { return entries_; }

  // Fails unless e holds floating-point weights (F32, F16 or BF16).
  static void check_float(const Entry& e);
  // out (n) = e's first n elements as f32.
  static void read_f32(const Entry& e, std::int64_t n, float* out);

 private:
  std::string path_;
  std::vector<std::unique_ptr<safetensors::File>> files_;  // unmoving: entries point into them
  std::vector<Entry> entries_;
};

// The GPT-2 of a config.json that GPT2LMHeadModel.save_pretrained wrote (or the hub's
// gpt2): n_layer, n_head, n_embd, n_positions (max_seq) and vocab_size (padded_vocab
// rounded up to a multiple of 128), initializer_range. A config llmpar's GPT-2 would
// compute differently from (another model_type, activation, layer_norm_epsilon, n_inner,
// attention scaling, or an untied head) is an error naming the key and its value.
LLMPAR_INLINE models::GPT2Config read_gpt2_config(const std::string& folder);

// Fails unless cfg computes what HF's GPT-2 of the same weights computes: µP's output
// multiplier (above its base width) has no counterpart there. `what` says which way the
// weights were to go (read_gpt2 and write_gpt2 check; a trainer may check first).
inline void check_standard_logits(const models::GPT2Config& cfg, const char* what) {
  LLMPAR_CHECK(cfg.output_multiplier() == 1.0, what, " a µP model of width multiplier ", cfg.width_mult(),
               " (--mup, --dim ", cfg.dim, " over --mup-base-dim ", cfg.mup_base_dim,
               "): its logits are multiplied by 1/", cfg.width_mult(),
               ", which Hugging Face's GPT-2 has no place for; train without --mup, or at --dim equal to "
               "--mup-base-dim, to exchange weights with it");
}

// The GPT-2 in HF safetensors file `path` (or in the folder `path`, see Tensors),
// checked against cfg, as whole tensors in our names and layout (wte padded with zero
// rows to cfg.padded_vocab, wpe cut to cfg.max_seq rows), without moments. Load it with
// trainer.load_weights(checkpoint::Source::of(snapshot)) — the Source reads the
// snapshot in place, so keep the snapshot alive while the Source is used.
LLMPAR_INLINE checkpoint::Snapshot read_gpt2(const std::string& path, const models::GPT2Config& cfg);

// GPT-2 under cfg, read whole from `source` (every element of every tensor), written to
// `path` as an HF safetensors file (F32, HF's names and order, {"format": "pt"}).
LLMPAR_INLINE void write_gpt2(const std::string& path, const checkpoint::Source& source, const models::GPT2Config& cfg);

// The same tensors as write_gpt2's, as a folder GPT2LMHeadModel.from_pretrained loads:
// dir/model.safetensors and dir/config.json (detail::write_folder).
LLMPAR_INLINE void write_gpt2_folder(const std::string& dir, const checkpoint::Source& source,
                                     const models::GPT2Config& cfg);

}  // namespace llmpar::checkpoint::hf

// The bodies: compiled here (header-only), or once in a program that defines
// LLMPAR_COMPILED and links the compiled part of llmpar (config.hpp).
#if !defined(LLMPAR_COMPILED)
#include "llmpar/checkpoint/hf_gpt2-inl.hpp"
#endif
