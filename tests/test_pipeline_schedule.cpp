// Pipeline schedules as data (pipeline/schedule.hpp): every generated schedule over a
// grid of (p, v, m) runs to completion in the checker (no deadlock, every micro-batch's
// forward before its backward on every stage, each exactly once), holds at most the
// activations its design promises, and has the bubble its analysis predicts; broken
// lists and shapes are named.
#include <doctest/doctest.h>

#include <cmath>

#include "llmpar/pipeline/schedule.hpp"

using namespace llmpar;
using namespace llmpar::pipeline;

namespace {
double bubble_ratio(const RankReport& r) { return r.idle / r.busy; }
}  // namespace

TEST_CASE("GPipe and 1F1B: no deadlock, m or at most p - rank micro-batches in flight, a bubble of (p-1)/m") {
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 3, 4, 8, 16}) {
      const Shape shape{.stages = p, .micro_batches = m};
      INFO("p " << p << ", m " << m);
      const Report g = simulate(gpipe(shape), shape);
      const Report f = simulate(one_f_one_b(shape), shape);
      for (int r = 0; r < p; ++r) {
        INFO("rank " << r);
        CHECK(g.ranks[r].max_in_flight == m);
        CHECK(f.ranks[r].max_in_flight == std::min(p - r, m));
        // Forward 1, backward 2 time units: the bubble is (p - 1)(F + B) on every rank,
        // the work m(F + B).
        CHECK(bubble_ratio(f.ranks[r]) == doctest::Approx(double(p - 1) / m));
        CHECK(bubble_ratio(g.ranks[r]) == doctest::Approx(double(p - 1) / m));
      }
    }
}

TEST_CASE("interleaved 1F1B: no deadlock, and a bubble of (p-1)/(v m)") {
  for (int p : {2, 3, 4})
    for (int v : {1, 2, 3})
      for (int k : {1, 2, 4}) {
        const Shape shape{.stages = p, .chunks = v, .micro_batches = k * p};
        INFO("p " << p << ", v " << v << ", m " << k * p);
        const Report report = simulate(interleaved_one_f_one_b(shape), shape);
        for (int r = 0; r < p; ++r) {
          INFO("rank " << r);
          CHECK(bubble_ratio(report.ranks[r]) == doctest::Approx(double(p - 1) / (v * k * p)));
          // Megatron's warm-up: (p - r - 1)·2 + (v - 1)·p chunk forwards, plus one.
          const int bound = v == 1 ? p - r : (p - r - 1) * 2 + (v - 1) * p + 1;
          CHECK(report.ranks[r].max_in_flight <= std::min(bound, v * k * p));
        }
      }
}

TEST_CASE("the checker names a deadlock, a backward before its forward, a missing action, and bad shapes") {
  const Shape two{.stages = 2, .micro_batches = 2};
  // Rank 1 waits for micro-batch 1, which rank 0 sends only after micro-batch 0's
  // backward, which needs rank 1 first.
  const Schedule cycle = {{{Op::forward, 0}, {Op::backward, 0}, {Op::forward, 1}, {Op::backward, 1}},
                          {{Op::forward, 1}, {Op::forward, 0}, {Op::backward, 0}, {Op::backward, 1}}};
  CHECK_THROWS_WITH(simulate(cycle, two), doctest::Contains("the pipeline schedule deadlocks: no rank can run its "
                                                            "next action (rank 0 at B0, rank 1 at F1"));
  const Schedule early = {{{Op::backward, 0}, {Op::forward, 0}}, {{Op::forward, 0}, {Op::backward, 0}}};
  CHECK_THROWS_WITH(simulate(early, {.stages = 2}), doctest::Contains("rank 0 runs B0 before its forward"));
  const Schedule missing = {{{Op::forward, 0}, {Op::backward, 0}}, {{Op::forward, 0}, {Op::backward, 0}}};
  CHECK_THROWS_WITH(simulate(missing, two), doctest::Contains("never runs the forward of micro-batch 1"));
  CHECK_THROWS_WITH(interleaved_one_f_one_b({.stages = 4, .chunks = 2, .micro_batches = 6}),
                    doctest::Contains("needs the micro-batches (6) to be a multiple of the pipeline stages (4); "
                                      "use 8 micro-batches"));
  CHECK_THROWS_WITH(one_f_one_b({.stages = 2, .chunks = 2, .micro_batches = 2}),
                    doctest::Contains("1F1B runs one chunk per rank"));
  CHECK_THROWS_WITH(gpipe({.stages = 0}), doctest::Contains("a pipeline of 0 stages"));
}
