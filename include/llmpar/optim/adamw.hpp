// llmpar/optim/adamw.hpp — AdamW over a shard of a model's flat parameter store, with
// global-norm gradient clipping folded into the update, f32 master weights for 16-bit
// models, and the inf/NaN check that lets a step be skipped.
//
// The optimizer is built for a shard (docs/design.md): a list of segments of the store's
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
// step(lr) does both for one rank. It is one optimizer for both backends: only the
// update's kernel is the backend's (Backend::AdamWKernel), so both detect, skip and
// report a non-finite gradient the same way.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "llmpar/backend/backend.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
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

using math::clip_factor;

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

// AdamW over a shard, on either backend: the moments (and, for a 16-bit model, the f32
// master weights) of the shard's elements, laid out segment after segment in the
// backend's memory; the update runs on the backend's kernel (Backend::AdamWKernel:
// backend/cpu/adamw.hpp, or the CUDA multi-tensor kernel), which takes the table of
// tensors built here once. The optimizer knows nothing of groups: the global norm over
// tensor, data and ZeRO shards is the data-parallel strategy's (parallel::GradSync).
template <class T, class Backend = backend::Cpu>
class AdamW {
 public:
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Grad = acc_t<T>;
  // The type the update computes in: f32 for float and 16-bit stores, double for the
  // double models of the tests.
  using Master = acc_t<T>;
  // A bf16/f16 store keeps its f32 master copy here; a float (or double) store is its
  // own master.
  static constexpr bool kSeparateMaster = !std::is_same_v<T, Master>;
  using Kernel = typename Backend::template AdamWKernel<T>;

  AdamW(Context& ctx, std::vector<Segment<T>> shard, const AdamWConfig& cfg)
      : ctx_(&ctx), shard_(std::move(shard)), cfg_(cfg) {
    cfg.validate();
    std::int64_t total = 0;
    for (const Segment<T>& s : shard_) {
      offsets_.push_back(total);
      total += s.n;
    }
    m_.resize(total);
    v_.resize(total);
    Backend::zero(ctx, m_.data(), total);
    Backend::zero(ctx, v_.data(), total);
    if constexpr (kSeparateMaster) {
      master_.resize(total);
      for (std::size_t k = 0; k < shard_.size(); ++k)
        Backend::convert(ctx, master_.data() + offsets_[k], shard_[k].value, shard_[k].n);
    }
    std::vector<math::AdamWSlot<Master, T>> slots;
    for (std::size_t k = 0; k < shard_.size(); ++k) {
      const Segment<T>& s = shard_[k];
      const std::int64_t at = offsets_[k];
      math::AdamWSlot<Master, T> slot{
          .grad = s.grad, .m = m_.data() + at, .v = v_.data() + at, .n = s.n, .decay = s.decay, .lr_scale = s.lr_scale};
      if constexpr (kSeparateMaster) {
        slot.master = master_.data() + at;
        slot.param = s.value;
      } else {
        slot.master = s.value;
      }
      slots.push_back(slot);
    }
    kernel_.emplace(ctx, std::move(slots));
  }
  // Every parameter of a store (one rank, or replicas that each update everything).
  AdamW(Context& ctx, nn::ParameterStore<T, Space>& store, const AdamWConfig& cfg)
      : AdamW(ctx, whole_store(store), cfg) {}
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  AdamW(AdamW&&) noexcept = default;
  AdamW& operator=(AdamW&&) noexcept = default;

  // The norm of this shard's unscaled gradient (the stored gradients times
  // inv_loss_scale) and whether it is finite: the global norm of a one-rank run, the
  // same sum (Backend::sum_of_squares, piece by piece) parallel::GradSync takes over
  // every rank's pieces.
  GradNorm gradient_norm(float inv_loss_scale = 1.0f) const {
    double squares = 0.0;
    for (const Segment<T>& s : shard_) squares += Backend::sum_of_squares(*ctx_, s.grad, s.n);
    squares *= static_cast<double>(inv_loss_scale) * inv_loss_scale;
    return {std::sqrt(squares), std::isfinite(squares)};
  }

  // One update at learning rate `lr` (already scheduled; each segment at lr x its
  // lr_scale): each gradient times inv_loss_scale and the clip factor of norm.norm (the
  // global norm). It must be finite. Queued on the backend's stream, not waited for.
  void update(float lr, const GradNorm& norm, float inv_loss_scale = 1.0f) {
    LLMPAR_CHECK(norm.finite, "AdamW::update with a non-finite gradient norm (", norm.norm,
                 "); skip the step instead (the trainer does, and its loss scaler backs off)");
    ++step_;
    const math::AdamWParams hp{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay};
    kernel_->step(*ctx_, hp, step_, norm.norm, inv_loss_scale, cfg_.grad_clip);
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
  Buffer<Master, Space>& first_moment() { return m_; }
  Buffer<Master, Space>& second_moment() { return v_; }
  // The f32 master weights of a 16-bit store (empty for float stores, whose values are
  // the master).
  Buffer<Master, Space>& master_weights() { return master_; }
  // Bytes of optimizer state: moments and master weights.
  std::size_t state_bytes() const { return m_.bytes() + v_.bytes() + master_.bytes(); }

 private:
  Context* ctx_;
  std::vector<Segment<T>> shard_;
  std::vector<std::int64_t> offsets_;
  AdamWConfig cfg_;
  Buffer<Master, Space> m_, v_, master_;
  std::optional<Kernel> kernel_;
  int step_ = 0;
};

}  // namespace llmpar::optim
