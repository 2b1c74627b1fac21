// llmpar/nn/tensor_parallel.hpp — Megatron-LM's tensor-parallel linear layers.
//
// A pair of them splits an MLP (or attention) over the tp ranks of a group so that it
// needs one all-reduce forward and one backward (Shoeybi et al. 2019):
//
//   ColumnParallelLinear  W (out, in) split by output features: each rank computes its
//                         out/tp columns of y from the full x. Forward needs nothing; in
//                         backward every rank holds a partial dx, summed by an all-reduce
//                         (Megatron's "f": identity forward, all-reduce backward).
//   RowParallelLinear     W (out, in) split by input features: each rank multiplies its
//                         in/tp slice of x (the column-parallel layer's output) and the
//                         partial products are summed by an all-reduce ("g": all-reduce
//                         forward, identity backward). The bias is whole on every rank and
//                         added once, by rank 0's GEMM, before the sum.
//
// Parameters are split with nn::Split and initialised at their positions in the full
// tensor, so the ranks' slices together are exactly the serial layer's weights: with
// the same seed, tp ranks compute the serial layer. Sums over ranks run in rank order
// (the communicators' contract), so a run is reproducible bit for bit, and equal to the
// serial run to float rounding.
//
// `groups` splits a fused projection block by block: a QKV weight (3C, C) with groups 3
// puts q's, k's and v's slices of this rank next to each other, which is the head
// layout the attention kernels read (C/tp channels of q, then of k, then of v).
//
// A null group (or one of size 1) is the serial layer: no split, no communication.
//
// Sequence parallelism (Korthikanti et al. 2022). With SequenceParallel::on the regions
// between the tensor-parallel pairs (LayerNorm, residual adds) hold 1/tp of the rows
// instead of all of them: "f" becomes an all-gather of the rows before the
// column-parallel layer (a reduce-scatter in backward) and "g" a reduce-scatter after the
// row-parallel one (an all-gather in backward). Same bytes on the wire as the two
// all-reduces, and the activations of those regions shrink by tp. The group's
// gather_rows / reduce_rows are that choice; a model calls them around the layers'
// partial forms (forward_partial / backward_partial), which do no communication.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "llmpar/backend/backend.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/nn/linear.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::nn {

// Whether Megatron-style sequence parallelism runs alongside tensor parallelism: the
// LayerNorm and residual regions are split over the sequence instead of being
// replicated. A value of the run's layout (parallel::LayoutConfig::sp), not a policy
// type: it chooses which collectives a region runs.
enum class SequenceParallel : std::uint8_t { off, on };

// The group a tensor-parallel layer is split over.
class TensorParallelGroup {
 public:
  TensorParallelGroup() = default;
  explicit TensorParallelGroup(comm::Comm* group, SequenceParallel sp = SequenceParallel::off)
      : group_(group && group->size() > 1 ? group : nullptr), sp_(group_ ? sp : SequenceParallel::off) {}
  // Sequence parallelism as a layout says it (parallel::LayoutConfig::sp).
  TensorParallelGroup(comm::Comm* group, bool sequence_parallel)
      : TensorParallelGroup(group, sequence_parallel ? SequenceParallel::on : SequenceParallel::off) {}

  int size() const { return group_ ? group_->size() : 1; }
  comm::Comm* communicator() const { return group_; }  // null when not split
  int rank() const { return group_ ? group_->rank() : 0; }
  bool split() const { return group_ != nullptr; }
  bool sequence_parallel() const { return sp_ == SequenceParallel::on; }

  // Rows this rank holds in a sequence-parallel region of `rows` rows, and the first.
  std::int64_t local_rows(std::int64_t rows) const { return sequence_parallel() ? rows / size() : rows; }
  std::int64_t first_row(std::int64_t rows) const { return sequence_parallel() ? rank() * (rows / size()) : 0; }

  // Enters a tensor-parallel region ("f" forward): returns `rows` whole rows of width
  // `width`. Without sequence parallelism `local` already holds them; with it, the
  // ranks' row slices are gathered into `full`, in rank order.
  template <class T>
  const T* gather_rows(T* full, const T* local, std::int64_t rows, std::int64_t width) const {
    if (!sequence_parallel()) return local;
    all_gather(full, local, local_rows(rows) * width);
    return full;
  }
  // Leaves a tensor-parallel region ("g" forward, "f" backward): `partial` holds this
  // rank's partial sums of `rows` rows; out receives the sums of this rank's rows (all
  // of them, in place, without sequence parallelism; its slice with it).
  template <class T>
  void reduce_rows(T* out, T* partial, std::int64_t rows, std::int64_t width) const {
    if (!split()) return;
    if (!sequence_parallel()) {
      all_reduce(partial, rows * width);
      return;
    }
    const std::int64_t n = local_rows(rows) * width;
    if constexpr (kCarried<T>) {
      group_->reduce_scatter(std::span<const T>(partial, static_cast<std::size_t>(n * size())),
                             std::span<T>(out, static_cast<std::size_t>(n)));
    } else {
      not_carried(sizeof(T));
    }
  }

  // Fails naming the sequence length when sequence parallelism cannot split it.
  void check_sequence(std::int64_t seq) const {
    LLMPAR_CHECK(!sequence_parallel() || seq % size() == 0, "sequence length ", seq,
                 " is not divisible by the tensor-parallel degree ", size(),
                 " (sequence parallelism splits the sequence); use a --seq that is a multiple of ", size());
  }

  // The Split of a dimension cut into size() parts, this rank's part.
  Split along(int dim, int groups = 1) const { return split() ? Split{dim, size(), rank(), groups} : Split{}; }

  // full (n · size()) = every rank's local (n), in rank order. The group must be split.
  template <class T>
  void all_gather(T* full, const T* local, std::int64_t n) const {
    LLMPAR_CHECK(split(), "all_gather over a tensor-parallel group of one rank; callers gather only when split()");
    if constexpr (kCarried<T>) {
      group_->all_gather(std::span<const T>(local, static_cast<std::size_t>(n)),
                         std::span<T>(full, static_cast<std::size_t>(n * size())));
    } else {
      not_carried(sizeof(T));
    }
  }

  // x (n) = Σ over the group's ranks, in place (nothing when not split).
  template <class T>
  void all_reduce(T* x, std::int64_t n) const {
    if (group_ == nullptr) return;
    if constexpr (kCarried<T>) {
      group_->all_reduce(std::span<T>(x, static_cast<std::size_t>(n)));
    } else {
      not_carried(sizeof(T));
    }
  }

  // A layer whose tensors live in `Space` (memory::Host, memory::Device) is split over
  // this group only if its communicator reaches that memory: device memory needs NCCL.
  template <class Space>
  void check_reaches(const std::string& layer) const {
    if (Space::kHostAccessible || !split()) return;
    LLMPAR_CHECK(group_->engine_name() == std::string_view("nccl"), layer,
                 " keeps its tensors in device memory, which the tensor-parallel group's ", group_->engine_name(),
                 " communicator cannot read; launch the ranks with mpirun on a build with NCCL");
  }

  // Host-side communication reads what the kernels wrote: a split layer waits for them
  // before it gathers or reduces (nothing when not split).
  template <class Backend>
  void wait_for_kernels(typename Backend::Context& ctx) const {
    if (split()) Backend::synchronize(ctx);
  }

  // A size that must divide by the group: fails naming the value, what it is and the degree.
  void check_divides(std::int64_t value, const char* what) const {
    LLMPAR_CHECK(value % size() == 0, what, " (", value, ") is not divisible by the tensor-parallel degree ", size(),
                 "; choose ", what, " as a multiple of ", size(), " or a tp that divides ", value);
  }

 private:
  // The element types the communicators carry; a double model (the finite-difference
  // tests) compiles against the group but runs unsplit.
  template <class T>
  static constexpr bool kCarried = requires(comm::Comm& c, std::span<T> x) {
    c.all_reduce(x);
  };
  [[noreturn]] static void not_carried(std::size_t bytes) {
    LLMPAR_FAIL("a tensor-parallel layer stores a type the communicators cannot carry (", bytes,
                "-byte elements); split float, bf16 or f16 models (double models run unsplit)");
  }

  comm::Comm* group_ = nullptr;
  SequenceParallel sp_ = SequenceParallel::off;
};

// Marks every parameter of `layer` (a norm in a sequence-parallel region) as
// Parameter::sequence_parallel when the group splits the sequence; nothing otherwise.
template <class T, class Layer>
void mark_sequence_parallel(Layer& layer, const TensorParallelGroup& tp) {
  if (!tp.sequence_parallel()) return;
  layer.parameters([](Parameter<T>& p) { p.sequence_parallel = true; });
}

// y_local (rows, out/tp) = x (rows, in) · W_localᵀ + b_local.
template <class T, class Backend = backend::Cpu>
class ColumnParallelLinear {
 public:
  using Context = typename Backend::Context;

  ColumnParallelLinear(const std::string& name, std::int64_t in_features, std::int64_t out_features, bool has_bias,
                       float init_std, TensorParallelGroup tp, int groups = 1)
      : tp_((tp.check_divides(out_features / groups, (name + " output features per group").c_str()),
             tp.check_reaches<typename Backend::Space>(name), tp)),
        linear_(name, in_features, out_features, has_bias, init_std, tp.along(0, groups), tp.along(0, groups)) {}

  void forward(Context& ctx, T* y, const T* x, std::int64_t rows) const { linear_.forward(ctx, y, x, rows); }
  // act = gelu(pre), pre = x · W_localᵀ + b_local: the first half of a tensor-parallel MLP.
  void forward_gelu(Context& ctx, T* act, T* pre, const T* x, std::int64_t rows) const {
    linear_.forward_gelu(ctx, act, pre, x, rows);
  }

  // This rank's partial dx (rows, in) = dy_local · W_local, not yet summed over the
  // group (the model sums it with TensorParallelGroup::reduce_rows); dW, db accumulate.
  void backward_partial(Context& ctx, T* dx_partial, const T* dy, const T* x, std::int64_t rows) {
    linear_.backward(ctx, dx_partial, dy, x, rows);
    if (tp_.split()) Backend::synchronize(ctx);
  }

  // dx (rows, in) = Σ_ranks dy_local · W_local (the all-reduce of "f"); dW, db of this
  // rank's slice accumulate.
  void backward(Context& ctx, T* dx, const T* dy, const T* x, std::int64_t rows) {
    linear_.backward(ctx, dx, dy, x, rows);
    if (dx != nullptr) {
      Backend::synchronize(ctx);
      tp_.all_reduce(dx, rows * linear_.in_features());
    }
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    linear_.parameters(visit);
  }
  std::int64_t local_out_features() const { return linear_.out_features(); }
  Linear<T, Backend>& linear() { return linear_; }

 private:
  TensorParallelGroup tp_;
  Linear<T, Backend> linear_;
};

// y (rows, out) = Σ_ranks x_local (rows, in/tp) · W_localᵀ + b.
template <class T, class Backend = backend::Cpu>
class RowParallelLinear {
 public:
  using Context = typename Backend::Context;

  // groups: the input features come in `groups` equal blocks, each split over the group
  // (the column-parallel layer before it split its outputs so: grouped-query attention's
  // query heads, nn::SelfAttention).
  RowParallelLinear(const std::string& name, std::int64_t in_features, std::int64_t out_features, bool has_bias,
                    float init_std, TensorParallelGroup tp, int groups = 1)
      : tp_((tp.check_divides(in_features / groups,
                              (name + (groups > 1 ? " input features per group" : " input features")).c_str()),
             tp.check_reaches<typename Backend::Space>(name), tp)),
        linear_(name, in_features, out_features, has_bias, init_std, tp.along(1, groups), Split{}) {}

  // This rank's partial y (rows, out) = x_local · W_localᵀ (+ b on rank 0), not yet
  // summed over the group (the model sums it with TensorParallelGroup::reduce_rows).
  void forward_partial(Context& ctx, T* y_partial, const T* x, std::int64_t rows) const {
    const bool bias = linear_.has_bias() && tp_.rank() == 0;  // added once, before the sum
    Backend::template gemm<T>(ctx, y_partial, x, linear_.weight().value, bias ? linear_.bias().value : nullptr, rows,
                              linear_.out_features(), linear_.in_features(),
                              {.trans_a = false, .trans_b = true, .accumulate = false});
    if (tp_.split()) Backend::synchronize(ctx);
  }

  void forward(Context& ctx, T* y, const T* x, std::int64_t rows) const {
    const bool bias = linear_.has_bias() && tp_.rank() == 0;  // added once, before the sum
    Backend::template gemm<T>(ctx, y, x, linear_.weight().value, bias ? linear_.bias().value : nullptr, rows,
                              linear_.out_features(), linear_.in_features(),
                              {.trans_a = false, .trans_b = true, .accumulate = false});
    if (tp_.split()) {
      Backend::synchronize(ctx);
      tp_.all_reduce(y, rows * linear_.out_features());
    }
  }

  // dx_local (rows, in/tp) = dy · W_local; dW_local += dyᵀ · x_local; db += Σ dy
  // (every rank has the whole dy, so the replicated bias gets the same gradient).
  void backward(Context& ctx, T* dx, const T* dy, const T* x, std::int64_t rows) {
    linear_.backward(ctx, dx, dy, x, rows);
  }
  // The same when x_local = gelu(pre_local): dpre_local = (dy · W_local) * gelu'(pre_local).
  void backward_through_gelu(Context& ctx, T* dpre, const T* dy, const T* x, const T* pre, std::int64_t rows) {
    linear_.backward_through_gelu(ctx, dpre, dy, x, pre, rows);
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    linear_.parameters(visit);
  }
  std::int64_t local_in_features() const { return linear_.in_features(); }
  Linear<T, Backend>& linear() { return linear_; }

 private:
  TensorParallelGroup tp_;
  Linear<T, Backend> linear_;
};

}  // namespace llmpar::nn

namespace llmpar {
using nn::SequenceParallel;
}  // namespace llmpar
