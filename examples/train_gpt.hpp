// train_gpt.hpp — the backend-neutral part of train_gpt: its options and the per-rank
// training run, a template over the backend tag. train_gpt.cpp instantiates it for
// backend::Cpu and, in CUDA builds, train_gpt_cuda.cu for backend::Cuda (nvcc compiles
// that one; backend/backend.hpp says why the two backends live in separate
// translation units).
#pragma once

#include <algorithm>
#include <cstdio>
#include <llmpar/llmpar.hpp>
#include <optional>
#include <string>
#include <vector>

namespace train_gpt {

using namespace llmpar;

struct Options {
  std::string model = "gpt2-tiny";
  std::optional<std::int64_t> layers, heads, dim, seq, vocab;
  std::string data, val_data;
  std::int64_t steps = 600;
  std::int64_t batch = 16;
  std::int64_t grad_accum = 1;
  float lr = 2e-3f;
  std::optional<std::int64_t> warmup;  // default: min(20, steps)
  float weight_decay = 0.1f;
  float grad_clip = 1.0f;
  std::uint64_t seed = 1337;
  bool shuffle = true;
  std::int64_t eval_every = 100;
  std::int64_t eval_batches = 16;
  std::string precision = "fp32";
  std::string metrics;
  std::int64_t sample_tokens = 320;
  float temperature = 0.8f;
  std::string prompt = "The ";
  double peak_gflops = 0.0;
  std::string backend = "cpu";
  bool tf32 = false;
  int tp = 1;  // tensor-parallel degree; the other ranks replicate (data parallel)
  bool sp = false;  // sequence parallelism within the tp group
};

// The validation pattern llm.c uses: the train pattern with "train" replaced by "val".
inline std::string default_val_pattern(const std::string& train) {
  const auto pos = train.rfind("train");
  LLMPAR_CHECK(pos != std::string::npos, "cannot derive validation shards from --data '", train,
               "' (it does not contain 'train'); pass --val-data");
  return train.substr(0, pos) + "val" + train.substr(pos + 5);
}

// One rank's training run under the composed policy `Policy` (its backend, and sequence
// parallelism or not). peak: the MFU denominator in GFLOP/s (0: none).
template <class Policy>
int run(const Options& o, comm::Comm& world, typename Policy::backend::Context& ctx, double peak) {
  using B = typename Policy::backend;
  const bool lead = world.rank() == 0;
  auto say = [&](auto... args) {
    if (lead) std::printf(args...);
  };
  LLMPAR_CHECK(o.precision == "fp32", "--precision ", o.precision, " is not available; this build trains in fp32");
  models::GPT2Config cfg = models::GPT2Config::preset(o.model);
  if (o.layers) cfg.layers = *o.layers;
  if (o.heads) cfg.heads = *o.heads;
  if (o.dim) cfg.dim = *o.dim;
  if (o.vocab) {
    cfg.vocab = *o.vocab;
    cfg.padded_vocab = models::GPT2Config::pad_vocab(*o.vocab);
  }
  const std::int64_t warmup = o.warmup.value_or(std::min<std::int64_t>(20, o.steps));
  const std::int64_t seq = o.seq.value_or(std::min<std::int64_t>(cfg.max_seq, 128));
  cfg.max_seq = std::max(cfg.max_seq, seq);
  cfg.validate();

  // Data: token shards, or the embedded corpus.
  std::optional<data::TokenDataset> train_set, val_set;
  if (o.data.empty()) {
    const data::TextCorpus corpus = data::load_text_corpus();
    say("data: %zu fortune files from %s, %lld train / %lld val bytes, unigram entropy %.3f nats\n",
                corpus.files.size(), data::kDefaultFortunesDir, static_cast<long long>(corpus.train.size()),
                static_cast<long long>(corpus.val.size()), data::unigram_entropy(corpus.train));
    LLMPAR_CHECK(cfg.vocab >= corpus.vocab_size, "the byte-level corpus needs --vocab >= ", corpus.vocab_size,
                 ", the model has ", cfg.vocab);
    train_set.emplace(data::TokenDataset::from_tokens(corpus.train, static_cast<int>(cfg.vocab), "fortunes (train)"));
    val_set.emplace(data::TokenDataset::from_tokens(corpus.val, static_cast<int>(cfg.vocab), "fortunes (val)"));
  } else {
    train_set.emplace(data::TokenDataset::from_shards(o.data, static_cast<int>(cfg.vocab)));
    val_set.emplace(data::TokenDataset::from_shards(o.val_data.empty() ? default_val_pattern(o.data) : o.val_data,
                                                    static_cast<int>(cfg.vocab)));
    say("data: %lld train tokens in %zu shards, %lld val tokens\n",
                static_cast<long long>(train_set->num_tokens()), train_set->num_shards(),
                static_cast<long long>(val_set->num_tokens()));
  }
  // The rank grid: tp adjacent ranks split each block, the rest replicate the model and
  // read different rows of the batch.
  LLMPAR_CHECK(o.tp >= 1 && world.size() % o.tp == 0, "--tp ", o.tp, " does not divide the ", world.size(),
               " ranks; use a tp that divides the number of ranks (--ranks, or mpirun -np)");
  comm::Grid grid(world, {.tp = o.tp});
  LLMPAR_CHECK(!o.sp || o.tp > 1, "--sp splits the sequence over the tensor-parallel group; use it with --tp 2 or more");
  const auto tp = nn::TensorParallelGroup::of<Policy>(&grid.tp());
  const data::LoaderConfig lc{.batch_size = static_cast<int>(o.batch), .seq_len = static_cast<int>(seq)};
  data::LoaderConfig train_lc = lc;
  train_lc.shuffle = o.shuffle;
  train_lc.seed = o.seed;
  train_lc.rank = grid.dp().rank();
  train_lc.world = grid.dp().size();
  data::LoaderConfig val_lc = lc;
  val_lc.rank = grid.dp().rank();
  val_lc.world = grid.dp().size();
  data::DataLoader train_loader(*train_set, train_lc);
  data::DataLoader val_loader(*val_set, val_lc);

  models::GPT2<float, B> model(cfg, o.seed, tp);
  say("model: %s, L=%lld H=%lld C=%lld T=%lld V=%lld (padded %lld), %.2fM parameters\n", o.model.c_str(),
              static_cast<long long>(cfg.layers), static_cast<long long>(cfg.heads), static_cast<long long>(cfg.dim),
              static_cast<long long>(seq), static_cast<long long>(cfg.vocab), static_cast<long long>(cfg.padded_vocab),
              static_cast<double>(model.num_parameters()) * 1e-6);
  say("train: %lld steps, %d rank%s (%s; tp %d%s x dp %d) x batch %lld x %lld, grad accum %lld, lr %.2e, warmup %lld, fp32, "
      "%s backend, MFU against a peak of %.1f GFLOP/s\n",
      static_cast<long long>(o.steps), world.size(), world.size() > 1 ? "s" : "", std::string(world.engine_name()).c_str(),
      grid.tp().size(), o.sp ? " sp" : "", grid.dp().size(),
      static_cast<long long>(o.batch), static_cast<long long>(seq), static_cast<long long>(o.grad_accum),
      static_cast<double>(o.lr), static_cast<long long>(warmup), B::kName, peak);
  say("policy: %s\n", Policy::kName);

  train::MetricsWriter metrics(lead ? o.metrics : std::string());
  metrics.write({{"type", "config"},
                 {"model", o.model},
                 {"layers", cfg.layers},
                 {"heads", cfg.heads},
                 {"dim", cfg.dim},
                 {"seq", seq},
                 {"vocab", cfg.vocab},
                 {"padded_vocab", cfg.padded_vocab},
                 {"parameters", model.num_parameters()},
                 {"ranks", world.size()},
                 {"tp", o.tp},
                 {"sp", o.sp},
                 {"batch", o.batch},
                 {"grad_accum", o.grad_accum},
                 {"steps", o.steps},
                 {"lr", o.lr},
                 {"warmup", warmup},
                 {"seed", o.seed},
                 {"precision", o.precision},
                 {"backend", B::kName},
                 {"peak_gflops", peak}});

  const optim::AdamWConfig opt{.lr = o.lr, .weight_decay = o.weight_decay, .grad_clip = o.grad_clip};
  const optim::CosineSchedule schedule{.peak_lr = o.lr, .warmup_steps = warmup, .total_steps = o.steps};
  train::Trainer<models::GPT2<float, B>> trainer(ctx, model, opt, schedule, train_loader,
                                              {.steps = o.steps, .grad_accum = o.grad_accum, .peak_gflops = peak},
                                              &grid.dp());
  // Never count a validation batch twice: at most one pass over the validation data.
  const std::int64_t eval_batches = std::min(o.eval_batches, val_loader.batches_per_epoch());
  auto run_eval = [&](std::int64_t step) {
    const double val = trainer.evaluate(val_loader, eval_batches);
    val_loader.reset();
    say("step %5lld | val loss %.4f\n", static_cast<long long>(step), val);
    metrics.write({{"type", "eval"}, {"step", step}, {"val_loss", val}});
  };
  if (o.eval_every > 0) run_eval(0);
  trainer.fit([&](const train::StepStats& s) {
    say("%s\n", train::format_step(s, o.steps).c_str());
    if (lead) std::fflush(stdout);
    metrics.write_step(s);
    if (o.eval_every > 0 && (s.step % o.eval_every == 0 || s.step == o.steps)) run_eval(s.step);
  });

  // Every rank samples (the split blocks need their whole tp group); rank 0 prints.
  if (o.sample_tokens > 0) {
    LLMPAR_CHECK(o.data.empty() || cfg.vocab == 256,
                 "sampling decodes with the byte tokenizer; pass --sample-tokens 0 "
                 "for models whose data used another tokenizer");
    const data::ByteTokenizer tok;
    std::vector<std::int32_t> prompt;
    for (std::uint16_t t : tok.encode(o.prompt)) prompt.push_back(t);
    const auto out =
        train::sample(ctx, model, prompt, {.tokens = o.sample_tokens, .temperature = o.temperature, .seed = o.seed});
    std::vector<std::uint16_t> ids(out.begin(), out.end());
    say("---- sample (temperature %.2f) ----\n%s\n----\n", static_cast<double>(o.temperature),
        tok.decode(ids).c_str());
  }
  return 0;
}

// The run on backend B, its layout composed from the flags: --sp chooses sequence
// parallelism at compile time (one instantiation each); the degrees come from the grid.
template <class B>
int run_on(const Options& o, comm::Comm& world, typename B::Context& ctx, double peak) {
  if (o.sp) return run<Compose<B, parallel::Tensor<SequenceParallel::on>>>(o, world, ctx, peak);
  return run<Compose<B, parallel::Tensor<SequenceParallel::off>>>(o, world, ctx, peak);
}

}  // namespace train_gpt
