// GPT-2 model: whole-model gradients against finite differences in double precision,
// float against double, parameter bookkeeping, the optimizer, bad configurations, and
// µP (GPT2Config::mup): the standard model at the base width, its init and lr scales,
// its output multiplier's gradient and forward, and its optimizer step.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/optim/adamw.hpp"
#include "llmpar/optim/schedule.hpp"
#include "llmpar/testing/gradcheck.hpp"
#include "llmpar/train/sample.hpp"
#include "model_test_util.hpp"

using namespace llmpar;
using model_test::random_tokens;

namespace {

models::GPT2Config small_config() {
  return {.layers = 2, .heads = 2, .dim = 8, .max_seq = 6, .vocab = 11, .padded_vocab = 16, .init_std = 0.2f};
}

}  // namespace

TEST_CASE("GPT-2 gradients of every parameter match central finite differences in double") {
  backend::cpu::Context ctx;
  const auto cfg = small_config();
  models::GPT2<double> model(cfg, 7);
  const auto result = testing::check_model(ctx, model, {.batch = 2, .seq = 5, .vocab = cfg.vocab});
  CHECK(result.ok());
  MESSAGE("checked ", result.checked, " gradient elements; worst: ", result.summary());
  CHECK(result.checked > 200);
}

TEST_CASE("sampling draws the same tokens from the same seed, among the first vocab ids when asked") {
  backend::cpu::Context ctx;
  const auto cfg = small_config();
  models::GPT2<float> model(cfg, 7);
  const std::vector<std::int32_t> prompt{1, 2};
  const auto all = train::sample(ctx, model, prompt, {.tokens = 40, .temperature = 2.0f, .seed = 3});
  CHECK(all == train::sample(ctx, model, prompt, {.tokens = 40, .temperature = 2.0f, .seed = 3}));
  CHECK(all.size() == 42);
  CHECK(std::any_of(all.begin() + 2, all.end(), [](std::int32_t t) { return t >= 4; }));  // at 2.0, ids above 4 come
  const auto few = train::sample(ctx, model, prompt, {.tokens = 40, .temperature = 2.0f, .seed = 3, .vocab = 4});
  CHECK(std::all_of(few.begin() + 2, few.end(), [](std::int32_t t) { return t >= 0 && t < 4; }));
  CHECK_THROWS_WITH_AS(train::sample(ctx, model, prompt, {.tokens = 1, .vocab = -1}),
                       doctest::Contains("sampling vocab is -1; give the number of ids to draw among, or 0 for the "
                                         "model's 11"),
                       Error);
}

TEST_CASE("padded vocabulary rows get no gradient and stay zero") {
  backend::cpu::Context ctx;
  const auto cfg = small_config();
  models::GPT2<float> model(cfg, 7);
  const auto tokens = random_tokens(6, cfg.vocab, 1);
  model.zero_grad(ctx);
  model.forward(ctx, tokens.data(), tokens.data(), 1, 6);
  model.backward(ctx);
  auto& wte = model.parameter_store().find("wte");
  for (std::int64_t i = cfg.vocab * cfg.dim; i < cfg.padded_vocab * cfg.dim; ++i) {
    REQUIRE(wte.value[i] == 0.0f);
    REQUIRE(wte.grad[i] == 0.0f);
  }
}

TEST_CASE("float and double models from one seed compute the same loss and gradients") {
  backend::cpu::Context ctx;
  const auto cfg = small_config();
  models::GPT2<double> md(cfg, 11);
  models::GPT2<float> mf(cfg, 11);
  const auto tokens = random_tokens(12, cfg.vocab, 5);
  const auto targets = random_tokens(12, cfg.vocab, 6);
  md.zero_grad(ctx);
  mf.zero_grad(ctx);
  const double ld = md.forward(ctx, tokens.data(), targets.data(), 2, 6);
  const double lf = mf.forward(ctx, tokens.data(), targets.data(), 2, 6);
  CHECK(lf == doctest::Approx(ld).epsilon(1e-5));
  md.backward(ctx);
  mf.backward(ctx);
  const auto& pd = md.parameter_store().parameters();
  const auto& pf = mf.parameter_store().parameters();
  REQUIRE(pd.size() == pf.size());
  for (std::size_t k = 0; k < pd.size(); ++k)
    for (std::int64_t i = 0; i < pd[k]->numel(); ++i) {
      INFO(pd[k]->name, "[", i, "]");
      REQUIRE(static_cast<double>(pf[k]->grad[i]) == doctest::Approx(pd[k]->grad[i]).epsilon(1e-3).scale(1e-4));
    }
}

TEST_CASE("parameter bookkeeping: count, unique names, deterministic initialisation") {
  const auto cfg = models::GPT2Config::preset("gpt2-tiny");
  models::GPT2<float> a(cfg, 42);
  models::GPT2<float> b(cfg, 42);
  models::GPT2<float> c(cfg, 43);
  CHECK(a.num_parameters() == cfg.num_parameters());
  // GPT-2 124M: the published count with the padded token table.
  CHECK(models::GPT2Config::preset("gpt2-124m").num_parameters() == 124475904);
  const auto& sa = a.parameter_store();
  CHECK(std::equal(sa.values(), sa.values() + sa.flat_size(), b.parameter_store().values()));
  CHECK(!std::equal(sa.values(), sa.values() + sa.flat_size(), c.parameter_store().values()));
  // A value depends only on (seed, name, index): recompute one directly.
  auto& w = a.parameter_store().find("h.1.mlp.c_fc.weight");
  CHECK(w.value[77] == static_cast<float>(0.02 * rng::Stream::named(42, "h.1.mlp.c_fc.weight").normal(77)));
}

TEST_CASE("AdamW steps overfit one batch: the loss falls by more than half") {
  backend::cpu::Context ctx;
  auto cfg = small_config();
  cfg.init_std = 0.02f;
  models::GPT2<float> model(cfg, 1);
  optim::AdamW<float> opt(ctx, model.parameter_store(), {.lr = 3e-2f, .weight_decay = 0.0f});
  const auto tokens = random_tokens(12, cfg.vocab, 9);
  const auto targets = random_tokens(12, cfg.vocab, 10);
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    model.zero_grad(ctx);
    last = model.forward(ctx, tokens.data(), targets.data(), 2, 6);
    model.backward(ctx);
    if (step == 0) first = last;
    const double norm = opt.step(3e-2f).grad_norm;
    REQUIRE(std::isfinite(norm));
  }
  MESSAGE("loss ", first, " -> ", last);
  CHECK(last < 0.5 * first);
}

TEST_CASE("the cosine schedule warms up linearly and decays to its floor") {
  const optim::CosineSchedule s{.peak_lr = 1.0f, .warmup_steps = 10, .total_steps = 110, .final_ratio = 0.1f};
  CHECK(s(0) == doctest::Approx(0.1));
  CHECK(s(9) == doctest::Approx(1.0));
  CHECK(s(10) == doctest::Approx(1.0));
  CHECK(s(60) == doctest::Approx(0.55));
  CHECK(s(110) == doctest::Approx(0.1));
  CHECK_THROWS_WITH_AS((optim::CosineSchedule{.warmup_steps = 5, .total_steps = 3}.validate()),
                       doctest::Contains("warmup 5 must be in [0, steps=3]"), Error);
}

TEST_CASE("bad model configurations and inputs are rejected with the value and the fix") {
  backend::cpu::Context ctx;
  auto cfg = small_config();
  cfg.dim = 10;
  cfg.heads = 4;
  CHECK_THROWS_WITH_AS(models::GPT2<float>(cfg, 1), doctest::Contains("dim 10 is not divisible by heads 4"), Error);
  CHECK_THROWS_WITH_AS(models::GPT2Config::preset("gpt3"), doctest::Contains("unknown model preset 'gpt3'"), Error);
  models::GPT2<float> model(small_config(), 1);
  std::vector<std::int32_t> tokens(7, 1);
  CHECK_THROWS_WITH_AS(model.forward(ctx, tokens.data(), tokens.data(), 1, 7),
                       doctest::Contains("sequence length 7 is outside [1, 6]"), Error);
  tokens[3] = 11;
  CHECK_THROWS_WITH_AS(model.forward(ctx, tokens.data(), tokens.data(), 1, 6),
                       doctest::Contains("token id 11 at position 3 is outside the vocabulary [0, 11)"), Error);
  CHECK_THROWS_WITH_AS(model.backward(ctx), doctest::Contains("backward() needs a training forward() first"), Error);
  CHECK_THROWS_WITH_AS((optim::AdamWConfig{.lr = -1.0f}.validate()), doctest::Contains("lr is -1"), Error);
}

TEST_CASE("gemm through oneDNN matches the reference for every transpose and accumulate") {
  backend::cpu::Context ctx;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (bool acc : {false, true}) {
        const std::int64_t m = 13, n = 29, k = 17;
        Buffer<float> a(m * k), b(k * n), bias(n), c(m * n), ref(m * n);
        const auto s = rng::Stream::named(1, "gemm");
        for (std::int64_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(s.normal(static_cast<std::uint64_t>(i)));
        for (std::int64_t i = 0; i < b.size(); ++i)
          b[i] = static_cast<float>(s.normal(static_cast<std::uint64_t>(1000 + i)));
        for (std::int64_t i = 0; i < n; ++i) bias[i] = static_cast<float>(i);
        for (std::int64_t i = 0; i < m * n; ++i) c[i] = ref[i] = 0.5f * static_cast<float>(i % 5);
        const backend::cpu::GemmOp op{ta, tb, acc};
        backend::cpu::gemm<float>(ctx, c.data(), a.data(), b.data(), bias.data(), m, n, k, op);
        backend::cpu::reference_gemm<float>(ref.data(), a.data(), b.data(), bias.data(), m, n, k, op);
        for (std::int64_t i = 0; i < m * n; ++i) REQUIRE(c[i] == doctest::Approx(ref[i]).epsilon(1e-5));
      }
  CHECK(ctx.cached_primitives() == 8);
}

TEST_CASE("the model learns to copy: attention carries tokens across positions") {
  // Sequences of 16 random tokens followed by the same 16 again. Without attention the
  // second half is as unpredictable as the first (ln 16 per token); a working model
  // predicts it exactly, so the loss falls to the first half's share alone.
  backend::cpu::Context ctx;
  const models::GPT2Config cfg{.layers = 2, .heads = 2, .dim = 64, .max_seq = 32, .vocab = 16, .padded_vocab = 16};
  models::GPT2<float> model(cfg, 1);
  optim::AdamW<float> opt(ctx, model.parameter_store(), {.lr = 3e-3f, .weight_decay = 0.0f});
  const std::int64_t B = 16, S = 31;
  std::vector<std::int32_t> tokens(B * S), targets(B * S);
  const auto stream = rng::Stream::named(5, "copy task");
  double loss = 0.0;
  for (int step = 0; step < 300; ++step) {
    for (std::int64_t b = 0; b < B; ++b) {
      std::int32_t seq[32];
      for (int i = 0; i < 16; ++i)
        seq[i] = seq[16 + i] =
            static_cast<std::int32_t>(stream.bits(static_cast<std::uint64_t>(step * 1000 + b * 32 + i))[0] % 16);
      for (std::int64_t t = 0; t < S; ++t) {
        tokens[static_cast<std::size_t>(b * S + t)] = seq[t];
        targets[static_cast<std::size_t>(b * S + t)] = seq[t + 1];
      }
    }
    model.zero_grad(ctx);
    loss = model.forward(ctx, tokens.data(), targets.data(), B, S);
    model.backward(ctx);
    opt.step(3e-3f);
  }
  const double first_half_only = std::log(16.0) * 15.0 / 31.0;  // 15 unpredictable targets of 31
  MESSAGE("copy-task loss ", loss, "; a perfect copier scores ", first_half_only);
  CHECK(loss < first_half_only + 0.1);
}

// ---- µP (GPT2Config::mup)

namespace {

models::GPT2Config mup_config(std::int64_t dim, std::int64_t base) {
  models::GPT2Config cfg = small_config();
  cfg.dim = dim;
  cfg.mup = true;
  cfg.mup_base_dim = base;
  return cfg;
}

bool is_hidden_matrix(const std::string& name) {
  for (const char* suffix : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"})
    if (name.size() > std::strlen(suffix) && name.ends_with(suffix)) return true;
  return false;
}

template <class T>
double rms(const nn::Parameter<T>& p) {
  double s = 0.0;
  for (std::int64_t i = 0; i < p.numel(); ++i) s += static_cast<double>(p.value[i]) * static_cast<double>(p.value[i]);
  return std::sqrt(s / static_cast<double>(p.numel()));
}

}  // namespace

TEST_CASE("µP at its base width is the standard model bit for bit: weights, lr scales, loss, gradients, a step") {
  backend::cpu::Context ctx;
  const models::GPT2Config standard = small_config();
  const models::GPT2Config mup = mup_config(standard.dim, standard.dim);
  models::GPT2<float> a(standard, 7);
  models::GPT2<float> b(mup, 7);
  CHECK(b.output_multiplier() == 1.0f);
  const auto& sa = a.parameter_store();
  const auto& sb = b.parameter_store();
  REQUIRE(sa.flat_size() == sb.flat_size());
  CHECK(std::memcmp(sa.values(), sb.values(), static_cast<std::size_t>(sa.flat_size()) * sizeof(float)) == 0);
  for (const auto* p : sb.parameters()) CHECK(p->lr_scale == 1.0f);
  optim::AdamW<float> oa(ctx, a.parameter_store(), {.lr = 1e-2f});
  optim::AdamW<float> ob(ctx, b.parameter_store(), {.lr = 1e-2f});
  const auto tokens = random_tokens(12, standard.vocab, 5);
  const auto targets = random_tokens(12, standard.vocab, 6);
  for (int step = 0; step < 2; ++step) {
    a.zero_grad(ctx);
    b.zero_grad(ctx);
    const float la = a.forward(ctx, tokens.data(), targets.data(), 2, 6);
    const float lb = b.forward(ctx, tokens.data(), targets.data(), 2, 6);
    CHECK(std::memcmp(&la, &lb, sizeof la) == 0);
    a.backward(ctx);
    b.backward(ctx);
    CHECK(std::memcmp(sa.grads(), sb.grads(), static_cast<std::size_t>(sa.flat_size()) * sizeof(float)) == 0);
    oa.step(1e-2f);
    ob.step(1e-2f);
    CHECK(std::memcmp(sa.values(), sb.values(), static_cast<std::size_t>(sa.flat_size()) * sizeof(float)) == 0);
  }
}

TEST_CASE("µP at 4x its base width: hidden matrices start at init_std / 2 and train at lr / 4, the rest unchanged") {
  // Every tensor thousands of draws (the smallest, a c_proj or wpe, 4096), so a
  // measured std is within 5% (~4.5 sampling errors of 1 / sqrt(2n)).
  const models::GPT2Config standard{
      .layers = 2, .heads = 4, .dim = 64, .max_seq = 64, .vocab = 256, .padded_vocab = 256, .init_std = 0.02f};
  models::GPT2Config mup = standard;
  mup.mup = true;
  mup.mup_base_dim = 16;
  REQUIRE(mup.width_mult() == 4.0);
  models::GPT2<float> off(standard, 3);
  models::GPT2<float> on(mup, 3);
  CHECK(on.output_multiplier() == 0.25f);
  const auto po = off.parameter_store().parameters();
  const auto pm = on.parameter_store().parameters();
  REQUIRE(po.size() == pm.size());
  int hidden = 0;
  for (std::size_t k = 0; k < pm.size(); ++k) {
    const nn::Parameter<float>& p = *pm[k];
    INFO(p.name);
    REQUIRE(p.name == po[k]->name);
    if (is_hidden_matrix(p.name)) {
      ++hidden;
      CHECK(p.lr_scale == 0.25f);
      // The measured std: init_std / sqrt(4), with the residual projections' 1 / sqrt(2L).
      const bool residual = p.name.ends_with(".c_proj.weight");
      const double want = 0.01 / (residual ? std::sqrt(2.0 * static_cast<double>(mup.layers)) : 1.0);
      CHECK(rms(p) == doctest::Approx(want).epsilon(0.05).scale(0));
      CHECK(rms(*po[k]) == doctest::Approx(2 * want).epsilon(0.05).scale(0));
      // From the same draws: exactly half of the standard model's values.
      for (std::int64_t i = 0; i < p.numel(); ++i) REQUIRE(p.value[i] == 0.5f * po[k]->value[i]);
    } else {
      CHECK(p.lr_scale == 1.0f);
      CHECK(std::memcmp(p.value, po[k]->value, static_cast<std::size_t>(p.numel()) * sizeof(float)) == 0);
    }
  }
  CHECK(hidden == 4 * mup.layers);
  // The embeddings keep their own scales: wte init_std, wpe init_std / 2 (GPT-2's 0.01).
  CHECK(rms(on.parameter_store().find("wte")) == doctest::Approx(0.02).epsilon(0.05).scale(0));
  CHECK(rms(on.parameter_store().find("wpe")) == doctest::Approx(0.01).epsilon(0.05).scale(0));
}

TEST_CASE("init_std sets every initial scale: hidden matrices, residual projections, wte, and wpe at half") {
  // 64 channels: every tensor holds 4096 draws or more, so a measured std is within 5%.
  models::GPT2Config cfg{
      .layers = 2, .heads = 4, .dim = 64, .max_seq = 64, .vocab = 256, .padded_vocab = 256, .init_std = 0.02f};
  cfg.init_std = models::GPT2Config::small_init_std(cfg.dim);
  // sqrt(2 / (5 * 64)) = 0.0790569; GPT-2's 0.02 is the rule at 1000 channels, 0.0228 at 768.
  CHECK(cfg.init_std == doctest::Approx(0.0790569).epsilon(1e-6));
  CHECK(models::GPT2Config::small_init_std(1000) == doctest::Approx(0.02).epsilon(1e-6));
  CHECK(models::GPT2Config::small_init_std(768) == doctest::Approx(0.0228218).epsilon(1e-5));
  models::GPT2<float> model(cfg, 5);
  int hidden = 0;
  for (const nn::Parameter<float>* p : model.parameter_store().parameters()) {
    INFO(p->name);
    if (!is_hidden_matrix(p->name)) continue;
    ++hidden;
    const bool residual = p->name.ends_with(".c_proj.weight");
    const double want = cfg.init_std / (residual ? std::sqrt(2.0 * static_cast<double>(cfg.layers)) : 1.0);
    CHECK(rms(*p) == doctest::Approx(want).epsilon(0.05).scale(0));
  }
  CHECK(hidden == 4 * cfg.layers);
  CHECK(rms(model.parameter_store().find("wte")) == doctest::Approx(cfg.init_std).epsilon(0.05).scale(0));
  CHECK(rms(model.parameter_store().find("wpe")) == doctest::Approx(cfg.init_std / 2).epsilon(0.05).scale(0));
  // A scale that is not a positive number is named with its flag.
  for (const float bad : {0.0f, -0.1f, std::numeric_limits<float>::quiet_NaN()}) {
    cfg.init_std = bad;
    CHECK_THROWS_WITH_AS(cfg.validate(), doctest::Contains("init_std (--init-std) is"), Error);
  }
}

TEST_CASE("µP at 2x its base width: gradients match finite differences in double, and the logits are halved") {
  backend::cpu::Context ctx;
  const auto cfg = mup_config(8, 4);
  models::GPT2<double> model(cfg, 7);
  REQUIRE(model.output_multiplier() == 0.5);
  const auto result = testing::check_model(ctx, model, {.batch = 2, .seq = 5, .vocab = cfg.vocab});
  CHECK(result.ok());
  MESSAGE("µP: checked ", result.checked, " gradient elements; worst: ", result.summary());
  CHECK(result.checked > 200);

  // The output multiplier in the forward: the standard model with the same weights has
  // twice the logits (a power of two: bit for bit).
  models::GPT2Config standard = cfg;
  standard.mup = false;
  models::GPT2<float> f_mup(cfg, 7);
  models::GPT2<float> f_std(standard, 7);
  auto& s_mup = f_mup.parameter_store();
  std::copy(s_mup.values(), s_mup.values() + s_mup.flat_size(), f_std.parameter_store().values());
  const auto tokens = random_tokens(6, cfg.vocab, 4);
  const float* l_mup = f_mup.logits(ctx, tokens.data(), 1, 6);
  const float* l_std = f_std.logits(ctx, tokens.data(), 1, 6);
  for (std::int64_t i = 0; i < 6 * cfg.padded_vocab; ++i) REQUIRE(l_mup[i] == 0.5f * l_std[i]);
}

TEST_CASE("µP's first AdamW step moves a hidden matrix by lr / width_mult and an embedding by lr") {
  backend::cpu::Context ctx;
  models::GPT2Config cfg = small_config();
  cfg.dim = 32;
  cfg.mup = true;
  cfg.mup_base_dim = 8;  // width_mult 4
  models::GPT2<float> model(cfg, 5);
  const float lr = 1e-3f;
  optim::AdamW<float> opt(ctx, model.parameter_store(), {.lr = lr, .weight_decay = 0.0f, .grad_clip = 0.0f});
  auto& store = model.parameter_store();
  const std::vector<float> before(store.values(), store.values() + store.flat_size());
  const auto tokens = random_tokens(12, cfg.vocab, 1);
  const auto targets = random_tokens(12, cfg.vocab, 2);
  model.zero_grad(ctx);
  model.forward(ctx, tokens.data(), targets.data(), 2, 6);
  model.backward(ctx);
  opt.step(lr);
  // Adam's first step is lr x lr_scale x g / (|g| + eps): ±lr x lr_scale where |g| >> eps.
  auto moves = [&](const std::string& name, double want) {
    const nn::Parameter<float>& p = store.find(name);
    const std::int64_t offset = p.value - store.values();
    int checked = 0;
    for (std::int64_t i = 0; i < p.numel(); ++i) {
      if (std::abs(p.grad[i]) < 1e-5f) continue;
      const double delta = static_cast<double>(p.value[i]) - before[static_cast<std::size_t>(offset + i)];
      INFO(name, "[", i, "] grad ", p.grad[i], " moved ", delta);
      REQUIRE(std::abs(delta) == doctest::Approx(want).epsilon(1e-2).scale(0));
      REQUIRE((delta < 0) == (p.grad[i] > 0));
      ++checked;
    }
    CHECK(checked > 50);
  };
  moves("h.0.mlp.c_fc.weight", lr / 4.0);
  moves("h.1.attn.c_attn.weight", lr / 4.0);
  moves("wte", lr);
  moves("wpe", lr);
}

TEST_CASE("AdamW runs each segment at lr x lr_scale, the decoupled weight decay included") {
  // Two copies of the same parameter and gradient, one at a quarter of the rate: the
  // update of each element (Adam's step and the decay lr wd p) is a quarter of the other's.
  const std::int64_t n = 1000;
  std::vector<float> p1(n), p2(n), g(n);
  const auto s = rng::Stream::named(2, "lr scale");
  for (std::int64_t i = 0; i < n; ++i) {
    p1[static_cast<std::size_t>(i)] = p2[static_cast<std::size_t>(i)] =
        static_cast<float>(s.normal(static_cast<std::uint64_t>(i)));
    g[static_cast<std::size_t>(i)] = static_cast<float>(1e-3 * s.normal(static_cast<std::uint64_t>(n + i)));
  }
  const std::vector<float> start = p1;
  backend::cpu::Context ctx;
  optim::AdamW<float> opt(ctx, {{p1.data(), g.data(), n, true, 1.0f}, {p2.data(), g.data(), n, true, 0.25f}},
                          {.lr = 1e-2f, .eps = 1e-3f, .weight_decay = 0.5f, .grad_clip = 0.0f});
  for (int step = 0; step < 3; ++step) opt.step(1e-2f);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    INFO("element ", i);
    REQUIRE(static_cast<double>(p2[k] - start[k]) ==
            doctest::Approx(0.25 * static_cast<double>(p1[k] - start[k])).epsilon(2e-2).scale(1e-6));
  }
}

TEST_CASE("µP configurations that cannot work are named") {
  auto cfg = mup_config(8, 0);
  CHECK_THROWS_WITH_AS(cfg.validate(), doctest::Contains("mup_base_dim (--mup-base-dim) is 0"), Error);
  cfg.mup_base_dim = -4;
  CHECK_THROWS_WITH_AS(models::GPT2<float>(cfg, 1), doctest::Contains("µP needs a positive base width"), Error);
  cfg.mup = false;  // the base width means nothing without µP
  CHECK_NOTHROW(cfg.validate());
}
