// llmpar/train/trainer.hpp — the training loop: micro-batches, gradient accumulation,
// clipping, AdamW, the schedule, evaluation, and the numbers a step reports.
//
// The loop is a template over the model so that any type with forward/backward/
// zero_grad/parameter_store trains; the example trainers and the tests drive it the
// same way. Nothing here is global: the context, the model, the loaders, the configs
// and the communicator are all passed in.
//
// Replicas: given a communicator over ranks that hold the same model (each reading its
// own rows of the global batch, see data::DataLoader), the trainer averages gradients
// and losses over it before the optimizer step, so N ranks with batch B compute the
// run one rank computes with batch N*B. This is plain replication — every rank keeps
// the whole optimizer state; sharding it is what the data-parallel strategies add.
//
// Backends: the model names its backend tag (Model::BackendTag); the trainer takes that
// backend's context and builds that backend's optimizer. On the CUDA backend the
// gradients live on the device, so the replicas' communicator must be NCCL.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <array>
#include <functional>
#include <span>

#include "llmpar/backend/backend.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/optim/adamw.hpp"
#include "llmpar/optim/schedule.hpp"
#include "llmpar/train/metrics.hpp"

namespace llmpar::train {

struct TrainerConfig {
  std::int64_t steps = 100;
  std::int64_t grad_accum = 1;  // micro-batches per optimizer step
  double peak_gflops = 0.0;     // MFU denominator; 0 leaves MFU at 0

  void validate() const {
    LLMPAR_CHECK(steps > 0, "steps is ", steps, "; train for at least 1 step");
    LLMPAR_CHECK(grad_accum > 0, "grad_accum is ", grad_accum, "; use at least 1 micro-batch per step");
    LLMPAR_CHECK(peak_gflops >= 0.0, "peak_gflops is ", peak_gflops, "; it must be >= 0");
  }
};

template <class Model>
class Trainer {
 public:
  using Backend = typename Model::BackendTag;
  using Context = typename Backend::Context;
  using Optimizer = typename Backend::template Optimizer<float>;

  // `replicas`: the ranks holding copies of this model (nullptr: this rank alone).
  Trainer(Context& ctx, Model& model, const optim::AdamWConfig& opt, const optim::CosineSchedule& schedule,
          data::DataLoader& train, const TrainerConfig& cfg, comm::Comm* replicas = nullptr)
      : ctx_(ctx),
        model_(model),
        optimizer_(Backend::make_optimizer(ctx, model.parameter_store(), opt)),
        schedule_(schedule),
        train_(train),
        cfg_(cfg),
        replicas_(replicas && replicas->size() > 1 ? replicas : nullptr) {
    cfg.validate();
    schedule.validate();
    // A model split over a tensor-parallel group: clipping takes the norm of the whole
    // model's gradient (the split parameters' squares summed over the group).
    if constexpr (requires { model.tensor_parallel(); }) {
      if (model.tensor_parallel().split()) optimizer_.set_model_parallel(model.tensor_parallel());
    }
    if (replicas_ && !Backend::Space::kHostAccessible) {
      LLMPAR_CHECK(replicas_->engine_name() == std::string_view("nccl"), "the ", Backend::kName,
                   " backend keeps gradients in device memory, which the ", replicas_->engine_name(),
                   " communicator cannot read; launch the ranks with mpirun on a build with NCCL");
    }
    if (replicas_) {
      LLMPAR_CHECK(train.config().world == replicas_->size() && train.config().rank == replicas_->rank(),
                   "the training loader reads as rank ", train.config().rank, " of ", train.config().world,
                   " but the replicas are rank ", replicas_->rank(), " of ", replicas_->size(),
                   "; build its LoaderConfig with the replicas' rank and size");
    }
  }

  // One optimizer step over grad_accum micro-batches.
  StepStats step() {
    const auto t0 = std::chrono::steady_clock::now();
    const auto& lc = train_.config();
    const std::int64_t batch = lc.batch_size, seq = lc.seq_len;
    model_.zero_grad();
    double loss = 0.0;
    for (std::int64_t micro = 0; micro < cfg_.grad_accum; ++micro) {
      const data::Batch b = train_.next();
      loss +=
          model_.forward(ctx_, b.inputs.data, b.targets.data, batch, seq, 1.0f / static_cast<float>(cfg_.grad_accum));
      model_.backward(ctx_);
    }
    loss /= static_cast<double>(cfg_.grad_accum);
    if constexpr (requires { model_.tensor_parallel(); })
      nn::sum_sequence_parallel_gradients<Backend>(ctx_, model_.parameter_store(), model_.tensor_parallel());
    if (replicas_) {
      auto& store = model_.parameter_store();
      replicas_->all_reduce(std::span<float>(store.grads(), store.flat_size()), comm::ReduceOp::avg);
      loss = average(loss);
    }
    LLMPAR_CHECK(std::isfinite(loss), "the loss is ", loss, " at step ", step_ + 1,
                 "; lower --lr, raise --warmup, or check the data");
    const float lr = schedule_(step_);
    const double norm = optimizer_.step(lr);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    StepStats s;
    s.step = ++step_;
    s.loss = loss;
    s.lr = lr;
    s.grad_norm = norm;
    s.ms = 1e3 * seconds;
    const double tokens = static_cast<double>(batch * seq * cfg_.grad_accum * (replicas_ ? replicas_->size() : 1));
    s.tokens_per_s = tokens / seconds;
    if (cfg_.peak_gflops > 0.0) {
      const auto& mc = model_.config();
      s.mfu =
          flops_per_token(model_.num_parameters(), mc.layers, mc.dim, seq) * s.tokens_per_s / (cfg_.peak_gflops * 1e9);
    }
    return s;
  }

  // Mean loss over `batches` batches of `loader` (no gradient state is touched).
  double evaluate(data::DataLoader& loader, std::int64_t batches) {
    LLMPAR_CHECK(batches > 0, "evaluation needs at least 1 batch, got ", batches);
    const auto& lc = loader.config();
    double sum = 0.0;
    for (std::int64_t i = 0; i < batches; ++i) {
      const data::Batch b = loader.next();
      sum += model_.evaluate(ctx_, b.inputs.data, b.targets.data, lc.batch_size, lc.seq_len);
    }
    const double mean = sum / static_cast<double>(batches);
    return replicas_ && loader.config().world == replicas_->size() ? average(mean) : mean;
  }

  // Runs the remaining steps, calling on_step after each.
  void fit(const std::function<void(const StepStats&)>& on_step) {
    while (step_ < cfg_.steps) on_step(step());
  }

  std::int64_t steps_done() const { return step_; }
  Optimizer& optimizer() { return optimizer_; }

 private:
  // The mean of a per-rank value over the replicas (in float, like the losses).
  double average(double v) {
    std::array<float, 1> x{static_cast<float>(v)};
    replicas_->all_reduce(x, comm::ReduceOp::avg);
    return x[0];
  }

  Context& ctx_;
  Model& model_;
  Optimizer optimizer_;
  optim::CosineSchedule schedule_;
  data::DataLoader& train_;
  TrainerConfig cfg_;
  comm::Comm* replicas_;
  std::int64_t step_ = 0;
};

}  // namespace llmpar::train
