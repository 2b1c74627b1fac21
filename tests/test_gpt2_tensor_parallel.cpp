// GPT-2 with its blocks split over tp = 1, 2, 4 thread ranks, with sequence parallelism
// off and on, trains as the serial model: five AdamW steps (with gradient clipping
// active) from the same seed give the same losses and the same final parameters,
// gathered from the ranks' slices, to 1e-5 relative in fp32. The activation memory per
// rank falls as predicted, and sequence parallelism's saving is asserted. A µP model
// (its output multiplier and per-parameter learning rates) at tp 2 trains as its serial
// run. Heads, vocabularies and sequence lengths that the degree does not divide are
// named.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/optim/adamw.hpp"
#include "tensor_parallel_test_util.hpp"

using namespace llmpar;
using tp_test::relative_difference;
using tp_test::Run;

namespace {

models::GPT2Config config() {
  return {.layers = 2, .heads = 4, .dim = 32, .max_seq = 16, .vocab = 50, .padded_vocab = 64, .init_std = 0.05f};
}

}  // namespace

TEST_CASE("GPT-2 split over 1, 2 and 4 tensor-parallel ranks, sequence parallel or not, trains as the serial model") {
  std::mutex mutex;
  Run serial;
  {
    models::GPT2<float> model(config(), 99);
    tp_test::train_five_steps(model, serial, mutex, true);
  }
  for (const auto sp : {SequenceParallel::off, SequenceParallel::on})
    for (int tp : {1, 2, 4}) {
      Run parallel;
      comm::run_threads(tp, [&](comm::ThreadComm& thread_world) {
        comm::Comm world(std::move(thread_world));
        models::GPT2<float> model(config(), 99, nn::TensorParallelGroup(&world, sp));
        tp_test::train_five_steps(model, parallel, mutex, world.rank() == 0);
      });
      const bool sequence_parallel = sp == SequenceParallel::on;
      INFO("tp = " << tp << std::string(sequence_parallel ? ", sequence parallel" : ""));
      REQUIRE(parallel.losses.size() == serial.losses.size());
      for (std::size_t s = 0; s < serial.losses.size(); ++s) {
        INFO("step " << s + 1 << ": " << parallel.losses[s] << " vs serial " << serial.losses[s]);
        CHECK(std::abs(parallel.losses[s] - serial.losses[s]) <= 1e-5 * std::abs(serial.losses[s]));
      }
      REQUIRE(parallel.params.size() == serial.params.size());
      double worst = 0.0, worst_loss = 0.0;
      for (std::size_t k = 0; k < serial.params.size(); ++k) {
        INFO(serial.names[k]);
        CHECK(parallel.names[k] == serial.names[k]);
        const double d = relative_difference(parallel.params[k], serial.params[k]);
        CHECK(d <= 1e-5);
        worst = std::max(worst, d);
        // The first step's gradient too: Adam's update hides a wrong scale of it.
        CHECK(relative_difference(parallel.grads[k], serial.grads[k]) <= 1e-5);
      }
      for (std::size_t s = 0; s < serial.losses.size(); ++s)
        worst_loss = std::max(worst_loss, std::abs(parallel.losses[s] - serial.losses[s]) / serial.losses[s]);
      MESSAGE("tp ", tp, std::string(sequence_parallel ? " with" : " without"),
              " sequence parallelism: largest relative difference from the serial run: losses ", worst_loss,
              ", parameters ", worst);
    }
}

TEST_CASE(
    "GPT-2 under µP split over 2 tensor-parallel ranks, sequence parallel or not, trains as the serial µP model") {
  // Width multiplier 4: the head's input rows and their gradient scaled by 1/4 (on this
  // rank's rows under sequence parallelism), the hidden matrices' slices at lr / 4.
  models::GPT2Config cfg = config();
  cfg.mup = true;
  cfg.mup_base_dim = 8;
  std::mutex mutex;
  Run serial, standard;
  {
    models::GPT2<float> model(cfg, 99);
    tp_test::train_five_steps(model, serial, mutex, true);
    models::GPT2<float> plain(config(), 99);
    tp_test::train_five_steps(plain, standard, mutex, true);
  }
  CHECK(std::abs(serial.losses.back() - standard.losses.back()) > 1e-3);  // µP changes the run
  for (const auto sp : {SequenceParallel::off, SequenceParallel::on}) {
    Run split;
    comm::run_threads(2, [&](comm::ThreadComm& thread_world) {
      comm::Comm world(std::move(thread_world));
      models::GPT2<float> model(cfg, 99, nn::TensorParallelGroup(&world, sp));
      tp_test::train_five_steps(model, split, mutex, world.rank() == 0);
    });
    INFO("tp 2" << std::string(sp == SequenceParallel::on ? ", sequence parallel" : ""));
    REQUIRE(split.losses.size() == serial.losses.size());
    for (std::size_t s = 0; s < serial.losses.size(); ++s)
      CHECK(std::abs(split.losses[s] - serial.losses[s]) <= 1e-5 * std::abs(serial.losses[s]));
    REQUIRE(split.params.size() == serial.params.size());
    for (std::size_t k = 0; k < serial.params.size(); ++k) {
      INFO(serial.names[k]);
      CHECK(relative_difference(split.grads[k], serial.grads[k]) <= 1e-5);
      CHECK(relative_difference(split.params[k], serial.params[k]) <= 1e-5);
    }
  }
}

TEST_CASE("GPT-2 heads that the tensor-parallel degree does not divide are named") {
  comm::run_threads(4, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    models::GPT2Config cfg = config();
    cfg.heads = 2;
    cfg.dim = 32;
    CHECK_THROWS_WITH_AS(models::GPT2<float>(cfg, 1, nn::TensorParallelGroup(&world)),
                         doctest::Contains("heads (2) is not divisible by the tensor-parallel degree 4"), Error);
  });
}

TEST_CASE("GPT-2 vocabularies that the tensor-parallel degree does not divide are named") {
  comm::run_threads(4, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    models::GPT2Config cfg = config();
    cfg.padded_vocab = 66;
    CHECK_THROWS_WITH_AS(
        models::GPT2<float>(cfg, 1, nn::TensorParallelGroup(&world)),
        doctest::Contains("the padded vocabulary (66) is not divisible by the tensor-parallel degree 4"), Error);
  });
}

TEST_CASE("a rank whose vocabulary slice is all padding trains as the serial model") {
  // vocab 40 of 64 rows over 4 ranks: rank 3 holds ids [48, 64), padding only.
  models::GPT2Config cfg = config();
  cfg.vocab = 40;
  std::mutex mutex;
  Run serial, split;
  {
    models::GPT2<float> model(cfg, 7);
    tp_test::train_five_steps(model, serial, mutex, true);
  }
  comm::run_threads(4, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    models::GPT2<float> model(cfg, 7, nn::TensorParallelGroup(&world, SequenceParallel::on));
    tp_test::train_five_steps(model, split, mutex, world.rank() == 0);
  });
  for (std::size_t s = 0; s < serial.losses.size(); ++s)
    CHECK(std::abs(split.losses[s] - serial.losses[s]) <= 1e-5 * std::abs(serial.losses[s]));
  for (std::size_t k = 0; k < serial.params.size(); ++k) {
    INFO(serial.names[k]);
    CHECK(relative_difference(split.params[k], serial.params[k]) <= 1e-5);
  }
}

TEST_CASE("tensor parallelism divides the split activations of every block by tp; sequence parallelism the rest") {
  // Per rank, tensor parallelism splits the attention (q, k, v, output, lse) and MLP
  // (pre-GELU and GELU) activations and the logits; sequence parallelism also splits each block's
  // LayerNorm outputs and residual after attention, and the residual stream between
  // blocks, at the price of two gather/partial buffers of (B·S, C).
  const std::int64_t B = 4, S = 16;
  const models::GPT2Config cfg = config();
  auto measure = [&](int tp, SequenceParallel sp) {
    std::size_t mine = 0;
    comm::run_threads(tp, [&](comm::ThreadComm& thread_world) {
      comm::Comm world(std::move(thread_world));
      backend::cpu::Context ctx;
      models::GPT2<float> model(cfg, 3, nn::TensorParallelGroup(&world, sp));
      std::vector<std::int32_t> tokens(B * S, 1), targets(B * S, 2);
      model.zero_grad(ctx);
      model.forward(ctx, tokens.data(), targets.data(), B, S);
      model.backward(ctx);
      if (world.rank() == 0) mine = model.activation_bytes();
    });
    MESSAGE("tp ", tp, std::string(sp == SequenceParallel::on ? " with" : " without"), " sequence parallelism: ", mine,
            " bytes of activations and activation gradients per rank (B=4, T=16, C=32, L=2)");
    return mine;
  };
  const std::size_t row = static_cast<std::size_t>(B * S) * sizeof(float);  // one float per row
  const std::size_t L = static_cast<std::size_t>(cfg.layers), C = static_cast<std::size_t>(cfg.dim);
  const std::size_t serial = measure(1, SequenceParallel::off);
  // Each block splits 3C (qkv) + C (attention out) + 8C (MLP) + NH (lse) floats per row.
  const std::size_t tp_split = L * row * (12 * C + static_cast<std::size_t>(cfg.heads));
  // The vocabulary-parallel head splits the logits (Vp per row), and the loss keeps its
  // softmax states: 3 floats per row for this rank, 3 per row and rank gathered.
  const std::size_t logits = row * static_cast<std::size_t>(cfg.padded_vocab), stats = 3 * row;
  // Sequence parallelism splits, per block, ln1 and ln2 outputs and x_mid (3C per row)
  // and the two LayerNorms' statistics (mean and rstd: 4 per row); the model's residual
  // stream ((L+1)C), its two residual gradients (2C) and the final norm's statistics (2);
  // the final norm's output is kept as a local copy (+C/tp) besides the gathered one.
  for (int tp : {2, 4}) {
    const std::size_t t = static_cast<std::size_t>(tp);
    const std::size_t without = measure(tp, SequenceParallel::off);
    const std::size_t with = measure(tp, SequenceParallel::on);
    CHECK(serial - without == tp_split * (t - 1) / t + logits * (t - 1) / t - stats * (1 + t));
    const std::size_t sp_split = row * (C * (3 * L + (L + 1) + 2) + 4 * L + 2) * (t - 1) / t;
    const std::size_t sp_added = row * C * 2 /* gathered, partial */ + row * C / t /* lnf_local */;
    CHECK(without - with == sp_split - sp_added);
    CHECK(with < without);
  }
}

TEST_CASE("a sequence that sequence parallelism cannot split is named") {
  comm::run_threads(4, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    backend::cpu::Context ctx;
    models::GPT2<float> model(config(), 1, nn::TensorParallelGroup(&world, SequenceParallel::on));
    std::vector<std::int32_t> tokens(2 * 10, 1);
    CHECK_THROWS_WITH_AS(model.forward(ctx, tokens.data(), tokens.data(), 2, 10),
                         doctest::Contains("sequence length 10 is not divisible by the tensor-parallel degree 4"),
                         Error);
  });
}
