// llmpar/train/metrics.hpp — what a step reports: loss, lr, gradient norm, time,
// throughput and MFU; printed as one line and written as JSON lines.
//
// MFU follows the llm.c / Kaplan et al. convention: model FLOPs per token are
// 6·N + 6·L·C·T (N parameters, L layers, C channels, T sequence length), and the
// denominator is the peak of the run's precision: on the CPU the best GEMM throughput
// measured in the same run, in that precision, over square products and the model's
// own GEMM shapes (backend/cpu/peak.hpp), so the figure means "fraction of what this
// machine's GEMM library can do" and cannot exceed 100%; on a GPU the data sheet's
// dense peak of that precision.
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "llmpar/core/error.hpp"
#include "llmpar/train/spike_guard.hpp"

namespace llmpar::train {

struct StepStats {
  std::int64_t step = 0;  // 1-based
  double loss = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;
  double ms = 0.0;
  double tokens_per_s = 0.0;
  std::optional<double> mfu;       // fraction of the peak; none when the peak is not known
  double loss_scale = 1.0;         // the loss scale this step's backward ran with (1 without a scaler)
  bool skipped = false;            // some gradient was inf/NaN: the update was not applied
  std::int64_t skipped_total = 0;  // skipped steps so far, this one included
  double comm_ms = 0.0;            // communication the step waited for (what overlap did not hide)
  double bubble_ms = 0.0;          // pipeline: this rank's wait for other stages (its measured bubble)
  // A loss spike (train/spike_guard.hpp): the step was not applied; the run rolled back
  // to after step rolled_back_to and skipped skipped_batches steps' worth of data.
  bool rolled_back = false;
  std::int64_t rolled_back_to = 0;
  std::int64_t skipped_batches = 0;
  std::string spike;  // why it is a spike
  // A loss-spike incident (train/spike_guard.hpp) that closed with this step: its
  // rollbacks, the data they skipped, the time they cost.
  std::optional<Incident> incident;
};

// Model FLOPs per trained token (forward and backward).
inline double flops_per_token(std::int64_t num_parameters, std::int64_t layers, std::int64_t dim, std::int64_t seq) {
  return 6.0 * static_cast<double>(num_parameters) + 6.0 * static_cast<double>(layers * dim * seq);
}

// Appends one JSON object per line; each record is flushed so a killed run keeps its log.
class MetricsWriter {
 public:
  MetricsWriter() = default;
  // `append`: continue the file (a run resumed from a checkpoint).
  explicit MetricsWriter(const std::string& path, bool append = false);
  bool enabled() const { return out_.is_open(); }

  void write(const nlohmann::json& record);

  // A step record, or for a loss spike the rollback it caused (the step was not applied;
  // the steps after rolled_back_to are logged again as the run repeats them); and an
  // "incident" record after the step that closed one.
  void write_step(const StepStats& s);

 private:
  std::ofstream out_;
};

// "loss spike incident: steps 81-81, 4 rollbacks, 12 steps of data skipped, 0.41 s lost
// (loss 7.0123 > 2.00 x the running median 2.9000)".
LLMPAR_INLINE std::string format_incident(const Incident& i);

// One line per step; `scaled` adds the loss scale (FP16Mixed runs). A skipped step says so.
LLMPAR_INLINE std::string format_step(const StepStats& s, std::int64_t total_steps, bool scaled = false);

}  // namespace llmpar::train

// The bodies: compiled here (header-only), or once in a program that defines
// LLMPAR_COMPILED and links the compiled part of llmpar (config.hpp).
#if !defined(LLMPAR_COMPILED)
#include "llmpar/train/metrics-inl.hpp"
#endif
