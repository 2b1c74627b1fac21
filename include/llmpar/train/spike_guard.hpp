// llmpar/train/spike_guard.hpp — telling a loss spike from noise, and counting the
// rollbacks it causes.
//
// A spike is a step whose loss is non-finite, or above `median_factor` times the loss of
// a uniform guess (ln V: the run diverged; checked from the first step), or times the
// median of the recent losses, or more than `z_score` standard deviations above their
// mean (the deviation floored at 1% of the median, so a flat stretch of losses does not
// make a small bump look huge); or whose gradient norm is non-finite, unless a loss
// scaler skips that step anyway (fp16's overflows are its business, not spikes). The
// running tests start after `min_history` losses.
//
// What to do about one is the trainer's (train/trainer.hpp): it does not apply the
// step, rolls back to its last snapshot (step c), does not read again the data it read
// since (steps c+1 .. s, the spike's included), skips `skip_batches` steps' worth more,
// and continues.
//
// A bad stretch of data outlasts one skip: the batch after the skipped one is bad too,
// and so is the next. So rollbacks come in incidents (PaLM, Chowdhery et al. 2022,
// restarted about 100 steps back and skipped 200-500 batches): a spike within
// `incident_steps` steps of the incident's last rollback belongs to it, and each such
// rollback skips twice the extra data of the one before (1, 2, 4, ... steps' worth,
// after the first's skip_batches), so a stretch of n bad batches costs about log2(n)
// rollbacks. An incident closes once `incident_steps` steps pass without a spike (or the
// run ends) and is reported whole (Incident). A spike that outlasts `max_skip` steps of
// skipped data, or more than `max_rollbacks` incidents within `rollback_window` steps,
// means the run is unstable, not unlucky (a learning rate far too high looks like
// that), and it stops with an error that says so.
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
  int skip_batches = 0;        // steps' worth of data skipped after the spike's own, at an incident's first rollback
  int incident_steps = 20;     // a spike this close after an incident's last rollback belongs to it
  int max_skip = 512;          // the most extra steps' worth one rollback of an incident may skip
  int max_rollbacks = 3;       // incidents allowed within rollback_window steps
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
    LLMPAR_CHECK(incident_steps >= 1, "--spike-incident-steps ", incident_steps,
                 "; a spike within this many steps of the last rollback is the same incident: use 1 or more");
    LLMPAR_CHECK(max_skip >= skip_batches, "--spike-max-skip ", max_skip, " is below --spike-skip ", skip_batches,
                 "; give the largest skip of an incident, at least its first");
    LLMPAR_CHECK(max_rollbacks >= 1, "--spike-max-rollbacks ", max_rollbacks, "; allow at least 1 incident");
    LLMPAR_CHECK(rollback_window >= 1, "--spike-rollback-window ", rollback_window, "; use a positive step count");
  }
};

// Why a step is a spike.
struct Spike {
  std::string reason;
};

// One incident: the rollbacks of one spike and of those that followed it within
// incident_steps (a bad stretch of data), reported once it closes.
struct Incident {
  std::int64_t first_step = 0, last_step = 0;  // the steps of its first and last spikes
  int rollbacks = 0;
  std::int64_t skipped_steps = 0;              // steps' worth of data never trained on
  std::int64_t extra_skip = 0;                 // the extra skip of its last rollback
  std::vector<double> losses;                  // the spikes' losses, in order
  std::string first_reason;
  double seconds = 0.0;                        // the time its rolled-back steps took
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
    // Far worse than guessing: the run diverged (a learning rate far too high sends the
    // loss there in a few steps, before the running statistics exist to compare with).
    if (cfg_.median_factor > 0.0 && uniform_loss_ > 0.0 && loss > cfg_.median_factor * uniform_loss_) {
      std::snprintf(why, sizeof why, "loss %.4f > %.2f x %.4f, the loss of a uniform guess over the vocabulary", loss,
                    cfg_.median_factor, uniform_loss_);
      return Spike{why};
    }
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

  // ln(vocabulary): the loss of a uniform guess. A loss above median_factor times it is a
  // spike from the first step on (0: not known, no such test).
  void set_uniform_loss(double loss) { uniform_loss_ = loss; }

  // A step that was applied.
  void record(std::int64_t step, double loss) {
    losses_.push_back({step, loss});
    while (static_cast<int>(losses_.size()) > cfg_.window) losses_.pop_front();
  }

  // The run rolls back to after step `to` because of a spike at step `at` (its loss,
  // and the time the failed step took): the losses after `to` are forgotten. Returns the
  // steps' worth of data to skip beyond what was read since `to`. Throws when the spike
  // outlasts max_skip, or when that makes too many incidents in the window.
  std::int64_t rolled_back(std::int64_t at, std::int64_t to, const Spike& why, double loss = NAN,
                           double seconds = 0.0) {
    while (!losses_.empty() && losses_.back().step > to) losses_.pop_back();
    const bool same = open_ && at <= open_->last_step + cfg_.incident_steps;
    std::int64_t extra = cfg_.skip_batches;
    if (same) {
      extra = std::max<std::int64_t>(1, 2 * open_->extra_skip);
      LLMPAR_CHECK(extra <= cfg_.max_skip, "loss spike guard: the spike of step ", open_->first_step,
                   " came back at step ", at, " after ", open_->rollbacks,
                   open_->rollbacks == 1 ? " rollback" : " rollbacks", " that skipped ",
                   open_->skipped_steps, " steps of data (", why.reason, "; the next would skip more than --spike-max-skip ",
                   cfg_.max_skip, "); the run is unstable, not unlucky: lower --lr, raise --warmup or --grad-clip's "
                   "strictness, or check the data");
    } else {
      close();
      incidents_.push_back(at);
      std::size_t recent = 0;
      for (std::int64_t s : incidents_)
        if (s > at - cfg_.rollback_window) ++recent;
      LLMPAR_CHECK(static_cast<int>(recent) <= cfg_.max_rollbacks, "loss spike guard: ", recent,
                   " incidents within ", cfg_.rollback_window, " steps (the last at step ", at, ": ", why.reason,
                   "); the run is unstable, not unlucky: lower --lr, raise --warmup or --grad-clip's strictness, or "
                   "check the data (or raise --spike-max-rollbacks)");
      open_.emplace();
      open_->first_step = at;
      open_->first_reason = why.reason;
    }
    open_->last_step = at;
    ++open_->rollbacks;
    open_->extra_skip = extra;
    open_->skipped_steps += (at - to) + extra;
    open_->losses.push_back(loss);
    open_->seconds += seconds;
    ++rollbacks_;
    return extra;
  }

  // The incident that closed since the last call, if one did: at step `step` (applied),
  // incident_steps after its last rollback, or with `run_over` at the run's last step.
  std::optional<Incident> closed(std::int64_t step, bool run_over) {
    if (open_ && (run_over || step > open_->last_step + cfg_.incident_steps)) close();
    std::optional<Incident> out = std::move(closed_);
    closed_.reset();
    return out;
  }
  const std::optional<Incident>& open_incident() const { return open_; }

  const SpikeGuardConfig& config() const { return cfg_; }
  std::size_t rollbacks() const { return rollbacks_; }

  // The recent losses (for a checkpoint) and back.
  std::vector<std::pair<std::int64_t, double>> history() const {
    std::vector<std::pair<std::int64_t, double>> out;
    for (const Entry& e : losses_) out.emplace_back(e.step, e.loss);
    return out;
  }
  // (A checkpoint keeps the incidents' first steps, which the limit counts; an incident
  // still open when it was written starts afresh after a resume.)
  void restore(const std::vector<std::pair<std::int64_t, double>>& h, std::vector<std::int64_t> incidents) {
    losses_.clear();
    for (const auto& [step, loss] : h) record(step, loss);
    incidents_ = std::move(incidents);
  }
  const std::vector<std::int64_t>& incident_steps() const { return incidents_; }

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

  void close() {
    if (open_) closed_ = std::move(open_);
    open_.reset();
  }

  SpikeGuardConfig cfg_;
  std::deque<Entry> losses_;
  std::vector<std::int64_t> incidents_;  // first steps, for the limit
  std::size_t rollbacks_ = 0;
  std::optional<Incident> open_, closed_;
  double uniform_loss_ = 0.0;
};

}  // namespace llmpar::train
