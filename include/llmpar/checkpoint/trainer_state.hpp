// llmpar/checkpoint/trainer_state.hpp — what a checkpoint records of a run besides its
// tensors: the step, the optimizer's update count, the data position, the loss scaler
// and the loss-spike guard's history.
//
// It is the "state" object of a checkpoint's metadata.json (checkpoint.hpp), written by
// Trainer::snapshot and read back by Trainer::restore:
//
//   {"step": 6, "optimizer_steps": 6,
//    "loader": {"epoch": 0, "consumed": 48, "seq_len": 64, "shuffle": true, "seed": 1337},
//    "loss_scaler": {"scale": 65536.0, "good_steps": 6, "hysteresis_left": 2, "skipped": 0,
//                    "growths": 0, "backoffs": 0},
//    "spike_guard": {"history": [[1, 5.41], ...], "rollbacks": []}}
//
// Reading checks every field it uses and names the one that is missing or wrong, with
// the checkpoint it came from; a hand-edited or truncated state never resumes a run in
// another place. Checkpoints from before the data order was a function of the seed, the
// global batch and T alone record a window of a shard instead of the sequences read
// ({"shard", "window", "epoch", "window_tokens"}): that position is kept as it was read,
// for the loader to translate (data::DataLoader::from_windows).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "llmpar/core/error.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/precision/loss_scaler.hpp"

namespace llmpar::checkpoint {

struct TrainerState {
  // A data position as checkpoints before format 2 of the loader recorded it.
  struct WindowPosition {
    std::int64_t shard = 0, window = 0, epoch = 0, window_tokens = 0;
  };

  std::int64_t step = 0;                          // steps done
  std::int64_t optimizer_steps = 0;               // of them, applied updates (fp16 skips some)
  data::LoaderState loader;                       // the sequences the world has read
  std::optional<WindowPosition> window_position;  // instead of `loader`, in older checkpoints
  bool shuffle = false;                           // the data order: shuffled with `seed`, or in order
  std::uint64_t seed = 0;
  precision::ScalerState loss_scaler;
  std::vector<std::pair<std::int64_t, double>> spike_history;  // (step, loss) the guard judges by
  std::vector<std::int64_t> rollbacks;                         // steps the guard rolled back at
  bool has_spike_guard = false;                                // the two above were recorded

  nlohmann::json to_json() const;

  // `what` names where `s` came from (the checkpoint's folder) in every error.
  static TrainerState from_json(const nlohmann::json& s, const std::string& what);
};

}  // namespace llmpar::checkpoint

// The bodies: compiled here (header-only), or once in a program that defines
// LLMPAR_COMPILED and links the compiled part of llmpar (config.hpp).
#if !defined(LLMPAR_COMPILED)
#include "llmpar/checkpoint/trainer_state-inl.hpp"
#endif
