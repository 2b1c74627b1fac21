// llmpar/optim/adamw.hpp — AdamW over a shard of a model's flat parameter store, with
// global-norm gradient clipping folded into the update, f32 master weights for 16-bit
// models, and the inf/NaN check that lets a step be skipped.
//
// The optimizer is built for a shard (DESIGN.md): a list of segments of the store's
// buffers, the whole store without ZeRO, this rank's part of every bucket with it
// (parallel/grad_sync.hpp). The moments (and, for a bf16/f16 store, the f32 master
// weights) are laid out segment after segment, so one optimizer step streams the arrays
// once. Clipping does not rewrite the gradients: the clip factor and 1 / loss scale are
// passed to the update as one gradient scale, saving a full pass over memory. Weight
// decay applies to the parameters that ask for it (matrices and embeddings), as in
// GPT-2 and llm.c. A segment's learning rate is lr x its parameter's lr_scale (1 but
// where a parametrisation such as µP scales it), the decoupled decay scaling with it.
//
// A step is two decisions, so that whoever owns the loss scaler and the groups
// (train::Trainer with parallel::GradSync) decides between them:
//   GradNorm g = sync.gradient_norm(inv_scale);  // global norm over every group, finite or not
//   if (g.finite) opt.update(lr, g, inv_scale);  // else skip: weights, moments, step count unchanged
// step(lr) does both for one rank. The CUDA optimizer (backend/cuda/backend.hpp) has the
// same calls, and both backends detect, skip and report a non-finite gradient the same way.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "llmpar/backend/cpu/adamw.hpp"
#include "llmpar/backend/cpu/convert.hpp"
#include "llmpar/backend/cpu/reduce.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/math/adamw.hpp"
#include "llmpar/nn/parameter.hpp"

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

// What one optimizer updates: its elements of the parameters, as segments (a whole
// parameter, or the part of it in a ZeRO shard). Pointers are in the backend's memory.
template <class T>
struct Segment {
  T* value = nullptr;        // (n) the parameter's storage-type values
  acc_t<T>* grad = nullptr;  // (n) their gradients (f32 main grads for 16-bit T)
  std::int64_t n = 0;        // elements
  bool decay = false;        // weight decay applies
  float lr_scale = 1.0f;     // the update runs at lr x lr_scale (nn::Parameter::lr_scale)
};

// Every parameter of a store, whole: the optimizer of a run without ZeRO sharding.
template <class T, class Space>
std::vector<Segment<T>> whole_store(nn::ParameterStore<T, Space>& store) {
  std::vector<Segment<T>> out;
  for (nn::Parameter<T>* p : store.parameters()) out.push_back({p->value, p->grad, p->numel(), p->decay, p->lr_scale});
  return out;
}

// L2 norm of all gradients of a store, deterministic whatever the thread count.
template <class T>
double gradient_norm(const nn::ParameterStore<T>& store) {
  return std::sqrt(backend::cpu::sum_of_squares(store.grads(), store.flat_size()));
}

// AdamW over a shard: the moments (and, for a 16-bit model, the f32 master weights) of
// the shard's elements, laid out segment after segment. The optimizer knows nothing of
// groups: the global norm over tensor, data and ZeRO shards is the data-parallel
// strategy's (parallel::GradSync); gradient_norm() here is the norm of this shard alone,
// for a run that has one rank.
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

  AdamW(std::vector<Segment<T>> shard, const AdamWConfig& cfg) : shard_(std::move(shard)), cfg_(cfg) {
    cfg.validate();
    std::int64_t total = 0;
    for (const Segment<T>& s : shard_) {
      offsets_.push_back(total);
      total += s.n;
    }
    m_.resize(total);
    v_.resize(total);
    m_.zero();
    v_.zero();
    if constexpr (kSeparateMaster) {
      master_.resize(total);
      for (std::size_t k = 0; k < shard_.size(); ++k)
        backend::cpu::convert(master_.data() + offsets_[k], shard_[k].value, shard_[k].n);
    }
  }
  // Every parameter of a store (one rank, or replicas that each update everything).
  AdamW(nn::ParameterStore<T>& store, const AdamWConfig& cfg) : AdamW(whole_store(store), cfg) {}

  // The sum of squares of this shard's stored gradients (loss scale included).
  double sum_of_squares() const {
    double squares = 0.0;
    for (const Segment<T>& s : shard_) squares += backend::cpu::sum_of_squares(s.grad, s.n);
    return squares;
  }

  // The norm of this shard's unscaled gradient (the stored gradients times
  // inv_loss_scale) and whether it is finite: the global norm when the shard is the
  // whole model of a one-rank run.
  GradNorm gradient_norm(float inv_loss_scale = 1.0f) const {
    const double squares = sum_of_squares() * static_cast<double>(inv_loss_scale) * inv_loss_scale;
    return {std::sqrt(squares), std::isfinite(squares)};
  }

  // One update at learning rate `lr` (already scheduled; each segment at lr x its
  // lr_scale): each gradient times inv_loss_scale and the clip factor of norm.norm (the
  // global norm). It must be finite.
  void update(float lr, const GradNorm& norm, float inv_loss_scale = 1.0f) {
    LLMPAR_CHECK(norm.finite, "AdamW::update with a non-finite gradient norm (", norm.norm,
                 "); skip the step instead (the trainer does, and its loss scaler backs off)");
    ++step_;
    const float grad_scale =
        static_cast<float>(static_cast<double>(inv_loss_scale) * clip_factor(norm.norm, cfg_.grad_clip));
    for (std::size_t k = 0; k < shard_.size(); ++k) {
      const Segment<T>& s = shard_[k];
      const std::int64_t offset = offsets_[k];
      const math::AdamWParams hp{lr * s.lr_scale, cfg_.beta1, cfg_.beta2, cfg_.eps, s.decay ? cfg_.weight_decay : 0.0f};
      if constexpr (kSeparateMaster)
        backend::cpu::adamw_update_master(master_.data() + offset, s.value, m_.data() + offset, v_.data() + offset,
                                          s.grad, s.n, hp, step_, grad_scale);
      else
        backend::cpu::adamw_update(s.value, m_.data() + offset, v_.data() + offset, s.grad, s.n, hp, step_, grad_scale);
    }
  }

  // gradient_norm and update in one call (one rank); a non-finite gradient skips the update.
  StepResult step(float lr, float inv_loss_scale = 1.0f) {
    const GradNorm g = gradient_norm(inv_loss_scale);
    if (g.finite) update(lr, g, inv_loss_scale);
    return {g.norm, !g.finite};
  }

  // Updates applied (a skipped step does not count: Adam's bias correction counts updates).
  int steps_taken() const { return step_; }
  // A checkpoint's count (the state it restores was built by that many updates).
  void set_steps_taken(int n) {
    LLMPAR_CHECK(n >= 0, "AdamW: a step count of ", n, " is negative");
    step_ = n;
  }
  const AdamWConfig& config() const { return cfg_; }
  std::span<const Segment<T>> shard() const { return shard_; }
  // Moments (and master weights) of the shard, segment after segment.
  Buffer<Master>& first_moment() { return m_; }
  Buffer<Master>& second_moment() { return v_; }
  // The f32 master weights of a 16-bit store (empty for float stores, whose values are
  // the master).
  Buffer<Master>& master_weights() { return master_; }
  // Bytes of optimizer state: moments and master weights.
  std::size_t state_bytes() const { return m_.bytes() + v_.bytes() + master_.bytes(); }

 private:
  std::vector<Segment<T>> shard_;
  std::vector<std::int64_t> offsets_;
  AdamWConfig cfg_;
  Buffer<Master> m_, v_, master_;
  int step_ = 0;
};

}  // namespace llmpar::optim
