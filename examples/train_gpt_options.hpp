// train_gpt_options.hpp — train_gpt's flags: the Options they fill, the model and the
// parallel::LayoutConfig they name, and every check on them, run before any work. The
// planner (llmpar_plan.cpp) includes this alone, to list exactly the layouts train_gpt
// accepts and print their flags; train_gpt.hpp adds the run.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "llmpar/checkpoint/checkpoint.hpp"
#include "llmpar/checkpoint/hf_gpt2.hpp"
#include "llmpar/checkpoint/hf_llama.hpp"
#include "llmpar/checkpoint/safetensors.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/models/llama.hpp"
#include "llmpar/parallel/layout.hpp"
#include "llmpar/train/spike_guard.hpp"

namespace train_gpt {

using namespace llmpar;

struct Options {
  std::string model = "gpt2-tiny";
  std::optional<std::int64_t> layers, heads, dim, seq, vocab;
  std::optional<std::int64_t> kv_heads, ffn_dim;  // Llama: key/value heads, the MLP's hidden units
  std::optional<float> rope_theta;                // Llama: the rotary base
  std::optional<float> init_std;                  // the hidden matrices' and embeddings' init std (default 0.02)
  bool mup = false;                               // µP (models::GPT2Config::mup)
  std::optional<std::int64_t> mup_base_dim;       // its base width (default 128)
  std::string data, val_data;
  std::int64_t steps = 600;
  std::int64_t batch = 16;                   // sequences per micro-batch and rank (--batch, --micro-batch)
  std::optional<std::int64_t> grad_accum;    // micro-batches per step (default 1, or from --global-batch)
  std::optional<std::int64_t> global_batch;  // sequences per optimizer step over all dp ranks
  int zero = 0;                              // ZeRO stage
  double bucket_mb = 4.0;                    // gradient bucket size, MiB of f32 gradients
  bool overlap = true;                       // reduce buckets during backward
  float lr = 2e-3f;
  std::optional<std::int64_t> warmup;  // default: min(20, steps)
  float final_lr = 0.1f;               // the cosine's floor, as a fraction of --lr
  float beta1 = 0.9f, beta2 = 0.95f;   // AdamW's moment decays
  float weight_decay = 0.1f;
  float grad_clip = 1.0f;
  std::uint64_t seed = 1337;
  bool shuffle = true;
  std::int64_t eval_every = 100;
  std::int64_t eval_batches = 16;
  std::string precision = "fp32";
  std::string metrics;
  std::optional<std::int64_t> sample_tokens;  // default: 320, or 0 with a pipeline
  float temperature = 0.8f;
  std::string prompt = "The ";
  double peak_gflops = 0.0;  // 0: measured (CPU) or the data sheet's (CUDA)
  std::string backend = "cpu";
  bool tf32 = false;
  std::string cpu_bf16_gemm = "measured";  // measured, native, upconvert (backend/cpu/gemm.hpp)
  int tp = 1;                              // tensor-parallel degree; the other ranks replicate (data parallel)
  bool sp = false;                         // sequence parallelism within the tp group
  int cp = 1;                              // context-parallel degree: each sequence over cp ranks
  std::string cp_comm = "ring";            // ring, a2a (nn::CpComm)
  int pp = 1;                              // pipeline stages
  std::string schedule = "1f1b";           // gpipe, 1f1b, interleaved, zb
  int virtual_stages = 1;                  // chunks per pipeline rank
  std::string partition = "even";          // even, parameters, or "3,3,2"
  std::string recompute = "none";          // none, selective, full
  std::string trace;                       // Chrome trace JSON of one step's pipeline timeline
  // Checkpoints (checkpoint/checkpoint.hpp) and Hugging Face weights (checkpoint/hf_gpt2.hpp).
  std::string save;                        // directory of step_N checkpoints and `latest`
  std::int64_t save_every = 0;             // steps between checkpoints (0: only at the end)
  int keep = 0;                            // checkpoints kept, the newest (0: all)
  std::string resume;                      // a step_N directory, a --save directory, or "latest" (--save's)
  std::optional<std::int64_t> exit_after;  // stop after this step (checkpointed with --save)
  // Hugging Face weights: a model folder (config.json and safetensors, GPT-2 or Llama),
  // or a GPT-2 safetensors file.
  std::string init_from, export_to;
  bool spike_guard = false, no_spike_guard = false;  // --spike-guard, --no-spike-guard (default: on with --save)
  train::SpikeGuardConfig spike{};                   // its thresholds (.enabled from spike_guard)
};

// The flags that choose the model's shape, for every program that takes train_gpt's
// model (train_gpt, llmpar-plan); App is a CLI::App.
template <class App>
void add_model_options(App& app, Options& o) {
  app.add_option("--model", o.model,
                 "Preset: gpt2-tiny (byte vocabulary), gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b; llama-tiny (byte "
                 "vocabulary), llama3.2-1b, llama3-8b")
      ->capture_default_str();
  app.add_option("--layers", o.layers, "Override the preset's number of layers");
  app.add_option("--heads", o.heads, "Override the preset's attention heads");
  app.add_option("--kv-heads", o.kv_heads, "Llama: key/value heads, a divisor of --heads (grouped-query attention)");
  app.add_option("--ffn-dim", o.ffn_dim, "Llama: the SwiGLU MLP's hidden units");
  app.add_option("--rope-theta", o.rope_theta, "Llama: the rotary embedding's base (Llama 3: 500000)");
  app.add_option("--dim", o.dim, "Override the preset's channels");
  app.add_option("--vocab", o.vocab, "Override the vocabulary size (padded to a multiple of 128)");
  app.add_option("--init-std", o.init_std,
                 "Init std of the embeddings and hidden matrices (default: the preset's, GPT-2's 0.02)");
}

// Whether the loss spike guard runs: --spike-guard / --no-spike-guard, else with --save.
inline bool guards_spikes(const Options& o) { return o.spike_guard || (!o.no_spike_guard && !o.save.empty()); }

// The spike guard's configuration: the flags' thresholds, enabled or not.
inline train::SpikeGuardConfig spike_config(const Options& o) {
  train::SpikeGuardConfig c = o.spike;
  c.enabled = guards_spikes(o);
  return c;
}

// The steps this invocation runs to: --steps, or --exit-after (a run to be resumed).
inline std::int64_t last_step(const Options& o) { return std::min(o.steps, o.exit_after.value_or(o.steps)); }

// Whether --init-from names a Hugging Face model folder (whose config.json then says
// the model) rather than a GPT-2 safetensors file.
inline bool init_from_folder(const Options& o) {
  return !o.init_from.empty() && std::filesystem::is_directory(o.init_from);
}
// Whether --export writes a model folder (anything but a FILE.safetensors).
inline bool export_folder(const Options& o) {
  return !o.export_to.empty() && std::filesystem::path(o.export_to).extension() != ".safetensors";
}
// Whether the run's model is a Llama (models::Llama) rather than a GPT-2: --init-from's
// folder says, or --model.
inline bool is_llama(const Options& o) {
  if (init_from_folder(o)) return checkpoint::hf::family_of_folder(o.init_from) == checkpoint::hf::Family::llama;
  return models::LlamaConfig::is_preset(o.model);
}
// What the start-up line and the metrics call the model: --model, or --init-from's folder.
inline std::string model_name(const Options& o) { return init_from_folder(o) ? o.init_from : o.model; }
// The model before the shape flags: --init-from's folder's config.json, or --model's
// preset.
template <class Config>
Config base_config(const Options& o) {
  if constexpr (std::is_same_v<Config, models::LlamaConfig>)
    return init_from_folder(o) ? checkpoint::hf::read_llama_config(o.init_from) : models::LlamaConfig::preset(o.model);
  else
    return init_from_folder(o) ? checkpoint::hf::read_gpt2_config(o.init_from) : models::GPT2Config::preset(o.model);
}

// What a checkpoint records of the model, and the flag that sets each field. A GPT-2's
// record has no "family" (records from before Llama have none either).
inline nlohmann::json model_record(const models::GPT2Config& c) {
  return {{"layers", c.layers}, {"heads", c.heads},
          {"dim", c.dim},       {"max_seq", c.max_seq},
          {"vocab", c.vocab},   {"padded_vocab", c.padded_vocab},
          {"mup", c.mup},       {"mup_base_dim", c.mup_base_dim}};
}
inline nlohmann::json model_record(const models::LlamaConfig& c) {
  return {{"family", "llama"},
          {"layers", c.layers},
          {"heads", c.heads},
          {"kv_heads", c.kv_heads},
          {"dim", c.dim},
          {"ffn_dim", c.ffn_dim},
          {"max_seq", c.max_seq},
          {"vocab", c.vocab},
          {"padded_vocab", c.padded_vocab},
          {"norm_eps", c.norm_eps},
          {"rope_theta", c.rope.theta},
          {"rope_factor", c.rope.factor},
          {"tie_embeddings", c.tie_embeddings}};
}
// The fields of model_record that must match between a checkpoint and a run, and the
// flag that sets each.
inline std::vector<std::pair<const char*, const char*>> model_flags(const models::GPT2Config&) {
  return {{"layers", "--layers"}, {"heads", "--heads"}, {"dim", "--dim"},
          {"max_seq", "--seq"},   {"vocab", "--vocab"}, {"padded_vocab", "--vocab"}};
}
inline std::vector<std::pair<const char*, const char*>> model_flags(const models::LlamaConfig&) {
  return {
      {"layers", "--layers"},       {"heads", "--heads"}, {"kv_heads", "--kv-heads"},  {"dim", "--dim"},
      {"ffn_dim", "--ffn-dim"},     {"vocab", "--vocab"}, {"padded_vocab", "--vocab"}, {"rope_theta", "--rope-theta"},
      {"tie_embeddings", "--model"}};
}
inline void check_same_mup(const nlohmann::json& saved, const models::GPT2Config& c, const std::string& from);
template <class Config>
void check_same_model(const nlohmann::json& saved, const Config& c, const std::string& from) {
  const nlohmann::json ours = model_record(c);
  const std::string saved_family = saved.is_object() ? saved.value("family", std::string("gpt2")) : "gpt2";
  const std::string our_family = ours.value("family", std::string("gpt2"));
  LLMPAR_CHECK(saved_family == our_family, from, " was saved from a ", saved_family, " model but this run builds a ",
               our_family, "; pass the --model it was trained with (the checkpoint's model: ", saved.dump(), ")");
  for (const auto& [key, flag] : model_flags(c)) {
    LLMPAR_CHECK(saved.is_object() && saved.contains(key), from, " does not record the model's ", key);
    LLMPAR_CHECK(saved[key] == ours[key], from, " was saved from a model with ", key, " ", saved[key].dump(),
                 " but this run builds ", ours[key].dump(), "; pass ", flag, " ", saved[key].dump(),
                 " (the checkpoint's model: ", saved.dump(), ")");
  }
  if constexpr (std::is_same_v<Config, models::GPT2Config>) check_same_mup(saved, c, from);
}
// µP: a checkpoint that does not record it predates it, and is of a standard model.
inline void check_same_mup(const nlohmann::json& saved, const models::GPT2Config& c, const std::string& from) {
  const nlohmann::json ours = model_record(c);
  const bool saved_mup = saved.contains("mup") && saved["mup"] == true;
  const std::string base = saved.contains("mup_base_dim") ? saved["mup_base_dim"].dump() : std::string("128");
  LLMPAR_CHECK(saved_mup == c.mup, from, " was saved from ",
               saved_mup ? "a µP model (--mup --mup-base-dim " + base +
                               ") but this run builds a standard one; pass --mup --mup-base-dim " + base
                         : std::string("a standard model but this run builds a µP one; drop --mup"),
               " (the checkpoint's model: ", saved.dump(), ")");
  if (c.mup)
    LLMPAR_CHECK(saved.contains("mup_base_dim") && saved["mup_base_dim"] == ours["mup_base_dim"], from,
                 " was saved from a µP model of base width ", base, " but this run builds one of ", c.mup_base_dim,
                 "; pass --mup-base-dim ", base);
}

// A checkpoint's layout in the words of the train: line.
inline std::string describe_layout(const nlohmann::json& l) {
  const auto get = [&](const char* key) { return l.contains(key) ? l[key].dump() : std::string("?"); };
  std::string s = "tp " + get("tp") + (l.value("sp", false) ? " sp" : "") +
                  (l.value("cp", 1) > 1 ? " x cp " + get("cp") : std::string()) + " x pp " + get("pp");
  if (l.value("virtual_stages", 1) > 1) s += " (v " + get("virtual_stages") + ")";
  s += " x dp " + get("dp") + ", ZeRO " + get("zero") + ", " + l.value("precision", std::string("?"));
  return s;
}

// The checkpoint --resume names, or none: "latest" with nothing saved in --save yet
// starts the run afresh.
inline std::optional<std::string> resume_path(const Options& o) {
  if (o.resume.empty()) return std::nullopt;
  if (o.resume != "latest") return o.resume;
  if (!std::filesystem::exists(std::filesystem::path(o.save) / "latest")) return std::nullopt;
  return o.save;
}

// Tokens to sample after training: --sample-tokens, or 320 (none under a pipeline, whose
// stages each hold part of the model, nor under context parallelism, whose ranks each
// hold part of every sequence).
inline std::int64_t sample_count(const Options& o) { return o.sample_tokens.value_or(o.pp > 1 || o.cp > 1 ? 0 : 320); }

// --seq, or min(preset, 128).
template <class Config>
std::int64_t sequence_length(const Options& o, const Config& preset) {
  return o.seq.value_or(std::min<std::int64_t>(preset.max_seq, 128));
}

// The model the options describe: the preset with its overrides, the position table
// grown to --seq.
inline models::GPT2Config model_config(const Options& o) {
  models::GPT2Config cfg = base_config<models::GPT2Config>(o);
  if (o.layers) cfg.layers = *o.layers;
  if (o.heads) cfg.heads = *o.heads;
  if (o.dim) cfg.dim = *o.dim;
  if (o.init_std) cfg.init_std = *o.init_std;
  cfg.mup = o.mup;
  if (o.mup_base_dim) cfg.mup_base_dim = *o.mup_base_dim;
  if (o.vocab) {
    cfg.vocab = *o.vocab;
    cfg.padded_vocab = models::GPT2Config::pad_vocab(*o.vocab);
  }
  cfg.max_seq = std::max(cfg.max_seq, sequence_length(o, base_config<models::GPT2Config>(o)));
  return cfg;
}
// A Llama's: the preset (or --init-from's config.json) with its overrides, max_seq
// raised to --seq.
inline models::LlamaConfig llama_config(const Options& o) {
  models::LlamaConfig cfg = base_config<models::LlamaConfig>(o);
  if (o.layers) cfg.layers = *o.layers;
  if (o.heads) cfg.heads = *o.heads;
  if (o.kv_heads) cfg.kv_heads = *o.kv_heads;
  if (o.dim) cfg.dim = *o.dim;
  if (o.ffn_dim) cfg.ffn_dim = *o.ffn_dim;
  if (o.init_std) cfg.init_std = *o.init_std;
  if (o.rope_theta) cfg.rope.theta = *o.rope_theta;
  if (o.vocab) {
    cfg.vocab = *o.vocab;
    cfg.padded_vocab = models::GPT2Config::pad_vocab(*o.vocab);
  }
  cfg.max_seq = std::max(cfg.max_seq, sequence_length(o, base_config<models::LlamaConfig>(o)));
  return cfg;
}
// The model of Spec the options describe.
template <class Spec>
typename Spec::Config config_of(const Options& o) {
  if constexpr (std::is_same_v<Spec, models::LlamaSpec>)
    return llama_config(o);
  else
    return model_config(o);
}

// The data-parallel degree of a run: the ranks left after tensor and pipeline parallelism.
inline int data_parallel_degree(const Options& o, int world_size) {
  return world_size / std::max(1, o.tp * std::max(1, o.cp) * std::max(1, o.pp));
}

// Micro-batches per optimizer step: --global-batch / (--batch x dp), or --grad-accum.
inline std::int64_t accumulation_steps(const Options& o, int world_size) {
  if (!o.global_batch) return o.grad_accum.value_or(1);
  return *o.global_batch / (o.batch * data_parallel_degree(o, world_size));
}

// The run's layout from its flags, fitted to `world_size` ranks and checked
// (parallel::LayoutConfig: the one set of layout rules, shared with the trainer and
// llmpar-plan).
inline parallel::LayoutConfig layout_of(const Options& o, int world_size) {
  parallel::LayoutConfig l;
  l.tp = o.tp;
  l.sp = o.sp;
  l.cp = o.cp;
  l.cp_comm = nn::parse_cp_comm(o.cp_comm);
  l.pp = o.pp;
  l.schedule = o.schedule;
  l.virtual_stages = o.virtual_stages;
  l.partition = o.partition;
  l.recompute = parallel::recompute_of_flag(o.recompute);
  l.zero = o.zero;
  l.precision = parallel::precision_of_flag(o.precision);
  l.micro_batch = o.batch;
  LLMPAR_CHECK(std::isfinite(o.bucket_mb) && o.bucket_mb > 0.0, "--bucket-mb ", o.bucket_mb,
               "; the gradient bucket size must be a positive number of MiB");
  l.data = {.bucket_bytes = static_cast<std::int64_t>(o.bucket_mb * (1 << 20)), .overlap = o.overlap};
  l.fit_world(world_size);
  l.grad_accum = accumulation_steps(o, world_size);
  l.validate();
  return l;
}

// Every check that needs no data and no work, run by every rank before anything else
// (the corpus, the model, the peak measurement, the first step): a mistake in any flag
// stops the run at once with the flag, its value and what would work.
template <class Config>
void validate_model(const Options& o, int world_size, const parallel::LayoutConfig& layout, const Config& cfg,
                    const Config& preset);
inline void validate(const Options& o, int world_size) {
  LLMPAR_CHECK(o.steps > 0 || (o.steps == 0 && !o.export_to.empty()), "--steps ", o.steps,
               "; train for at least 1 step (--steps 0 only converts: --init-from X --export Y)");
  LLMPAR_CHECK(o.save_every >= 0, "--save-every ", o.save_every, "; use a number of steps, or 0 for the end only");
  LLMPAR_CHECK(o.save_every == 0 || !o.save.empty(), "--save-every ", o.save_every,
               " needs --save DIR (where the checkpoints go)");
  LLMPAR_CHECK(o.keep >= 0, "--keep ", o.keep, "; keep at least 1 checkpoint, or 0 for all");
  LLMPAR_CHECK(o.keep == 0 || !o.save.empty(), "--keep ", o.keep, " needs --save DIR");
  LLMPAR_CHECK(o.resume != "latest" || !o.save.empty(),
               "--resume latest resumes from the newest checkpoint of --save DIR; give --save (or a path to --resume)");
  LLMPAR_CHECK(o.resume.empty() || o.init_from.empty(), "--resume and --init-from both set the weights; give one");
  if (o.exit_after)
    LLMPAR_CHECK(*o.exit_after >= 1 && *o.exit_after <= o.steps, "--exit-after ", *o.exit_after,
                 " must be in [1, --steps ", o.steps, "]");
  if (const auto path = resume_path(o)) static_cast<void>(checkpoint::Checkpoint::resolve(*path));
  if (!o.init_from.empty() && !init_from_folder(o)) static_cast<void>(checkpoint::safetensors::File::open(o.init_from));
  if (export_folder(o)) {
    const std::filesystem::path parent = std::filesystem::absolute(o.export_to).parent_path();
    LLMPAR_CHECK(std::filesystem::is_directory(parent), "--export ", o.export_to, ": the directory ", parent.string(),
                 " that would hold the model folder does not exist; create it first");
  } else if (!o.export_to.empty()) {
    std::ofstream probe(o.export_to, std::ios::out | std::ios::app);
    LLMPAR_CHECK(probe.good(), "--export ", o.export_to,
                 ": cannot open the file for writing; check the directory exists");
  }
  LLMPAR_CHECK(!(o.spike_guard && o.no_spike_guard), "--spike-guard and --no-spike-guard contradict; give one");
  spike_config(o).validate();
  LLMPAR_CHECK(o.batch > 0, "--batch ", o.batch, "; use at least 1 sequence per micro-batch");
  if (o.grad_accum)
    LLMPAR_CHECK(*o.grad_accum > 0, "--grad-accum ", *o.grad_accum, "; use at least 1 micro-batch per step");
  LLMPAR_CHECK(std::isfinite(o.lr) && o.lr > 0.0f, "--lr ", o.lr, "; the learning rate must be a positive number");
  if (o.warmup)
    LLMPAR_CHECK(*o.warmup >= 0 && *o.warmup <= o.steps, "--warmup ", *o.warmup, " must be in [0, --steps ", o.steps,
                 "]");
  LLMPAR_CHECK(std::isfinite(o.final_lr) && o.final_lr >= 0.0f && o.final_lr <= 1.0f, "--final-lr ", o.final_lr,
               " is the last step's rate as a fraction of --lr; give a number in [0, 1]");
  LLMPAR_CHECK(std::isfinite(o.beta1) && o.beta1 >= 0.0f && o.beta1 < 1.0f, "--beta1 ", o.beta1,
               "; AdamW's first-moment decay must be in [0, 1), e.g. 0.9");
  LLMPAR_CHECK(std::isfinite(o.beta2) && o.beta2 >= 0.0f && o.beta2 < 1.0f, "--beta2 ", o.beta2,
               "; AdamW's second-moment decay must be in [0, 1), e.g. 0.95 (0.99 for batches of a few sequences)");
  LLMPAR_CHECK(o.weight_decay >= 0.0f, "--weight-decay ", o.weight_decay, "; it must be >= 0");
  LLMPAR_CHECK(o.grad_clip >= 0.0f, "--grad-clip ", o.grad_clip, "; use a positive norm, or 0 to disable clipping");
  LLMPAR_CHECK(o.eval_every >= 0, "--eval-every ", o.eval_every, "; use a number of steps, or 0 for no validation");
  LLMPAR_CHECK(o.eval_every == 0 || o.eval_batches > 0, "--eval-batches ", o.eval_batches,
               "; validation needs at least 1 batch (or --eval-every 0)");
  const std::int64_t samples = sample_count(o);
  LLMPAR_CHECK(samples >= 0, "--sample-tokens ", samples, "; use a count, or 0 for no sample");
  LLMPAR_CHECK(samples == 0 || o.temperature > 0.0f, "--temperature ", o.temperature,
               "; sampling needs a positive temperature");
  LLMPAR_CHECK(samples == 0 || !o.prompt.empty(), "--prompt is empty; sampling needs at least one byte");
  LLMPAR_CHECK(o.peak_gflops >= 0.0, "--peak-gflops ", o.peak_gflops, "; give a positive peak, or leave it out");
  LLMPAR_CHECK(o.cpu_bf16_gemm == "measured" || (o.backend == "cpu" && o.precision == "bf16"), "--cpu-bf16-gemm ",
               o.cpu_bf16_gemm,
               " chooses how the CPU backend runs bf16 GEMMs; use it with --backend cpu --precision "
               "bf16, or leave it out");
  LLMPAR_CHECK(!o.tf32 || o.backend == "cuda",
               "--tf32 is a CUDA option (fp32 GEMMs on TF32 tensor cores); use it "
               "with --backend cuda");
  // The degrees first (--global-batch is split over dp).
  const int dp = parallel::LayoutConfig{.tp = o.tp, .cp = o.cp, .pp = o.pp}.fit_world(world_size).dp;
  LLMPAR_CHECK(o.pp == 1 || samples == 0, "--sample-tokens ", samples, " with --pp ", o.pp,
               ": sampling runs the whole model on one rank; pass --sample-tokens 0 with a pipeline");
  LLMPAR_CHECK(o.cp == 1 || samples == 0, "--sample-tokens ", samples, " with --cp ", o.cp,
               ": sampling runs whole sequences, of which each context-parallel rank holds chunks; pass "
               "--sample-tokens 0 with --cp");
  LLMPAR_CHECK(o.cp == 1 || o.backend == "cpu", "--cp ", o.cp,
               ": context parallelism (ring attention) on the CUDA backend is not built yet; use --backend cpu, or "
               "--cp 1");
  if (o.global_batch) {
    const std::int64_t per_step = o.batch * dp;
    LLMPAR_CHECK(*o.global_batch > 0 && *o.global_batch % per_step == 0, "--global-batch ", *o.global_batch,
                 " is not a multiple of --micro-batch ", o.batch, " x dp ", dp, " = ", per_step,
                 " (sequences one micro-batch step reads over the data-parallel ranks); use a multiple of ", per_step,
                 ", or change --micro-batch");
    LLMPAR_CHECK(!o.grad_accum || *o.grad_accum == *o.global_batch / per_step, "--grad-accum ", *o.grad_accum,
                 " contradicts --global-batch ", *o.global_batch, " / (--micro-batch ", o.batch, " x dp ", dp,
                 ") = ", *o.global_batch / per_step, "; give one of the two");
  }
  const parallel::LayoutConfig layout = layout_of(o, world_size);
  LLMPAR_CHECK(!o.mup_base_dim || o.mup, "--mup-base-dim ", o.mup_base_dim.value_or(0),
               " sets µP's base width; it needs --mup");
  if (is_llama(o))
    validate_model(o, world_size, layout, llama_config(o), base_config<models::LlamaConfig>(o));
  else
    validate_model(o, world_size, layout, model_config(o), base_config<models::GPT2Config>(o));
}

// validate()'s checks of the model the flags build (cfg, from `preset`).
template <class Config>
void validate_model(const Options& o, int world_size, const parallel::LayoutConfig& layout, const Config& cfg,
                    const Config& preset) {
  constexpr bool kLlama = std::is_same_v<Config, models::LlamaConfig>;
  if constexpr (kLlama) {
    LLMPAR_CHECK(!o.mup && !o.mup_base_dim, "--mup is GPT-2's µP parametrisation; a Llama (--model ", o.model,
                 ") trains without it: drop --mup");
    LLMPAR_CHECK(o.init_from.empty() || init_from_folder(o), "--init-from ", o.init_from,
                 ": a Llama starts from a Hugging Face model folder (config.json and its safetensors, as "
                 "save_pretrained writes it), not a single file");
    LLMPAR_CHECK(o.export_to.empty() || export_folder(o), "--export ", o.export_to,
                 ": a Llama is written as a Hugging Face model folder (config.json and model.safetensors); give a "
                 "directory name, not a .safetensors file");
  } else {
    LLMPAR_CHECK(!o.kv_heads && !o.ffn_dim && !o.rope_theta, "--kv-heads, --ffn-dim and --rope-theta shape a Llama; ",
                 o.model,
                 " is a GPT-2 (4C MLP, multi-head attention, learned positions): use --model llama-tiny, "
                 "llama3.2-1b or llama3-8b, or drop them");
  }
  cfg.validate();
  if constexpr (kLlama) {
    LLMPAR_CHECK(cfg.heads % o.tp == 0 && cfg.kv_heads % o.tp == 0, "--tp ", o.tp, " does not divide the ",
                 cfg.heads % o.tp != 0 ? "query" : "kv", " heads (--heads ", cfg.heads, ", --kv-heads ", cfg.kv_heads,
                 "): tensor parallelism splits both without splitting a head; use a --tp that divides ", cfg.kv_heads);
    LLMPAR_CHECK(cfg.ffn_dim % o.tp == 0, "--tp ", o.tp, " does not divide the model's ", cfg.ffn_dim,
                 " MLP hidden units (--ffn-dim): tensor parallelism splits them evenly; use an --ffn-dim that is a "
                 "multiple of ",
                 o.tp, ", or another --tp");
  } else {
    if (!o.init_from.empty())
      checkpoint::hf::check_standard_logits(cfg, "--init-from: Hugging Face GPT-2 weights cannot be read into");
    if (!o.export_to.empty())
      checkpoint::hf::check_standard_logits(cfg, "--export: Hugging Face GPT-2 weights cannot be written from");
  }
  if (o.cp > 1) {
    std::int64_t kv_heads = cfg.heads;
    if constexpr (kLlama) kv_heads = cfg.kv_heads;
    nn::check_cp_heads(layout.cp_comm, o.cp, kv_heads / o.tp, o.tp);
  }
  const std::int64_t seq = sequence_length(o, preset);
  LLMPAR_CHECK(seq > 0, "--seq ", seq, "; the sequence length must be positive");
  LLMPAR_CHECK(o.cp <= 1 || seq % (2 * o.cp) == 0, "--seq ", seq, " is not divisible by 2 x --cp ", o.cp, " = ",
               2 * o.cp,
               " (context parallelism cuts each sequence into 2 x cp chunks); use a --seq that is a multiple "
               "of ",
               2 * o.cp);
  LLMPAR_CHECK(!o.sp || (seq / std::max(1, o.cp)) % o.tp == 0, "--seq ", seq, o.cp > 1 ? " / --cp" : "",
               o.cp > 1 ? std::to_string(o.cp) : std::string(), " is not divisible by --tp ", o.tp,
               o.cp > 1
                   ? " (sequence parallelism splits each rank's rows of a sequence); use a --seq that is a multiple of "
                   : " (sequence parallelism splits the sequence); use a --seq that is a multiple of ",
               o.tp * std::max(1, o.cp) * (o.cp > 1 ? 2 : 1));
  if (!o.data.empty() && o.val_data.empty()) static_cast<void>(data::val_pattern_of(o.data));
  static_cast<void>(models::partition_of(cfg, layout));  // more stages than layers, a list that does not sum
  if (o.schedule == "interleaved") {
    const std::int64_t m = accumulation_steps(o, world_size);
    LLMPAR_CHECK(m % o.pp == 0, "--schedule interleaved needs the micro-batches per step (", m,
                 ", from --grad-accum or --global-batch) to be a multiple of --pp ", o.pp, "; use ",
                 (m / o.pp + 1) * o.pp);
  }
  if (!o.trace.empty()) {
    std::ofstream probe(o.trace, std::ios::out | std::ios::app);
    LLMPAR_CHECK(probe.good(), "--trace ", o.trace, ": cannot open the file for writing; check the directory exists");
  }
  // Sampling decodes bytes: a model of another vocabulary cannot be sampled as text.
  LLMPAR_CHECK(sample_count(o) == 0 || o.data.empty() || cfg.vocab == 256,
               "sampling decodes with the byte tokenizer, but --data trains a vocabulary of ", cfg.vocab,
               "; pass --sample-tokens 0 for models whose data used another tokenizer");
}

}  // namespace train_gpt
