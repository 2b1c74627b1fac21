// The user-defined LLaMA-style block of examples/custom_layer.hpp, checked the way
// llmpar checks its own layers: the user's rotary and SwiGLU code and nn::RMSNorm
// against central finite differences in double, the block's selective recomputation
// against keeping its activations (bitwise, two micro-batches in flight), the whole
// model's gradient against finite differences, and the model split over tp = 1, 2, 4
// thread ranks against the serial run (five AdamW steps: same losses, same gathered
// parameters to 1e-5 relative in fp32).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "../examples/custom_layer.hpp"
#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/nn/model.hpp"
#include "llmpar/nn/rmsnorm.hpp"
#include "llmpar/testing/gradcheck.hpp"
#include "model_test_util.hpp"
#include "tensor_parallel_test_util.hpp"

using namespace llmpar;
using custom_layer::LlamaConfig;
using custom_layer::LlamaModel;
using tp_test::relative_difference;
using tp_test::Run;
using tp_test::train_five_steps;

// A model of a user's blocks is a pipeline::Model, as models::GPT2 is: the trainer takes it.
static_assert(pipeline::check_model<LlamaModel<float>>());

namespace {

std::vector<double> random_vector(std::int64_t n, std::string_view name, double scale = 1.0) {
  const auto stream = rng::Stream::named(17, name);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    v[static_cast<std::size_t>(i)] = scale * stream.normal(static_cast<std::uint64_t>(i));
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of the scalar f at x, element by element, against `analytic`:
// the largest error relative to |numeric| + |analytic| (with an absolute floor).
double worst_fd_error(std::vector<double>& x, const std::function<double()>& f, const std::vector<double>& analytic,
                      double h = 1e-5) {
  double worst = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double up = f();
    x[i] = saved - h;
    const double down = f();
    x[i] = saved;
    const double numeric = (up - down) / (2 * h);
    worst =
        std::max(worst, std::abs(numeric - analytic[i]) / std::max(1e-6, std::abs(numeric) + std::abs(analytic[i])));
  }
  return worst;
}

LlamaConfig small_config() {
  return {.layers = 2,
          .heads = 4,
          .dim = 32,
          .hidden = 64,
          .max_seq = 16,
          .vocab = 50,
          .padded_vocab = 64,
          .init_std = 0.05f};
}

}  // namespace

TEST_CASE("the user's rotary embedding: its backward is the forward's transpose (finite differences)") {
  // Two heads of size 8 on (B, S) = (2, 5): qkv (10, 48).
  const std::int64_t B = 2, S = 5, Cl = 16, n = B * S * 3 * Cl;
  const custom_layer::Rotary<double> rotary(8, 6, 10000.0);
  using Direction = custom_layer::Rotary<double>::Direction;
  std::vector<double> x = random_vector(n, "x");
  const std::vector<double> w = random_vector(n, "w");
  auto f = [&] {
    std::vector<double> y = x;
    rotary.rotate(y.data(), AttentionShape::mha(B, S, Cl, 2), Direction::forward);
    return dot(w, y);
  };
  std::vector<double> grad = w;  // ∂(w · rotate(x))/∂x = rotateᵀ(w)
  rotary.rotate(grad.data(), AttentionShape::mha(B, S, Cl, 2), Direction::backward);
  // f is linear in x, so a large step is exact and keeps rounding out of the quotient.
  CHECK(worst_fd_error(x, f, grad, 1e-2) < 1e-8);

  // v is untouched, and a rotation preserves length.
  std::vector<double> y = x;
  rotary.rotate(y.data(), AttentionShape::mha(B, S, Cl, 2), Direction::forward);
  for (std::int64_t r = 0; r < B * S; ++r)
    for (std::int64_t c = 2 * Cl; c < 3 * Cl; ++c)
      CHECK(y[static_cast<std::size_t>(r * 3 * Cl + c)] == x[static_cast<std::size_t>(r * 3 * Cl + c)]);
  CHECK(dot(y, y) == doctest::Approx(dot(x, x)).epsilon(1e-12));
}

TEST_CASE("the user's rotary embedding makes q·k depend on the distance between positions only") {
  // The same q at every position and the same k at every position: after rotation the
  // score of (t, s) is a function of t - s.
  const std::int64_t S = 6, Cl = 8;
  const custom_layer::Rotary<double> rotary(8, S, 10000.0);
  const std::vector<double> q = random_vector(Cl, "q"), k = random_vector(Cl, "k");
  std::vector<double> qkv(static_cast<std::size_t>(S * 3 * Cl), 0.0);
  for (std::int64_t t = 0; t < S; ++t)
    for (std::int64_t c = 0; c < Cl; ++c) {
      qkv[static_cast<std::size_t>(t * 3 * Cl + c)] = q[static_cast<std::size_t>(c)];
      qkv[static_cast<std::size_t>(t * 3 * Cl + Cl + c)] = k[static_cast<std::size_t>(c)];
    }
  rotary.rotate(qkv.data(), AttentionShape::mha(1, S, Cl, 1), custom_layer::Rotary<double>::Direction::forward);
  auto score = [&](std::int64_t t, std::int64_t s) {
    double sum = 0.0;
    for (std::int64_t c = 0; c < Cl; ++c)
      sum += qkv[static_cast<std::size_t>(t * 3 * Cl + c)] * qkv[static_cast<std::size_t>(s * 3 * Cl + Cl + c)];
    return sum;
  };
  CHECK(score(3, 1) == doctest::Approx(score(5, 3)).epsilon(1e-12));
  CHECK(score(2, 2) == doctest::Approx(score(0, 0)).epsilon(1e-12));
  CHECK(score(4, 0) != doctest::Approx(score(4, 1)).epsilon(1e-6));
}

TEST_CASE("the user's SwiGLU backward matches finite differences in double") {
  const std::int64_t rows = 3, Hl = 5;
  std::vector<double> gate_up = random_vector(rows * 2 * Hl, "gate_up", 2.0);
  const std::vector<double> w = random_vector(rows * Hl, "w");
  auto f = [&] {
    std::vector<double> act(static_cast<std::size_t>(rows * Hl));
    custom_layer::swiglu_forward(act.data(), gate_up.data(), rows, Hl);
    return dot(w, act);
  };
  std::vector<double> grad(gate_up.size());
  custom_layer::swiglu_backward(grad.data(), w.data(), gate_up.data(), rows, Hl);
  CHECK(worst_fd_error(gate_up, f, grad) < 1e-8);
}

TEST_CASE("nn::RMSNorm backward (dx and dweight) matches finite differences in double") {
  backend::cpu::Context ctx;
  const std::int64_t rows = 4, C = 7;
  nn::RMSNorm<double> norm("norm", C);
  nn::ParameterStore<double> store;
  store.bind(norm);
  store.initialize(1);
  nn::Parameter<double>& weight = store.find("norm.weight");
  CHECK(weight.value[0] == 1.0);  // initialised to ones
  std::vector<double> gain = random_vector(C, "gain", 0.5);
  for (std::int64_t c = 0; c < C; ++c) gain[static_cast<std::size_t>(c)] += 1.0;
  std::vector<double> x = random_vector(rows * C, "x");
  const std::vector<double> w = random_vector(rows * C, "w");
  std::vector<double> out(x.size()), dx(x.size());
  nn::RMSNorm<double>::Saved saved;
  auto f = [&] {
    std::copy(gain.begin(), gain.end(), weight.value);
    norm.forward(ctx, saved, out.data(), x.data(), rows);
    return dot(w, out);
  };
  f();
  CHECK(saved.bytes() == rows * sizeof(double));  // 1/rms per row, nothing else
  store.zero_grad();
  norm.backward(ctx, saved, dx.data(), w.data(), x.data(), rows);
  const std::vector<double> dweight(weight.grad, weight.grad + C);
  CHECK(worst_fd_error(x, f, dx) < 1e-7);
  CHECK(worst_fd_error(gain, f, dweight) < 1e-7);
}

namespace {

// One LlamaBlock, two micro-batches in flight as a 1F1B pipeline stage runs them
// (forward a, forward b, backward a, backward b, each with its own Saved): what came
// out, and what the Saveds and the block's scratch held.
struct BlockRun {
  std::vector<float> out, dx;  // both micro-batches, a then b
  std::vector<float> grads;    // the parameter store's flat gradient buffer
  std::size_t saved_bytes = 0, scratch_bytes = 0;
};

BlockRun run_block(bool selective, nn::TensorParallelGroup tp = {}) {
  using Block = custom_layer::LlamaBlock<float>;
  backend::cpu::Context ctx;
  LlamaConfig cfg = small_config();
  cfg.init_std = 0.2f;  // attention far from uniform
  Block block("layers.0", cfg, tp);
  block.set_selective_recompute(selective);
  CHECK(block.selective_recompute() == selective);
  nn::ParameterStore<float> store;
  store.bind(block);
  store.initialize(3);
  const std::int64_t B = 2, S = 8, n = tp.local_rows(B * S) * cfg.dim;
  auto floats = [&](std::string_view name) {
    const std::vector<double> v = random_vector(n, name);
    return std::vector<float>(v.begin(), v.end());
  };
  const std::vector<float> x[2] = {floats("x.a"), floats("x.b")};
  const std::vector<float> dout[2] = {floats("dout.a"), floats("dout.b")};
  Block::Saved saved[2];
  BlockRun run;
  run.out.resize(static_cast<std::size_t>(2 * n));
  run.dx.resize(static_cast<std::size_t>(2 * n));
  for (int m = 0; m < 2; ++m) block.forward(ctx, saved[m], run.out.data() + m * n, x[m].data(), B, S);
  run.saved_bytes = saved[0].bytes();
  CHECK(saved[1].bytes() == run.saved_bytes);
  for (int m = 0; m < 2; ++m) block.backward(ctx, saved[m], run.dx.data() + m * n, dout[m].data(), x[m].data(), B, S);
  run.grads.assign(store.grads(), store.grads() + store.flat_size());
  run.scratch_bytes = block.scratch_bytes();
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void check_selective_like_kept(nn::TensorParallelGroup tp) {
  const BlockRun kept = run_block(false, tp), recomputed = run_block(true, tp);
  CHECK(same_bits(recomputed.out, kept.out));
  CHECK(same_bits(recomputed.dx, kept.dx));
  CHECK(same_bits(recomputed.grads, kept.grads));
  // Not vacuous: the micro-batches differ, so a backward that read the other one's
  // attention output (left in the scratch by the last forward) would not match.
  const std::size_t half = kept.dx.size() / 2;
  CHECK_FALSE(std::equal(kept.dx.begin(), kept.dx.begin() + static_cast<std::ptrdiff_t>(half),
                         kept.dx.begin() + static_cast<std::ptrdiff_t>(half)));
  CHECK(std::any_of(kept.grads.begin(), kept.grads.end(), [](float g) { return g != 0.0f; }));
  // What a Saved no longer holds: the attention output (B, S, C/tp) and its lse
  // (B, NH/tp, S), which the block's scratch holds instead, once for every micro-batch.
  const LlamaConfig cfg = small_config();
  const std::size_t B = 2, S = 8,
                    dropped = (B * S * static_cast<std::size_t>(cfg.dim / tp.size()) +
                               B * static_cast<std::size_t>(cfg.heads / tp.size()) * S) *
                              sizeof(float);
  CHECK(recomputed.saved_bytes < kept.saved_bytes);
  CHECK(kept.saved_bytes - recomputed.saved_bytes == dropped);
  CHECK(recomputed.scratch_bytes - kept.scratch_bytes == dropped);
  MESSAGE("tp ", tp.size(), std::string(tp.sequence_parallel() ? " with" : " without"),
          " sequence parallelism: Saved of one micro-batch ", kept.saved_bytes, " bytes, ", recomputed.saved_bytes,
          " with selective recomputation");
}

}  // namespace

TEST_CASE(
    "LlamaBlock with selective recomputation gives bitwise the same outputs, input gradients and parameter "
    "gradients as keeping the attention core's outputs, and keeps fewer bytes per micro-batch") {
  check_selective_like_kept({});
  // Split over 2 ranks with sequence parallelism: the gathered rows and partial sums
  // share the scratch with the recomputed attention.
  comm::run_threads(2, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    check_selective_like_kept(nn::TensorParallelGroup(&world, SequenceParallel::on));
  });
}

TEST_CASE("a LlamaBlock Saved filled without selective recomputation still serves backward after it is turned on") {
  using Block = custom_layer::LlamaBlock<float>;
  backend::cpu::Context ctx;
  const LlamaConfig cfg = small_config();
  const std::int64_t B = 1, S = 4, n = B * S * cfg.dim;
  Block block("layers.0", cfg);
  nn::ParameterStore<float> store;
  store.bind(block);
  store.initialize(3);
  const std::vector<double> xd = random_vector(n, "x"), doutd = random_vector(n, "dout");
  const std::vector<float> x(xd.begin(), xd.end()), dout(doutd.begin(), doutd.end());
  std::vector<float> out(static_cast<std::size_t>(n)), dx_kept(out.size()), dx_switched(out.size());
  Block::Saved saved;
  block.forward(ctx, saved, out.data(), x.data(), B, S);
  block.backward(ctx, saved, dx_kept.data(), dout.data(), x.data(), B, S);
  const std::size_t kept_bytes = saved.bytes();
  block.forward(ctx, saved, out.data(), x.data(), B, S);
  block.set_selective_recompute(true);  // between a forward and its backward
  block.backward(ctx, saved, dx_switched.data(), dout.data(), x.data(), B, S);
  CHECK(same_bits(dx_switched, dx_kept));
  block.forward(ctx, saved, out.data(), x.data(), B, S);  // now the Saved drops them
  CHECK(saved.bytes() < kept_bytes);
  block.backward(ctx, saved, dx_switched.data(), dout.data(), x.data(), B, S);
  CHECK(same_bits(dx_switched, dx_kept));
}

TEST_CASE("the LLaMA model's gradients of every parameter match central finite differences in double") {
  backend::cpu::Context ctx;
  LlamaConfig cfg = small_config();
  cfg.init_std = 0.2f;  // attention far from uniform, so the rotary path matters
  LlamaModel<double> model(cfg, 7);
  const auto result = testing::check_model(ctx, model, {.batch = 2, .seq = 5, .vocab = cfg.vocab});
  CHECK(result.ok());
  MESSAGE("checked ", result.checked, " gradient elements; worst: ", result.summary());
  CHECK(result.checked > 150);
}

// Sequence parallelism is the layout's (a value, as in a user's trainer); the
// communicator gives the degree.
void check_llama_split_like_serial(const Run& serial, std::mutex& mutex, SequenceParallel sp) {
  for (int tp : {1, 2, 4}) {
    Run parallel;
    comm::run_threads(tp, [&](comm::ThreadComm& thread_world) {
      comm::Comm world(std::move(thread_world));
      LlamaModel<float> model(small_config(), 99, nn::TensorParallelGroup(&world, sp));
      train_five_steps(model, parallel, mutex, world.rank() == 0);
    });
    INFO((sp == SequenceParallel::on ? "sequence parallel" : "no sequence parallelism") << ", tp = " << tp);
    REQUIRE(parallel.losses.size() == serial.losses.size());
    double worst_loss = 0.0;
    for (std::size_t s = 0; s < serial.losses.size(); ++s) {
      INFO("step " << s + 1 << ": " << parallel.losses[s] << " vs serial " << serial.losses[s]);
      CHECK(std::abs(parallel.losses[s] - serial.losses[s]) <= 1e-5 * std::abs(serial.losses[s]));
      worst_loss = std::max(worst_loss, std::abs(parallel.losses[s] - serial.losses[s]) / serial.losses[s]);
    }
    REQUIRE(parallel.params.size() == serial.params.size());
    double worst = 0.0;
    for (std::size_t k = 0; k < serial.params.size(); ++k) {
      INFO(serial.names[k]);
      CHECK(parallel.names[k] == serial.names[k]);
      const double d = relative_difference(parallel.params[k], serial.params[k]);
      CHECK(d <= 1e-5);
      worst = std::max(worst, d);
      // The first step's gradient too: Adam's update hides a wrong scale of it.
      CHECK(relative_difference(parallel.grads[k], serial.grads[k]) <= 1e-5);
    }
    MESSAGE("tp ", tp, std::string(sp == SequenceParallel::on ? " with" : " without"),
            " sequence parallelism: largest relative difference from the serial run: losses ", worst_loss,
            ", parameters ", worst);
  }
}

TEST_CASE(
    "the LLaMA model split over 1, 2 and 4 tensor-parallel ranks, sequence parallel or not, trains as the "
    "serial model") {
  std::mutex mutex;
  Run serial;
  {
    LlamaModel<float> model(small_config(), 99);
    train_five_steps(model, serial, mutex, true);
  }
  CHECK(serial.losses.back() < serial.losses.front());
  check_llama_split_like_serial(serial, mutex, SequenceParallel::off);
  check_llama_split_like_serial(serial, mutex, SequenceParallel::on);
}

TEST_CASE("a hidden size that the tensor-parallel degree does not divide is named") {
  comm::run_threads(4, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    LlamaConfig cfg = small_config();
    cfg.hidden = 66;
    CHECK_THROWS_WITH_AS(LlamaModel<float>(cfg, 1, nn::TensorParallelGroup(&world)),
                         doctest::Contains("hidden (66) is not divisible by the tensor-parallel degree 4"), Error);
  });
}
