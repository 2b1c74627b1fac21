// Mixed precision above the kernels: the loss scaler's state machine, f32 main grads
// under gradient accumulation, the trainer's inf/NaN handling across ranks (an fp16
// overflow on one rank of four skips the step on all four and backs the scale off),
// and bf16 tensor and sequence parallelism against the serial bf16 run.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/comm/grid.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/nn/linear.hpp"
#include "llmpar/optim/adamw.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/precision/loss_scaler.hpp"
#include "llmpar/train/metrics.hpp"
#include "llmpar/train/trainer.hpp"
#include "tensor_parallel_test_util.hpp"

using namespace llmpar;
using precision::DynamicLossScaler;

// ---- The loss scaler ------------------------------------------------------------------

TEST_CASE("the dynamic loss scale grows by growth_factor after growth_interval clean steps") {
  DynamicLossScaler s({.initial_scale = 1024.0f, .growth_factor = 2.0f, .growth_interval = 3});
  CHECK(s.scale() == 1024.0f);
  CHECK_FALSE(s.update(false, 1).grew);
  CHECK_FALSE(s.update(false, 2).grew);
  const auto u = s.update(false, 3);
  CHECK(u.grew);
  CHECK_FALSE(u.skipped);
  CHECK(s.scale() == 2048.0f);
  CHECK(s.good_steps() == 0);
  for (int i = 4; i <= 6; ++i) s.update(false, i);
  CHECK(s.scale() == 4096.0f);
  CHECK(s.growths() == 2);
  CHECK(s.skipped_steps() == 0);
}

TEST_CASE("an overflow skips the step and, with hysteresis 2, backs off on the second one") {
  DynamicLossScaler s({.initial_scale = 65536.0f, .backoff_factor = 0.5f, .growth_interval = 4, .hysteresis = 2});
  auto u = s.update(true, 1);  // first overflow: skipped, scale kept (hysteresis)
  CHECK(u.skipped);
  CHECK_FALSE(u.backed_off);
  CHECK(s.scale() == 65536.0f);
  CHECK(s.hysteresis_left() == 1);
  u = s.update(true, 2);  // second: backed off
  CHECK(u.skipped);
  CHECK(u.backed_off);
  CHECK(s.scale() == 32768.0f);
  u = s.update(true, 3);  // hysteresis used up: every further overflow backs off
  CHECK(u.backed_off);
  CHECK(s.scale() == 16384.0f);
  // A clean run in between resets the growth count, not the hysteresis.
  s.update(false, 4);
  s.update(false, 5);
  CHECK(s.update(true, 6).backed_off);
  CHECK(s.scale() == 8192.0f);
  CHECK(s.good_steps() == 0);
  // Growth restores the hysteresis.
  for (int i = 7; i <= 10; ++i) s.update(false, i);
  CHECK(s.scale() == 16384.0f);
  CHECK(s.hysteresis_left() == 2);
  CHECK_FALSE(s.update(true, 11).backed_off);
  CHECK(s.skipped_steps() == 5);
  CHECK(s.backoffs() == 3);
}

TEST_CASE("the scale backs off to min_scale, and an overflow there is an error that says so") {
  DynamicLossScaler s({.initial_scale = 4.0f, .backoff_factor = 0.25f, .hysteresis = 1, .min_scale = 2.0f});
  CHECK(s.update(true, 1).backed_off);
  CHECK(s.scale() == 2.0f);  // 4 * 0.25 = 1, clamped to the minimum
  CHECK_THROWS_WITH_AS(s.update(true, 2),
                       doctest::Contains("step 2: the gradients hold inf/NaN with the fp16 loss scale at its minimum "
                                         "(2) after 1 overflow(s) in a row"),
                       Error);
  // With the defaults (min 1, hysteresis 2) the error comes on the second overflow at 1.
  DynamicLossScaler d({.initial_scale = 1.0f});
  CHECK_FALSE(d.update(true, 1).backed_off);
  CHECK_THROWS_WITH_AS(d.update(true, 2), doctest::Contains("no loss scale can fix them"), Error);
}

TEST_CASE("the loss scaler's settings are validated with the field and a value that works") {
  using Config = DynamicLossScaler::Config;
  CHECK_THROWS_WITH_AS(DynamicLossScaler(Config{.initial_scale = 0.0f}), doctest::Contains("initial_scale is 0"),
                       Error);
  CHECK_THROWS_WITH_AS(DynamicLossScaler(Config{.growth_factor = 1.0f}), doctest::Contains("growth_factor is 1"),
                       Error);
  CHECK_THROWS_WITH_AS(DynamicLossScaler(Config{.backoff_factor = 1.5f}), doctest::Contains("backoff_factor is 1.5"),
                       Error);
  CHECK_THROWS_WITH_AS(DynamicLossScaler(Config{.growth_interval = 0}), doctest::Contains("growth_interval is 0"),
                       Error);
  CHECK_THROWS_WITH_AS(DynamicLossScaler(Config{.hysteresis = 0}), doctest::Contains("hysteresis is 0"), Error);
  CHECK_THROWS_WITH_AS(DynamicLossScaler(Config{.initial_scale = 2.0f, .min_scale = 4.0f}),
                       doctest::Contains("min_scale is 4; it must be in (0, initial_scale = 2]"), Error);
  // Growth never reaches inf.
  DynamicLossScaler big({.initial_scale = 0x1p127f, .growth_interval = 1});
  CHECK_FALSE(big.update(false, 1).grew);
  CHECK(std::isfinite(big.scale()));
}

TEST_CASE("without a loss scaler an inf/NaN step is skipped and counted, the scale stays 1") {
  precision::NoLossScaler s;
  CHECK(s.scale() == 1.0f);
  CHECK(s.update(true, 1).skipped);
  CHECK_FALSE(s.update(false, 2).skipped);
  CHECK(s.skipped_steps() == 1);
}

// ---- f32 main grads ---------------------------------------------------------------------

TEST_CASE("gradient accumulation keeps small micro-batch gradients in f32 main grads; a bf16 sum loses them") {
  // One bf16 linear layer, 1 row: micro-batch 0 contributes 1 to every weight gradient,
  // the next 255 contribute 2^-9 each. bf16 spaces its values 2^-7 apart at 1, so
  // 1 + 2^-9 rounds back to 1: a bf16 accumulator would stay at 1 for good, losing a
  // third of the exact total 1 + 255·2^-9 = 1.498046875 (exact in f32 too).
  backend::cpu::Context ctx;
  nn::Linear<bf16> layer("acc", 8, 4, true, 0.02f);
  nn::ParameterStore<bf16> store;
  store.bind(layer);
  store.initialize(1);
  const std::vector<bf16> x(8, bf16(1.0f));
  std::vector<bf16> dy(4, bf16(1.0f));
  layer.weight_bias_backward(ctx, dy.data(), x.data(), 1);
  float emulated_bf16 = 1.0f;
  dy.assign(4, bf16(0x1p-9f));
  for (int micro = 1; micro < 256; ++micro) {
    layer.weight_bias_backward(ctx, dy.data(), x.data(), 1);
    emulated_bf16 = static_cast<float>(bf16(emulated_bf16 + 0x1p-9f));
  }
  const double exact = 1.0 + 255.0 * 0x1p-9;
  for (std::int64_t i = 0; i < 4 * 8; ++i) REQUIRE(layer.weight().grad[i] == exact);
  for (std::int64_t i = 0; i < 4; ++i) REQUIRE(layer.bias().grad[i] == exact);
  CHECK(emulated_bf16 == 1.0f);  // what accumulating in bf16 would have kept
  MESSAGE("256 micro-batches: f32 main grad ", layer.weight().grad[0], ", bf16 accumulation ", emulated_bf16,
          ", exact ", exact);
}

// ---- The trainer across ranks --------------------------------------------------------------

namespace {

models::GPT2Config tiny() {
  return {.layers = 2, .heads = 4, .dim = 32, .max_seq = 16, .vocab = 64, .padded_vocab = 64};
}

std::vector<std::uint16_t> token_stream(std::int64_t n, std::int64_t vocab) {
  const auto stream = rng::Stream::named(5, "precision tokens");
  std::vector<std::uint16_t> t(static_cast<std::size_t>(n));
  // A learnable pattern (each token predicts the next) with some noise.
  for (std::int64_t i = 0; i < n; ++i)
    t[i] = static_cast<std::uint16_t>((i % 7 == 0 ? stream.bits(static_cast<std::uint64_t>(i))[0] : i * 3) % vocab);
  return t;
}

struct RankLog {
  std::vector<train::StepStats> steps;
  std::vector<float> before, after;  // the weights around the faulty step
  int updates = 0;
  float final_scale = 0.0f;
};

}  // namespace

TEST_CASE(
    "fp16: an inf in one rank's gradients of 4 skips that step on all 4, backs the scale off, and the run "
    "continues") {
  // 4 thread ranks as tp 2 x dp 2: the fault is on rank 3 (tp rank 1 of dp rank 1), in
  // a replicated parameter, after the gradients were averaged over dp, so only the
  // verdict's reduction over both groups can tell the other three ranks.
  using Policy = Compose<backend::Cpu, precision::FP16Mixed<precision::DynamicLossScale>>;
  using Model = models::GPT2<f16>;
  const std::int64_t kSteps = 6, kFaultStep = 3;
  const auto data_tokens = token_stream(20000, tiny().vocab);
  const std::string metrics_path = "precision_fault_metrics.jsonl";
  std::vector<RankLog> logs(4);
  comm::run_threads(4, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    comm::Grid grid(world, {.tp = 2});
    backend::cpu::Context ctx;
    Model model(tiny(), 11, nn::TensorParallelGroup(&grid.tp()));
    const data::TokenDataset dataset = data::TokenDataset::from_tokens(data_tokens, 64, "tokens");
    data::DataLoader loader(dataset,
                            {.batch_size = 2, .seq_len = 16, .rank = grid.dp().rank(), .world = grid.dp().size()});
    parallel::LayoutConfig layout = parallel::layout_of<Policy>();
    layout.tp = 2;
    layout.fit_world(4);
    layout.micro_batch = 2;
    train::Trainer<Model, Policy> trainer(
        ctx, model, {.lr = 1e-3f}, {.peak_lr = 1e-3f, .warmup_steps = 0, .total_steps = kSteps}, loader,
        {.steps = kSteps, .loss_scale = {.initial_scale = 1024.0f, .hysteresis = 1}, .layout = layout},
        parallel::Groups::of(grid));
    RankLog& log = logs[static_cast<std::size_t>(world.rank())];
    auto snapshot = [&] {
      auto& store = model.parameter_store();
      std::vector<float> w(static_cast<std::size_t>(store.flat_size()));
      for (std::int64_t i = 0; i < store.flat_size(); ++i) w[i] = static_cast<float>(store.values()[i]);
      return w;
    };
    trainer.set_gradient_hook([&](Model& m) {
      if (trainer.steps_done() + 1 == kFaultStep && world.rank() == 3)
        m.parameter_store().find("ln_f.weight").grad[0] = std::numeric_limits<float>::infinity();
    });
    train::MetricsWriter metrics(world.rank() == 0 ? metrics_path : std::string());
    while (trainer.steps_done() < kSteps) {
      if (trainer.steps_done() + 1 == kFaultStep) log.before = snapshot();
      const train::StepStats s = trainer.step();
      if (s.step == kFaultStep) log.after = snapshot();
      log.steps.push_back(s);
      metrics.write_step(s);
    }
    log.updates = trainer.optimizer().steps_taken();
    log.final_scale = trainer.loss_scaler().scale();
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const RankLog& log = logs[static_cast<std::size_t>(r)];
    REQUIRE(log.steps.size() == static_cast<std::size_t>(kSteps));
    for (std::int64_t s = 1; s <= kSteps; ++s) {
      const train::StepStats& st = log.steps[static_cast<std::size_t>(s - 1)];
      CHECK(st.skipped == (s == kFaultStep));
      // The scale of each step's backward: 1024 until the fault, then backed off to 512.
      CHECK(st.loss_scale == (s <= kFaultStep ? 1024.0 : 512.0));
      CHECK(std::isfinite(st.loss));
      CHECK(st.loss == logs[0].steps[static_cast<std::size_t>(s - 1)].loss);  // every rank: the same loss
    }
    CHECK(log.before == log.after);  // the skipped step changed no weight
    CHECK(log.updates == kSteps - 1);
    CHECK(log.final_scale == 512.0f);
    CHECK(log.steps.back().skipped_total == 1);
  }
  // The metrics log shows the skip and the scale.
  std::ifstream in(metrics_path);
  int records = 0, skipped = 0;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    ++records;
    if (j.at("skipped").get<bool>()) {
      ++skipped;
      CHECK(j.at("step").get<int>() == kFaultStep);
      CHECK(j.at("loss_scale").get<double>() == 1024.0);
    }
  }
  CHECK(records == kSteps);
  CHECK(skipped == 1);
  std::remove(metrics_path.c_str());
}

TEST_CASE("fp32 and bf16 skip a step whose gradient is NaN, with the same verdict on every rank") {
  using Policy = Compose<backend::Cpu, precision::BF16Mixed>;
  using Model = models::GPT2<bf16>;
  const auto data_tokens = token_stream(8000, tiny().vocab);
  std::vector<std::vector<bool>> skipped(2);
  comm::run_threads(2, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    backend::cpu::Context ctx;
    Model model(tiny(), 3);
    const data::TokenDataset dataset = data::TokenDataset::from_tokens(data_tokens, 64, "tokens");
    data::DataLoader loader(dataset, {.batch_size = 2, .seq_len = 16, .rank = world.rank(), .world = 2});
    parallel::LayoutConfig layout = parallel::layout_of<Policy>();
    layout.fit_world(2);
    layout.micro_batch = 2;
    train::Trainer<Model, Policy> trainer(ctx, model, {.lr = 1e-3f},
                                          {.peak_lr = 1e-3f, .warmup_steps = 0, .total_steps = 3}, loader,
                                          {.steps = 3, .layout = layout}, {.dp = &world, .world = &world});
    trainer.set_gradient_hook([&](Model& m) {
      if (trainer.steps_done() == 1 && world.rank() == 0) m.parameter_store().grads()[5] = std::nanf("");
    });
    for (int s = 0; s < 3; ++s) skipped[static_cast<std::size_t>(world.rank())].push_back(trainer.step().skipped);
    CHECK(trainer.optimizer().steps_taken() == 2);
  });
  CHECK(skipped[0] == std::vector<bool>{false, true, false});
  CHECK(skipped[1] == skipped[0]);
}

// ---- bf16 tensor and sequence parallelism ------------------------------------------------

namespace {

// ||a - b|| / ||b|| (Frobenius): a norm-wise relative difference.
double norm_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0.0, s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    s += double(b[i]) * b[i];
  }
  return std::sqrt(d / std::max(s, 1e-60));
}

}  // namespace

TEST_CASE("bf16 tensor and sequence parallelism over 2 and 4 ranks train as the serial bf16 model") {
  // Where the split run rounds differently from the serial one: a row-parallel layer's
  // partial products are rounded to bf16 before they are summed over the group (2 per
  // block forward), and so are a column-parallel layer's partial input gradients (2 per
  // block backward) and the LM head's. Each is one extra bf16 rounding, relative error
  // u = 2^-8, of a quantity the rest of the step depends on linearly: over the L = 2
  // blocks, the embedding and the head that is (4L + 2) = 10 roundings, so the first
  // step's gradients agree with the serial run to 10u ≈ 4% norm-wise per parameter and
  // the loss (a mean over 48 tokens, where the roundings average out) far better. The
  // statistics that decide the loss, the norms and the softmax run in f32 on both.
  const double u = 0x1p-8, grads_tolerance = 10 * u;
  const models::GPT2Config cfg = tiny();
  std::mutex mutex;
  tp_test::Run serial;
  {
    models::GPT2<bf16> model(cfg, 7);
    tp_test::train_five_steps(model, serial, mutex, true);
  }
  for (const int tp : {2, 4}) {
    for (const auto sp : {SequenceParallel::off, SequenceParallel::on}) {
      CAPTURE(tp);
      CAPTURE(sp == SequenceParallel::on);
      tp_test::Run split;
      comm::run_threads(tp, [&](comm::ThreadComm& thread_world) {
        comm::Comm world(std::move(thread_world));
        models::GPT2<bf16> model(cfg, 7, nn::TensorParallelGroup(&world, sp));
        tp_test::train_five_steps(model, split, mutex, world.rank() == 0);
      });
      double worst_grad = 0.0, worst_param = 0.0, worst_loss = 0.0;
      for (std::size_t k = 0; k < serial.grads.size(); ++k) {
        INFO(serial.names[k]);
        const double g = norm_difference(split.grads[k], serial.grads[k]);
        CHECK(g <= grads_tolerance);
        worst_grad = std::max(worst_grad, g);
        worst_param = std::max(worst_param, norm_difference(split.params[k], serial.params[k]));
      }
      for (std::size_t s = 0; s < serial.losses.size(); ++s) {
        const double d = std::abs(split.losses[s] - serial.losses[s]) / serial.losses[s];
        CHECK(d <= 4 * u);
        worst_loss = std::max(worst_loss, d);
      }
      // After 5 Adam steps of lr 1e-2 a weight moves by up to 5e-2; the first step's
      // gradient difference shifts Adam's normalised update by at most that much of it.
      CHECK(worst_param <= grads_tolerance);
      MESSAGE("bf16 tp ", tp, std::string(sp == SequenceParallel::on ? " sp" : ""), ": first-step gradients within ",
              worst_grad, " (norm-wise), losses within ", worst_loss, " (relative), weights after 5 steps within ",
              worst_param, " of the serial bf16 run");
    }
  }
}
