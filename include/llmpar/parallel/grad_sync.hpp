// llmpar/parallel/grad_sync.hpp — data parallelism and ZeRO stages 0 to 3: the one owner
// of gradient communication.
//
// GradSync<Model, kStage> re-lays the model's ParameterStore out in the order backward
// produces gradients (Megatron-Core's ParamAndGradBuffer), cuts it into buckets, and
// does every gradient collective of a step:
//
//   stage 0  all-reduce (average over dp) per bucket; every rank updates everything.
//   stage 1  reduce-scatter per bucket: rank r keeps block r of each bucket, the only
//            part its optimizer (master weights, moments) holds; after the update the
//            buckets' values are all-gathered in the storage precision.
//   stage 2  as 1, and a bucket's whole gradient lives only while its units run
//            backward and its reduce-scatter is in flight: a pool of bucket buffers is
//            bound to the parameters at before_backward and returned when the reduction
//            has been added into the rank's f32 gradient shard.
//   stage 3  as 2, and parameter values are sharded too: a bucket is one unit (a block,
//            the embedding, the final norm), all-gathered into a pooled working buffer
//            just before its forward and again before its backward, the next unit's
//            gather prefetched (in the order the first step recorded) while the current
//            one computes, and the buffer reusable as soon as the unit is done, so only
//            a few units are whole at any time.
//
// Why it is built this way:
//  - Buckets are reduced as soon as the units in them finish backward, on a
//    communication thread (host memory) that issues the blocking collectives on the
//    data-parallel communicator, so communication overlaps the rest of backward on every
//    engine (MPI progresses a blocking call; a non-blocking one would need polling). The
//    dp communicator belongs to that thread during a step and to the caller between
//    steps; the tensor-parallel communicators never leave the compute thread, so the
//    order of operations on each communicator is the same on every rank.
//  - Gradient accumulation: stages 0 and 1 reduce once per optimizer step (during the
//    last micro-batch's backward); stages 2 and 3 reduce-scatter each micro-batch, as
//    DeepSpeed does, because keeping the whole gradient across micro-batches is what
//    they exist to avoid.
//  - A ZeRO shard is offsets into the buckets: block r of every bucket (Megatron's
//    distributed optimizer shards per bucket the same way), so rank r's shard is a list
//    of segments, and the optimizer is built for it (Backend::make_optimizer(ctx,
//    sync.optimizer_shard(), cfg)). Buckets are padded so each block is aligned.
//  - The sequence-parallel norm gradients are summed over the tensor-parallel group
//    after the dp reduction (sums commute), over only the elements this rank owns, in
//    one packed all-reduce instead of one per norm.
//  - The global gradient norm counts every element once: each rank sums the squares of
//    block r of every bucket (tensor-split parameters on every tp rank, replicated ones
//    on tp rank 0 only), and one world all-reduce adds them together with the count of
//    ranks whose gradients are not finite (the loss scaler's overflow flag, reduced over
//    every group at once).
//  - Memory is reported from the buffers themselves (memory()).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "llmpar/comm/init.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/nn/units.hpp"
#include "llmpar/optim/adamw.hpp"
#include "llmpar/parallel/layout.hpp"

namespace llmpar::parallel {

// The groups a training step communicates over: the replicas of this model (dp), every
// rank (the global norm and the overflow verdict), the pipeline's two channels
// (activations on pp, gradients on pp_grad) and the embedding group (the first and last
// pipeline stage: the tied token table's gradient). Null: this rank alone.
struct Groups {
  comm::Comm* dp = nullptr;
  comm::Comm* world = nullptr;
  comm::Comm* pp = nullptr;
  comm::Comm* pp_grad = nullptr;
  comm::Comm* embedding = nullptr;

  template <class Grid>
  static Groups of(Grid& grid) {
    return {&grid.dp(), &grid.world(), &grid.pp(), &grid.pp_grad(), &grid.embedding()};
  }
};

// Bytes per rank, from the allocations.
struct MemoryReport {
  std::size_t parameters = 0;     // parameter values this rank keeps between steps
  std::size_t gradients = 0;      // gradients kept between micro-batches (whole or shard)
  std::size_t optimizer = 0;      // master weights and moments
  std::size_t activations = 0;    // the model's activations and their gradients
  std::size_t communication = 0;  // bucket and gather buffers, staging (high-water)
  std::size_t model_state() const { return parameters + gradients + optimizer; }
};

// One entry of the event trace (DataConfig::trace).
struct TraceEvent {
  enum class Kind : std::uint8_t { backward_done, issued, reduced, gathered };
  Kind kind;
  int index;  // the unit (backward_done) or the bucket
};

namespace detail {

// A thread that runs tasks in the order they were submitted. wait(ticket) returns when
// the task has run, rethrowing its exception.
class CommThread {
 public:
  using Ticket = std::uint64_t;
  CommThread() : thread_([this] { loop(); }) {}
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;
  ~CommThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  Ticket submit(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    wake_.notify_all();
    return ++submitted_;
  }
  void wait(Ticket t) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return finished_ >= t || error_; });
    if (error_) std::rethrow_exception(error_);
  }
  bool done(Ticket t) {
    std::lock_guard<std::mutex> lock(mutex_);
    return finished_ >= t;
  }
  void drain() { wait(submitted()); }
  Ticket submitted() {
    std::lock_guard<std::mutex> lock(mutex_);
    return submitted_;
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      std::exception_ptr error;
      if (!error_) {
        try {
          task();
        } catch (...) {
          error = std::current_exception();
        }
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++finished_;
        if (error && !error_) error_ = error;
      }
      done_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, done_cv_;
  std::deque<std::function<void()>> tasks_;
  Ticket submitted_ = 0, finished_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;
};

template <class Model>
concept HasUnits = requires(Model& m, nn::UnitHooks* h) {
  { m.num_units() } -> std::convertible_to<int>;
  m.set_unit_hooks(h);
};

}  // namespace detail

template <class Model, int kStage>
class GradSync final : public nn::UnitHooks {
 public:
  using T = typename Model::value_type;
  using Backend = typename Model::BackendTag;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Grad = acc_t<T>;
  using Segment = optim::Segment<T>;
  static_assert(kStage >= 0 && kStage <= 3, "llmpar::parallel::GradSync: the ZeRO stage is 0, 1, 2 or 3");
  static constexpr bool kShardedGrads = kStage >= 2;
  static constexpr bool kShardedValues = kStage == 3;
  static_assert(kStage < 2 || detail::HasUnits<Model>,
                "llmpar::parallel::GradSync: ZeRO stages 2 and 3 bind gradients (and gather parameters) per unit, "
                "so the model must name its units (num_units, unit_parameters, set_unit_hooks: nn/units.hpp)");

  GradSync(Context& ctx, Model& model, Groups groups, const DataConfig& cfg)
      : ctx_(ctx),
        model_(model),
        store_(model.parameter_store()),
        dp_(groups.dp && groups.dp->size() > 1 ? groups.dp : nullptr),
        world_(groups.world && groups.world->size() > 1 ? groups.world : nullptr),
        embedding_(groups.embedding && groups.embedding->size() > 1 ? groups.embedding : nullptr),
        cfg_(cfg) {
    cfg.validate();
    if constexpr (requires { model.tensor_parallel(); }) tp_ = model.tensor_parallel();
    LLMPAR_CHECK(!tp_.split() || world_ != nullptr, "the model is split over ", tp_.size(),
                 " tensor-parallel ranks, but the data-parallel strategy was given no world group; pass "
                 "parallel::Groups::of(grid) (the global gradient norm is summed over every rank)");
    if (dp_ && !Space::kHostAccessible)
      LLMPAR_CHECK(dp_->engine_name() == std::string_view("nccl"), "the ", Backend::kName,
                   " backend keeps gradients in device memory, which the ", dp_->engine_name(),
                   " communicator cannot read; launch the ranks with mpirun on a build with NCCL");
#if defined(LLMPAR_WITH_MPI)
    // The communication thread calls MPI while the compute thread may too (tensor
    // parallelism's collectives): that needs MPI_THREAD_MULTIPLE.
    if (dp_ && cfg.overlap && dp_->engine_name() == std::string_view("mpi")) {
      int level = MPI_THREAD_SINGLE;
      MPI_Query_thread(&level);
      LLMPAR_CHECK(level == MPI_THREAD_MULTIPLE,
                   "overlapping the data-parallel reduction with backward calls MPI from a communication thread, "
                   "but this MPI library provides only ",
                   comm::detail::mpi::thread_level_name(level),
                   "; use an MPI built with MPI_THREAD_MULTIPLE, or reduce after backward (DataConfig::overlap = "
                   "false, train_gpt --no-overlap)");
    }
#endif
    if constexpr (requires { model.tied_copy(); }) tied_copy_ = model.tied_copy();
    const int pp = groups.pp ? groups.pp->size() : 1;
    LLMPAR_CHECK(kStage < 2 || pp == 1, "ZeRO stage ", kStage, " with a pipeline of ", pp,
                 " stages: stages 2 and 3 reduce (and gather) every micro-batch's gradients per unit, which a "
                 "pipeline interleaves across micro-batches (DeepSpeed and Megatron-LM do not combine them either); "
                 "use ZeRO stage 1 (--zero 1) with pipeline parallelism");
    LLMPAR_CHECK(!(pp > 1 && !world_), "a pipeline of ", pp,
                 " stages needs the world group for the gradient norm; pass parallel::Groups::of(grid)");
    dp_size_ = dp_ ? dp_->size() : 1;
    dp_rank_ = dp_ ? dp_->rank() : 0;
    plan_layout();
    if constexpr (detail::HasUnits<Model>) model.set_unit_hooks(this);
  }
  ~GradSync() override {
    if constexpr (detail::HasUnits<Model>) model_.set_unit_hooks(nullptr);
  }
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // ---- a step: begin_step, then per micro-batch begin_micro_batch + forward/backward,
  // then finish, gradient_norm, the optimizer's update (or a skip) and after_update.

  // Zeroes the gradients this rank accumulates and starts a step.
  void begin_step() {
    if constexpr (kShardedGrads)
      Backend::zero(ctx_, shard_grads_.data(), shard_grads_.size());
    else
      Backend::zero(ctx_, store_.grads(), store_.flat_size());
    in_step_ = true;
    comm_wait_ = 0.0;
    trace_cursor_ = 0;
    prefetch_ok_ = !trace_recording_;
  }
  // Before a micro-batch's forward; `last`: the last of the step (stages 0 and 1 reduce
  // only then).
  void begin_micro_batch(bool last) {
    reduce_now_ = kShardedGrads || last;
    for (Bucket& b : buckets_) {
      b.pending = b.units;
      b.issued = false;
      b.grad_slot = -1;
    }
  }
  // After each micro-batch's backward: the buckets not issued yet (without overlap, or
  // a model that calls no hooks) are issued now.
  void end_micro_batch() {
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (!buckets_[b].issued) issue(static_cast<int>(b));
  }
  // After a pipeline's whole schedule (stages 0 and 1; the micro-batches of a pipeline
  // interleave, so nothing was reduced during backward): the tied token table's
  // gradient summed over the embedding group (the first and last stage), then every
  // bucket reduced. Sums commute, so summing before the dp reduction is the same.
  void reduce_after_pipeline() {
    if (embedding_) {
      if constexpr (requires { model_.token_table(); }) {
        const nn::Parameter<T>* table = model_.token_table();
        LLMPAR_CHECK(table != nullptr, "this rank is in the embedding group but holds no token table");
        Backend::synchronize(ctx_);
        const auto t0 = std::chrono::steady_clock::now();
        embedding_->all_reduce(std::span<Grad>(table->grad, static_cast<std::size_t>(table->numel())),
                               comm::ReduceOp::sum);
        comm_wait_ += seconds_since(t0);
      }
    }
    begin_micro_batch(true);
    end_micro_batch();
  }
  // After the last micro-batch: every bucket reduced, the sequence-parallel norm
  // gradients summed over the group. The gradients this rank owns are then final.
  void finish() {
    wait_all();
    sum_sequence_parallel();
    in_step_ = false;
    if (trace_recording_ && !trace_.empty()) trace_recording_ = false;  // the first step's gathers are the order
  }
  // The global norm of the unscaled gradient (stored gradients times inv_loss_scale)
  // over every rank, each element counted once, and whether every rank's gradients are
  // finite.
  optim::GradNorm gradient_norm(float inv_loss_scale = 1.0f) {
    double counted = 0.0, all = 0.0;
    for (const Piece& p : owned_) {
      const double s = Backend::sum_of_squares(ctx_, p.grad, p.n);
      if (p.counted) counted += s;
      all += s;
    }
    // Stage 0: every rank updates every parameter from the gradients it holds, so all of
    // them must be finite on this rank, not only its block.
    if constexpr (kStage == 0) all = Backend::sum_of_squares(ctx_, store_.grads(), store_.flat_size());
    std::array<float, 2> parts{static_cast<float>(counted), std::isfinite(all) ? 0.0f : 1.0f};
    if (world_) world_->all_reduce(parts, comm::ReduceOp::sum);
    const double inv = inv_loss_scale;
    const double squares = static_cast<double>(parts[0]) * inv * inv;
    return {std::sqrt(squares), parts[1] == 0.0f && std::isfinite(squares)};
  }
  // After the optimizer's update (or a checkpoint's restore of this rank's blocks):
  // stages 1 and 2 all-gather each bucket's updated values; stage 3 forgets its gathered
  // values, which are now stale.
  void after_update() {
    if constexpr (kShardedValues) {
      wait_all();
      for (Slot& s : value_slots_) {
        s.bucket = -1;
        s.ticket = 0;
      }
      std::fill(resident_.begin(), resident_.end(), -1);
    }
    gather_values();
  }

  // The segments this rank's optimizer updates: the whole store at stage 0, block r of
  // every bucket from stage 1.
  std::vector<Segment> optimizer_shard() {
    if constexpr (kStage == 0) return optim::whole_store(store_);
    std::vector<Segment> out;
    for (const Piece& p : owned_) out.push_back({p.value, p.grad, p.n, p.param->decay, p.param->lr_scale});
    return out;
  }

  // A part of a parameter whose optimizer state this rank holds: elements [first, first
  // + n) of the parameter's local tensor, their values (Space memory), and where their
  // state sits in the optimizer's arrays (segment after segment, optimizer_shard()'s
  // order).
  struct StatePiece {
    nn::Parameter<T>* param = nullptr;
    std::int64_t first = 0, n = 0;
    T* value = nullptr;
    std::int64_t state_offset = 0;
  };
  // Every part whose state this rank holds (what restoring a checkpoint fills): the
  // whole store at stage 0, block r of every bucket from stage 1.
  std::vector<StatePiece> held_state() const {
    std::vector<StatePiece> out;
    std::int64_t at = 0;
    if constexpr (kStage == 0) {
      for (nn::Parameter<T>* p : store_.parameters()) {
        out.push_back({p, 0, p->numel(), p->value, at});
        at += p->numel();
      }
    } else {
      for (const Piece& p : owned_) {
        out.push_back({p.param, p.first, p.n, p.value, at});
        at += p.n;
      }
    }
    return out;
  }
  // The parts this rank writes to a checkpoint, so that the world writes every element
  // of the model once: block r of every bucket (at stage 0 too, whose replicas share the
  // writing), tensor-split parameters from every tp rank and replicated ones from tp
  // rank 0, the last pipeline stage's copy of the tied token table never.
  std::vector<StatePiece> saved_state() const {
    std::vector<StatePiece> out;
    std::unordered_map<const nn::Parameter<T>*, std::int64_t> base;  // stage 0: a parameter's state offset
    if constexpr (kStage == 0) {
      std::int64_t at = 0;
      for (nn::Parameter<T>* p : store_.parameters()) {
        base[p] = at;
        at += p->numel();
      }
    }
    std::int64_t at = 0;
    for (const Piece& p : owned_) {
      const std::int64_t offset = kStage == 0 ? base.at(p.param) + p.first : at;
      at += p.n;
      if (p.counted) out.push_back({p.param, p.first, p.n, p.value, offset});
    }
    return out;
  }
  // Calls f(parameter, first, grad, value, n) for every part of a parameter whose
  // reduced gradient this rank holds after finish(): elements [first, first + n) of the
  // parameter's local tensor, their gradients and current values (Space memory).
  template <class F>
  void for_each_owned(F&& f) const {
    if constexpr (kStage == 0) {
      for (nn::Parameter<T>* p : store_.parameters()) f(*p, std::int64_t{0}, p->grad, p->value, p->numel());
    } else {
      for (const Piece& p : owned_) f(*p.param, p.first, p.grad, p.value, p.n);
    }
  }

  // Bytes per rank of what data parallelism keeps (parameters, gradients, buffers);
  // the caller adds the optimizer's and the model's activations.
  MemoryReport memory() const {
    MemoryReport r;
    r.parameters = store_.value_bytes() + shard_values_.bytes();
    r.gradients = store_.grad_bytes() + shard_grads_.bytes();
    r.communication = staging_.bytes() + sp_staging_.bytes();
    for (const Slot& s : grad_slots_) r.communication += s.grads.bytes();
    for (const Slot& s : value_slots_) r.communication += s.values.bytes();
    return r;
  }

  // Seconds the compute thread waited for communication since begin_step (exposed
  // communication: what overlap did not hide).
  double exposed_communication_seconds() const { return comm_wait_; }
  std::span<const TraceEvent> trace() const { return events_; }
  void clear_trace() { events_.clear(); }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  int dp_size() const { return dp_size_; }
  comm::Comm* dp() const { return dp_; }
  // The most units whose values were whole at once (stage 3).
  int max_gathered_units() const { return max_live_; }

  // ---- nn::UnitHooks: the model calls these around each unit.
  void before_forward(int unit) override {
    if constexpr (kShardedValues) acquire_values(unit_bucket_[static_cast<std::size_t>(unit)]);
  }
  void after_forward(int unit) override {
    if constexpr (kShardedValues) release_values(unit_bucket_[static_cast<std::size_t>(unit)]);
  }
  void before_backward(int unit) override {
    const int b = unit_bucket_[static_cast<std::size_t>(unit)];
    if constexpr (kShardedValues) acquire_values(b);
    if constexpr (kShardedGrads) bind_grads(b);
  }
  void after_backward(int unit) override {
    const int b = unit_bucket_[static_cast<std::size_t>(unit)];
    if (cfg_.trace) record({TraceEvent::Kind::backward_done, unit});
    if constexpr (kShardedValues) release_values(b);
    if (!reduce_now_ || !in_step_) return;
    Bucket& bucket = buckets_[static_cast<std::size_t>(b)];
    if (--bucket.pending == 0 && cfg_.overlap) issue(b);
  }

 private:
  // A contiguous range of the flat buffers holding whole units (backward order).
  struct Bucket {
    std::int64_t begin = 0, end = 0, chunk = 0;  // chunk: (end - begin) / dp, one rank's block
    std::int64_t shard_offset = 0;               // where this rank's block sits in its shard buffers
    std::vector<int> params;                     // parameter indices (store order)
    int units = 0, pending = 0;
    bool issued = false;
    int grad_slot = -1;  // stages 2, 3: the pooled gradient buffer bound to it this micro-batch
    std::int64_t size() const { return end - begin; }
  };
  // Part of a parameter in this rank's block of a bucket.
  struct Piece {
    nn::Parameter<T>* param = nullptr;
    std::int64_t first = 0, n = 0;  // elements [first, first + n) of the parameter
    Grad* grad = nullptr;           // its reduced gradient (store or shard)
    T* value = nullptr;             // its value (store or shard)
    bool counted = true;            // counted in the global norm by this rank
  };
  using Ticket = detail::CommThread::Ticket;
  struct Slot {
    Buffer<T, Space> values;
    Buffer<Grad, Space> grads;
    int bucket = -1;
    bool in_use = false;
    Ticket ticket = 0;  // the reduction or gather that still uses it (0: none)
    std::uint64_t last_use = 0;
  };

  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void record(TraceEvent e) {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    events_.push_back(e);
  }

  // Stages 1 and 2: every rank's block of every bucket's values all-gathered into the
  // store (after the optimizer's update, or after a checkpoint filled this rank's block).
  void gather_values() {
    if constexpr (kStage == 1 || kStage == 2) {
      if (!dp_) return;
      Backend::synchronize(ctx_);
      const auto t0 = std::chrono::steady_clock::now();
      for (const Bucket& b : buckets_) {
        T* base = store_.values() + b.begin;
        dp_->all_gather(std::span<const T>(base + dp_rank_ * b.chunk, static_cast<std::size_t>(b.chunk)),
                        std::span<T>(base, static_cast<std::size_t>(b.size())));
      }
      comm_wait_ += seconds_since(t0);
    }
  }

  // Lays the store out unit by unit in backward order, cuts buckets, and builds the
  // shards.
  void plan_layout() {
    const auto params = store_.parameters();
    std::unordered_map<const nn::Parameter<T>*, int> index;
    for (std::size_t k = 0; k < params.size(); ++k) index[params[k]] = static_cast<int>(k);
    // Units in forward order, each a list of parameter indices.
    std::vector<std::vector<int>> units;
    if constexpr (detail::HasUnits<Model>) {
      units.resize(static_cast<std::size_t>(model_.num_units()));
      for (int u = 0; u < model_.num_units(); ++u)
        model_.unit_parameters(
            u, [&](nn::Parameter<T>& p) { units[static_cast<std::size_t>(u)].push_back(index.at(&p)); });
    } else {
      units.emplace_back();
      for (std::size_t k = 0; k < params.size(); ++k) units[0].push_back(static_cast<int>(k));
    }
    std::size_t covered = 0;
    for (const auto& u : units) covered += u.size();
    LLMPAR_CHECK(covered == params.size(), "the model's units hold ", covered, " parameters but the model has ",
                 params.size(), "; every parameter must belong to exactly one unit");

    constexpr std::int64_t kAlign = static_cast<std::int64_t>(kHostAlignment / sizeof(T));
    const std::int64_t bucket_elements =
        std::max<std::int64_t>(1, cfg_.bucket_bytes / static_cast<std::int64_t>(sizeof(Grad)));
    auto round = [](std::int64_t n, std::int64_t to) { return (n + to - 1) / to * to; };
    typename nn::ParameterStore<T, Space>::Layout layout;
    layout.offsets.assign(params.size(), 0);
    unit_bucket_.assign(units.size(), 0);
    std::int64_t offset = 0;
    Bucket current;
    auto close = [&] {
      current.end = current.begin + round(std::max<std::int64_t>(offset - current.begin, 1), kAlign * dp_size_);
      current.chunk = current.size() / dp_size_;
      offset = current.end;
      buckets_.push_back(std::move(current));
      current = Bucket{};
      current.begin = offset;
    };
    for (int u = static_cast<int>(units.size()) - 1; u >= 0; --u) {
      for (int k : units[static_cast<std::size_t>(u)]) {
        layout.offsets[static_cast<std::size_t>(k)] = offset;
        offset += round(params[static_cast<std::size_t>(k)]->numel(), kAlign);
        current.params.push_back(k);
      }
      unit_bucket_[static_cast<std::size_t>(u)] = static_cast<int>(buckets_.size());
      ++current.units;
      if (kShardedValues || u == 0 || offset - current.begin >= bucket_elements) close();
    }
    layout.size = offset;
    layout.values = !kShardedValues;
    layout.grads = !kShardedGrads;
    offsets_ = layout.offsets;
    store_.relayout(layout);

    // This rank's block of every bucket, as pieces of parameters.
    std::int64_t shard = 0;
    for (Bucket& b : buckets_) {
      b.shard_offset = shard;
      shard += b.chunk;
      max_bucket_ = std::max(max_bucket_, b.size());
    }
    if constexpr (kShardedGrads) {
      shard_grads_.resize(shard);
      shard_grads_.zero();
      staging_.resize(dp_ ? max_bucket_ / dp_size_ : 0);
    }
    if constexpr (kShardedValues) {
      shard_values_.resize(shard);
      shard_values_.zero();
    }
    for (const Bucket& b : buckets_) {
      const std::int64_t lo = b.begin + dp_rank_ * b.chunk, hi = lo + b.chunk;
      for (int k : b.params) {
        nn::Parameter<T>* p = params[static_cast<std::size_t>(k)];
        const std::int64_t pb = offsets_[static_cast<std::size_t>(k)], pe = pb + p->numel();
        const std::int64_t x0 = std::max(lo, pb), x1 = std::min(hi, pe);
        if (x0 >= x1) continue;
        Piece piece;
        piece.param = p;
        piece.first = x0 - pb;
        piece.n = x1 - x0;
        piece.grad = kShardedGrads ? shard_grads_.data() + b.shard_offset + (x0 - lo) : store_.grads() + x0;
        piece.value = kShardedValues ? shard_values_.data() + b.shard_offset + (x0 - lo) : store_.values() + x0;
        // Tensor-split parameters on every tp rank, replicated ones on tp rank 0; the
        // last pipeline stage's copy of the tied token table not at all (the first
        // stage's counts it).
        piece.counted = (p->split.is_split() || tp_.rank() == 0) && p != tied_copy_;
        if constexpr (kShardedValues)
          Space::copy(piece.value, store_.old_value(static_cast<std::size_t>(k)) + piece.first, piece.n);
        owned_.push_back(piece);
      }
    }
    if constexpr (kShardedValues) store_.release_old_values();
    // Sequence-parallel norms: the elements this rank owns, packed for one all-reduce.
    std::int64_t sp = 0;
    if (tp_.sequence_parallel()) {
      if constexpr (kStage == 0) {
        for (nn::Parameter<T>* p : params)
          if (p->sequence_parallel) sp_pieces_.push_back({p, 0, p->numel(), p->grad, p->value, true});
      } else {
        for (const Piece& piece : owned_)
          if (piece.param->sequence_parallel) sp_pieces_.push_back(piece);
      }
      for (const Piece& piece : sp_pieces_) sp += piece.n;
      sp_staging_.resize(sp);
    }
  }

  // Queues bucket b's reduction (stage 0: all-reduce; 1: reduce-scatter in place; 2, 3:
  // reduce-scatter of its pooled buffer, added into the shard).
  void issue(int b) {
    Bucket& bucket = buckets_[static_cast<std::size_t>(b)];
    bucket.issued = true;
    if (!reduce_now_ && !kShardedGrads) return;
    if (cfg_.trace) record({TraceEvent::Kind::issued, b});
    Backend::synchronize(ctx_);   // the reduction reads what the kernels wrote
    const Grad* whole = nullptr;  // stages 2, 3: the pooled gradients bound this micro-batch
    if constexpr (kShardedGrads) {
      LLMPAR_CHECK(bucket.grad_slot >= 0, "ZeRO stage ", kStage, ": bucket ", b,
                   " reached its reduction without a gradient buffer; the model must call before_backward for "
                   "every unit it runs backward through");
      whole = grad_slots_[static_cast<std::size_t>(bucket.grad_slot)].grads.data();
    }
    auto task = [this, b, whole] {
      reduce_bucket(buckets_[static_cast<std::size_t>(b)], whole);
      if (cfg_.trace) record({TraceEvent::Kind::reduced, b});
    };
    Ticket t = 0;
    if (dp_ && cfg_.overlap) {
      t = comm_thread().submit(task);
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      task();  // on the compute thread: all of it is exposed
      comm_wait_ += seconds_since(t0);
    }
    if constexpr (kShardedGrads) {
      if (bucket.grad_slot >= 0) {
        grad_slots_[static_cast<std::size_t>(bucket.grad_slot)].ticket = t;
        grad_slots_[static_cast<std::size_t>(bucket.grad_slot)].in_use = false;  // free once t is done
        bucket.grad_slot = -1;
      }
    }
  }

  void reduce_bucket(const Bucket& b, [[maybe_unused]] const Grad* whole) {
    if constexpr (kStage == 0) {
      if (dp_)
        dp_->all_reduce(std::span<Grad>(store_.grads() + b.begin, static_cast<std::size_t>(b.size())),
                        comm::ReduceOp::avg);
    } else if constexpr (kStage == 1) {
      if (dp_) {
        Grad* base = store_.grads() + b.begin;
        dp_->reduce_scatter(std::span<const Grad>(base, static_cast<std::size_t>(b.size())),
                            std::span<Grad>(base + dp_rank_ * b.chunk, static_cast<std::size_t>(b.chunk)),
                            comm::ReduceOp::avg);
      }
    } else {
      Grad* shard = shard_grads_.data() + b.shard_offset;
      if (dp_) {
        dp_->reduce_scatter(std::span<const Grad>(whole, static_cast<std::size_t>(b.size())),
                            std::span<Grad>(staging_.data(), static_cast<std::size_t>(b.chunk)), comm::ReduceOp::avg);
        add_into(shard, staging_.data(), b.chunk);
      } else {
        add_into(shard, whole, b.chunk);
      }
    }
  }
  // shard += x (n), on the communication thread.
  void add_into(Grad* shard, const Grad* x, std::int64_t n) {
    if constexpr (Space::kHostAccessible) {
      for (std::int64_t i = 0; i < n; ++i) shard[i] += x[i];
    } else {
      Backend::add_inplace(ctx_, shard, x, n);
      Backend::synchronize(ctx_);
    }
  }

  // Stages 2, 3: binds a zeroed pooled buffer to bucket b's gradients for this micro-batch.
  void bind_grads(int b) {
    Bucket& bucket = buckets_[static_cast<std::size_t>(b)];
    if (bucket.grad_slot >= 0) return;
    const int s = take_slot(grad_slots_, [](Slot& slot, std::int64_t n) { slot.grads.resize(n); });
    Slot& slot = grad_slots_[static_cast<std::size_t>(s)];
    slot.in_use = true;
    slot.bucket = b;
    bucket.grad_slot = s;
    Backend::zero(ctx_, slot.grads.data(), bucket.size());
    for (int k : bucket.params) {
      nn::Parameter<T>* p = store_.parameters()[static_cast<std::size_t>(k)];
      p->grad = slot.grads.data() + (offsets_[static_cast<std::size_t>(k)] - bucket.begin);
    }
  }

  // A slot that is free (not in use, its last reduction or gather done), else a new one
  // of the largest bucket's size.
  template <class Alloc>
  int take_slot(std::vector<Slot>& slots, Alloc alloc, int avoid = -1) {
    int best = -1;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      Slot& s = slots[i];
      if (s.in_use || static_cast<int>(i) == avoid || (s.ticket != 0 && !comm_thread().done(s.ticket))) continue;
      if (best < 0 || s.last_use < slots[static_cast<std::size_t>(best)].last_use) best = static_cast<int>(i);
    }
    if (best >= 0) {
      Slot& s = slots[static_cast<std::size_t>(best)];
      if (s.bucket >= 0 && &slots == &value_slots_) resident_[static_cast<std::size_t>(s.bucket)] = -1;
      s.bucket = -1;
      return best;
    }
    slots.emplace_back();
    alloc(slots.back(), max_bucket_);
    return static_cast<int>(slots.size()) - 1;
  }

  // Stage 3: bucket b's values whole in a slot and bound to its parameters; prefetches
  // the next bucket of the recorded order.
  void acquire_values(int b) {
    if (resident_.empty()) resident_.assign(buckets_.size(), -1);
    int s = resident_[static_cast<std::size_t>(b)];
    if (s < 0) s = gather(b);
    Slot& slot = value_slots_[static_cast<std::size_t>(s)];
    if (slot.ticket != 0) {
      const auto t0 = std::chrono::steady_clock::now();
      comm_thread().wait(slot.ticket);
      comm_wait_ += seconds_since(t0);
      slot.ticket = 0;
    }
    if (!slot.in_use) ++live_;
    max_live_ = std::max(max_live_, live_);
    slot.in_use = true;
    slot.last_use = ++clock_;
    const Bucket& bucket = buckets_[static_cast<std::size_t>(b)];
    for (int k : bucket.params) {
      nn::Parameter<T>* p = store_.parameters()[static_cast<std::size_t>(k)];
      p->value = slot.values.data() + (offsets_[static_cast<std::size_t>(k)] - bucket.begin);
    }
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
  void release_values(int b) {
    if (resident_.empty()) return;
    const int s = resident_[static_cast<std::size_t>(b)];
    if (s < 0) return;
    Slot& slot = value_slots_[static_cast<std::size_t>(s)];
    if (slot.in_use) --live_;
    slot.in_use = false;
  }
  // Queues the all-gather of bucket b's values into a slot (not `avoid`); returns it.
  int gather(int b, int avoid = -1) {
    const int s = take_slot(
        value_slots_, [](Slot& slot, std::int64_t n) { slot.values.resize(n); }, avoid);
    Slot& slot = value_slots_[static_cast<std::size_t>(s)];
    slot.bucket = b;
    resident_[static_cast<std::size_t>(b)] = s;
    const Bucket& bucket = buckets_[static_cast<std::size_t>(b)];
    T* whole = slot.values.data();
    const T* mine = shard_values_.data() + bucket.shard_offset;
    Backend::synchronize(ctx_);  // the optimizer's last writes to the shard
    auto task = [this, b, whole, mine] {
      const Bucket& bk = buckets_[static_cast<std::size_t>(b)];
      if (dp_)
        dp_->all_gather(std::span<const T>(mine, static_cast<std::size_t>(bk.chunk)),
                        std::span<T>(whole, static_cast<std::size_t>(bk.size())));
      else
        Space::copy(whole, mine, bk.size());
      if (cfg_.trace) record({TraceEvent::Kind::gathered, b});
    };
    if (dp_ && cfg_.overlap) {
      slot.ticket = comm_thread().submit(task);
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      task();
      comm_wait_ += seconds_since(t0);
      slot.ticket = 0;
    }
    return s;
  }

  void wait_all() {
    if (!comm_thread_) return;
    const auto t0 = std::chrono::steady_clock::now();
    comm_thread_->drain();
    comm_wait_ += seconds_since(t0);
  }

  void sum_sequence_parallel() {
    if (sp_pieces_.empty()) return;
    Backend::synchronize(ctx_);
    std::int64_t at = 0;
    for (const Piece& p : sp_pieces_) {
      Backend::copy(ctx_, sp_staging_.data() + at, p.grad, p.n);
      at += p.n;
    }
    Backend::synchronize(ctx_);
    tp_.all_reduce(sp_staging_.data(), sp_staging_.size());
    at = 0;
    for (const Piece& p : sp_pieces_) {
      Backend::copy(ctx_, p.grad, sp_staging_.data() + at, p.n);
      at += p.n;
    }
  }

  detail::CommThread& comm_thread() {
    if (!comm_thread_) comm_thread_ = std::make_unique<detail::CommThread>();
    return *comm_thread_;
  }

  Context& ctx_;
  Model& model_;
  nn::ParameterStore<T, Space>& store_;
  comm::Comm* dp_;
  comm::Comm* world_;
  comm::Comm* embedding_;
  nn::TensorParallelGroup tp_;
  DataConfig cfg_;
  int dp_size_ = 1, dp_rank_ = 0;

  std::vector<Bucket> buckets_;
  std::vector<int> unit_bucket_;
  std::vector<std::int64_t> offsets_;  // per parameter (store order)
  std::int64_t max_bucket_ = 0;
  std::vector<Piece> owned_, sp_pieces_;
  const nn::Parameter<T>* tied_copy_ = nullptr;  // the last pipeline stage's copy of the token table

  Buffer<Grad, Space> shard_grads_;  // stages 2, 3: this rank's reduced gradients
  Buffer<T, Space> shard_values_;    // stage 3: this rank's parameter values
  Buffer<Grad, Space> staging_;      // stages 2, 3: one block's reduce-scatter result
  Buffer<Grad, Space> sp_staging_;   // sequence-parallel norm gradients, packed
  std::vector<Slot> grad_slots_;     // stages 2, 3: pooled bucket gradients
  std::vector<Slot> value_slots_;    // stage 3: pooled gathered values
  std::vector<int> resident_;        // stage 3: bucket -> its value slot, or -1
  std::vector<int> trace_;           // stage 3: the order of gathers the first step recorded
  std::size_t trace_cursor_ = 0;
  bool trace_recording_ = true, prefetch_ok_ = false;
  int live_ = 0, max_live_ = 0;
  std::uint64_t clock_ = 0;

  bool in_step_ = false, reduce_now_ = true;
  double comm_wait_ = 0.0;
  std::unique_ptr<detail::CommThread> comm_thread_;
  std::mutex trace_mutex_;
  std::vector<TraceEvent> events_;
};

}  // namespace llmpar::parallel
