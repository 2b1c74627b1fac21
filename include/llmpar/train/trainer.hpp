// llmpar/train/trainer.hpp — the training loop: micro-batches, gradient accumulation,
// loss scaling, clipping, AdamW, the schedule, evaluation, and the numbers a step reports.
//
// The loop is a template over the model and its composed policy, so that any type with
// forward/backward/zero_grad/parameter_store trains; the example trainers and the tests
// drive it the same way. Nothing here is global: the context, the model, the loaders,
// the configs and the communicator are all passed in.
//
// Precision. The policy's precision says what the model stores (Model::value_type must
// be its Compute type: models::GPT2<bf16, B> for BF16Mixed) and which loss scaler runs:
// FP16Mixed's dynamic scaler (precision/loss_scaler.hpp) multiplies each micro-batch's
// loss gradient by the scale, the optimizer takes the norm of the unscaled gradient and
// divides the scale out in its update. Gradients are f32 main grads under every policy.
// The policy defaults to the one the model's type implies (PolicyOf<Model>).
//
// A step whose gradient holds inf/NaN on any rank is skipped on every rank: the
// data-parallel strategy's global norm reduces the verdict over every rank with the
// norm, so all ranks see the same verdict, skip together and keep the same scaler
// state. Without a scaler a skipped step is still reported (StepStats::skipped, the
// metrics log), never applied.
//
// Data parallelism: every gradient collective of a step belongs to the policy's
// parallel::GradSync (parallel/grad_sync.hpp), built from the Grid's groups: the bucketed
// dp reduction overlapped with backward, ZeRO's shards (Policy::kZeroStage), the
// sequence-parallel norm sums, the global norm. The optimizer is built for the rank's
// shard. N dp ranks with micro-batch B compute the run one rank computes with B·N.
//
// Pipeline parallelism and recomputation: every step runs a schedule (pipeline/
// executor.hpp) over the model's chunks: the policy's, or under schedule::Configured the
// one TrainerConfig::schedule names, for p = the model's pipeline stages and m =
// grad_accum micro-batches. Without a pipeline that is the one-stage schedule
// [F0 B0 F1 B1 ...], which lets the data-parallel strategy reduce during the last
// backward; a pipeline's micro-batches interleave, so its gradients are reduced after the
// schedule (the tied embedding summed over the first and last stage first). The loss is
// the last stage's, shared over the pipeline. The recompute policy (or
// TrainerConfig::recompute) is set on the model.
//
// Backends: the model names its backend tag (Model::BackendTag); the trainer takes that
// backend's context and builds that backend's optimizer. On the CUDA backend the
// gradients live on the device, so the dp communicator must be NCCL.
#pragma once

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "llmpar/backend/backend.hpp"
#include "llmpar/backend/cpu/convert.hpp"
#include "llmpar/checkpoint/checkpoint.hpp"
#include "llmpar/checkpoint/trainer_state.hpp"
#include "llmpar/comm/grid.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/nn/model.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/optim/adamw.hpp"
#include "llmpar/optim/schedule.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/parallel/grad_sync.hpp"
#include "llmpar/parallel/layout.hpp"
#include "llmpar/pipeline/executor.hpp"
#include "llmpar/pipeline/schedule.hpp"
#include "llmpar/precision/loss_scaler.hpp"
#include "llmpar/precision/policy.hpp"
#include "llmpar/train/metrics.hpp"
#include "llmpar/train/spike_guard.hpp"

namespace llmpar::train {

// Which of a rank's state a snapshot holds: what it writes to a checkpoint (so that the
// world writes each element of the model once), or all it holds (to roll back to).
enum class SnapshotScope { saved, held };

struct TrainerConfig {
  std::int64_t steps = 100;
  double peak_gflops = 0.0;                          // MFU denominator; 0: MFU n/a
  precision::DynamicLossScale::Config loss_scale{};  // FP16Mixed's scaler (unused otherwise)
  // The layout the run trains at (parallel/layout.hpp). The trainer runs its schedule,
  // chunks, recomputation, accumulation and gradient buckets, and checks that the rest
  // (degrees, sequence parallelism, micro-batch, ZeRO stage, precision) is what the
  // model, the groups, the loader and the policy are: parallel::layout_of<Policy>()
  // starts one from the policy.
  parallel::LayoutConfig layout{};
  // Loss spikes: detected, rolled back to an in-memory snapshot, their data skipped.
  SpikeGuardConfig spike_guard{};

  void validate() const {
    layout.validate();
    spike_guard.validate();
    LLMPAR_CHECK(steps > 0, "steps is ", steps, "; train for at least 1 step");
    LLMPAR_CHECK(peak_gflops >= 0.0, "peak_gflops is ", peak_gflops, "; it must be >= 0");
  }
};

namespace detail {
// The precision a model's storage type implies.
template <class T>
struct PrecisionOf {
  using type = precision::FP32;  // float, and the double models of the tests
};
template <>
struct PrecisionOf<bf16> {
  using type = precision::BF16Mixed;
};
template <>
struct PrecisionOf<f16> {
  using type = precision::FP16Mixed<precision::DynamicLossScale>;
};
}  // namespace detail

namespace detail {
// The model's type names a composed policy (models::GPT2<Policy>).
template <class Model>
concept DeclaresPolicy = ComposedPolicy<typename Model::Policy>;

template <class Model>
struct PolicyOf {
  using type = Compose<typename Model::BackendTag, typename PrecisionOf<typename Model::value_type>::type>;
};
template <DeclaresPolicy Model>
struct PolicyOf<Model> {
  using type = typename Model::Policy;
};
}  // namespace detail

// The policy a model's own type names: the composed policy it was declared with
// (models::GPT2<Policy>), or else its backend and the precision of its storage type
// (everything else default).
template <class Model>
using PolicyOf = typename detail::PolicyOf<Model>::type;

template <class Model, ComposedPolicy Policy = PolicyOf<Model>>
class Trainer {
 public:
  using Backend = typename Model::BackendTag;
  using Context = typename Backend::Context;
  using T = typename Model::value_type;
  using Optimizer = optim::AdamW<T, Backend>;
  using Space = typename Backend::Space;
  using Grad = acc_t<T>;
  using Precision = typename Policy::precision;
  using Scaler = precision::ScalerFor<Precision>;
  using Sync = parallel::GradSync<Model, Policy::kZeroStage>;
  using Executor = pipeline::Executor<nn::core_of_t<Model>>;  // one per model code, whatever the policy
  static_assert(pipeline::check_model<Model>());
  static_assert(std::is_same_v<PolicyOf<Model>, Policy> || !detail::DeclaresPolicy<Model>,
                "llmpar::train::Trainer: the model was declared with another composed policy; name the policy "
                "once, in the model's type (train::Trainer<decltype(model)>)");
  static_assert(std::is_same_v<typename Policy::backend, Backend>,
                "llmpar::train::Trainer: the policy's backend is not the model's; compose the policy with the "
                "model's backend tag (Model::BackendTag)");
  static_assert(std::is_same_v<typename Precision::Compute, T> ||
                    (std::is_same_v<T, double> && std::is_same_v<Precision, precision::FP32>),
                "llmpar::train::Trainer: the model's storage type is not the policy precision's Compute type; "
                "instantiate the model for Policy::precision::Compute (float for precision::FP32, bf16 for "
                "precision::BF16Mixed, f16 for precision::FP16Mixed<...>)");

  // The Grid's groups: every collective of the step runs over them.
  Trainer(Context& ctx, Model& model, const optim::AdamWConfig& opt, const optim::CosineSchedule& schedule,
          data::DataLoader& train, const TrainerConfig& cfg, comm::Grid<comm::Comm>& grid)
      : Trainer(ctx, model, opt, schedule, train, cfg, parallel::Groups::of(grid)) {}
  // `groups`: the Grid's groups (parallel::Groups::of(grid)); empty: this rank alone.
  Trainer(Context& ctx, Model& model, const optim::AdamWConfig& opt, const optim::CosineSchedule& schedule,
          data::DataLoader& train, const TrainerConfig& cfg, parallel::Groups groups = {})
      : ctx_(ctx),
        model_(model),
        executor_(model, make_schedule(model, cfg), shape_of(model, cfg), {groups.pp, groups.pp_grad}),
        sync_(ctx, model, groups, cfg.layout.data),
        optimizer_(ctx, sync_.optimizer_shard(), opt),
        scaler_(scaler_config(cfg)),
        schedule_(schedule),
        train_(train),
        cfg_(cfg),
        replicas_(sync_.dp()),
        data_(groups.dp && groups.dp->size() > 1 ? groups.dp : nullptr),
        pipeline_(groups.pp && groups.pp->size() > 1 ? groups.pp : nullptr) {
    schedule.validate();
    if (cfg.spike_guard.enabled) {
      guard_.emplace(cfg.spike_guard);
      guard_->set_uniform_loss(std::log(static_cast<double>(model.config().vocab)));
    }
    check_layout(cfg.layout, model, train);
    model.set_recompute(recompute_mode(cfg));
    if (data_) {
      LLMPAR_CHECK(train.config().world == data_->size() && train.config().rank == data_->rank(),
                   "the training loader reads as rank ", train.config().rank, " of ", train.config().world,
                   " but the data-parallel group is rank ", data_->rank(), " of ", data_->size(),
                   "; build its LoaderConfig with the dp group's rank and size");
    }
    // The loader draws global batches of every micro-batch of every dp rank of a step.
    const data::LoaderConfig& lc = train.config();
    const std::int64_t per_step = static_cast<std::int64_t>(lc.batch_size) * lc.world * cfg.layout.grad_accum;
    train.set_global_batch(per_step);
  }

  // One optimizer step over grad_accum micro-batches.
  StepStats step() {
    if (guard_ && snapshot_step_ < 0) take_snapshot();
    const auto t0 = std::chrono::steady_clock::now();
    const auto& lc = train_.config();
    const std::int64_t batch = lc.batch_size, seq = lc.seq_len, m = cfg_.layout.grad_accum;
    const float loss_scale = scaler_.scale();
    read_micro_batches(train_, m);
    sync_.begin_step();
    const bool serial = pipeline_ == nullptr;
    typename Executor::Listener listener;
    if (serial) {  // the data-parallel reduction overlaps the last micro-batch's backward
      listener.before_forward = [&](int micro) { sync_.begin_micro_batch(micro == m - 1); };
      listener.after_backward = [&](int) { sync_.end_micro_batch(); };
    } else {
      sync_.begin_micro_batch(false);
    }
    double loss = executor_.run(ctx_, micro_, batch, seq, loss_scale / static_cast<float>(m), listener);
    if (!serial) sync_.reduce_after_pipeline();
    sync_.finish();
    loss = pipeline_sum(loss) / static_cast<double>(m);
    if (replicas_) loss = average(loss);
    if (gradient_hook_) gradient_hook_(model_);
    LLMPAR_CHECK(guard_ || std::isfinite(loss), "the loss is ", loss, " at step ", step_ + 1,
                 "; lower --lr, raise --warmup, or check the data (or let --spike-guard roll back)");
    const float lr = schedule_(step_);
    // The norm and its verdict over every rank.
    const float inv_scale = 1.0f / loss_scale;
    const optim::GradNorm norm = sync_.gradient_norm(inv_scale);
    // Every rank sees the same loss and norm, so every rank decides the same.
    if (guard_) {
      if (const auto spike = guard_->check(loss, norm.norm, Precision::kHasLossScale && !norm.finite))
        return roll_back(*spike, loss, norm.norm, t0);
    }
    const precision::ScaleUpdate verdict = scaler_.update(!norm.finite, step_ + 1);
    if (!verdict.skipped) {
      optimizer_.update(lr, norm, inv_scale);
      sync_.after_update();
      if (guard_) guard_->record(step_ + 1, loss);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    StepStats s;
    s.step = ++step_;
    s.loss = loss;
    s.lr = lr;
    s.grad_norm = norm.norm;
    s.ms = 1e3 * seconds;
    s.loss_scale = loss_scale;
    s.skipped = verdict.skipped;
    s.skipped_total = scaler_.skipped_steps();
    s.comm_ms = 1e3 * sync_.exposed_communication_seconds();
    s.bubble_ms = 1e3 * executor_.idle_seconds();
    const double tokens = static_cast<double>(batch * seq * cfg_.layout.grad_accum * (data_ ? data_->size() : 1));
    s.tokens_per_s = tokens / seconds;
    if (cfg_.peak_gflops > 0.0) {
      const auto& mc = model_.config();
      s.mfu =
          flops_per_token(model_.num_parameters(), mc.layers, mc.dim, seq) * s.tokens_per_s / (cfg_.peak_gflops * 1e9);
    }
    if (guard_ && !verdict.skipped && step_ % cfg_.spike_guard.snapshot_every == 0) take_snapshot();
    if (guard_) s.incident = guard_->closed(s.step, s.step >= cfg_.steps);
    return s;
  }

  // Skips the data of n steps (grad_accum batches each): what a run that never saw them reads next.
  void skip_batches(std::int64_t n) {
    for (std::int64_t i = 0; i < n * cfg_.layout.grad_accum; ++i) static_cast<void>(train_.next());
  }

  // Called once per step after the gradients are complete (reduced over dp, summed over
  // the sequence-parallel group; under ZeRO 2 and 3 only sync().for_each_owned reaches
  // them) and before the norm and the update: to inspect them, or to inject a fault.
  void set_gradient_hook(std::function<void(Model&)> hook) { gradient_hook_ = std::move(hook); }

  // Mean loss over `batches` batches of `loader` (no gradient state is touched).
  double evaluate(data::DataLoader& loader, std::int64_t batches) {
    LLMPAR_CHECK(batches > 0, "evaluation needs at least 1 batch, got ", batches);
    const auto& lc = loader.config();
    read_micro_batches(loader, batches);
    const double sum = pipeline_sum(executor_.evaluate(ctx_, micro_, lc.batch_size, lc.seq_len));
    const double mean = sum / static_cast<double>(batches);
    // Every dp rank read its own batches, every cp rank its chunks of them: the mean of
    // all is the loss of all the batches (a loader of one rank's batches on each: its own).
    return replicas_ && loader.config().world == (data_ ? data_->size() : 1) ? average(mean) : mean;
  }

  // Runs the remaining steps, calling on_step after each.
  void fit(const std::function<void(const StepStats&)>& on_step) {
    while (step_ < cfg_.steps) on_step(step());
  }

  std::int64_t steps_done() const { return step_; }
  // The loss spike guard (empty when TrainerConfig::spike_guard is off).
  const std::optional<SpikeGuard>& spike_guard() const { return guard_; }
  Optimizer& optimizer() { return optimizer_; }
  Sync& sync() { return sync_; }
  // The pipeline schedule's executor: its actions, the last step's timings and idle time,
  // its activation stashes.
  const Executor& executor() const { return executor_; }
  // Bytes per rank: parameters, gradients, optimizer state, activations, buffers.
  parallel::MemoryReport memory() const {
    parallel::MemoryReport r = sync_.memory();
    r.optimizer = optimizer_.state_bytes();
    r.activations = model_.activation_bytes();
    r.activations += executor_.stash_bytes();
    return r;
  }
  const Scaler& loss_scaler() const { return scaler_; }

  // ---- checkpoints (checkpoint/checkpoint.hpp)

  // This rank's parameters (f32 master values) and AdamW moments, copied to host memory,
  // and the trainer's state. Between steps; every rank calls it (no communication).
  checkpoint::Snapshot snapshot(SnapshotScope scope) {
    checkpoint::Snapshot s;
    snapshot(scope, s);
    return s;
  }
  // The same into `s`, reusing its memory (a snapshot taken again and again: no page
  // faults after the first).
  void snapshot(SnapshotScope scope, checkpoint::Snapshot& s) {
    static_assert(std::is_same_v<Grad, float>,
                  "llmpar::train::Trainer: checkpoints store f32 master weights and "
                  "moments; train in fp32, bf16 or fp16");
    Backend::synchronize(ctx_);
    const auto pieces = scope == SnapshotScope::saved ? sync_.saved_state() : sync_.held_state();
    std::int64_t total = 0;
    for (const auto& p : pieces) total += p.n;
    for (auto& d : s.data) d.resize(static_cast<std::size_t>(total));
    s.pieces.clear();
    std::int64_t at = 0;
    for (const auto& p : pieces) {
      s.pieces.push_back({p.param->name, p.param->shape, p.param->split, p.first, p.n});
      const std::size_t bytes = static_cast<std::size_t>(p.n) * sizeof(float);
      if constexpr (Optimizer::kSeparateMaster)
        Space::copy_to_host(s.data[0].data() + at, optimizer_.master_weights().data() + p.state_offset, bytes);
      else
        Space::copy_to_host(s.data[0].data() + at, p.value, bytes);
      Space::copy_to_host(s.data[1].data() + at, optimizer_.first_moment().data() + p.state_offset, bytes);
      Space::copy_to_host(s.data[2].data() + at, optimizer_.second_moment().data() + p.state_offset, bytes);
      at += p.n;
    }
    s.state = state().to_json();
  }

  // Continues the run a checkpoint (or snapshot) stopped: every value and moment this
  // rank holds read from `source` (saved at this layout or any other), then the step,
  // the data position and the loss scaler from `state`. Every rank calls it together.
  void restore(const checkpoint::Source& source, const nlohmann::json& state) {
    fill(source, /*moments=*/true);
    restore_state(checkpoint::TrainerState::from_json(state, source.what()), source.what());
  }
  // Only the weights (master and working copy) from `source`, e.g. a Hugging Face file
  // (checkpoint/hf_gpt2.hpp): the moments, the step and the data position stay as they are.
  // Every rank calls it together.
  void load_weights(const checkpoint::Source& source) { fill(source, /*moments=*/false); }

  // The step, data position, optimizer step count, loss scaler and spike guard (what a
  // checkpoint's metadata holds besides the tensors).
  checkpoint::TrainerState state() const {
    checkpoint::TrainerState t;
    t.step = step_;
    t.optimizer_steps = optimizer_.steps_taken();
    t.loader = train_.state();
    t.shuffle = train_.config().shuffle;
    t.seed = train_.config().seed;
    t.loss_scaler = scaler_.state();
    if (guard_) {
      t.spike_history = guard_->history();
      t.rollbacks = guard_->incident_steps();
      t.has_spike_guard = true;
    }
    return t;
  }

  // The layout this rank trains at, as a checkpoint records it.
  nlohmann::json layout() const {
    const nn::TensorParallelGroup tp = model_.tensor_parallel();
    const auto& pl = model_.placement();
    return {{"tp", tp.size()},
            {"sp", tp.sequence_parallel()},
            {"pp", pl.stages},
            {"virtual_stages", pl.chunks},
            {"partition", pl.partition.describe()},
            {"cp", sync_.dp_size() / (data_ ? data_->size() : 1)},
            {"dp", data_ ? data_->size() : 1},
            {"zero", Policy::kZeroStage},
            {"precision", Precision::kName},
            {"grad_accum", cfg_.layout.grad_accum}};
  }

 private:
  // Every value (and with `moments`, every moment) this rank holds, from `source`.
  void fill(const checkpoint::Source& source, bool moments) {
    static_assert(std::is_same_v<Grad, float>,
                  "llmpar::train::Trainer: checkpoints store f32 master weights and "
                  "moments; train in fp32, bf16 or fp16");
    Backend::synchronize(ctx_);
    std::vector<float> staging;
    std::vector<T> values;
    for (const auto& p : sync_.held_state()) {
      staging.resize(static_cast<std::size_t>(p.n));
      const std::size_t bytes = staging.size() * sizeof(float);
      const nn::Parameter<T>& param = *p.param;
      source.fill(checkpoint::Kind::param, param.name, param.shape, param.split, p.first, p.n, staging.data());
      if constexpr (Optimizer::kSeparateMaster) {
        Space::copy_from_host(optimizer_.master_weights().data() + p.state_offset, staging.data(), bytes);
        values.resize(staging.size());
        backend::cpu::convert(values.data(), staging.data(), p.n);
        Space::copy_from_host(p.value, values.data(), values.size() * sizeof(T));
      } else {
        Space::copy_from_host(p.value, staging.data(), bytes);
      }
      if (!moments) continue;
      source.fill(checkpoint::Kind::exp_avg, param.name, param.shape, param.split, p.first, p.n, staging.data());
      Space::copy_from_host(optimizer_.first_moment().data() + p.state_offset, staging.data(), bytes);
      source.fill(checkpoint::Kind::exp_avg_sq, param.name, param.shape, param.split, p.first, p.n, staging.data());
      Space::copy_from_host(optimizer_.second_moment().data() + p.state_offset, staging.data(), bytes);
    }
    sync_.after_update();  // every rank's blocks to every replica (stages 1, 2); stale gathers forgotten (3)
  }

  void restore_state(const checkpoint::TrainerState& s, const std::string& what) {
    const auto order = [](bool shuffle, std::uint64_t seed) {
      return shuffle ? "shuffled with seed " + std::to_string(seed) : std::string("in order");
    };
    LLMPAR_CHECK(s.shuffle == train_.config().shuffle && (!s.shuffle || s.seed == train_.config().seed), what,
                 ": the data order was ", order(s.shuffle, s.seed), " but this run's loader reads ",
                 order(train_.config().shuffle, train_.config().seed),
                 "; resume with the checkpoint's --seed and --shuffle/--no-shuffle");
    if (const auto& w = s.window_position)
      train_.restore(train_.from_windows(w->shard, w->window, w->epoch, w->window_tokens, s.shuffle));
    else
      train_.restore(s.loader);
    scaler_.restore(s.loss_scaler);
    optimizer_.set_steps_taken(static_cast<int>(s.optimizer_steps));
    step_ = s.step;
    if (guard_ && s.has_spike_guard) guard_->restore(s.spike_history, s.rollbacks);
    snapshot_step_ = -1;  // the next step snapshots the restored state
  }

  // The guard's snapshot: everything this rank holds, to roll back to.
  void take_snapshot() {
    snapshot(SnapshotScope::held, last_good_);
    snapshot_step_ = step_;
  }

  // A spike at step step_ + 1: nothing applied; back to the snapshot (step c). The data
  // read since the snapshot (steps c+1 .. step_ + 1; after an earlier rollback to the same
  // snapshot, what the run read since that one) is not read again, and the guard's extra
  // skip more (skip_batches, doubled by each repeated spike of one incident).
  StepStats roll_back(const Spike& spike, double loss, double norm, std::chrono::steady_clock::time_point t0) {
    const std::int64_t at = step_ + 1, to = snapshot_step_;
    const double failed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::int64_t extra = guard_->rolled_back(at, to, spike, loss, failed_s);  // throws when it must
    const std::vector<std::int64_t> counted = guard_->incident_steps();
    const data::LoaderState position = train_.state();
    restore(checkpoint::Source::of(last_good_), last_good_.state);
    guard_->restore(guard_->history(), counted);
    train_.restore(position);
    skip_batches(extra);
    const std::int64_t skip = (at - to) + extra;
    snapshot_step_ = to;  // the snapshot is still the last good state
    StepStats s;
    s.step = at;
    s.loss = loss;
    s.grad_norm = norm;
    s.rolled_back = true;
    s.rolled_back_to = to;
    s.skipped_batches = skip;
    s.spike = spike.reason;
    s.skipped_total = scaler_.skipped_steps();
    s.ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
  }

  static typename Scaler::Config scaler_config(const TrainerConfig& cfg) {
    if constexpr (Precision::kHasLossScale)
      return cfg.loss_scale;
    else
      return {};
  }

  static pipeline::Shape shape_of(const Model& model, const TrainerConfig& cfg) {
    cfg.validate();
    const auto& pl = model.placement();
    return {pl.stages, pl.chunks, static_cast<int>(cfg.layout.grad_accum)};
  }
  // The schedule the policy names (or, under schedule::Configured, the layout's), for
  // the model's pipeline.
  static pipeline::Schedule make_schedule(const Model& model, const TrainerConfig& cfg) {
    const pipeline::Shape shape = shape_of(model, cfg);
    const std::string& name = cfg.layout.schedule;
    using P = typename Policy::pipeline;
    if constexpr (std::is_same_v<P, parallel::NoPipeline>) {
      LLMPAR_CHECK(shape.stages == 1, "the model is split into ", shape.stages,
                   " pipeline stages but the policy has no pipeline; compose it with parallel::Pipeline<...>");
    } else {
      using S = typename P::Schedule;
      if constexpr (!std::is_same_v<S, schedule::Configured>) {
        LLMPAR_CHECK(name == S::kFlag, "the layout's schedule is '", name, "' but the policy's is ", S::kName, " ('",
                     S::kFlag,
                     "'); set LayoutConfig::schedule to it (parallel::layout_of<Policy>() does), or compose "
                     "parallel::Pipeline<schedule::Configured>");
        LLMPAR_CHECK(shape.chunks == S::kChunks, "the model holds ", shape.chunks, " chunks per pipeline rank but ",
                     S::kName, " runs ", S::kChunks);
      }
    }
    return pipeline::make_schedule(name, shape);
  }
  static recompute::Mode recompute_mode(const TrainerConfig& cfg) {
    using R = typename Policy::recompute;
    if constexpr (!std::is_same_v<R, recompute::Configured>)
      LLMPAR_CHECK(cfg.layout.recompute == R::kMode, "the layout's recomputation disagrees with the policy's ",
                   R::kName,
                   "; set LayoutConfig::recompute to it (parallel::layout_of<Policy>() does), or compose "
                   "recompute::Configured");
    return cfg.layout.recompute;
  }
  // The layout names what the model, its groups, the loader and the policy are.
  void check_layout(const parallel::LayoutConfig& l, const Model& model, const data::DataLoader& train) const {
    const nn::TensorParallelGroup tp = model.tensor_parallel();
    const auto& pl = model.placement();
    const int dp = data_ ? data_->size() : 1;
    const int cp = (replicas_ ? replicas_->size() : 1) / dp;
    LLMPAR_CHECK(l.zero == Policy::kZeroStage, "the layout's ZeRO stage is ", l.zero, " but the policy's is ",
                 Policy::data::kName, "; set LayoutConfig::zero to ", Policy::kZeroStage,
                 " (parallel::layout_of<Policy>() starts from the policy)");
    LLMPAR_CHECK(l.precision == dtype_of<T>(), "the layout's precision is ", parallel::precision_flag(l.precision),
                 " but the policy's is ", Precision::kName,
                 "; set LayoutConfig::precision to DType::", name_of(dtype_of<T>()),
                 " (parallel::layout_of<Policy>() starts from the policy)");
    LLMPAR_CHECK(l.tp == tp.size() && l.sp == tp.sequence_parallel(), "the layout is tp ", l.tp,
                 l.sp ? " with" : " without", " sequence parallelism but the model is split over ", tp.size(), " ranks",
                 tp.sequence_parallel() ? " with" : " without",
                 " it; build the model's TensorParallelGroup from the "
                 "layout (its tp group and sp)");
    LLMPAR_CHECK(l.pp == pl.stages && l.virtual_stages == pl.chunks, "the layout is pp ", l.pp, " x ", l.virtual_stages,
                 " chunks but the model is placed on ", pl.stages, " stages x ", pl.chunks,
                 " chunks; build its pipeline::Placement from the layout");
    LLMPAR_CHECK(l.dp == dp, "the layout is dp ", l.dp, " but the data-parallel group has ", dp,
                 " ranks; set LayoutConfig::dp (LayoutConfig::fit_world does, from the ranks)");
    LLMPAR_CHECK(l.cp == cp, "the layout is cp ", l.cp, " but the grid's context-parallel group has ", cp,
                 " ranks; build the Grid and the model from the layout (.cp = layout.cp)");
    LLMPAR_CHECK(l.micro_batch == train.config().batch_size, "the layout's micro-batch is ", l.micro_batch,
                 " sequences but the loader reads ", train.config().batch_size,
                 "; give LoaderConfig::batch_size the layout's micro_batch");
  }

  // The next n batches of a loader, copied (a loader's batch is a view of its buffer).
  void read_micro_batches(data::DataLoader& loader, std::int64_t n) {
    const auto& lc = loader.config();
    const std::int64_t rows = lc.batch_size * lc.seq_len;
    tokens_.resize(static_cast<std::size_t>(n * rows));
    targets_.resize(static_cast<std::size_t>(n * rows));
    micro_.resize(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      const data::Batch b = loader.next();
      std::copy(b.inputs.data, b.inputs.data + rows, tokens_.data() + i * rows);
      std::copy(b.targets.data, b.targets.data + rows, targets_.data() + i * rows);
    }
    for (std::int64_t i = 0; i < n; ++i)
      micro_[static_cast<std::size_t>(i)] = {tokens_.data() + i * rows, targets_.data() + i * rows};
  }
  // The loss lives on the last pipeline stage: shared with every stage.
  double pipeline_sum(double v) {
    if (!pipeline_) return v;
    std::array<float, 1> x{static_cast<float>(v)};
    pipeline_->all_reduce(x, comm::ReduceOp::sum);
    return x[0];
  }

  // The mean of a per-rank value over the replicas (in float, like the losses).
  double average(double v) {
    std::array<float, 1> x{static_cast<float>(v)};
    replicas_->all_reduce(x, comm::ReduceOp::avg);
    return x[0];
  }

  Context& ctx_;
  Model& model_;
  Executor executor_;
  Sync sync_;
  Optimizer optimizer_;
  Scaler scaler_;
  std::function<void(Model&)> gradient_hook_;
  optim::CosineSchedule schedule_;
  data::DataLoader& train_;
  TrainerConfig cfg_;
  comm::Comm* replicas_;                        // the ranks whose gradients are averaged (dp, or dp x cp)
  comm::Comm* data_;                            // the ranks that read other batches (dp)
  comm::Comm* pipeline_;                        // the pp group when there are 2 stages or more
  std::vector<std::int32_t> tokens_, targets_;  // this step's micro-batches (host)
  std::vector<pipeline::MicroBatch> micro_;
  std::int64_t step_ = 0;
  std::optional<SpikeGuard> guard_;
  checkpoint::Snapshot last_good_;   // the guard's snapshot, after step snapshot_step_
  std::int64_t snapshot_step_ = -1;  // -1: none yet
};

}  // namespace llmpar::train
