// cuBLASLt GEMMs (backend/cuda/gemm.hpp) against a double-precision host reference:
// every transposition, accumulate, every epilogue, float (strict fp32 and TF32), bf16
// and f16, on aligned and ragged shapes; the plan cache; and the error messages.
// Exit codes: 0 pass, 1 failure, 77 no CUDA device (ctest reports that as skipped).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "llmpar/backend/cuda/gemm.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/math/activation.hpp"

#include "gpu_test.hpp"

namespace {

using namespace llmpar;
using namespace llmpar::backend::cuda;

using gpu_test::expect;
using gpu_test::failures;
using gpu_test::random_vector;
using gpu_test::upload;

template <class T>
double value(const std::vector<T>& v, std::int64_t i) {
  return static_cast<double>(convert<float>(v[static_cast<std::size_t>(i)]));
}

double gelu_grad(double x) { return math::gelu_tanh_grad(x); }

// One case: C(M,N) [+]= op(A)·op(B) with an epilogue, on the device and in double.
template <class T>
void check_case(Blas& blas, cudaStream_t stream, std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op,
                double tolerance) {
  const auto a = random_vector<T>(rng::Stream(1 + m * 7 + k), m * k);
  const auto b = random_vector<T>(rng::Stream(2 + n * 5 + k), k * n);
  const auto c0 = random_vector<T>(rng::Stream(3 + m + n), m * n);
  const auto bias = random_vector<T>(rng::Stream(4 + n), std::max(m, n));
  const auto aux_in = random_vector<T>(rng::Stream(5 + m * n), m * n);  // dgelu's saved input
  auto d_a = upload(a, stream);
  auto d_b = upload(b, stream);
  auto d_c = upload(c0, stream);
  auto d_bias = upload(bias, stream);
  auto d_aux = upload(aux_in, stream);
  blas.gemm<T>(stream, d_c.data(), d_a.data(), d_b.data(), d_bias.data(), d_aux.data(), m, n, k, op);
  std::vector<T> c(static_cast<std::size_t>(m * n)), aux(static_cast<std::size_t>(m * n)),
      bias_out(bias.size());
  d_c.download(c);
  d_aux.download(aux);
  d_bias.download(bias_out);
  LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream));

  double worst = 0.0, worst_bias = 0.0;
  std::vector<double> bgrad(static_cast<std::size_t>(std::max(m, n)), 0.0);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (std::int64_t p = 0; p < k; ++p)
        acc += value(a, op.trans_a ? p * m + i : i * k + p) * value(b, op.trans_b ? j * k + p : p * n + j);
      double expected = acc;
      switch (op.epilogue) {
        case Epilogue::none:
          break;
        case Epilogue::bias:
          expected = acc + value(bias, j);
          break;
        case Epilogue::gelu_aux_bias:
        case Epilogue::gelu_aux: {
          const double pre = acc + (op.epilogue == Epilogue::gelu_aux_bias ? value(bias, j) : 0.0);
          expected = math::gelu_tanh(pre);
          worst = std::max(worst, std::abs(value(aux, i * n + j) - pre) / (1.0 + std::abs(pre)));
          break;
        }
        case Epilogue::dgelu:
        case Epilogue::dgelu_bgrad:
          expected = acc * gelu_grad(value(aux_in, i * n + j));
          bgrad[static_cast<std::size_t>(j)] += expected;
          break;
        case Epilogue::bgradb:
          break;
      }
      if (op.accumulate) expected += value(c0, i * n + j);
      worst = std::max(worst, std::abs(value(c, i * n + j) - expected) / (1.0 + std::abs(expected)));
    }
  }
  if (op.epilogue == Epilogue::dgelu_bgrad) {
    for (std::int64_t j = 0; j < n; ++j)
      worst_bias = std::max(worst_bias, std::abs(value(bias_out, j) - bgrad[static_cast<std::size_t>(j)]) /
                                            (1.0 + std::abs(bgrad[static_cast<std::size_t>(j)])));
  }
  if (op.epilogue == Epilogue::bgradb) {  // bias(M) = Σ_k op(A)(i, k)
    for (std::int64_t i = 0; i < m; ++i) {
      double s = 0.0;
      for (std::int64_t p = 0; p < k; ++p) s += value(a, op.trans_a ? p * m + i : i * k + p);
      worst_bias = std::max(worst_bias, std::abs(value(bias_out, i) - s) / (1.0 + std::abs(s)));
    }
  }
  const bool ok = worst <= tolerance && worst_bias <= tolerance * 4;
  std::printf("%-4s M=%-5lld N=%-5lld K=%-5lld ta=%d tb=%d acc=%d epilogue=%-13s max rel err %.2e %.2e  %s\n",
              name_of(dtype_of<T>()).data(), static_cast<long long>(m), static_cast<long long>(n),
              static_cast<long long>(k), op.trans_a, op.trans_b, op.accumulate, backend::cuda::detail::name_of(op.epilogue), worst,
              worst_bias, ok ? "ok" : "FAILED");
  expect(ok, "gemm case above");
}

template <class T>
void check_type(Blas& blas, cudaStream_t stream, double tolerance) {
  const std::int64_t shapes[][3] = {{64, 64, 64}, {1, 8, 1}, {7, 24, 13}, {257, 136, 129}, {768, 2304, 768}};
  for (const auto& s : shapes)
    for (int t = 0; t < 4; ++t)
      for (bool accumulate : {false, true})
        check_case<T>(blas, stream, s[0], s[1], s[2], {(t & 1) != 0, (t & 2) != 0, accumulate, Epilogue::none}, tolerance);
  for (Epilogue e : {Epilogue::bias, Epilogue::gelu_aux_bias, Epilogue::gelu_aux, Epilogue::dgelu,
                     Epilogue::dgelu_bgrad}) {
    check_case<T>(blas, stream, 40, 64, 96, {false, true, false, e}, tolerance);
    check_case<T>(blas, stream, 257, 1024, 136, {false, false, false, e}, tolerance);
  }
  check_case<T>(blas, stream, 96, 48, 80, {true, false, true, Epilogue::bgradb}, tolerance);
}

}  // namespace

int main() {
  if (device_count() == 0) {
    std::printf("skipped: no CUDA device\n");
    return gpu_test::skip_exit_code();
  }
  try {
    DeviceContext context(0);
    const cudaStream_t stream = context.compute();
    Blas strict(Fp32Math::strict);
    check_type<float>(strict, stream, 2e-5);
    check_type<bf16>(strict, stream, 2e-2);
    check_type<f16>(strict, stream, 4e-3);
    Blas tf32(Fp32Math::tf32);
    check_case<float>(tf32, stream, 257, 1024, 512, {false, true, false, Epilogue::none}, 5e-3);

    // The cache: one plan per distinct key, none added by repeating a call.
    const std::size_t plans = strict.cached_plans();
    check_case<float>(strict, stream, 64, 64, 64, {false, false, false, Epilogue::none}, 2e-5);
    expect(strict.cached_plans() == plans, "repeating a GEMM must reuse its cached plan");

    // Errors name the value and the rule.
    DeviceBuffer<float> x(64, stream);
    const auto expect_error = [&](auto&& call, const char* text) {
      try {
        call();
        expect(false, std::string("expected an error containing '") + text + "'");
      } catch (const Error& e) {
        expect(std::strstr(e.what(), text) != nullptr, std::string("message '") + e.what() + "' lacks '" + text + "'");
      }
    };
    expect_error([&] { strict.gemm<float>(stream, x.data(), x.data(), x.data(), nullptr, nullptr, -1, 2, 2, {}); },
                 "gemm sizes must be >= 0, got M=-1");
    expect_error(
        [&] {
          strict.gemm<float>(stream, x.data(), x.data(), x.data(), nullptr, nullptr, 2, 2, 2,
                             {false, false, false, Epilogue::bias});
        },
        "needs a bias pointer");
    expect_error(
        [&] {
          strict.gemm<float>(stream, x.data(), x.data(), x.data(), x.data(), x.data(), 2, 6, 2,
                             {false, false, false, Epilogue::gelu_aux_bias});
        },
        "needs N (6) to be a multiple of 8");
    std::printf("tensor-core peak of device 0: %.1f TFLOP/s\n", tensor_peak_tflops(0));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED with an exception: %s\n", e.what());
    return 1;
  }
  if (failures) std::fprintf(stderr, "%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
