// llmpar/data/tokenizer.hpp — the Tokenizer concept and the byte tokenizer.
//
// A tokenizer maps text to uint16 token ids and back; uint16 because that is what a
// version-1 shard stores (GPT-2's 50257-token BPE fits). The concept is all a trainer
// and prepare_data rely on, so a BPE tokenizer can be dropped in later without touching
// them. The byte tokenizer is the one llmpar ships: vocabulary 256, token = byte. It
// needs no vocabulary file, round-trips any input exactly (UTF-8 or not), and is what
// the embedded fortunes corpus is trained with.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::data {

template <class T>
concept Tokenizer = requires(const T& tok, std::string_view text, std::span<const std::uint16_t> ids) {
  { tok.vocab_size() } -> std::convertible_to<int>;
  { tok.encode(text) } -> std::same_as<std::vector<std::uint16_t>>;
  { tok.decode(ids) } -> std::same_as<std::string>;
};

class ByteTokenizer {
 public:
  static constexpr int kVocabSize = 256;

  constexpr int vocab_size() const { return kVocabSize; }

  std::vector<std::uint16_t> encode(std::string_view text) const {
    std::vector<std::uint16_t> ids(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }

  // Ids outside the vocabulary are an error rather than a wrapped byte: they mean the
  // ids came from a model or shard with a different vocabulary.
  std::string decode(std::span<const std::uint16_t> ids) const {
    std::string text(ids.size(), '\0');
    for (std::size_t i = 0; i < ids.size(); ++i) {
      LLMPAR_CHECK(ids[i] < kVocabSize, "byte tokenizer cannot decode token id ", ids[i], " at position ", i,
                   ": its vocabulary is ", kVocabSize,
                   " bytes; the ids come from a different tokenizer or a model with a larger vocabulary");
      text[i] = static_cast<char>(static_cast<unsigned char>(ids[i]));
    }
    return text;
  }
};

static_assert(Tokenizer<ByteTokenizer>, "ByteTokenizer must model the Tokenizer concept");

}  // namespace llmpar::data
