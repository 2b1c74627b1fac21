// Pipeline parallelism (pipeline::Executor through train::Trainer) and recomputation
// compute the serial run:
//  - pp in {2, 4} x every schedule (GPipe, 1F1B, interleaved 1F1B with 2 chunks, ZB-H1)
//    x m in {1, 4, 8} micro-batches: step 1's gradients, the losses and the parameters
//    after five steps within 1e-5 relative of the serial run with the same accumulation,
//    and the last stage's copy of the tied token table bitwise equal to the first's;
//  - the 3D layout tp 2 x pp 2 x dp 2 (8 ranks) with ZeRO 1 and sequence parallelism;
//  - recompute none / selective / full bitwise equal, alone and in a pipeline;
//  - the activations each rank holds, from the executor's stashes: GPipe m micro-batches,
//    1F1B at most p - rank, ZB-H1 at most p; full and selective recomputation less than
//    none;
//  - bad layouts named: more virtual stages than layers, a partition that does not sum,
//    the interleaved schedule with m not a multiple of p, a whole-model call on a stage
//    (a pipeline with ZeRO 2 or 3 fails to compile: tests/compile_fail/).
#include <doctest/doctest.h>

#include <string>

#include "data_parallel_test_util.hpp"
#include "llmpar/comm/thread_comm.hpp"

using namespace llmpar;

namespace {

template <int kStage = 0>
using PipelinePolicy = Compose<backend::Cpu, parallel::Pipeline<schedule::Configured>,
                               parallel::Data<zero::Stage<kStage>>, recompute::Configured>;

// The layout with sequence parallelism over its tp group.
dp_test::Layout with_sp(dp_test::Layout layout) {
  layout.sp = true;
  return layout;
}

template <class Policy>
dp_test::Run run_on(int ranks, int tp, const dp_test::Layout& layout) {
  return dp_test::run_threads<Policy>(ranks, tp, layout);
}

// One rank, the whole model, the same accumulation: what every layout must compute.
dp_test::Run serial(const dp_test::Layout& layout, int dp = 1) {
  return dp_test::serial_run<PipelinePolicy<>>(layout, dp);
}
using dp_test::check_close;
using dp_test::same_bits;

// The last stage's copy of the tied table stays the first stage's, bit for bit.
void check_tied(const dp_test::Run& run) {
  const auto wte = static_cast<std::size_t>(std::find(run.names.begin(), run.names.end(), "wte") - run.names.begin());
  REQUIRE(wte < run.names.size());
  REQUIRE(!run.head_copy_param.empty());
  CHECK(run.head_copy_grad == run.grads[wte]);
  CHECK(run.head_copy_param == run.params[wte]);
}

}  // namespace

TEST_CASE("every schedule on 2 and 4 stages computes the serial run's gradients, losses and parameters") {
  for (int m : {1, 4, 8}) {
    const dp_test::Layout base{.micro_batch = 1, .accum = m, .layers = 8};
    const dp_test::Run reference = serial(base);
    for (int pp : {2, 4})
      for (const std::string schedule : {"gpipe", "1f1b", "interleaved", "zb"}) {
        if (schedule == "interleaved" && m % pp != 0) continue;  // an error (below)
        dp_test::Layout layout = base;
        layout.pp = pp;
        layout.schedule = schedule;
        layout.chunks = schedule == "interleaved" ? 2 : 1;
        const dp_test::Run run = run_on<PipelinePolicy<>>(pp, 1, layout);
        check_close(run, reference, "pp " + std::to_string(pp) + " " + schedule + " m " + std::to_string(m));
        check_tied(run);
      }
  }
}

TEST_CASE("3D: tp 2 x pp 2 x dp 2 with ZeRO 1 and sequence parallelism computes the serial run") {
  const dp_test::Layout layout{.micro_batch = 1, .accum = 4, .layers = 4, .pp = 2, .schedule = "1f1b"};
  const dp_test::Run reference = serial(layout, 2);
  const dp_test::Run run = run_on<PipelinePolicy<1>>(8, 2, with_sp(layout));
  check_close(run, reference, "tp 2 x pp 2 x dp 2, ZeRO 1, sp");
  check_tied(run);
  dp_test::Layout interleaved = layout;
  interleaved.schedule = "interleaved";
  interleaved.chunks = 2;
  check_close(run_on<PipelinePolicy<1>>(8, 2, with_sp(interleaved)), reference,
              "tp 2 x pp 2 (2 chunks) x dp 2, ZeRO 1, sp");
}

TEST_CASE("recomputation (selective, full) is bitwise the run without it, alone and in a pipeline") {
  for (int pp : {1, 2}) {
    dp_test::Layout layout{.micro_batch = 2, .accum = 2, .layers = 4, .pp = pp, .schedule = "1f1b"};
    const dp_test::Run none = run_on<PipelinePolicy<>>(pp, 1, layout);
    for (const recompute::Mode mode : {recompute::Mode::selective, recompute::Mode::full}) {
      layout.recompute = mode;
      const dp_test::Run run = run_on<PipelinePolicy<>>(pp, 1, layout);
      INFO("pp " << pp << ", recompute " << (mode == recompute::Mode::full ? "full" : "selective"));
      CHECK(run.losses == none.losses);
      CHECK(same_bits(run.grads, none.grads));
      CHECK(same_bits(run.params, none.params));
    }
  }
  // Under tensor and sequence parallelism too (the recomputed forward communicates).
  dp_test::Layout layout{.micro_batch = 2, .accum = 2, .layers = 2, .pp = 1, .schedule = "1f1b"};
  const dp_test::Run none = run_on<PipelinePolicy<0>>(2, 2, with_sp(layout));
  layout.recompute = recompute::Mode::full;
  const dp_test::Run full = run_on<PipelinePolicy<0>>(2, 2, with_sp(layout));
  CHECK(same_bits(full.grads, none.grads));
  CHECK(same_bits(full.params, none.params));
  // ZB-H1 with selective recomputation keeps the attention output for its weight pass.
  dp_test::Layout zb{.micro_batch = 1, .accum = 4, .layers = 4, .pp = 2, .schedule = "zb"};
  const dp_test::Run zb_none = run_on<PipelinePolicy<>>(2, 1, zb);
  zb.recompute = recompute::Mode::selective;
  const dp_test::Run zb_selective = run_on<PipelinePolicy<>>(2, 1, zb);
  CHECK(same_bits(zb_selective.grads, zb_none.grads));
  CHECK(same_bits(zb_selective.params, zb_none.params));
}

TEST_CASE("activations in flight, measured from the stashes: GPipe m, 1F1B at most p - rank, ZB-H1 at most p") {
  const int pp = 4, m = 8;
  std::vector<std::size_t> gpipe_bytes, one_f_one_b_bytes;
  for (const std::string schedule : {"gpipe", "1f1b", "zb"}) {
    const dp_test::Layout layout{.micro_batch = 1, .accum = m, .steps = 1, .layers = 4, .pp = pp, .schedule = schedule};
    const dp_test::Run run = run_on<PipelinePolicy<>>(pp, 1, layout);
    for (int r = 0; r < pp; ++r) {
      INFO(schedule << " rank " << r);
      const int held = run.stashes[static_cast<std::size_t>(r)];
      if (schedule == "gpipe") CHECK(held == m);
      if (schedule == "1f1b") CHECK(held == pp - r);
      if (schedule == "zb") CHECK(held <= pp);
      CHECK(run.peak_stash_bytes[static_cast<std::size_t>(r)] > 0);
    }
    if (schedule == "gpipe") gpipe_bytes = run.peak_stash_bytes;
    if (schedule == "1f1b") one_f_one_b_bytes = run.peak_stash_bytes;
  }
  // A rank's stashes are the same size under every schedule: the bytes follow the count.
  for (int r = 0; r < pp; ++r) {
    INFO("rank " << r);
    CHECK(gpipe_bytes[static_cast<std::size_t>(r)] % m == 0);
    CHECK(gpipe_bytes[static_cast<std::size_t>(r)] / m * (pp - r) == one_f_one_b_bytes[static_cast<std::size_t>(r)]);
  }
  // Recomputation: full keeps each block's input only, selective drops the attention core.
  std::size_t bytes[3] = {};
  int i = 0;
  for (const recompute::Mode mode : {recompute::Mode::none, recompute::Mode::selective, recompute::Mode::full}) {
    const dp_test::Layout layout{
        .micro_batch = 2, .accum = 4, .steps = 1, .layers = 4, .pp = 2, .schedule = "gpipe", .recompute = mode};
    bytes[i++] = run_on<PipelinePolicy<>>(2, 1, layout).peak_stash_bytes[0];
  }
  INFO("stash bytes, none " << bytes[0] << ", selective " << bytes[1] << ", full " << bytes[2]);
  CHECK(bytes[1] < bytes[0]);
  CHECK(bytes[2] < bytes[1]);
  // Full: per block and micro-batch only its (B·S, C) input is stashed (GPT-2 keeps about
  // 16 such rows' worth of activations per block).
  CHECK(bytes[2] * 8 < bytes[0]);
}

TEST_CASE("bad pipeline layouts are named before the first step") {
  using Model = models::GPT2<float, backend::Cpu>;
  CHECK_THROWS_WITH_AS(pipeline::even_partition(4, 4, 2),
                       doctest::Contains("the model has 4 layers but the pipeline has 4 stages x 2 chunks = 8"), Error);
  CHECK_THROWS_WITH_AS(pipeline::explicit_partition({3, 3}, 8, 2),
                       doctest::Contains("the partition's stages hold 6 layers but the model has 8"), Error);
  CHECK_THROWS_WITH_AS(pipeline::explicit_partition({3, 3, 2}, 8, 2),
                       doctest::Contains("the partition lists 3 stages but the pipeline has 2 stages x 1 chunks"),
                       Error);
  CHECK_THROWS_WITH_AS(
      pipeline::make_schedule("interleaved", {.stages = 2, .chunks = 2, .micro_batches = 3}),
      doctest::Contains(
          "the interleaved schedule needs the micro-batches (3) to be a multiple of the pipeline stages (2)"),
      Error);
  // A pipeline schedule the trainer cannot generate for the layout, named when it is built.
  dp_test::Layout layout{
      .micro_batch = 1, .accum = 3, .steps = 1, .layers = 4, .pp = 2, .chunks = 2, .schedule = "interleaved"};
  CHECK_THROWS_WITH_AS(run_on<PipelinePolicy<>>(2, 1, layout),
                       doctest::Contains("needs the micro-batches (3) to be a multiple of the pipeline stages (2)"),
                       Error);
  // One stage runs its micro-batches one after another (the data-parallel reduction
  // overlaps the last one's backward): no other schedule.
  dp_test::Layout one_stage{.micro_batch = 1, .accum = 2, .steps = 1, .layers = 2, .pp = 1, .schedule = "gpipe"};
  CHECK_THROWS_WITH_AS(run_on<PipelinePolicy<>>(1, 1, one_stage),
                       doctest::Contains("--schedule gpipe needs --pp 2 or more"), Error);
  // A whole-model call on a pipeline rank.
  comm::run_threads(2, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    comm::Grid grid(world, {.pp = 2});
    const pipeline::Placement placement{
        .stages = 2, .rank = grid.coords().pp, .partition = pipeline::even_partition(2, 2)};
    Model model(dp_test::config(2), 1, {}, placement);
    backend::cpu::Context ctx;
    std::vector<std::int32_t> tokens(16, 1);
    CHECK_THROWS_WITH_AS(model.forward(ctx, tokens.data(), tokens.data(), 1, 16),
                         doctest::Contains("forward() runs the whole model, but this rank holds pipeline stage"),
                         Error);
  });
}

TEST_CASE("partitions: even spreads the remainder over the middle, by parameters balances the ends") {
  CHECK(pipeline::even_partition(10, 4).describe() == "2,3,3,2");
  CHECK(pipeline::even_partition(8, 2, 2).describe() == "2,2,2,2");
  CHECK(pipeline::explicit_partition({1, 3, 4}, 8, 3).describe() == "1,3,4");
  // Eight equal blocks of 10, an embedding worth 25 on the first stage and a head worth
  // 5 on the last: the first stage gets fewer blocks.
  const std::vector<std::int64_t> blocks(8, 10);
  const pipeline::Partition p = pipeline::parameter_partition(blocks, 25, 5, 2);
  CHECK(p.describe() == "3,5");
}
