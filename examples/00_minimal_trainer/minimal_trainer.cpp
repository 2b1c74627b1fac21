// 00_minimal_trainer — the smallest complete llmpar trainer: GPT-2 (the gpt2-tiny preset)
// on the embedded fortunes corpus, one rank, fp32 on the CPU. README.md beside it says
// what each part is; 01_swap_mlp goes on to a block of one's own.
#include <cstdio>
#include <llmpar/llmpar.hpp>

using namespace llmpar;

int main() {
  try {
    // The one place the policy is named: the model's type carries it to the Trainer.
    using Policy = Compose<backend::Cpu, precision::FP32>;
    models::GPT2Config cfg = models::GPT2Config::preset("gpt2-tiny");  // 4 layers, 128 channels, bytes

    const data::TextCorpus corpus = data::load_text_corpus();
    const auto train_set = data::TokenDataset::from_tokens(corpus.train, static_cast<int>(cfg.vocab), "train");
    const auto val_set = data::TokenDataset::from_tokens(corpus.val, static_cast<int>(cfg.vocab), "val");
    data::DataLoader train(train_set, {.batch_size = 8, .seq_len = 64, .shuffle = true, .seed = 1});
    data::DataLoader val(val_set, {.batch_size = 8, .seq_len = 64});

    models::GPT2<Policy> model(cfg, /*seed=*/1);
    parallel::LayoutConfig layout = parallel::layout_of<Policy>();
    layout.micro_batch = 8;

    backend::cpu::Context ctx;
    const std::int64_t steps = 100;
    train::Trainer<decltype(model)> trainer(ctx, model, {.lr = 3e-3f, .weight_decay = 0.1f, .grad_clip = 1.0f},
                                            {.peak_lr = 3e-3f, .warmup_steps = 10, .total_steps = steps}, train,
                                            {.steps = steps, .layout = layout});
    trainer.fit([&](const train::StepStats& s) {
      if (s.step % 10 == 0 || s.step == 1) std::printf("%s\n", train::format_step(s, steps).c_str());
    });
    std::printf("val loss %.4f\n", trainer.evaluate(val, 4));
    return 0;
  } catch (const Error& e) {  // every llmpar error names the value and the fix
    std::fprintf(stderr, "minimal_trainer: %s\n", e.what());
    return 1;
  }
}
