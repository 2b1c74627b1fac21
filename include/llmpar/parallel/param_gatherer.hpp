// llmpar/parallel/param_gatherer.hpp — parameter values across the data-parallel group
// after ZeRO has sharded them.
//
//   stages 1, 2  after each update every rank's block of every bucket's values is
//                all-gathered into the store (gather_after_update).
//   stage 3      parameter values are sharded too: a unit's values are all-gathered into
//                a pooled working buffer just before its forward and again before its
//                backward, the next unit's gather prefetched (in the order the first
//                step recorded) while the current one computes, and the buffer reusable
//                as soon as the unit is done, so only a few units are whole at any time.
//
// Gathers go through the same communication thread as the bucket reductions
// (comm_thread.hpp), so the two keep one order on the dp communicator on every rank. A
// gather reads the shard the optimizer wrote: it waits, on the communication thread, for a
// fence recorded in the compute stream's order when it was queued (Backend::Fence), so the
// compute thread is never held up by a host synchronisation of the stream.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "llmpar/comm/init.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/parallel/comm_thread.hpp"
#include "llmpar/parallel/grad_buffer.hpp"
#include "llmpar/parallel/layout.hpp"

namespace llmpar::parallel {

template <class Model, int kStage>
class ParamGatherer {
 public:
  using T = typename Model::value_type;
  using Backend = typename Model::BackendTag;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Fence = typename Backend::Fence;
  using Buffer_ = GradBuffer<Model, kStage>;
  static constexpr bool kShardedValues = kStage == 3;

  ParamGatherer(Context& ctx, Buffer_& buffer, comm::Comm* dp, CommThread& thread, const DataConfig& cfg)
      : ctx_(ctx), buffer_(buffer), dp_(dp), thread_(thread), cfg_(cfg) {}
  ParamGatherer(const ParamGatherer&) = delete;
  ParamGatherer& operator=(const ParamGatherer&) = delete;

  void begin_step() {
    in_step_ = true;
    trace_cursor_ = 0;
    prefetch_ok_ = !trace_recording_;
  }
  void end_step() {
    in_step_ = false;
    if (trace_recording_ && !trace_.empty()) trace_recording_ = false;  // the first step's gathers are the order
  }

  // The model's hooks (stage 3: whole values around each use of a unit).
  void before_use(int unit) {
    if constexpr (kShardedValues) acquire(buffer_.bucket_of_unit(unit));
  }
  void after_use(int unit) {
    if constexpr (kShardedValues) release(buffer_.bucket_of_unit(unit));
  }

  // After the optimizer's update (or a checkpoint's restore of this rank's blocks):
  // stages 1 and 2 all-gather each bucket's updated values; stage 3 forgets its gathered
  // values, which are now stale.
  void after_update() {
    if constexpr (kShardedValues) {
      thread_.drain();
      for (Slot& s : slots_) {
        s.bucket = -1;
        s.ticket = 0;
      }
      std::fill(resident_.begin(), resident_.end(), -1);
    } else if constexpr (kStage == 1 || kStage == 2) {
      if (!dp_) return;
      updated_.record(ctx_);
      thread_.run_here([&] {
        updated_.wait();  // the engine reads the updated blocks
        for (const auto& b : buffer_.buckets()) {
          T* base = buffer_.store().values() + b.begin;
          dp_->all_gather(std::span<const T>(base + buffer_.dp_rank() * b.chunk, static_cast<std::size_t>(b.chunk)),
                          std::span<T>(base, static_cast<std::size_t>(b.size())));
        }
      });
    }
  }

  // The most units whose values were whole at once (stage 3).
  int max_gathered_units() const { return max_live_; }
  // Bytes of the pooled gathered values (high-water).
  std::size_t bytes() const {
    std::size_t n = 0;
    for (const Slot& s : slots_) n += s.values.bytes();
    return n;
  }

 private:
  struct Slot {
    Buffer<T, Space> values;
    int bucket = -1;
    bool in_use = false;
    CommThread::Ticket ticket = 0;  // the gather that still writes it (0: none)
    std::uint64_t last_use = 0;
    Fence fence;  // where the shard its gather reads is written
  };

  // Bucket b's values whole in a slot and bound to its parameters; prefetches the next
  // bucket of the recorded order.
  void acquire(int b) {
    if (resident_.empty()) resident_.assign(buffer_.buckets().size(), -1);
    int s = resident_[static_cast<std::size_t>(b)];
    if (s < 0) s = gather(b);
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    thread_.wait(slot.ticket);
    slot.ticket = 0;
    if (!slot.in_use) ++live_;
    max_live_ = std::max(max_live_, live_);
    slot.in_use = true;
    slot.last_use = ++clock_;
    const auto& bucket = buffer_.buckets()[static_cast<std::size_t>(b)];
    for (int k : bucket.params) buffer_.parameter(k)->value = slot.values.data() + (buffer_.offset(k) - bucket.begin);
    if (!in_step_) return;
    if (trace_recording_) {
      if (trace_.empty() || trace_.back() != b) trace_.push_back(b);
      return;
    }
    // Prefetch: where the first step's order goes next.
    if (!prefetch_ok_) return;
    if (trace_cursor_ < trace_.size() && trace_[trace_cursor_] == b) {
      ++trace_cursor_;
    } else if (!(trace_cursor_ > 0 && trace_[trace_cursor_ - 1] == b)) {
      prefetch_ok_ = false;  // a different order this step: gather on demand
      return;
    }
    if (trace_cursor_ < trace_.size()) {
      const int next = trace_[trace_cursor_];
      if (resident_[static_cast<std::size_t>(next)] < 0) gather(next, s);
    }
  }
  void release(int b) {
    if (resident_.empty()) return;
    const int s = resident_[static_cast<std::size_t>(b)];
    if (s < 0) return;
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    if (slot.in_use) --live_;
    slot.in_use = false;
  }
  // Queues the all-gather of bucket b's values into a slot (not `avoid`); returns it.
  int gather(int b, int avoid = -1) {
    const int s = take_slot(avoid);
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    slot.bucket = b;
    resident_[static_cast<std::size_t>(b)] = s;
    const auto& bucket = buffer_.buckets()[static_cast<std::size_t>(b)];
    T* whole = slot.values.data();
    const T* mine = buffer_.shard_values().data() + bucket.shard_offset;
    Fence* fence = &slot.fence;  // a slot is not taken again before its gather has run
    fence->record(ctx_);         // the optimizer's last writes to the shard
    auto task = [this, b, whole, mine, fence] {
      const auto& bk = buffer_.buckets()[static_cast<std::size_t>(b)];
      if (dp_) {
        fence->wait();
        dp_->all_gather(std::span<const T>(mine, static_cast<std::size_t>(bk.chunk)),
                        std::span<T>(whole, static_cast<std::size_t>(bk.size())));
      } else {
        Backend::copy(ctx_, whole, mine, bk.size());  // alone: a copy in stream order
      }
      if (cfg_.trace) thread_.record({TraceEvent::Kind::gathered, b});
    };
    if (dp_ && cfg_.overlap) {
      slot.ticket = thread_.submit(task);
    } else {
      thread_.run_here(task);
      slot.ticket = 0;
    }
    return s;
  }
  // A slot that is free (not in use, its last gather done), else a new one of the
  // largest bucket's size.
  int take_slot(int avoid) {
    int best = -1;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (s.in_use || static_cast<int>(i) == avoid || (s.ticket != 0 && !thread_.done(s.ticket))) continue;
      if (best < 0 || s.last_use < slots_[static_cast<std::size_t>(best)].last_use) best = static_cast<int>(i);
    }
    if (best >= 0) {
      Slot& s = slots_[static_cast<std::size_t>(best)];
      if (s.bucket >= 0) resident_[static_cast<std::size_t>(s.bucket)] = -1;
      s.bucket = -1;
      return best;
    }
    slots_.emplace_back();
    slots_.back().values.resize(buffer_.largest_bucket());
    return static_cast<int>(slots_.size()) - 1;
  }

  Context& ctx_;
  Buffer_& buffer_;
  comm::Comm* dp_;
  CommThread& thread_;
  DataConfig cfg_;
  std::deque<Slot> slots_;     // stage 3: pooled gathered values (a deque: a queued gather's fence stays put)
  Fence updated_;              // stages 1, 2: where the optimizer's update is written
  std::vector<int> resident_;  // stage 3: bucket -> its value slot, or -1
  std::vector<int> trace_;     // stage 3: the order of gathers the first step recorded
  std::size_t trace_cursor_ = 0;
  bool trace_recording_ = true, prefetch_ok_ = false, in_step_ = false;
  int live_ = 0, max_live_ = 0;
  std::uint64_t clock_ = 0;
};

}  // namespace llmpar::parallel
