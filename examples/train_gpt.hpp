// train_gpt.hpp — the backend-neutral part of train_gpt: its options, their checks, and
// the per-rank training run, a template over the composed policy. train_gpt.cpp runs it
// on backend::Cpu and, in CUDA builds, train_gpt_cuda.cpp on backend::Cuda; every
// policy's run is instantiated in its own file, one per backend and precision
// (train_gpt_fp32.cpp ... train_gpt_cuda_fp16.cpp). All of them are plain C++: the CUDA
// backend's device code is compiled once, in the build's llmpar_cuda_ops library
// (backend/cuda/backend.hpp). --precision and --zero choose the policy at run time among
// the compiled ones (parallel::dispatch).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <llmpar/llmpar.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "train_gpt_options.hpp"

#if defined(LLMPAR_TRAIN_GPT_CUDA)
#include <llmpar/backend/cuda/backend.hpp>
#endif

namespace train_gpt {

using namespace llmpar;

// What a precision policy keeps in which type, for the start-up lines.
template <class P>
std::string precision_summary() {
  const auto name = [](DType t) { return std::string(name_of(t)); };
  std::string s = std::string(P::kName) + ": weights and activations " + name(dtype_of<typename P::Compute>()) +
                  ", gradients " + name(dtype_of<typename P::Grad>()) + ", master weights and moments " +
                  name(dtype_of<typename P::Master>()) + ", norms/softmax/loss f32";
  if constexpr (P::kHasLossScale) s += ", dynamic loss scale";
  return s;
}

// The denominator of MFU for a run: its value and where it came from.
struct Peak {
  double gflops = 0.0;
  std::string source;
};
// The peak --peak-gflops gives, if it does.
inline std::optional<Peak> given_peak(const Options& o) {
  if (o.peak_gflops <= 0.0) return std::nullopt;
  return Peak{o.peak_gflops, std::to_string(o.peak_gflops) + " GFLOP/s, from --peak-gflops"};
}
// The (in, out) sizes of a block's linear layers and the head on one tensor-parallel
// rank (GPT2Config::linear_sizes, LlamaConfig::linear_sizes).
using LinearSizes = std::array<std::pair<std::int64_t, std::int64_t>, 5>;
// A backend's start-up for a run in storage type `dtype` of a model whose linear layers
// are `sizes` at `rows` rows per micro-batch (the CPU chooses its bf16 GEMM paths on the
// step's shapes), and its peak: --peak-gflops, or measured, or the data sheet's. Every
// rank calls it together, before the first step.
using PeakFinder = std::function<Peak(DType dtype, const LinearSizes& sizes, std::int64_t rows)>;

// The training and validation data: token shards, or the embedded corpus (announced by
// rank 0, `lead`). In train_gpt.cpp, like everything here that is the same for every
// policy: compiled once, not once per policy.
struct Datasets {
  data::TokenDataset train, val;
};
Datasets load_datasets(const Options& o, std::int64_t vocab, bool lead);

// A fault for the restart tests, off unless LLMPAR_TEST_FAULT is set: "kill:STEP:RANK"
// makes world rank RANK kill itself (SIGKILL) after step STEP, "hang:STEP:RANK" makes it
// stop answering (its peers' watchdog then ends the job). With LLMPAR_TEST_FAULT_ONCE=FILE
// it fires only in the run that creates FILE, so a restarted run passes the step.
void test_fault(std::int64_t step, int world_rank);

// What a run's first metrics record says besides the flags.
struct RunFacts {
  std::int64_t seq = 0, parameters = 0;
  int ranks = 1;
  std::string partition;
  int dp = 1;
  std::int64_t grad_accum = 1, global_batch = 0, warmup = 0;
  const char* policy = "";
  const char* backend = "";
  double peak_gflops = 0.0;
  std::string peak_source;
};
// The metrics log's "config" record: the model (model_record's fields and init_std),
// the layout and the run's settings.
nlohmann::json config_record(const Options& o, nlohmann::json model, const RunFacts& f);

// The start-up line of the model.
inline std::string describe_model(const models::GPT2Config& c) {
  char s[160] = "";
  if (c.mup)
    std::snprintf(s, sizeof s, ", µP base width %lld (width multiplier %g)", static_cast<long long>(c.mup_base_dim),
                  c.width_mult());
  return s;
}
inline std::string describe_model(const models::LlamaConfig& c) {
  char s[240];
  std::snprintf(s, sizeof s, ", Llama: %lld kv heads, SwiGLU %lld, RoPE theta %g%s, %s head",
                static_cast<long long>(c.kv_heads), static_cast<long long>(c.ffn_dim),
                static_cast<double>(c.rope.theta), c.rope.scaled() ? " (llama3 scaling)" : "",
                c.tie_embeddings ? "tied" : "untied");
  return s;
}

// One rank's training run at `layout` (validated: layout_of) under the composed policy
// `Policy` it names (parallel::dispatch: its backend, precision and ZeRO stage), of the
// model Spec names (models::GPT2Spec, models::LlamaSpec).
template <class Policy, class Spec>
int run(const Options& o, const parallel::LayoutConfig& layout, comm::Comm& world,
        typename Policy::backend::Context& ctx, const PeakFinder& find_peak) {
  using B = typename Policy::backend;
  using T = typename Policy::precision::Compute;
  using Config = typename Spec::Config;
  constexpr bool kGpt2 = std::is_same_v<Spec, models::GPT2Spec>;
  const bool lead = world.rank() == 0;
  auto say = [&](auto... args) {
    if (lead) std::printf(args...);
  };
  const Config cfg = config_of<Spec>(o);
  const std::int64_t warmup = o.warmup.value_or(std::min<std::int64_t>(20, o.steps));
  const std::int64_t seq = sequence_length(o, base_config<Config>(o));

  Datasets sets = load_datasets(o, cfg.vocab, lead);
  // The rank grid: tp adjacent ranks split each block, the rest replicate the model and
  // read different rows of the batch.
  comm::Grid grid(world, {.tp = layout.tp, .cp = layout.cp, .pp = layout.pp});
  const data::LoaderConfig lc{.batch_size = static_cast<int>(o.batch), .seq_len = static_cast<int>(seq)};
  data::LoaderConfig train_lc = lc;
  train_lc.shuffle = o.shuffle;
  train_lc.seed = o.seed;
  train_lc.rank = grid.dp().rank();
  train_lc.world = grid.dp().size();
  train_lc.global_batch = layout.global_batch();
  data::LoaderConfig val_lc = lc;
  val_lc.rank = grid.dp().rank();
  val_lc.world = grid.dp().size();
  data::DataLoader train_loader(sets.train, train_lc);
  data::DataLoader val_loader(sets.val, val_lc);

  // This rank's share of the model: its tp split (and sp) and its pipeline chunks.
  models::Transformer<Policy, B, Spec> model(cfg, o.seed, grid, layout);
  const pipeline::Placement& placement = model.placement();
  // The checkpoint to resume from, or the weights to start from, read and checked now.
  std::optional<checkpoint::Checkpoint> resume;
  if (const auto path = resume_path(o)) {
    resume.emplace(checkpoint::Checkpoint::open(*path));
    check_same_model(resume->metadata()["model"], cfg, "checkpoint " + resume->dir());
  } else if (o.resume == "latest") {
    say("resume: no checkpoint in %s yet; starting at step 0\n", o.save.c_str());
  }
  std::optional<checkpoint::Snapshot> initial;
  if (!o.init_from.empty()) {
    if constexpr (kGpt2)
      initial.emplace(checkpoint::hf::read_gpt2(o.init_from, cfg));
    else
      initial.emplace(checkpoint::hf::read_llama(o.init_from, cfg));
  }
  // The backend's start-up on the model's shapes, and the peak in the run's precision.
  const Peak peak = find_peak(dtype_of<T>(), cfg.linear_sizes(o.tp), o.batch * seq);
  say("model: %s, L=%lld H=%lld C=%lld T=%lld V=%lld (padded %lld), %.2fM parameters%s\n", model_name(o).c_str(),
      static_cast<long long>(cfg.layers), static_cast<long long>(cfg.heads), static_cast<long long>(cfg.dim),
      static_cast<long long>(seq), static_cast<long long>(cfg.vocab), static_cast<long long>(cfg.padded_vocab),
      static_cast<double>(model.num_parameters()) * 1e-6, describe_model(cfg).c_str());
  const std::int64_t accum = layout.grad_accum;
  const std::int64_t global_batch = layout.global_batch();
  const std::string pp = (o.cp > 1 ? " x cp " + std::to_string(o.cp) : std::string()) +
                         (o.pp > 1 ? " x pp " + std::to_string(o.pp) : std::string());
  say("train: %lld steps, %d rank%s (%s; tp %d%s%s x dp %d, ZeRO %d) x micro-batch %lld x %lld, grad accum %lld "
      "(global batch %lld), lr %.2e, warmup %lld, %s, %s backend\n",
      static_cast<long long>(o.steps), world.size(), world.size() > 1 ? "s" : "",
      std::string(world.engine_name()).c_str(), grid.tp().size(), o.sp ? " sp" : "", pp.c_str(), grid.dp().size(),
      o.zero, static_cast<long long>(o.batch), static_cast<long long>(seq), static_cast<long long>(accum),
      static_cast<long long>(global_batch), static_cast<double>(o.lr), static_cast<long long>(warmup),
      o.precision.c_str(), B::kName);
  say("policy: %s\n", Policy::kName);
  if (o.pp > 1)
    say("pipeline: %d stages x %d chunk%s, schedule %s, layers per virtual stage %s, %lld micro-batches per step\n",
        o.pp, o.virtual_stages, o.virtual_stages > 1 ? "s" : "", o.schedule.c_str(),
        placement.partition.describe().c_str(), static_cast<long long>(accum));
  if (o.recompute != "none") say("recompute: %s\n", o.recompute.c_str());
  say("precision: %s\n", precision_summary<typename Policy::precision>().c_str());
  say("MFU peak: %s\n", peak.source.c_str());

  train::MetricsWriter metrics(lead ? o.metrics : std::string(), /*append=*/resume.has_value());
  nlohmann::json model_fields = model_record(cfg);
  model_fields["init_std"] = cfg.init_std;
  metrics.write(config_record(o, std::move(model_fields),
                              {.seq = seq,
                               .parameters = model.num_parameters(),
                               .ranks = world.size(),
                               .partition = placement.partition.describe(),
                               .dp = grid.dp().size(),
                               .grad_accum = accum,
                               .global_batch = global_batch,
                               .warmup = warmup,
                               .policy = Policy::kName,
                               .backend = B::kName,
                               .peak_gflops = peak.gflops,
                               .peak_source = peak.source}));

  const optim::AdamWConfig opt{
      .lr = o.lr, .beta1 = o.beta1, .beta2 = o.beta2, .weight_decay = o.weight_decay, .grad_clip = o.grad_clip};
  const std::int64_t steps = std::max<std::int64_t>(o.steps, 1);  // --steps 0 converts and trains none
  const optim::CosineSchedule schedule{
      .peak_lr = o.lr, .warmup_steps = warmup, .total_steps = steps, .final_ratio = o.final_lr};
  train::Trainer<decltype(model)> trainer(
      ctx, model, opt, schedule, train_loader,
      {.steps = steps, .peak_gflops = peak.gflops, .layout = layout, .spike_guard = spike_config(o)}, grid);
  if (resume) {
    trainer.restore(resume->source(), resume->state());
    say("resume: step %lld from %s (saved at %s)\n", static_cast<long long>(trainer.steps_done()),
        resume->dir().c_str(), describe_layout(resume->metadata()["layout"]).c_str());
    metrics.write({{"type", "resume"}, {"step", trainer.steps_done()}, {"from", resume->dir()}});
    LLMPAR_CHECK(trainer.steps_done() < o.steps || o.steps == 0, "checkpoint ", resume->dir(), " is at step ",
                 trainer.steps_done(), ", the end of a run of --steps ", o.steps, "; raise --steps to train on");
  }
  if (initial) {
    trainer.load_weights(checkpoint::Source::of(*initial));
    say("init: weights from %s\n", o.init_from.c_str());
    initial.reset();
  }
  if (guards_spikes(o))
    say("spike guard: a loss above %.2f x the running median or %.1f deviations above the mean of the last %d, or "
        "not finite, rolls back to an in-memory snapshot (every %d steps) and skips its data\n",
        o.spike.median_factor, o.spike.z_score, o.spike.window, o.spike.snapshot_every);
  // Checkpoints: this rank's shard written on a thread while training goes on.
  std::optional<checkpoint::Checkpointer> saver;
  if (!o.save.empty()) saver.emplace(world, checkpoint::CheckpointerConfig{.dir = o.save, .keep = o.keep});
  std::int64_t saved_step = resume ? trainer.steps_done() : -1;
  auto save = [&](checkpoint::Checkpointer& to) {
    checkpoint::Snapshot snap = to.reuse();
    trainer.snapshot(train::SnapshotScope::saved, snap);
    to.save(trainer.steps_done(), std::move(snap),
            {{"model", model_record(cfg)},
             {"layout", trainer.layout()},
             {"data", {{"seq", seq}, {"micro_batch", o.batch}, {"global_batch", global_batch}, {"seed", o.seed}}}});
    saved_step = trainer.steps_done();
  };
  // Bytes per rank, from the buffers: at start (activations are allocated by the first
  // step), and after the first step with them, also in the metrics log.
  auto report_memory = [&](const char* when) {
    const parallel::MemoryReport m = trainer.memory();
    const auto mib = [](std::size_t b) { return static_cast<double>(b) / (1 << 20); };
    say("memory per rank (%s): parameters %.2f MiB, gradients %.2f MiB, optimizer %.2f MiB, activations %.2f MiB, "
        "buffers %.2f MiB\n",
        when, mib(m.parameters), mib(m.gradients), mib(m.optimizer), mib(m.activations), mib(m.communication));
    metrics.write({{"type", "memory"},
                   {"when", when},
                   {"parameters", m.parameters},
                   {"gradients", m.gradients},
                   {"optimizer", m.optimizer},
                   {"activations", m.activations},
                   {"buffers", m.communication}});
  };
  report_memory("start");
  // Never count a validation batch twice: at most one pass over the validation data.
  const std::int64_t eval_batches = std::min(o.eval_batches, val_loader.batches_per_epoch());
  auto run_eval = [&](std::int64_t step) {
    const double val = trainer.evaluate(val_loader, eval_batches);
    val_loader.reset();
    say("step %5lld | val loss %.4f\n", static_cast<long long>(step), val);
    metrics.write({{"type", "eval"}, {"step", step}, {"val_loss", val}});
  };
  if (o.eval_every > 0 && !resume) run_eval(0);
  const std::int64_t last = last_step(o);
  while (trainer.steps_done() < last) {
    const train::StepStats s = trainer.step();
    test_fault(s.step, world.rank());
    say("%s\n", train::format_step(s, o.steps, Policy::kHasLossScale).c_str());
    if (lead) std::fflush(stdout);
    metrics.write_step(s);
    if (s.incident) say("%s\n", train::format_incident(*s.incident).c_str());
    if (s.step == 1) report_memory("after step 1");
    if (!o.trace.empty() && s.step == std::min<std::int64_t>(2, o.steps)) {
      const auto timeline = train::gather_timeline(world, grid.coords().pp, trainer.executor().timings());
      if (lead) {
        train::write_chrome_trace(o.trace, timeline);
        say("trace: step %lld's pipeline timeline (%zu ranks) in %s\n", static_cast<long long>(s.step), timeline.size(),
            o.trace.c_str());
      }
    }
    if (s.rolled_back) continue;
    if (o.eval_every > 0 && (s.step % o.eval_every == 0 || s.step == o.steps)) run_eval(s.step);
    if (saver && o.save_every > 0 && s.step % o.save_every == 0) {
      save(*saver);
      say("checkpoint: step %lld to %s, written in the background\n", static_cast<long long>(s.step), o.save.c_str());
    }
  }
  if (saver) {
    if (saved_step != trainer.steps_done()) save(*saver);
    saver->wait();
    say("checkpoint: step %lld in %s (this rank's shard %.1f MB in %.2f s)\n",
        static_cast<long long>(trainer.steps_done()), o.save.c_str(), static_cast<double>(saver->last_bytes()) * 1e-6,
        saver->last_seconds());
  }
  if (trainer.spike_guard() && trainer.spike_guard()->rollbacks() > 0)
    say("spike guard: %zu rollback%s\n", trainer.spike_guard()->rollbacks(),
        trainer.spike_guard()->rollbacks() == 1 ? "" : "s");
  // --export: the model's every tensor on rank 0, through a checkpoint (the last one, or
  // a temporary one beside the file), written in Hugging Face's names and layout.
  if (!o.export_to.empty()) {
    std::string from =
        o.save.empty() ? std::string()
                       : (std::filesystem::path(o.save) / checkpoint::detail::step_name(trainer.steps_done())).string();
    const std::string parts = o.export_to + ".parts";
    if (from.empty()) {
      checkpoint::Checkpointer temporary(world, {.dir = parts, .background = false});
      save(temporary);
      from = parts;
    }
    if (lead) {
      const auto c = checkpoint::Checkpoint::open(from);
      if constexpr (kGpt2) {
        if (export_folder(o))
          checkpoint::hf::write_gpt2_folder(o.export_to, c.source(), cfg);
        else
          checkpoint::hf::write_gpt2(o.export_to, c.source(), cfg);
      } else {
        checkpoint::hf::write_llama(o.export_to, c.source(), cfg);
      }
      say("export: %s (Hugging Face %s names, F32%s)\n", o.export_to.c_str(), kGpt2 ? "GPT-2" : "Llama",
          export_folder(o) ? "; config.json and model.safetensors, for from_pretrained" : "");
    }
    world.barrier();
    if (lead && o.save.empty()) std::filesystem::remove_all(parts);
  }

  // Every rank samples (the split blocks need their whole tp group); rank 0 prints.
  if (sample_count(o) > 0) {
    const data::ByteTokenizer tok;
    std::vector<std::int32_t> prompt;
    for (std::uint16_t t : tok.encode(o.prompt)) prompt.push_back(t);
    // The byte tokenizer decodes ids below 256: a larger vocabulary samples among those.
    const auto out = train::sample(
        ctx, model, prompt,
        {.tokens = sample_count(o), .temperature = o.temperature, .seed = o.seed, .vocab = tok.vocab_size()});
    std::vector<std::uint16_t> ids(out.begin(), out.end());
    const std::string among = model.config().vocab > tok.vocab_size()
                                  ? ", among the byte tokenizer's " + std::to_string(tok.vocab_size()) + " of " +
                                        std::to_string(model.config().vocab) + " ids"
                                  : std::string();
    say("---- sample (temperature %.2f%s) ----\n%s\n----\n", static_cast<double>(o.temperature), among.c_str(),
        tok.decode(ids).c_str());
  }
  return 0;
}

// The run on backend B: the flags checked, the layout built from them, and its policy
// (precision and ZeRO stage) chosen by the library's one dispatch. The pipeline schedule,
// recomputation and sequence parallelism are the layout's values (one instantiation for
// all of them). Every policy's run() is instantiated in its own translation unit, one per
// precision (train_gpt_fp32.cpp, ..., train_gpt_cuda_fp16.cpp; the `extern template`
// declarations below keep this one from instantiating them again).
template <class B>
int run_on(const Options& o, comm::Comm& world, typename B::Context& ctx, const PeakFinder& find_peak) {
  validate(o, world.size());
  const parallel::LayoutConfig layout = layout_of(o, world.size());
  if (is_llama(o))
    return parallel::dispatch<B>(
        layout, [&]<class Policy>() { return run<Policy, models::LlamaSpec>(o, layout, world, ctx, find_peak); });
  return parallel::dispatch<B>(
      layout, [&]<class Policy>() { return run<Policy, models::GPT2Spec>(o, layout, world, ctx, find_peak); });
}

// run<Policy, Spec> for the four ZeRO stages of one precision on one backend: declared
// with EXTERN = extern, defined (instantiated) with it empty.
#define TRAIN_GPT_RUN_POLICIES(EXTERN, Backend, Precision, Spec)                                         \
  EXTERN template int run<parallel::ConfiguredPolicy<Backend, Precision, 0>, Spec>(                      \
      const Options&, const parallel::LayoutConfig&, comm::Comm&, Backend::Context&, const PeakFinder&); \
  EXTERN template int run<parallel::ConfiguredPolicy<Backend, Precision, 1>, Spec>(                      \
      const Options&, const parallel::LayoutConfig&, comm::Comm&, Backend::Context&, const PeakFinder&); \
  EXTERN template int run<parallel::ConfiguredPolicy<Backend, Precision, 2>, Spec>(                      \
      const Options&, const parallel::LayoutConfig&, comm::Comm&, Backend::Context&, const PeakFinder&); \
  EXTERN template int run<parallel::ConfiguredPolicy<Backend, Precision, 3>, Spec>(                      \
      const Options&, const parallel::LayoutConfig&, comm::Comm&, Backend::Context&, const PeakFinder&);
// ... for both models.
#define TRAIN_GPT_RUN_MODELS(EXTERN, Backend, Precision)               \
  TRAIN_GPT_RUN_POLICIES(EXTERN, Backend, Precision, models::GPT2Spec) \
  TRAIN_GPT_RUN_POLICIES(EXTERN, Backend, Precision, models::LlamaSpec)

TRAIN_GPT_RUN_MODELS(extern, backend::Cpu, precision::FP32)
TRAIN_GPT_RUN_MODELS(extern, backend::Cpu, precision::BF16Mixed)
TRAIN_GPT_RUN_MODELS(extern, backend::Cpu, precision::FP16Mixed<precision::DynamicLossScale>)
#if defined(LLMPAR_TRAIN_GPT_CUDA)
TRAIN_GPT_RUN_MODELS(extern, backend::Cuda, precision::FP32)
TRAIN_GPT_RUN_MODELS(extern, backend::Cuda, precision::BF16Mixed)
TRAIN_GPT_RUN_MODELS(extern, backend::Cuda, precision::FP16Mixed<precision::DynamicLossScale>)
#endif

}  // namespace train_gpt
