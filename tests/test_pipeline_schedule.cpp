// Pipeline schedules as data (pipeline/schedule.hpp): every generated schedule over a
// grid of (p, v, m) runs to completion in the checker (no deadlock, every micro-batch's
// forward before its backward on every stage, each exactly once, the messages in the
// order each FIFO channel delivers them), holds at most the activations its design
// promises, and has the bubble its analysis predicts (ZB-H1's a third of 1F1B's); broken
// lists, shapes, costs and schedule names are named.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "llmpar/pipeline/schedule.hpp"

using namespace llmpar::pipeline;

namespace {
double bubble_ratio(const RankReport& r) { return r.idle / r.busy; }

double max_idle(const Report& report) {
  double idle = 0.0;
  for (const RankReport& r : report.ranks) idle = std::max(idle, r.idle);
  return idle;
}
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

TEST_CASE(
    "every generated schedule over p, v, m plays without deadlock, in message order, within its in-flight bound") {
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 3, 4, 8, 12, 16}) {
      const Shape flat{.stages = p, .micro_batches = m};
      INFO("p " << p << ", m " << m);
      // simulate() fails on a deadlock, an ordering error or a message out of order.
      const Report g = simulate(gpipe(flat), flat);
      const Report f = simulate(one_f_one_b(flat), flat);
      const Report z = simulate(zb_h1(flat), flat);
      for (int r = 0; r < p; ++r) {
        INFO("rank " << r);
        CHECK(g.ranks[r].max_in_flight == m);
        CHECK(f.ranks[r].max_in_flight <= std::min(p - r, m));
        CHECK(z.ranks[r].max_in_flight <= p);  // H1: 1F1B's peak, the p of its first rank
      }
      if (m % p != 0) continue;  // the interleaved schedule's precondition
      for (int v : {1, 2, 3}) {
        const Shape shape{.stages = p, .chunks = v, .micro_batches = m};
        INFO("v " << v);
        const Report report = simulate(interleaved_one_f_one_b(shape), shape);
        for (int r = 0; r < p; ++r) {
          INFO("rank " << r);
          CHECK(report.ranks[r].max_in_flight <= std::min((p - r - 1) * 2 + (v - 1) * p + 1, m * v));
        }
      }
    }
}

TEST_CASE("ZB-H1 idles p - 1 + max(0, p - m) units on every rank, 1F1B 3(p - 1): (p-1)(F+Bi-W) against (p-1)(F+Bi+W)") {
  // Default costs: F = 1, B = 2 split into Bi = W = 1, so both do the same work (3m per
  // rank). Rank 0 runs its min(p, m) forwards, then waits for Bi0 to come back through
  // the p - 1 stages below (Bi of the last stage starts at p, reaches rank 0 at 2p - 1),
  // then never waits again: the W's fill what 1F1B's longer backwards leave idle.
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 3, 4, 8, 12, 16}) {
      const Shape shape{.stages = p, .micro_batches = m};
      INFO("p " << p << ", m " << m);
      const Report z = simulate(zb_h1(shape), shape);
      const Report f = simulate(one_f_one_b(shape), shape);
      for (int r = 0; r < p; ++r) {
        INFO("rank " << r);
        CHECK(z.ranks[r].busy == doctest::Approx(3.0 * m));
        CHECK(z.ranks[r].idle == doctest::Approx(p - 1 + std::max(0, p - m)));
        CHECK(f.ranks[r].idle == doctest::Approx(3.0 * (p - 1)));
      }
    }
  for (int p : {2, 4})
    for (int m : {4, 8, 16}) {
      const Shape shape{.stages = p, .micro_batches = m};
      INFO("p " << p << ", m " << m);
      const Report z = simulate(zb_h1(shape), shape);
      const Report f = simulate(one_f_one_b(shape), shape);
      CHECK(z.ranks[0].idle < f.ranks[0].idle);
      CHECK(max_idle(z) < max_idle(f));
      CHECK(z.makespan < f.makespan);
    }
  const Shape four_by_eight{.stages = 4, .micro_batches = 8};
  const Report z = simulate(zb_h1(four_by_eight), four_by_eight);
  const Report f = simulate(one_f_one_b(four_by_eight), four_by_eight);
  CHECK(max_idle(z) == doctest::Approx(3.0));
  CHECK(max_idle(f) == doctest::Approx(9.0));
  CHECK(z.makespan == doctest::Approx(27.0));
  CHECK(f.makespan == doctest::Approx(33.0));
}

TEST_CASE(
    "ZB-H1 runs each rank's weight gradients in micro-batch order, each after its input gradient, as in the paper") {
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 3, 4, 8, 12, 16}) {
      const Shape shape{.stages = p, .micro_batches = m};
      INFO("p " << p << ", m " << m);
      const Schedule schedule = zb_h1(shape);
      CHECK(schedule == zb_h1(shape));  // deterministic
      for (int r = 0; r < p; ++r) {
        INFO("rank " << r);
        const auto& list = schedule[r];
        REQUIRE(list.size() == std::size_t(3 * m));
        int next[kOps] = {};
        for (std::size_t i = 0; i < list.size(); ++i) {
          const Action& a = list[i];
          INFO("action " << i << ": " << describe(a));
          CHECK(a.op != Op::backward);
          CHECK(a.chunk == 0);
          CHECK(a.micro == next[int(a.op)]++);  // each kind in micro-batch order
          if (a.op == Op::weight_grad) CHECK(next[int(Op::input_grad)] > a.micro);
          // The paper's figure (m >= p): W of micro-batch i right after Bi of i + r. With
          // fewer micro-batches than p - r, a rank has nothing to wait for after its
          // forwards and lags its W's less.
          const int lag = std::max(0, r - std::max(0, p - m));
          if (a.op == Op::input_grad && a.micro >= lag) {
            REQUIRE(i + 1 < list.size());
            CHECK(list[i + 1] == Action{Op::weight_grad, a.micro - lag, 0});
          }
        }
      }
      // Other costs change the times, never the safety (Bi 2, W 1; Bi 0.5, W 2.5).
      simulate(schedule, shape, {.forward = 1.0, .backward = 3.0, .weight = 1.0});
      simulate(schedule, shape, {.forward = 1.0, .backward = 3.0, .weight = 2.5});
    }
}

TEST_CASE("the checker names W before its Bi, a backward run both whole and split, a missing W, and bad costs") {
  const Shape one{.stages = 1};
  CHECK_THROWS_WITH_AS(simulate({{{Op::forward, 0}, {Op::weight_grad, 0}, {Op::input_grad, 0}}}, one),
                       doctest::Contains("rank 0 runs W0 before its input gradient Bi0"), llmpar::Error);
  CHECK_THROWS_WITH_AS(simulate({{{Op::forward, 0}, {Op::input_grad, 0}, {Op::backward, 0}}}, one),
                       doctest::Contains("rank 0 runs both Bi0 and B0; a micro-batch's backward on a stage is either "
                                         "one full backward B, or its input gradient Bi then its weight gradient W"),
                       llmpar::Error);
  CHECK_THROWS_WITH_AS(simulate({{{Op::forward, 0}, {Op::backward, 0}, {Op::weight_grad, 0}}}, one),
                       doctest::Contains("rank 0 runs both B0 and W0"), llmpar::Error);
  CHECK_THROWS_WITH_AS(simulate({{{Op::forward, 0}, {Op::input_grad, 0}}}, one),
                       doctest::Contains("rank 0 runs Bi0 but never its weight gradient W0"), llmpar::Error);
  // Mixing is per stage: rank 1 splits its backward, rank 0 runs it whole, starting as
  // soon as rank 1's Bi's end (at 3 and 5), so the step ends at 7, not after rank 1's
  // W's would have delayed it.
  const Shape two{.stages = 2, .micro_batches = 2};
  const Schedule mixed = {{{Op::forward, 0}, {Op::forward, 1}, {Op::backward, 0}, {Op::backward, 1}},
                          {{Op::forward, 0},
                           {Op::input_grad, 0},
                           {Op::forward, 1},
                           {Op::input_grad, 1},
                           {Op::weight_grad, 0},
                           {Op::weight_grad, 1}}};
  CHECK(simulate(mixed, two).makespan == doctest::Approx(7.0));
  CHECK_THROWS_WITH_AS(simulate(zb_h1(two), two, {.weight = 2.0}),
                       doctest::Contains("Cost::weight is 2; the weight gradient is the part of the backward "
                                         "(Cost::backward = 2) left after the input gradient"),
                       llmpar::Error);
  CHECK_THROWS_WITH_AS(simulate(zb_h1(two), two, {.forward = 0.0}), doctest::Contains("Cost::forward is 0"),
                       llmpar::Error);
}

TEST_CASE("the message-order check names the channel and the first message out of place, without a deadlock") {
  // Rank 1 takes micro-batch 1's activation first: nothing waits forever (rank 0 sends
  // both before it needs anything back), but over one FIFO channel rank 1's F1 would
  // receive micro-batch 0's activation.
  const Shape two{.stages = 2, .micro_batches = 2};
  const Schedule swapped_forwards = {{{Op::forward, 0}, {Op::forward, 1}, {Op::backward, 0}, {Op::backward, 1}},
                                     {{Op::forward, 1}, {Op::forward, 0}, {Op::backward, 0}, {Op::backward, 1}}};
  CHECK_THROWS_WITH_AS(simulate(swapped_forwards, two),
                       doctest::Contains("rank 0 sends rank 1 activations in an order it does not take them in (one "
                                         "FIFO channel per pair of ranks, no tags): message 0 is micro-batch 0 of "
                                         "virtual stage 0, sent by F0, but rank 1's F1 takes it as micro-batch 1 of "
                                         "virtual stage 0"),
                       llmpar::Error);
  const Schedule swapped_backwards = {{{Op::forward, 0}, {Op::forward, 1}, {Op::backward, 1}, {Op::backward, 0}},
                                      {{Op::forward, 0}, {Op::backward, 0}, {Op::forward, 1}, {Op::backward, 1}}};
  CHECK_THROWS_WITH_AS(simulate(swapped_backwards, two),
                       doctest::Contains("rank 1 sends rank 0 gradients in an order it does not take them in"),
                       llmpar::Error);
  // p = 2, v = 2: rank 0 sends both chunk-0 activations (virtual stage 0) before its
  // chunk-1 ones (stage 2); rank 1 takes micro-batch 0 through both of its chunks
  // first. Every input exists in time; only the channel's order is wrong.
  const Shape interleaved{.stages = 2, .chunks = 2, .micro_batches = 2};
  const std::vector<Action> backwards = {
      {Op::backward, 0, 1}, {Op::backward, 1, 1}, {Op::backward, 0, 0}, {Op::backward, 1, 0}};
  Schedule depth_first = {{{Op::forward, 0, 0}, {Op::forward, 1, 0}, {Op::forward, 0, 1}, {Op::forward, 1, 1}},
                          {{Op::forward, 0, 0}, {Op::forward, 1, 0}, {Op::forward, 0, 1}, {Op::forward, 1, 1}}};
  for (auto& rank : depth_first) rank.insert(rank.end(), backwards.begin(), backwards.end());
  CHECK(simulate(depth_first, interleaved).makespan > 0.0);  // the consistent order passes
  std::swap(depth_first[1][1], depth_first[1][2]);           // rank 1: F0, F0.1, F1, F1.1
  CHECK_THROWS_WITH_AS(simulate(depth_first, interleaved),
                       doctest::Contains("rank 0 sends rank 1 activations in an order it does not take them in (one "
                                         "FIFO channel per pair of ranks, no tags): message 1 is micro-batch 1 of "
                                         "virtual stage 0, sent by F1, but rank 1's F0.1 takes it as micro-batch 0 "
                                         "of virtual stage 2"),
                       llmpar::Error);
  // One rank, two chunks: the activations pass between its own chunks, held to the
  // same order (one local queue).
  const Shape local{.stages = 1, .chunks = 2, .micro_batches = 2};
  const Schedule crossed = {{{Op::forward, 0, 0},
                             {Op::forward, 1, 0},
                             {Op::forward, 1, 1},
                             {Op::forward, 0, 1},
                             {Op::backward, 0, 1},
                             {Op::backward, 1, 1},
                             {Op::backward, 0, 0},
                             {Op::backward, 1, 0}}};
  CHECK_THROWS_WITH_AS(simulate(crossed, local),
                       doctest::Contains("rank 0 passes itself activations (between its chunks) in an order it does "
                                         "not take them in"),
                       llmpar::Error);
  CHECK_THROWS_WITH_AS(check_message_order(crossed, local), doctest::Contains("message 0 is micro-batch 0"),
                       llmpar::Error);
}

TEST_CASE("make_schedule picks a schedule by its --schedule name and names the valid ones otherwise") {
  const Shape flat{.stages = 4, .micro_batches = 8};
  const Shape chunked{.stages = 4, .chunks = 2, .micro_batches = 8};
  CHECK(make_schedule("gpipe", flat) == gpipe(flat));
  CHECK(make_schedule("1f1b", flat) == one_f_one_b(flat));
  CHECK(make_schedule("interleaved", chunked) == interleaved_one_f_one_b(chunked));
  CHECK(make_schedule("zb", flat) == zb_h1(flat));
  CHECK_THROWS_WITH_AS(make_schedule("zb-h2", flat),
                       doctest::Contains("unknown pipeline schedule 'zb-h2'; use one of gpipe, 1f1b, interleaved, zb"),
                       llmpar::Error);
  CHECK_THROWS_WITH_AS(make_schedule("interleaved", flat), doctest::Contains("give --virtual-stages >= 2"),
                       llmpar::Error);
  CHECK_THROWS_WITH_AS(make_schedule("zb", chunked), doctest::Contains("ZB-H1 runs one chunk per rank; 2 were asked"),
                       llmpar::Error);
  CHECK_THROWS_WITH_AS(make_schedule("1f1b", chunked), doctest::Contains("1F1B runs one chunk per rank"),
                       llmpar::Error);
  CHECK_THROWS_WITH_AS(make_schedule("gpipe", chunked), doctest::Contains("GPipe runs one chunk per rank"),
                       llmpar::Error);
}
