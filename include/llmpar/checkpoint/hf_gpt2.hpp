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
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
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
inline std::optional<std::int64_t> layer_of(std::string_view name, std::string_view* rest = nullptr) {
  if (name.substr(0, 2) != "h.") return std::nullopt;
  std::size_t i = 2;
  std::int64_t layer = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i < 12) layer = layer * 10 + (name[i++] - '0');
  if (i == 2 || i >= name.size() || name[i] != '.') return std::nullopt;
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

}  // namespace detail

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

// The GPT-2 in HF safetensors file `path`, checked against cfg, as whole tensors in our
// names and layout (wte padded with zero rows to cfg.padded_vocab, wpe cut to
// cfg.max_seq rows), without moments. Load it with
// trainer.load_weights(checkpoint::Source::of(snapshot)) — the Source reads the
// snapshot in place, so keep the snapshot alive while the Source is used.
LLMPAR_INLINE checkpoint::Snapshot read_gpt2(const std::string& path, const models::GPT2Config& cfg);

// GPT-2 under cfg, read whole from `source` (every element of every tensor), written to
// `path` as an HF safetensors file (F32, HF's names and order, {"format": "pt"}).
LLMPAR_INLINE void write_gpt2(const std::string& path, const checkpoint::Source& source, const models::GPT2Config& cfg);

}  // namespace llmpar::checkpoint::hf

// The bodies: compiled here (header-only), or once in a program that defines
// LLMPAR_COMPILED and links the compiled part of llmpar (config.hpp).
#if !defined(LLMPAR_COMPILED)
#include "llmpar/checkpoint/hf_gpt2-inl.hpp"
#endif
