// The loss spike guard (train/spike_guard.hpp, train::Trainer), which rolls back to an
// in-memory snapshot through the checkpoint's restore: what is a spike and what is not
// (the running median, the z-score with its floor, non-finite losses and norms, fp16's
// overflows that the loss scaler skips); and a corrupted batch injected at a known step
// makes the run roll back, skip it, and end bit for bit where a run that never saw that
// batch ends (one rank, fp32).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/parallel/layout.hpp"
#include "llmpar/train/spike_guard.hpp"
#include "llmpar/train/trainer.hpp"

using namespace llmpar;

namespace spike {

using train::SpikeGuard;
using train::SpikeGuardConfig;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

SpikeGuard with_history(const SpikeGuardConfig& cfg, const std::vector<double>& losses) {
  SpikeGuard g(cfg);
  for (std::size_t i = 0; i < losses.size(); ++i) g.record(static_cast<std::int64_t>(i + 1), losses[i]);
  return g;
}

// A stream the tiny model learns quickly (a period-17 sequence of distinct symbols), with
// the windows of steps bad .. bad + count - 1 (1-based; B*T tokens after the first's
// first; bad 0: none) replaced by noise.
std::vector<std::uint16_t> stream_with_bad_window(std::int64_t window, std::int64_t bad, std::int64_t n,
                                                  std::int64_t count = 1) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(n));
  const std::uint16_t period[17] = {3, 41, 7, 19, 0, 33, 12, 48, 25, 5, 38, 16, 29, 44, 9, 21, 36};
  for (std::int64_t i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = period[i % 17];
  const rng::Stream noise(11);
  for (std::int64_t i = (bad - 1) * window + 1; bad > 0 && i < std::min((bad + count - 1) * window, n); ++i)
    out[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(noise.bits(static_cast<std::uint64_t>(i))[0] % 50);
  return out;
}

models::GPT2Config tiny() {
  return {.layers = 2, .heads = 2, .dim = 32, .max_seq = 16, .vocab = 50, .padded_vocab = 64, .init_std = 0.05f};
}

struct Result {
  std::vector<train::StepStats> steps;  // every step() in order, rollbacks included
  std::vector<float> params;            // the flat store after the last step
  double val_loss = 0.0;                // on 8 batches of the clean stream
};

// 30 steps of the tiny model; `guard` on or off; `skip_after`: without the guard, skip
// `skip` steps' worth of data after that step (the run that never saw them).
template <class Policy = Compose<backend::Cpu>>
Result train_run(const std::vector<std::uint16_t>& tokens, const SpikeGuardConfig& guard, std::int64_t skip_after = 0,
                 std::int64_t skip = 0, const precision::DynamicLossScale::Config& scale = {}, std::int64_t steps = 30,
                 float lr = 1e-2f) {
  using T = typename Policy::precision::Compute;
  using Model = models::GPT2<T, backend::Cpu>;
  backend::cpu::Context ctx;
  Model model(tiny(), 5);
  const auto data = data::TokenDataset::from_tokens(tokens, 50, "spiky");
  data::DataLoader loader(data, {.batch_size = 4, .seq_len = 16});
  parallel::LayoutConfig layout = parallel::layout_of<Policy>();
  layout.micro_batch = 4;
  train::Trainer<Model, Policy> trainer(ctx, model, {.lr = lr, .eps = 1e-6f},
                                        {.peak_lr = lr, .warmup_steps = 2, .total_steps = steps}, loader,
                                        {.steps = steps, .loss_scale = scale, .layout = layout, .spike_guard = guard});
  Result r;
  while (trainer.steps_done() < steps) {
    r.steps.push_back(trainer.step());
    if (trainer.steps_done() == skip_after && skip > 0) {
      for (std::int64_t i = 0; i < skip; ++i) static_cast<void>(loader.next());  // not through the trainer
    }
  }
  const auto& store = model.parameter_store();
  for (std::int64_t i = 0; i < store.flat_size(); ++i) r.params.push_back(static_cast<float>(store.values()[i]));
  const auto val = data::TokenDataset::from_tokens(stream_with_bad_window(64, 0, 40 * 64), 50, "clean");
  data::DataLoader val_loader(val, {.batch_size = 4, .seq_len = 16});
  r.val_loss = trainer.evaluate(val_loader, 8);
  return r;
}

}  // namespace spike

using spike::kNaN;
using spike::Result;
using spike::SpikeGuard;
using spike::SpikeGuardConfig;
using spike::stream_with_bad_window;
using spike::train_run;
using spike::with_history;

TEST_CASE("spike guard: a loss far above the running median or mean is a spike; noise is not") {
  SpikeGuardConfig cfg{.enabled = true, .median_factor = 2.0, .z_score = 8.0, .window = 8, .min_history = 4};
  const SpikeGuard g = with_history(cfg, {2.0, 1.9, 2.1, 1.8, 2.0, 1.95});
  CHECK(!g.check(2.3, 1.0, false));  // noise
  const auto median = g.check(4.5, 1.0, false);
  REQUIRE(median);
  CHECK(median->reason.find("> 2.00 x the running median 1.9") != std::string::npos);
  // The z-score alone (factor off): 2.8 is 8+ deviations (0.11) above 1.96.
  cfg.median_factor = 0.0;
  const SpikeGuard z = with_history(cfg, {2.0, 1.9, 2.1, 1.8, 2.0, 1.95});
  CHECK(!z.check(2.5, 1.0, false));
  const auto spike = z.check(2.9, 1.0, false);
  REQUIRE(spike);
  CHECK(spike->reason.find("standard deviations above the running mean") != std::string::npos);
  // A flat history: the deviation is floored at 1% of the median, so a 5% bump is no spike.
  const SpikeGuard flat = with_history(cfg, {1.0, 1.0, 1.0, 1.0, 1.0});
  CHECK(!flat.check(1.05, 1.0, false));
  CHECK(flat.check(1.2, 1.0, false));
}

TEST_CASE("spike guard: non-finite losses and norms are spikes, fp16's skipped overflows are not") {
  const SpikeGuardConfig cfg{.enabled = true, .window = 8, .min_history = 4};
  const SpikeGuard g(cfg);  // no history: only the non-finite checks apply
  CHECK(!g.check(9.0, 1.0, false));
  CHECK(g.check(kNaN, 1.0, false)->reason == "the loss is not finite");
  CHECK(g.check(2.0, std::numeric_limits<double>::infinity(), false)->reason == "the gradient norm is not finite");
  CHECK(!g.check(2.0, std::numeric_limits<double>::infinity(), /*scaler_skips=*/true));
}

TEST_CASE(
    "spike guard: a spike soon after a rollback is the same incident and doubles the skip; too many incidents, or "
    "a spike that outlasts --spike-max-skip, stop the run with a sentence") {
  SpikeGuard g({.enabled = true, .window = 8, .min_history = 4, .skip_batches = 1, .incident_steps = 5,
                .max_skip = 8, .max_rollbacks = 2, .rollback_window = 100});
  for (int s = 1; s <= 10; ++s) g.record(s, 2.0);
  CHECK(g.rolled_back(11, 10, {"x"}, 9.0) == 1);  // an incident's first rollback: --spike-skip
  CHECK(g.history().size() == 8);
  CHECK(g.rolled_back(11, 10, {"x"}, 8.0) == 2);  // the same step again: the same incident, twice the skip
  CHECK(g.rolled_back(13, 10, {"x"}, 7.0) == 4);  // within 5 steps of the last: still the same
  CHECK(g.incident_steps() == std::vector<std::int64_t>{11});
  CHECK_FALSE(g.closed(16, false));  // 3 steps after the last rollback: still open
  const auto incident = g.closed(19, false);
  REQUIRE(incident);
  CHECK(incident->first_step == 11);
  CHECK(incident->last_step == 13);
  CHECK(incident->rollbacks == 3);
  CHECK(incident->skipped_steps == (1 + 1) + (1 + 2) + (3 + 4));
  CHECK(incident->losses == std::vector<double>{9.0, 8.0, 7.0});
  CHECK_FALSE(g.closed(20, true));  // closed once
  CHECK(g.rolled_back(50, 45, {"y"}) == 1);  // a second incident
  CHECK(g.rolled_back(51, 45, {"y"}) == 2);
  CHECK(g.rolled_back(52, 45, {"y"}) == 4);
  CHECK(g.rolled_back(53, 45, {"y"}) == 8);
  CHECK_THROWS_WITH_AS(g.rolled_back(54, 45, {"loss 9 > 2 x the running median 2"}),
                       doctest::Contains("the spike of step 50 came back at step 54 after 4 rollbacks"), Error);
  SpikeGuard h({.enabled = true, .incident_steps = 5, .max_rollbacks = 2, .rollback_window = 100});
  h.rolled_back(10, 9, {"x"});
  h.rolled_back(30, 29, {"x"});
  CHECK_THROWS_WITH_AS(h.rolled_back(60, 59, {"loss 9 > 2 x the running median 2"}),
                       doctest::Contains("3 incidents within 100 steps (the last at step 60: loss 9 > 2"), Error);
  SpikeGuard w({.enabled = true, .incident_steps = 5, .max_rollbacks = 1, .rollback_window = 10});
  w.rolled_back(5, 4, {"x"});
  CHECK_NOTHROW(w.rolled_back(30, 29, {"x"}));  // the first is outside the window by now
}

TEST_CASE("spike guard: bad settings are errors naming the flag") {
  auto fails = [](SpikeGuardConfig c, const char* what) {
    c.enabled = true;
    CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains(what), Error);
  };
  fails({.median_factor = 0.5}, "--spike-factor 0.5");
  fails({.z_score = -1.0}, "--spike-z -1");
  fails({.window = 1}, "--spike-window 1");
  fails({.window = 8, .min_history = 9}, "--spike-min-history 9 must be in [2, --spike-window 8]");
  fails({.snapshot_every = 0}, "--spike-snapshot-every 0");
  fails({.skip_batches = -1}, "--spike-skip -1");
  fails({.max_rollbacks = 0}, "--spike-max-rollbacks 0");
  fails({.incident_steps = 0}, "--spike-incident-steps 0");
  fails({.skip_batches = 4, .max_skip = 2}, "--spike-max-skip 2 is below --spike-skip 4");
  CHECK_NOTHROW(SpikeGuardConfig{.enabled = false, .window = 0}.validate());
}

TEST_CASE("spike guard: a corrupted batch rolls the run back, is skipped, and the run ends where one without it ends") {
  const std::int64_t window = 4 * 16, bad = 14;
  const auto tokens = stream_with_bad_window(window, bad, 60 * window);
  const SpikeGuardConfig guard{.enabled = true, .window = 8, .min_history = 5, .snapshot_every = 4, .skip_batches = 1};
  // The guarded run: the spike at step 14 rolls back to step 12's snapshot and skips the
  // data of steps 13, 14 and one more.
  const Result guarded = train_run(tokens, guard);
  std::vector<const train::StepStats*> rollbacks;
  for (const auto& s : guarded.steps)
    if (s.rolled_back) rollbacks.push_back(&s);
  REQUIRE(rollbacks.size() == 1);
  CHECK(rollbacks[0]->step == bad);
  CHECK(rollbacks[0]->rolled_back_to == 12);
  CHECK(rollbacks[0]->skipped_batches == 3);
  MESSAGE("step 14: ", rollbacks[0]->spike);
  // Without the guard, the corrupted batch is trained on: its loss is the spike's.
  const Result unguarded = train_run(tokens, {});
  CHECK(unguarded.steps[bad - 1].loss == rollbacks[0]->loss);
  CHECK(unguarded.params != guarded.params);
  // The run that never saw the data of steps 13 to 15: the same steps, bit for bit.
  const Result clean = train_run(tokens, {}, 12, 3);
  // The guarded run's steps as it kept them (the rollback discarded step 13's first try).
  std::vector<double> kept;
  for (const auto& s : guarded.steps) {
    if (s.rolled_back) kept.resize(static_cast<std::size_t>(s.rolled_back_to));
    if (!s.rolled_back) kept.push_back(s.loss);
  }
  REQUIRE(kept.size() == clean.steps.size());
  for (std::size_t i = 0; i < kept.size(); ++i) CHECK(kept[i] == clean.steps[i].loss);
  CHECK(guarded.params == clean.params);
}

TEST_CASE("spike guard: fp16's overflowing first steps are skipped by the scaler, not rolled back") {
  const auto tokens = stream_with_bad_window(64, 0, 60 * 64);
  const Result r = train_run<Compose<backend::Cpu, precision::FP16Mixed<precision::DynamicLossScale>>>(
      tokens, {.enabled = true, .window = 8, .min_history = 5}, 0, 0,
      {.initial_scale = 1e30f, .growth_interval = 1000, .hysteresis = 1});
  int skipped = 0;
  for (const auto& s : r.steps) {
    CHECK(!s.rolled_back);
    skipped += s.skipped ? 1 : 0;
  }
  CHECK(skipped > 0);
}

TEST_CASE(
    "spike guard: a bad stretch of 5 and of 50 batches is one incident; the run finishes within 1% of the clean "
    "run's validation loss; 100x the learning rate stops with the sentence") {
  const std::int64_t window = 4 * 16, steps = 60, bad = 31;
  const SpikeGuardConfig guard{.enabled = true};  // the defaults
  const Result clean = train_run(stream_with_bad_window(window, 0, 200 * window), {}, 0, 0, {}, steps);
  for (std::int64_t count : {5, 50}) {
    const Result r = train_run(stream_with_bad_window(window, bad, 200 * window, count), guard, 0, 0, {}, steps);
    int rollbacks = 0, incidents = 0;
    for (const auto& s : r.steps) {
      rollbacks += s.rolled_back ? 1 : 0;
      if (s.incident) {
        ++incidents;
        CHECK(s.incident->first_step == bad);
        CHECK(s.incident->rollbacks == rollbacks);
        CHECK(s.incident->skipped_steps >= count);
        MESSAGE(count, " bad batches: ", train::format_incident(*s.incident));
      }
    }
    CHECK(incidents == 1);
    CHECK(r.steps.back().step == steps);
    MESSAGE(count, " bad batches: validation loss ", r.val_loss, " against the clean run's ", clean.val_loss);
    CHECK(std::abs(r.val_loss - clean.val_loss) <= 0.01 * clean.val_loss);
  }
  CHECK_THROWS_WITH_AS(train_run(stream_with_bad_window(window, 0, 200 * window), guard, 0, 0, {}, steps, 1.0f),
                       doctest::Contains("the run is unstable, not unlucky"), Error);
}
