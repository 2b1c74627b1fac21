// Context parallelism (nn/context_parallel.hpp: ring attention, and the all-to-all over
// the heads) computes the serial run: GPT-2 (learned positions) and Llama (rotary
// positions, grouped-query attention) at cp 2 and 4, cp x tp (with sequence
// parallelism) x dp, cp x pp, cp with ZeRO 1 and 3 and with selective recomputation: step 1's gradients,
// five steps' losses, norms and parameters within 1e-5 (fp32) of one rank; the chunking
// itself (which rows a rank holds, at which positions); the activations a rank holds
// fall with the cp degree, as the planner predicts them; bad sequence lengths are named.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "data_parallel_test_util.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/nn/context_parallel.hpp"
#include "llmpar/plan/cost.hpp"

using namespace llmpar;

namespace {

template <int kStage = 0>
using Policy = Compose<backend::Cpu, parallel::Pipeline<schedule::Configured>, parallel::Data<zero::Stage<kStage>>,
                       recompute::Configured>;
template <int kStage>
using DataPolicy = Compose<backend::Cpu, parallel::Data<zero::Stage<kStage>>>;

template <class Spec, class P = Policy<>>
dp_test::Run run(int ranks, int tp, const dp_test::Layout& layout) {
  return dp_test::run_threads<P, Spec>(ranks, tp, layout);
}

// One rank, the whole model, the same global batch (dp replicas' micro-batches in one).
template <class Spec>
dp_test::Run serial(const dp_test::Layout& layout, int dp = 1) {
  return dp_test::serial_run<Policy<>, Spec>(layout, dp);
}
using dp_test::check_close;

}  // namespace

TEST_CASE("each cp rank holds chunks r and 2cp - 1 - r of every sequence, at their positions") {
  comm::run_threads(2, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    const nn::ContextParallelGroup cp(&world);
    const std::vector<int> full{0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17};  // (2, 8)
    std::vector<int> local(8);
    cp.take_chunks(local.data(), full.data(), 2, 8);
    const std::vector<int> expected =
        world.rank() == 0 ? std::vector<int>{0, 1, 6, 7, 10, 11, 16, 17} : std::vector<int>{2, 3, 4, 5, 12, 13, 14, 15};
    CHECK(local == expected);
    const ChunkPositions at = cp.positions(8);
    for (std::int64_t t = 0; t < 4; ++t) CHECK(at.position_of(t) == expected[static_cast<std::size_t>(t)]);
    CHECK_THROWS_WITH_AS(cp.check_sequence(6), doctest::Contains("sequence length 6 is not divisible by 2 x --cp 2"),
                         Error);
  });
}

TEST_CASE_TEMPLATE("context parallelism at cp 2 and 4 computes the serial run", Spec, models::GPT2Spec,
                   models::LlamaSpec) {
  const dp_test::Layout base{.micro_batch = 2, .accum = 2};
  const dp_test::Run reference = serial<Spec>(base);
  for (int cp : {2, 4}) {
    dp_test::Layout layout = base;
    layout.cp = cp;
    check_close(run<Spec>(cp, 1, layout), reference, "cp " + std::to_string(cp));
  }
}

TEST_CASE_TEMPLATE("cp 2 x tp 2 with sequence parallelism x dp 2, and cp 2 x pp 2, compute the serial run", Spec,
                   models::GPT2Spec, models::LlamaSpec) {
  const dp_test::Layout base{.micro_batch = 1, .accum = 2, .layers = 2};
  dp_test::Layout three = base;
  three.cp = 2;
  three.sp = true;
  check_close(run<Spec, Policy<1>>(8, 2, three), serial<Spec>(base, 2), "cp 2 x tp 2 sp x dp 2, ZeRO 1");
  dp_test::Layout piped = base;
  piped.cp = 2;
  piped.pp = 2;
  piped.schedule = "1f1b";
  check_close(run<Spec>(4, 1, piped), serial<Spec>(base), "cp 2 x pp 2");
}

TEST_CASE("cp 2 x dp 2 with ZeRO 3, and cp 2 with selective recomputation, compute the serial run") {
  const dp_test::Layout base{.micro_batch = 1, .accum = 2, .layers = 2};
  dp_test::Layout layout = base;
  layout.cp = 2;
  check_close(run<models::LlamaSpec, DataPolicy<3>>(4, 1, layout), serial<models::LlamaSpec>(base, 2),
              "cp 2 x dp 2, ZeRO 3");
  layout.recompute = recompute::Mode::selective;
  check_close(run<models::LlamaSpec>(2, 1, layout), serial<models::LlamaSpec>(base), "cp 2, selective recompute");
}

TEST_CASE_TEMPLATE("context parallelism by all-to-all over the heads computes the serial run", Spec, models::GPT2Spec,
                   models::LlamaSpec) {
  const dp_test::Layout base{.micro_batch = 2, .accum = 2};
  const dp_test::Run reference = serial<Spec>(base);
  dp_test::Layout layout = base;
  layout.cp = 2;
  layout.cp_comm = nn::CpComm::all_to_all;
  check_close(run<Spec>(2, 1, layout), reference, "cp 2, all-to-all");
  layout.recompute = recompute::Mode::selective;
  check_close(run<Spec>(2, 1, layout), reference, "cp 2, all-to-all, selective recompute");
  layout.recompute.reset();
  layout.pp = 2;
  layout.schedule = "1f1b";
  check_close(run<Spec>(4, 1, layout), reference, "cp 2 x pp 2, all-to-all");
  if constexpr (std::is_same_v<Spec, models::GPT2Spec>) {  // 4 heads: cp 4, or cp 2 within tp 2
    layout.pp = 1;
    layout.cp = 4;
    check_close(run<Spec>(4, 1, layout), reference, "cp 4, all-to-all");
    dp_test::Layout three{.micro_batch = 1, .accum = 2, .sp = true, .cp = 2, .cp_comm = nn::CpComm::all_to_all};
    check_close(run<Spec, Policy<1>>(8, 2, three), serial<Spec>(three, 2), "cp 2 x tp 2 sp x dp 2, all-to-all, ZeRO 1");
  } else {  // 2 kv heads: cp 4 over 4 of them
    models::LlamaConfig wide = dp_test::llama_config(base.layers);
    wide.kv_heads = 4;
    dp_test::Layout mha = base;
    mha.llama = wide;
    const dp_test::Run mha_reference = serial<Spec>(mha);
    mha.cp = 4;
    mha.cp_comm = nn::CpComm::all_to_all;
    check_close(run<Spec>(4, 1, mha), mha_reference, "cp 4 over 4 kv heads, all-to-all");
  }
}

TEST_CASE("the all-to-all names a cp that does not divide the kv heads") {
  dp_test::Layout layout{.micro_batch = 1, .accum = 1, .cp = 4, .cp_comm = nn::CpComm::all_to_all};
  CHECK_THROWS_WITH_AS(run<models::LlamaSpec>(4, 1, layout),
                       doctest::Contains("--cp-comm a2a splits the heads over the cp ranks, but --cp 4 does not "
                                         "divide the 2 kv heads; use --cp-comm ring, or a --cp that divides them"),
                       Error);
  layout.cp = 2;
  layout.sp = false;
  CHECK_THROWS_WITH_AS(run<models::LlamaSpec>(4, 2, layout),
                       doctest::Contains("does not divide the 1 kv heads of a tp rank (kv heads / --tp)"), Error);
  CHECK_THROWS_WITH_AS(nn::parse_cp_comm("ulysses"),
                       doctest::Contains("--cp-comm ulysses is not a context-parallel exchange; use ring"), Error);
}

TEST_CASE("the activations a rank holds fall with the cp degree") {
  const dp_test::Layout base{.micro_batch = 4, .accum = 1};
  const std::size_t one = run<models::LlamaSpec>(1, 1, base).memory.activations;
  for (int cp : {2, 4}) {
    dp_test::Layout layout = base;
    layout.cp = cp;
    const std::size_t per_rank = run<models::LlamaSpec>(cp, 1, layout).memory.activations;
    MESSAGE("cp ", cp, ": ", per_rank, " activation bytes per rank against ", one, " on one rank");
    // The stashes and scratch scale with the rows; ring attention adds its K/V blocks.
    CHECK(static_cast<double>(per_rank) <= 1.25 * static_cast<double>(one) / cp);
  }
}

TEST_CASE("the planner's memory per rank under context parallelism is what the trainer measures") {
  plan::Cluster cluster;
  cluster.memory_bytes = 1e12;
  for (auto [cp, how] : {std::pair{1, nn::CpComm::ring}, std::pair{2, nn::CpComm::ring}, std::pair{4, nn::CpComm::ring},
                         std::pair{2, nn::CpComm::all_to_all}}) {
    for (int zero : {0, 1}) {
      CAPTURE(cp);
      CAPTURE(nn::cp_comm_name(how));
      CAPTURE(zero);
      dp_test::Layout layout{.micro_batch = 2, .accum = 2};
      layout.cp = cp;
      layout.cp_comm = how;
      const dp_test::Run got =
          zero == 1 ? run<models::LlamaSpec, Policy<1>>(cp * 2, 1, layout) : run<models::LlamaSpec>(cp, 1, layout);
      parallel::LayoutConfig l = dp_test::layout_config<Policy<>>(layout, zero == 1 ? cp * 2 : cp, 1);
      l.zero = zero;
      const plan::Memory m = plan::rank_memory(dp_test::llama_config(layout.layers), 16, l, 0, cluster);
      CHECK(m.parameters == doctest::Approx(static_cast<double>(got.memory.parameters)));
      CHECK(m.gradients == doctest::Approx(static_cast<double>(got.memory.gradients)));
      // ZeRO 1: moments of a 1 / (dp x cp) share (rank 0's real parameters differ from the
      // mean share by the padding of the buckets' blocks).
      CHECK(m.optimizer == doctest::Approx(static_cast<double>(got.memory.optimizer)).epsilon(0.01));
      CHECK(m.activations + m.workspace == doctest::Approx(static_cast<double>(got.memory.activations)).epsilon(0.05));
    }
  }
}

TEST_CASE("a sequence that context parallelism cannot cut into 2 x cp chunks is named") {
  dp_test::Layout layout{.micro_batch = 1, .accum = 1};
  layout.cp = 4;  // 16 tokens: 8 chunks of 2; cp 8 would need 16 chunks
  CHECK_NOTHROW(run<models::LlamaSpec>(4, 1, layout));
  layout.cp = 16;
  CHECK_THROWS_WITH_AS(run<models::LlamaSpec>(16, 1, layout),
                       doctest::Contains("sequence length 16 is not divisible by 2 x --cp 16 = 32"), Error);
}
