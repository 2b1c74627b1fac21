// The sub-layers a block is composed of, nn::SelfAttention (multi-head, and grouped-query
// with rotary positions) and nn::Mlp over GELU, SwiGLU and GeGLU, checked with the library's own gradient checker
// (llmpar/testing/ gradcheck.hpp) in double; the checker itself against backwards that are wrong by 0.1%; the gated
// units' 16-bit kernels against the float kernel; and both sub-layers split over 2 and 4 thread ranks, with and without
// sequence parallelism, against the serial layer (outputs, input gradients and every parameter's gradient).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/nn/attention.hpp"
#include "llmpar/nn/mlp.hpp"
#include "llmpar/testing/gradcheck.hpp"
#include "tensor_parallel_test_util.hpp"

using namespace llmpar;

namespace {

constexpr std::int64_t kDim = 16;

template <class T, class Backend = backend::Cpu>
nn::SelfAttention<T, Backend> attention(bool bias, nn::TensorParallelGroup tp = {}) {
  return {"attn.qkv", "attn.proj", {.dim = kDim, .heads = 4, .bias = bias, .init_std = 0.3f, .out_init_std = 0.2f}, tp};
}
// Grouped-query attention with rotary positions (Llama's): 8 query heads of 2 channels
// reading kv_heads kv heads; theta 100 so that positions 0..7 turn the pairs well apart.
template <class T>
nn::SelfAttention<T, backend::Cpu, nn::Rotary<backend::Cpu>> gqa_attention(std::int64_t kv_heads,
                                                                           nn::TensorParallelGroup tp = {}) {
  return {"attn.qkv",
          "attn.proj",
          {.dim = kDim, .heads = 8, .kv_heads = kv_heads, .bias = false, .init_std = 0.4f, .out_init_std = 0.2f},
          tp,
          nn::Rotary<backend::Cpu>{{.theta = 100.0f}}};
}
template <class T, class Act>
nn::Mlp<T, backend::Cpu, Act> mlp(nn::TensorParallelGroup tp = {}) {
  return {"mlp.up", "mlp.down", {.dim = kDim, .hidden = 24, .bias = true, .init_std = 0.3f, .out_init_std = 0.2f}, tp};
}

// A layer whose backward is the wrapped one's with one gradient off by 0.1%: dx, or the
// first parameter's.
template <class Inner>
struct OffByAThousandth {
  Inner inner;
  bool input = true;
  using Saved = typename Inner::Saved;
  void forward(backend::cpu::Context& ctx, Saved& s, double* out, const double* x, std::int64_t b, std::int64_t t) {
    inner.forward(ctx, s, out, x, b, t);
  }
  void backward(backend::cpu::Context& ctx, Saved& s, double* dx, const double* dout, const double* x, std::int64_t b,
                std::int64_t t) {
    inner.backward(ctx, s, dx, dout, x, b, t);
    if (input) {
      for (std::int64_t i = 0; i < b * t * kDim; ++i) dx[i] *= 1.001;
    } else {
      bool first = true;
      inner.parameters([&](nn::Parameter<double>& p) {
        if (first)
          for (std::int64_t i = 0; i < p.numel(); ++i) p.grad[i] *= 1.001;
        first = false;
      });
    }
  }
  template <class Visit>
  void parameters(Visit&& visit) {
    inner.parameters(visit);
  }
};

}  // namespace

TEST_CASE("nn::SelfAttention's gradients match central finite differences in double, with and without biases") {
  backend::cpu::Context ctx;
  for (bool bias : {true, false}) {
    auto layer = attention<double>(bias);
    const auto report = testing::check_layer(ctx, layer, {.batch = 2, .seq = 5, .dim = kDim});
    MESSAGE("bias ", bias, ": ", report.summary());
    CHECK(report.ok());
    CHECK(report.checked >= 13 * (bias ? 5 : 3));
  }
}

TEST_CASE("grouped-query attention with rotary positions matches central finite differences in double") {
  backend::cpu::Context ctx;
  for (std::int64_t kv_heads : {8, 4, 2, 1}) {  // multi-head, 2, 4 and 8 query heads per kv head
    auto layer = gqa_attention<double>(kv_heads);
    const auto report = testing::check_layer(ctx, layer, {.batch = 2, .seq = 5, .dim = kDim});
    MESSAGE("kv heads ", kv_heads, ": ", report.summary());
    CHECK(report.ok());
    CHECK(layer.qkv().linear().weight().shape[0] == (8 + 2 * kv_heads) * 2);
  }
  // Llama 3's frequency scaling on the same layer.
  nn::SelfAttention<double, backend::Cpu, nn::Rotary<backend::Cpu>> scaled(
      "attn.qkv", "attn.proj", {.dim = kDim, .heads = 4, .kv_heads = 2, .bias = false, .init_std = 0.4f}, {},
      nn::Rotary<backend::Cpu>{{.theta = 50.0f, .factor = 8.0f, .original_max_position = 16}});
  const auto report = testing::check_layer(ctx, scaled, {.batch = 1, .seq = 6, .dim = kDim});
  MESSAGE("llama3 scaling: ", report.summary());
  CHECK(report.ok());
}

TEST_CASE_TEMPLATE("nn::Mlp's gradients match central finite differences in double", Act, nn::Gelu, nn::SwiGlu,
                   nn::GeGlu) {
  backend::cpu::Context ctx;
  auto layer = mlp<double, Act>();
  const auto report = testing::check_layer(ctx, layer, {.batch = 2, .seq = 3, .dim = kDim});
  MESSAGE(report.summary());
  CHECK(report.ok());
  CHECK(report.checked >= 13 * 5);
}

TEST_CASE("the gradient checker fails a backward that is 0.1% off and names the tensor") {
  backend::cpu::Context ctx;
  for (bool input : {true, false}) {
    OffByAThousandth<nn::Mlp<double, backend::Cpu, nn::SwiGlu>> layer{mlp<double, nn::SwiGlu>(), input};
    const auto report = testing::check_layer(ctx, layer, {.batch = 2, .seq = 3, .dim = kDim});
    CHECK_FALSE(report.ok());
    CHECK(report.failed > 0);
    const std::string wrong = input ? "x" : "mlp.up.weight";
    CHECK(report.worst.tensor == wrong);
    CHECK(report.summary().find("worst " + wrong + "[") != std::string::npos);
    for (const auto& e : report.failures) CHECK(e.tensor == wrong);
  }
}

TEST_CASE("the gradient checker's options are checked") {
  backend::cpu::Context ctx;
  auto layer = mlp<double, nn::Gelu>();
  CHECK_THROWS_WITH_AS(testing::check_layer(ctx, layer, {.dim = kDim}, {.step = 0.0}),
                       doctest::Contains("gradcheck step is 0"), Error);
  CHECK_THROWS_WITH_AS(testing::check_layer(ctx, layer, {.dim = 0}),
                       doctest::Contains("check_layer: batch 2, seq 5, dim 0"), Error);
}

TEST_CASE_TEMPLATE("the gated units' 16-bit kernels are the float kernel rounded once", T, bf16, f16) {
  const std::int64_t rows = 5, hidden = 37;
  const auto stream = rng::Stream::named(4, "glu");
  std::vector<T> pre(2 * rows * hidden), dact(rows * hidden);
  std::vector<float> pre_f(pre.size()), dact_f(dact.size());
  for (std::size_t i = 0; i < pre.size(); ++i) {
    pre[i] = convert<T>(static_cast<float>(2.0 * stream.normal(i)));
    pre_f[i] = convert<float>(pre[i]);
  }
  for (std::size_t i = 0; i < dact.size(); ++i) {
    dact[i] = convert<T>(static_cast<float>(stream.normal(1000 + i)));
    dact_f[i] = convert<float>(dact[i]);
  }
  // One rounding: half an ulp of the value, or of f16's subnormal spacing (2^-24) below
  // its normal range (bf16 has float's range).
  const double ulp = std::is_same_v<T, bf16> ? 0x1p-8 : 0x1p-11;
  const double floor = std::is_same_v<T, bf16> ? 1e-30 : 0x1p-25;
  for (math::Gate gate : {math::Gate::silu, math::Gate::gelu}) {
    std::vector<T> act(dact.size()), dpre(pre.size());
    std::vector<float> act_f(dact.size()), dpre_f(pre.size());
    backend::cpu::glu_forward(act.data(), pre.data(), rows, hidden, gate);
    backend::cpu::glu_forward(act_f.data(), pre_f.data(), rows, hidden, gate);
    backend::cpu::glu_backward(dpre.data(), dact.data(), pre.data(), rows, hidden, gate);
    backend::cpu::glu_backward(dpre_f.data(), dact_f.data(), pre_f.data(), rows, hidden, gate);
    for (std::size_t i = 0; i < act.size(); ++i)
      CHECK(std::abs(convert<float>(act[i]) - act_f[i]) <= ulp * std::abs(act_f[i]) + floor);
    for (std::size_t i = 0; i < dpre.size(); ++i)
      CHECK(std::abs(convert<float>(dpre[i]) - dpre_f[i]) <= ulp * std::abs(dpre_f[i]) + floor);
  }
}

namespace {

struct LayerRun {
  std::vector<float> out, dx;             // this rank's rows
  std::vector<std::vector<float>> grads;  // per parameter, the full tensor
  std::vector<std::string> names;
};

// One forward and backward of `layer` on fixed x and dout of (2·8, kDim); this rank's
// rows of them under sequence parallelism. Gradients are scattered into full tensors.
template <class Layer>
void run_layer(Layer& layer, nn::TensorParallelGroup tp, LayerRun& run, std::mutex& mutex) {
  backend::cpu::Context ctx;
  nn::ParameterStore<float> store;
  store.bind(layer);
  store.initialize(5);
  const std::int64_t B = 2, S = 8, rows = tp.local_rows(B * S), first = tp.first_row(B * S);
  const auto stream = rng::Stream::named(6, "layer input");
  std::vector<float> x(rows * kDim), dout(rows * kDim), out(rows * kDim), dx(rows * kDim);
  for (std::int64_t i = 0; i < rows * kDim; ++i) {
    const auto at = static_cast<std::uint64_t>(first * kDim + i);
    x[i] = static_cast<float>(stream.normal(at));
    dout[i] = static_cast<float>(stream.normal(at + 100000));
  }
  typename Layer::Saved saved;
  layer.forward(ctx, saved, out.data(), x.data(), B, S);
  layer.backward(ctx, saved, dx.data(), dout.data(), x.data(), B, S);
  std::lock_guard lock(mutex);
  if (tp.rank() == 0 || tp.sequence_parallel()) {
    run.out.insert(run.out.end(), out.begin(), out.end());
    run.dx.insert(run.dx.end(), dx.begin(), dx.end());
  }
  const auto params = store.parameters();
  run.grads.resize(params.size());
  run.names.resize(params.size());
  for (std::size_t k = 0; k < params.size(); ++k) {
    run.names[k] = params[k]->name;
    tp_test::scatter_to_full(*params[k], params[k]->grad, run.grads[k]);
  }
}

// Rank r's rows arrive in rank order only if the ranks append in order: run them so.
template <class Make>
void check_split_like_serial(Make make) {
  std::mutex mutex;
  LayerRun serial;
  {
    auto layer = make(nn::TensorParallelGroup{});
    run_layer(layer, {}, serial, mutex);
  }
  for (int tp : {2, 4})
    for (SequenceParallel sp : {SequenceParallel::off, SequenceParallel::on}) {
      std::vector<LayerRun> ranks(static_cast<std::size_t>(tp));
      comm::run_threads(tp, [&](comm::ThreadComm& thread_world) {
        comm::Comm world(std::move(thread_world));
        const nn::TensorParallelGroup group(&world, sp);
        auto layer = make(group);
        run_layer(layer, group, ranks[static_cast<std::size_t>(world.rank())], mutex);
      });
      LayerRun split;
      for (const LayerRun& r : ranks) {
        split.out.insert(split.out.end(), r.out.begin(), r.out.end());
        split.dx.insert(split.dx.end(), r.dx.begin(), r.dx.end());
      }
      // Every rank wrote its slices of the full gradients into its own copies: merge.
      split.grads = ranks[0].grads;
      for (std::size_t k = 0; k < split.grads.size(); ++k)
        for (std::size_t i = 0; i < split.grads[k].size(); ++i)
          for (const LayerRun& r : ranks)
            if (r.grads[k][i] != 0.0f) split.grads[k][i] = r.grads[k][i];
      INFO("tp " << tp << (sp == SequenceParallel::on ? " with" : " without") << " sequence parallelism");
      CHECK(tp_test::relative_difference(split.out, serial.out) <= 1e-5);
      CHECK(tp_test::relative_difference(split.dx, serial.dx) <= 1e-5);
      REQUIRE(split.grads.size() == serial.grads.size());
      for (std::size_t k = 0; k < serial.grads.size(); ++k) {
        INFO(serial.names[k]);
        CHECK(tp_test::relative_difference(split.grads[k], serial.grads[k]) <= 1e-5);
      }
    }
}

}  // namespace

TEST_CASE(
    "nn::SelfAttention split over 2 and 4 thread ranks, with and without sequence parallelism, is the serial "
    "layer") {
  check_split_like_serial([](nn::TensorParallelGroup tp) { return attention<float>(true, tp); });
}

TEST_CASE(
    "grouped-query attention split over 2 and 4 thread ranks (kv heads split with the query heads) is the serial "
    "layer") {
  check_split_like_serial([](nn::TensorParallelGroup tp) { return gqa_attention<float>(4, tp); });
}

TEST_CASE_TEMPLATE(
    "nn::Mlp split over 2 and 4 thread ranks, with and without sequence parallelism, is the serial layer", Act,
    nn::Gelu, nn::SwiGlu, nn::GeGlu) {
  check_split_like_serial([](nn::TensorParallelGroup tp) { return mlp<float, Act>(tp); });
}

TEST_CASE("kv heads the tensor-parallel degree does not divide are named") {
  comm::run_threads(4, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    CHECK_THROWS_WITH_AS(gqa_attention<float>(2, nn::TensorParallelGroup(&world)),
                         doctest::Contains("kv heads (2) is not divisible by the tensor-parallel degree 4"), Error);
  });
  CHECK_THROWS_WITH_AS(gqa_attention<float>(3), doctest::Contains("attention kv_heads 3 does not divide the heads 8"),
                       Error);
}

TEST_CASE("a head count or hidden size the tensor-parallel degree does not divide is named") {
  comm::run_threads(5, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    CHECK_THROWS_WITH_AS(attention<float>(true, nn::TensorParallelGroup(&world)),
                         doctest::Contains("heads (4) is not divisible by the tensor-parallel degree 5"), Error);
    CHECK_THROWS_WITH_AS(gqa_attention<float>(4, nn::TensorParallelGroup(&world)),
                         doctest::Contains("heads (8) is not divisible by the tensor-parallel degree 5"), Error);
    CHECK_THROWS_WITH_AS((mlp<float, nn::SwiGlu>(nn::TensorParallelGroup(&world))),
                         doctest::Contains("MLP hidden (24) is not divisible by the tensor-parallel degree 5"), Error);
  });
}
