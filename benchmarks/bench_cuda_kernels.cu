// bench_cuda_kernels — llmpar's CUDA kernels and cuBLASLt GEMMs, timed with CUDA events.
//
// Each benchmark times the kernel alone on the compute stream: an event before and after
// every repetition, the L2 cache flushed (a memset of twice its size) between
// repetitions and outside the timed span, so every repetition reads from HBM as in a
// training step. Counters: TFLOP/s or GB/s, and the fraction of the device's peak (the
// data sheet's dense rate for the kernel's arithmetic, datasheet_peak_tflops: bf16 on
// tensor cores, TF32 for the f32 GEMM, fp32 CUDA cores for f32 attention; HBM bandwidth
// from the memory clock and bus width the driver reports).
//
// GEMMs are compared with cuBLASLt's best: the same shape is run with every algorithm
// its heuristic offers (up to 16), and `of_best` is the fastest of those over the time
// of the one Blas picks. Bytes counted are the minimum a kernel must move (each input
// read once, each output written once).
//
// Without a CUDA device the program prints a line and exits 0, so ./llmpar.sh bench
// runs everywhere.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <span>
#include <vector>

#include "llmpar/backend/cuda/gemm.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/kernels/adamw.cuh"
#include "llmpar/kernels/attention.cuh"
#include "llmpar/kernels/cross_entropy.cuh"
#include "llmpar/kernels/elementwise.cuh"
#include "llmpar/kernels/layernorm.cuh"

namespace {

using namespace llmpar;
using namespace llmpar::backend::cuda;

struct Device {
  DeviceContext context{0};
  double hbm_gbps = 0.0;
  DeviceBuffer<std::byte> flush;
  Device() {
    int khz = 0, bus_bits = 0, l2 = 0;
    LLMPAR_CHECK_CUDA(cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, 0));
    LLMPAR_CHECK_CUDA(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0));
    LLMPAR_CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
    hbm_gbps = 2.0 * khz * 1e3 * (bus_bits / 8.0) * 1e-9;  // double data rate
    flush = DeviceBuffer<std::byte>(static_cast<std::size_t>(2 * l2), context.compute());
  }
};

Device& device() {
  static Device d;
  return d;
}

// The data sheet's dense peak of device 0 for GEMM-like work on T (0: unknown part).
template <class T>
double peak_tflops(Fp32Math fp32) {
  return datasheet_peak_tflops(0, dtype_of<T>(), fp32);
}

// Times `launch` once per iteration with events, flushing L2 before each; returns the
// mean milliseconds per launch. of_peak is reported against peak (TFLOP/s) when it is
// known (> 0).
double time_kernel(benchmark::State& state, const std::function<void(cudaStream_t)>& launch, double flops, double bytes,
                   double peak = 0.0) {
  Device& d = device();
  const cudaStream_t stream = d.context.compute();
  launch(stream);  // warm-up: plan caches, first-touch
  LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream));
  Event start(Event::Timing::on), stop(Event::Timing::on);
  double total_ms = 0.0;
  for (auto _ : state) {
    LLMPAR_CHECK_CUDA(cudaMemsetAsync(d.flush.data(), 0, d.flush.bytes(), stream));
    start.record(stream);
    launch(stream);
    stop.record(stream);
    stop.synchronize();
    const double ms = static_cast<double>(stop.ms_since(start));
    total_ms += ms;
    state.SetIterationTime(ms * 1e-3);
  }
  const auto per_second = benchmark::Counter::kIsIterationInvariantRate;
  if (flops > 0) {
    state.counters["TFLOP/s"] = benchmark::Counter(flops * 1e-12, per_second);
    if (peak > 0) state.counters["of_peak"] = benchmark::Counter(flops * 1e-12 / peak, per_second);
  }
  if (bytes > 0) {
    state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, per_second);
    state.counters["of_hbm"] = benchmark::Counter(bytes * 1e-9 / d.hbm_gbps, per_second);
  }
  return state.iterations() > 0 ? total_ms / static_cast<double>(state.iterations()) : 0.0;
}

template <class T>
DeviceBuffer<T> filled(std::size_t n, float value) {
  DeviceBuffer<T> b(n, device().context.compute());
  std::vector<T> host(n, convert<T>(value));
  b.upload(host);
  return b;
}

// Attention, causal: forward 4·B·NH·T²·hs/2 FLOPs; backward 2.5x that (the FLOPs do
// not depend on the kv heads: grouped-query attention only shrinks k and v).
// Arguments: B, T, hs, query heads NH, kv heads KVH.
template <class T>
void attention(benchmark::State& state, bool backward) {
  const AttentionShape shape{state.range(0), state.range(1), state.range(3), state.range(4), state.range(2)};
  const auto n_qkv = static_cast<std::size_t>(shape.batch * shape.seq * shape.row());
  const auto n_out = static_cast<std::size_t>(shape.batch * shape.seq * shape.q_dim());
  auto qkv = filled<T>(n_qkv, 0.01f);
  auto out = filled<T>(n_out, 0.0f);
  auto dout = filled<T>(n_out, 0.01f);
  auto dqkv = filled<T>(n_qkv, 0.0f);
  auto lse = filled<float>(static_cast<std::size_t>(shape.batch * shape.heads * shape.seq), 0.0f);
  auto workspace = filled<float>(static_cast<std::size_t>(kernels::attention_backward_workspace(shape)), 0);
  const double forward_flops =
      4.0 * shape.batch * shape.heads * static_cast<double>(shape.seq) * shape.seq * shape.head_dim / 2.0;
  const double peak = peak_tflops<T>(Fp32Math::strict);  // 16-bit: mma.sync; f32: the SIMT path
  kernels::attention_forward(device().context.compute(), out.data(), lse.data(), qkv.data(), shape);
  if (!backward) {
    time_kernel(
        state, [&](cudaStream_t s) { kernels::attention_forward(s, out.data(), lse.data(), qkv.data(), shape); },
        forward_flops, 0, peak);
  } else {
    time_kernel(
        state,
        [&](cudaStream_t s) {
          kernels::attention_backward(s, dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), workspace.data(),
                                      shape);
        },
        2.5 * forward_flops, 0, peak);
  }
}

template <class T>
void layernorm_forward(benchmark::State& state) {
  const std::int64_t rows = state.range(0), C = state.range(1);
  auto x = filled<T>(static_cast<std::size_t>(rows * C), 1.0f);
  auto out = filled<T>(static_cast<std::size_t>(rows * C), 0.0f);
  auto w = filled<T>(static_cast<std::size_t>(C), 1.0f);
  auto mean = filled<float>(static_cast<std::size_t>(rows), 0.0f);
  auto rstd = filled<float>(static_cast<std::size_t>(rows), 0.0f);
  time_kernel(
      state,
      [&](cudaStream_t s) {
        kernels::layernorm_forward(s, out.data(), mean.data(), rstd.data(), x.data(), w.data(), w.data(), rows, C);
      },
      0, 2.0 * rows * C * sizeof(T) + 8.0 * rows);
}

template <class T>
void layernorm_backward(benchmark::State& state) {
  const std::int64_t rows = state.range(0), C = state.range(1);
  auto x = filled<T>(static_cast<std::size_t>(rows * C), 1.0f);
  auto dout = filled<T>(static_cast<std::size_t>(rows * C), 0.5f);
  auto dx = filled<T>(static_cast<std::size_t>(rows * C), 0.0f);
  auto w = filled<T>(static_cast<std::size_t>(C), 1.0f);
  auto dw = filled<float>(static_cast<std::size_t>(C), 0.0f);  // f32 main grads
  auto db = filled<float>(static_cast<std::size_t>(C), 0.0f);
  auto mean = filled<float>(static_cast<std::size_t>(rows), 0.0f);
  auto rstd = filled<float>(static_cast<std::size_t>(rows), 1.0f);
  auto workspace = filled<float>(static_cast<std::size_t>(kernels::layernorm_backward_workspace(rows, C)), 0.0f);
  time_kernel(
      state,
      [&](cudaStream_t s) {
        kernels::layernorm_backward(s, dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                                    rstd.data(), workspace.data(), rows, C);
      },
      0, 3.0 * rows * C * sizeof(T) + 8.0 * rows);
}

// AdamW as backend::cuda::AdamW runs it for a bf16 store: fp32 master weights, f32
// main grads, bf16 parameters. Per element it reads the gradient twice (norm, update)
// and master, m, v, and writes master, m, v and the bf16 copy.
void adamw(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t tensors = 64, per = n / tensors;
  auto master = filled<float>(n, 0.1f);
  auto m = filled<float>(n, 0.0f);
  auto v = filled<float>(n, 0.0f);
  auto param = filled<bf16>(n, 0.1f);
  auto grad = filled<float>(n, 0.01f);
  auto norm_sq = filled<float>(1, 0.0f);
  DeviceBuffer<int> found_inf(1, device().context.compute());
  std::vector<kernels::AdamWTensor<float, bf16>> list;
  for (std::size_t t = 0; t < tensors; ++t) {
    const std::size_t o = t * per;
    list.push_back({.master = master.data() + o,
                    .param = param.data() + o,
                    .grad = grad.data() + o,
                    .m = m.data() + o,
                    .v = v.data() + o,
                    .n = static_cast<std::int64_t>(per),
                    .decay = t % 2 == 0});
  }
  kernels::AdamWPlan<float, bf16> plan(device().context.compute(),
                                       std::span<const kernels::AdamWTensor<float, bf16>>(list));
  auto workspace = filled<float>(static_cast<std::size_t>(plan.workspace_floats()), 0.0f);
  int step = 0;
  const math::AdamWParams hp{.lr = 1e-4f, .weight_decay = 0.1f};
  time_kernel(
      state,
      [&](cudaStream_t s) {
        plan.grad_norm_squared(s, norm_sq.data(), workspace.data());
        plan.step(s, hp, ++step, norm_sq.data(), 1.0f, 1.0f, found_inf.data());
      },
      0, static_cast<double>(tensors * per) * (2 * 4 + 3 * 4 + 3 * 4 + 2));
}

template <class T>
void cross_entropy(benchmark::State& state) {
  const std::int64_t rows = state.range(0), V = 50257, Vp = 50304;
  auto logits = filled<T>(static_cast<std::size_t>(rows * Vp), 0.0f);
  auto losses = filled<float>(static_cast<std::size_t>(rows), 0.0f);
  DeviceBuffer<std::int32_t> targets(static_cast<std::size_t>(rows), device().context.compute());
  std::vector<std::int32_t> host(static_cast<std::size_t>(rows));
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::int32_t>((i * 7919) % V);
  targets.upload(host);
  time_kernel(
      state,
      [&](cudaStream_t s) {
        kernels::cross_entropy_forward_backward(s, logits.data(), losses.data(), targets.data(), rows, V, Vp,
                                                1.0f / static_cast<float>(rows));
      },
      0, 2.0 * rows * Vp * sizeof(T));
}

template <class T>
void gelu(benchmark::State& state) {
  const auto n = state.range(0);
  auto x = filled<T>(static_cast<std::size_t>(n), 0.5f);
  auto out = filled<T>(static_cast<std::size_t>(n), 0.0f);
  time_kernel(
      state, [&](cudaStream_t s) { kernels::gelu_forward(s, out.data(), x.data(), n); }, 0, 2.0 * n * sizeof(T));
}

// The fastest of every algorithm cuBLASLt's heuristic offers (up to 16) for
// C(M,N) = A(M,K)·B(N,K)ᵀ, in milliseconds (best of 5 launches each, L2 flushed).
template <class T>
double best_algorithm_ms(std::int64_t M, std::int64_t N, std::int64_t K, const T* a, const T* b, T* c) {
  Device& d = device();
  const cudaStream_t stream = d.context.compute();
  constexpr cudaDataType_t type = llmpar::backend::cuda::detail::cuda_type<T>();
  const cublasComputeType_t compute = std::is_same_v<T, float> ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  cublasLtHandle_t handle = nullptr;
  LLMPAR_CHECK_CUBLAS(cublasLtCreate(&handle));
  cublasLtMatmulDesc_t desc = nullptr;
  LLMPAR_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  LLMPAR_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
  LLMPAR_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)));
  // Column-major: first operand B (K x N, transposed), second A (K x M), out (N x M).
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  LLMPAR_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&first, type, K, N, K));
  LLMPAR_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&second, type, K, M, K));
  LLMPAR_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&out, type, N, M, N));
  cublasLtMatmulPreference_t preference = nullptr;
  LLMPAR_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  const std::uint64_t workspace_bytes = std::uint64_t{32} << 20;
  LLMPAR_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &workspace_bytes, sizeof(workspace_bytes)));
  DeviceBuffer<std::byte> workspace(workspace_bytes, stream);
  cublasLtMatmulHeuristicResult_t results[16] = {};
  int found = 0;
  LLMPAR_CHECK_CUBLAS(
      cublasLtMatmulAlgoGetHeuristic(handle, desc, first, second, out, out, preference, 16, results, &found));
  const float alpha = 1.0f, beta = 0.0f;
  Event start(Event::Timing::on), stop(Event::Timing::on);
  double best = 1e30;
  for (int i = 0; i < found; ++i) {
    for (int rep = 0; rep < 6; ++rep) {
      LLMPAR_CHECK_CUDA(cudaMemsetAsync(d.flush.data(), 0, d.flush.bytes(), stream));
      start.record(stream);
      const cublasStatus_t status = cublasLtMatmul(handle, desc, &alpha, b, first, a, second, &beta, c, out, c, out,
                                                   &results[i].algo, workspace.data(), workspace_bytes, stream);
      stop.record(stream);
      stop.synchronize();
      if (status != CUBLAS_STATUS_SUCCESS) break;
      if (rep > 0) best = std::min(best, static_cast<double>(stop.ms_since(start)));
    }
  }
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(out);
  cublasLtMatrixLayoutDestroy(second);
  cublasLtMatrixLayoutDestroy(first);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(handle);
  return best;
}

// GEMM through Blas (Y = X·Wᵀ, the forward of a linear layer), and `of_best`: the time
// of cuBLASLt's fastest algorithm for the shape over the time of the one Blas picked.
template <class T>
void gemm(benchmark::State& state) {
  const std::int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  auto a = filled<T>(static_cast<std::size_t>(M * K), 0.01f);
  auto b = filled<T>(static_cast<std::size_t>(N * K), 0.01f);
  auto c = filled<T>(static_cast<std::size_t>(M * N), 0.0f);
  static Blas blas(Fp32Math::tf32);
  const GemmOp op{.trans_a = false, .trans_b = true};
  const double ours_ms = time_kernel(
      state, [&](cudaStream_t s) { blas.gemm<T>(s, c.data(), a.data(), b.data(), nullptr, nullptr, M, N, K, op); },
      2.0 * M * N * K, 0, peak_tflops<T>(Fp32Math::tf32));
  const double best_ms = best_algorithm_ms<T>(M, N, K, a.data(), b.data(), c.data());
  state.counters["of_best"] = ours_ms > 0 ? best_ms / ours_ms : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  if (device_count() == 0) {
    std::printf("bench_cuda_kernels: skipped, no CUDA device\n");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  // B, T, hs, NH, KVH: GPT-sized multi-head attention over 2048 channels, and Llama-3-8B's
  // grouped-query attention (32 query heads on 8 kv heads of 128).
  const auto attention_args = [](benchmark::internal::Benchmark* b) {
    b->Args({4, 4096, 128, 16, 16})
        ->Args({4, 4096, 64, 32, 32})
        ->Args({16, 1024, 64, 32, 32})
        ->Args({4, 4096, 128, 32, 8})
        ->Args({16, 1024, 128, 32, 8})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  };
  benchmark::RegisterBenchmark("attention_forward/bf16", [](benchmark::State& s) {
    attention<bf16>(s, false);
  })->Apply(attention_args);
  benchmark::RegisterBenchmark("attention_backward/bf16", [](benchmark::State& s) {
    attention<bf16>(s, true);
  })->Apply(attention_args);
  benchmark::RegisterBenchmark("attention_forward/f32", [](benchmark::State& s) { attention<float>(s, false); })
      ->Args({4, 1024, 64, 32, 32})
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("layernorm_forward/bf16", layernorm_forward<bf16>)
      ->Args({16384, 768})
      ->Args({16384, 4096})
      ->UseManualTime();
  benchmark::RegisterBenchmark("layernorm_forward/f32", layernorm_forward<float>)->Args({16384, 768})->UseManualTime();
  benchmark::RegisterBenchmark("layernorm_backward/bf16", layernorm_backward<bf16>)
      ->Args({16384, 768})
      ->Args({16384, 4096})
      ->UseManualTime();
  benchmark::RegisterBenchmark("adamw/bf16_params_f32_master", adamw)->Arg(124 << 20)->UseManualTime();
  benchmark::RegisterBenchmark("cross_entropy/bf16", cross_entropy<bf16>)->Arg(8192)->UseManualTime();
  benchmark::RegisterBenchmark("gelu_forward/bf16", gelu<bf16>)->Arg(64 << 20)->UseManualTime();
  benchmark::RegisterBenchmark("gemm/bf16", gemm<bf16>)
      ->Args({8192, 2304, 768})
      ->Args({8192, 768, 3072})
      ->Args({8192, 50304, 768})
      ->Args({4096, 4096, 4096})
      ->UseManualTime();
  benchmark::RegisterBenchmark("gemm/f32_tf32", gemm<float>)->Args({4096, 4096, 4096})->UseManualTime();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
