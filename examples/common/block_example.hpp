// examples/common/block_example.hpp — what examples 01 to 03 share around their own
// block: the flags, the gradient check of the block, and training the Transformer of
// those blocks on the fortunes corpus over N ranks. Each example is then its block, its
// Spec and one call:
//
//   int main(int argc, char** argv) { return block_example::main<MySpec>(argc, argv, "my_block", cfg); }
//
//   my_block                        # check the block's gradients in double, train 60 steps on 1 rank
//   my_block --ranks 2 --tp 2 --sp  # the same model split over 2 thread ranks (mpirun: one per process)
//   my_block --precision bf16       # bf16 weights and activations, f32 master weights and gradients
//
// Only rank 0 prints: the step lines (train::format_step) and a last line of every
// step's loss to 9 digits, which the test suite compares between layouts. It exits 1 on an llmpar::Error (the message names
// the fix), 3 when the gradient check fails, 2 when the loss did not fall.
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <llmpar/llmpar.hpp>
#include <llmpar/testing/gradcheck.hpp>
#include <optional>
#include <string>

namespace block_example {

using namespace llmpar;

struct Options {
  int tp = 1;        // tensor-parallel degree; the other ranks replicate (data parallel)
  bool sp = false;   // sequence parallelism within the tp group
  std::string precision = "fp32";
  std::int64_t steps = 60;
  std::int64_t batch = 8;  // sequences per step, over all ranks
  std::int64_t seq = 64;
  float lr = 3e-3f;
  std::uint64_t seed = 1337;
  bool gradcheck = true;
};

// The Spec's block, in double on the CPU, against finite differences (rank 0 only).
template <class Spec>
bool check_block(const typename Spec::Config& cfg, bool report_it) {
  using Block = typename Spec::template Block<double, backend::Cpu>;
  backend::cpu::Context ctx;
  Block block("check", cfg, {});
  const auto report = testing::check_layer(ctx, block, {.batch = 2, .seq = std::min<std::int64_t>(8, cfg.max_seq),
                                                        .dim = cfg.dim});
  if (report_it) std::printf("%s\n", report.summary().c_str());
  return report.ok();
}

// One rank's run of the Transformer of Spec's blocks under Policy.
template <class Spec, class Policy>
int train(const Options& o, typename Spec::Config cfg, comm::Comm& world) {
  const bool lead = world.rank() == 0;
  auto say = [&](const std::string& line) {
    if (lead) std::printf("%s\n", line.c_str()), std::fflush(stdout);
  };
  cfg.max_seq = o.seq;
  cfg.validate();
  const data::TextCorpus corpus = data::load_text_corpus();
  const auto train_set = data::TokenDataset::from_tokens(corpus.train, static_cast<int>(cfg.vocab), "fortunes");

  parallel::LayoutConfig layout = parallel::layout_of<Policy>();
  layout.tp = o.tp;
  layout.sp = o.sp;
  layout.fit_world(world.size());
  LLMPAR_CHECK(o.batch % layout.dp == 0, "--batch ", o.batch, " is not divisible by the ", layout.dp,
               " data-parallel replicas; give a multiple of ", layout.dp);
  layout.micro_batch = o.batch / layout.dp;
  layout.validate();
  comm::Grid grid(world, {.tp = layout.tp});
  data::DataLoader loader(train_set, {.batch_size = static_cast<int>(layout.micro_batch),
                                      .seq_len = static_cast<int>(o.seq),
                                      .rank = grid.dp().rank(),
                                      .world = grid.dp().size(),
                                      .shuffle = true,
                                      .seed = o.seed});
  models::Transformer<Policy, backend::Cpu, Spec> model(cfg, o.seed, grid, layout);
  say("model: " + std::to_string(model.num_parameters()) + " parameters; policy " + Policy::kName + "; tp " +
      std::to_string(grid.tp().size()) + " x dp " + std::to_string(grid.dp().size()) + (o.sp ? ", sp" : ""));

  backend::cpu::Context ctx;
  train::Trainer<decltype(model)> trainer(ctx, model, {.lr = o.lr, .weight_decay = 0.1f, .grad_clip = 1.0f},
                                          {.peak_lr = o.lr, .warmup_steps = std::min<std::int64_t>(10, o.steps),
                                           .total_steps = o.steps},
                                          loader, {.steps = o.steps, .layout = layout}, grid);
  std::string losses = "losses";  // every step's, to 9 digits: what the tests compare between layouts
  double first = 0.0, last = 0.0;
  trainer.fit([&](const train::StepStats& s) {
    if (s.step == 1) first = s.loss;
    last = s.loss;
    say(train::format_step(s, o.steps));
    char value[32];
    std::snprintf(value, sizeof value, " %.9g", s.loss);
    losses += value;
  });
  say(losses);
  char line[128];
  std::snprintf(line, sizeof line, "loss %.4f at step 1 -> %.4f at step %lld", first, last,
                static_cast<long long>(o.steps));
  say(line);
  return last < first ? 0 : 2;
}

template <class Spec>
int main(int argc, char** argv, const char* name, const typename Spec::Config& cfg) {
  try {
    Launch launch = init(argc, argv);  // --ranks N (threads), or mpirun's ranks
    Options o;
    CLI::App app{std::string(name) + ": train a Transformer of this example's block with llmpar"};
    app.add_option("--tp", o.tp, "Tensor-parallel degree")->capture_default_str();
    app.add_flag("--sp", o.sp, "Sequence parallelism within the tensor-parallel group");
    app.add_option("--precision", o.precision, "fp32 or bf16")
        ->check(CLI::IsMember({"fp32", "bf16"}))
        ->capture_default_str();
    app.add_option("--steps", o.steps, "Optimizer steps")->capture_default_str();
    app.add_option("--batch", o.batch, "Sequences per step, over all ranks")->capture_default_str();
    app.add_option("--seq", o.seq, "Sequence length")->capture_default_str();
    app.add_option("--lr", o.lr, "Peak learning rate")->capture_default_str();
    app.add_option("--seed", o.seed, "Seed of the weights and the data order")->capture_default_str();
    app.add_flag("!--no-gradcheck", o.gradcheck, "Skip checking the block's gradients first");
    app.footer("  --ranks N   ranks as threads of this process (default 1); under mpirun, one per process");
    CLI11_PARSE(app, argc, argv);
    int status = 0;
    launch.run([&](comm::Comm& world) {
      // Every rank checks (the same numbers everywhere), rank 0 reports.
      if (o.gradcheck && !check_block<Spec>(cfg, world.rank() == 0)) {
        if (world.rank() == 0) {
          std::fprintf(stderr, "%s: the block's backward does not match finite differences (above)\n", name);
          status = 3;
        }
        return;
      }
      const int rc = o.precision == "bf16" ? train<Spec, Compose<backend::Cpu, precision::BF16Mixed>>(o, cfg, world)
                                           : train<Spec, Compose<backend::Cpu, precision::FP32>>(o, cfg, world);
      if (world.rank() == 0) status = rc;
    });
    return status;
  } catch (const std::exception& e) {  // llmpar::Error names the value and the fix
    std::fprintf(stderr, "%s: error: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace block_example
