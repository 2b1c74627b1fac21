// llmpar/precision/loss_scaler.hpp — the loss scale of a run: fixed at 1, or dynamic.
//
// fp16 activations and their gradients underflow below 2^-24, so FP16Mixed multiplies the
// loss by a scale S before backward and every gradient by 1/S before the update
// (Micikevicius et al. 2018). S is chosen dynamically, as in Megatron-LM's
// DynamicGradScaler and DeepSpeed's DynamicLossScaler: as large as the gradients allow
// without overflowing, found by growing it after a run of clean steps and backing it off
// when a step overflows. The state machine is here, on the host, in one place for both
// backends; the trainer feeds it one verdict per step ("did any rank's gradient hold
// inf/NaN?", reduced over every group), and every rank holds the same state because
// every rank sees the same verdicts.
//
//   clean step     good_steps + 1; at growth_interval: scale *= growth_factor,
//                  good_steps = 0, hysteresis_left = hysteresis.
//   overflow       the step is skipped (weights, moments and Adam's step count stay);
//                  good_steps = 0; hysteresis_left - 1, and once it is 0 the scale is
//                  multiplied by backoff_factor (not below min_scale) on this and every
//                  later overflow until the next growth.
//   at min_scale   an overflow when the scale is already min_scale and the hysteresis is
//                  used up is an error: the gradients overflow even unscaled, which no
//                  scale can fix (DeepSpeed raises the same).
//
// NoLossScaler is the same interface with scale 1 for FP32 and BF16Mixed: a step whose
// gradient is inf/NaN is still skipped (and counted), never applied.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "llmpar/core/error.hpp"
#include "llmpar/precision/policy.hpp"

namespace llmpar::precision {

// A scaler's state, for checkpoints (NoLossScaler keeps only `skipped`).
struct ScalerState {
  float scale = 1.0f;
  int good_steps = 0;
  int hysteresis_left = 0;
  std::int64_t skipped = 0, growths = 0, backoffs = 0;
};

// What a scaler decided about one step.
struct ScaleUpdate {
  bool skipped = false;  // the step's update must not be applied
  bool grew = false;     // the scale was multiplied by growth_factor after this step
  bool backed_off = false;
};

class DynamicLossScaler {
 public:
  using Config = DynamicLossScale::Config;

  explicit DynamicLossScaler(const Config& cfg = {}) : cfg_(validated(cfg)), scale_(cfg.initial_scale) {
    hysteresis_left_ = cfg.hysteresis;
  }

  // The factor the loss is multiplied by before this step's backward.
  float scale() const { return scale_; }
  float inv_scale() const { return 1.0f / scale_; }

  // Records step `step`'s verdict (found_inf: some gradient of some rank was inf/NaN).
  ScaleUpdate update(bool found_inf, std::int64_t step) {
    ScaleUpdate u;
    if (found_inf) {
      u.skipped = true;
      ++skipped_;
      good_steps_ = 0;
      if (hysteresis_left_ > 0) --hysteresis_left_;
      if (hysteresis_left_ == 0) {
        LLMPAR_CHECK(scale_ > cfg_.min_scale, "step ", step,
                     ": the gradients hold inf/NaN with the fp16 loss scale at its ", "minimum (", cfg_.min_scale,
                     ") after ", cfg_.hysteresis,
                     " overflow(s) in a row: they overflow even unscaled, so no loss scale can fix them; lower --lr, "
                     "raise --warmup, check the data, or train in bf16 (--precision bf16)");
        scale_ = std::max(scale_ * cfg_.backoff_factor, cfg_.min_scale);
        ++backoffs_;
        u.backed_off = true;
      }
      return u;
    }
    if (++good_steps_ >= cfg_.growth_interval) {
      good_steps_ = 0;
      hysteresis_left_ = cfg_.hysteresis;
      // Never to inf: a scale that no longer fits in a float stays where it is.
      const float grown = scale_ * cfg_.growth_factor;
      if (std::isfinite(grown)) {
        scale_ = grown;
        ++growths_;
        u.grew = true;
      }
    }
    return u;
  }

  std::int64_t skipped_steps() const { return skipped_; }
  std::int64_t growths() const { return growths_; }
  std::int64_t backoffs() const { return backoffs_; }
  int good_steps() const { return good_steps_; }
  int hysteresis_left() const { return hysteresis_left_; }
  const Config& config() const { return cfg_; }

  ScalerState state() const { return {scale_, good_steps_, hysteresis_left_, skipped_, growths_, backoffs_}; }
  void restore(const ScalerState& s) {
    LLMPAR_CHECK(std::isfinite(s.scale) && s.scale >= cfg_.min_scale && s.good_steps >= 0 && s.hysteresis_left >= 0 &&
                     s.hysteresis_left <= cfg_.hysteresis && s.skipped >= 0,
                 "loss scaler state (scale ", s.scale, ", ", s.good_steps, " good steps, hysteresis ",
                 s.hysteresis_left, ") does not fit this scaler (min scale ", cfg_.min_scale, ", hysteresis ",
                 cfg_.hysteresis, ")");
    scale_ = s.scale;
    good_steps_ = s.good_steps;
    hysteresis_left_ = s.hysteresis_left;
    skipped_ = s.skipped;
    growths_ = s.growths;
    backoffs_ = s.backoffs;
  }

 private:
  static Config validated(const Config& c) {
    LLMPAR_CHECK(std::isfinite(c.initial_scale) && c.initial_scale > 0.0f, "loss scaler: initial_scale is ",
                 c.initial_scale, "; it must be a positive number, e.g. 65536");
    LLMPAR_CHECK(std::isfinite(c.growth_factor) && c.growth_factor > 1.0f, "loss scaler: growth_factor is ",
                 c.growth_factor, "; it must be > 1, e.g. 2");
    LLMPAR_CHECK(c.backoff_factor > 0.0f && c.backoff_factor < 1.0f, "loss scaler: backoff_factor is ",
                 c.backoff_factor, "; it must be in (0, 1), e.g. 0.5");
    LLMPAR_CHECK(c.growth_interval >= 1, "loss scaler: growth_interval is ", c.growth_interval,
                 "; grow after at least 1 clean step (e.g. 1000)");
    LLMPAR_CHECK(c.hysteresis >= 1, "loss scaler: hysteresis is ", c.hysteresis,
                 "; at least 1 overflow must come before a backoff (e.g. 2)");
    LLMPAR_CHECK(std::isfinite(c.min_scale) && c.min_scale > 0.0f && c.min_scale <= c.initial_scale,
                 "loss scaler: min_scale is ", c.min_scale, "; it must be in (0, initial_scale = ", c.initial_scale,
                 "], e.g. 1");
    return c;
  }

  Config cfg_;
  float scale_;
  int good_steps_ = 0;
  int hysteresis_left_ = 0;
  std::int64_t skipped_ = 0, growths_ = 0, backoffs_ = 0;
};

// Scale 1, for precisions without a loss scaler: an inf/NaN gradient skips the step.
class NoLossScaler {
 public:
  struct Config {};
  explicit NoLossScaler(const Config& = {}) {}
  float scale() const { return 1.0f; }
  float inv_scale() const { return 1.0f; }
  ScaleUpdate update(bool found_inf, std::int64_t /*step*/) {
    if (found_inf) ++skipped_;
    return {.skipped = found_inf};
  }
  std::int64_t skipped_steps() const { return skipped_; }
  ScalerState state() const { return {.skipped = skipped_}; }
  void restore(const ScalerState& s) { skipped_ = s.skipped; }

 private:
  std::int64_t skipped_ = 0;
};

// The scaler a precision policy names.
template <Policy P>
using ScalerFor = std::conditional_t<P::kHasLossScale, DynamicLossScaler, NoLossScaler>;

}  // namespace llmpar::precision
