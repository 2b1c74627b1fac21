// llmpar/parallel/bucket_reducer.hpp — reduces the gradient buffer's buckets over the
// data-parallel group as backward completes them (Megatron-Core's DDP start/finish grad
// sync).
//
//   stage 0  all-reduce (average over dp) per bucket.
//   stage 1  reduce-scatter per bucket: rank r keeps block r, the only part its optimizer
//            holds.
//   stage 2  as 1, and a bucket's whole gradient lives only while its units run
//            backward and its reduce-scatter is in flight: a pool of bucket buffers is
//            bound to the parameters at before_backward and returned when the reduction
//            has been added into the rank's f32 gradient shard.
//   stage 3  as 2 (one unit per bucket).
//
// Why it is built this way:
//  - A bucket is issued when the last of its units finishes backward (after_backward),
//    so its reduction on the communication thread (comm_thread.hpp) overlaps the rest of
//    backward; without overlap (DataConfig::overlap = false, or a model that calls no
//    hooks) end_micro_batch issues what is left.
//  - Gradient accumulation: stages 0 and 1 reduce once per optimizer step (during the
//    last micro-batch's backward); stages 2 and 3 reduce-scatter each micro-batch, as
//    DeepSpeed does, because keeping the whole gradient across micro-batches is what
//    they exist to avoid.
//  - On a GPU the reduction reads what the kernels wrote, but the thread that queues
//    the kernels does not wait for them: issuing a bucket records a fence in the
//    compute stream's order (Backend::Fence, a CUDA event) and the communication thread
//    waits on it before the collective, while the compute thread goes on queueing the
//    rest of backward. No host synchronisation of the compute stream happens here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "llmpar/comm/init.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/parallel/comm_thread.hpp"
#include "llmpar/parallel/grad_buffer.hpp"
#include "llmpar/parallel/layout.hpp"

namespace llmpar::parallel {

template <class Model, int kStage>
class BucketReducer {
 public:
  using T = typename Model::value_type;
  using Backend = typename Model::BackendTag;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Fence = typename Backend::Fence;
  using Buffer_ = GradBuffer<Model, kStage>;
  using Grad = typename Buffer_::Grad;
  static constexpr bool kShardedGrads = kStage >= 2;

  // dp: the data-parallel group, or null for one replica.
  BucketReducer(Context& ctx, Buffer_& buffer, comm::Comm* dp, CommThread& thread, const DataConfig& cfg)
      : ctx_(ctx), buffer_(buffer), dp_(dp), thread_(thread), cfg_(cfg), state_(buffer.buckets().size()) {
    if constexpr (kShardedGrads) staging_.resize(dp_ ? buffer.largest_bucket() / buffer.dp_size() : 0);
  }
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  // Zeroes the gradients this rank accumulates; a step starts.
  void begin_step() {
    if constexpr (kShardedGrads)
      Backend::zero(ctx_, buffer_.shard_grads().data(), buffer_.shard_grads().size());
    else
      Backend::zero(ctx_, buffer_.store().grads(), buffer_.store().flat_size());
    in_step_ = true;
  }
  // Before a micro-batch's forward; `last`: the last of the step (stages 0 and 1 reduce
  // only then).
  void begin_micro_batch(bool last) {
    reduce_now_ = kShardedGrads || last;
    for (std::size_t b = 0; b < state_.size(); ++b) {
      state_[b].pending = buffer_.buckets()[b].units;
      state_[b].issued = false;
      state_[b].grad_slot = -1;
    }
  }
  // After each micro-batch's backward: the buckets not issued yet are issued now.
  void end_micro_batch() {
    for (std::size_t b = 0; b < state_.size(); ++b)
      if (!state_[b].issued) issue(static_cast<int>(b));
  }
  // Every reduction issued so far has run.
  void wait_all() { thread_.drain(); }
  void end_step() { in_step_ = false; }

  // The model's hooks: before a unit's backward (stages 2, 3 bind its bucket's pooled
  // gradients), after it (the bucket is issued when its last unit is done).
  void before_backward(int unit) {
    if constexpr (kShardedGrads) bind_grads(buffer_.bucket_of_unit(unit));
  }
  void after_backward(int unit) {
    if (!reduce_now_ || !in_step_) return;
    const int b = buffer_.bucket_of_unit(unit);
    if (--state_[static_cast<std::size_t>(b)].pending == 0 && cfg_.overlap) issue(b);
  }

  // Bytes of the pooled bucket gradients and the reduce-scatter staging (high-water).
  std::size_t bytes() const {
    std::size_t n = staging_.bytes();
    for (const Slot& s : slots_) n += s.grads.bytes();
    return n;
  }

 private:
  struct State {
    int pending = 0;  // units of this micro-batch still in backward
    bool issued = false;
    int grad_slot = -1;  // stages 2, 3: the pooled gradient buffer bound to it this micro-batch
    Fence fence;         // stages 0, 1: where its gradients are complete (one reduction per step)
  };
  struct Slot {
    Buffer<Grad, Space> grads;
    bool in_use = false;
    CommThread::Ticket ticket = 0;  // the reduction that still reads it (0: none)
    std::uint64_t last_use = 0;
    Fence fence;  // where the gradients of its reduction in flight are complete
  };

  // Queues bucket b's reduction (stage 0: all-reduce; 1: reduce-scatter in place; 2, 3:
  // reduce-scatter of its pooled buffer, added into the shard).
  void issue(int b) {
    State& st = state_[static_cast<std::size_t>(b)];
    st.issued = true;
    if (!reduce_now_ && !kShardedGrads) return;
    if (cfg_.trace) thread_.record({TraceEvent::Kind::issued, b});
    const Grad* whole = nullptr;  // stages 2, 3: the pooled gradients bound this micro-batch
    Fence* fence = &st.fence;
    if constexpr (kShardedGrads) {
      LLMPAR_CHECK(st.grad_slot >= 0, "ZeRO stage ", kStage, ": bucket ", b,
                   " reached its reduction without a gradient buffer; the model must call before_backward for "
                   "every unit it runs backward through");
      Slot& slot = slots_[static_cast<std::size_t>(st.grad_slot)];
      whole = slot.grads.data();
      fence = &slot.fence;  // a slot is not bound again before this reduction has run
    }
    fence->record(ctx_);  // the reduction reads what the kernels queued so far wrote
    auto task = [this, b, whole, fence] {
      if (dp_) fence->wait();  // alone, the only work is an add queued in stream order
      reduce(buffer_.buckets()[static_cast<std::size_t>(b)], whole);
      if (cfg_.trace) thread_.record({TraceEvent::Kind::reduced, b});
    };
    CommThread::Ticket t = 0;
    if (dp_ && cfg_.overlap)
      t = thread_.submit(task);
    else
      thread_.run_here(task);
    if constexpr (kShardedGrads) {
      Slot& slot = slots_[static_cast<std::size_t>(st.grad_slot)];
      slot.ticket = t;
      slot.in_use = false;  // free once t is done
      st.grad_slot = -1;
    }
  }

  void reduce(const typename Buffer_::Bucket& b, [[maybe_unused]] const Grad* whole) {
    if constexpr (kStage == 0) {
      if (dp_)
        dp_->all_reduce(std::span<Grad>(buffer_.store().grads() + b.begin, static_cast<std::size_t>(b.size())),
                        comm::ReduceOp::avg);
    } else if constexpr (kStage == 1) {
      if (dp_) {
        Grad* base = buffer_.store().grads() + b.begin;
        dp_->reduce_scatter(std::span<const Grad>(base, static_cast<std::size_t>(b.size())),
                            std::span<Grad>(base + buffer_.dp_rank() * b.chunk, static_cast<std::size_t>(b.chunk)),
                            comm::ReduceOp::avg);
      }
    } else {
      Grad* shard = buffer_.shard_grads().data() + b.shard_offset;
      if (dp_) {
        dp_->reduce_scatter(std::span<const Grad>(whole, static_cast<std::size_t>(b.size())),
                            std::span<Grad>(staging_.data(), static_cast<std::size_t>(b.chunk)), comm::ReduceOp::avg);
        add_into(shard, staging_.data(), b.chunk);
        if constexpr (!Space::kHostAccessible) {
          // The next reduction writes the staging block again, and an engine on the host
          // does so at once: the add must have run.
          added_.record(ctx_);
          added_.wait();
        }
      } else {
        add_into(shard, whole, b.chunk);
      }
    }
  }
  // shard += x (n): on the host at once, on a device queued in the compute stream's order.
  void add_into(Grad* shard, const Grad* x, std::int64_t n) {
    if constexpr (Space::kHostAccessible) {
      for (std::int64_t i = 0; i < n; ++i) shard[i] += x[i];
    } else {
      Backend::add_inplace(ctx_, shard, x, n);
    }
  }

  // Stages 2, 3: binds a zeroed pooled buffer to bucket b's gradients for this micro-batch.
  void bind_grads(int b) {
    State& st = state_[static_cast<std::size_t>(b)];
    if (st.grad_slot >= 0) return;
    const auto& bucket = buffer_.buckets()[static_cast<std::size_t>(b)];
    const int s = take_slot();
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    slot.in_use = true;
    slot.last_use = ++clock_;
    st.grad_slot = s;
    Backend::zero(ctx_, slot.grads.data(), bucket.size());
    for (int k : bucket.params) buffer_.parameter(k)->grad = slot.grads.data() + (buffer_.offset(k) - bucket.begin);
  }
  // A slot that is free (not in use, its last reduction done), else a new one of the
  // largest bucket's size.
  int take_slot() {
    int best = -1;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (s.in_use || (s.ticket != 0 && !thread_.done(s.ticket))) continue;
      if (best < 0 || s.last_use < slots_[static_cast<std::size_t>(best)].last_use) best = static_cast<int>(i);
    }
    if (best >= 0) return best;
    slots_.emplace_back();
    slots_.back().grads.resize(buffer_.largest_bucket());
    return static_cast<int>(slots_.size()) - 1;
  }

  Context& ctx_;
  Buffer_& buffer_;
  comm::Comm* dp_;
  CommThread& thread_;
  DataConfig cfg_;
  std::vector<State> state_;     // per bucket
  std::deque<Slot> slots_;       // stages 2, 3: pooled bucket gradients (a deque: a queued reduction's fence stays put)
  Buffer<Grad, Space> staging_;  // stages 2, 3: one block's reduce-scatter result
  Fence added_;                  // stages 2, 3 on a device: the communication thread's last add into the shard
  bool in_step_ = false, reduce_now_ = true;
  std::uint64_t clock_ = 0;
};

}  // namespace llmpar::parallel
