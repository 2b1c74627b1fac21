// llmpar/train/sample.hpp — autoregressive sampling from a trained model.
//
// Each new token re-runs the forward over the last max_seq tokens (no KV cache): simple
// and exact, and cheap for the models a CPU samples from. Draws come from the
// counter-based RNG, so a (seed, prompt) pair always gives the same text. The last
// position's logits are copied to the host (from the device on the CUDA backend) and
// the draw happens there, so both backends sample alike. A model split over a
// tensor-parallel group gathers that one row over the group (Model::logits_row): every
// rank draws the same token. SampleConfig::vocab draws among the first ids only (the
// softmax over those logits): the ids a tokenizer can decode, when the model's
// vocabulary is larger (a GPT-2 or Llama vocabulary trained on bytes).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "llmpar/backend/cpu/cross_entropy.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/core/tensor.hpp"

namespace llmpar::train {

struct SampleConfig {
  std::int64_t tokens = 256;
  float temperature = 0.8f;
  std::uint64_t seed = 1337;
  std::int64_t vocab = 0;  // draw among ids [0, vocab) (0: every id of the model's vocabulary)
};

// Returns prompt followed by cfg.tokens sampled tokens.
template <class Model>
std::vector<std::int32_t> sample(typename Model::Context& ctx, Model& model, std::vector<std::int32_t> prompt,
                                 const SampleConfig& cfg) {
  LLMPAR_CHECK(!prompt.empty(), "sampling needs a prompt of at least one token");
  LLMPAR_CHECK(cfg.temperature > 0.0f, "temperature is ", cfg.temperature, "; it must be positive");
  const auto& mc = model.config();
  LLMPAR_CHECK(cfg.vocab >= 0, "sampling vocab is ", cfg.vocab,
               "; give the number of ids to draw among, or 0 for the model's ", mc.vocab);
  const std::int64_t V = cfg.vocab > 0 ? std::min<std::int64_t>(cfg.vocab, mc.vocab) : mc.vocab;
  using Acc = float;
  Buffer<Acc> probs(V);
  Buffer<typename Model::value_type> row(mc.padded_vocab);  // the model's logits, in its storage type
  const rng::Stream stream = rng::Stream::named(cfg.seed, "sample");
  // A model split by sequence parallelism takes sequences of a multiple of its degree:
  // the window is padded on the right, which a causal model's earlier positions ignore.
  std::int64_t multiple = 1;
  if (model.tensor_parallel().sequence_parallel()) multiple = model.tensor_parallel().size();
  const std::int64_t longest = mc.max_seq - mc.max_seq % multiple;
  LLMPAR_CHECK(longest > 0, "sampling needs sequences of a multiple of ", multiple, " tokens, longer than the model's ",
               mc.max_seq);
  std::vector<std::int32_t> window;
  for (std::int64_t i = 0; i < cfg.tokens; ++i) {
    const std::int64_t len = std::min<std::int64_t>(static_cast<std::int64_t>(prompt.size()), longest);
    const std::int64_t padded = (len + multiple - 1) / multiple * multiple;
    window.assign(prompt.end() - len, prompt.end());
    window.resize(static_cast<std::size_t>(padded), 0);
    model.logits_row(ctx, row.data(), window.data(), 1, padded, len - 1);
    backend::cpu::softmax_forward(probs.data(), row.data(), V, static_cast<Acc>(cfg.temperature));
    const double u = stream.uniform(static_cast<std::uint64_t>(i));
    double cdf = 0.0;
    std::int32_t next = static_cast<std::int32_t>(V - 1);
    for (std::int64_t v = 0; v < V; ++v) {
      cdf += probs[v];
      if (u < cdf) {
        next = static_cast<std::int32_t>(v);
        break;
      }
    }
    prompt.push_back(next);
  }
  return prompt;
}

}  // namespace llmpar::train
