// What the model tests share: random token ids, and the check of every parameter's
// gradient against central finite differences of the loss (models in double).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "llmpar/core/rng.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::model_test {

// n token ids in [0, vocab) from the stream (seed, "tokens").
inline std::vector<std::int32_t> random_tokens(std::int64_t n, std::int64_t vocab, std::uint64_t seed) {
  const auto s = rng::Stream::named(seed, "tokens");
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    t[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(s.bits(static_cast<std::uint64_t>(i))[0] % vocab);
  return t;
}

struct GradientCheck {
  int checked = 0;     // elements compared
  double worst = 0.0;  // largest relative error
};

// Checks ∂loss/∂p of a spread of elements of every parameter (all of the small ones)
// against central differences of model.evaluate, each to 1e-6 relative. Parameters that
// do not start from a normal draw (biases, norm gains) are moved off their initial
// values first, so their gradients are exercised. The rows of the token table
// `token_table` past vocab are padding with no gradient by design, and are skipped.
template <class Model, class Context>
GradientCheck check_gradients(Context& ctx, Model& model, const std::string& token_table, std::int64_t vocab,
                              std::int64_t dim, std::int64_t B, std::int64_t S) {
  for (auto* p : model.parameter_store().parameters())
    if (p->init.kind != nn::Init::Kind::normal)
      for (std::int64_t i = 0; i < p->numel(); ++i)
        p->value[i] += 0.1 * rng::Stream::named(3, p->name).normal(static_cast<std::uint64_t>(i));
  const auto tokens = random_tokens(B * S, vocab, 1);
  const auto targets = random_tokens(B * S, vocab, 2);
  model.zero_grad(ctx);
  model.forward(ctx, tokens.data(), targets.data(), B, S);
  model.backward(ctx);

  GradientCheck result;
  for (auto* p : model.parameter_store().parameters()) {
    const std::int64_t n = p->numel();
    const std::int64_t stride = std::max<std::int64_t>(1, n / 13);
    for (std::int64_t i = 0; i < n; i += stride) {
      if (p->name == token_table && i >= vocab * dim) break;
      const double saved = p->value[i];
      const double h = 1e-5;
      p->value[i] = saved + h;
      const double up = model.evaluate(ctx, tokens.data(), targets.data(), B, S);
      p->value[i] = saved - h;
      const double down = model.evaluate(ctx, tokens.data(), targets.data(), B, S);
      p->value[i] = saved;
      const double numeric = (up - down) / (2 * h);
      const double analytic = p->grad[i];
      // Relative error, with an absolute floor for gradients that are zero by symmetry
      // (GPT-2's key bias shifts every score of a row equally, which softmax ignores).
      const double err = std::abs(numeric - analytic) / std::max(1e-4, std::abs(numeric) + std::abs(analytic));
      result.worst = std::max(result.worst, err);
      INFO(p->name, "[", i, "] analytic ", analytic, " numeric ", numeric);
      CHECK(err < 1e-6);
      ++result.checked;
    }
  }
  return result;
}

}  // namespace llmpar::model_test
