// llmpar/parallel/grad_sync.hpp — data parallelism and ZeRO stages 0 to 3: the one owner
// of gradient communication, composed of parts with one job each (Megatron-Core's split):
//
//   GradBuffer     the parameters laid out in backward order, cut into buckets, and this
//                  rank's ZeRO shard of them (grad_buffer.hpp);
//   BucketReducer  each bucket's all-reduce or reduce-scatter, started as backward
//                  completes it, on the communication thread (bucket_reducer.hpp);
//   ParamGatherer  ZeRO 3's gather of a unit's values before it runs, the next one
//                  prefetched; stages 1 and 2's gather after the update (param_gatherer.hpp);
//   Finalizer      the tied table's and the sequence-parallel norms' sums, and the one
//                  global gradient norm with the overflow verdict (finalize.hpp).
//
// GradSync<Model, kStage> builds them over one CommThread (comm_thread.hpp: one order of
// collectives on the dp communicator on every rank), is the model's unit hooks
// (nn/units.hpp) and hands each event to the part it concerns. A step:
//
//   begin_step(); per micro-batch: begin_micro_batch(last), forward/backward (the hooks),
//   end_micro_batch(); [a pipeline: reduce_after_pipeline()]; finish(); gradient_norm();
//   the optimizer's update (or a skip); after_update().
//
// Stage 0 all-reduces buckets and every rank updates everything; 1 reduce-scatters and
// each rank's optimizer holds its block of every bucket (optimizer_shard()); 2 keeps only
// that block of the gradients; 3 of the values too. Memory is reported from the buffers
// themselves (memory()).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "llmpar/comm/init.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/nn/model.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/nn/units.hpp"
#include "llmpar/optim/adamw.hpp"
#include "llmpar/parallel/bucket_reducer.hpp"
#include "llmpar/parallel/comm_thread.hpp"
#include "llmpar/parallel/finalize.hpp"
#include "llmpar/parallel/grad_buffer.hpp"
#include "llmpar/parallel/layout.hpp"
#include "llmpar/parallel/param_gatherer.hpp"

namespace llmpar::parallel {

// The groups a training step communicates over: the replicas of this model that read
// other data (dp), every rank (the global norm and the overflow verdict), the pipeline's
// two channels (activations on pp, gradients on pp_grad), the embedding group (the first
// and last pipeline stage: the tied token table's gradient), and under context
// parallelism dp_cp, the ranks that hold the same parameters (dp x cp: the gradients
// are averaged, and ZeRO shards, over it). Null: this rank alone.
struct Groups {
  comm::Comm* dp = nullptr;
  comm::Comm* world = nullptr;
  comm::Comm* pp = nullptr;
  comm::Comm* pp_grad = nullptr;
  comm::Comm* embedding = nullptr;
  comm::Comm* dp_cp = nullptr;  // set when the grid's cp > 1

  template <class Grid>
  static Groups of(Grid& grid) {
    return {&grid.dp(),      &grid.world(),     &grid.pp(),
            &grid.pp_grad(), &grid.embedding(), grid.cp().size() > 1 ? &grid.dp_cp() : nullptr};
  }
  // The ranks whose gradients are averaged: dp, or dp x cp.
  comm::Comm* replicas() const { return dp_cp ? dp_cp : dp; }
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

template <class Model, int kStage>
class GradSync final : public nn::UnitHooks {
 public:
  using T = typename Model::value_type;
  using Backend = typename Model::BackendTag;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Grad = acc_t<T>;
  using Segment = optim::Segment<T>;
  using StatePiece = typename GradBuffer<Model, kStage>::StatePiece;
  static_assert(kStage >= 0 && kStage <= 3, "llmpar::parallel::GradSync: the ZeRO stage is 0, 1, 2 or 3");
  static_assert(nn::check_model<Model>());

  GradSync(Context& ctx, Model& model, Groups groups, const DataConfig& cfg)
      : model_(model),
        dp_(checked_dp(model, groups, cfg)),
        cfg_(cfg),
        buffer_(model, model.tensor_parallel(), dp_ ? dp_->size() : 1, dp_ ? dp_->rank() : 0, cfg.bucket_bytes),
        reducer_(ctx, buffer_, dp_, thread_, cfg),
        gatherer_(ctx, buffer_, dp_, thread_, cfg),
        finalizer_(ctx, model, buffer_, model.tensor_parallel(), single(groups.world),
                   ties_head(model) ? single(groups.embedding) : nullptr, thread_) {
    model.set_unit_hooks(this);
  }
  ~GradSync() override { model_.set_unit_hooks(nullptr); }
  // Whether the model's LM head is its token table (then the first and last pipeline
  // stage each hold it, and its gradient is summed between them), as it is unless the
  // model says otherwise (models::Transformer::ties_head).
  static bool ties_head(const Model& m) {
    if constexpr (requires { m.ties_head(); })
      return m.ties_head();
    else
      return true;
  }
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // ---- a step.

  // Zeroes the gradients this rank accumulates and starts a step.
  void begin_step() {
    reducer_.begin_step();
    gatherer_.begin_step();
    thread_.reset_exposed();
  }
  // Before a micro-batch's forward; `last`: the last of the step (stages 0 and 1 reduce
  // only then).
  void begin_micro_batch(bool last) { reducer_.begin_micro_batch(last); }
  // After each micro-batch's backward: the buckets not issued yet are issued now.
  void end_micro_batch() { reducer_.end_micro_batch(); }
  // After a pipeline's whole schedule (stages 0 and 1; the micro-batches of a pipeline
  // interleave, so nothing was reduced during backward): the tied token table's
  // gradient summed over the embedding group (the first and last stage), then every
  // bucket reduced. Sums commute, so summing before the dp reduction is the same.
  void reduce_after_pipeline() {
    finalizer_.sum_tied_table();
    reducer_.begin_micro_batch(true);
    reducer_.end_micro_batch();
  }
  // After the last micro-batch: every bucket reduced, the sequence-parallel norm
  // gradients summed over the group. The gradients this rank owns are then final.
  void finish() {
    reducer_.wait_all();
    finalizer_.sum_sequence_parallel();
    reducer_.end_step();
    gatherer_.end_step();
  }
  // The global norm of the unscaled gradient (stored gradients times inv_loss_scale)
  // over every rank, each element counted once, and whether every rank's gradients are
  // finite.
  optim::GradNorm gradient_norm(float inv_loss_scale = 1.0f) { return finalizer_.gradient_norm(inv_loss_scale); }
  // After the optimizer's update (or a checkpoint's restore of this rank's blocks):
  // stages 1 and 2 all-gather each bucket's updated values; stage 3 forgets its gathered
  // values, which are now stale.
  void after_update() { gatherer_.after_update(); }

  // ---- what this rank owns (the gradient buffer's).

  // The segments this rank's optimizer updates: the whole store at stage 0, block r of
  // every bucket from stage 1.
  std::vector<Segment> optimizer_shard() { return buffer_.optimizer_shard(); }
  // Every part whose optimizer state this rank holds (what restoring a checkpoint fills).
  std::vector<StatePiece> held_state() const { return buffer_.held_state(); }
  // The parts this rank writes to a checkpoint (the world writes every element once).
  std::vector<StatePiece> saved_state() const { return buffer_.saved_state(); }
  // Calls f(parameter, first, grad, value, n) for every part of a parameter whose
  // reduced gradient this rank holds after finish().
  template <class F>
  void for_each_owned(F&& f) const {
    buffer_.for_each_owned(std::forward<F>(f));
  }

  // Bytes per rank of what data parallelism keeps (parameters, gradients, buffers);
  // the caller adds the optimizer's and the model's activations.
  MemoryReport memory() const {
    MemoryReport r;
    r.parameters = buffer_.value_bytes();
    r.gradients = buffer_.grad_bytes();
    r.communication = reducer_.bytes() + gatherer_.bytes() + finalizer_.bytes();
    return r;
  }

  // Seconds the compute thread waited for communication since begin_step (exposed
  // communication: what overlap did not hide).
  double exposed_communication_seconds() const { return thread_.exposed_seconds(); }
  std::span<const TraceEvent> trace() const { return thread_.trace(); }
  void clear_trace() { thread_.clear_trace(); }
  int num_buckets() const { return static_cast<int>(buffer_.buckets().size()); }
  int dp_size() const { return buffer_.dp_size(); }
  comm::Comm* dp() const { return dp_; }
  // The most units whose values were whole at once (stage 3).
  int max_gathered_units() const { return gatherer_.max_gathered_units(); }

  // ---- nn::UnitHooks: the model calls these around each unit.
  void before_forward(int unit) override { gatherer_.before_use(unit); }
  void after_forward(int unit) override { gatherer_.after_use(unit); }
  void before_backward(int unit) override {
    gatherer_.before_use(unit);
    reducer_.before_backward(unit);
  }
  void after_backward(int unit) override {
    if (cfg_.trace) thread_.record({TraceEvent::Kind::backward_done, unit});
    gatherer_.after_use(unit);
    reducer_.after_backward(unit);
  }

 private:
  static comm::Comm* single(comm::Comm* group) { return group && group->size() > 1 ? group : nullptr; }

  // The dp group (null for one replica), once the groups fit the model and the backend.
  static comm::Comm* checked_dp(Model& model, const Groups& groups, const DataConfig& cfg) {
    cfg.validate();
    comm::Comm* dp = single(groups.replicas());
    const nn::TensorParallelGroup tp = model.tensor_parallel();
    LLMPAR_CHECK(!tp.split() || single(groups.world) != nullptr, "the model is split over ", tp.size(),
                 " tensor-parallel ranks, but the data-parallel strategy was given no world group; pass "
                 "parallel::Groups::of(grid) (the global gradient norm is summed over every rank)");
    const int pp = groups.pp ? groups.pp->size() : 1;
    LLMPAR_CHECK(!(pp > 1 && !single(groups.world)), "a pipeline of ", pp,
                 " stages needs the world group for the gradient norm; pass parallel::Groups::of(grid)");
    if (dp && !Space::kHostAccessible)
      LLMPAR_CHECK(dp->engine_name() == std::string_view("nccl"), "the ", Backend::kName,
                   " backend keeps gradients in device memory, which the ", dp->engine_name(),
                   " communicator cannot read; launch the ranks with mpirun on a build with NCCL");
#if defined(LLMPAR_WITH_MPI)
    // The communication thread calls MPI while the compute thread may too (tensor
    // parallelism's collectives): that needs MPI_THREAD_MULTIPLE.
    if (dp && cfg.overlap && dp->engine_name() == std::string_view("mpi")) {
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
    return dp;
  }

  Model& model_;
  comm::Comm* dp_;
  DataConfig cfg_;
  CommThread thread_;  // before the parts that submit to it, destroyed after them
  GradBuffer<Model, kStage> buffer_;
  BucketReducer<Model, kStage> reducer_;
  ParamGatherer<Model, kStage> gatherer_;
  Finalizer<Model, kStage> finalizer_;
};

}  // namespace llmpar::parallel
