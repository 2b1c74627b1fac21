// llmpar/optim/schedule.hpp — learning-rate schedule: linear warmup, then cosine decay
// to a floor (GPT-2 / llm.c / nanoGPT).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "llmpar/core/error.hpp"

namespace llmpar::optim {

struct CosineSchedule {
  float peak_lr = 6e-4f;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;
  float final_ratio = 0.1f;  // lr at the last step, as a fraction of the peak

  void validate() const {
    LLMPAR_CHECK(total_steps > 0, "steps is ", total_steps, "; train for at least 1 step");
    LLMPAR_CHECK(warmup_steps >= 0 && warmup_steps <= total_steps, "warmup ", warmup_steps,
                 " must be in [0, steps=", total_steps, "]");
    LLMPAR_CHECK(final_ratio >= 0.0f && final_ratio <= 1.0f, "final lr ratio ", final_ratio, " must be in [0, 1]");
  }

  // Learning rate of 0-based step `step`.
  float operator()(std::int64_t step) const {
    if (step < warmup_steps) return peak_lr * static_cast<float>(step + 1) / static_cast<float>(warmup_steps);
    const std::int64_t decay_steps = std::max<std::int64_t>(1, total_steps - warmup_steps);
    const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps));
    const double cosine = 0.5 * (1.0 + std::cos(3.141592653589793 * progress));
    return static_cast<float>(peak_lr * (final_ratio + (1.0 - final_ratio) * cosine));
  }
};

}  // namespace llmpar::optim
