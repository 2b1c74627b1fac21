// What the data- and pipeline-parallel equivalence tests share (thread ranks and MPI
// processes): five training steps of GPT-2 (or of a Llama: Layout::llama) through
// train::Trainer under a composed
// layout (tp x pp x dp, a ZeRO stage, a pipeline schedule, recomputation), with the
// reduced gradients of the first step and the final parameters written into full
// tensors by the ranks that own them, to be compared with the serial run.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/comm/grid.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/models/llama.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/parallel/grad_sync.hpp"
#include "llmpar/parallel/layout.hpp"
#include "llmpar/pipeline/partition.hpp"
#include "llmpar/train/trainer.hpp"
#include "tensor_parallel_test_util.hpp"

namespace llmpar::dp_test {

using tp_test::relative_difference;

inline models::GPT2Config config(std::int64_t layers = 2) {
  return {.layers = layers, .heads = 4, .dim = 32, .max_seq = 16, .vocab = 50, .padded_vocab = 64, .init_std = 0.05f};
}
// The Llama of the same size: 4 query heads reading 2 kv heads, untied head.
inline models::LlamaConfig llama_config(std::int64_t layers = 2) {
  return {.layers = layers,
          .heads = 4,
          .kv_heads = 2,
          .dim = 32,
          .ffn_dim = 48,
          .max_seq = 16,
          .vocab = 50,
          .padded_vocab = 64,
          .init_std = 0.05f,
          .rope = {.theta = 10000.0f}};
}

// A fixed token stream (no shuffling, so every layout reads the same global batches).
inline std::vector<std::uint16_t> tokens(std::int64_t n = 20000) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(n));
  const auto stream = rng::Stream::named(5, "dp tokens");
  for (std::int64_t i = 0; i < n; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(stream.bits(static_cast<std::uint64_t>(i))[0] % 50);
  return out;
}

struct Run {
  std::vector<double> losses;
  std::vector<double> norms;               // the global gradient norm of every step
  std::vector<std::vector<float>> grads;   // per parameter (serial model order), full tensor: step 1's reduced gradient
  std::vector<std::vector<float>> params;  // per parameter, full tensor, after the last step
  std::vector<std::string> names;          // the serial model's parameter names
  // Under a pipeline: the last stage's copy of the tied token table (empty otherwise).
  std::vector<float> head_copy_grad, head_copy_param;
  // Per world rank: the executor's stashes (most micro-batches in flight) and the most
  // stashed activation bytes live at once, after the last step.
  std::vector<int> stashes;
  std::vector<std::size_t> peak_stash_bytes;
  parallel::MemoryReport memory;      // rank 0's
  std::int64_t local_parameters = 0;  // rank 0's Ψ: elements of its (tp-split) model
  int max_gathered_units = 0;
};

struct Layout {
  int micro_batch = 2;  // sequences per rank and micro-batch
  int accum = 1;        // micro-batches per step (the pipeline's m)
  bool sp = false;      // sequence parallelism over the tp group
  int cp = 1;           // context parallelism: each sequence over cp ranks
  nn::CpComm cp_comm = nn::CpComm::ring;
  int steps = 5;
  std::int64_t bucket_bytes = 4096;  // small: several buckets even in the test model
  bool overlap = true;
  std::int64_t layers = 2;
  int pp = 1;                                  // pipeline stages (the policy must have a pipeline when > 1)
  int chunks = 1;                              // virtual stages per pipeline rank
  std::string schedule{};                      // under schedule::Configured (empty: the policy's, or 1f1b)
  std::optional<recompute::Mode> recompute{};  // under recompute::Configured (empty: the policy's, or none)
  // Checkpoints: restore from `resume_from` before the first step (the run then trains
  // the steps after the checkpoint's), and save into `save_dir` after step `save_step`.
  std::string resume_from{};
  std::string save_dir{};
  int save_step = 0;
  bool background_save = false;
  // The model, when not config(layers) (a µP model, say); its layers must be `layers`.
  std::optional<models::GPT2Config> model{};
  // The model of a Llama run (run_threads<Policy, models::LlamaSpec>), when not
  // llama_config(layers).
  std::optional<models::LlamaConfig> llama{};
};

// Writes elements [first, first + n) of p's local tensor (values or gradients) into
// full at their positions in the full tensor.
template <class T, class V>
void scatter(const nn::Parameter<T>& p, std::int64_t first, const V* local, std::int64_t n, std::vector<float>& full) {
  full.resize(static_cast<std::size_t>(p.full_numel()));
  for (std::int64_t i = 0; i < n; ++i)
    full[static_cast<std::size_t>(nn::full_index(p.shape, p.split, first + i))] = static_cast<float>(local[i]);
}

// One rank's run: `world` is every rank, split as tp x dp by the Grid. Each rank writes
// what it owns into `run` under the mutex (thread ranks share it; MPI ranks gather
// afterwards).
// The library's layout of a test layout on `world` ranks split as tp x pp x dp.
template <class Policy>
parallel::LayoutConfig layout_config(const Layout& layout, int world, int tp) {
  parallel::LayoutConfig l = parallel::layout_of<Policy>();
  l.tp = tp;
  l.sp = layout.sp;
  l.cp = layout.cp;
  l.cp_comm = layout.cp_comm;
  l.pp = layout.pp;
  l.fit_world(world);
  l.virtual_stages = layout.chunks;
  if (!layout.schedule.empty()) l.schedule = layout.schedule;
  if (layout.recompute) l.recompute = *layout.recompute;
  l.micro_batch = layout.micro_batch;
  l.grad_accum = layout.accum;
  l.data = {.bucket_bytes = layout.bucket_bytes, .overlap = layout.overlap};
  return l;
}

// The layout's model of Spec (models::GPT2Spec or models::LlamaSpec).
template <class Spec>
typename Spec::Config model_config(const Layout& layout) {
  if constexpr (std::is_same_v<Spec, models::LlamaSpec>)
    return layout.llama.value_or(llama_config(layout.layers));
  else
    return layout.model.value_or(config(layout.layers));
}

template <class Policy, class Spec = models::GPT2Spec>
void train(comm::Comm& world, int tp, const Layout& layout, Run& run, std::mutex& mutex) {
  using T = typename Policy::precision::Compute;
  using Model = models::Transformer<T, backend::Cpu, Spec>;
  const typename Spec::Config cfg = model_config<Spec>(layout);
  const parallel::LayoutConfig lc = layout_config<Policy>(layout, world.size(), tp);
  comm::Grid grid(world, {.tp = tp, .cp = layout.cp, .pp = layout.pp});
  backend::cpu::Context ctx;
  const pipeline::Placement placement{.stages = layout.pp,
                                      .chunks = layout.chunks,
                                      .rank = grid.coords().pp,
                                      .partition = pipeline::even_partition(layout.layers, layout.pp, layout.chunks)};
  REQUIRE(cfg.layers == layout.layers);
  Model model(cfg, 99, nn::TensorParallelGroup(&grid.tp(), lc.sp), placement,
              nn::ContextParallelGroup(&grid.cp(), layout.cp_comm));
  static const std::vector<std::uint16_t> stream = tokens();
  const data::TokenDataset dataset = data::TokenDataset::from_tokens(stream, 50, "dp tokens");
  data::DataLoader loader(
      dataset, {.batch_size = layout.micro_batch, .seq_len = 16, .rank = grid.dp().rank(), .world = grid.dp().size()});
  // eps = 1e-2 for the reason given in tensor_parallel_test_util.hpp; clipping active.
  train::Trainer<Model, Policy> trainer(ctx, model,
                                        {.lr = 1e-2f, .eps = 1e-2f, .weight_decay = 0.1f, .grad_clip = 0.5f},
                                        {.peak_lr = 1e-2f, .warmup_steps = 0, .total_steps = layout.steps}, loader,
                                        {.steps = layout.steps, .layout = lc}, parallel::Groups::of(grid));
  // Every parameter by its place in the serial model (a pipeline rank holds some).
  std::vector<std::string> names;
  {
    Model whole(cfg, 99);
    for (const nn::Parameter<T>* p : whole.parameter_store().parameters()) names.push_back(p->name);
  }
  const nn::Parameter<T>* copy = model.tied_copy();
  auto target = [&](const nn::Parameter<T>& p, std::vector<std::vector<float>>& full,
                    std::vector<float>& head_copy) -> std::vector<float>& {
    if (&p == copy) return head_copy;
    const auto k = static_cast<std::size_t>(std::find(names.begin(), names.end(), p.name) - names.begin());
    REQUIRE(k < names.size());
    full.resize(names.size());
    return full[k];
  };
  trainer.set_gradient_hook([&](Model&) {
    if (trainer.steps_done() != 0) return;
    const std::lock_guard<std::mutex> lock(mutex);
    trainer.sync().for_each_owned(
        [&](const nn::Parameter<T>& p, std::int64_t first, const float* grad, const T*, std::int64_t n) {
          scatter(p, first, grad, n, target(p, run.grads, run.head_copy_grad));
        });
  });
  if (!layout.resume_from.empty()) {
    const auto checkpoint = checkpoint::Checkpoint::open(layout.resume_from);
    trainer.restore(checkpoint.source(), checkpoint.state());
  }
  std::optional<checkpoint::Checkpointer> saver;
  if (!layout.save_dir.empty())
    saver.emplace(world, checkpoint::CheckpointerConfig{.dir = layout.save_dir, .background = layout.background_save});
  std::vector<double> losses, norms;
  while (trainer.steps_done() < layout.steps) {
    const train::StepStats s = trainer.step();
    losses.push_back(s.loss);
    norms.push_back(s.grad_norm);
    if (saver && s.step == layout.save_step)
      saver->save(s.step, trainer.snapshot(train::SnapshotScope::saved),
                  {{"layout", trainer.layout()}, {"model", {{"layers", layout.layers}}}});
  }
  if (saver) saver->wait();
  const std::lock_guard<std::mutex> lock(mutex);
  run.stashes.resize(static_cast<std::size_t>(world.size()));
  run.peak_stash_bytes.resize(static_cast<std::size_t>(world.size()));
  run.stashes[static_cast<std::size_t>(world.rank())] = trainer.executor().stashes();
  run.peak_stash_bytes[static_cast<std::size_t>(world.rank())] = trainer.executor().peak_stash_bytes();
  if (world.rank() == 0) {
    run.losses = losses;
    run.norms = norms;
    run.memory = trainer.memory();
    run.local_parameters = model.parameter_store().numel();
    run.max_gathered_units = trainer.sync().max_gathered_units();
  }
  run.names = names;
  run.grads.resize(names.size());
  run.params.resize(names.size());
  trainer.sync().for_each_owned(
      [&](const nn::Parameter<T>& p, std::int64_t first, const float*, const T* value, std::int64_t n) {
        scatter(p, first, value, n, target(p, run.params, run.head_copy_param));
      });
}

// The run of Policy on `ranks` thread ranks split as tp x pp x dp, of GPT-2 or of Spec's
// model.
template <class Policy, class Spec = models::GPT2Spec>
Run run_threads(int ranks, int tp, const Layout& layout) {
  Run run;
  std::mutex mutex;
  comm::run_threads(ranks, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    train<Policy, Spec>(world, tp, layout, run, mutex);
  });
  return run;
}

// MPI: rank 0 recorded the losses and norms (every rank computed the same); every rank
// gets them, `steps` of each.
inline void share_series(comm::Comm& world, Run& run, std::size_t steps) {
  for (auto* series : {&run.losses, &run.norms}) {
    std::vector<float> v(series->begin(), series->end());
    v.resize(steps);
    world.broadcast(std::span<float>(v), 0);
    series->assign(v.begin(), v.end());
  }
}

// The largest relative differences of the losses, the step-1 gradients and the final
// parameters (each tensor against its serial counterpart).
struct Difference {
  double loss = 0.0, norm = 0.0, grad = 0.0, param = 0.0;
  std::string worst_grad, worst_param;
};
inline Difference compare(const Run& run, const Run& serial) {
  Difference d;
  REQUIRE(run.losses.size() == serial.losses.size());
  for (std::size_t s = 0; s < serial.losses.size(); ++s)
    d.loss = std::max(d.loss, std::abs(run.losses[s] - serial.losses[s]) / std::abs(serial.losses[s]));
  // The global norm over every rank (each element counted once); the serial run's first
  // norm exceeds the clip of 0.5, so clipping is active and a wrong norm would change
  // the update.
  REQUIRE(run.norms.size() == serial.norms.size());
  REQUIRE(serial.norms.front() > 0.5);
  for (std::size_t s = 0; s < serial.norms.size(); ++s)
    d.norm = std::max(d.norm, std::abs(run.norms[s] - serial.norms[s]) / serial.norms[s]);
  REQUIRE(run.grads.size() == serial.grads.size());
  REQUIRE(run.params.size() == serial.params.size());
  for (std::size_t k = 0; k < serial.grads.size(); ++k) {
    const double g = relative_difference(run.grads[k], serial.grads[k]);
    if (g > d.grad) d.grad = g, d.worst_grad = serial.names[k];
    const double p = relative_difference(run.params[k], serial.params[k]);
    if (p > d.param) d.param = p, d.worst_param = serial.names[k];
  }
  return d;
}

// The run every layout must compute: one rank, the whole model, the same global batch
// (dp replicas' micro-batches in one), no pipeline, context or sequence parallelism,
// no recomputation.
template <class Policy, class Spec = models::GPT2Spec>
Run serial_run(Layout layout, int dp = 1) {
  layout.micro_batch *= dp;
  layout.cp = 1;
  layout.pp = 1;
  layout.chunks = 1;
  layout.sp = false;
  layout.schedule = "1f1b";
  layout.recompute.reset();
  return run_threads<Policy, Spec>(1, 1, layout);
}

// run computes the serial run: losses, norms, step 1's gradients and the final
// parameters within `tolerance` (fp32: 1e-5).
inline void check_close(const Run& run, const Run& reference, const std::string& what, double tolerance = 1e-5) {
  const Difference d = compare(run, reference);
  INFO(what << ": losses " << d.loss << ", norms " << d.norm << ", gradients " << d.grad << " (" << d.worst_grad
            << "), parameters " << d.param << " (" << d.worst_param << ")");
  CHECK(d.loss <= tolerance);
  CHECK(d.norm <= tolerance);
  CHECK(d.grad <= tolerance);
  CHECK(d.param <= tolerance);
}

// The same tensors, bit for bit.
inline bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t k = 0; k < a.size(); ++k)
    if (a[k].size() != b[k].size() || std::memcmp(a[k].data(), b[k].data(), a[k].size() * sizeof(float)) != 0)
      return false;
  return true;
}

}  // namespace llmpar::dp_test
