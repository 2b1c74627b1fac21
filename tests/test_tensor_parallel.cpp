// Tensor-parallel building blocks (nn/tensor_parallel.hpp, nn::Split) against the serial
// layers: a rank's slice of a split parameter is the serial parameter's values at those
// positions, and an MLP split over tp = 1, 2, 4 thread ranks (column-parallel, GELU,
// row-parallel) computes the serial MLP's output, input gradient and weight gradients.
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
#include "llmpar/nn/linear.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "tensor_parallel_test_util.hpp"

using namespace llmpar;
using tp_test::relative_difference;

namespace {

constexpr std::uint64_t kSeed = 2024;

std::vector<float> random_vector(std::int64_t n, const char* name) {
  const rng::Stream stream = rng::Stream::named(kSeed, name);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(stream.normal(i));
  return v;
}

// Runs body(world) on `ranks` thread ranks.
template <class Body>
void on_ranks(int ranks, Body&& body) {
  comm::run_threads(ranks, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    body(world);
  });
}

// A two-layer MLP: y = proj(gelu(fc(x))), split over `tp` (serial when tp is empty).
struct Mlp {
  nn::ColumnParallelLinear<float> fc;
  nn::RowParallelLinear<float> proj;
  nn::ParameterStore<float> store;

  Mlp(std::int64_t C, nn::TensorParallelGroup tp)
      : fc("mlp.c_fc", C, 4 * C, true, 0.02f, tp), proj("mlp.c_proj", 4 * C, C, true, 0.02f, tp) {
    store.bind(*this);
    store.initialize(kSeed);
    // Non-zero biases, from the same full-tensor positions on every layout.
    for (nn::Parameter<float>* p : store.parameters()) {
      if (p->name.find("bias") == std::string::npos) continue;
      const rng::Stream stream = rng::Stream::named(kSeed + 1, p->name);
      for (std::int64_t i = 0; i < p->numel(); ++i)
        p->value[i] = 0.1f * static_cast<float>(stream.normal(nn::full_index(p->shape, p->split, i)));
    }
  }
  template <class Visit>
  void parameters(Visit&& visit) {
    fc.parameters(visit);
    proj.parameters(visit);
  }
};

struct MlpResult {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> grads;  // per parameter, in the full tensor's layout
};

// Forward and backward of the MLP on `rows` rows; gradients are scattered into full
// tensors at their full-tensor positions (each rank fills its slice).
void run_mlp(Mlp& mlp, std::int64_t rows, std::int64_t C, MlpResult& out, std::mutex& mutex, bool lead) {
  backend::cpu::Context ctx;
  const auto x = random_vector(rows * C, "x");
  const auto dy = random_vector(rows * C, "dy");
  const std::int64_t hidden = mlp.fc.local_out_features();
  std::vector<float> pre(static_cast<std::size_t>(rows * hidden)), act(pre.size()), dpre(pre.size());
  std::vector<float> y(static_cast<std::size_t>(rows * C)), dx(y.size());
  mlp.store.zero_grad();
  mlp.fc.forward_gelu(ctx, act.data(), pre.data(), x.data(), rows);
  mlp.proj.forward(ctx, y.data(), act.data(), rows);
  mlp.proj.backward_through_gelu(ctx, dpre.data(), dy.data(), act.data(), pre.data(), rows);
  mlp.fc.backward(ctx, dx.data(), dpre.data(), x.data(), rows);

  const std::lock_guard<std::mutex> lock(mutex);
  if (lead) {
    out.y = y;
    out.dx = dx;
  }
  const auto params = mlp.store.parameters();
  out.grads.resize(params.size());
  for (std::size_t k = 0; k < params.size(); ++k) {
    const nn::Parameter<float>& p = *params[k];
    tp_test::scatter_to_full(p, p.grad, out.grads[k]);
  }
}

}  // namespace

TEST_CASE("full_index maps a rank's slice to the serial tensor's positions") {
  const Shape full{12, 5};
  for (int parts : {1, 2, 3}) {
    for (int groups : {1, 2}) {
      if (12 % (parts * groups) != 0) continue;
      for (int dim : {0, 1}) {
        if (dim == 1 && (groups != 1 || 5 % parts != 0)) continue;
        std::vector<int> hits(60, 0);
        for (int r = 0; r < parts; ++r) {
          const nn::Split split{dim, parts, r, groups};
          const Shape local = nn::local_shape(full, split);
          for (std::int64_t i = 0; i < local.numel(); ++i)
            ++hits[static_cast<std::size_t>(nn::full_index(full, split, i))];
        }
        // Every element of the full tensor is held by exactly one rank.
        CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
      }
    }
  }
  // A fused QKV weight (3C, C) with C = 4 over 2 ranks: rank 1 holds rows 2-3 of q,
  // 6-7 (k) and 10-11 (v).
  const nn::Split qkv{0, 2, 1, 3};
  CHECK(nn::full_index({12, 4}, qkv, 0) == 2 * 4);
  CHECK(nn::full_index({12, 4}, qkv, 2 * 4) == 6 * 4);
  CHECK(nn::full_index({12, 4}, qkv, 4 * 4 + 3) == 10 * 4 + 3);
}

TEST_CASE("a split parameter starts with the serial parameter's values at its positions") {
  nn::Parameter<float> serial("w", {8, 6}, nn::Init::normal(0.02f), true);
  std::vector<float> full(48);
  nn::ParameterStore<float>::initial_values(serial, 7, full.data());
  for (int dim : {0, 1}) {
    for (int r = 0; r < 2; ++r) {
      nn::Parameter<float> part("w", {8, 6}, nn::Init::normal(0.02f), true, nn::Split{dim, 2, r, 1});
      std::vector<float> mine(static_cast<std::size_t>(part.numel()));
      nn::ParameterStore<float>::initial_values(part, 7, mine.data());
      for (std::int64_t i = 0; i < part.numel(); ++i)
        CHECK(mine[static_cast<std::size_t>(i)] ==
              full[static_cast<std::size_t>(nn::full_index({8, 6}, part.split, i))]);
    }
  }
}

TEST_CASE("a tensor-parallel MLP on 1, 2 and 4 ranks computes the serial MLP") {
  const std::int64_t C = 24, rows = 13;
  MlpResult serial;
  std::mutex mutex;
  {
    Mlp mlp(C, nn::TensorParallelGroup{});
    run_mlp(mlp, rows, C, serial, mutex, true);
  }
  for (int tp : {1, 2, 4}) {
    MlpResult parallel;
    on_ranks(tp, [&](comm::Comm& world) {
      Mlp mlp(C, nn::TensorParallelGroup(&world));
      CHECK(mlp.fc.local_out_features() == 4 * C / tp);
      CHECK(mlp.proj.local_in_features() == 4 * C / tp);
      run_mlp(mlp, rows, C, parallel, mutex, world.rank() == 0);
    });
    INFO("tp = " << tp);
    CHECK(relative_difference(parallel.y, serial.y) <= 1e-5);
    CHECK(relative_difference(parallel.dx, serial.dx) <= 1e-5);
    REQUIRE(parallel.grads.size() == serial.grads.size());
    for (std::size_t k = 0; k < serial.grads.size(); ++k) {
      INFO("parameter " << k);
      CHECK(relative_difference(parallel.grads[k], serial.grads[k]) <= 1e-5);
    }
    if (tp == 1) {  // no split, no communication: bit for bit
      CHECK(parallel.y == serial.y);
      CHECK(parallel.dx == serial.dx);
    }
  }
}

TEST_CASE("tensor-parallel sizes that the degree does not divide are named") {
  on_ranks(4, [&](comm::Comm& world) {
    const nn::TensorParallelGroup tp(&world);
    CHECK_THROWS_WITH_AS(nn::ColumnParallelLinear<float>("attn.c_attn", 8, 3 * 6, true, 0.02f, tp, 3),
                         doctest::Contains("attn.c_attn output features per group (6) is not divisible by the "
                                           "tensor-parallel degree 4"),
                         Error);
    CHECK_THROWS_WITH_AS(nn::RowParallelLinear<float>("mlp.c_proj", 10, 8, true, 0.02f, tp),
                         doctest::Contains("mlp.c_proj input features (10) is not divisible by the tensor-parallel "
                                           "degree 4"),
                         Error);
  });
}
