// What the model tests share: random token ids. (The finite-difference check of a
// model's gradients is the library's own, llmpar/testing/gradcheck.hpp.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "llmpar/core/rng.hpp"

namespace llmpar::model_test {

// n token ids in [0, vocab) from the stream (seed, "tokens").
inline std::vector<std::int32_t> random_tokens(std::int64_t n, std::int64_t vocab, std::uint64_t seed) {
  const auto s = rng::Stream::named(seed, "tokens");
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    t[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(s.bits(static_cast<std::uint64_t>(i))[0] % vocab);
  return t;
}

}  // namespace llmpar::model_test
