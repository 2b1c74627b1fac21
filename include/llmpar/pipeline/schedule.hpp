// llmpar/pipeline/schedule.hpp — pipeline schedules as data, and their checker.
//
// A schedule is, for every pipeline rank, the list of compute actions it runs in order:
// forward, backward, or the two halves of a backward (the input gradient, then the
// weight gradient) of micro-batch `micro` through its local chunk `chunk` (virtual stage
// chunk·p + rank when each rank holds v chunks, Narayanan et al. 2021). The
// communication between stages is implied by the actions (a forward of virtual stage s
// > 0 needs the activation of s − 1; a backward or input gradient of s < last needs the
// gradient of s + 1; a weight gradient needs nothing from another stage), so one
// executor can run any list, and one checker can prove a list safe before it runs:
//
//   simulate(schedule, shape, cost) plays every rank's list with the given action
//   costs, each action starting when its rank is free and its inputs exist. It fails,
//   naming the ranks and the actions they wait on, when no rank can progress (a
//   deadlock), and reports each rank's idle time (the bubble) and the most micro-batches
//   it holds activations for at once (forward done, weight gradients not yet).
//   check_message_order(schedule, shape), which simulate also runs, proves the messages
//   can travel without tags: the executor carries activations over one communicator and
//   gradients over another, each a FIFO channel per ordered pair of ranks, so what rank
//   a sends b of one kind must be what b takes from a, in the same order.
//
// Built here: GPipe (all forwards, then all backwards: m in flight), 1F1B (PipeDream-
// flush: at most p − rank in flight), interleaved 1F1B (Megatron-LM's order, v chunks
// per rank, m a multiple of p) and ZB-H1 (Qi et al. 2023, zero bubble): the backward
// split into the input gradient Bi, which the previous stage waits on, and the weight
// gradient W, which nobody waits on, so W can fill the bubble while at most p micro-
// batches are in flight, 1F1B's peak memory. make_schedule picks one by its
// --schedule name. The executor and the stage partition come with the pipeline itself
// (not built yet: parallel::Pipeline<...> still fails to compile, saying so).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "llmpar/core/error.hpp"

namespace llmpar::pipeline {

enum class Op : std::uint8_t {
  forward,      // F: sends the chunk's output activation to the next virtual stage
  backward,     // B: the full backward (input and weight gradients together)
  input_grad,   // Bi: the input gradient only, sent to the previous virtual stage
  weight_grad,  // W: the deferred weight gradients of the same micro-batch and chunk
};
inline constexpr int kOps = 4;

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

inline const char* op_name(Op op) {
  switch (op) {
    case Op::forward:
      return "F";
    case Op::backward:
      return "B";
    case Op::input_grad:
      return "Bi";
    case Op::weight_grad:
      return "W";
  }
  return "?";
}

// "F3", "B3", "Bi3", "W3"; ".1" after it for chunk 1 and up.
inline std::string describe(const Action& a) {
  return detail::concat(op_name(a.op), a.micro, a.chunk > 0 ? detail::concat(".", a.chunk) : "");
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

// ZB-H1 (Qi et al. 2023, the zero-bubble schedule whose memory is 1F1B's): built by
// playing the pipeline with unit costs (F = Bi = W = 1) and letting each free rank r
// pick, in order,
//   (a) its next forward, if its input exists, fewer than p micro-batches are in flight
//       (forwards minus weight gradients: activations live until W, so p is 1F1B's
//       peak, the paper's H1) and its forwards are fewer than p − r ahead of its input
//       gradients (1F1B's warm-up);
//   (b) else its next input gradient Bi whose input exists (the next stage's Bi has
//       ended, or on the last stage its own forward), in micro-batch order;
//   (c) else its oldest pending weight gradient W, which no stage waits on;
//   (d) else it waits a step.
// The forwards and input gradients so keep 1F1B's alternation, and the W's fill the
// gaps: with m ≥ p, rank r's W of micro-batch i lands right after its Bi of i + r (the
// rest drain at the end), as in the paper's figure, and every rank idles
// p − 1 + max(0, p − m) units: the paper's (p − 1)(F + Bi − W) once m ≥ p, against
// 1F1B's (p − 1)(F + Bi + W). Putting (b) before (a) starves the stages downstream of
// forwards and measures worse (5 units, not 3, at p = 4, m = 8). The pick is
// deterministic (a rank decides from what ended by the current step only), runs each
// rank's W's in micro-batch order (the executor accumulates weight gradients in that
// order, bitwise equal to 1F1B's), and simulate() with the default costs replays it to
// the same times.
inline Schedule zb_h1(const Shape& s) {
  s.validate();
  LLMPAR_CHECK(s.chunks == 1, "ZB-H1 runs one chunk per rank; ", s.chunks,
               " were asked for (use the interleaved schedule)");
  const int p = s.stages, m = s.micro_batches;
  constexpr int kNever = std::numeric_limits<int>::max();
  // The step at which rank r's forward / input gradient of a micro-batch ends.
  std::vector<int> forward_end(static_cast<std::size_t>(p * m), kNever), input_grad_end = forward_end;
  auto ended = [&](const std::vector<int>& end, int rank, int micro, int step) {
    return end[static_cast<std::size_t>(rank * m + micro)] <= step;
  };
  struct Done {
    int forwards = 0, input_grads = 0, weight_grads = 0;
  };
  std::vector<Done> done(static_cast<std::size_t>(p));
  Schedule out(static_cast<std::size_t>(p));
  for (int step = 0, placed = 0; placed < 3 * p * m; ++step) {
    int placed_now = 0;
    for (int r = 0; r < p; ++r) {
      Done& d = done[static_cast<std::size_t>(r)];
      const int f = d.forwards, b = d.input_grads;
      const bool forward_ok =
          f < m && (r == 0 || ended(forward_end, r - 1, f, step)) && f - d.weight_grads < p && f - b < p - r;
      const bool input_grad_ok =
          b < f && (r + 1 < p ? ended(input_grad_end, r + 1, b, step) : ended(forward_end, r, b, step));
      Action next;
      if (forward_ok) {
        next = {Op::forward, d.forwards++, 0};
        forward_end[static_cast<std::size_t>(r * m + f)] = step + 1;
      } else if (input_grad_ok) {
        next = {Op::input_grad, d.input_grads++, 0};
        input_grad_end[static_cast<std::size_t>(r * m + b)] = step + 1;
      } else if (d.weight_grads < b) {
        next = {Op::weight_grad, d.weight_grads++, 0};
      } else {
        continue;
      }
      out[static_cast<std::size_t>(r)].push_back(next);
      ++placed_now;
    }
    // Unit costs: a step where no rank starts anything leaves the next step the same.
    LLMPAR_CHECK(placed_now > 0, "the ZB-H1 construction stalls at step ", step, " for ", p, " stages and ", m,
                 " micro-batches (a bug in zb_h1)");
    placed += placed_now;
  }
  return out;
}

// Time units of an action on one chunk. A full backward costs `backward`; split, its
// input gradient costs backward − weight and its weight gradient `weight`. The defaults
// (a backward about twice a forward) give the zero-bubble paper's F = Bi = W.
struct Cost {
  double forward = 1.0;
  double backward = 2.0;
  double weight = 1.0;  // the weight-gradient part of `backward`

  void validate() const {
    LLMPAR_CHECK(forward > 0.0, "Cost::forward is ", forward, "; an action takes a positive time");
    LLMPAR_CHECK(backward > 0.0, "Cost::backward is ", backward, "; an action takes a positive time");
    LLMPAR_CHECK(weight > 0.0 && weight < backward, "Cost::weight is ", weight,
                 "; the weight gradient is the part of the backward (Cost::backward = ", backward,
                 ") left after the input gradient, so it lies strictly between 0 and ", backward);
  }
  double of(Op op) const {
    switch (op) {
      case Op::forward:
        return forward;
      case Op::backward:
        return backward;
      case Op::input_grad:
        return backward - weight;
      case Op::weight_grad:
        return weight;
    }
    return 0.0;
  }
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

namespace detail {

using llmpar::detail::concat;

inline void check_actions(const Schedule& schedule, const Shape& s) {
  s.validate();
  LLMPAR_CHECK(static_cast<int>(schedule.size()) == s.stages, "the schedule has ", schedule.size(),
               " ranks, the shape ", s.stages);
  for (int r = 0; r < s.stages; ++r)
    for (const Action& a : schedule[static_cast<std::size_t>(r)])
      LLMPAR_CHECK(a.micro >= 0 && a.micro < s.micro_batches && a.chunk >= 0 && a.chunk < s.chunks, "rank ", r,
                   "'s action ", describe(a), " is outside ", s.micro_batches, " micro-batches and ", s.chunks,
                   " chunks");
}

}  // namespace detail

// Proves the messages the schedule implies can travel over one FIFO channel per ordered
// pair of ranks and kind, without tags (see the header note): a forward of virtual stage
// s sends its activation to s + 1, a backward or input gradient of s sends its gradient
// to s − 1; a message is sent when its action runs and taken when the action needing it
// starts, so each channel's sent order is the sender's list order and its taken order
// the receiver's. Stage s lives on rank s % p, so with p == 1 a rank passes messages
// between its own chunks; they are held to the same order (one local queue serves).
// Fails naming the pair, the kind and the first message out of place.
inline void check_message_order(const Schedule& schedule, const Shape& s) {
  detail::check_actions(schedule, s);
  const int p = s.stages, vs = s.virtual_stages();
  struct Message {
    int micro;
    int stage;  // the sending virtual stage
    Action by;  // the action that sends it, or that takes it
  };
  enum Kind { kActivation, kGradient, kKinds };
  // [kind][from · p + to], in the order sent / taken.
  std::vector<std::vector<Message>> sent[kKinds], taken[kKinds];
  for (int k = 0; k < kKinds; ++k) {
    sent[k].resize(static_cast<std::size_t>(p * p));
    taken[k].resize(static_cast<std::size_t>(p * p));
  }
  auto channel = [&](int from, int to) { return static_cast<std::size_t>(from * p + to); };
  for (int r = 0; r < p; ++r)
    for (const Action& a : schedule[static_cast<std::size_t>(r)]) {
      const int stage = s.virtual_stage(r, a.chunk);
      if (a.op == Op::forward) {
        if (stage + 1 < vs) sent[kActivation][channel(r, (stage + 1) % p)].push_back({a.micro, stage, a});
        if (stage > 0) taken[kActivation][channel((stage - 1) % p, r)].push_back({a.micro, stage - 1, a});
      } else if (a.op == Op::backward || a.op == Op::input_grad) {
        if (stage > 0) sent[kGradient][channel(r, (stage - 1) % p)].push_back({a.micro, stage, a});
        if (stage + 1 < vs) taken[kGradient][channel((stage + 1) % p, r)].push_back({a.micro, stage + 1, a});
      }
    }
  for (int k = 0; k < kKinds; ++k) {
    const char* kind = k == kActivation ? "activations" : "gradients";
    for (int from = 0; from < p; ++from)
      for (int to = 0; to < p; ++to) {
        const auto& out = sent[k][channel(from, to)];
        const auto& in = taken[k][channel(from, to)];
        const std::string pair = from == to
                                     ? detail::concat("rank ", from, " passes itself ", kind, " (between its chunks)")
                                     : detail::concat("rank ", from, " sends rank ", to, " ", kind);
        for (std::size_t i = 0; i < std::min(out.size(), in.size()); ++i)
          LLMPAR_CHECK(out[i].micro == in[i].micro && out[i].stage == in[i].stage, pair,
                       " in an order it does not take them in (one FIFO channel per pair of ranks, no tags): message ",
                       i, " is micro-batch ", out[i].micro, " of virtual stage ", out[i].stage, ", sent by ",
                       describe(out[i].by), ", but rank ", to, "'s ", describe(in[i].by), " takes it as micro-batch ",
                       in[i].micro, " of virtual stage ", in[i].stage, "; take them in the order they are sent");
        LLMPAR_CHECK(out.size() == in.size(), pair, ": ", out.size(), " messages sent, ", in.size(), " taken");
      }
  }
}

// Plays the schedule (see the header note). Also checks that every rank runs each
// (micro-batch, chunk) forward once, and either one full backward or one input gradient
// and one weight gradient, in that order and after the forward; then the message order.
inline Report simulate(const Schedule& schedule, const Shape& s, Cost cost = {}) {
  detail::check_actions(schedule, s);
  cost.validate();
  const int p = s.stages, v = s.chunks, m = s.micro_batches, vs = s.virtual_stages();
  // finish[op][micro][virtual stage], -1: not yet run.
  std::vector<double> finish(static_cast<std::size_t>(kOps * m * vs), -1.0);
  auto at = [&](Op op, int micro, int stage) -> double& {
    return finish[static_cast<std::size_t>((static_cast<int>(op) * m + micro) * vs + stage)];
  };
  // When the gradient stage `stage` sends back ended: from its backward or input gradient
  // (never both: checked as they run).
  auto gradient = [&](int micro, int stage) {
    return std::max(at(Op::backward, micro, stage), at(Op::input_grad, micro, stage));
  };
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
        LLMPAR_CHECK(at(a.op, a.micro, stage) < 0.0, "rank ", r, " runs ", describe(a), " twice");
        auto never_both = [&](Op other) {
          LLMPAR_CHECK(at(other, a.micro, stage) < 0.0, "rank ", r, " runs both ", describe({other, a.micro, a.chunk}),
                       " and ", describe(a),
                       "; a micro-batch's backward on a stage is either one full backward B, or "
                       "its input gradient Bi then its weight gradient W");
        };
        double ready = 0.0;
        switch (a.op) {
          case Op::forward:
            if (stage > 0) ready = at(Op::forward, a.micro, stage - 1);
            break;
          case Op::backward:
          case Op::input_grad:
            LLMPAR_CHECK(at(Op::forward, a.micro, stage) >= 0.0, "rank ", r, " runs ", describe(a),
                         " before its forward; every backward needs its forward first on the same stage");
            never_both(a.op == Op::backward ? Op::input_grad : Op::backward);
            ready = stage + 1 < vs ? gradient(a.micro, stage + 1) : at(Op::forward, a.micro, stage);
            break;
          case Op::weight_grad:
            never_both(Op::backward);
            LLMPAR_CHECK(at(Op::input_grad, a.micro, stage) >= 0.0, "rank ", r, " runs ", describe(a),
                         " before its input gradient ", describe({Op::input_grad, a.micro, a.chunk}),
                         "; the weight gradient comes after the input gradient on the same stage");
            break;  // its input is this rank's own
        }
        if (ready < 0.0) break;  // its input does not exist yet
        const double start = std::max(free[static_cast<std::size_t>(r)], ready);
        const double t = cost.of(a.op) / v;
        at(a.op, a.micro, stage) = start + t;
        free[static_cast<std::size_t>(r)] = start + t;
        RankReport& rr = report.ranks[static_cast<std::size_t>(r)];
        rr.busy += t;
        // Activations live from the forward until the weight gradients are done.
        int& held = in_flight[static_cast<std::size_t>(r)];
        held += a.op == Op::forward ? 1 : a.op == Op::input_grad ? 0 : -1;
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
    for (int micro = 0; micro < m; ++micro) {
      LLMPAR_CHECK(at(Op::forward, micro, stage) >= 0.0 && gradient(micro, stage) >= 0.0,
                   "the schedule never runs the ", at(Op::forward, micro, stage) < 0.0 ? "forward" : "backward",
                   " of micro-batch ", micro, " on virtual stage ", stage);
      LLMPAR_CHECK(at(Op::input_grad, micro, stage) < 0.0 || at(Op::weight_grad, micro, stage) >= 0.0, "rank ",
                   stage % p, " runs ", describe({Op::input_grad, micro, stage / p}), " but never its weight gradient ",
                   describe({Op::weight_grad, micro, stage / p}), " (micro-batch ", micro, " on virtual stage ", stage,
                   ")");
    }
  for (double f : free) report.makespan = std::max(report.makespan, f);
  for (RankReport& rr : report.ranks) rr.idle = report.makespan - rr.busy;
  check_message_order(schedule, s);
  return report;
}

// The schedule a --schedule flag names: "gpipe", "1f1b", "interleaved" (v = chunks ≥ 2)
// or "zb" (ZB-H1).
inline Schedule make_schedule(std::string_view name, const Shape& s) {
  if (name == "gpipe") return gpipe(s);
  if (name == "1f1b") return one_f_one_b(s);
  if (name == "interleaved") {
    LLMPAR_CHECK(s.chunks >= 2, "--schedule interleaved runs 2 or more chunks per rank, ", s.chunks,
                 " was asked for; give --virtual-stages >= 2 (or use --schedule 1f1b)");
    return interleaved_one_f_one_b(s);
  }
  if (name == "zb") return zb_h1(s);
  LLMPAR_FAIL("unknown pipeline schedule '", name, "'; use one of gpipe, 1f1b, interleaved, zb");
}

}  // namespace llmpar::pipeline
