// llmpar/parallel/grad_buffer.hpp — the gradient buffer: the model's parameters laid out
// in the order backward produces their gradients, cut into buckets, and this rank's
// shard of them (Megatron-Core's ParamAndGradBuffer).
//
// The layout is all this does; the bucket reducer, the ZeRO-3 gatherer and the finalize
// step (bucket_reducer.hpp, param_gatherer.hpp, finalize.hpp) read it.
//  - Units in reverse order (the last block's backward runs first), each parameter at a
//    64-byte-aligned offset; a bucket closes at a unit boundary once it holds
//    bucket_bytes of f32 gradients (ZeRO 3: one unit per bucket, the gather granule),
//    and is padded so each of the dp ranks' blocks is aligned.
//  - A ZeRO shard is offsets into the buckets: block r of every bucket (Megatron's
//    distributed optimizer shards per bucket the same way), so rank r's shard is a list
//    of pieces of parameters. From stage 2 the shard's gradients live in their own
//    buffer (the store keeps none); at stage 3 its values too.
//  - Each piece knows whether this rank counts it in the global norm: tensor-split
//    parameters on every tp rank, replicated ones on tp rank 0, the last pipeline
//    stage's copy of the tied token table never.
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/nn/model.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/optim/adamw.hpp"

namespace llmpar::parallel {

template <class Model, int kStage>
class GradBuffer {
 public:
  using T = typename Model::value_type;
  using Space = typename Model::BackendTag::Space;
  using Grad = acc_t<T>;
  static constexpr bool kShardedGrads = kStage >= 2;
  static constexpr bool kShardedValues = kStage == 3;

  // A contiguous range of the flat buffers holding whole units (backward order).
  struct Bucket {
    std::int64_t begin = 0, end = 0, chunk = 0;  // chunk: (end - begin) / dp, one rank's block
    std::int64_t shard_offset = 0;               // where this rank's block sits in its shard buffers
    std::vector<int> params;                     // parameter indices (store order)
    int units = 0;
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

  GradBuffer(Model& model, const nn::TensorParallelGroup& tp, int dp_size, int dp_rank, std::int64_t bucket_bytes)
      : store_(model.parameter_store()), dp_size_(dp_size), dp_rank_(dp_rank), tied_copy_(model.tied_copy()) {
    plan(model, tp, bucket_bytes);
  }
  GradBuffer(const GradBuffer&) = delete;
  GradBuffer& operator=(const GradBuffer&) = delete;

  nn::ParameterStore<T, Space>& store() { return store_; }
  std::vector<Bucket>& buckets() { return buckets_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  int bucket_of_unit(int unit) const { return unit_bucket_[static_cast<std::size_t>(unit)]; }
  std::int64_t largest_bucket() const { return max_bucket_; }
  // Where parameter k (store order) starts in the flat buffers.
  std::int64_t offset(int k) const { return offsets_[static_cast<std::size_t>(k)]; }
  nn::Parameter<T>* parameter(int k) { return store_.parameters()[static_cast<std::size_t>(k)]; }
  int dp_size() const { return dp_size_; }
  int dp_rank() const { return dp_rank_; }
  // This rank's pieces (its block of every bucket), and those of the sequence-parallel
  // norms among them (at stage 0: every sequence-parallel parameter, whole).
  const std::vector<Piece>& owned() const { return owned_; }
  const std::vector<Piece>& sequence_parallel_pieces() const { return sp_pieces_; }
  // Stages 2, 3: this rank's reduced gradients; stage 3: its parameter values.
  Buffer<Grad, Space>& shard_grads() { return shard_grads_; }
  Buffer<T, Space>& shard_values() { return shard_values_; }

  // The segments this rank's optimizer updates: the whole store at stage 0, block r of
  // every bucket from stage 1.
  std::vector<optim::Segment<T>> optimizer_shard() {
    if constexpr (kStage == 0) return optim::whole_store(store_);
    std::vector<optim::Segment<T>> out;
    for (const Piece& p : owned_) out.push_back({p.value, p.grad, p.n, p.param->decay, p.param->lr_scale});
    return out;
  }

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
  // reduced gradient this rank holds after the reduction: elements [first, first + n) of
  // the parameter's local tensor, their gradients and current values (Space memory).
  template <class F>
  void for_each_owned(F&& f) const {
    if constexpr (kStage == 0) {
      for (nn::Parameter<T>* p : store_.parameters()) f(*p, std::int64_t{0}, p->grad, p->value, p->numel());
    } else {
      for (const Piece& p : owned_) f(*p.param, p.first, p.grad, p.value, p.n);
    }
  }

  // Bytes of parameter values and of gradients this rank keeps between steps.
  std::size_t value_bytes() const { return store_.value_bytes() + shard_values_.bytes(); }
  std::size_t grad_bytes() const { return store_.grad_bytes() + shard_grads_.bytes(); }

 private:
  // Lays the store out unit by unit in backward order, cuts buckets, and builds the shards.
  void plan(Model& model, const nn::TensorParallelGroup& tp, std::int64_t bucket_bytes) {
    const auto params = store_.parameters();
    std::unordered_map<const nn::Parameter<T>*, int> index;
    for (std::size_t k = 0; k < params.size(); ++k) index[params[k]] = static_cast<int>(k);
    // Units in forward order, each a list of parameter indices.
    std::vector<std::vector<int>> units(static_cast<std::size_t>(model.num_units()));
    for (int u = 0; u < model.num_units(); ++u)
      model.unit_parameters(u,
                            [&](nn::Parameter<T>& p) { units[static_cast<std::size_t>(u)].push_back(index.at(&p)); });
    std::size_t covered = 0;
    for (const auto& u : units) covered += u.size();
    LLMPAR_CHECK(covered == params.size(), "the model's units hold ", covered, " parameters but the model has ",
                 params.size(), "; every parameter must belong to exactly one unit");

    constexpr std::int64_t kAlign = static_cast<std::int64_t>(kHostAlignment / sizeof(T));
    const std::int64_t bucket_elements =
        std::max<std::int64_t>(1, bucket_bytes / static_cast<std::int64_t>(sizeof(Grad)));
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
        piece.counted = (p->split.is_split() || tp.rank() == 0) && p != tied_copy_;
        if constexpr (kShardedValues)
          Space::copy(piece.value, store_.old_value(static_cast<std::size_t>(k)) + piece.first, piece.n);
        owned_.push_back(piece);
      }
    }
    if constexpr (kShardedValues) store_.release_old_values();
    // Sequence-parallel norms: the elements this rank owns.
    if (tp.sequence_parallel()) {
      if constexpr (kStage == 0) {
        for (nn::Parameter<T>* p : params)
          if (p->sequence_parallel) sp_pieces_.push_back({p, 0, p->numel(), p->grad, p->value, true});
      } else {
        for (const Piece& piece : owned_)
          if (piece.param->sequence_parallel) sp_pieces_.push_back(piece);
      }
    }
  }

  nn::ParameterStore<T, Space>& store_;
  int dp_size_ = 1, dp_rank_ = 0;
  const nn::Parameter<T>* tied_copy_ = nullptr;  // the last pipeline stage's copy of the token table
  std::vector<Bucket> buckets_;
  std::vector<int> unit_bucket_;
  std::vector<std::int64_t> offsets_;  // per parameter (store order)
  std::int64_t max_bucket_ = 0;
  std::vector<Piece> owned_, sp_pieces_;
  Buffer<Grad, Space> shard_grads_;  // stages 2, 3: this rank's reduced gradients
  Buffer<T, Space> shard_values_;    // stage 3: this rank's parameter values
};

}  // namespace llmpar::parallel
