// llmpar/checkpoint/trainer_state-inl.hpp — the trainer state to and from a checkpoint's JSON.
//
// trainer_state.hpp includes this file unless LLMPAR_COMPILED is defined; a program that
// defines it compiles this file once, in the compiled part of llmpar (src/), where
// LLMPAR_INLINE is empty (config.hpp).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "llmpar/checkpoint/trainer_state.hpp"

namespace llmpar::checkpoint {

LLMPAR_INLINE nlohmann::json TrainerState::to_json() const {
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

LLMPAR_INLINE TrainerState TrainerState::from_json(const nlohmann::json& s, const std::string& what) {
  const auto number = [&](const nlohmann::json& obj, const char* key) -> std::int64_t {
    LLMPAR_CHECK(
        obj.is_object() && obj.contains(key) && obj[key].is_number_integer() && obj[key].get<std::int64_t>() >= 0, what,
        ": the trainer state has no count '", key, "'");
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

}  // namespace llmpar::checkpoint
