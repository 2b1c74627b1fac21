// llmpar/optim/adamw.hpp — AdamW over a model's flat parameter store, with global-norm
// gradient clipping folded into the update.
//
// The moments live in two flat buffers laid out like the store's, so one optimizer
// step streams five arrays once. Clipping does not rewrite the gradients: the clip
// factor is passed to the update as a gradient scale, saving a full pass over memory.
// Weight decay applies to the parameters that ask for it (matrices and embeddings),
// as in GPT-2 and llm.c.
#pragma once

#include <cmath>
#include <cstdint>

#include "llmpar/backend/cpu/adamw.hpp"
#include "llmpar/backend/cpu/reduce.hpp"
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

// L2 norm of all gradients of a store, deterministic whatever the thread count.
template <class T>
double gradient_norm(const nn::ParameterStore<T>& store) {
  return std::sqrt(backend::cpu::sum_of_squares(store.grads(), store.flat_size()));
}

template <class T>
class AdamW {
 public:
  AdamW(nn::ParameterStore<T>& store, const AdamWConfig& cfg) : store_(store), cfg_(cfg) {
    cfg.validate();
    m_.resize(store.flat_size());
    v_.resize(store.flat_size());
    m_.zero();
    v_.zero();
  }

  // The model is split over a tensor-parallel group: the global gradient norm then sums
  // the split parameters' squares over the group (each rank holds a slice) and counts
  // the replicated ones once (every rank holds the same gradient).
  void set_model_parallel(nn::TensorParallelGroup tp) { tp_ = tp; }

  // One update at learning rate `lr` (already scheduled). Returns the gradient norm
  // before clipping.
  double step(float lr) {
    ++step_;
    const double norm = tp_.split() ? model_parallel_gradient_norm() : gradient_norm(store_);
    float grad_scale = 1.0f;
    if (cfg_.grad_clip > 0.0f && norm > cfg_.grad_clip) grad_scale = static_cast<float>(cfg_.grad_clip / (norm + 1e-6));
    const T* base = store_.values();
    for (nn::Parameter<T>* p : store_.parameters()) {
      const std::int64_t offset = p->value - base;
      const math::AdamWParams hp{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, p->decay ? cfg_.weight_decay : 0.0f};
      backend::cpu::adamw_update(p->value, m_.data() + offset, v_.data() + offset, p->grad, p->numel(), hp, step_,
                                 grad_scale);
    }
    return norm;
  }

  int steps_taken() const { return step_; }
  const AdamWConfig& config() const { return cfg_; }
  Buffer<T>& first_moment() { return m_; }
  Buffer<T>& second_moment() { return v_; }

 private:
  double model_parallel_gradient_norm() const {
    double split = 0.0, replicated = 0.0;
    for (const nn::Parameter<T>* p : store_.parameters())
      (p->split.is_split() ? split : replicated) += backend::cpu::sum_of_squares(p->grad, p->numel());
    float total = static_cast<float>(split);  // communicators carry f32
    tp_.all_reduce(&total, 1);
    return std::sqrt(static_cast<double>(total) + replicated);
  }

  nn::ParameterStore<T>& store_;
  nn::TensorParallelGroup tp_;
  AdamWConfig cfg_;
  Buffer<T> m_, v_;
  int step_ = 0;
};

}  // namespace llmpar::optim
