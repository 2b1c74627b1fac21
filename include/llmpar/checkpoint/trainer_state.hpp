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

  nlohmann::json to_json() const {
    return {{"step", step},
            {"optimizer_steps", optimizer_steps},
            {"loader",
             {{"epoch", loader.epoch},
              {"consumed", loader.consumed},
              {"seq_len", loader.seq_len},
              {"shuffle", shuffle},
              {"seed", seed}}},
            {"loss_scaler",
             {{"scale", loss_scaler.scale},
              {"good_steps", loss_scaler.good_steps},
              {"hysteresis_left", loss_scaler.hysteresis_left},
              {"skipped", loss_scaler.skipped},
              {"growths", loss_scaler.growths},
              {"backoffs", loss_scaler.backoffs}}},
            {"spike_guard", {{"history", spike_history}, {"rollbacks", rollbacks}}}};
  }

  // `what` names where `s` came from (the checkpoint's folder) in every error.
  static TrainerState from_json(const nlohmann::json& s, const std::string& what) {
    const auto number = [&](const nlohmann::json& obj, const char* key) -> std::int64_t {
      LLMPAR_CHECK(
          obj.is_object() && obj.contains(key) && obj[key].is_number_integer() && obj[key].get<std::int64_t>() >= 0,
          what, ": the trainer state has no count '", key, "'");
      return obj[key].get<std::int64_t>();
    };
    TrainerState t;
    t.step = number(s, "step");
    t.optimizer_steps = number(s, "optimizer_steps");
    LLMPAR_CHECK(t.optimizer_steps <= t.step && t.step < (std::int64_t{1} << 31), what, ": ", t.optimizer_steps,
                 " optimizer updates in ", t.step, " steps");
    LLMPAR_CHECK(s.contains("loader") && s.contains("loss_scaler"), what,
                 ": the trainer state has no 'loader' or 'loss_scaler'");
    const nlohmann::json& l = s["loader"];
    t.shuffle = l.contains("shuffle") && l["shuffle"].is_boolean() && l["shuffle"].get<bool>();
    t.seed = l.contains("seed") && l["seed"].is_number_unsigned() ? l["seed"].get<std::uint64_t>() : 0;
    if (l.contains("consumed"))
      t.loader = {.epoch = number(l, "epoch"), .consumed = number(l, "consumed"), .seq_len = number(l, "seq_len")};
    else
      t.window_position = WindowPosition{.shard = number(l, "shard"),
                                         .window = number(l, "window"),
                                         .epoch = number(l, "epoch"),
                                         .window_tokens = number(l, "window_tokens")};
    const nlohmann::json& sc = s["loss_scaler"];
    LLMPAR_CHECK(sc.is_object() && sc.contains("scale") && sc["scale"].is_number(), what,
                 ": the loss scaler state has no scale");
    t.loss_scaler = {.scale = sc["scale"].get<float>(),
                     .good_steps = static_cast<int>(number(sc, "good_steps")),
                     .hysteresis_left = static_cast<int>(number(sc, "hysteresis_left")),
                     .skipped = number(sc, "skipped"),
                     .growths = number(sc, "growths"),
                     .backoffs = number(sc, "backoffs")};
    if (s.contains("spike_guard")) {
      const nlohmann::json& g = s["spike_guard"];
      try {
        t.spike_history = g.at("history").get<std::vector<std::pair<std::int64_t, double>>>();
        t.rollbacks = g.at("rollbacks").get<std::vector<std::int64_t>>();
      } catch (const nlohmann::json::exception&) {
        LLMPAR_FAIL(what, ": the spike guard's state is not {history: [[step, loss], ...], rollbacks: [step, ...]}");
      }
      t.has_spike_guard = true;
    }
    return t;
  }
};

}  // namespace llmpar::checkpoint
