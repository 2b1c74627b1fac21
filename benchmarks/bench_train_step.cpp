// bench_train_step — one full training step of GPT-2 124M on the CPU (forward, backward,
// AdamW), at B=4, T=64 by default, in fp32 and bf16 (BF16Mixed: bf16 weights and
// activations, f32 main grads, f32 master weights), and its parts; and the step of a
// small GPT split over tp = 1, 2, 4 tensor-parallel thread ranks (gpt_small/train_step_tp).
//
// MFU is reported as model FLOPs (6N + 6·L·C·T per token, the llm.c convention) over
// the GEMM peak of the step's own precision, measured at the start of this same run on
// square products and the step's own GEMM shapes (backend/cpu/peak.hpp), so the figure
// is relative to what the machine's GEMM library can actually do in that precision.
// Compare with PyTorch through benchmarks/pytorch_step.py (./llmpar.sh bench runs both).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <llmpar/llmpar.hpp>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using namespace llmpar;

namespace {

template <class T>
struct StepFixture {
  backend::cpu::Context ctx;
  models::GPT2Config cfg;
  std::int64_t batch, seq;
  std::unique_ptr<models::GPT2<T>> model;
  std::unique_ptr<optim::AdamW<T>> opt;
  std::vector<std::int32_t> tokens, targets;

  StepFixture(const std::string& preset, std::int64_t b, std::int64_t s)
      : cfg(models::GPT2Config::preset(preset)), batch(b), seq(s) {
    model = std::make_unique<models::GPT2<T>>(cfg, 1337);
    opt = std::make_unique<optim::AdamW<T>>(ctx, model->parameter_store(), optim::AdamWConfig{});
    const auto stream = rng::Stream::named(1, "bench tokens");
    for (std::int64_t i = 0; i <= b * s; ++i)
      tokens.push_back(static_cast<std::int32_t>(stream.bits(static_cast<std::uint64_t>(i))[0] % cfg.vocab));
    targets.assign(tokens.begin() + 1, tokens.end());
    tokens.pop_back();
  }
  double flops_per_step() const {
    return train::flops_per_token(model->num_parameters(), cfg.layers, cfg.dim, seq) * static_cast<double>(batch * seq);
  }
};

// Plain (not rate) counters from the measured wall time of the timed iterations.
void set_counters(benchmark::State& state, double seconds, double flops_per_step, double tokens_per_step,
                  double peak_gflops) {
  const double per_step = seconds / static_cast<double>(state.iterations());
  state.counters["ms/step"] = 1e3 * per_step;
  state.counters["tokens/s"] = tokens_per_step / per_step;
  state.counters["GFLOP/s"] = flops_per_step / per_step * 1e-9;
  state.counters["MFU"] = flops_per_step / per_step / (peak_gflops * 1e9);
}

template <class Body>
double timed(Body&& body) {
  const auto t0 = std::chrono::steady_clock::now();
  body();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class T>
void register_precision(const char* precision, double peak_gflops) {
  // The whole step (zero grads, forward, backward, clip and AdamW), and the same without
  // the optimizer to separate its share.
  for (const bool with_optimizer : {true, false}) {
    auto run = [peak_gflops, with_optimizer](benchmark::State& state) {
      StepFixture<T> f("gpt2-124m", state.range(0), state.range(1));
      double seconds = 0.0;
      for (auto _ : state) {
        seconds += timed([&] {
          f.model->zero_grad(f.ctx);
          benchmark::DoNotOptimize(f.model->forward(f.ctx, f.tokens.data(), f.targets.data(), f.batch, f.seq));
          f.model->backward(f.ctx);
          if (with_optimizer) f.opt->step(1e-4f);
        });
      }
      set_counters(state, seconds, f.flops_per_step(), static_cast<double>(f.batch * f.seq), peak_gflops);
    };
    benchmark::RegisterBenchmark(
        (std::string("gpt2_124m/") + (with_optimizer ? "train_step/" : "forward_backward/") + precision).c_str(), run)
        ->Args({4, 64})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->Iterations(6);
  }

  // The optimizer alone: gradient norm, then AdamW over every parameter.
  auto adamw = [](benchmark::State& state) {
    StepFixture<T> f("gpt2-124m", state.range(0), state.range(1));
    for (auto _ : state) f.opt->step(1e-4f);
    // The norm reads the f32 gradients; AdamW reads master, grad, m, v and writes master,
    // m, v (and the 16-bit copy).
    const double bytes =
        (std::is_same_v<T, float> ? 8.0 * 4.0 : 8.0 * 4.0 + 2.0) * static_cast<double>(f.model->num_parameters());
    state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  };
  benchmark::RegisterBenchmark((std::string("gpt2_124m/optimizer/") + precision).c_str(), adamw)
      ->Args({4, 64})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->Iterations(6);
}

// One training step of a small GPT (L=4, H=8, C=512, T=128, B=8) split over tp thread
// ranks (ThreadComm), each rank with its share of the OpenMP threads, without and with
// sequence parallelism (arguments: tp, sp): the cost of tensor parallelism's
// communication against the serial step.
void register_tensor_parallel(double peak_gflops) {
  auto run = [peak_gflops](benchmark::State& state) {
    const int tp = static_cast<int>(state.range(0));
    const auto sp = state.range(1) != 0 ? SequenceParallel::on : SequenceParallel::off;
    const models::GPT2Config cfg{
        .layers = 4, .heads = 8, .dim = 512, .max_seq = 128, .vocab = 256, .padded_vocab = 256};
    const std::int64_t B = 8, T = 128;
    std::vector<std::int32_t> tokens, targets;
    const auto stream = rng::Stream::named(1, "bench tokens");
    for (std::int64_t i = 0; i <= B * T; ++i)
      tokens.push_back(static_cast<std::int32_t>(stream.bits(static_cast<std::uint64_t>(i))[0] % cfg.vocab));
    targets.assign(tokens.begin() + 1, tokens.end());
    tokens.pop_back();
    double seconds = 0.0, flops = 0.0;
    const int iterations = 4;
    comm::ThreadOptions options;
    options.omp_threads_per_rank = std::max(1, omp_get_max_threads() / tp);
    comm::run_threads(
        tp,
        [&](comm::ThreadComm& thread_world) {
          comm::Comm world(std::move(thread_world));
          backend::cpu::Context ctx;
          models::GPT2<float> model(cfg, 1337, nn::TensorParallelGroup(&world, sp));
          parallel::GradSync<models::GPT2<float>, 0> sync(ctx, model, {.world = &world}, {});
          optim::AdamW<float> opt(ctx, sync.optimizer_shard(), optim::AdamWConfig{});
          auto step = [&] {
            sync.begin_step();
            sync.begin_micro_batch(true);
            model.forward(ctx, tokens.data(), targets.data(), B, T);
            model.backward(ctx);
            sync.end_micro_batch();
            sync.finish();
            const optim::GradNorm norm = sync.gradient_norm();
            if (norm.finite) opt.update(1e-4f, norm);
            sync.after_update();
          };
          step();  // warm-up: buffers and GEMM primitives
          world.barrier();
          const double s = timed([&] {
            for (int i = 0; i < iterations; ++i) step();
            world.barrier();
          });
          if (world.rank() == 0) {
            seconds = s;
            flops = train::flops_per_token(model.num_parameters(), cfg.layers, cfg.dim, T) * static_cast<double>(B * T);
          }
        },
        options);
    for (auto _ : state) state.SetIterationTime(seconds / iterations);
    const double per_step = seconds / iterations;
    state.counters["ms/step"] = 1e3 * per_step;
    state.counters["tokens/s"] = static_cast<double>(B * T) / per_step;
    state.counters["MFU"] = flops / per_step / (peak_gflops * 1e9);
  };
  benchmark::RegisterBenchmark("gpt_small/train_step_tp", run)
      ->ArgNames({"tp", "sp"})
      ->Args({1, 0})
      ->Args({2, 0})
      ->Args({2, 1})
      ->Args({4, 0})
      ->Args({4, 1})
      ->Unit(benchmark::kMillisecond)
      ->UseManualTime()
      ->Iterations(1);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  // The peaks of both precisions over the 124M step's own shapes (B=4, T=64: 256 rows).
  const std::vector<backend::cpu::GemmShape> shapes =
      backend::cpu::step_gemm_shapes(256, models::GPT2Config::preset("gpt2-124m").linear_sizes());
  double peak_f32 = 0.0, peak_bf16 = 0.0;
  {
    backend::cpu::Context ctx;
    const backend::cpu::GemmPeak f32 = backend::cpu::measure_gemm_peak<float>(ctx, shapes);
    const backend::cpu::GemmPeak b16 = backend::cpu::measure_gemm_peak<bf16>(ctx, shapes);
    peak_f32 = f32.gflops;
    peak_bf16 = b16.gflops;
    std::printf("measured f32 GEMM peak: %s\nmeasured bf16 GEMM peak: %s\n", f32.describe().c_str(),
                b16.describe().c_str());
    benchmark::AddCustomContext("f32_gemm_peak", f32.describe());
    benchmark::AddCustomContext("bf16_gemm_peak", b16.describe());
  }
  register_precision<float>("fp32", peak_f32);
  register_precision<bf16>("bf16", peak_bf16);
  register_tensor_parallel(peak_f32);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
