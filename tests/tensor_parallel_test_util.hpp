// What the tensor-parallel equivalence tests share: gathering a rank's slices into full
// tensors, comparing with the serial run, and five training steps of a model.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/optim/adamw.hpp"
#include "llmpar/parallel/grad_sync.hpp"

namespace llmpar::tp_test {

// Writes this rank's slice `local` of p (values or gradients) into full, p's full tensor,
// at its positions, as float.
template <class T, class V>
void scatter_to_full(const nn::Parameter<T>& p, const V* local, std::vector<float>& full) {
  full.resize(static_cast<std::size_t>(p.full_numel()));
  for (std::int64_t i = 0; i < p.numel(); ++i)
    full[static_cast<std::size_t>(nn::full_index(p.shape, p.split, i))] = static_cast<float>(local[i]);
}

// max |a - b| over max |b|.
inline double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::abs(b[i])));
  }
  return worst / std::max(scale, 1e-30);
}

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;   // per parameter, the full tensor: the first step's gradient
  std::vector<std::vector<float>> params;  // per parameter, the full tensor after the five steps
  std::vector<std::string> names;
};

// Five training steps of `model` (any storage type) on fixed batches; the first step's
// gradients and the final parameters are gathered into full tensors at their
// full-tensor positions (each rank writes its slice under mutex).
template <class Model>
void train_five_steps(Model& model, Run& run, std::mutex& mutex, bool lead) {
  using T = typename Model::value_type;
  backend::cpu::Context ctx;
  // eps = 1e-2 keeps the update a smooth function of the gradient: with a tiny eps,
  // Adam turns rounding noise in a gradient that is zero in exact arithmetic (GPT-2's
  // key bias: softmax ignores a constant added to every score of a row) into a full
  // ±lr step, in the serial run and the parallel one alike, but not the same step.
  // The tensor-parallel group is the whole world here: the global norm sums over it.
  parallel::GradSync<Model, 0> sync(ctx, model, {.world = model.tensor_parallel().communicator()}, {});
  optim::AdamW<T> opt(ctx, sync.optimizer_shard(),
                      {.lr = 1e-2f, .eps = 1e-2f, .weight_decay = 0.1f, .grad_clip = 0.5f});
  const std::int64_t B = 3, S = 16, V = model.config().vocab;
  std::vector<std::int32_t> tokens(B * S), targets(B * S);
  std::vector<double> losses;
  const auto params = model.parameter_store().parameters();
  for (int step = 0; step < 5; ++step) {
    const auto stream = rng::Stream::named(static_cast<std::uint64_t>(step), "batch");
    for (std::int64_t i = 0; i < B * S; ++i) {
      tokens[static_cast<std::size_t>(i)] =
          static_cast<std::int32_t>(stream.bits(static_cast<std::uint64_t>(i))[0] % V);
      targets[static_cast<std::size_t>(i)] =
          static_cast<std::int32_t>(stream.bits(static_cast<std::uint64_t>(i))[1] % V);
    }
    sync.begin_step();
    sync.begin_micro_batch(true);
    losses.push_back(model.forward(ctx, tokens.data(), targets.data(), B, S));
    model.backward(ctx);
    sync.end_micro_batch();
    sync.finish();
    if (step == 0) {
      const std::lock_guard<std::mutex> lock(mutex);
      run.grads.resize(params.size());
      for (std::size_t k = 0; k < params.size(); ++k) scatter_to_full(*params[k], params[k]->grad, run.grads[k]);
    }
    const optim::GradNorm norm = sync.gradient_norm();
    REQUIRE(norm.finite);
    opt.update(1e-2f, norm);
    sync.after_update();
  }
  const std::lock_guard<std::mutex> lock(mutex);
  if (lead) run.losses = losses;
  run.params.resize(params.size());
  run.names.resize(params.size());
  for (std::size_t k = 0; k < params.size(); ++k) {
    run.names[k] = params[k]->name;
    scatter_to_full(*params[k], params[k]->value, run.params[k]);
  }
}

}  // namespace llmpar::tp_test
