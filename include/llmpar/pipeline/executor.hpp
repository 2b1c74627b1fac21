// llmpar/pipeline/executor.hpp — runs one rank's list of a pipeline schedule.
//
// The executor takes the schedule of every rank (pipeline/schedule.hpp), checks it once
// (simulate: no deadlock, every forward before its backward, messages in the order the
// receiver takes them) and then, each step, runs this rank's list on the model's chunks
// (Model::forward_chunk / backward_chunk, models/transformer.hpp):
//
//   forward  mb, chunk   receive the previous virtual stage's activation (unless this is
//                        the first), run the chunk, and send its output on (unless last,
//                        which computes the loss and its gradient instead);
//   backward mb, chunk   receive the next stage's gradient (unless last), run the chunk's
//                        backward, send the input gradient back (unless first).
//
// One micro-batch's activations through one chunk live in a Stash taken from a pool at
// its forward and returned after its backward, so the pool's size is the most
// micro-batches in flight (GPipe: m; 1F1B: at most p) and its bytes are what the
// schedule costs in activations: peak_stash_bytes() is measured from the buffers.
//
// Communication. Activations travel on one communicator (the pp group) and gradients on
// another (pp_grad), each a FIFO channel per pair of ranks, in the order the checked
// schedule produces and consumes them. A message is posted when the action after the
// one that produced it starts, together with that action's receive on the same
// communicator (one batch: p2p_async). On the host engines (threads, MPI) sends do not
// block: they are kept until their buffer is reused, and only receives are waited for.
// On NCCL a send holds its stream until the peer receives, so a send and a receive on
// the same communicator go in one group. The time a rank spends waiting for a receive
// is its bubble as the run measured it (idle_seconds()).
//
// A zero-bubble schedule's input-gradient pass (Op::input_grad) leaves the blocks'
// weight gradients in the stash (Model::backward_chunk(..., defer_weights)); its weight
// pass (Op::weight_grad, Model::weight_chunk) computes them and frees the stash.
//
// The serial run is the one-stage schedule: p = 1, one chunk, [F0 B0 F1 B1 ...] (1F1B
// with p = 1), so the trainer has one code path for every layout.
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "llmpar/comm/init.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/nn/model.hpp"
#include "llmpar/pipeline/partition.hpp"
#include "llmpar/pipeline/schedule.hpp"

namespace llmpar::pipeline {

// The communicators of a pipeline (parallel::Groups carries them); null when p = 1.
struct Links {
  comm::Comm* activations = nullptr;  // the pp group: forward messages
  comm::Comm* gradients = nullptr;    // a second pp communicator: backward messages
};

// One action as it ran (train_gpt --trace): seconds since the step began.
struct ActionTiming {
  Action action;
  double start = 0.0, end = 0.0;  // the compute
  double wait = 0.0;              // waiting for its input before start
};

// One micro-batch's host inputs (every rank of a pipeline reads the same batches; the
// first stage uses the tokens, the last the targets).
struct MicroBatch {
  const std::int32_t* tokens = nullptr;
  const std::int32_t* targets = nullptr;
};

// A model the executor runs: an nn::Model that also says where it sits on the stages.
template <class M>
concept Placed = requires(const M& cm) {
  { cm.placement() } -> std::convertible_to<const Placement&>;
};
template <class M>
concept Model = nn::Model<M> && Placed<M>;

// Checks M as nn::check_model does, and its placement; true when M is a Model.
template <class M>
consteval bool check_model() {
  static_assert(nn::check_model<M>());
  static_assert(Placed<M>,
                "llmpar: this model type has no placement() const returning its pipeline::Placement (which chunks "
                "of layers this rank holds); the trainer checks it against the layout and the pipeline executor "
                "runs those chunks");
  return true;
}

template <class Model>
class Executor {
 public:
  static_assert(check_model<Model>());
  using T = typename Model::value_type;
  using Backend = typename Model::BackendTag;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Acc = typename Model::Acc;
  using Stash = typename Model::Stash;

  // What the trainer hears around each micro-batch of the one-stage schedule (the
  // data-parallel strategy's begin_micro_batch / end_micro_batch, which overlap the
  // gradient reduction with the last backward).
  struct Listener {
    std::function<void(int micro)> before_forward;
    std::function<void(int micro)> after_backward;
  };

  Executor(Model& model, const Schedule& schedule, Shape shape, Links links = {})
      : model_(model), shape_(shape), links_(links) {
    const Placement& pl = model.placement();
    LLMPAR_CHECK(shape.stages == pl.stages && shape.chunks == pl.chunks, "the schedule is for ", shape.stages,
                 " stages x ", shape.chunks, " chunks but the model holds stage ", pl.rank, " of ", pl.stages, " with ",
                 pl.chunks, " chunks; build both from the same --pp and --virtual-stages");
    report_ = simulate(schedule, shape);  // throws, naming the problem, if the schedule cannot run
    list_ = schedule[static_cast<std::size_t>(pl.rank)];
    LLMPAR_CHECK(shape.stages > 1 || shape.chunks == 1, "virtual stages (", shape.chunks,
                 " chunks) need a pipeline of at least 2 stages; use --virtual-stages 1 without --pp");
    if (shape.stages > 1) {
      LLMPAR_CHECK(links.activations != nullptr && links.gradients != nullptr &&
                       links.activations->size() == shape.stages && links.gradients->size() == shape.stages,
                   "a pipeline of ", shape.stages,
                   " stages needs its two pp communicators of that size (parallel::Groups::of(grid))");
    }
  }

  // Runs this rank's list for one step of shape().micro_batches micro-batches and
  // returns the sum of their mean losses (the last stage's; 0 elsewhere).
  double run(Context& ctx, std::span<const MicroBatch> micro, std::int64_t batch, std::int64_t seq, Acc loss_scale,
             const Listener& listener = {}) {
    LLMPAR_CHECK(static_cast<int>(micro.size()) == shape_.micro_batches, "the step was given ", micro.size(),
                 " micro-batches but the schedule runs ", shape_.micro_batches);
    const auto t0 = std::chrono::steady_clock::now();
    auto now = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    const std::int64_t n = model_.activation_size(batch, seq);
    held_.assign(static_cast<std::size_t>(shape_.micro_batches * shape_.chunks), nullptr);
    timings_.clear();
    idle_ = 0.0;
    double loss = 0.0;
    for (const Action& a : list_) {
      const int vstage = shape_.virtual_stage(model_.placement().rank, a.chunk);
      const bool first = vstage == 0, last = vstage == shape_.virtual_stages() - 1;
      ActionTiming timing{a};
      const double w0 = now();
      if (a.op == Op::forward) {
        Slot& slot = take();
        held(a) = &slot;
        std::optional<comm::Op> recv;
        if (!first) recv = recv_op(*links_.activations, model_.input(slot.stash, a.chunk, batch, seq), n, prev(vstage));
        flush(ctx, recv, 0);
        timing.wait = now() - w0;
        timing.start = now();
        if (listener.before_forward) listener.before_forward(a.micro);
        const MicroBatch& mb = micro[static_cast<std::size_t>(a.micro)];
        const Acc l = model_.forward_chunk(ctx, a.chunk, slot.stash, mb.tokens, mb.targets, batch, seq,
                                           Model::Pass::train, loss_scale);
        if (last) loss += static_cast<double>(l);
        if (!last) {
          pending_[0] = {send_op(*links_.activations, model_.output(slot.stash), n, next(vstage)), &slot.sends};
        }
        account(slot);
      } else if (a.op == Op::weight_grad) {  // the weight pass: nothing to receive or send
        Slot* slot = held(a);
        LLMPAR_CHECK(slot != nullptr, "the weight pass of micro-batch ", a.micro, " ran before its forward");
        flush(ctx, std::nullopt, 0);
        timing.start = now();
        model_.weight_chunk(ctx, slot->stash);
        retire(a, *slot, listener);
      } else {  // backward or input_grad
        Slot* slot = held(a);
        LLMPAR_CHECK(slot != nullptr, "backward of micro-batch ", a.micro, " ran before its forward");
        std::optional<comm::Op> recv;
        if (!last) {
          grad_in_.reserve(n);
          recv = recv_op(*links_.gradients, grad_in_.data(), n, next(vstage));
        }
        flush(ctx, recv, 1);
        timing.wait = now() - w0;
        timing.start = now();
        GradBuffer* dx = first ? nullptr : &take_grad(n);
        model_.backward_chunk(ctx, slot->stash, last ? nullptr : grad_in_.data(), dx ? dx->data.data() : nullptr,
                              a.op == Op::input_grad);
        if (dx) pending_[1] = {send_op(*links_.gradients, dx->data.data(), n, prev(vstage)), &dx->sends};
        if (a.op == Op::backward)
          retire(a, *slot, listener);
        else
          account(*slot);  // the deferred weight operands
      }
      timing.end = now();
      if (shape_.stages > 1) idle_ += timing.wait;  // one stage receives nothing
      timings_.push_back(timing);
    }
    flush(ctx, std::nullopt, 0);
    const double w0 = now();
    wait_all();
    if (shape_.stages > 1) idle_ += now() - w0;
    step_seconds_ = now();
    return loss;
  }

  // Forward only, for evaluation: every micro-batch through every stage in order;
  // returns the sum of the mean losses (the last stage's; 0 elsewhere).
  double evaluate(Context& ctx, std::span<const MicroBatch> micro, std::int64_t batch, std::int64_t seq) {
    const std::int64_t n = model_.activation_size(batch, seq);
    double loss = 0.0;
    Slot& slot = take();
    for (std::size_t m = 0; m < micro.size(); ++m)
      for (int c = 0; c < shape_.chunks; ++c) {
        const int vstage = shape_.virtual_stage(model_.placement().rank, c);
        const bool first = vstage == 0, last = vstage == shape_.virtual_stages() - 1;
        std::optional<comm::Op> recv;
        if (!first) recv = recv_op(*links_.activations, model_.input(slot.stash, c, batch, seq), n, prev(vstage));
        flush(ctx, recv, 0);
        const Acc l = model_.forward_chunk(ctx, c, slot.stash, micro[m].tokens, micro[m].targets, batch, seq,
                                           Model::Pass::evaluate);
        if (last) loss += static_cast<double>(l);
        if (!last) {
          pending_[0] = {send_op(*links_.activations, model_.output(slot.stash), n, next(vstage)), &slot.sends};
          flush(ctx, std::nullopt, 0);
          wait(slot.sends);  // the stash is reused by the next forward
        }
      }
    give_back(slot);
    return loss;
  }

  const Shape& shape() const { return shape_; }
  const std::vector<Action>& actions() const { return list_; }
  // The checker's report of the schedule with unit costs (the bubble it predicts).
  const Report& predicted() const { return report_; }
  // The last step, as it ran: each action's timing, the seconds this rank waited for
  // its inputs (its bubble), the step's length.
  std::span<const ActionTiming> timings() const { return timings_; }
  double idle_seconds() const { return idle_; }
  double step_seconds() const { return step_seconds_; }
  // Stashes allocated (the most micro-batches in flight at once) and the most bytes of
  // stashed activations live at once, from the buffers.
  int stashes() const { return static_cast<int>(slots_.size()); }
  std::size_t peak_stash_bytes() const { return peak_bytes_; }
  std::size_t stash_bytes() const {
    std::size_t b = grad_in_.bytes();
    for (const auto& s : slots_) b += s->stash.bytes();
    for (const auto& g : grads_) b += g->data.bytes();
    return b;
  }

 private:
  using Request = comm::Comm::Request;
  struct Slot {
    Stash stash;
    std::vector<Request> sends;  // sends still reading the stash's output
    bool busy = false;
    std::size_t counted = 0;  // its bytes in the live total
  };
  struct GradBuffer {
    Buffer<T, Space> data;
    std::vector<Request> sends;
  };
  struct Pending {
    std::optional<comm::Op> op;
    std::vector<Request>* owner = nullptr;  // where the send's request is kept
  };

  // A message of n activations (the communicators carry f32, bf16 and f16; the f64
  // models of the tests run without a pipeline).
  static comm::Op send_op(comm::Comm& c, const T* data, std::int64_t n, int peer) {
    if constexpr (comm::Element<T>)
      return c.send_op(std::span<const T>(data, static_cast<std::size_t>(n)), peer);
    else
      LLMPAR_FAIL("pipeline messages carry f32, bf16 or f16 activations; this model's are not");
  }
  static comm::Op recv_op(comm::Comm& c, T* data, std::int64_t n, int peer) {
    if constexpr (comm::Element<T>)
      return c.recv_op(std::span<T>(data, static_cast<std::size_t>(n)), peer);
    else
      LLMPAR_FAIL("pipeline messages carry f32, bf16 or f16 activations; this model's are not");
  }
  int prev(int vstage) const { return (vstage - 1) % shape_.stages; }
  int next(int vstage) const { return (vstage + 1) % shape_.stages; }
  Slot*& held(const Action& a) { return held_[static_cast<std::size_t>(a.micro * shape_.chunks + a.chunk)]; }

  // Counts a held stash's bytes as they are now in the live total and its peak.
  void account(Slot& slot) {
    const std::size_t now = slot.stash.bytes();
    live_bytes_ = live_bytes_ - slot.counted + now;
    slot.counted = now;
    peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  }
  // A micro-batch's backward is complete on this chunk: its stash goes back to the pool.
  void retire(const Action& a, Slot& slot, const Listener& listener) {
    if (listener.after_backward) listener.after_backward(a.micro);
    live_bytes_ -= slot.counted;
    slot.counted = 0;
    give_back(slot);
    held(a) = nullptr;
  }

  Slot& take() {
    for (auto& s : slots_)
      if (!s->busy) {
        s->busy = true;
        return *s;
      }
    slots_.push_back(std::make_unique<Slot>());
    slots_.back()->busy = true;
    return *slots_.back();
  }
  void give_back(Slot& s) {
    wait(s.sends);
    s.busy = false;
  }
  // A gradient buffer no send still reads.
  GradBuffer& take_grad(std::int64_t n) {
    for (auto& g : grads_) {
      bool free = true;
      for (auto& r : g->sends) free = free && r.test();
      if (free) {
        g->sends.clear();
        g->data.reserve(n);
        return *g;
      }
    }
    grads_.push_back(std::make_unique<GradBuffer>());
    grads_.back()->data.reserve(n);
    return *grads_.back();
  }
  static void wait(std::vector<Request>& requests) {
    for (auto& r : requests) r.wait();
    requests.clear();
  }
  void wait_all() {
    for (auto& s : slots_) wait(s->sends);
    for (auto& g : grads_) wait(g->sends);
  }

  // Posts the pending sends with this action's receive (on its communicator) and waits
  // for the receive. Sends read what the kernels wrote; a receive's buffer is read by
  // the kernels after it.
  // channel: the receive's communicator (0 activations, 1 gradients).
  void flush(Context& ctx, const std::optional<comm::Op>& recv, int channel) {
    if (!pending_[0].op && !pending_[1].op && !recv) return;
    Backend::synchronize(ctx);
    comm::Comm* comms[2] = {links_.activations, links_.gradients};
    for (int k = 0; k < 2; ++k) {
      const bool mine = recv && k == channel;
      Pending& p = pending_[k];
      if (!p.op && !mine) continue;
      if constexpr (Space::kHostAccessible) {
        if (p.op) p.owner->push_back(comms[k]->p2p_async({*p.op}));
        if (mine) comms[k]->p2p({*recv});
      } else {
        std::vector<comm::Op> ops;
        if (p.op) ops.push_back(*p.op);
        if (mine) ops.push_back(*recv);
        Request r = comms[k]->p2p_async(std::span<const comm::Op>(ops));
        if (mine)
          r.wait();
        else
          p.owner->push_back(std::move(r));
      }
      p = Pending{};
    }
  }
  Model& model_;
  Shape shape_;
  Links links_;
  Report report_;
  std::vector<Action> list_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<std::unique_ptr<GradBuffer>> grads_;
  std::vector<Slot*> held_;   // (micro, chunk) -> its stash while in flight
  Pending pending_[2];        // [0] activations, [1] gradients
  Buffer<T, Space> grad_in_;  // the gradient received for a backward
  std::vector<ActionTiming> timings_;
  double idle_ = 0.0, step_seconds_ = 0.0;
  std::size_t live_bytes_ = 0, peak_bytes_ = 0;
};

}  // namespace llmpar::pipeline
