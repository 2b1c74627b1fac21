// llmpar/plan/cost.hpp — the planner's cost model: for a model (GPT-2 or Llama, as a
// plan::ModelShape), a layout and a cluster, the bytes each rank holds and the time a
// training step takes.
//
// Why it is built this way:
//  - Memory is predicted from the same allocations the trainer makes and reports
//    (Trainer::memory(): parallel::MemoryReport), term by term, not from a rule of
//    thumb. The parameter store is cut into GradSync's buckets (units in reverse
//    order, each rounded to 64 bytes, a bucket closed past --bucket-mb, one bucket per
//    unit under ZeRO 3), so the ZeRO shards, the padding and the largest bucket (which
//    sizes ZeRO 2/3's pooled buffers) come out as GradSync computes them. Activations
//    follow what each block's Saved, the model's Stash and its shared backward scratch
//    reserve (models/prenorm_block.hpp, nn/attention.hpp, nn/mlp.hpp,
//    models/transformer.hpp), with the executor holding one
//    Stash per micro-batch in flight: that count comes from pipeline::simulate of the
//    schedule the run would use (pipeline/schedule.hpp), not from a formula per
//    schedule. Estimator tables that guess activations (the DeepSpeed estimator's
//    0.49 GB against a measured 14.7 GB) are what this avoids.
//  - Time is compute, communication and bubble. Compute is every GEMM of the step at
//    its own shape on the cluster's GEMM curve (plan/cluster.hpp: small products, as
//    tensor parallelism makes them, run below the peak), plus memory-bound work
//    (norms, GELU, residual adds, the loss) at the cluster's element-wise rate, the
//    attention core at its own rate, and the optimizer at the memory bandwidth.
//    Communication is each collective's bytes over the busbw of the link its group
//    spans (comm::bus_factor: the same definition the collective benchmarks report)
//    plus a latency per ring step. The pipeline's bubble is pipeline::simulate's
//    makespan over the slowest stage's action costs.
//  - Ranks are placed as comm::Grid places them: tp adjacent, then cp, dp, pp. A
//    group of ranks that fits in a node uses the node's link.
//  - Every estimate is per rank of the most loaded pipeline stage (the first holds the
//    embedding, the last the LM head and its logits): the rank that runs out of memory
//    first and the stage that sets the pipeline's pace.
//  - The degrees a search tries (degree_choices) and the order it lists layouts in
//    (listed_before) are here, beside the model, so that a planner and its tests share
//    them; which layouts a trainer accepts beyond these is the trainer's to check.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "llmpar/comm/types.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/models/llama.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/parallel/layout.hpp"
#include "llmpar/pipeline/partition.hpp"
#include "llmpar/pipeline/schedule.hpp"
#include "llmpar/plan/cluster.hpp"
#include "llmpar/train/metrics.hpp"

namespace llmpar::plan {

// A layout is parallel::LayoutConfig: the one the trainer and train_gpt check and run.
using parallel::LayoutConfig;

// One rank's bytes, as parallel::MemoryReport counts them, with the model's scratch
// apart (MemoryReport counts it with the activations).
struct Memory {
  double parameters = 0.0;     // parameter values kept between steps (whole, or the ZeRO-3 shard)
  double gradients = 0.0;      // gradients (whole, or the ZeRO-2/3 shard)
  double optimizer = 0.0;      // AdamW moments and, for 16-bit storage, f32 master weights
  double activations = 0.0;    // stashes of the micro-batches in flight, the residual gradients, targets
  double workspace = 0.0;      // the blocks' shared backward scratch, recomputation buffers, the loss's stats
  double communication = 0.0;  // ZeRO buckets in flight, reduce-scatter staging, sequence-parallel norms
  double reserved = 0.0;       // the device's own (cluster): a CUDA context, libraries' workspaces

  double model_state() const { return parameters + gradients + optimizer; }
  // What the trainer's MemoryReport totals: everything but the reserved bytes.
  double measured_total() const { return model_state() + activations + workspace + communication; }
  double total() const { return measured_total() + reserved; }
};

// One step's time on the slowest stage, in seconds.
struct Time {
  double compute = 0.0;        // this stage's forward and backward of every micro-batch, recomputation included
  double tensor_comm = 0.0;    // tensor/sequence-parallel collectives (inside compute's critical path)
  double context_comm = 0.0;   // ring attention's K/V blocks not hidden under attention (inside compute)
  double pipeline_comm = 0.0;  // activations and gradients between stages
  double bubble = 0.0;         // the stage's idle time inside the pipeline
  double data_comm = 0.0;      // data-parallel reductions and gathers, the part not hidden under backward
  double optimizer = 0.0;      // gradient norm and the AdamW update
  double step = 0.0;
  double mfu = 0.0;  // model FLOPs (6N + attention per token) over the step and the cluster's peak
};

struct Estimate {
  Memory memory;
  int memory_stage = 0;  // the pipeline rank whose memory it is
  Time time;
  bool fits = true;
  std::string why;  // when it does not fit
};

// What the cost model needs of a model: the pre-norm Transformer's sizes, whichever
// Spec built it. GPT-2 and Llama convert to it (implicitly: every function below takes
// either config).
struct ModelShape {
  std::int64_t layers = 0, dim = 0, heads = 0, kv_heads = 0;
  std::int64_t hidden = 0;         // the MLP's hidden units (GPT-2 4C, Llama ffn_dim)
  int projections = 1;             // the MLP's up projections: 1 (GELU), 2 (gated: SwiGLU)
  bool biases = true;              // on the linear layers (GPT-2 yes, Llama no)
  int norm_tensors = 2;            // a norm's parameters, C each: LayerNorm 2, RMSNorm 1
  int norm_stats = 2;              // what a norm keeps per row: LayerNorm's mean and rstd, RMSNorm's rstd
  std::int64_t position_rows = 0;  // a learned position table's rows (GPT-2's max_seq; Llama none)
  std::int64_t padded_vocab = 0;
  bool tied = true;                                                                  // the LM head is the token table
  std::int64_t parameters = 0;                                                       // the serial model's
  std::int64_t block_parameters = 0, embedding_parameters = 0, head_parameters = 0;  // for the partition

  ModelShape(const models::GPT2Config& c)  // NOLINT(google-explicit-constructor): a view of either config
      : layers(c.layers),
        dim(c.dim),
        heads(c.heads),
        kv_heads(c.heads),
        hidden(4 * c.dim),
        position_rows(c.max_seq),
        padded_vocab(c.padded_vocab),
        parameters(c.num_parameters()),
        block_parameters(c.block_parameters()),
        embedding_parameters(c.embedding_parameters()),
        head_parameters(c.head_parameters()) {}
  ModelShape(const models::LlamaConfig& c)  // NOLINT(google-explicit-constructor)
      : layers(c.layers),
        dim(c.dim),
        heads(c.heads),
        kv_heads(c.kv_heads),
        hidden(c.ffn_dim),
        projections(2),
        biases(false),
        norm_tensors(1),
        norm_stats(1),
        padded_vocab(c.padded_vocab),
        tied(c.tie_embeddings),
        parameters(c.num_parameters()),
        block_parameters(c.block_parameters()),
        embedding_parameters(c.embedding_parameters()),
        head_parameters(c.head_parameters()) {}

  std::int64_t head_dim() const { return dim / heads; }
  // The fused QKV projection's outputs: (heads + 2 kv_heads) · head_dim.
  std::int64_t qkv_features() const { return (heads + 2 * kv_heads) * head_dim(); }
  // The serial model's parameters at sequence length seq (a position table grows to it).
  double parameters_at(std::int64_t seq) const {
    return static_cast<double>(parameters) +
           (position_rows > 0 ? static_cast<double>(std::max<std::int64_t>(0, seq - position_rows) * dim) : 0.0);
  }
  // The pipeline partition the layout's --partition rule gives.
  pipeline::Partition partition(const LayoutConfig& l) const {
    return l.partition_of(std::vector<std::int64_t>(static_cast<std::size_t>(layers), block_parameters),
                          embedding_parameters, head_parameters);
  }
};

namespace detail {

using llmpar::detail::concat;

inline double round_to(double n, double to) { return std::ceil(n / to) * to; }

// What the workload is, per micro-batch, for one rank: S its rows of each sequence
// (seq / cp), Ql the QKV features, Hl the MLP's hidden units, P its up projections, on
// this tp rank; KVl its kv heads' channels (ring attention's blocks).
struct Shapes {
  double B, S, R, Rl, C, Cl, NHl, Vl, Ql, Hl, P, KVl, stats, t, acc = 4.0;
  int tp, cp;
};

inline Shapes shapes_of(const ModelShape& cfg, std::int64_t seq, const LayoutConfig& l) {
  Shapes s{};
  s.B = static_cast<double>(l.micro_batch);
  s.S = static_cast<double>(seq) / l.cp;
  s.cp = l.cp;
  s.R = s.B * s.S;
  s.tp = l.tp;
  s.Rl = l.sp ? s.R / l.tp : s.R;
  s.C = static_cast<double>(cfg.dim);
  s.Cl = s.C / l.tp;
  s.NHl = static_cast<double>(cfg.heads) / l.tp;
  s.Vl = static_cast<double>(cfg.padded_vocab) / l.tp;
  s.Ql = static_cast<double>(cfg.qkv_features()) / l.tp;
  s.Hl = static_cast<double>(cfg.hidden) / l.tp;
  s.KVl = static_cast<double>(cfg.kv_heads * cfg.head_dim()) / l.tp;
  s.P = cfg.projections;
  s.stats = cfg.norm_stats;
  s.t = static_cast<double>(size_of(l.precision));
  return s;
}

// A block's parameters on one tp rank, as the store binds them: two norms, the QKV and
// output projections, the MLP's up and down projections (each with its bias, if any).
inline std::vector<double> block_parameters(const ModelShape& cfg, int tp) {
  const double C = static_cast<double>(cfg.dim), Q = static_cast<double>(cfg.qkv_features()) / tp;
  const double up = cfg.projections * static_cast<double>(cfg.hidden) / tp, H = static_cast<double>(cfg.hidden) / tp;
  std::vector<double> p;
  auto norm = [&] { p.insert(p.end(), static_cast<std::size_t>(cfg.norm_tensors), C); };
  auto linear = [&](double out, double in, double bias) {
    p.push_back(out * in);
    if (cfg.biases) p.push_back(bias);
  };
  norm();
  linear(Q, C, Q);
  linear(C, C / tp, C);
  norm();
  linear(up, C, up);
  linear(C, H, C);
  return p;
}

// The bytes one block's Saved holds for a micro-batch (models/prenorm_block.hpp,
// nn/attention.hpp, nn/mlp.hpp): the norms' statistics, the block's three (Rl, C)
// rows, qkv, the MLP's up projection and activation, the attention core's output and lse.
inline double block_saved_bytes(const Shapes& s, bool selective) {
  const double norms = 2 * s.stats * s.Rl * s.acc;
  const double kept = (3 * s.Rl * s.C + s.R * s.Ql + s.R * s.P * s.Hl + s.R * s.Hl) * s.t;
  const double attention = selective ? 0.0 : s.R * s.Cl * s.t + s.B * s.NHl * s.S * s.acc;
  return norms + kept + attention;
}

// The zero-bubble schedule's deferred weight-gradient operands of one block.
inline double block_deferred_bytes(const Shapes& s, bool sp, bool selective) {
  double n = 2 * s.R * s.C + s.R * s.P * s.Hl + s.R * s.Ql;
  if (sp) n += 2 * s.R * s.C;
  if (selective) n += s.R * s.Cl;
  return n * s.t;
}

// A time for `bytes` through a collective over `ranks` ranks on `link`.
inline double collective_seconds(comm::Collective c, double bytes, int ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0.0) return 0.0;
  const double steps = c == comm::Collective::all_reduce ? 2.0 * (ranks - 1) : ranks - 1.0;
  return bytes * comm::bus_factor(c, ranks) / link.busbw + steps * link.latency;
}

}  // namespace detail

// The pipeline rank's units' parameter counts (forward order: embedding, blocks, final
// norm, the head's copy of the token table), each a list of this tp rank's tensors.
inline std::vector<std::vector<double>> unit_parameters(const ModelShape& cfg, const LayoutConfig& l, int stage) {
  const pipeline::Placement pl{
      .stages = l.pp, .chunks = l.virtual_stages, .rank = stage, .partition = cfg.partition(l)};
  const double C = static_cast<double>(cfg.dim), table = static_cast<double>(cfg.padded_vocab) / l.tp * C;
  std::vector<std::vector<double>> units;
  if (pl.first()) {
    units.push_back({table});
    if (cfg.position_rows > 0) units.back().push_back(static_cast<double>(cfg.position_rows) * C);
  }
  for (int c = 0; c < pl.chunks; ++c)
    for (std::int64_t b = pl.begin(c); b < pl.end(c); ++b) units.push_back(detail::block_parameters(cfg, l.tp));
  if (pl.last()) {
    units.push_back(std::vector<double>(static_cast<std::size_t>(cfg.norm_tensors), C));
    if (!pl.first() || !cfg.tied) units.push_back({table});  // the head: the table's copy, or its own
  }
  return units;
}

// GradSync's buckets over a stage's units (parallel/grad_sync.hpp plan_layout).
struct Buckets {
  double size = 0.0;        // elements of the store, padding included
  double shard = 0.0;       // this dp rank's elements (sum of the buckets' blocks)
  double largest = 0.0;     // the largest bucket
  double parameters = 0.0;  // real parameter elements (no padding)
  int count = 0;
};

inline Buckets bucket_layout(const std::vector<std::vector<double>>& units, const LayoutConfig& l) {
  const double align = static_cast<double>(kHostAlignment) / static_cast<double>(size_of(l.precision));
  const double bucket_elements = std::max(1.0, std::floor(static_cast<double>(l.data.bucket_bytes) / 4.0));
  Buckets b;
  double offset = 0.0, begin = 0.0;
  for (int u = static_cast<int>(units.size()) - 1; u >= 0; --u) {
    for (double n : units[static_cast<std::size_t>(u)]) {
      offset += detail::round_to(n, align);
      b.parameters += n;
    }
    if (l.zero == 3 || u == 0 || offset - begin >= bucket_elements) {
      const double size = detail::round_to(std::max(offset - begin, 1.0), align * l.replicas());
      b.largest = std::max(b.largest, size);
      b.shard += size / l.replicas();
      offset = begin + size;
      begin = offset;
      ++b.count;
    }
  }
  b.size = offset;
  return b;
}

// The schedule's most micro-batches in flight on each pipeline rank, and its makespan
// for unit forward/backward costs.
inline pipeline::Report schedule_report(const LayoutConfig& l, pipeline::Cost cost = {}) {
  const pipeline::Shape shape{
      .stages = l.pp, .chunks = l.virtual_stages, .micro_batches = static_cast<int>(l.grad_accum)};
  return pipeline::simulate(pipeline::make_schedule(l.pp > 1 ? l.schedule : "1f1b", shape), shape, cost);
}

// One pipeline rank's bytes.
inline Memory stage_memory(const ModelShape& cfg, std::int64_t seq, const LayoutConfig& l, int stage, int in_flight,
                           const Cluster& cluster) {
  const pipeline::Placement pl{
      .stages = l.pp, .chunks = l.virtual_stages, .rank = stage, .partition = cfg.partition(l)};
  const detail::Shapes s = detail::shapes_of(cfg, seq, l);
  const Buckets b = bucket_layout(unit_parameters(cfg, l, stage), l);
  const double t = s.t, g = 4.0;
  const bool selective = l.recompute == recompute::Mode::selective, full = l.recompute == recompute::Mode::full;
  Memory m;
  m.parameters = (l.zero < 3 ? b.size : b.shard) * t;
  m.gradients = (l.zero < 2 ? b.size : b.shard) * g;
  const double state = l.zero == 0 ? b.parameters : b.parameters / l.replicas();
  m.optimizer = state * 4.0 * (l.precision == DType::f32 ? 2.0 : 3.0);

  // Stashes: one per micro-batch in flight, each grown to the largest chunk it served.
  std::int64_t most_blocks = 0;
  for (int c = 0; c < pl.chunks; ++c) most_blocks = std::max(most_blocks, pl.end(c) - pl.begin(c));
  const double n = static_cast<double>(most_blocks);
  double stash = (n + 1) * s.Rl * s.C * t;
  if (!full) stash += n * detail::block_saved_bytes(s, selective);
  if (l.pp > 1 && l.schedule == "zb") stash += n * detail::block_deferred_bytes(s, l.sp, selective);
  if (pl.first()) stash += s.R * 4.0;  // token ids
  if (pl.last())
    stash += s.stats * s.Rl * s.acc + s.R * s.C * t + (l.sp ? s.Rl * s.C * t : 0.0) + s.R * s.Vl * t + s.R * s.acc;
  m.activations = in_flight * stash + 2 * s.Rl * s.C * t;        // the stashes, the residual gradients
  if (pl.last()) m.activations += 2 * s.R * 4.0;                 // targets, the host's losses
  if (l.pp > 1 && !pl.first()) m.activations += s.Rl * s.C * t;  // the gradient sent back
  // The blocks' shared backward scratch (wide0 and qkv at least GPT-2's 4C and 3C, c0,
  // c1; a gated MLP's wide1; gathered and partial rows under sequence parallelism; the
  // attention core under selective recomputation), full recomputation's block, the
  // loss's softmax stats.
  m.workspace = (std::max(4 * s.C, s.P * s.Hl) + std::max(3 * s.C, s.Ql) + 2 * s.C) * s.R * t;
  if (s.P > 1) m.workspace += s.R * s.Hl * t;
  // Context parallelism (nn/context_parallel.hpp). Ring attention: two K/V blocks and
  // three of their gradients (in hand, passing on, arriving), the queries' state (o, m,
  // l), dq and D, and dq's or dK/dV's staging in T. The all-to-all: its send and receive
  // buffers (qkv's size), and the core's output, ∂output and ∂qkv over this rank's heads.
  if (s.cp > 1 && l.cp_comm == nn::CpComm::ring)
    m.workspace += s.R * 2 * s.KVl * (2 * t + 3 * s.acc) + 2 * s.R * s.Cl * s.acc + 3 * s.B * s.NHl * s.S * s.acc +
                   s.R * std::max(s.Cl, 2 * s.KVl) * t;
  if (s.cp > 1 && l.cp_comm == nn::CpComm::all_to_all) m.workspace += (3 * s.Ql + 2 * s.Cl) * s.R * t;
  if (l.sp) m.workspace += 2 * s.R * s.C * t;
  if (selective) m.workspace += s.R * s.Cl * t + s.B * s.NHl * s.S * s.acc;
  if (full) m.workspace += detail::block_saved_bytes(s, false) + s.Rl * s.C * t;
  if (pl.last()) m.workspace += (1 + l.tp) * s.R * 3.0 * s.acc;
  // ZeRO 2/3: pooled buckets of the largest bucket's size, as many as are in use or in
  // flight at once. The pools grow with the overlap; these are the counts measured on
  // thread ranks (ZeRO 2: three gradient buckets, one filling and two reducing; ZeRO 3,
  // whose buckets are single units: two gradient and two value buckets, in use and
  // prefetched), plus the staging of one block of a reduce-scatter.
  if (l.zero == 2) m.communication += 3 * b.largest * g + b.largest / l.replicas() * g;
  if (l.zero == 3) m.communication += 2 * b.largest * g + b.largest / l.replicas() * g + 2 * b.largest * t;
  if (l.sp) {
    const double per_norm = static_cast<double>(cfg.norm_tensors) * s.C;
    const double norms = static_cast<double>(pl.last() ? 1 : 0) * per_norm + n * l.virtual_stages * 2 * per_norm;
    m.communication += (l.zero == 0 ? norms : norms / l.replicas()) * g;
  }
  m.reserved = cluster.reserved_bytes;
  return m;
}

// The memory of pipeline rank `stage` (every tp and dp rank of a stage holds the same).
inline Memory rank_memory(const ModelShape& cfg, std::int64_t seq, const LayoutConfig& l, int stage,
                          const Cluster& cluster) {
  const pipeline::Report r = schedule_report(l);
  return stage_memory(cfg, seq, l, stage, r.ranks[static_cast<std::size_t>(stage)].max_in_flight, cluster);
}

// The memory of the rank that holds the most, and which pipeline rank that is.
inline std::pair<Memory, int> peak_memory(const ModelShape& cfg, std::int64_t seq, const LayoutConfig& l,
                                          const Cluster& cluster) {
  const pipeline::Report r = schedule_report(l);
  Memory best;
  int where = 0;
  for (int stage = 0; stage < l.pp; ++stage) {
    const Memory m = stage_memory(cfg, seq, l, stage, r.ranks[static_cast<std::size_t>(stage)].max_in_flight, cluster);
    if (stage == 0 || m.total() > best.total()) {
      best = m;
      where = stage;
    }
  }
  return {best, where};
}

// The link a group of `size` ranks spaced `stride` apart uses (ranks are numbered tp
// fastest, then cp, dp, pp, as comm::Grid numbers them).
inline const Link& group_link(const Cluster& c, int size, int stride) {
  return static_cast<std::int64_t>(size) * stride <= c.devices_per_node || size == 1 ? c.intra : c.inter;
}

// How many ranks share one device's compute, bandwidth and memory: on a shared node
// (a CPU) every rank the node runs, 1 on GPUs.
inline double ranks_sharing(const LayoutConfig& l, const Cluster& c) {
  return c.shared_node ? std::ceil(static_cast<double>(l.world()) / c.nodes) : 1.0;
}

// The step time of a layout.
inline Time step_time(const ModelShape& cfg, std::int64_t seq, const LayoutConfig& l, const Cluster& c) {
  const detail::Shapes s = detail::shapes_of(cfg, seq, l);
  const double share = ranks_sharing(l, c);
  Gemm gemm = c.gemm(l.precision);
  gemm.peak_flops /= share;
  const double bandwidth = c.memory_bandwidth / share;
  const Kernels& kernels = c.kernels(l.precision);
  const double elementwise_rate = kernels.elementwise / share, attention_rate = kernels.attention / share;
  const bool selective = l.recompute == recompute::Mode::selective, full = l.recompute == recompute::Mode::full;
  const Link& tp_link = group_link(c, l.tp, 1);
  const Link& dp_link = group_link(c, l.replicas(), l.tp);
  const Link& pp_link = group_link(c, l.pp > 1 ? 2 : 1, l.tp * l.cp * l.dp);

  // One block, one micro-batch: the four linear layers' GEMMs (backward: the input and
  // the weight gradient), attention (QKᵀ and PV, causal: half the square), and the
  // memory-bound rest (norms, GELU, residual adds, softmax: about the Saved bytes
  // written once and read back twice forward, three times backward).
  auto linear = [&](double in, double out) { return gemm.seconds(s.R, out, in); };
  const double gemms = linear(s.C, s.Ql) + linear(s.Cl, s.C) + linear(s.C, s.P * s.Hl) + linear(s.Hl, s.C);
  const double head_dim = static_cast<double>(cfg.head_dim());
  // 4·B·NH·S·T·d over the whole sequence T = cp·S, half of it causal: each cp rank's
  // share of the (load-balanced) causal square.
  const double attention_flops = 2.0 * s.B * s.NHl * s.S * s.S * s.cp * head_dim;
  const double attention = attention_flops / attention_rate;
  const double elementwise = detail::block_saved_bytes(s, false) / elementwise_rate;
  // Tensor parallelism per block and micro-batch: two all-reduces of (B·S, C) each way;
  // under sequence parallelism two all-gathers and two reduce-scatters forward, and
  // backward also the two gathers of the norms' outputs again for the weight gradients.
  const double tp_bytes = s.R * s.C * s.t;
  const double gather = detail::collective_seconds(comm::Collective::all_gather, tp_bytes, l.tp, tp_link);
  const double scatter = detail::collective_seconds(comm::Collective::reduce_scatter, tp_bytes, l.tp, tp_link);
  const double reduce = detail::collective_seconds(comm::Collective::all_reduce, tp_bytes, l.tp, tp_link);
  const double tp_forward = l.sp ? 2 * gather + 2 * scatter : 2 * reduce;
  const double tp_backward = l.sp ? 4 * gather + 2 * scatter : 2 * reduce;
  // Context parallelism. Ring attention: cp - 1 K/V blocks on, forward and backward,
  // each hidden under a step's blocks when those take longer; in backward the dK/dV of
  // each block (f32) travels one step behind it, with the next step's K/V, and after the
  // last step goes home (not hidden). The all-to-all: qkv to the heads and the output
  // back forward; the output, ∂output and ∂qkv backward (and the output again under
  // selective recomputation); none hidden.
  const Link& cp_link = group_link(c, l.cp, l.tp);
  const double kv_bytes = s.R * 2 * s.KVl * s.t, dkv_bytes = kv_bytes / s.t * s.acc;
  double cp_forward = 0.0, cp_backward = 0.0;
  if (l.cp > 1 && l.cp_comm == nn::CpComm::ring) {
    const double kv_step = kv_bytes / cp_link.busbw + cp_link.latency;
    const double dkv_step = dkv_bytes / cp_link.busbw + cp_link.latency;
    const double forward_step = attention / l.cp, backward_step = 2.5 * attention / l.cp;  // one step's blocks
    cp_forward = (l.cp - 1) * std::max(0.0, kv_step - forward_step);
    cp_backward = std::max(0.0, kv_step - backward_step) +
                  (l.cp - 2) * std::max(0.0, kv_step + dkv_step - cp_link.latency - backward_step) +
                  std::max(0.0, dkv_step - backward_step) + dkv_step;
  } else if (l.cp > 1) {
    const auto exchange = [&](double features) {
      return detail::collective_seconds(comm::Collective::all_to_all, s.R * features * s.t, l.cp, cp_link);
    };
    cp_forward = exchange(s.Ql) + exchange(s.Cl);
    cp_backward = 2 * exchange(s.Cl) + exchange(s.Ql) + (selective ? exchange(s.Cl) : 0.0);
  }
  // Fixed costs per call: a block's forward makes about 6 kernel calls and 4 GEMMs, its
  // backward about 10 and 8 (what makes many small micro-batches slower than few large).
  const double calls_forward = 6 * c.kernel_overhead + 4 * c.gemm_overhead;
  const double calls_backward = 10 * c.kernel_overhead + 8 * c.gemm_overhead;
  const double block_forward = gemms + attention + 3 * elementwise + tp_forward + cp_forward + calls_forward;
  const double block_backward = 2 * gemms + 2.5 * attention + 3 * elementwise + tp_backward + cp_backward +
                                calls_backward +
                                (full        ? block_forward
                                 : selective ? attention
                                             : 0.0);

  Time time;
  double worst_forward = 0.0, worst_backward = 0.0, worst_weight = 0.0, worst_tp = 0.0, worst_cp = 0.0;
  for (int stage = 0; stage < l.pp; ++stage) {
    const pipeline::Placement pl{
        .stages = l.pp, .chunks = l.virtual_stages, .rank = stage, .partition = cfg.partition(l)};
    double blocks = 0;
    for (int ch = 0; ch < pl.chunks; ++ch) blocks += static_cast<double>(pl.end(ch) - pl.begin(ch));
    double forward = blocks * block_forward, backward = blocks * block_backward;
    double weight = blocks * gemms;  // the weight-gradient GEMMs a zero-bubble schedule defers
    const double tp = blocks * (tp_forward + tp_backward + (full ? tp_forward : 0.0));
    const double cp = blocks * (cp_forward + cp_backward + (full ? cp_forward : 0.0));
    if (pl.last()) {  // the final norm, the LM head (and its two gradients), the loss
      const double head = gemm.seconds(s.R, s.Vl, s.C);
      const double loss = s.R * s.Vl * s.t * 3 / elementwise_rate;
      forward += head + loss;
      backward += 2 * head + loss;
      weight += head;
    }
    if (pl.first()) {
      const double embed = s.R * s.C * s.t * 3 / elementwise_rate;
      forward += embed;
      backward += embed;
    }
    if (l.pp > 1) {  // an activation out and a gradient back per micro-batch and chunk
      const double p2p = pl.chunks * (s.Rl * s.C * s.t / pp_link.busbw + pp_link.latency);
      forward += p2p;
      backward += p2p;
      time.pipeline_comm = std::max(time.pipeline_comm, 2 * p2p * static_cast<double>(l.grad_accum));
    }
    if (forward + backward > worst_forward + worst_backward) {
      worst_forward = forward;
      worst_backward = backward;
      worst_weight = weight;
      worst_tp = tp;
      worst_cp = cp;
    }
  }
  const double m = static_cast<double>(l.grad_accum);
  // Ranks sharing a node's cores (a rank per core, each synchronising with the others)
  // run at the measured fraction of one rank on them all; more ranks than cores take
  // turns, at the measured loss on top.
  if (c.shared_node && share > 1.0) {
    const double speed = c.shared_ranks * (share > static_cast<double>(c.devices_per_node) ? c.oversubscribed : 1.0);
    worst_forward /= speed;
    worst_backward /= speed;
    worst_weight /= speed;
  }
  time.compute = m * (worst_forward + worst_backward);
  time.tensor_comm = m * worst_tp;
  time.context_comm = m * worst_cp;
  if (l.pp > 1) {
    const pipeline::Report r = schedule_report(
        l,
        {.forward = worst_forward, .backward = worst_backward, .weight = std::min(worst_weight, 0.9 * worst_backward)});
    // More ranks than cores: a rank idle in the bubble leaves its turn on a core to the
    // ranks that have work, so the step is the longer of the work over the cores (the
    // compute, every rank at its share) and the schedule's critical path with a core per
    // rank (its makespan at cores / share of these times). 2 stages of 2 replicas on 2
    // cores: the bubble is gone, since one stage's two ranks keep both cores busy.
    const double oversubscription =
        c.shared_node ? std::max(1.0, share / static_cast<double>(c.devices_per_node)) : 1.0;
    time.bubble = std::max(0.0, r.makespan / oversubscription - time.compute);
  }

  // Data parallelism over this stage's store: ZeRO 0 all-reduces the gradients once a
  // step; 1 reduce-scatters them and all-gathers the updated values; 2 reduce-scatters
  // every micro-batch; 3 also gathers every bucket's values for each forward and
  // backward. The last bucket's reduction comes after backward and is never hidden.
  const Buckets b = bucket_layout(unit_parameters(cfg, l, l.pp - 1), l);
  const double grad_bytes = b.size * 4.0, value_bytes = b.size * s.t;
  double dp = 0.0;
  if (l.zero == 0) dp = detail::collective_seconds(comm::Collective::all_reduce, grad_bytes, l.replicas(), dp_link);
  if (l.zero >= 1) {
    const double reductions = l.zero >= 2 ? m : 1.0;
    dp = reductions * detail::collective_seconds(comm::Collective::reduce_scatter, grad_bytes, l.replicas(), dp_link);
    if (l.zero < 3)
      dp += detail::collective_seconds(comm::Collective::all_gather, value_bytes, l.replicas(), dp_link);
    else
      dp += 2 * m * detail::collective_seconds(comm::Collective::all_gather, value_bytes, l.replicas(), dp_link);
  }
  const double last_bucket = b.count > 0 ? dp / b.count : 0.0;
  time.data_comm = l.replicas() > 1 ? last_bucket + (1.0 - c.overlap) * (dp - last_bucket) : 0.0;
  // Each collective of the communication thread also costs the compute its overhead.
  const double buckets = static_cast<double>(b.count);
  const double collectives = l.zero == 0   ? buckets
                             : l.zero == 1 ? 2 * buckets
                             : l.zero == 2 ? (m + 1) * buckets
                                           : 3 * m * buckets;
  if (l.replicas() > 1) time.data_comm += collectives * c.collective_overhead;
  if (l.pp > 1 && cfg.tied)  // the tied token table's gradient, summed over the first and last stage
    time.data_comm += detail::collective_seconds(comm::Collective::all_reduce, s.Vl * s.C * 4.0, 2,
                                                 group_link(c, 2, l.tp * l.cp * l.dp));

  // The gradient norm reads every gradient; AdamW reads gradients, values and both
  // moments and writes the three back (and the master copy of 16-bit values).
  const double state = l.zero == 0 ? b.parameters : b.parameters / l.replicas();
  time.optimizer =
      (b.size * 4.0 + state * (4.0 + 2 * 12.0 + (l.precision == DType::f32 ? 0.0 : 8.0 + s.t))) / bandwidth;
  time.step = time.compute + time.bubble + time.data_comm + time.optimizer;

  const double flops_per_token =
      train::flops_per_token(static_cast<std::int64_t>(cfg.parameters_at(seq)), cfg.layers, cfg.dim, seq);
  const double tokens = static_cast<double>(l.global_batch() * seq);
  const double peak = c.gemm(l.precision).peak_flops * (c.shared_node ? 1.0 : static_cast<double>(l.world()));
  time.mfu = flops_per_token * tokens / (time.step * peak);
  return time;
}

// Memory and time of a layout on a cluster, and whether it fits.
inline Estimate estimate(const ModelShape& cfg, std::int64_t seq, const LayoutConfig& l, const Cluster& c) {
  Estimate e;
  std::tie(e.memory, e.memory_stage) = peak_memory(cfg, seq, l, c);
  e.time = step_time(cfg, seq, l, c);
  // Ranks sharing a node share its memory.
  const double need = e.memory.total() * ranks_sharing(l, c);
  if (need > c.memory_bytes) {
    e.fits = false;
    const Memory& m = e.memory;
    const double largest = std::max({m.parameters + m.gradients + m.optimizer, m.activations + m.workspace});
    e.why = detail::concat("needs ", need / (1 << 30), " GiB of ", c.memory_bytes / (1 << 30), " GiB (",
                           largest == m.activations + m.workspace
                               ? "mostly activations: lower --micro-batch, or --recompute selective/full"
                               : "mostly model state: a higher --zero stage, or more tp/pp",
                           ")");
  }
  return e;
}

// ---- The search: the degrees it tries and the order it lists layouts in.

// Whether context parallelism of degree cp cuts a sequence of seq tokens: ring
// attention balances the causal square by giving each rank two of 2·cp equal chunks.
inline bool cp_cuts(std::int64_t seq, int cp) { return cp == 1 || (cp > 1 && seq % (2 * cp) == 0); }

// A layout's degrees: tp · cp · pp · dp ranks.
struct Degrees {
  int tp = 1, cp = 1, pp = 1, dp = 1;
};

// The degrees a search of `world` ranks of cluster c tries for sequences of seq tokens:
// tp inside a node (its collectives run in every block), cp where it cuts the sequence
// (cp_cuts), pp, and dp for the ranks left. fixed_cp keeps the context-parallel degree
// the user gave (--cp), checked against the ranks and the sequence; without it, every
// degree that cuts the sequence is tried.
inline std::vector<Degrees> degree_choices(const Cluster& c, int world, std::int64_t seq,
                                           std::optional<int> fixed_cp = std::nullopt) {
  LLMPAR_CHECK(world >= 1 && seq >= 1, "a search needs ranks and a sequence; got ", world, " ranks, seq ", seq);
  auto divisors = [](int n) {
    std::vector<int> d;
    for (int i = 1; i <= n; ++i)
      if (n % i == 0) d.push_back(i);
    return d;
  };
  if (fixed_cp) {
    std::string usable;  // the degrees that would work, for the messages
    for (int cp : divisors(world))
      if (cp_cuts(seq, cp)) usable += (usable.empty() ? "" : ", ") + std::to_string(cp);
    const int cp = *fixed_cp;
    LLMPAR_CHECK(cp >= 1, "--cp ", cp, "; the context-parallel degree is at least 1 (1: none), e.g. one of ", usable);
    LLMPAR_CHECK(world % cp == 0, "--cp ", cp, " does not divide the ", world, " ranks of ", c.name,
                 "; use a --cp that divides them and cuts --seq ", seq, ": ", usable);
    LLMPAR_CHECK(cp_cuts(seq, cp), "--seq ", seq, " is not divisible by 2 x --cp ", cp, " = ", 2 * cp,
                 " (context parallelism cuts each sequence into 2 x cp chunks); use a --seq that is a multiple of ",
                 2 * cp, ", or a --cp that cuts it and divides the ", world, " ranks: ", usable);
  }
  std::vector<Degrees> out;
  for (int tp : divisors(world)) {
    if (tp > c.devices_per_node) continue;
    for (int cp : divisors(world / tp)) {
      if (fixed_cp ? cp != *fixed_cp : !cp_cuts(seq, cp)) continue;
      for (int pp : divisors(world / (tp * cp))) out.push_back({tp, cp, pp, world / (tp * cp * pp)});
    }
  }
  return out;
}

// The order a planner lists layouts in: those that fit before those that do not, each
// by step time (a strict weak order, for std::stable_sort).
inline bool listed_before(const Estimate& a, const Estimate& b) {
  if (a.fits != b.fits) return a.fits;
  return a.time.step < b.time.step;
}

}  // namespace llmpar::plan
