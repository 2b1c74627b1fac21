// Data parallelism's device side (parallel::GradSync on backend::Cuda), on one GPU:
//   - backend::Cuda::sum_of_squares (the shard norm's kernel) against a double sum on
//     the host;
//   - GPT-2 (fp32 and bf16) trained for 4 steps under ZeRO stages 1, 2 and 3 gives the
//     losses and parameters of stage 0 on the same device: the shard segments, the
//     optimizer built for them, the pooled gradient buffers (stage 2) and the gathered
//     parameter buffers with their prefetch (stage 3, a world of one: every gather is a
//     copy) all work in device memory. Across GPUs the reductions are NCCL's, covered by
//     train_gpt's cuda case under mpirun on a machine with 2 GPUs.
//   - Checkpoints' device side: a run snapshotted after step 2 (Trainer::snapshot, a
//     copy from device memory) and restored into a fresh model and trainer
//     (Trainer::restore, a copy back) continues with the uninterrupted run's losses and
//     parameters bit for bit, at ZeRO 0, 1 and 3, fp32 and bf16.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "gpu_test.hpp"
#include "llmpar/backend/cuda/backend.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/parallel/grad_sync.hpp"
#include "llmpar/train/trainer.hpp"

using namespace llmpar;
using gpu_test::expect;
using gpu_test::failures;

namespace {

struct Result {
  std::vector<double> losses;
  std::vector<float> params;  // every parameter's values, in model order, as float
};

// `snapshot_after`: snapshot after that step, restore into a fresh model and trainer,
// and train the rest there (0: uninterrupted).
template <class T, int kStage>
Result train_stage(backend::cuda::Context& ctx, int snapshot_after = 0) {
  using Model = models::GPT2<T, backend::Cuda>;
  using Precision = std::conditional_t<std::is_same_v<T, bf16>, precision::BF16Mixed, precision::FP32>;
  using Policy = Compose<backend::Cuda, Precision, parallel::Data<zero::Stage<kStage>>>;
  const models::GPT2Config cfg{
      .layers = 2, .heads = 4, .dim = 64, .max_seq = 32, .vocab = 96, .padded_vocab = 128, .init_std = 0.05f};
  auto model = std::make_unique<Model>(cfg, 7);
  std::vector<std::uint16_t> tokens(8192);
  const auto stream = rng::Stream::named(3, "gpu dp tokens");
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint16_t>(stream.bits(i)[0] % 96);
  const data::TokenDataset dataset = data::TokenDataset::from_tokens(tokens, 96, "tokens");
  data::DataLoader loader(dataset, {.batch_size = 4, .seq_len = 32});
  using Trainer = train::Trainer<Model, Policy>;
  parallel::LayoutConfig layout = parallel::layout_of<Policy>();
  layout.micro_batch = 4;
  layout.grad_accum = 2;
  layout.data = {.bucket_bytes = 16 << 10};
  auto make_trainer = [&](Model& m) {
    return std::make_unique<Trainer>(ctx, m, optim::AdamWConfig{.lr = 1e-2f, .eps = 1e-2f, .grad_clip = 0.5f},
                                     optim::CosineSchedule{.peak_lr = 1e-2f, .warmup_steps = 0, .total_steps = 4},
                                     loader, train::TrainerConfig{.steps = 4, .layout = layout});
  };
  auto trainer = make_trainer(*model);
  Result r;
  for (int s = 0; s < 4; ++s) {
    r.losses.push_back(trainer->step().loss);
    if (s + 1 == snapshot_after) {
      const auto snap = trainer->snapshot(train::SnapshotScope::held);
      trainer.reset();
      model = std::make_unique<Model>(cfg, 8);  // other initial values: all must come from the snapshot
      trainer = make_trainer(*model);
      trainer->restore(checkpoint::Source::of(snap), snap.state);
    }
  }
  ctx.synchronize();
  trainer->sync().for_each_owned([&](const nn::Parameter<T>&, std::int64_t, const float*, const T* value,
                                     std::int64_t n) {
    std::vector<T> host(static_cast<std::size_t>(n));
    LLMPAR_CHECK_CUDA(cudaMemcpy(host.data(), value, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToHost));
    for (const T& v : host) r.params.push_back(static_cast<float>(v));
  });
  return r;
}

template <class T>
void check_stages(backend::cuda::Context& ctx, const char* precision) {
  const Result base = train_stage<T, 0>(ctx);
  const Result stages[] = {train_stage<T, 1>(ctx), train_stage<T, 2>(ctx), train_stage<T, 3>(ctx)};
  for (int k = 0; k < 3; ++k) {
    const Result& r = stages[k];
    double loss = 0.0, param = 0.0;
    for (std::size_t s = 0; s < base.losses.size(); ++s)
      loss = std::max(loss, std::abs(r.losses[s] - base.losses[s]) / std::abs(base.losses[s]));
    bool same_size = r.params.size() == base.params.size();
    for (std::size_t i = 0; same_size && i < base.params.size(); ++i)
      param = std::max(param, static_cast<double>(std::abs(r.params[i] - base.params[i])));
    // One GPU: every stage does the same arithmetic as stage 0 (a gather is a copy, a
    // shard is all of it), so the runs agree to float rounding of the summed shards.
    gpu_test::report(same_size && loss <= 1e-6 && param <= 1e-6,
                     std::string(precision) + " ZeRO stage " + std::to_string(k + 1) + " vs stage 0: losses " +
                         std::to_string(loss) + ", parameters " + std::to_string(param));
  }
}

template <class T, int kStage>
void check_resume(backend::cuda::Context& ctx, const char* precision) {
  const Result whole = train_stage<T, kStage>(ctx), resumed = train_stage<T, kStage>(ctx, 2);
  gpu_test::report(whole.losses == resumed.losses && whole.params == resumed.params,
                   std::string(precision) + " ZeRO " + std::to_string(kStage) +
                       ": snapshot after step 2, restored into a fresh trainer, continues bit for bit");
}

}  // namespace

int main() {
  try {
    expect(backend::cuda::device_count() >= 0, "device_count");
    if (backend::cuda::device_count() == 0) {
      std::printf("skipped: no CUDA device\n");
      return gpu_test::skip_exit_code();
    }
    backend::cuda::Context ctx(0);
    // The shard norm's kernel.
    for (std::int64_t n : {std::int64_t{1}, std::int64_t{1000}, std::int64_t{1} << 20}) {
      std::vector<float> host(static_cast<std::size_t>(n));
      const auto stream = rng::Stream::named(1, "squares");
      double want = 0.0;
      for (std::int64_t i = 0; i < n; ++i) {
        host[static_cast<std::size_t>(i)] = stream.normal(static_cast<std::uint64_t>(i));
        want += static_cast<double>(host[static_cast<std::size_t>(i)]) * host[static_cast<std::size_t>(i)];
      }
      Buffer<float, memory::Device> x(n);
      memory::Device::copy_from_host(x.data(), host.data(), x.bytes());
      const double got = backend::Cuda::sum_of_squares(ctx, x.data(), n);
      gpu_test::report(std::abs(got - want) <= 1e-9 * want, "sum_of_squares of " + std::to_string(n) + " floats: " +
                                                                std::to_string(got) + " vs " + std::to_string(want));
    }
    check_stages<float>(ctx, "fp32");
    check_stages<bf16>(ctx, "bf16");
    check_resume<float, 0>(ctx, "fp32");
    check_resume<float, 1>(ctx, "fp32");
    check_resume<float, 3>(ctx, "fp32");
    check_resume<bf16, 1>(ctx, "bf16");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    ++failures;
  }
  std::printf("%s\n", gpu_test::verdict());
  return failures ? 1 : 0;
}
