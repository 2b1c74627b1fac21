// llmpar/train/spike_guard.hpp — telling a loss spike from noise, and counting the
// rollbacks it causes.
//
// A spike is a step whose loss is non-finite, or above `median_factor` times the median
// of the recent losses, or more than `z_score` standard deviations above their mean (the
// deviation floored at 1% of the median, so a flat stretch of losses does not make a
// small bump look huge); or whose gradient norm is non-finite, unless a loss scaler
// skips that step anyway (fp16's overflows are its business, not spikes). Detection
// starts after `min_history` losses.
//
// What to do about one is the trainer's (train/trainer.hpp): it does not apply the
// step, rolls back to its last snapshot (step c), does not read again the data it read
// since (steps c+1 .. s, the spike's included), skips `skip_batches` steps' worth more,
// as PaLM does, and continues. After
// `max_rollbacks` rollbacks within `rollback_window` steps the run is unstable, not
// unlucky, and stops with an error that says so.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "llmpar/core/error.hpp"

namespace llmpar::train {

struct SpikeGuardConfig {
  bool enabled = false;
  double median_factor = 2.0;  // a loss above this x the running median is a spike (0: off)
  double z_score = 8.0;        // a loss this many deviations above the running mean is a spike (0: off)
  int window = 50;             // recent losses the median, mean and deviation are of
  int min_history = 10;        // losses seen before detection starts
  int snapshot_every = 10;     // steps between the in-memory snapshots rolled back to
  int skip_batches = 0;        // steps' worth of data skipped after the spike's own
  int max_rollbacks = 3;       // rollbacks allowed within rollback_window steps
  int rollback_window = 1000;

  void validate() const {
    if (!enabled) return;
    LLMPAR_CHECK(median_factor == 0.0 || (std::isfinite(median_factor) && median_factor > 1.0), "--spike-factor ",
                 median_factor,
                 "; a spike is a loss above this multiple of the running median: use a number > 1, or 0 for off");
    LLMPAR_CHECK(z_score == 0.0 || (std::isfinite(z_score) && z_score > 0.0), "--spike-z ", z_score,
                 "; use a positive number of standard deviations, or 0 for off");
    LLMPAR_CHECK(window >= 2, "--spike-window ", window, "; the running statistics need at least 2 losses");
    LLMPAR_CHECK(min_history >= 2 && min_history <= window, "--spike-min-history ", min_history,
                 " must be in [2, --spike-window ", window, "]");
    LLMPAR_CHECK(snapshot_every >= 1, "--spike-snapshot-every ", snapshot_every,
                 "; keep an in-memory snapshot at least every N >= 1 steps");
    LLMPAR_CHECK(skip_batches >= 0, "--spike-skip ", skip_batches, "; skip 0 or more extra batches after a spike");
    LLMPAR_CHECK(max_rollbacks >= 1, "--spike-max-rollbacks ", max_rollbacks, "; allow at least 1 rollback");
    LLMPAR_CHECK(rollback_window >= 1, "--spike-rollback-window ", rollback_window, "; use a positive step count");
  }
};

// Why a step is a spike.
struct Spike {
  std::string reason;
};

class SpikeGuard {
 public:
  explicit SpikeGuard(const SpikeGuardConfig& cfg) : cfg_(cfg) { cfg.validate(); }

  // Whether step `step` (loss, gradient norm) is a spike; `scaler_skips`: a loss scaler
  // skips this step for its non-finite gradient.
  std::optional<Spike> check(double loss, double grad_norm, bool scaler_skips) const {
    char why[200];
    if (!std::isfinite(loss)) return Spike{"the loss is not finite"};
    if (!std::isfinite(grad_norm) && !scaler_skips) return Spike{"the gradient norm is not finite"};
    if (static_cast<int>(losses_.size()) < cfg_.min_history) return std::nullopt;
    const double median = running_median();
    if (cfg_.median_factor > 0.0 && loss > cfg_.median_factor * median) {
      std::snprintf(why, sizeof why, "loss %.4f > %.2f x the running median %.4f", loss, cfg_.median_factor, median);
      return Spike{why};
    }
    if (cfg_.z_score > 0.0) {
      double mean = 0.0;
      for (const Entry& e : losses_) mean += e.loss;
      mean /= static_cast<double>(losses_.size());
      double var = 0.0;
      for (const Entry& e : losses_) var += (e.loss - mean) * (e.loss - mean);
      const double deviation = std::max(std::sqrt(var / static_cast<double>(losses_.size() - 1)), 0.01 * median);
      const double z = (loss - mean) / deviation;
      if (z > cfg_.z_score) {
        std::snprintf(why, sizeof why, "loss %.4f is %.1f standard deviations above the running mean %.4f", loss, z,
                      mean);
        return Spike{why};
      }
    }
    return std::nullopt;
  }

  // A step that was applied.
  void record(std::int64_t step, double loss) {
    losses_.push_back({step, loss});
    while (static_cast<int>(losses_.size()) > cfg_.window) losses_.pop_front();
  }

  // The run rolled back to after step `to` because of a spike at step `at`: the losses
  // after `to` are forgotten. Throws when that makes too many rollbacks in the window.
  void rolled_back(std::int64_t at, std::int64_t to, const Spike& why) {
    while (!losses_.empty() && losses_.back().step > to) losses_.pop_back();
    rollbacks_.push_back(at);
    std::size_t recent = 0;
    for (std::int64_t s : rollbacks_)
      if (s > at - cfg_.rollback_window) ++recent;
    LLMPAR_CHECK(static_cast<int>(recent) <= cfg_.max_rollbacks, "loss spike guard: ", recent, " rollbacks within ",
                 cfg_.rollback_window, " steps (the last at step ", at, ": ", why.reason,
                 "); the run is unstable, not unlucky: lower --lr, raise --warmup or --grad-clip's strictness, or "
                 "check the data (or raise --spike-max-rollbacks)");
  }

  const SpikeGuardConfig& config() const { return cfg_; }
  std::size_t rollbacks() const { return rollbacks_.size(); }

  // The recent losses (for a checkpoint) and back.
  std::vector<std::pair<std::int64_t, double>> history() const {
    std::vector<std::pair<std::int64_t, double>> out;
    for (const Entry& e : losses_) out.emplace_back(e.step, e.loss);
    return out;
  }
  void restore(const std::vector<std::pair<std::int64_t, double>>& h, std::vector<std::int64_t> rollbacks) {
    losses_.clear();
    for (const auto& [step, loss] : h) record(step, loss);
    rollbacks_ = std::move(rollbacks);
  }
  const std::vector<std::int64_t>& rollback_steps() const { return rollbacks_; }

 private:
  struct Entry {
    std::int64_t step;
    double loss;
  };
  double running_median() const {
    std::vector<double> v;
    for (const Entry& e : losses_) v.push_back(e.loss);
    const std::size_t mid = v.size() / 2;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
    double m = v[mid];
    if (v.size() % 2 == 0) m = 0.5 * (m + *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid)));
    return m;
  }

  SpikeGuardConfig cfg_;
  std::deque<Entry> losses_;
  std::vector<std::int64_t> rollbacks_;
};

}  // namespace llmpar::train
