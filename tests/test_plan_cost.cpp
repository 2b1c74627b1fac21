// The planner's cost model (plan/cost.hpp) and cluster descriptions (plan/cluster.hpp)
// against hand-worked values. The predictions against measured runs are
// llmpar-plan --validate (the example_plan test runs its quick grid).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "llmpar/plan/cluster.hpp"
#include "llmpar/plan/cost.hpp"

using namespace llmpar;
using plan::Cluster;
using Layout = parallel::LayoutConfig;

namespace {

// Whether f() throws with a message containing `part`.
template <class F>
bool fails_with(F&& f, const std::string& part) {
  try {
    f();
  } catch (const std::exception& e) {
    if (std::string(e.what()).find(part) != std::string::npos) return true;
    MESSAGE("message was: ", e.what());
    return false;
  }
  return false;
}

// A one-block model small enough to count by hand: C = 8, 2 heads, vocabulary 16.
models::GPT2Config tiny() { return {.layers = 1, .heads = 2, .dim = 8, .max_seq = 4, .vocab = 16, .padded_vocab = 16}; }

Cluster test_cluster() {
  Cluster c;
  c.name = "test";
  c.nodes = 2;
  c.devices_per_node = 4;
  c.memory_bytes = 80e9;
  c.fp32 = {100e12, 0.0};
  c.bf16 = {400e12, 0.0};
  c.fp16 = {400e12, 0.0};
  c.memory_bandwidth = 2e12;
  c.fp32_kernels = {1.4e12, 50e12};
  c.bf16_kernels = {1.4e12, 160e12};
  c.fp16_kernels = c.bf16_kernels;
  c.intra = {100e9, 1e-5};
  c.inter = {10e9, 1e-5};
  c.overlap = 0.5;
  return c;
}

}  // namespace

TEST_CASE("bus factors and collective times are nccl-tests' conventions") {
  CHECK(comm::bus_factor(comm::Collective::all_reduce, 4) == doctest::Approx(1.5));
  CHECK(comm::bus_factor(comm::Collective::reduce_scatter, 4) == doctest::Approx(0.75));
  CHECK(comm::bus_factor(comm::Collective::all_gather, 8) == doctest::Approx(0.875));
  CHECK(comm::bus_factor(comm::Collective::send, 2) == doctest::Approx(1.0));
  const plan::Link link{100e9, 1e-5};
  // 1 GB all-reduced over 4 ranks at 100 GB/s busbw: 1.5 GB of traffic, 6 ring steps.
  CHECK(plan::detail::collective_seconds(comm::Collective::all_reduce, 1e9, 4, link) == doctest::Approx(0.015 + 6e-5));
  CHECK(plan::detail::collective_seconds(comm::Collective::all_gather, 1e9, 4, link) == doctest::Approx(0.0075 + 3e-5));
  CHECK(plan::detail::collective_seconds(comm::Collective::all_reduce, 1e9, 1, link) == 0.0);
}

TEST_CASE("the GEMM curve reaches half its peak where the thinnest dimension is the half size") {
  const plan::Gemm g{100e12, 512.0};
  CHECK(g.flops_per_second(512, 512, 512) == doctest::Approx(50e12));
  CHECK(g.flops_per_second(4096, 4096, 4096) == doctest::Approx(100e12 * 4096 / (4096 + 512)));
  // 2·m·n·k FLOPs at the rate of the smallest dimension, 512: half the peak.
  CHECK(g.seconds(1024, 2048, 512) == doctest::Approx(2.0 * 1024 * 2048 * 512 / 50e12));
  CHECK(g.flops_per_second(8192, 64, 768) == doctest::Approx(100e12 * 64 / (64 + 512)));
}

TEST_CASE("buckets are GradSync's: units in reverse, 64-byte rounding, dp-divisible buckets") {
  const std::vector<std::vector<double>> units{{100, 30}, {200}, {50}};
  Layout l;
  l.dp = 2;
  l.data.bucket_bytes = 1;  // every unit closes its bucket
  // fp32: 16-element rounding, buckets rounded to 32. Unit 2: 64 -> 64. Unit 1: 208 ->
  // 224. Unit 0: 112 + 32 = 144 -> 160.
  plan::Buckets b = plan::bucket_layout(units, l);
  CHECK(b.size == 448);
  CHECK(b.shard == 224);
  CHECK(b.largest == 224);
  CHECK(b.parameters == 380);
  CHECK(b.count == 3);
  l.data.bucket_bytes = 4 << 20;  // one bucket, closed at unit 0: 64 + 208 + 144 = 416
  b = plan::bucket_layout(units, l);
  CHECK(b.size == 416);
  CHECK(b.shard == 208);
  CHECK(b.count == 1);
  l.precision = DType::bf16;  // 32-element rounding: 64 + 224 + 128 + 32 = 448, to 64s
  b = plan::bucket_layout(units, l);
  CHECK(b.size == 448);
}

TEST_CASE("a stage's parameters are the model's, split as the layers split") {
  const models::GPT2Config cfg = models::GPT2Config::preset("gpt2-124m");
  Layout l;
  double n = 0;
  for (const auto& u : plan::unit_parameters(cfg, l, 0))
    for (double x : u) n += x;
  CHECK(n == static_cast<double>(cfg.num_parameters()));
  // tp 2: the token table, c_attn, c_fc and both projections' weights halve; the
  // row-parallel biases, the norms and the position table stay whole.
  l.tp = 2;
  n = 0;
  for (const auto& u : plan::unit_parameters(cfg, l, 0))
    for (double x : u) n += x;
  const double C = 768;
  CHECK(n == 50304 * C / 2 + 1024 * C + 12 * (12 * C * C / 2 + 7 * C / 2 + 6 * C) + 2 * C);
  // pp 2: the last stage holds the head's copy of the token table and the final norm.
  l.tp = 1;
  l.pp = 2;
  const auto last = plan::unit_parameters(cfg, l, 1);
  REQUIRE(last.size() == 6 + 2);
  CHECK(last.back() == std::vector<double>{50304 * C});
  CHECK(last[last.size() - 2] == std::vector<double>{C, C});
}

TEST_CASE("one rank's memory of a model counted by hand") {
  const models::GPT2Config cfg = tiny();
  Layout l;
  l.micro_batch = 1;
  const Cluster c = test_cluster();
  const plan::Memory m = plan::rank_memory(cfg, 4, l, 0, c);
  // Parameters: wte 128, wpe 32, the block 12·64 + 13·8 = 872, ln_f 16 = 1048; each
  // rounded to 16 floats: 128, 32 | 16, 16, 192, 32, 64, 16, 16, 16, 256, 32, 256, 16 |
  // 16, 16 = 1120, one bucket rounded to 16.
  CHECK(m.parameters == 1120 * 4);
  CHECK(m.gradients == 1120 * 4);
  CHECK(m.optimizer == 1048 * 4 * 2);  // both moments, fp32 values are their own master
  // One stash (R = 4 rows, C = 8, V = 16): residual 2·R·C, the block's Saved (norms
  // 2·2·R, ln1_out, x_mid, ln2_out R·C each, qkv 3·R·C, fc and gelu 4·R·C each,
  // att_out R·C, lse 2·4 in f32), tokens R, the final norm 2·R, norm_out R·C, logits
  // R·V, losses R: 680 values; then the residual gradients 2·R·C and targets, losses R each.
  CHECK(m.activations == (680 + 64 + 8) * 4);
  // Scratch: wide0 4·R·C, qkv 3·R·C, c0, c1 R·C each; the loss's stats (1 + tp)·R·3.
  CHECK(m.workspace == (9 * 32 + 2 * 12) * 4);
  CHECK(m.communication == 0);
  CHECK(m.measured_total() == m.parameters + m.gradients + m.optimizer + m.activations + m.workspace);

  // bf16: 2-byte values, f32 gradients, f32 moments and master weights.
  l.precision = DType::bf16;
  const plan::Memory h = plan::rank_memory(cfg, 4, l, 0, c);
  // 32-element rounding: the block's eight small tensors and ln_f's grow to 32 each.
  CHECK(h.parameters == 1248 * 2);
  CHECK(h.gradients == 1248 * 4);
  CHECK(h.optimizer == 1048 * 4 * 3);

  // ZeRO 1 over 4 ranks: moments of a quarter; ZeRO 3: a quarter of the values too.
  l.precision = DType::f32;
  l.dp = 4;
  l.zero = 1;
  CHECK(plan::rank_memory(cfg, 4, l, 0, c).optimizer == doctest::Approx(1048 * 4 * 2 / 4.0));
  l.zero = 3;
  const plan::Memory z3 = plan::rank_memory(cfg, 4, l, 0, c);
  CHECK(z3.parameters < m.parameters / 3);
  CHECK(z3.communication > 0);
}

TEST_CASE("micro-batches in flight come from the schedule itself") {
  Layout l;
  l.pp = 4;
  l.grad_accum = 8;
  const pipeline::Report one_f_one_b = plan::schedule_report(l);
  for (int r = 0; r < 4; ++r) CHECK(one_f_one_b.ranks[static_cast<std::size_t>(r)].max_in_flight == 4 - r);
  l.schedule = "gpipe";
  CHECK(plan::schedule_report(l).ranks[0].max_in_flight == 8);
  // 1F1B's makespan with unit costs: (m + p − 1)(F + B).
  l.schedule = "1f1b";
  CHECK(plan::schedule_report(l, {.forward = 1, .backward = 2, .weight = 1}).makespan == doctest::Approx(11 * 3));
}

TEST_CASE("step time: the bubble, recomputation, ZeRO's traffic and MFU") {
  const models::GPT2Config cfg = models::GPT2Config::preset("gpt2-124m");
  const Cluster c = test_cluster();
  Layout l;
  l.micro_batch = 4;
  l.grad_accum = 4;
  const plan::Time base = plan::step_time(cfg, 1024, l, c);
  CHECK(base.bubble == 0.0);
  CHECK(base.data_comm == 0.0);
  CHECK(base.mfu > 0.0);
  CHECK(base.mfu < 1.0);
  // Full recomputation runs every block's forward again (not the LM head's, which holds
  // a third of GPT-2 small's FLOPs): a fifth to a third more compute.
  l.recompute = recompute::Mode::full;
  const plan::Time full = plan::step_time(cfg, 1024, l, c);
  CHECK(full.compute > 1.15 * base.compute);
  CHECK(full.compute < 1.35 * base.compute);
  l.recompute = recompute::Mode::none;
  // A 1F1B pipeline of p stages idles (p − 1) micro-batch slots of the slowest stage.
  l.pp = 4;
  const plan::Time piped = plan::step_time(cfg, 1024, l, c);
  CHECK(piped.bubble == doctest::Approx(piped.compute * 3.0 / 4.0).epsilon(1e-9));
  // Data parallelism: ZeRO 2 reduce-scatters every micro-batch, ZeRO 0 all-reduces once.
  l.pp = 1;
  l.dp = 8;
  const double z0 = plan::step_time(cfg, 1024, l, c).data_comm;
  l.zero = 2;
  const double z2 = plan::step_time(cfg, 1024, l, c).data_comm;
  CHECK(z0 > 0.0);
  CHECK(z2 > z0);
  // dp 8 of 4 GPUs a node spans nodes: slower than dp 4 within one.
  l.zero = 0;
  l.dp = 4;
  const double inside = plan::step_time(cfg, 1024, l, c).data_comm;
  CHECK(inside < z0);
}

TEST_CASE("a shared node: ranks split its cores, lose the measured fractions, and share the bubble") {
  const models::GPT2Config cfg = models::GPT2Config::preset("gpt2-tiny");
  Cluster c = test_cluster();
  c.nodes = 1;
  c.devices_per_node = 2;  // two cores
  c.shared_node = true;
  Layout l;
  l.micro_batch = 4;
  l.grad_accum = 4;
  // Two pipeline ranks: each has half the cores for half the blocks, the shared-ranks
  // fraction on top.
  l.pp = 2;
  const plan::Time two = plan::step_time(cfg, 64, l, c);
  c.shared_ranks = 0.8;
  const plan::Time slower = plan::step_time(cfg, 64, l, c);
  CHECK(slower.compute == doctest::Approx(two.compute / 0.8).epsilon(1e-9));
  CHECK(slower.bubble == doctest::Approx(two.bubble / 0.8).epsilon(1e-9));
  // Four ranks on two cores (pp 2 x dp 2): the oversubscription loss too, and a rank
  // idle in the bubble gives its turn to another. One stage's two ranks keep both cores
  // busy, so the step is the work over the cores: no bubble.
  l.dp = 2;
  l.micro_batch = 2;
  const plan::Time four = plan::step_time(cfg, 64, l, c);
  c.oversubscribed = 0.5;
  const plan::Time turns = plan::step_time(cfg, 64, l, c);
  CHECK(turns.compute == doctest::Approx(four.compute / 0.5).epsilon(1e-9));
  CHECK(turns.bubble == 0.0);
  // Four stages of one micro-batch on two cores: the critical path with a core per rank
  // is the schedule's makespan at 2 / 4 of the shared times; the bubble is what it adds.
  l.dp = 1;
  l.pp = 4;
  l.grad_accum = 1;
  l.micro_batch = 8;
  const plan::Time deep = plan::step_time(cfg, 64, l, c);
  const pipeline::Report r = plan::schedule_report(l, {.forward = 1.0, .backward = 2.0});
  const double path = r.makespan / (l.grad_accum * 3.0);  // the makespan over one stage's work: 4
  CHECK(path == doctest::Approx(4.0));
  CHECK(deep.bubble > 0.0);
  CHECK(deep.compute + deep.bubble == doctest::Approx(deep.compute * path * 2.0 / 4.0).epsilon(0.02));
}

TEST_CASE("a layout that needs more than the device holds does not fit, and says why") {
  const models::GPT2Config cfg = models::GPT2Config::preset("gpt2-1.5b");
  Cluster c = Cluster::preset("h100x8x1");
  Layout l;
  l.micro_batch = 64;
  l.precision = DType::bf16;
  const plan::Estimate e = plan::estimate(cfg, 1024, l, c);
  CHECK_FALSE(e.fits);
  CHECK(e.why.find("activations") != std::string::npos);
  l.micro_batch = 1;
  l.recompute = recompute::Mode::full;
  CHECK(plan::estimate(cfg, 1024, l, c).fits);
}

TEST_CASE("cluster presets, files and their errors") {
  const Cluster h = Cluster::preset("h200x8x4");
  CHECK(h.devices() == 32);
  CHECK(h.memory_bytes == 141e9);
  CHECK(h.bf16.peak_flops == 989e12);
  CHECK_FALSE(h.shared_node);
  CHECK(fails_with([] { (void)Cluster::preset("a100x8x2"); }, "unknown cluster 'a100x8x2'"));
  CHECK(fails_with([] { (void)Cluster::preset("h100x4x2"); }, "use h100x8xN or h200x8xN"));
  // A file round trip.
  const auto path = std::filesystem::temp_directory_path() / "llmpar_test_cluster.json";
  {
    std::ofstream out(path);
    out << h.to_json().dump();
  }
  const Cluster back = Cluster::named(path.string());
  CHECK(back.name == h.name);
  CHECK(back.inter.busbw == h.inter.busbw);
  CHECK(back.fp16.half == h.fp16.half);
  // Every figure comes back, and none is listed twice.
  std::vector<std::string> places;
  std::vector<double> sent, came;
  Cluster::for_each_figure(h, [&](const std::string& at, double v, bool) {
    places.push_back(at);
    sent.push_back(v);
  });
  Cluster::for_each_figure(back, [&](const std::string&, double v, bool) { came.push_back(v); });
  CHECK(came == sent);
  CHECK(places.size() == 25);
  std::sort(places.begin(), places.end());
  CHECK(std::adjacent_find(places.begin(), places.end()) == places.end());
  {
    // A file from before shared_ranks was measured reads as 1.
    std::ofstream out(path);
    nlohmann::json j = h.to_json();
    j.erase("shared_ranks");
    out << j.dump();
  }
  CHECK(Cluster::named(path.string()).shared_ranks == 1.0);
  {
    std::ofstream out(path);
    nlohmann::json j = h.to_json();
    j["gemm"]["bf16"].erase("half");
    out << j.dump();
  }
  CHECK(fails_with([&] { (void)Cluster::named(path.string()); }, "half"));
  {
    std::ofstream out(path);
    nlohmann::json j = h.to_json();
    j.erase("memory_bandwidth");
    out << j.dump();
  }
  CHECK(fails_with([&] { (void)Cluster::named(path.string()); }, "memory_bandwidth"));
  {
    std::ofstream out(path);
    nlohmann::json j = h.to_json();
    j["overlap"] = 2.0;
    out << j.dump();
  }
  CHECK(fails_with([&] { (void)Cluster::named(path.string()); }, "overlap is 2"));
  {
    std::ofstream out(path);
    nlohmann::json j = h.to_json();
    j["shared_ranks"] = 0.0;
    out << j.dump();
  }
  CHECK(fails_with([&] { (void)Cluster::named(path.string()); }, "shared_ranks is 0"));
  {
    std::ofstream out(path);
    out << "{not json";
  }
  CHECK(fails_with([&] { (void)Cluster::named(path.string()); }, "is not JSON"));
  std::filesystem::remove(path);
  CHECK(fails_with([] { (void)Cluster::named("/nonexistent/cluster.json"); }, "cannot be read"));
}

TEST_CASE("a search tries cp only where it cuts the sequence into 2 cp chunks, and tp inside a node") {
  const Cluster c = test_cluster();  // 2 nodes of 4
  auto cps = [](const std::vector<plan::Degrees>& ds) {
    std::vector<int> v;
    for (const plan::Degrees& d : ds)
      if (std::find(v.begin(), v.end(), d.cp) == v.end()) v.push_back(d.cp);
    return v;
  };
  const std::vector<plan::Degrees> long_seq = plan::degree_choices(c, 8, 1024);
  CHECK(cps(long_seq) == std::vector<int>{1, 2, 4, 8});
  for (const plan::Degrees& d : long_seq) {
    CHECK(d.tp * d.cp * d.pp * d.dp == 8);
    CHECK(d.tp <= 4);
  }
  // 1, 2, 4 and 8 each divide 8 ranks; seq 12 is 4 chunks of 3, not 8 of 1.5.
  CHECK(cps(plan::degree_choices(c, 8, 12)) == std::vector<int>{1, 2});
  CHECK(cps(plan::degree_choices(c, 8, 6)) == std::vector<int>{1});
  CHECK_FALSE(plan::cp_cuts(12, 4));
  CHECK(plan::cp_cuts(12, 3));
  CHECK(plan::cp_cuts(7, 1));
  // --cp 2: only cp 2, every tp and pp around it.
  const std::vector<plan::Degrees> fixed = plan::degree_choices(c, 8, 1024, 2);
  CHECK(cps(fixed) == std::vector<int>{2});
  CHECK(fixed.size() == 6);  // tp x pp of the 4 ranks left: (1,1) (1,2) (1,4) (2,1) (2,2) (4,1)
}

TEST_CASE("a fixed cp that does not divide the ranks or cut the sequence is refused, naming what would") {
  const Cluster c = test_cluster();
  CHECK(fails_with([&] { (void)plan::degree_choices(c, 8, 1024, 3); },
                   "--cp 3 does not divide the 8 ranks of test; use a --cp that divides them and cuts --seq 1024: 1, "
                   "2, 4, 8"));
  CHECK(
      fails_with([&] { (void)plan::degree_choices(c, 8, 12, 4); },
                 "--seq 12 is not divisible by 2 x --cp 4 = 8 (context parallelism cuts each sequence into 2 x cp "
                 "chunks); use a --seq that is a multiple of 8, or a --cp that cuts it and divides the 8 ranks: 1, 2"));
  CHECK(fails_with([&] { (void)plan::degree_choices(c, 8, 1024, 0); },
                   "--cp 0; the context-parallel degree is at least 1"));
  CHECK(
      fails_with([&] { (void)plan::degree_choices(c, 0, 1024); }, "a search needs ranks and a sequence; got 0 ranks"));
}

TEST_CASE("the listed order: layouts that fit first, each by step time") {
  plan::Estimate fast, slow, big;
  fast.time.step = 1.0;
  slow.time.step = 2.0;
  big.time.step = 0.5;
  big.fits = false;
  CHECK(plan::listed_before(fast, slow));
  CHECK_FALSE(plan::listed_before(slow, fast));
  CHECK(plan::listed_before(slow, big));  // a layout that does not fit comes last, however fast
  CHECK_FALSE(plan::listed_before(big, fast));
  CHECK_FALSE(plan::listed_before(fast, fast));
}

TEST_CASE(
    "a Llama's long sequences: cp divides the activations, its exchange is timed, and it ranks first where "
    "only it fits") {
  const models::LlamaConfig llama = models::LlamaConfig::preset("llama3-8b");
  const plan::ModelShape shape = llama;
  CHECK(shape.kv_heads == 8);
  CHECK(shape.qkv_features() == (32 + 2 * 8) * 128);
  CHECK(shape.parameters == llama.num_parameters());
  Cluster c = test_cluster();
  constexpr std::int64_t seq = 32768;
  Layout l;
  l.tp = 4;
  l.sp = true;
  l.precision = DType::bf16;
  l.recompute = recompute::Mode::full;
  const plan::Estimate one = plan::estimate(shape, seq, l, c);
  l.cp = 2;
  const plan::Estimate two = plan::estimate(shape, seq, l, c);
  CHECK(one.time.context_comm == 0.0);
  CHECK(two.time.context_comm > 0.0);
  CHECK(two.time.context_comm < two.time.compute);
  // Each cp rank holds half of every sequence's rows (and ring attention's blocks).
  CHECK(two.memory.activations == doctest::Approx(one.memory.activations / 2).epsilon(0.05));
  CHECK(two.memory.model_state() == one.memory.model_state());  // ZeRO 0: each rank keeps the whole store

  // The search as llmpar-plan runs it (every degree and ZeRO stage; micro-batch 1, full
  // recomputation, 1F1B), on devices too small for every layout without cp: only
  // context-parallel layouts fit, and they come first.
  struct Candidate {
    Layout layout;
    plan::Estimate estimate;
  };
  auto search = [&] {
    std::vector<Candidate> out;
    for (const plan::Degrees& d : plan::degree_choices(c, 8, seq))
      for (int zero = 0; zero <= (d.pp > 1 ? 1 : 3); ++zero) {
        Layout k = l;
        k.tp = d.tp;
        k.sp = d.tp > 1;
        k.cp = d.cp;
        k.pp = d.pp;
        k.dp = d.dp;
        k.zero = zero;
        k.grad_accum = 8 / d.dp;
        out.push_back({k, plan::estimate(shape, seq, k, c)});
      }
    std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
      return plan::listed_before(a.estimate, b.estimate);
    });
    return out;
  };
  double without_cp = 1e300, with_cp = 1e300;
  for (const Candidate& k : search()) {
    double& smallest = k.layout.cp == 1 ? without_cp : with_cp;
    smallest = std::min(smallest, k.estimate.memory.total());
  }
  // At 32k tokens, ZeRO 3 over tp 4 x cp 2 holds less than any layout without cp.
  REQUIRE(with_cp < without_cp);
  c.memory_bytes = (with_cp + without_cp) / 2;
  const std::vector<Candidate> ranked = search();
  REQUIRE_FALSE(ranked.empty());
  CHECK(ranked.front().estimate.fits);
  CHECK(ranked.front().layout.cp > 1);
  bool fitting = true;
  for (const Candidate& k : ranked) {
    if (k.layout.cp == 1) CHECK_FALSE(k.estimate.fits);
    if (!k.estimate.fits) fitting = false;
    CHECK(k.estimate.fits == fitting);  // fitting first, then the rest
  }
  for (std::size_t i = 1; i < ranked.size(); ++i)
    if (ranked[i].estimate.fits) CHECK(ranked[i - 1].estimate.time.step <= ranked[i].estimate.time.step);
}
