// bench_kernels — llmpar's CPU kernels on the shapes of a GPT-2 124M step.
//
// GEMMs report GFLOP/s and their fraction of the sgemm peak measured at start-up (same
// library, same run); memory-bound kernels report GB/s of the bytes they must move.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <llmpar/backend/cpu/adamw.hpp>
#include <llmpar/backend/cpu/attention.hpp>
#include <llmpar/backend/cpu/convert.hpp>
#include <llmpar/backend/cpu/cross_entropy.hpp>
#include <llmpar/backend/cpu/gelu.hpp>
#include <llmpar/backend/cpu/gemm.hpp>
#include <llmpar/backend/cpu/layernorm.hpp>
#include <llmpar/backend/cpu/peak.hpp>
#include <llmpar/core/rng.hpp>
#include <llmpar/core/tensor.hpp>
#include <string>
#include <utility>

using namespace llmpar;
namespace cpu = llmpar::backend::cpu;

namespace {

Buffer<float> random_buffer(std::int64_t n, std::uint64_t seed, float scale = 1.0f) {
  Buffer<float> b(n);
  const auto s = rng::Stream::named(seed, "bench");
  for (std::int64_t i = 0; i < n; ++i) b[i] = scale * s.uniform(static_cast<std::uint64_t>(i)) - 0.5f * scale;
  return b;
}

void bytes_rate(benchmark::State& state, double bytes) {
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

struct GemmShape {
  const char* name;
  std::int64_t m, n, k;
  cpu::GemmOp op;
};

// One GEMM in storage type T: C is T for the forward and input-gradient forms and f32
// (main grads) for the accumulating weight-gradient form, as a training step runs them.
template <class T>
void gemm_case(benchmark::State& state, const GemmShape& s, double peak, cpu::Bf16Gemm bf16_path) {
  cpu::Context ctx(cpu::Context::Config{.bf16 = bf16_path});
  const auto a32 = random_buffer(s.m * s.k, 1), b32 = random_buffer(s.k * s.n, 2);
  Buffer<T> a(s.m * s.k), b(s.k * s.n), c(s.m * s.n);
  Buffer<float> c32 = random_buffer(s.m * s.n, 3);
  cpu::convert(a.data(), a32.data(), a.size());
  cpu::convert(b.data(), b32.data(), b.size());
  cpu::convert(c.data(), c32.data(), c.size());
  // The primitive (and a measured bf16 path's measurement) is made before the clock runs.
  const std::string how = s.op.accumulate ? ctx.implementation<T, float>(s.m, s.n, s.k, s.op)
                                          : ctx.implementation<T, T>(s.m, s.n, s.k, s.op);
  for (auto _ : state) {
    if (s.op.accumulate)
      ctx.gemm<T, float>(c32.data(), a.data(), b.data(), nullptr, s.m, s.n, s.k, s.op);
    else
      ctx.gemm<T, T>(c.data(), a.data(), b.data(), nullptr, s.m, s.n, s.k, s.op);
  }
  const double flops = 2.0 * static_cast<double>(s.m * s.n * s.k);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["of_peak"] = benchmark::Counter(flops / (peak * 1e9), benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(how);
}

// f32 and bf16 GEMMs of the step (of_peak: against the f32 peak measured at start-up,
// so bf16's figure above 1 is its gain over f32): bf16 on the path a training step takes
// (measured per shape; the label has both times), and pinned to each path.
void register_gemms(double peak) {
  // M = B·T = 256 rows of a GPT-2 124M step; forward, input-gradient and weight-gradient forms.
  static constexpr GemmShape kShapes[] = {
      {"qkv/fwd", 256, 2304, 768, {false, true, false}},
      {"qkv/dx", 256, 768, 2304, {}},
      {"qkv/dw", 2304, 768, 256, {true, false, true}},
      {"attn_proj/fwd", 256, 768, 768, {false, true, false}},
      {"fc/fwd", 256, 3072, 768, {false, true, false}},
      {"fc_proj/fwd", 256, 768, 3072, {false, true, false}},
      {"fc_proj/dw", 768, 3072, 256, {true, false, true}},
      {"lm_head/fwd", 256, 50304, 768, {false, true, false}},
      {"lm_head/dx", 256, 768, 50304, {}},
      {"lm_head/dw", 50304, 768, 256, {true, false, true}},
  };
  for (const GemmShape& s : kShapes) {
    benchmark::RegisterBenchmark(
        (std::string("gemm/f32/") + s.name).c_str(),
        [s, peak](benchmark::State& state) { gemm_case<float>(state, s, peak, cpu::Bf16Gemm::measured); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (const auto& [name, path] :
         {std::pair{"gemm/bf16/", cpu::Bf16Gemm::measured}, std::pair{"gemm/bf16_native/", cpu::Bf16Gemm::native},
          std::pair{"gemm/bf16_upconvert/", cpu::Bf16Gemm::upconvert}})
      benchmark::RegisterBenchmark((std::string(name) + s.name).c_str(),
                                   [s, peak, path](benchmark::State& state) { gemm_case<bf16>(state, s, peak, path); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  }
}

// Attention: B=4, C=768, NH=12 at T=64 and T=1024. Causal FLOPs: 2 GEMM-like products
// of B·NH·T²/2·hs multiply-adds each in the forward, 4 of them in the backward (besides
// the recomputed scores: 5 counted for the backward, as flash-attention papers do).
void attention_forward(benchmark::State& state) {
  const std::int64_t B = 4, T = state.range(0), C = 768, NH = 12;
  auto qkv = random_buffer(B * T * 3 * C, 4);
  Buffer<float> out(B * T * C), lse(B * NH * T);
  for (auto _ : state) cpu::attention_forward(out.data(), lse.data(), qkv.data(), AttentionShape::mha(B, T, C, NH));
  const double flops = 2.0 * 2.0 * static_cast<double>(B * NH) * static_cast<double>(T * T) / 2.0 * (C / NH);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(attention_forward)->Arg(64)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

void attention_backward(benchmark::State& state) {
  const std::int64_t B = 4, T = state.range(0), C = 768, NH = 12;
  auto qkv = random_buffer(B * T * 3 * C, 4);
  auto dout = random_buffer(B * T * C, 5);
  Buffer<float> out(B * T * C), lse(B * NH * T), dqkv(B * T * 3 * C);
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), AttentionShape::mha(B, T, C, NH));
  for (auto _ : state)
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(),
                            AttentionShape::mha(B, T, C, NH));
  const double flops = 5.0 * 2.0 * static_cast<double>(B * NH) * static_cast<double>(T * T) / 2.0 * (C / NH);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(attention_backward)->Arg(64)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

void layernorm_forward(benchmark::State& state) {
  const std::int64_t rows = state.range(0), C = 768;
  auto x = random_buffer(rows * C, 6), w = random_buffer(C, 7), b = random_buffer(C, 8);
  Buffer<float> out(rows * C), mean(rows), rstd(rows);
  for (auto _ : state)
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows, C);
  bytes_rate(state, 2.0 * 4.0 * static_cast<double>(rows * C));
}
BENCHMARK(layernorm_forward)->Arg(256)->Arg(4096)->Unit(benchmark::kMicrosecond)->UseRealTime();

void layernorm_backward(benchmark::State& state) {
  const std::int64_t rows = state.range(0), C = 768;
  auto x = random_buffer(rows * C, 6), w = random_buffer(C, 7), b = random_buffer(C, 8),
       dout = random_buffer(rows * C, 9);
  Buffer<float> out(rows * C), mean(rows), rstd(rows), dx(rows * C), dw(C), db(C);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows, C);
  for (auto _ : state)
    cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(), rstd.data(),
                            rows, C);
  bytes_rate(state, 3.0 * 4.0 * static_cast<double>(rows * C));
}
BENCHMARK(layernorm_backward)->Arg(256)->Arg(4096)->Unit(benchmark::kMicrosecond)->UseRealTime();

void gelu_forward(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  auto x = random_buffer(n, 10);
  Buffer<float> out(n);
  for (auto _ : state) cpu::gelu_forward(out.data(), x.data(), n);
  bytes_rate(state, 2.0 * 4.0 * static_cast<double>(n));
}
BENCHMARK(gelu_forward)->Arg(256 * 3072)->Unit(benchmark::kMicrosecond)->UseRealTime();

void cross_entropy(benchmark::State& state) {
  const std::int64_t rows = state.range(0), V = 50257, Vp = 50304;
  auto logits = random_buffer(rows * Vp, 11);
  Buffer<float> work(rows * Vp), losses(rows);
  Buffer<std::int32_t> targets(rows);
  for (std::int64_t i = 0; i < rows; ++i) targets[i] = static_cast<std::int32_t>((i * 7919) % V);
  for (auto _ : state) {
    state.PauseTiming();
    std::copy(logits.begin(), logits.end(), work.begin());
    state.ResumeTiming();
    cpu::cross_entropy_forward_backward(work.data(), losses.data(), targets.data(), rows, V, Vp, 1.0f / rows);
  }
  bytes_rate(state, 3.0 * 4.0 * static_cast<double>(rows * Vp));  // read twice, write once
}
BENCHMARK(cross_entropy)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();

// AdamW over 124M parameters: reads p, g, m, v and writes p, m, v.
void adamw(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  auto p = random_buffer(n, 12), g = random_buffer(n, 13);
  Buffer<float> m(n), v(n);
  m.zero();
  v.zero();
  const math::AdamWParams hp{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f};
  int step = 0;
  for (auto _ : state) cpu::adamw_update(p.data(), m.data(), v.data(), g.data(), n, hp, ++step, 1.0f);
  bytes_rate(state, 7.0 * 4.0 * static_cast<double>(n));
}
BENCHMARK(adamw)->Arg(124475904)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  double peak = 0.0;
  {
    cpu::Context ctx;
    const cpu::GemmPeak measured = cpu::measure_gemm_peak<float>(ctx);
    peak = measured.gflops;
    std::printf("measured f32 GEMM peak: %s\n", measured.describe().c_str());
  }
  benchmark::AddCustomContext("sgemm_peak_gflops", std::to_string(peak));
  register_gemms(peak);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
