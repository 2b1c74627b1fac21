// models::Llama, checked as GPT-2 is:
//  - the rotary kernel: its backward is the forward's transpose, q·k after it depends on
//    the distance of the positions only, the bf16 kernel is the f32 one rounded once,
//    and Llama 3's frequency scaling gives the numbers its definition does;
//  - the whole model's gradients (grouped-query attention, untied and tied head) against
//    central finite differences in double;
//  - the model trained under every strategy against the serial run: tensor parallelism
//    (kv heads split with the query heads) with and without sequence parallelism,
//    pipelines (1F1B, ZB-H1; the untied head on the last stage, the tied one summed
//    between the ends), ZeRO 1 and 3 over dp 2, tp 2 x pp 2 x dp 2, recomputation:
//    step 1's gradients, five steps' losses, norms and parameters within 1e-5 (fp32);
//  - the planner's memory per rank (plan::rank_memory) against the trainer's measured
//    bytes, term by term, for a Llama under several layouts;
//  - bad shapes named.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "data_parallel_test_util.hpp"
#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/models/llama.hpp"
#include "llmpar/plan/cost.hpp"
#include "llmpar/testing/gradcheck.hpp"

using namespace llmpar;

static_assert(pipeline::check_model<models::Llama<float>>());

namespace {

std::vector<double> random_vector(std::int64_t n, const char* name) {
  const auto stream = rng::Stream::named(23, name);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = stream.normal(static_cast<std::uint64_t>(i));
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

template <int kStage = 0>
using Policy = Compose<backend::Cpu, parallel::Pipeline<schedule::Configured>, parallel::Data<zero::Stage<kStage>>,
                       recompute::Configured>;
// ZeRO 2 and 3 have no pipeline.
template <int kStage>
using DataPolicy = Compose<backend::Cpu, parallel::Data<zero::Stage<kStage>>>;

template <class P = Policy<>>
dp_test::Run llama_run(int ranks, int tp, const dp_test::Layout& layout) {
  return dp_test::run_threads<P, models::LlamaSpec>(ranks, tp, layout);
}

// One rank, the whole model, the same global batch.
dp_test::Run serial(const dp_test::Layout& layout, int dp = 1) {
  return dp_test::serial_run<Policy<>, models::LlamaSpec>(layout, dp);
}
using dp_test::check_close;
using dp_test::same_bits;

}  // namespace

// ---- rotary embeddings ------------------------------------------------------------------

TEST_CASE("the rotary kernel's backward is its forward's transpose, and v is untouched") {
  // 4 query heads and 2 kv heads of 8 channels on (B, S) = (2, 5): rows of (4 + 4) 8.
  const AttentionShape shape{2, 5, 4, 2, 8};
  const math::RopeConfig rope{.theta = 100.0f, .factor = 4.0f, .original_max_position = 4};
  const std::int64_t n = shape.batch * shape.seq * shape.row();
  const std::vector<double> x = random_vector(n, "x"), w = random_vector(n, "w");
  std::vector<double> y = x, g = w;
  backend::cpu::rotary(y.data(), shape, rope, false);
  backend::cpu::rotary(g.data(), shape, rope, true);
  // <w, R x> = <Rᵀ w, x> for the linear map R, and R preserves length.
  CHECK(dot(w, y) == doctest::Approx(dot(g, x)).epsilon(1e-12));
  CHECK(dot(y, y) == doctest::Approx(dot(x, x)).epsilon(1e-12));
  for (std::int64_t r = 0; r < shape.batch * shape.seq; ++r)
    for (std::int64_t c = shape.q_dim() + shape.kv_dim(); c < shape.row(); ++c)
      CHECK(y[static_cast<std::size_t>(r * shape.row() + c)] == x[static_cast<std::size_t>(r * shape.row() + c)]);
  // Position 0 is not rotated.
  for (std::int64_t c = 0; c < shape.row(); ++c)
    CHECK(y[static_cast<std::size_t>(c)] == x[static_cast<std::size_t>(c)]);
  // The inverse undoes the forward.
  backend::cpu::rotary(y.data(), shape, rope, true);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(y[i] == doctest::Approx(x[i]).epsilon(1e-12));
}

TEST_CASE("after the rotary kernel q·k depends on the distance between positions only") {
  // One head (q and k the same vector at every position): q_t · k_s is a function of t - s.
  const AttentionShape shape{1, 9, 1, 1, 8};
  const std::vector<double> head = random_vector(8, "head");
  std::vector<double> qkv(static_cast<std::size_t>(shape.seq * shape.row()));
  for (std::int64_t t = 0; t < shape.seq; ++t)
    for (std::int64_t d = 0; d < 8; ++d) {
      qkv[static_cast<std::size_t>(t * shape.row() + d)] = head[static_cast<std::size_t>(d)];
      qkv[static_cast<std::size_t>(t * shape.row() + 8 + d)] = head[static_cast<std::size_t>(d)];
    }
  backend::cpu::rotary(qkv.data(), shape, {.theta = 10000.0f}, false);
  auto score = [&](std::int64_t t, std::int64_t s) {
    double v = 0;
    for (std::int64_t d = 0; d < 8; ++d)
      v += qkv[static_cast<std::size_t>(t * shape.row() + d)] * qkv[static_cast<std::size_t>(s * shape.row() + 8 + d)];
    return v;
  };
  for (std::int64_t delta = 0; delta < 4; ++delta)
    for (std::int64_t s = 1; s + delta < shape.seq; ++s) CHECK(score(s + delta, s) == doctest::Approx(score(delta, 0)));
}

TEST_CASE("Llama 3's rope scaling keeps the high frequencies, divides the low ones and interpolates between") {
  // Llama 3.1 8B: head size 128, theta 500000, factor 8, low 1, high 4, context 8192.
  const math::RopeConfig rope{.theta = 500000.0f, .factor = 8.0f};
  const math::RopeConfig plain{.theta = 500000.0f};
  // Pair 0: wavelength 2π, far below 8192 / 4: kept.
  CHECK(math::rope_inv_freq(0, 128, rope) == 1.0f);
  // Pair 63: 500000^(-126/128) = 2.45514e-6, wavelength 2.56e6 > 8192: divided by 8.
  CHECK(math::rope_inv_freq(63, 128, rope) == doctest::Approx(2.45514e-6 / 8).epsilon(1e-4));
  CHECK(math::rope_inv_freq(63, 128, plain) == doctest::Approx(2.45514e-6).epsilon(1e-4));
  // Pair 32: 500000^(-1/2) = 1.41421e-3, wavelength 4442.88 between 2048 and 8192:
  // s = (8192 / 4442.88 - 1) / 3 = 0.281283, (1 - s) / 8 + s = 0.371122 of it.
  CHECK(math::rope_inv_freq(32, 128, rope) == doctest::Approx(1.41421e-3 * 0.371122).epsilon(1e-4));
  CHECK_THROWS_WITH_AS((math::RopeConfig{.theta = 1.0f}.validate()),
                       doctest::Contains("rope theta (--rope-theta) is 1"), Error);
}

TEST_CASE("the rotary kernel on bf16 is the f32 kernel rounded once") {
  const AttentionShape shape{2, 7, 4, 2, 16};
  const std::int64_t n = shape.batch * shape.seq * shape.row();
  const std::vector<double> x = random_vector(n, "bf16 x");
  std::vector<bf16> low(x.size());
  std::vector<float> f32(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    low[i] = bf16(static_cast<float>(x[i]));
    f32[i] = static_cast<float>(low[i]);
  }
  backend::cpu::rotary(low.data(), shape, {.theta = 10000.0f}, false);
  backend::cpu::rotary(f32.data(), shape, {.theta = 10000.0f}, false);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(static_cast<float>(low[i]) == static_cast<float>(bf16(f32[i])));
}

// ---- the model ---------------------------------------------------------------------------

TEST_CASE("models::Llama's gradients of every parameter match central finite differences in double") {
  backend::cpu::Context ctx;
  for (bool tied : {false, true}) {
    models::LlamaConfig cfg{.layers = 2,
                            .heads = 4,
                            .kv_heads = 2,
                            .dim = 16,
                            .ffn_dim = 24,
                            .max_seq = 8,
                            .vocab = 11,
                            .padded_vocab = 16,
                            .init_std = 0.3f,
                            .rope = {.theta = 100.0f},
                            .tie_embeddings = tied};
    models::Llama<double> model(cfg, 7);
    CHECK(model.ties_head() == tied);
    CHECK(model.num_parameters() == cfg.num_parameters());
    const auto result = testing::check_model(ctx, model, {.batch = 2, .seq = 5, .vocab = cfg.vocab});
    MESSAGE("tied ", tied, ": checked ", result.checked, " gradient elements; worst: ", result.summary());
    CHECK(result.ok());
    CHECK(result.checked > 200);
  }
}

TEST_CASE("models::Llama's parameters carry Hugging Face's names and shapes, fused q/k/v and gate/up") {
  const models::LlamaConfig cfg = dp_test::llama_config(2);
  models::Llama<float> model(cfg, 1);
  std::vector<std::string> names;
  for (const nn::Parameter<float>* p : model.parameter_store().parameters())
    names.push_back(p->name + " " + [&] {
      std::string s;
      for (int d = 0; d < p->shape.rank; ++d) s += (d ? "x" : "") + std::to_string(p->shape[d]);
      return s;
    }());
  const std::vector<std::string> expected{
      "embed_tokens 64x32",
      "layers.0.input_layernorm.weight 32",
      "layers.0.self_attn.qkv_proj.weight 64x32",  // (4 + 2·2) heads of 8
      "layers.0.self_attn.o_proj.weight 32x32",
      "layers.0.post_attention_layernorm.weight 32",
      "layers.0.mlp.gate_up_proj.weight 96x32",
      "layers.0.mlp.down_proj.weight 32x48",
      "layers.1.input_layernorm.weight 32",
      "layers.1.self_attn.qkv_proj.weight 64x32",
      "layers.1.self_attn.o_proj.weight 32x32",
      "layers.1.post_attention_layernorm.weight 32",
      "layers.1.mlp.gate_up_proj.weight 96x32",
      "layers.1.mlp.down_proj.weight 32x48",
      "norm.weight 32",
      "lm_head 64x32",
  };
  CHECK(names == expected);
  CHECK(model.num_parameters() == cfg.num_parameters());
  CHECK(models::LlamaConfig::preset("llama3-8b").num_parameters() == 8030261248);    // Meta's 8.03B
  CHECK(models::LlamaConfig::preset("llama3.2-1b").num_parameters() == 1235814400);  // Meta's 1.24B (tied)
}

TEST_CASE(
    "Llama under tensor parallelism (kv heads split with the query heads), with and without sequence "
    "parallelism, trains as the serial model") {
  const dp_test::Layout base{.micro_batch = 2, .accum = 1};
  const dp_test::Run reference = serial(base);
  for (bool sp : {false, true}) {
    dp_test::Layout layout = base;
    layout.sp = sp;
    check_close(llama_run(2, 2, layout), reference, sp ? "tp 2 sp" : "tp 2");
  }
}

TEST_CASE(
    "Llama in a pipeline (1F1B, ZB-H1; untied head on the last stage, or tied and summed) trains as the serial "
    "model") {
  for (bool tied : {false, true}) {
    models::LlamaConfig cfg = dp_test::llama_config(4);
    cfg.tie_embeddings = tied;
    const dp_test::Layout base{.micro_batch = 1, .accum = 4, .layers = 4, .llama = cfg};
    const dp_test::Run reference = serial(base);
    for (const std::string schedule : {"1f1b", "zb"}) {
      dp_test::Layout layout = base;
      layout.pp = 2;
      layout.schedule = schedule;
      const dp_test::Run run = llama_run(2, 1, layout);
      check_close(run, reference, std::string(tied ? "tied " : "untied ") + "pp 2 " + schedule);
      // The last stage holds a copy of the token table only when the head is tied.
      CHECK(run.head_copy_param.empty() == !tied);
      if (tied) CHECK(run.head_copy_param == run.params[0]);  // embed_tokens, summed between the ends
    }
  }
}

TEST_CASE(
    "Llama under ZeRO 1 and 3 over dp 2, and tp 2 x pp 2 x dp 2 with sequence parallelism, trains as the "
    "serial model") {
  const dp_test::Layout base{.micro_batch = 1, .accum = 2, .layers = 2};
  const dp_test::Run reference = serial(base, 2);
  check_close(llama_run<Policy<1>>(2, 1, base), reference, "dp 2 ZeRO 1");
  check_close(llama_run<DataPolicy<3>>(2, 1, base), reference, "dp 2 ZeRO 3");
  dp_test::Layout three_d = base;
  three_d.pp = 2;
  three_d.sp = true;
  three_d.schedule = "1f1b";
  check_close(llama_run<Policy<1>>(8, 2, three_d), reference, "tp 2 x pp 2 x dp 2, ZeRO 1, sp");
}

TEST_CASE("Llama's recomputation (selective, full) is bitwise the run without it") {
  const dp_test::Layout base{.micro_batch = 2, .accum = 1};
  const dp_test::Run none = llama_run(1, 1, base);
  for (recompute::Mode mode : {recompute::Mode::selective, recompute::Mode::full}) {
    dp_test::Layout layout = base;
    layout.recompute = mode;
    const dp_test::Run run = llama_run(1, 1, layout);
    CHECK(run.losses == none.losses);
    CHECK(same_bits(run.grads, none.grads));
    CHECK(same_bits(run.params, none.params));
  }
}

TEST_CASE("Llama shapes that cannot work are named") {
  models::LlamaConfig cfg = dp_test::llama_config(2);
  cfg.kv_heads = 3;
  CHECK_THROWS_WITH_AS(models::Llama<float>(cfg, 1),
                       doctest::Contains("kv_heads (--kv-heads) is 3; it must divide heads 4"), Error);
  cfg = dp_test::llama_config(2);
  cfg.heads = 32;  // head size 1
  cfg.kv_heads = 8;
  CHECK_THROWS_WITH_AS(models::Llama<float>(cfg, 1), doctest::Contains("the head size dim / heads = 1 is odd"), Error);
  CHECK_THROWS_WITH_AS(models::LlamaConfig::preset("llama-huge"),
                       doctest::Contains("unknown Llama preset 'llama-huge'"), Error);
  comm::run_threads(4, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    comm::Grid grid(world, {.tp = 4});
    CHECK_THROWS_WITH_AS(models::Llama<float>(dp_test::llama_config(2), 1, grid),
                         doctest::Contains("kv heads (2) is not divisible by the tensor-parallel degree 4"), Error);
  });
}

TEST_CASE("the planner's memory per rank of a Llama is what the trainer measures") {
  plan::Cluster cluster;
  cluster.memory_bytes = 1e12;
  struct Case {
    const char* what;
    int ranks, tp;
    dp_test::Layout layout;
    int zero;
  };
  const dp_test::Layout base{.micro_batch = 2, .accum = 2, .layers = 2};
  dp_test::Layout sp = base, piped = base;
  sp.sp = true;
  piped.pp = 2;
  piped.schedule = "1f1b";
  for (const Case& c : {Case{"serial", 1, 1, base, 0}, Case{"tp 2 sp", 2, 2, sp, 0}, Case{"pp 2", 2, 1, piped, 0},
                        Case{"dp 2 ZeRO 1", 2, 1, base, 1}, Case{"dp 2 ZeRO 3", 2, 1, base, 3}}) {
    INFO(c.what);
    const dp_test::Run run = c.zero == 1   ? llama_run<Policy<1>>(c.ranks, c.tp, c.layout)
                             : c.zero == 3 ? llama_run<DataPolicy<3>>(c.ranks, c.tp, c.layout)
                                           : llama_run(c.ranks, c.tp, c.layout);
    const parallel::LayoutConfig l = dp_test::layout_config<Policy<>>(c.layout, c.ranks, c.tp);
    parallel::LayoutConfig planned = l;
    planned.zero = c.zero;
    const plan::Memory m = plan::rank_memory(dp_test::llama_config(c.layout.layers), 16, planned, 0, cluster);
    CHECK(m.parameters == doctest::Approx(static_cast<double>(run.memory.parameters)));
    CHECK(m.gradients == doctest::Approx(static_cast<double>(run.memory.gradients)));
    CHECK(m.optimizer == doctest::Approx(static_cast<double>(run.memory.optimizer)));
    CHECK(m.activations + m.workspace == doctest::Approx(static_cast<double>(run.memory.activations)).epsilon(0.05));
    CHECK(m.measured_total() == doctest::Approx(static_cast<double>(run.memory.model_state() + run.memory.activations +
                                                                    run.memory.communication))
                                    .epsilon(0.05));
  }
}
