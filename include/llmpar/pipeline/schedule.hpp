// llmpar/pipeline/schedule.hpp — pipeline schedules as data, and their checker.
//
// A schedule is, for every pipeline rank, the list of compute actions it runs in order:
// forward or backward of micro-batch `micro` through its local chunk `chunk` (virtual
// stage chunk·p + rank when each rank holds v chunks, Narayanan et al. 2021). The
// communication between stages is implied by the actions (a forward of virtual stage s
// > 0 needs the activation of s − 1; a backward of s < last needs the gradient of s + 1),
// so one executor can run any list, and one checker can prove a list safe before it
// runs:
//
//   simulate(schedule, shape, cost) plays every rank's list with the given action
//   costs, each action starting when its rank is free and its inputs exist. It fails,
//   naming the ranks and the actions they wait on, when no rank can progress (a
//   deadlock), and reports each rank's idle time (the bubble) and the most micro-batches
//   it holds activations for at once (forward done, backward not yet).
//
// Built here: GPipe (all forwards, then all backwards: m in flight), 1F1B (PipeDream-
// flush: at most p − rank in flight) and interleaved 1F1B (Megatron-LM's order, v
// chunks per rank, m a multiple of p). The executor, the zero-bubble schedule and the
// stage partition come with the pipeline itself (not built yet: parallel::Pipeline<...>
// still fails to compile, saying so).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "llmpar/core/error.hpp"

namespace llmpar::pipeline {

enum class Op : std::uint8_t { forward, backward };

struct Action {
  Op op = Op::forward;
  int micro = 0;  // micro-batch
  int chunk = 0;  // this rank's chunk (0 without interleaving)
  friend bool operator==(const Action&, const Action&) = default;
};

// The pipeline's size: p ranks, v chunks each, m micro-batches per step.
struct Shape {
  int stages = 1;         // p
  int chunks = 1;         // v
  int micro_batches = 1;  // m

  int virtual_stages() const { return stages * chunks; }
  int virtual_stage(int rank, int chunk) const { return chunk * stages + rank; }
  void validate() const {
    LLMPAR_CHECK(stages >= 1, "a pipeline of ", stages, " stages; use 1 or more");
    LLMPAR_CHECK(chunks >= 1, chunks, " chunks per pipeline rank; use 1 or more");
    LLMPAR_CHECK(micro_batches >= 1, micro_batches, " micro-batches per step; a pipeline needs at least 1");
  }
};

using Schedule = std::vector<std::vector<Action>>;  // per rank, in order

inline std::string describe(const Action& a) {
  return detail::concat(a.op == Op::forward ? "F" : "B", a.micro, a.chunk > 0 ? detail::concat(".", a.chunk) : "");
}

// GPipe: every micro-batch forward, then every backward (in the same order).
inline Schedule gpipe(const Shape& s) {
  s.validate();
  LLMPAR_CHECK(s.chunks == 1, "GPipe runs one chunk per rank; ", s.chunks,
               " were asked for (use the interleaved schedule)");
  Schedule out(static_cast<std::size_t>(s.stages));
  for (auto& rank : out) {
    for (int m = 0; m < s.micro_batches; ++m) rank.push_back({Op::forward, m, 0});
    for (int m = 0; m < s.micro_batches; ++m) rank.push_back({Op::backward, m, 0});
  }
  return out;
}

// 1F1B: rank r runs min(p − r − 1, m) forwards, then alternates one forward and one
// backward, then drains the backwards.
inline Schedule one_f_one_b(const Shape& s) {
  s.validate();
  LLMPAR_CHECK(s.chunks == 1, "1F1B runs one chunk per rank; ", s.chunks,
               " were asked for (use the interleaved schedule)");
  Schedule out(static_cast<std::size_t>(s.stages));
  for (int r = 0; r < s.stages; ++r) {
    auto& rank = out[static_cast<std::size_t>(r)];
    const int warmup = std::min(s.stages - r - 1, s.micro_batches);
    int f = 0, b = 0;
    for (; f < warmup; ++f) rank.push_back({Op::forward, f, 0});
    for (; f < s.micro_batches; ++f, ++b) {
      rank.push_back({Op::forward, f, 0});
      rank.push_back({Op::backward, b, 0});
    }
    for (; b < s.micro_batches; ++b) rank.push_back({Op::backward, b, 0});
  }
  return out;
}

// Interleaved 1F1B (Megatron-LM): each rank holds v chunks; micro-batches go through
// the chunks in groups of p, so m must be a multiple of p.
inline Schedule interleaved_one_f_one_b(const Shape& s) {
  s.validate();
  const int p = s.stages, v = s.chunks, m = s.micro_batches;
  LLMPAR_CHECK(m % p == 0, "the interleaved schedule needs the micro-batches (", m,
               ") to be a multiple of the pipeline stages (", p, "); use ", (m / p + 1) * p, " micro-batches");
  const int total = m * v;
  auto chunk_of = [&](int k, bool forward) {
    const int c = (k % (p * v)) / p;
    return forward ? c : v - 1 - c;
  };
  auto micro_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  Schedule out(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& rank = out[static_cast<std::size_t>(r)];
    const int warmup = v == 1 ? std::min(p - r - 1, total) : std::min((p - r - 1) * 2 + (v - 1) * p, total);
    int f = 0, b = 0;
    for (; f < warmup; ++f) rank.push_back({Op::forward, micro_of(f), chunk_of(f, true)});
    for (; f < total; ++f, ++b) {
      rank.push_back({Op::forward, micro_of(f), chunk_of(f, true)});
      rank.push_back({Op::backward, micro_of(b), chunk_of(b, false)});
    }
    for (; b < total; ++b) rank.push_back({Op::backward, micro_of(b), chunk_of(b, false)});
  }
  return out;
}

// Time units of an action on one chunk (a backward costs about twice a forward).
struct Cost {
  double forward = 1.0;
  double backward = 2.0;
};

struct RankReport {
  double busy = 0.0;      // time spent computing
  double idle = 0.0;      // waiting inside the step (the bubble): makespan − busy
  int max_in_flight = 0;  // most (micro-batch, chunk) pairs holding activations at once
};
struct Report {
  double makespan = 0.0;
  std::vector<RankReport> ranks;
};

// Plays the schedule (see the header note). Also checks that every rank runs each
// (micro-batch, chunk) forward and backward exactly once, forward first.
inline Report simulate(const Schedule& schedule, const Shape& s, Cost cost = {}) {
  s.validate();
  const int p = s.stages, v = s.chunks, m = s.micro_batches, vs = s.virtual_stages();
  LLMPAR_CHECK(static_cast<int>(schedule.size()) == p, "the schedule has ", schedule.size(), " ranks, the shape ", p);
  // finish[op][micro][virtual stage], -1: not yet run.
  std::vector<double> finish(static_cast<std::size_t>(2 * m * vs), -1.0);
  auto at = [&](Op op, int micro, int stage) -> double& {
    return finish[static_cast<std::size_t>((static_cast<int>(op) * m + micro) * vs + stage)];
  };
  for (int r = 0; r < p; ++r)
    for (const Action& a : schedule[static_cast<std::size_t>(r)])
      LLMPAR_CHECK(a.micro >= 0 && a.micro < m && a.chunk >= 0 && a.chunk < v, "rank ", r, "'s action ", describe(a),
                   " is outside ", m, " micro-batches and ", v, " chunks");
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  std::vector<double> free(static_cast<std::size_t>(p), 0.0);
  std::vector<int> in_flight(static_cast<std::size_t>(p), 0);
  Report report;
  report.ranks.resize(static_cast<std::size_t>(p));
  for (;;) {
    bool progressed = false, done = true;
    for (int r = 0; r < p; ++r) {
      const auto& list = schedule[static_cast<std::size_t>(r)];
      std::size_t& i = next[static_cast<std::size_t>(r)];
      while (i < list.size()) {
        const Action& a = list[i];
        const int stage = s.virtual_stage(r, a.chunk);
        double ready = 0.0;
        if (a.op == Op::forward) {
          if (stage > 0) ready = at(Op::forward, a.micro, stage - 1);
        } else {
          LLMPAR_CHECK(at(Op::forward, a.micro, stage) >= 0.0, "rank ", r, " runs ", describe(a),
                       " before its forward; every backward needs its forward first on the same stage");
          ready = stage + 1 < vs ? at(Op::backward, a.micro, stage + 1) : at(Op::forward, a.micro, stage);
        }
        if (ready < 0.0) break;  // its input does not exist yet
        LLMPAR_CHECK(at(a.op, a.micro, stage) < 0.0, "rank ", r, " runs ", describe(a), " twice");
        const double start = std::max(free[static_cast<std::size_t>(r)], ready);
        const double t = (a.op == Op::forward ? cost.forward : cost.backward) / v;
        at(a.op, a.micro, stage) = start + t;
        free[static_cast<std::size_t>(r)] = start + t;
        RankReport& rr = report.ranks[static_cast<std::size_t>(r)];
        rr.busy += t;
        int& held = in_flight[static_cast<std::size_t>(r)];
        held += a.op == Op::forward ? 1 : -1;
        rr.max_in_flight = std::max(rr.max_in_flight, held);
        ++i;
        progressed = true;
      }
      if (i < list.size()) done = false;
    }
    if (done) break;
    if (!progressed) {
      std::string waiting;
      for (int r = 0; r < p; ++r) {
        const auto& list = schedule[static_cast<std::size_t>(r)];
        if (next[static_cast<std::size_t>(r)] < list.size())
          waiting += detail::concat(waiting.empty() ? "" : ", ", "rank ", r, " at ",
                                    describe(list[next[static_cast<std::size_t>(r)]]));
      }
      LLMPAR_FAIL("the pipeline schedule deadlocks: no rank can run its next action (", waiting,
                  ": each waits for an input that another rank produces only later)");
    }
  }
  for (int stage = 0; stage < vs; ++stage)
    for (int micro = 0; micro < m; ++micro)
      LLMPAR_CHECK(at(Op::forward, micro, stage) >= 0.0 && at(Op::backward, micro, stage) >= 0.0,
                   "the schedule never runs the ", at(Op::forward, micro, stage) < 0.0 ? "forward" : "backward",
                   " of micro-batch ", micro, " on virtual stage ", stage);
  for (double f : free) report.makespan = std::max(report.makespan, f);
  for (RankReport& rr : report.ranks) rr.idle = report.makespan - rr.busy;
  return report;
}

}  // namespace llmpar::pipeline
