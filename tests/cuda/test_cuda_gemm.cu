// cuBLASLt GEMMs (backend/cuda/gemm.hpp) against a double-precision host reference:
// every transposition, accumulate, every epilogue, float (strict fp32 and TF32), bf16
// and f16, on aligned and ragged shapes; the plan cache; and the error messages.
//
// Mixed precision against the CPU backend (backend::cpu::Context::gemm in f32 on the
// same operands, upconverted; cpu_gemm.cpp, built by the host compiler): bf16/f16 A and
// B with an f32 C (the weight-gradient GEMMs writing f32 main grads), plain and
// accumulating, in every transposition and in the dW GEMM's own shape (dW(out,in) +=
// dYᵀ·X: trans_a, accumulate, K = the token count); and bf16/f16 C against the CPU's f32
// result rounded to the format. The tolerances are derived from K (see check_mixed).
// Exit codes: 0 pass, 1 failure, 77 no CUDA device (ctest reports that as skipped).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_gemm.hpp"
#include "gpu_test.hpp"
#include "llmpar/backend/cuda/gemm.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/math/activation.hpp"

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
  std::vector<T> c(static_cast<std::size_t>(m * n)), aux(static_cast<std::size_t>(m * n)), bias_out(bias.size());
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
              static_cast<long long>(k), op.trans_a, op.trans_b, op.accumulate,
              backend::cuda::detail::name_of(op.epilogue), worst, worst_bias, ok ? "ok" : "FAILED");
  expect(ok, "gemm case above");
}

template <class T>
void check_type(Blas& blas, cudaStream_t stream, double tolerance) {
  const std::int64_t shapes[][3] = {{64, 64, 64}, {1, 8, 1}, {7, 24, 13}, {257, 136, 129}, {768, 2304, 768}};
  for (const auto& s : shapes)
    for (int t = 0; t < 4; ++t)
      for (bool accumulate : {false, true})
        check_case<T>(blas, stream, s[0], s[1], s[2], {(t & 1) != 0, (t & 2) != 0, accumulate, Epilogue::none},
                      tolerance);
  for (Epilogue e :
       {Epilogue::bias, Epilogue::gelu_aux_bias, Epilogue::gelu_aux, Epilogue::dgelu, Epilogue::dgelu_bgrad}) {
    check_case<T>(blas, stream, 40, 64, 96, {false, true, false, e}, tolerance);
    check_case<T>(blas, stream, 257, 1024, 136, {false, false, false, e}, tolerance);
  }
  check_case<T>(blas, stream, 96, 48, 80, {true, false, true, Epilogue::bgradb}, tolerance);
}

template <class T>
std::vector<float> widen(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = convert<float>(v[i]);
  return out;
}

// The unit roundoff u of T (half its ulp at 1): 2^-24 float, 2^-8 bf16, 2^-11 f16.
template <class T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, float>)
    return 0x1p-24;
  else if constexpr (std::is_same_v<T, bf16>)
    return 0x1p-8;
  else
    return 0x1p-11;
}

// C(M,N) [+]= op(A)·op(B) with 16-bit A and B and a C of type TC (float: f32 main grads;
// T: the format itself), on the device and with the CPU backend's f32 GEMM of the same
// operands upconverted to float (exact: every 16-bit value is a float).
//
// Tolerance. A product of two bf16 (8-bit significands) or two f16 (11-bit) values is
// exact in f32 (24 bits), so both sides add the same K exact terms (K + 1 with
// accumulate: C's old value) in f32, only in different orders and groupings. Each sum
// is within (K + 1)·2^-24·Σ|term| of the exact one (the classic worst-case bound for
// recursive or blocked summation, whatever the order; random signs stay far below it),
// so the two differ by at most
//   delta = 2·(K + 1)·2^-24·(Σ_k |a_ik||b_kj| + |c0_ij|)
// plus a tiny absolute floor (1e-6) for sums that are exact on one side only through
// luck of cancellation. For TC = T the device rounds its f32 sum x once to the format and
// is compared with the CPU's f32 result y rounded to the format; each rounding moves a
// value by at most u times its magnitude (u = 2^-8 bf16, 2^-11 f16), so
//   |rd(x) - rd(y)| <= u·|x| + delta + u·|y| <= (1 + u)·delta + 2·u·|y|
// (one ulp where the two sums straddle a rounding boundary, which 2u·|y| covers from the
// bottom of a binade up).
template <class T, class TC>
void check_mixed(Blas& blas, cudaStream_t stream, std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op,
                 const char* label) {
  static_assert(!std::is_same_v<T, float>, "check_mixed: 16-bit operands");
  const auto a = random_vector<T>(rng::Stream(11 + m * 7 + k), m * k);
  const auto b = random_vector<T>(rng::Stream(12 + n * 5 + k), k * n);
  const auto c0 = random_vector<TC>(rng::Stream(13 + m + n), m * n);
  auto d_a = upload(a, stream);
  auto d_b = upload(b, stream);
  auto d_c = upload(c0, stream);
  blas.gemm<T, TC>(stream, d_c.data(), d_a.data(), d_b.data(), nullptr, nullptr, m, n, k, op);
  const std::vector<TC> got = gpu_test::download(d_c);

  // The CPU backend's f32 GEMM of the upconverted operands.
  const std::vector<float> a32 = widen(a), b32 = widen(b);
  std::vector<float> ref = widen(c0);
  gpu_test::cpu_sgemm(ref.data(), a32.data(), b32.data(), m, n, k, op.trans_a, op.trans_b, op.accumulate);

  constexpr double kF32 = 0x1p-24, kFloor = 1e-6;
  const double u = std::is_same_v<TC, float> ? 0.0 : unit_roundoff<T>();
  std::int64_t bad = 0;
  double worst = 0.0;  // the largest |got - ref| over its tolerance
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double magnitude = op.accumulate ? std::abs(value(c0, i * n + j)) : 0.0;
      for (std::int64_t p = 0; p < k; ++p)
        magnitude +=
            std::abs(value(a32, op.trans_a ? p * m + i : i * k + p) * value(b32, op.trans_b ? j * k + p : p * n + j));
      const double y = value(ref, i * n + j);
      // The CPU's result in the output's format.
      const double r =
          std::is_same_v<TC, float> ? y : static_cast<double>(convert<float>(convert<TC>(static_cast<float>(y))));
      const double delta = 2.0 * static_cast<double>(k + 1) * kF32 * magnitude + kFloor;
      const double tolerance = (1.0 + u) * delta + 2.0 * u * std::abs(y);
      const double err = std::abs(value(got, i * n + j) - r);
      worst = std::max(worst, err / tolerance);
      if (!(err <= tolerance) && ++bad <= 3)
        std::fprintf(stderr, "  C[%lld, %lld]: device %.9g, cpu %.9g, tolerance %.3g\n", static_cast<long long>(i),
                     static_cast<long long>(j), value(got, i * n + j), r, tolerance);
    }
  }
  std::printf(
      "%-4s x %-4s -> %-4s M=%-5lld N=%-5lld K=%-5lld ta=%d tb=%d acc=%d %-10s vs cpu f32: %lld off, "
      "worst %.2f of tolerance  %s\n",
      name_of(dtype_of<T>()).data(), name_of(dtype_of<T>()).data(), name_of(dtype_of<TC>()).data(),
      static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k), op.trans_a, op.trans_b,
      op.accumulate, label, static_cast<long long>(bad), worst, bad == 0 ? "ok" : "FAILED");
  expect(bad == 0, "mixed-precision gemm case above");
}

// Every transposition, plain and accumulating, on aligned and ragged shapes, and the dW
// GEMM (M = out features, N = in features, K = tokens; A = dY stored (K, M)).
template <class T, class TC>
void check_mixed_type(Blas& blas, cudaStream_t stream) {
  const std::int64_t shapes[][3] = {{64, 64, 64}, {7, 24, 13}, {257, 136, 129}};
  for (const auto& s : shapes)
    for (int t = 0; t < 4; ++t)
      for (bool accumulate : {false, true})
        check_mixed<T, TC>(blas, stream, s[0], s[1], s[2], {(t & 1) != 0, (t & 2) != 0, accumulate, Epilogue::none},
                           "");
  check_mixed<T, TC>(blas, stream, 256, 768, 1024, {true, false, true, Epilogue::none}, "(dW GEMM)");
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

    // Mixed precision against the CPU backend: f32 main grads from 16-bit operands, and
    // 16-bit outputs.
    check_mixed_type<bf16, float>(strict, stream);
    check_mixed_type<f16, float>(strict, stream);
    check_mixed_type<bf16, bf16>(strict, stream);
    check_mixed_type<f16, f16>(strict, stream);

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
    DeviceBuffer<bf16> xb(64, stream);
    expect_error(
        [&] {
          strict.gemm<bf16, float>(stream, x.data(), xb.data(), xb.data(), xb.data(), nullptr, 2, 8, 2,
                                   {false, false, false, Epilogue::bias});
        },
        "with an f32 output of bf16 operands");
    std::printf("data-sheet peak of device 0: bf16 %.1f, tf32 %.1f, fp32 %.1f TFLOP/s\n",
                datasheet_peak_tflops(0, DType::bf16), datasheet_peak_tflops(0, DType::f32, Fp32Math::tf32),
                datasheet_peak_tflops(0, DType::f32, Fp32Math::strict));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED with an exception: %s\n", e.what());
    return 1;
  }
  if (failures) std::fprintf(stderr, "%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
