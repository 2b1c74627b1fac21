// llmpar/parallel/layout.hpp — the layout of a run: one typed configuration, checked
// once, and the one place where its run-time choices become compiled policies.
//
// A layout is how a run spreads over its ranks and steps: the degrees (tp, pp, dp), the
// choices that only reorder or resize work (sequence parallelism, the pipeline schedule
// and its chunks, the partition of layers, recomputation, micro-batch and accumulation,
// the gradient buckets), and the two choices that select code (the ZeRO stage and the
// precision). The trainer, train_gpt and llmpar-plan all read it, so a layout that one
// of them accepts the others accept, with the same messages.
//
// Why it is built this way:
//  - One struct with public fields and validate(): the flags of train_gpt map onto it
//    one to one (its errors name them, --tp rather than `tp`, because those names are
//    the layout's vocabulary everywhere, docs and planner included), and a C++ trainer
//    fills the same fields.
//  - Policies at compile time, sizes at run time (docs/design.md): what changes code is a
//    type (the ZeRO stage and the precision: Compose<...>); the rest stays a value.
//    Sequence parallelism is a value, as the schedule and the recomputation are: it
//    decides which collectives a tensor-parallel region runs, a branch, and a type for
//    it doubled every instantiation of a program that offers both.
//  - dispatch<Backend>(layout, f) is the one run-time to compile-time boundary (CUB's
//    Dispatch): it calls f.template operator()<Policy>() with the policy the layout's
//    precision and ZeRO stage name. A program that instantiates many policies declares
//    its per-policy code `extern template` and instantiates it in several translation
//    units (examples/train_gpt_*.cpp), so its build runs in parallel.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/nn/context_parallel.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/pipeline/partition.hpp"
#include "llmpar/precision/policy.hpp"

namespace llmpar::parallel {

// Settings of data parallelism (the stage is the policy's: parallel::Data<zero::Stage<K>>).
struct DataConfig {
  // Of f32 gradients per bucket (stages 0-2; stage 3 reduces per unit). Buckets close at
  // unit boundaries, so a unit larger than this is one bucket. 4 MiB: in
  // bench_data_parallel (2 ranks, threads and MPI processes) 1 and 4 MiB exposed the
  // least communication, 16 and 64 MiB more (the last bucket, reduced after backward,
  // is larger); 1 MiB would multiply the collectives of a model with small units.
  std::int64_t bucket_bytes = 4ll << 20;
  bool overlap = true;  // reduce buckets during backward (false: after it)
  bool trace = false;   // record the order of events (tests)

  void validate() const {
    LLMPAR_CHECK(bucket_bytes > 0, "the gradient bucket size is ", bucket_bytes,
                 " bytes; use a positive size (--bucket-mb 16, for example)");
  }
};

// The pipeline schedules a layout can name (pipeline::make_schedule builds them).
inline constexpr std::string_view kScheduleNames[] = {"gpipe", "1f1b", "interleaved", "zb"};

struct LayoutConfig {
  int tp = 1;                             // tensor-parallel degree
  bool sp = false;                        // sequence parallelism over the tp group
  int cp = 1;                             // context-parallel degree: each sequence over cp ranks
  nn::CpComm cp_comm = nn::CpComm::ring;  // how attention reaches the other cp ranks' rows
  int pp = 1;                             // pipeline stages
  int dp = 1;                             // data-parallel replicas (fit_world sets it from the ranks)
  std::string schedule = "1f1b";          // gpipe, 1f1b, interleaved (with virtual_stages), zb
  int virtual_stages = 1;                 // model chunks per pipeline rank
  std::string partition = "even";         // even, parameters, or the layers per virtual stage ("3,3,2")
  recompute::Mode recompute = recompute::Mode::none;
  int zero = 0;                  // ZeRO stage: 0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters
  DType precision = DType::f32;  // f32, bf16 (BF16Mixed) or f16 (FP16Mixed with a dynamic loss scale)
  std::int64_t micro_batch = 1;  // sequences per micro-batch and dp rank
  std::int64_t grad_accum = 1;   // micro-batches per optimizer step
  DataConfig data{};             // gradient buckets and their overlap with backward

  int world() const { return tp * cp * pp * dp; }
  // The ranks holding the same parameters, over which gradients are averaged and ZeRO
  // shards: dp x cp.
  int replicas() const { return dp * cp; }
  // Sequences per optimizer step over every dp rank.
  std::int64_t global_batch() const { return micro_batch * dp * grad_accum; }

  // The degrees of a run on `world` ranks: dp = world / (tp · cp · pp), once they are
  // checked to divide it.
  LayoutConfig& fit_world(int world) {
    LLMPAR_CHECK(tp >= 1 && world % tp == 0, "--tp ", tp, " does not divide the ", world,
                 " ranks; use a tp that divides the number of ranks (--ranks, or mpirun -np)");
    LLMPAR_CHECK(cp >= 1 && world % (tp * cp) == 0, "--tp ", tp, " x --cp ", cp, " does not divide the ", world,
                 " ranks; use degrees whose product divides the number of ranks (--ranks, or mpirun -np)");
    LLMPAR_CHECK(pp >= 1 && world % (tp * cp * pp) == 0, "--tp ", tp, cp > 1 ? " x --cp " + std::to_string(cp) : "",
                 " x --pp ", pp, " does not divide the ", world,
                 " ranks; use degrees whose product divides the number of ranks (--ranks, or mpirun -np)");
    dp = world / (tp * cp * pp);
    return *this;
  }

  // Every rule of the layout alone (what the model adds — heads, layers, sequence length
  // divisible by the degrees — is checked where the model is built).
  void validate() const {
    LLMPAR_CHECK(tp >= 1 && cp >= 1 && pp >= 1 && dp >= 1, "the layout's degrees are tp ", tp, ", cp ", cp, ", pp ", pp,
                 ", dp ", dp, "; each must be at least 1");
    LLMPAR_CHECK(!sp || tp > 1, "--sp splits the sequence over the tensor-parallel group; use it with --tp 2 or more");
    bool known = false;
    for (std::string_view name : kScheduleNames) known = known || schedule == name;
    LLMPAR_CHECK(known, "--schedule ", schedule, " is not a pipeline schedule; use gpipe, 1f1b, interleaved or zb");
    LLMPAR_CHECK(virtual_stages >= 1, "--virtual-stages ", virtual_stages, "; each pipeline rank holds at least 1");
    LLMPAR_CHECK(schedule == "interleaved" || virtual_stages == 1, "--virtual-stages ", virtual_stages,
                 " needs --schedule interleaved (the other schedules run one chunk per rank)");
    LLMPAR_CHECK(pp > 1 || schedule == "1f1b", "--schedule ", schedule,
                 " needs --pp 2 or more; one stage runs its micro-batches one after another (1f1b)");
    LLMPAR_CHECK(schedule != "interleaved" || (virtual_stages >= 2 && pp >= 2),
                 "--schedule interleaved needs --pp 2 or more and --virtual-stages 2 or more; got --pp ", pp,
                 " --virtual-stages ", virtual_stages);
    LLMPAR_CHECK(zero >= 0 && zero <= 3, "--zero ", zero,
                 " is not a ZeRO stage; use 0 (replicated), 1 (optimizer state sharded), 2 (and gradients) or 3 (and "
                 "parameters)");
    LLMPAR_CHECK(pp == 1 || zero <= 1, "--zero ", zero, " with --pp ", pp,
                 ": ZeRO stages 2 and 3 reduce and gather per micro-batch, which a pipeline interleaves; use --zero 1 "
                 "(or 0) with pipeline parallelism");
    LLMPAR_CHECK(!(schedule == "zb" && recompute == recompute::Mode::full),
                 "--schedule zb keeps each block's activations for its deferred weight pass, which --recompute full "
                 "drops; use --recompute selective or none with zb");
    LLMPAR_CHECK(precision == DType::f32 || precision == DType::bf16 || precision == DType::f16, "--precision ",
                 name_of(precision), " is not one of fp32, bf16, fp16");
    LLMPAR_CHECK(micro_batch >= 1, "--micro-batch ", micro_batch, "; use at least 1 sequence per micro-batch");
    LLMPAR_CHECK(grad_accum >= 1, "--grad-accum ", grad_accum, "; use at least 1 micro-batch per step");
    data.validate();
    static_cast<void>(partition_counts());
  }

  // The layers per virtual stage an explicit --partition lists (empty for even and
  // parameters).
  std::vector<std::int64_t> partition_counts() const {
    std::vector<std::int64_t> counts;
    if (partition == "even" || partition == "parameters") return counts;
    std::size_t at = 0;
    while (at <= partition.size()) {
      const std::size_t comma = std::min(partition.find(',', at), partition.size());
      const std::string item = partition.substr(at, comma - at);
      char* end = nullptr;
      const long long v = std::strtoll(item.c_str(), &end, 10);
      LLMPAR_CHECK(!item.empty() && end != nullptr && *end == '\0', "--partition '", partition,
                   "' is not even, parameters or a comma-separated list of layer counts (e.g. 3,3,2)");
      counts.push_back(v);
      at = comma + 1;
    }
    return counts;
  }

  // The layers of each virtual stage for a model of `block_params.size()` blocks of
  // those parameter counts, whose first stage also holds `first_extra` parameters (the
  // embedding) and whose last `last_extra` (the final norm and the head).
  pipeline::Partition partition_of(std::span<const std::int64_t> block_params, std::int64_t first_extra,
                                   std::int64_t last_extra) const {
    const auto layers = static_cast<std::int64_t>(block_params.size());
    if (partition == "even") return pipeline::even_partition(layers, pp, virtual_stages);
    if (partition == "parameters")
      return pipeline::parameter_partition(std::vector<std::int64_t>(block_params.begin(), block_params.end()),
                                           first_extra, last_extra, pp, virtual_stages);
    return pipeline::explicit_partition(partition_counts(), layers, pp, virtual_stages);
  }
};

// The policy a layout names on `Backend` for a ZeRO stage and a precision, with the
// pipeline schedule and the recomputation from the layout (run-time values). ZeRO 2
// and 3 do not compose with a pipeline (validate() refuses --pp > 1 for them).
template <class Backend, class Precision, int kZero>
using ConfiguredPolicy =
    Compose<Backend, Precision, std::conditional_t<(kZero >= 2), NoPipeline, Pipeline<schedule::Configured>>,
            Data<zero::Stage<kZero>>, recompute::Configured>;

namespace detail {

template <class Backend, class Precision, class F>
decltype(auto) dispatch_zero(int stage, F&& f) {
  switch (stage) {
    case 1:
      return f.template operator()<ConfiguredPolicy<Backend, Precision, 1>>();
    case 2:
      return f.template operator()<ConfiguredPolicy<Backend, Precision, 2>>();
    case 3:
      return f.template operator()<ConfiguredPolicy<Backend, Precision, 3>>();
    default:
      LLMPAR_CHECK(stage == 0, "--zero ", stage, " is not a ZeRO stage; use 0, 1, 2 or 3");
      return f.template operator()<ConfiguredPolicy<Backend, Precision, 0>>();
  }
}

}  // namespace detail

// Calls f.template operator()<Policy>() with the ConfiguredPolicy of `layout`'s
// precision and ZeRO stage on Backend, and returns what it returns. The one place a
// run-time layout becomes a compiled policy.
template <class Backend, class F>
decltype(auto) dispatch(const LayoutConfig& layout, F&& f) {
  switch (layout.precision) {
    case DType::bf16:
      return detail::dispatch_zero<Backend, precision::BF16Mixed>(layout.zero, f);
    case DType::f16:
      return detail::dispatch_zero<Backend, precision::FP16Mixed<precision::DynamicLossScale>>(layout.zero, f);
    default:
      LLMPAR_CHECK(layout.precision == DType::f32, "--precision ", name_of(layout.precision),
                   " is not one of fp32, bf16, fp16");
      return detail::dispatch_zero<Backend, precision::FP32>(layout.zero, f);
  }
}

// A layout of one rank that says what `Policy` fixes: its ZeRO stage and precision, and
// its schedule, chunks and recomputation where those are fixed tags (not Configured).
// The degrees and batches stay the defaults, for the caller to set.
template <ComposedPolicy Policy>
LayoutConfig layout_of() {
  LayoutConfig l;
  l.zero = Policy::kZeroStage;
  l.precision = dtype_of<typename Policy::precision::Compute>();
  if constexpr (!std::is_same_v<typename Policy::pipeline, NoPipeline>) {
    using S = typename Policy::pipeline::Schedule;
    if constexpr (!std::is_same_v<S, schedule::Configured>) {
      l.schedule = S::kFlag;
      l.virtual_stages = S::kChunks;
    }
  }
  if constexpr (!std::is_same_v<typename Policy::recompute, recompute::Configured>)
    l.recompute = Policy::recompute::kMode;
  return l;
}

// The precision a layout's DType names, as train_gpt spells it (fp32, bf16, fp16).
inline const char* precision_flag(DType t) {
  switch (t) {
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "fp16";
    default:
      return "fp32";
  }
}
// What --recompute names: none, selective, full.
inline recompute::Mode recompute_of_flag(const std::string& flag) {
  if (flag == "full") return recompute::Mode::full;
  if (flag == "selective") return recompute::Mode::selective;
  LLMPAR_CHECK(flag == "none", "--recompute ", flag, " is not one of none, selective, full");
  return recompute::Mode::none;
}

// And back: "fp32", "bf16", "fp16".
inline DType precision_of_flag(const std::string& flag) {
  if (flag == "bf16") return DType::bf16;
  if (flag == "fp16") return DType::f16;
  LLMPAR_CHECK(flag == "fp32", "--precision ", flag, " is not one of fp32, bf16, fp16");
  return DType::f32;
}

}  // namespace llmpar::parallel
