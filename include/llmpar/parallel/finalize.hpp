// llmpar/parallel/finalize.hpp — the last sums before the update (Megatron-Core's
// finalize_model_grads): the tied token table's gradient over the first and last
// pipeline stage, the sequence-parallel norms' gradients over the tensor-parallel group,
// and the one global gradient norm with the overflow verdict over every rank.
//
// Why it is built this way:
//  - The tied table: its gradient is the sum of the embedding's (first stage) and the
//    head's (last stage); summed over the embedding group before the dp reduction (sums
//    commute), so both stages update the same values.
//  - Sequence-parallel norms: each rank normalised its own rows, so their gradients are
//    partial sums; the elements this rank owns are packed and summed over the group in
//    one all-reduce instead of one per norm.
//  - The global norm counts every element once: each rank sums the squares of the pieces
//    it counts (its block of every bucket: tensor-split parameters on every tp rank,
//    replicated ones on tp rank 0, the tied copy never), and one all-reduce over the
//    world adds them together with the count of ranks whose gradients are not finite
//    (the loss scaler's overflow flag, reduced over every group at once). At stage 0
//    every rank updates every parameter from what it holds, so all of it must be finite.
#pragma once

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>

#include "llmpar/comm/init.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/optim/adamw.hpp"
#include "llmpar/parallel/comm_thread.hpp"
#include "llmpar/parallel/grad_buffer.hpp"

namespace llmpar::parallel {

template <class Model, int kStage>
class Finalizer {
 public:
  using T = typename Model::value_type;
  using Backend = typename Model::BackendTag;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Buffer_ = GradBuffer<Model, kStage>;
  using Grad = typename Buffer_::Grad;

  // world: every rank (the norm), null for one; embedding: the first and last pipeline
  // stage, null when the model is not split into stages.
  Finalizer(Context& ctx, Model& model, Buffer_& buffer, const nn::TensorParallelGroup& tp, comm::Comm* world,
            comm::Comm* embedding, CommThread& thread)
      : ctx_(ctx), model_(model), buffer_(buffer), tp_(tp), world_(world), embedding_(embedding), thread_(thread) {
    std::int64_t n = 0;
    for (const auto& piece : buffer.sequence_parallel_pieces()) n += piece.n;
    staging_.resize(n);
  }
  Finalizer(const Finalizer&) = delete;
  Finalizer& operator=(const Finalizer&) = delete;

  // The tied token table's gradient summed over the embedding group (before the
  // buckets of a pipeline's step are reduced).
  void sum_tied_table() {
    if (!embedding_) return;
    const nn::Parameter<T>* table = model_.token_table();
    LLMPAR_CHECK(table != nullptr, "this rank is in the embedding group but holds no token table");
    Backend::synchronize(ctx_);
    thread_.run_here([&] {
      embedding_->all_reduce(std::span<Grad>(table->grad, static_cast<std::size_t>(table->numel())),
                             comm::ReduceOp::sum);
    });
  }

  // The sequence-parallel norms' gradients (this rank's elements) summed over the tp group.
  void sum_sequence_parallel() {
    const auto& pieces = buffer_.sequence_parallel_pieces();
    if (pieces.empty()) return;
    Backend::synchronize(ctx_);
    std::int64_t at = 0;
    for (const auto& p : pieces) {
      Backend::copy(ctx_, staging_.data() + at, p.grad, p.n);
      at += p.n;
    }
    Backend::synchronize(ctx_);
    tp_.all_reduce(staging_.data(), staging_.size());
    at = 0;
    for (const auto& p : pieces) {
      Backend::copy(ctx_, p.grad, staging_.data() + at, p.n);
      at += p.n;
    }
  }

  // The global norm of the unscaled gradient (stored gradients times inv_loss_scale)
  // over every rank, each element counted once, and whether every rank's gradients are
  // finite.
  optim::GradNorm gradient_norm(float inv_loss_scale) {
    double counted = 0.0, all = 0.0;
    for (const auto& p : buffer_.owned()) {
      const double s = Backend::sum_of_squares(ctx_, p.grad, p.n);
      if (p.counted) counted += s;
      all += s;
    }
    if constexpr (kStage == 0)
      all = Backend::sum_of_squares(ctx_, buffer_.store().grads(), buffer_.store().flat_size());
    std::array<float, 2> parts{static_cast<float>(counted), std::isfinite(all) ? 0.0f : 1.0f};
    if (world_) world_->all_reduce(parts, comm::ReduceOp::sum);
    const double inv = inv_loss_scale;
    const double squares = static_cast<double>(parts[0]) * inv * inv;
    return {std::sqrt(squares), parts[1] == 0.0f && std::isfinite(squares)};
  }

  std::size_t bytes() const { return staging_.bytes(); }

 private:
  Context& ctx_;
  Model& model_;
  Buffer_& buffer_;
  nn::TensorParallelGroup tp_;
  comm::Comm* world_;
  comm::Comm* embedding_;
  CommThread& thread_;
  Buffer<Grad, Space> staging_;  // the sequence-parallel norms' gradients, packed
};

}  // namespace llmpar::parallel
