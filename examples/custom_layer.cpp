// custom_layer — trains a model made of a user-defined block: a LLaMA-style transformer
// block (RMSNorm, rotary position embeddings, SwiGLU MLP) written outside llmpar, in
// custom_layer.hpp, from llmpar's layers and kernels plus the user's own element-wise
// code. Nothing in llmpar's model code knows about it, yet it trains under tensor
// and sequence parallelism: the block is built from ColumnParallelLinear /
// RowParallelLinear and the group's gather_rows / reduce_rows, so splitting it over
// ranks is the building blocks' job, not the user's. The layout (tp, sp, dp) is one
// parallel::LayoutConfig, a value; the policy is the default Compose<> (fp32, CPU).
//
//   custom_layer                            # 300 steps on the fortunes corpus, one rank
//   custom_layer --ranks 2 --tp 2           # the block's heads and MLP split over 2 ranks
//   custom_layer --ranks 2 --tp 2 --sp      # ... and the norms and residuals' rows too
//   custom_layer --ranks 4 --tp 2 --batch 4 # 2-way tensor parallel x 2 replicas
//
// Read custom_layer.hpp first: its top comment says what a user writes and why that is
// all. This file is the ordinary training setup, the same as train_gpt's: the rank
// grid, the byte-level corpus, the trainer, and a sample at the end. It exits with 2
// when the training loss of the last step is not below the first step's, so a short
// run (--steps 20) doubles as a smoke test.
#include "custom_layer.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <vector>

using namespace llmpar;

namespace {

struct Options {
  int tp = 1;       // tensor-parallel degree; the other ranks replicate (data parallel)
  bool sp = false;  // sequence parallelism within the tp group
  std::int64_t steps = 300;
  std::int64_t batch = 8;
  std::int64_t seq = 64;
  float lr = 3e-3f;
  std::int64_t warmup = 20;
  std::uint64_t seed = 1337;
  std::int64_t eval_batches = 8;
  std::int64_t sample_tokens = 200;
  custom_layer::LlamaConfig model;
};

// One rank's run.
int run(const Options& o, comm::Comm& world) {
  // fp32 on the CPU; every other dimension of the layout is a value (`layout` below).
  using Policy = Compose<backend::Cpu, precision::FP32>;
  const bool lead = world.rank() == 0;
  auto say = [&](auto... args) {
    if (lead) std::printf(args...);
  };
  custom_layer::LlamaConfig cfg = o.model;
  cfg.max_seq = o.seq;
  cfg.validate();

  const data::TextCorpus corpus = data::load_text_corpus();
  LLMPAR_CHECK(cfg.vocab >= corpus.vocab_size, "the byte-level corpus needs a vocabulary of ", corpus.vocab_size);
  const auto train_set = data::TokenDataset::from_tokens(corpus.train, static_cast<int>(cfg.vocab), "fortunes (train)");
  const auto val_set = data::TokenDataset::from_tokens(corpus.val, static_cast<int>(cfg.vocab), "fortunes (val)");

  // The layout, checked once, and the rank grid: tp adjacent ranks split each block, the
  // rest replicate the model and read different rows of the batch.
  parallel::LayoutConfig layout = parallel::layout_of<Policy>();
  layout.tp = o.tp;
  layout.sp = o.sp;
  layout.micro_batch = o.batch;
  layout.fit_world(world.size()).validate();
  comm::Grid grid(world, {.tp = layout.tp});
  data::LoaderConfig lc{.batch_size = static_cast<int>(o.batch), .seq_len = static_cast<int>(o.seq)};
  lc.rank = grid.dp().rank();
  lc.world = grid.dp().size();
  data::LoaderConfig train_lc = lc;
  train_lc.shuffle = true;
  train_lc.seed = o.seed;
  data::DataLoader train_loader(train_set, train_lc);
  data::DataLoader val_loader(val_set, lc);

  custom_layer::LlamaModel<Policy> model(cfg, o.seed, grid, layout);
  say("model: LLaMA-style, L=%lld NH=%lld C=%lld H=%lld T=%lld V=%lld, %.2fM parameters\n",
      static_cast<long long>(cfg.layers), static_cast<long long>(cfg.heads), static_cast<long long>(cfg.dim),
      static_cast<long long>(cfg.hidden), static_cast<long long>(cfg.max_seq), static_cast<long long>(cfg.vocab),
      static_cast<double>(model.num_parameters()) * 1e-6);
  say("train: %lld steps, %d rank%s (tp %d x dp %d) x batch %lld x %lld, lr %.2e\n", static_cast<long long>(o.steps),
      world.size(), world.size() > 1 ? "s" : "", grid.tp().size(), grid.dp().size(), static_cast<long long>(o.batch),
      static_cast<long long>(o.seq), static_cast<double>(o.lr));
  say("policy: %s\n", Policy::kName);

  backend::cpu::Context ctx;
  const optim::AdamWConfig opt{.lr = o.lr, .weight_decay = 0.1f, .grad_clip = 1.0f};
  const optim::CosineSchedule schedule{
      .peak_lr = o.lr, .warmup_steps = std::min(o.warmup, o.steps), .total_steps = o.steps};
  // The grid's groups: the dp reduction, and the global norm over every rank (the
  // split parameters' squares summed over the tp ranks).
  train::Trainer<decltype(model)> trainer(ctx, model, opt, schedule, train_loader, {.steps = o.steps, .layout = layout},
                                          grid);
  double first = 0.0, last = 0.0;
  trainer.fit([&](const train::StepStats& s) {
    if (s.step == 1) first = s.loss;
    last = s.loss;
    say("%s\n", train::format_step(s, o.steps).c_str());
    if (lead) std::fflush(stdout);
  });
  const double val = trainer.evaluate(val_loader, std::min(o.eval_batches, val_loader.batches_per_epoch()));
  say("val loss %.4f\n", val);
  say("loss %.4f at step 1 -> %.4f at step %lld (%s)\n", first, last, static_cast<long long>(o.steps),
      last < first ? "fell" : "did not fall");

  // Every rank samples (the split blocks need all tp ranks in each forward); the same
  // seed gives the same text everywhere, and rank 0 prints it.
  if (o.sample_tokens > 0) {
    const data::ByteTokenizer tok;
    std::vector<std::int32_t> prompt;
    for (std::uint16_t t : tok.encode("The ")) prompt.push_back(t);
    const auto out = train::sample(ctx, model, prompt, {.tokens = o.sample_tokens, .seed = o.seed});
    const std::vector<std::uint16_t> ids(out.begin(), out.end());
    say("---- sample ----\n%s\n----\n", tok.decode(ids).c_str());
  }
  return last < first ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<Launch> launch;
  try {
    launch.emplace(init(argc, argv));  // --ranks N (threads), or mpirun's ranks
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_layer: error: %s\n", e.what());
    return 1;
  }
  Options o;
  CLI::App app{"custom_layer: train a model of user-defined LLaMA-style blocks with llmpar"};
  app.add_option("--tp", o.tp, "Tensor-parallel degree: split every block's heads and MLP over this many ranks")
      ->capture_default_str();
  app.add_flag("--sp", o.sp,
               "Sequence parallelism: the norms and residual stream hold 1/tp of the rows (needs --seq divisible by "
               "--tp)");
  app.add_option("--steps", o.steps, "Optimizer steps")->capture_default_str();
  app.add_option("--batch", o.batch, "Sequences per batch and rank")->capture_default_str();
  app.add_option("--seq", o.seq, "Sequence length T")->capture_default_str();
  app.add_option("--lr", o.lr, "Peak learning rate")->capture_default_str();
  app.add_option("--warmup", o.warmup, "Linear warmup steps, then cosine decay")->capture_default_str();
  app.add_option("--seed", o.seed, "Seed of initialisation, data order and sampling")->capture_default_str();
  app.add_option("--layers", o.model.layers, "Blocks")->capture_default_str();
  app.add_option("--heads", o.model.heads, "Attention heads")->capture_default_str();
  app.add_option("--dim", o.model.dim, "Channels")->capture_default_str();
  app.add_option("--hidden", o.model.hidden, "SwiGLU hidden units")->capture_default_str();
  app.add_option("--sample-tokens", o.sample_tokens, "Tokens to sample at the end (0: none)")->capture_default_str();
  app.footer(
      "Ranks (read before the options above):\n"
      "  --ranks N   Train on N ranks, as threads of this process (default 1); under mpirun, one per process");
  CLI11_PARSE(app, argc, argv);
  try {
    int status = 0;
    launch->run([&](comm::Comm& world) {
      const int rc = run(o, world);
      if (world.rank() == 0) status = rc;
    });
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_layer: error: %s\n", e.what());
    return 1;
  }
}
