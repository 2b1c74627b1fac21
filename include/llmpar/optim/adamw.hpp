// llmpar/optim/adamw.hpp — AdamW over a model's flat parameter store, with global-norm
// gradient clipping folded into the update, f32 master weights for 16-bit models, and
// the inf/NaN check that lets a step be skipped.
//
// The moments (and, for a bf16/f16 store, the f32 master weights) live in flat buffers
// laid out like the store's, so one optimizer step streams the arrays once. Clipping
// does not rewrite the gradients: the clip factor and 1 / loss scale are passed to the
// update as one gradient scale, saving a full pass over memory. Weight decay applies to
// the parameters that ask for it (matrices and embeddings), as in GPT-2 and llm.c.
//
// A step is two calls, so that whoever owns the loss scaler (train::Trainer) decides
// between them:
//   GradNorm g = opt.gradient_norm(inv_scale);  // unscaled global norm, and finite or not
//   ... reduce g.finite over the other groups that hold different gradients ...
//   if (g.finite) opt.update(lr, g, inv_scale); // else skip: weights, moments, step count unchanged
// step(lr) does both for a caller without a scaler. The CUDA optimizer
// (backend/cuda/backend.hpp) has the same three calls, and both backends detect, skip
// and report a non-finite gradient the same way.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "llmpar/backend/cpu/adamw.hpp"
#include "llmpar/backend/cpu/convert.hpp"
#include "llmpar/backend/cpu/reduce.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/math/adamw.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/tensor_parallel.hpp"

namespace llmpar::optim {

struct AdamWConfig {
  float lr = 6e-4f;  // peak learning rate (the schedule scales it)
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  float grad_clip = 1.0f;  // max global gradient norm; 0 disables clipping

  void validate() const {
    LLMPAR_CHECK(lr > 0.0f && std::isfinite(lr), "lr is ", lr, "; the learning rate must be a positive number");
    LLMPAR_CHECK(beta1 >= 0.0f && beta1 < 1.0f, "beta1 is ", beta1, "; it must be in [0, 1)");
    LLMPAR_CHECK(beta2 >= 0.0f && beta2 < 1.0f, "beta2 is ", beta2, "; it must be in [0, 1)");
    LLMPAR_CHECK(eps > 0.0f, "eps is ", eps, "; it must be positive");
    LLMPAR_CHECK(weight_decay >= 0.0f, "weight_decay is ", weight_decay, "; it must be >= 0");
    LLMPAR_CHECK(grad_clip >= 0.0f, "grad_clip is ", grad_clip, "; use a positive norm, or 0 to disable clipping");
  }
};

// The global gradient norm of one step.
struct GradNorm {
  double norm = 0.0;   // L2 norm of the unscaled gradient of the whole model (inf/NaN when not finite)
  bool finite = true;  // every gradient of every rank that took part is finite
};

// What step() did.
struct StepResult {
  double grad_norm = 0.0;  // before clipping, unscaled
  bool skipped = false;    // a gradient was inf/NaN: nothing was updated
};

// The clip factor for a gradient of global norm `norm` (1 when clipping is off or the
// norm is within max_norm): the same expression on both backends.
inline double clip_factor(double norm, float max_norm) {
  return max_norm > 0.0f && norm > max_norm ? static_cast<double>(max_norm) / (norm + 1e-6) : 1.0;
}

// L2 norm of all gradients of a store, deterministic whatever the thread count.
template <class T>
double gradient_norm(const nn::ParameterStore<T>& store) {
  return std::sqrt(backend::cpu::sum_of_squares(store.grads(), store.flat_size()));
}

template <class T>
class AdamW {
 public:
  using Grad = acc_t<T>;
  // The type the update computes in: f32 for float and 16-bit stores, double for the
  // double models of the tests.
  using Master = acc_t<T>;
  // A bf16/f16 store keeps its f32 master copy here; a float (or double) store is its
  // own master.
  static constexpr bool kSeparateMaster = !std::is_same_v<T, Master>;

  AdamW(nn::ParameterStore<T>& store, const AdamWConfig& cfg) : store_(store), cfg_(cfg) {
    cfg.validate();
    m_.resize(store.flat_size());
    v_.resize(store.flat_size());
    m_.zero();
    v_.zero();
    if constexpr (kSeparateMaster) {
      master_.resize(store.flat_size());
      backend::cpu::convert(master_.data(), store.values(), store.flat_size());
    }
  }

  // The model is split over a tensor-parallel group: the global gradient norm then sums
  // the split parameters' squares over the group (each rank holds a slice) and counts
  // the replicated ones once (every rank holds the same gradient); whether a gradient
  // is inf/NaN is decided over the group too, so every rank of it skips together.
  void set_model_parallel(nn::TensorParallelGroup tp) { tp_ = tp; }

  // The global norm of the unscaled gradient (the stored gradients times
  // inv_loss_scale) and whether every gradient is finite.
  GradNorm gradient_norm(float inv_loss_scale = 1.0f) const {
    const double inv2 = static_cast<double>(inv_loss_scale) * static_cast<double>(inv_loss_scale);
    if (!tp_.split()) {
      const double squares = backend::cpu::sum_of_squares(store_.grads(), store_.flat_size()) * inv2;
      return {std::sqrt(squares), std::isfinite(squares)};
    }
    double split = 0.0, replicated = 0.0;
    for (const nn::Parameter<T>* p : store_.parameters())
      (p->split.is_split() ? split : replicated) += backend::cpu::sum_of_squares(p->grad, p->numel());
    split *= inv2;
    replicated *= inv2;
    // One reduction: the split part's sum and the count of ranks with a non-finite part.
    std::array<float, 2> parts{static_cast<float>(split),
                               std::isfinite(split) && std::isfinite(replicated) ? 0.f : 1.f};
    tp_.all_reduce(parts.data(), 2);
    const double squares = static_cast<double>(parts[0]) + replicated;
    return {std::sqrt(squares), parts[1] == 0.0f && std::isfinite(squares)};
  }

  // One update at learning rate `lr` (already scheduled): each gradient times
  // inv_loss_scale and the clip factor of norm.norm. The norm must be finite.
  void update(float lr, const GradNorm& norm, float inv_loss_scale = 1.0f) {
    LLMPAR_CHECK(norm.finite, "AdamW::update with a non-finite gradient norm (", norm.norm,
                 "); skip the step instead (the trainer does, and its loss scaler backs off)");
    ++step_;
    const float grad_scale =
        static_cast<float>(static_cast<double>(inv_loss_scale) * clip_factor(norm.norm, cfg_.grad_clip));
    const T* base = store_.values();
    for (nn::Parameter<T>* p : store_.parameters()) {
      const std::int64_t offset = p->value - base;
      const math::AdamWParams hp{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, p->decay ? cfg_.weight_decay : 0.0f};
      if constexpr (kSeparateMaster)
        backend::cpu::adamw_update_master(master_.data() + offset, p->value, m_.data() + offset, v_.data() + offset,
                                          p->grad, p->numel(), hp, step_, grad_scale);
      else
        backend::cpu::adamw_update(p->value, m_.data() + offset, v_.data() + offset, p->grad, p->numel(), hp, step_,
                                   grad_scale);
    }
  }

  // gradient_norm and update in one call; a non-finite gradient skips the update.
  StepResult step(float lr, float inv_loss_scale = 1.0f) {
    const GradNorm g = gradient_norm(inv_loss_scale);
    if (g.finite) update(lr, g, inv_loss_scale);
    return {g.norm, !g.finite};
  }

  // Updates applied (a skipped step does not count: Adam's bias correction counts updates).
  int steps_taken() const { return step_; }
  const AdamWConfig& config() const { return cfg_; }
  Buffer<Master>& first_moment() { return m_; }
  Buffer<Master>& second_moment() { return v_; }
  // The f32 master weights of a 16-bit store (empty for float stores, whose values are
  // the master).
  Buffer<Master>& master_weights() { return master_; }
  // Bytes of optimizer state: moments and master weights.
  std::size_t state_bytes() const { return m_.bytes() + v_.bytes() + master_.bytes(); }

 private:
  nn::ParameterStore<T>& store_;
  nn::TensorParallelGroup tp_;
  AdamWConfig cfg_;
  Buffer<Master> m_, v_, master_;
  int step_ = 0;
};

}  // namespace llmpar::optim
