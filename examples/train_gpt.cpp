// train_gpt — trains a GPT-2 on token shards, or with no --data on the English text of
// the Debian `fortunes` package, byte-tokenized. Prints one line per step, evaluates on
// held-out text, writes JSON-lines metrics on request, and samples text at the end.
//
//   train_gpt                                  # gpt2-tiny on fortunes, about a minute
//   train_gpt --model gpt2-124m --data 'data/fineweb_train_*.bin' --batch 4 --seq 64
//   train_gpt --ranks 2 --batch 8              # two ranks (threads), each 8 rows
//   mpirun -np 2 train_gpt --batch 8           # the same with two processes
//   train_gpt --backend cuda                   # on a GPU (CUDA builds); mpirun -np N for N GPUs
//
// With several ranks, --tp T splits each block over T ranks and the dp = ranks / T
// replicas read their own rows of every global batch; gradients and losses are averaged
// over dp, so --ranks N with --batch B trains exactly as one rank with --batch N*B.
// --zero 1|2|3 shards optimizer state, gradients and parameters over dp. Rank 0 prints
// and writes.
#include "train_gpt.hpp"

#include <CLI/CLI.hpp>
#include <array>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace llmpar;
using train_gpt::Options;

namespace train_gpt {

void test_fault(std::int64_t step, int world_rank) {
  const char* spec = std::getenv("LLMPAR_TEST_FAULT");
  if (spec == nullptr || *spec == '\0') return;
  char kind[8] = "";
  long long at = -1;
  int rank = -1;
  LLMPAR_CHECK(std::sscanf(spec, "%7[a-z]:%lld:%d", kind, &at, &rank) == 3 &&
                   (std::strcmp(kind, "kill") == 0 || std::strcmp(kind, "hang") == 0),
               "LLMPAR_TEST_FAULT is '", spec, "'; give kill:STEP:RANK or hang:STEP:RANK (a test-only fault)");
  if (step != at || world_rank != rank) return;
  if (const char* once = std::getenv("LLMPAR_TEST_FAULT_ONCE"); once != nullptr && *once != '\0') {
    if (std::filesystem::exists(once)) return;
    std::ofstream(once) << spec << "\n";
  }
  std::fprintf(stderr, "train_gpt: test fault: world rank %d %s after step %lld\n", world_rank,
               kind[0] == 'k' ? "kills itself" : "stops answering", at);
  std::fflush(stderr);
  if (kind[0] == 'k') std::raise(SIGKILL);
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

Datasets load_datasets(const Options& o, std::int64_t model_vocab, bool lead) {
  auto say = [&](auto... args) {
    if (lead) std::printf(args...);
  };
  // Shards of either width are checked against the model's vocabulary (version-2 shards
  // hold uint32 ids, for vocabularies above 65536); the loader hands out int32 ids.
  LLMPAR_CHECK(model_vocab >= 1 && model_vocab <= 0x7fffffff, "the model's vocabulary is ", model_vocab,
               " ids; token ids are int32, so it must be in [1, 2147483647]");
  const int vocab = static_cast<int>(model_vocab);
  if (o.data.empty()) {
    const data::TextCorpus corpus = data::load_text_corpus();
    say("data: %zu fortune files from %s, %lld train / %lld val bytes, unigram entropy %.3f nats\n",
        corpus.files.size(), data::kDefaultFortunesDir, static_cast<long long>(corpus.train.size()),
        static_cast<long long>(corpus.val.size()), data::unigram_entropy(corpus.train));
    LLMPAR_CHECK(model_vocab >= corpus.vocab_size, "the byte-level corpus needs --vocab >= ", corpus.vocab_size,
                 ", the model has ", model_vocab);
    return {data::TokenDataset::from_tokens(corpus.train, vocab, "fortunes (train)"),
            data::TokenDataset::from_tokens(corpus.val, vocab, "fortunes (val)")};
  }
  Datasets sets{data::TokenDataset::from_shards(o.data, vocab),
                data::TokenDataset::from_shards(o.val_data.empty() ? data::val_pattern_of(o.data) : o.val_data, vocab)};
  say("data: %lld train tokens in %zu shards, %lld val tokens\n", static_cast<long long>(sets.train.num_tokens()),
      sets.train.num_shards(), static_cast<long long>(sets.val.num_tokens()));
  return sets;
}

nlohmann::json config_record(const Options& o, nlohmann::json model, const RunFacts& f) {
  model.erase("max_seq");  // the record has the run's seq
  nlohmann::json record = {{"type", "config"},
                           {"model", train_gpt::model_name(o)},
                           {"seq", f.seq},
                           {"parameters", f.parameters},
                           {"ranks", f.ranks},
                           {"tp", o.tp},
                           {"sp", o.sp},
                           {"cp", o.cp},
                           {"cp_comm", o.cp_comm},
                           {"pp", o.pp},
                           {"schedule", o.schedule},
                           {"virtual_stages", o.virtual_stages},
                           {"partition", f.partition},
                           {"recompute", o.recompute},
                           {"dp", f.dp},
                           {"zero", o.zero},
                           {"micro_batch", o.batch},
                           {"grad_accum", f.grad_accum},
                           {"global_batch", f.global_batch},
                           {"bucket_mb", o.bucket_mb},
                           {"overlap", o.overlap},
                           {"steps", o.steps},
                           {"lr", o.lr},
                           {"warmup", f.warmup},
                           {"final_lr", o.final_lr},
                           {"beta1", o.beta1},
                           {"beta2", o.beta2},
                           {"seed", o.seed},
                           {"precision", o.precision},
                           {"policy", f.policy},
                           {"backend", f.backend},
                           {"peak_gflops", f.peak_gflops},
                           {"peak_source", f.peak_source}};
  record.update(model);
  return record;
}

}  // namespace train_gpt

#if defined(LLMPAR_TRAIN_GPT_CUDA)
namespace train_gpt {
// train_gpt_cuda.cpp: one rank's run on backend::Cuda, with this rank's GPU.
int run_cuda(const Options& o, comm::Comm& world);
// The CUDA devices this process sees (0 without a driver or device).
int cuda_device_count();
}  // namespace train_gpt
#endif

namespace {

// The CPU backend's start-up. In bf16, the GEMM path of each of the step's shapes is
// chosen (measured by default: backend/cpu/gemm.hpp). Then, unless --peak-gflops gave it,
// the CPU's GEMM peak in the run's precision, for MFU: every rank measures at the same
// time on its own share of the cores (its OpenMP threads), over square products and the
// step's shapes (backend/cpu/peak.hpp says why that makes it an upper bound), and the
// ranks add what they measured.
train_gpt::Peak start_cpu(const Options& o, comm::Comm& world, backend::cpu::Context& ctx, DType dtype,
                          const train_gpt::LinearSizes& sizes, std::int64_t rows) {
  const std::vector<backend::cpu::GemmShape> shapes = backend::cpu::step_gemm_shapes(rows, sizes);
  if (dtype == DType::bf16) {
    const backend::cpu::Bf16Paths paths = backend::cpu::choose_bf16_paths(ctx, shapes);
    if (world.rank() == 0)
      std::printf("bf16 GEMMs (--cpu-bf16-gemm %s): %s\n", backend::cpu::name_of(ctx.config().bf16),
                  paths.describe().c_str());
  }
  if (const auto given = train_gpt::given_peak(o)) return *given;
  world.barrier();
  backend::cpu::GemmPeak mine;
  switch (dtype) {
    case DType::bf16:
      mine = backend::cpu::measure_gemm_peak<bf16>(ctx, shapes);
      break;
    case DType::f16:
      mine = backend::cpu::measure_gemm_peak<f16>(ctx, shapes);
      break;
    default:
      mine = backend::cpu::measure_gemm_peak<float>(ctx, shapes);
      break;
  }
  std::array<float, 1> total{static_cast<float>(mine.gflops)};
  world.all_reduce(total);
  std::string source = mine.describe();
  if (world.size() > 1) {
    char sum[96];
    std::snprintf(sum, sizeof sum, "%.1f GFLOP/s: %d ranks measuring at once, summed; rank 0's ", total[0],
                  world.size());
    source = sum + source;
  }
  return {total[0], source};
}

// --backend must be known before init(): the CUDA backend's ranks are NCCL's.
bool wants_cuda(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--backend=cuda") == 0) return true;
    if (std::strcmp(argv[i], "--backend") == 0 && i + 1 < argc && std::strcmp(argv[i + 1], "cuda") == 0) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<Launch> launch;
  try {
    const bool cuda = wants_cuda(argc, argv);
#if !defined(LLMPAR_TRAIN_GPT_CUDA)
    LLMPAR_CHECK(!cuda,
                 "--backend cuda: this train_gpt was built without the CUDA backend; configure with the CUDA "
                 "toolkit (nvcc) and LLMPAR_CUDA=ON, or use --backend cpu");
#else
    LLMPAR_CHECK(!cuda || train_gpt::cuda_device_count() > 0,
                 "--backend cuda: this process sees no CUDA device; check the driver and CUDA_VISIBLE_DEVICES, or "
                 "use --backend cpu");
#endif
    launch.emplace(init(argc, argv, {.device = cuda ? Device::cuda : Device::cpu}));  // --ranks/--comm-*, MPI
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
    return 1;
  }
  Options o;
  CLI::App app{"train_gpt: train a GPT-2 with llmpar"};
  train_gpt::add_model_options(app, o);
  app.add_option("--seq", o.seq, "Sequence length T (default: min(preset, 128))");
  app.add_flag("--mup", o.mup,
               "µP: hidden matrices' init std / sqrt(m) and learning rate / m, logits x 1/m, m = dim / "
               "--mup-base-dim (hyper-parameters tuned at the base width transfer across width)");
  app.add_option("--mup-base-dim", o.mup_base_dim, "µP's base width, where it equals the standard model (default 128)");
  app.add_option("--data", o.data, "Glob of training shards (.bin); default: the fortunes corpus");
  app.add_option("--val-data", o.val_data, "Glob of validation shards (default: --data with 'train' -> 'val')");
  app.add_option("--steps", o.steps, "Optimizer steps")->capture_default_str();
  app.add_option("--batch,--micro-batch", o.batch, "Sequences per micro-batch on each data-parallel rank")
      ->capture_default_str();
  app.add_option("--grad-accum", o.grad_accum, "Micro-batches per optimizer step (default 1, or from --global-batch)");
  app.add_option("--global-batch", o.global_batch,
                 "Sequences per optimizer step over all dp ranks: grad accum = global / (micro-batch x dp)");
  app.add_option("--zero", o.zero,
                 "ZeRO stage: 0 replicated, 1 optimizer state sharded over dp, 2 and gradients, 3 and parameters")
      ->capture_default_str();
  app.add_option("--bucket-mb", o.bucket_mb, "Gradient bucket size in MiB of f32 gradients")->capture_default_str();
  app.add_flag("!--no-overlap", o.overlap, "Reduce gradient buckets after backward instead of during it (measuring)");
  app.add_option("--lr", o.lr, "Peak learning rate")->capture_default_str();
  app.add_option("--warmup", o.warmup,
                 "Linear warmup steps, then cosine decay to --final-lr (default: min(20, steps))");
  app.add_option("--final-lr", o.final_lr, "The last step's learning rate, as a fraction of --lr")
      ->capture_default_str();
  app.add_option("--beta1", o.beta1, "AdamW's first-moment decay")->capture_default_str();
  app.add_option("--beta2", o.beta2, "AdamW's second-moment decay")->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->capture_default_str();
  app.add_option("--grad-clip", o.grad_clip, "Max global gradient norm (0: off)")->capture_default_str();
  app.add_option("--seed", o.seed, "Seed of initialisation, data order and sampling")->capture_default_str();
  app.add_flag("--shuffle,!--no-shuffle", o.shuffle,
               "Visit the training sequences in a seeded random order, new every epoch and the same at every layout "
               "(default on)");
  app.add_option("--eval-every", o.eval_every, "Validate every N steps (0: never)")->capture_default_str();
  app.add_option("--eval-batches", o.eval_batches, "Batches per validation")->capture_default_str();
  app.add_option("--precision", o.precision,
                 "fp32, bf16 (bf16 weights/activations, f32 main grads and master weights) or fp16 (the same in f16, "
                 "with a dynamic loss scale)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--metrics", o.metrics, "Write JSON lines of config, steps and evals to this file");
  app.add_option("--sample-tokens", o.sample_tokens, "Tokens to sample at the end (0: none; default 320, 0 with --pp)");
  app.add_option("--temperature", o.temperature, "Sampling temperature")->capture_default_str();
  app.add_option("--prompt", o.prompt, "Text the sample starts from")->capture_default_str();
  app.add_option("--peak-gflops", o.peak_gflops,
                 "MFU denominator (default: the CPU's GEMM peak in the run's precision, measured at start; the GPU's "
                 "data-sheet peak of the run's precision)");
  app.add_option("--cpu-bf16-gemm", o.cpu_bf16_gemm,
                 "CPU bf16 GEMMs: measured (time oneDNN's bf16 kernels against widening to f32 on each of the step's "
                 "shapes at start, keep the faster), native or upconvert (pinned: bit-exact reruns)")
      ->check(CLI::IsMember({"measured", "native", "upconvert"}))
      ->capture_default_str();
  app.add_option("--backend", o.backend, "Where to train: cpu, or cuda (one GPU per rank; CUDA builds)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--tp", o.tp, "Tensor-parallel degree: split every block's heads and MLP over this many ranks")
      ->capture_default_str();
  app.add_flag("--sp", o.sp, "Sequence parallelism: split the LayerNorm and residual regions' rows over the tp group");
  app.add_option("--cp", o.cp,
                 "Context-parallel degree: split every sequence over this many ranks (load-balanced causal chunks, "
                 "ring attention, or an all-to-all over the heads with --cp-comm a2a)")
      ->capture_default_str();
  app.add_option("--cp-comm", o.cp_comm,
                 "How attention reaches the other cp ranks' rows: ring (K/V blocks passed round the ranks, hidden "
                 "behind the compute; any head count) or a2a (all-to-all over the heads; --cp divides the kv heads "
                 "per tp rank)")
      ->check(CLI::IsMember({"ring", "a2a"}))
      ->capture_default_str();
  app.add_option("--pp", o.pp, "Pipeline stages: split the layers over this many ranks")->capture_default_str();
  app.add_option("--schedule", o.schedule,
                 "Pipeline schedule: gpipe, 1f1b, interleaved (with --virtual-stages) or zb (ZB-H1, zero bubble)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb"}))
      ->capture_default_str();
  app.add_option("--virtual-stages", o.virtual_stages, "Model chunks per pipeline rank (the interleaved schedule)")
      ->capture_default_str();
  app.add_option("--partition", o.partition,
                 "How layers split over pipeline stages: even, parameters (balance parameter counts, embedding on "
                 "the first stage, head on the last) or a list of layers per virtual stage (e.g. 3,3,2)")
      ->capture_default_str();
  app.add_option("--recompute", o.recompute,
                 "Activation recomputation: none, selective (the attention core) or full (each block from its input)")
      ->check(CLI::IsMember({"none", "selective", "full"}))
      ->capture_default_str();
  app.add_option("--trace", o.trace, "Write the pipeline timeline of step 2 (or 1) as Chrome trace JSON (Perfetto)");
  app.add_option("--save", o.save,
                 "Checkpoint directory: step_N subdirectories (each rank its shard) and 'latest'; saved at the end "
                 "and every --save-every steps, in the background");
  app.add_option("--save-every", o.save_every, "Steps between checkpoints (0: only at the end)")->capture_default_str();
  app.add_option("--keep", o.keep, "Checkpoints to keep, the newest (0: all)")->capture_default_str();
  app.add_option("--resume", o.resume,
                 "Continue a run: a step_N checkpoint, a --save directory (its latest), or 'latest' (--save's; none "
                 "yet starts afresh). Any layout loads any other");
  app.add_option("--exit-after", o.exit_after, "Stop after this step (checkpointed with --save), to --resume later");
  app.add_option("--init-from", o.init_from,
                 "Start from Hugging Face weights: a model folder (config.json and safetensors, GPT-2 or Llama: the "
                 "model its config.json describes) or a GPT-2 safetensors file");
  app.add_option("--export", o.export_to,
                 "Write the final weights for Hugging Face: DIR, a model folder from_pretrained loads, or (GPT-2) "
                 "FILE.safetensors (--steps 0: convert only)");
  app.add_flag("--spike-guard", o.spike_guard, "Roll back loss spikes and skip their data (default: on with --save)");
  app.add_flag("--no-spike-guard", o.no_spike_guard, "No loss spike guard, even with --save");
  app.add_option("--spike-factor", o.spike.median_factor, "Spike: a loss above this x the running median (0: off)")
      ->capture_default_str();
  app.add_option("--spike-z", o.spike.z_score, "Spike: a loss this many deviations above the running mean (0: off)")
      ->capture_default_str();
  app.add_option("--spike-window", o.spike.window, "Recent losses the spike statistics are of")->capture_default_str();
  app.add_option("--spike-min-history", o.spike.min_history, "Losses seen before spikes are detected")
      ->capture_default_str();
  app.add_option("--spike-snapshot-every", o.spike.snapshot_every, "Steps between the in-memory snapshots")
      ->capture_default_str();
  app.add_option("--spike-skip", o.spike.skip_batches,
                 "Steps' worth of data skipped after a spike's own, at an incident's first rollback (those since "
                 "the snapshot are always skipped)")
      ->capture_default_str();
  app.add_option("--spike-incident-steps", o.spike.incident_steps,
                 "A spike within this many steps of the last rollback is the same incident (a bad stretch of data): "
                 "its rollback skips twice the extra data of the one before")
      ->capture_default_str();
  app.add_option("--spike-max-skip", o.spike.max_skip,
                 "The most extra steps of data one rollback may skip; a spike that outlasts it stops the run")
      ->capture_default_str();
  app.add_option("--spike-max-rollbacks", o.spike.max_rollbacks,
                 "Loss-spike incidents allowed within --spike-rollback-window (the rollbacks of one count once)")
      ->capture_default_str();
  app.add_option("--spike-rollback-window", o.spike.rollback_window, "Steps of the incident limit's window")
      ->capture_default_str();
  app.add_flag("--tf32", o.tf32, "CUDA: fp32 GEMMs on TF32 tensor cores (faster, 10-bit mantissa products)");
  app.footer(
      "Ranks (read before the options above):\n"
      "  --ranks N              Train on N ranks, as threads of this process (default 1)\n"
      "  --comm-timeout SEC     Fail, naming the missing ranks, when a collective waits this long (default 300)\n"
      "  --comm-verify          Check that every MPI rank issues the same collective (always on for threads)\n"
      "  Under mpirun/srun there is one rank per process instead.");
  CLI11_PARSE(app, argc, argv);
  try {
    int status = 0;
    launch->run([&](comm::Comm& world) {
      // A rank stopped answering: end the process now with kLostRankExit (a supervisor
      // restarts on it); waiting for the ranks of this process to join could be forever.
      try {
#if defined(LLMPAR_TRAIN_GPT_CUDA)
        if (o.backend == "cuda") {
          const int rc = train_gpt::run_cuda(o, world);
          if (world.rank() == 0) status = rc;
          return;
        }
#endif
        backend::cpu::Context ctx({.bf16 = backend::cpu::bf16_gemm_of_flag(o.cpu_bf16_gemm)});
        const int rc = train_gpt::run_on<backend::Cpu>(
            o, world, ctx, [&](DType dtype, const train_gpt::LinearSizes& sizes, std::int64_t rows) {
              return start_cpu(o, world, ctx, dtype, sizes, rows);
            });
        if (world.rank() == 0) status = rc;
      } catch (const comm::TimeoutError& e) {
        std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
        std::fflush(stderr);
        std::_Exit(comm::kLostRankExit);
      }
    });
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
    return 1;
  }
}
