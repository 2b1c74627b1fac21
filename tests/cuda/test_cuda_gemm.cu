// cuBLASLt GEMMs (backend/cuda/gemm.hpp) against a double-precision host reference:
// every transposition, accumulate, every epilogue, float (strict fp32 and TF32), bf16
// and f16, on aligned and ragged shapes; the plan cache; and the error messages.
//
// Each element is held to an error bound derived from how its value is computed
// (evaluate() below), not to one tolerance per type: a K-term dot product in f32 is
// within gamma(K)·Σ|a||b| of the exact one whatever the summation order, a 16-bit output
// adds one rounding of the result, TF32 adds the rounding of both inputs, and the GELU
// epilogues add the error of cuBLASLt's f32 tanh. What the first H200 run taught (commit
// f75a025, /work/shared/gpu/first-h200-run/test_cuda_gemm.log; each figure below was
// reproduced to three digits on the CPU from this test's own data):
//   - strict fp32 sums each dot product with sequential f32 FMAs (6.01e-5 at K = 768
//     under the old |err| / (1 + |C|) metric): the old 2e-5 tolerance was below f32
//     rounding, not the kernel wrong. A separate exact check proves no TF32 is used.
//   - the TF32 case (257 x 1024 x 512) is TF32 rounding its inputs to nearest (2.09e-2,
//     exactly what emulating that gives): the old 5e-3 was below TF32's own rounding.
//   - accumulating bf16/f16 outputs, the bgradb and the dgelu(_bgrad) epilogues were off
//     by a second 16-bit rounding: T(T(A·B) + C), T(T(A·B)·gelu'), and for f16 bgradb
//     16-element K-chunks each rounded to f16. That is a split-K reduction in the output
//     type; gemm.hpp now excludes those algorithms for 16-bit outputs, and the bounds
//     here allow one rounding only, so a second one fails.
//   - the f32 dgelu epilogue's error (5.2e-5, 3.0e-4) is the error of cuBLASLt's f32
//     gelu'(x) (tanh-GELU, as the reference: erf-GELU's would be 30x larger) times
//     |A·B|, largest where gelu'(x) ~ 0; the bound now carries that term (kActivation).
//
// Mixed precision against the CPU backend (backend::cpu::Context::gemm in f32 on the
// same operands, upconverted; cpu_gemm.cpp, built by the host compiler): bf16/f16 A and
// B with an f32 C (the weight-gradient GEMMs writing f32 main grads), plain and
// accumulating, in every transposition and in the dW GEMM's own shape (dW(out,in) +=
// dYᵀ·X: trans_a, accumulate, K = the token count); and bf16/f16 C against the CPU's f32
// result rounded to the format. The tolerances are derived from K (see check_mixed).
//
// A failing case prints the algorithm cuBLASLt chose (id, tile, split-K, reduction,
// numerics) and its worst elements with the f64 value and what one and two roundings
// of it give, so the next GPU run says which computation the device did. Without a
// device, host_checks() still runs: the argument errors, and the bounds against models
// of the first run (one rounding accepted, the second rounding and TF32 rejected).
// Exit codes: 0 pass, 1 failure, 77 no CUDA device (ctest reports that as skipped).
#include <algorithm>
#include <cmath>
#include <cstdint>
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

// x rounded to T (through float, as a device stores an f32 value as T).
template <class T>
double rounded(double x) {
  return static_cast<double>(convert<float>(convert<T>(static_cast<float>(x))));
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

constexpr double kF32 = 0x1p-24;  // f32's unit roundoff: every accumulation is in f32

// gamma(n) = n·u / (1 - n·u) (Higham, Accuracy and Stability of Numerical Algorithms,
// §3.1): a sum of n products computed in f32, in any order and grouping, with or without
// FMA, is within gamma(n)·Σ|a_k||b_k| of the exact sum. That is the worst case; random
// signs typically stay near sqrt(n)·u·Σ|a_k||b_k|, so the bound never fails on rounding
// and still catches a wrong operand, layout or epilogue by orders of magnitude (those
// are off by O(|C|)).
constexpr double gamma(std::int64_t n) {
  const double nu = static_cast<double>(n) * kF32;
  return nu / (1.0 - nu);
}

// The absolute error of cuBLASLt's f32 epilogue functions: gelu(x) within
// kActivation·max(1, |x|), gelu'(x) within kActivation. cuBLASLt does not document how
// it evaluates them. Its epilogue computes gelu'(x) = 0.5(1 + t) + 0.5x(1 - t²)u'(x),
// t = tanh(u(x)) (CUTLASS's dGELU), in f32 with an approximate tanh; the first H200
// run's dgelu errors need |Δgelu'| >= 2e-6 (x = -0.76, where gelu' = 0) or a tanh
// accurate to 1.2e-6 (x = -3.5, where the two terms cancel), so 2^-15 = 3.1e-5 holds
// them with 3.5x to spare, and is 28x below the distance to erf-GELU' (8.7e-4), 60x
// below a gelu' rounded to bf16. check_epilogue_functions measures the actual error on
// a grid of x and prints it.
constexpr double kActivation = 0x1p-15;

// TF32's input rounding: 2^-11 if it rounds to nearest (which reproduces the first run's
// 2.09e-2 at 257 x 1024 x 512; truncation gives 2.21e-2), 2^-10 if it truncates. The
// bound takes the larger.
constexpr double kTf32Input = 0x1p-10;

double gelu_grad(double x) { return math::gelu_tanh_grad(x); }

// The largest |gelu'(x)| over all x (at x = 1.5): how far an input error moves gelu.
constexpr double kMaxGeluSlope = 1.13;

// Per element: the exact op(A)·op(B) (in double) and Σ_k |a_ik||b_kj|.
struct Products {
  std::vector<double> exact, magnitude;  // (M, N) each
};

template <class T>
Products products(const std::vector<T>& a, const std::vector<T>& b, std::int64_t m, std::int64_t n, std::int64_t k,
                  bool trans_a, bool trans_b) {
  // op(A) as (M, K) rows and op(B) as (K, N) rows, so the inner loop runs along N.
  std::vector<double> opa(static_cast<std::size_t>(m * k)), opb(static_cast<std::size_t>(k * n));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t p = 0; p < k; ++p) opa[i * k + p] = value(a, trans_a ? p * m + i : i * k + p);
  for (std::int64_t p = 0; p < k; ++p)
    for (std::int64_t j = 0; j < n; ++j) opb[p * n + j] = value(b, trans_b ? j * k + p : p * n + j);
  Products out{std::vector<double>(static_cast<std::size_t>(m * n), 0.0),
               std::vector<double>(static_cast<std::size_t>(m * n), 0.0)};
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < m; ++i) {
    double* exact = &out.exact[i * n];
    double* magnitude = &out.magnitude[i * n];
    for (std::int64_t p = 0; p < k; ++p) {
      const double x = opa[i * k + p];
      const double* row = &opb[p * n];
      for (std::int64_t j = 0; j < n; ++j) {
        exact[j] += x * row[j];
        magnitude[j] += std::abs(x * row[j]);
      }
    }
  }
  return out;
}

// The worst elements of a case, for the failure report.
struct Miss {
  double ratio = 0.0;  // |error| / bound
  std::int64_t i = 0, j = 0;
  double device = 0.0, exact = 0.0, bound = 0.0, twice = 0.0;  // twice: the double-rounding model's value
};

void keep_worst(std::vector<Miss>& worst, const Miss& miss) {
  worst.push_back(miss);
  std::sort(worst.begin(), worst.end(), [](const Miss& x, const Miss& y) { return x.ratio > y.ratio; });
  if (worst.size() > 3) worst.pop_back();
}

// One case's operands (host), as every run of it draws them.
template <class T>
struct CaseData {
  std::int64_t m, n, k;
  GemmOp op;
  std::vector<T> a, b, c0, bias, aux_in;  // aux_in: dgelu's saved GELU input
};

template <class T>
CaseData<T> case_data(std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op) {
  return {m,
          n,
          k,
          op,
          random_vector<T>(rng::Stream(1 + m * 7 + k), m * k),
          random_vector<T>(rng::Stream(2 + n * 5 + k), k * n),
          random_vector<T>(rng::Stream(3 + m + n), m * n),
          random_vector<T>(rng::Stream(4 + n), std::max(m, n)),
          random_vector<T>(rng::Stream(5 + m * n), m * n)};
}

// What a GEMM wrote: C, the aux matrix and the bias vector (the epilogues' outputs).
template <class T>
struct Outputs {
  std::vector<T> c, aux, bias;
};

// How a case measures against its bounds.
struct Verdict {
  double worst = 0.0, worst_bias = 0.0;  // max |error| / (1 + |exact|): the first run's figures
  double worst_ratio = 0.0;              // max |error| / bound
  std::vector<Miss> misses;              // the worst elements past their bound
  bool ok() const { return worst_ratio <= 1.0; }
};

// The outputs against the exact result in double, each element against its bound. u_in:
// the rounding of the inputs before they are multiplied (TF32), 0 when none.
//
// The bound of each element, built up as the device computes it (u_T: the output type's
// unit roundoff; 16-bit products are exact in f32):
//   pre  = A·B (+ C) (+ bias) in f32:  E_pre = (2 u_in + u_in²) Σ|a||b|
//                                             + gamma(K + 2) (Σ|a||b| + |C| + |bias|)
//   none, bias, bgradb:  C = T(pre)                 E_pre + u_T (|pre| + E_pre)
//   gelu_aux(_bias):     aux = T(pre)               as above
//                        C = T(gelu(pre))           1.13 E_pre + kActivation max(1, |pre|)
//                                                   + u32 |gelu| + u_T (|gelu| + that)
//   dgelu(_bgrad):       C = T(v), v = pre·gelu'(x) |gelu'(x)| E_pre + (|pre| + E_pre) kActivation
//                                                   + u32 |v| + u_T (|v| + that)
//   dgelu_bgrad bias(N) = T(Σ_i v_ij):              Σ_i E_v + gamma(M) Σ_i |v_ij| + u_T |bias|
//   bgradb bias(M) = T(Σ_k op(A)(i, k)):            gamma(K) Σ_k |a_ik| + u_T |bias|
// One rounding to T each: a device that rounds A·B to T before adding C or applying
// gelu' (what a split-K reduction in the output type does) is off by up to u_T |A·B|,
// which exceeds u_T |pre| wherever C cancels part of A·B; host_checks() shows the bound
// rejecting the first run's figures for that, and accepting one rounding.
template <class T>
Verdict evaluate(const CaseData<T>& d, const Outputs<T>& out, double u_in) {
  const std::int64_t m = d.m, n = d.n, k = d.k;
  const GemmOp op = d.op;
  const double u = unit_roundoff<T>();
  const Products ab = products(d.a, d.b, m, n, k, op.trans_a, op.trans_b);
  const bool adds_bias = op.epilogue == Epilogue::bias || op.epilogue == Epilogue::gelu_aux_bias;
  const auto round_out = [u](double error, double magnitude) { return error + u * (magnitude + error); };

  Verdict verdict;
  std::vector<double> bgrad(static_cast<std::size_t>(n), 0.0), bgrad_bound(static_cast<std::size_t>(n), 0.0),
      bgrad_magnitude(static_cast<std::size_t>(n), 0.0);
  const auto check = [&](double device, double exact, double bound, std::int64_t i, std::int64_t j, double twice,
                         double& worst) {
    const double error = std::abs(device - exact);
    worst = std::max(worst, error / (1.0 + std::abs(exact)));
    const double ratio = error / bound;
    verdict.worst_ratio = std::max(verdict.worst_ratio, ratio);
    if (!(ratio <= 1.0)) keep_worst(verdict.misses, {ratio, i, j, device, exact, bound, twice});
  };
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      const std::int64_t ij = i * n + j;
      const double old_c = op.accumulate ? value(d.c0, ij) : 0.0;
      const double bias_j = adds_bias ? value(d.bias, j) : 0.0;
      const double pre = ab.exact[ij] + old_c + bias_j;
      const double e_pre = (2.0 * u_in + u_in * u_in) * ab.magnitude[ij] +
                           gamma(k + 2) * (ab.magnitude[ij] + std::abs(old_c) + std::abs(bias_j));
      // What rounding the product to T before the rest (a split-K reduction in the output
      // type) would give: printed beside a miss.
      const double twice_pre = rounded<T>(rounded<T>(ab.exact[ij] + bias_j) + old_c);
      switch (op.epilogue) {
        case Epilogue::none:
        case Epilogue::bias:
        case Epilogue::bgradb:
          check(value(out.c, ij), pre, round_out(e_pre, std::abs(pre)), i, j, twice_pre, verdict.worst);
          break;
        case Epilogue::gelu_aux:
        case Epilogue::gelu_aux_bias: {
          check(value(out.aux, ij), pre, round_out(e_pre, std::abs(pre)), i, j, twice_pre, verdict.worst);
          const double g = math::gelu_tanh(pre);
          const double e_g = kMaxGeluSlope * e_pre + kActivation * std::max(1.0, std::abs(pre)) + kF32 * std::abs(g);
          check(value(out.c, ij), g, round_out(e_g, std::abs(g)), i, j, rounded<T>(math::gelu_tanh(twice_pre)),
                verdict.worst);
          break;
        }
        case Epilogue::dgelu:
        case Epilogue::dgelu_bgrad: {
          const double slope = gelu_grad(value(d.aux_in, ij));
          const double v = pre * slope;
          const double e_v = std::abs(slope) * e_pre + (std::abs(pre) + e_pre) * kActivation + kF32 * std::abs(v);
          check(value(out.c, ij), v, round_out(e_v, std::abs(v)), i, j, rounded<T>(twice_pre * slope), verdict.worst);
          bgrad[static_cast<std::size_t>(j)] += v;
          bgrad_bound[static_cast<std::size_t>(j)] += e_v;
          bgrad_magnitude[static_cast<std::size_t>(j)] += std::abs(v);
          break;
        }
      }
    }
  }
  if (op.epilogue == Epilogue::dgelu_bgrad) {
    for (std::int64_t j = 0; j < n; ++j) {
      const auto jj = static_cast<std::size_t>(j);
      check(value(out.bias, j), bgrad[jj],
            round_out(bgrad_bound[jj] + gamma(m) * bgrad_magnitude[jj], std::abs(bgrad[jj])), -1, j,
            rounded<T>(bgrad[jj]), verdict.worst_bias);
    }
  }
  if (op.epilogue == Epilogue::bgradb) {  // bias(M) = Σ_k op(A)(i, k)
    for (std::int64_t i = 0; i < m; ++i) {
      double sum = 0.0, magnitude = 0.0;
      for (std::int64_t p = 0; p < k; ++p) {
        const double x = value(d.a, op.trans_a ? p * m + i : i * k + p);
        sum += x;
        magnitude += std::abs(x);
      }
      check(value(out.bias, i), sum, round_out(gamma(k) * magnitude, std::abs(sum)), -1, i, rounded<T>(sum),
            verdict.worst_bias);
    }
  }
  return verdict;
}

// One case: C(M,N) [+]= op(A)·op(B) with an epilogue, on the device, against evaluate().
template <class T>
void check_case(Blas& blas, cudaStream_t stream, std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op) {
  const CaseData<T> d = case_data<T>(m, n, k, op);
  auto d_a = upload(d.a, stream);
  auto d_b = upload(d.b, stream);
  auto d_c = upload(d.c0, stream);
  auto d_bias = upload(d.bias, stream);
  auto d_aux = upload(d.aux_in, stream);
  blas.gemm<T>(stream, d_c.data(), d_a.data(), d_b.data(), d_bias.data(), d_aux.data(), m, n, k, op);
  const GemmAlgorithm* algorithm = blas.last_algorithm();
  const Outputs<T> out{gpu_test::download(d_c), gpu_test::download(d_aux), gpu_test::download(d_bias)};

  const double u_in = std::is_same_v<T, float> && blas.fp32_math() == Fp32Math::tf32 ? kTf32Input : 0.0;
  const Verdict verdict = evaluate(d, out, u_in);
  std::printf(
      "%-4s M=%-5lld N=%-5lld K=%-5lld ta=%d tb=%d acc=%d epilogue=%-13s max rel err %.2e %.2e, worst %.2g of bound  "
      "%s\n",
      name_of(dtype_of<T>()).data(), static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
      op.trans_a, op.trans_b, op.accumulate, backend::cuda::detail::name_of(op.epilogue), verdict.worst,
      verdict.worst_bias, verdict.worst_ratio, verdict.ok() ? "ok" : "FAILED");
  if (!verdict.ok()) {
    std::printf("  cuBLASLt: %s\n", algorithm != nullptr ? algorithm->describe().c_str() : "(no plan)");
    for (const Miss& miss : verdict.misses) {
      const std::string where = miss.i < 0 ? "bias[" + std::to_string(miss.j) + "]"
                                           : "C[" + std::to_string(miss.i) + ", " + std::to_string(miss.j) + "]";
      std::printf(
          "  %s: device %.9g, f64 %.9g (rounded once to %s: %.9g; A·B rounded first: %.9g), bound %.3g (%.3g x)\n",
          where.c_str(), miss.device, miss.exact, name_of(dtype_of<T>()).data(), rounded<T>(miss.exact), miss.twice,
          miss.bound, miss.ratio);
    }
  }
  expect(verdict.ok(), "gemm case above");
}

// What a GEMM without epilogue outputs under a model of its arithmetic (host_checks):
// f32 FMAs in K order, then + C in f32, then one rounding to T; `twice`: A·B rounded
// to T before C is added (the first run's 16-bit accumulating GEMMs); `tf32`: the
// inputs rounded to nearest TF32 first (the first run's TF32 case).
enum class Model : std::uint8_t { once, twice, tf32 };

float tf32_nearest(float x) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0xFFFu + ((bits >> 13) & 1u)) & ~0x1FFFu;  // ties to even on the 13 dropped bits
  std::memcpy(&x, &bits, sizeof(bits));
  return x;
}

template <class T>
Outputs<T> emulate(const CaseData<T>& d, Model model) {
  const std::int64_t m = d.m, n = d.n, k = d.k;
  Outputs<T> out{std::vector<T>(d.c0.size()), d.aux_in, d.bias};
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (std::int64_t p = 0; p < k; ++p) {
        float x = convert<float>(d.a[static_cast<std::size_t>(d.op.trans_a ? p * m + i : i * k + p)]);
        float y = convert<float>(d.b[static_cast<std::size_t>(d.op.trans_b ? j * k + p : p * n + j)]);
        if (model == Model::tf32) x = tf32_nearest(x), y = tf32_nearest(y);
        sum = std::fma(x, y, sum);
      }
      const float old_c = d.op.accumulate ? convert<float>(d.c0[static_cast<std::size_t>(i * n + j)]) : 0.0f;
      const float first = model == Model::twice ? convert<float>(convert<T>(sum)) : sum;
      out.c[static_cast<std::size_t>(i * n + j)] = convert<T>(first + old_c);
    }
  }
  return out;
}

template <class T>
void check_type(Blas& blas, cudaStream_t stream) {
  const std::int64_t shapes[][3] = {{64, 64, 64}, {1, 8, 1}, {7, 24, 13}, {257, 136, 129}, {768, 2304, 768}};
  for (const auto& s : shapes)
    for (int t = 0; t < 4; ++t)
      for (bool accumulate : {false, true})
        check_case<T>(blas, stream, s[0], s[1], s[2], {(t & 1) != 0, (t & 2) != 0, accumulate, Epilogue::none});
  for (Epilogue e :
       {Epilogue::bias, Epilogue::gelu_aux_bias, Epilogue::gelu_aux, Epilogue::dgelu, Epilogue::dgelu_bgrad}) {
    check_case<T>(blas, stream, 40, 64, 96, {false, true, false, e});
    check_case<T>(blas, stream, 257, 1024, 136, {false, false, false, e});
  }
  check_case<T>(blas, stream, 96, 48, 80, {true, false, true, Epilogue::bgradb});
}

// cuBLASLt's f32 GELU and gelu' on their own, free of any GEMM rounding: A·B is
// exactly the values fed in (K = 8, each row of A one value and seven zeros, B ones).
// GELU_AUX with A's rows (x, 0, ..., 0) gives C = gelu(x) and aux = x; DGELU with A's
// rows (1, 0, ..., 0) and aux = x gives C = gelu'(x). Prints the largest error against
// tanh-GELU and how far erf-GELU is, and holds the epilogue to kActivation.
void check_epilogue_functions(Blas& blas, cudaStream_t stream) {
  constexpr std::int64_t kPoints = 4096, kWidth = 8, kDepth = 8;
  std::vector<float> x(static_cast<std::size_t>(kPoints));
  for (std::int64_t i = 0; i < kPoints; ++i)
    x[static_cast<std::size_t>(i)] = static_cast<float>(-8.0 + 16.0 * static_cast<double>(i) / (kPoints - 1));
  std::vector<float> a_x(static_cast<std::size_t>(kPoints * kDepth), 0.0f), a_one(a_x.size(), 0.0f);
  std::vector<float> grid(static_cast<std::size_t>(kPoints * kWidth));  // aux = x along each row of C
  for (std::int64_t i = 0; i < kPoints; ++i) {
    a_x[static_cast<std::size_t>(i * kDepth)] = x[static_cast<std::size_t>(i)];
    a_one[static_cast<std::size_t>(i * kDepth)] = 1.0f;
    for (std::int64_t j = 0; j < kWidth; ++j)
      grid[static_cast<std::size_t>(i * kWidth + j)] = x[static_cast<std::size_t>(i)];
  }
  const std::vector<float> ones(static_cast<std::size_t>(kDepth * kWidth), 1.0f);
  auto d_a_x = upload(a_x, stream);
  auto d_a_one = upload(a_one, stream);
  auto d_ones = upload(ones, stream);
  auto d_grid = upload(grid, stream);
  DeviceBuffer<float> d_c(grid.size(), stream);
  DeviceBuffer<float> d_pre(grid.size(), stream);
  blas.gemm<float>(stream, d_c.data(), d_a_x.data(), d_ones.data(), nullptr, d_pre.data(), kPoints, kWidth, kDepth,
                   {false, false, false, Epilogue::gelu_aux});
  const std::vector<float> gelu = gpu_test::download(d_c);
  const std::vector<float> pre = gpu_test::download(d_pre);
  blas.gemm<float>(stream, d_c.data(), d_a_one.data(), d_ones.data(), nullptr, d_grid.data(), kPoints, kWidth, kDepth,
                   {false, false, false, Epilogue::dgelu});
  const std::vector<float> slope = gpu_test::download(d_c);

  const auto erf_gelu = [](double v) { return 0.5 * v * std::erfc(-v / std::sqrt(2.0)); };
  const auto erf_gelu_grad = [](double v) {
    return 0.5 * std::erfc(-v / std::sqrt(2.0)) + v * std::exp(-0.5 * v * v) / std::sqrt(2.0 * 3.14159265358979323846);
  };
  double err_gelu = 0.0, err_slope = 0.0, at_gelu = 0.0, at_slope = 0.0, erf_gelu_err = 0.0, erf_slope_err = 0.0;
  double ratio = 0.0;
  bool aux_exact = true;
  for (std::int64_t i = 0; i < kPoints * kWidth; ++i) {
    const double v = grid[static_cast<std::size_t>(i)];
    const double g = math::gelu_tanh(v), s = gelu_grad(v);
    const double e_g = std::abs(gelu[static_cast<std::size_t>(i)] - g);
    const double e_s = std::abs(slope[static_cast<std::size_t>(i)] - s);
    aux_exact = aux_exact && pre[static_cast<std::size_t>(i)] == grid[static_cast<std::size_t>(i)];
    if (e_g > err_gelu) err_gelu = e_g, at_gelu = v;
    if (e_s > err_slope) err_slope = e_s, at_slope = v;
    erf_gelu_err = std::max(erf_gelu_err, std::abs(erf_gelu(v) - g));
    erf_slope_err = std::max(erf_slope_err, std::abs(erf_gelu_grad(v) - s));
    ratio = std::max(ratio, e_g / (kActivation * std::max(1.0, std::abs(v)) + kF32 * std::abs(g)));
    ratio = std::max(ratio, e_s / (kActivation + kF32 * std::abs(s)));
  }
  const bool ok = ratio <= 1.0 && aux_exact;
  std::printf(
      "f32 epilogue functions on %lld points in [-8, 8]: gelu max |err| %.2e at x = %.3f (erf-GELU is %.2e away), "
      "gelu' max |err| %.2e at x = %.3f (erf-GELU' %.2e away), aux %s; worst %.2g of bound  %s\n",
      static_cast<long long>(kPoints), err_gelu, at_gelu, erf_gelu_err, err_slope, at_slope, erf_slope_err,
      aux_exact ? "= x" : "NOT x", ratio, ok ? "ok" : "FAILED");
  if (!ok) std::printf("  cuBLASLt (dgelu): %s\n", blas.last_algorithm()->describe().c_str());
  expect(ok, "cuBLASLt's GELU epilogues compute tanh-GELU within the bound");
}

// Strict fp32 is not TF32: 1 + 2^-20 is a float but not a TF32 value (10-bit mantissa),
// so A = 1 + 2^-20, B = 1 give K(1 + 2^-20) exactly in f32 (K = 16: 16 + 2^-16, a float)
// and K under TF32. Also prints what the TF32 plan gives (K when it uses TF32 tensor
// cores, which the heuristic may choose not to).
void check_strict_is_not_tf32(Blas& strict, Blas& tf32, cudaStream_t stream) {
  constexpr std::int64_t m = 128, n = 128, k = 16;
  const std::vector<float> a(static_cast<std::size_t>(m * k), 1.0f + 0x1p-20f),
      b(static_cast<std::size_t>(k * n), 1.0f);
  auto d_a = upload(a, stream);
  auto d_b = upload(b, stream);
  DeviceBuffer<float> d_c(static_cast<std::size_t>(m * n), stream);
  const auto run = [&](Blas& blas) {
    blas.gemm<float>(stream, d_c.data(), d_a.data(), d_b.data(), nullptr, nullptr, m, n, k, {});
    const std::vector<float> c = gpu_test::download(d_c);
    std::int64_t exact = 0;
    for (float v : c) exact += v == 16.0f + 0x1p-16f ? 1 : 0;
    return exact;
  };
  const std::int64_t strict_exact = run(strict);
  const std::string strict_algo = strict.last_algorithm()->describe();
  const std::int64_t tf32_exact = run(tf32);
  const bool ok = strict_exact == m * n;
  std::printf("f32  strict: %lld of %lld elements are K(1 + 2^-20) exactly (TF32 would give K)  %s\n",
              static_cast<long long>(strict_exact), static_cast<long long>(m * n), ok ? "ok" : "FAILED");
  std::printf("     tf32:   %lld of %lld exact (%s); %s\n", static_cast<long long>(tf32_exact),
              static_cast<long long>(m * n), tf32_exact == 0 ? "TF32 in use" : "this plan does not round to TF32",
              tf32.last_algorithm()->describe().c_str());
  if (!ok) std::printf("  cuBLASLt (strict): %s\n", strict_algo.c_str());
  expect(ok, "strict fp32 GEMMs keep the input bits TF32 drops");
}

template <class T>
std::vector<float> widen(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = convert<float>(v[i]);
  return out;
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
  const GemmAlgorithm* algorithm = blas.last_algorithm();
  const std::vector<TC> got = gpu_test::download(d_c);

  // The CPU backend's f32 GEMM of the upconverted operands.
  const std::vector<float> a32 = widen(a), b32 = widen(b);
  std::vector<float> ref = widen(c0);
  gpu_test::cpu_sgemm(ref.data(), a32.data(), b32.data(), m, n, k, op.trans_a, op.trans_b, op.accumulate);

  constexpr double kFloor = 1e-6;
  const double u = std::is_same_v<TC, float> ? 0.0 : unit_roundoff<T>();
  const Products ab = products(a, b, m, n, k, op.trans_a, op.trans_b);
  std::int64_t bad = 0;
  double worst = 0.0;  // the largest |got - ref| over its tolerance
  std::vector<std::string> shown;
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      const std::int64_t ij = i * n + j;
      const double old_c = op.accumulate ? value(c0, ij) : 0.0;
      const double magnitude = ab.magnitude[ij] + std::abs(old_c);
      const double y = value(ref, ij);
      // The CPU's result in the output's format.
      const double r = std::is_same_v<TC, float> ? y : rounded<TC>(y);
      const double delta = 2.0 * static_cast<double>(k + 1) * kF32 * magnitude + kFloor;
      const double tolerance = (1.0 + u) * delta + 2.0 * u * std::abs(y);
      const double err = std::abs(value(got, ij) - r);
      worst = std::max(worst, err / tolerance);
      if (!(err <= tolerance) && ++bad <= 3) {
        // Beside the CPU: the exact value, rounded once to the output type, and with A·B
        // rounded to it first (what a split-K reduction in the output type gives).
        const double exact = ab.exact[ij] + old_c;
        char line[320];
        std::snprintf(line, sizeof(line),
                      "  C[%lld, %lld]: device %.9g, cpu %.9g, tolerance %.3g; f64 %.9g, rounded once %.9g, A·B "
                      "rounded first %.9g",
                      static_cast<long long>(i), static_cast<long long>(j), value(got, ij), r, tolerance, exact,
                      rounded<TC>(exact), rounded<TC>(rounded<TC>(ab.exact[ij]) + old_c));
        shown.emplace_back(line);
      }
    }
  }
  std::printf(
      "%-4s x %-4s -> %-4s M=%-5lld N=%-5lld K=%-5lld ta=%d tb=%d acc=%d %-10s vs cpu f32: %lld off, "
      "worst %.2f of tolerance  %s\n",
      name_of(dtype_of<T>()).data(), name_of(dtype_of<T>()).data(), name_of(dtype_of<TC>()).data(),
      static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k), op.trans_a, op.trans_b,
      op.accumulate, label, static_cast<long long>(bad), worst, bad == 0 ? "ok" : "FAILED");
  if (bad != 0) {
    std::printf("  cuBLASLt: %s\n", algorithm != nullptr ? algorithm->describe().c_str() : "(no plan)");
    for (const std::string& line : shown) std::printf("%s\n", line.c_str());
  }
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

// ---------------------------------------------------------------------------------------
// Host-side checks: no device needed.

// The bounds against the first run's figures: emulate() reproduces what the H200 did,
// and evaluate() must accept one rounding and reject the second one it found.
template <class T>
void check_bound_on_model(const char* what, std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op, Model model,
                          double u_in, bool accept, double first_run) {
  const CaseData<T> d = case_data<T>(m, n, k, op);
  const Verdict verdict = evaluate(d, emulate(d, model), u_in);
  const bool as_expected = verdict.ok() == accept;
  const bool reproduces = first_run == 0.0 || std::abs(verdict.worst - first_run) <= 0.005 * first_run;
  char first[48] = "";
  if (first_run != 0.0) std::snprintf(first, sizeof(first), " (first run %.3g)", first_run);
  std::printf("host: %-4s M=%-4lld N=%-4lld K=%-4lld acc=%d %-30s max rel err %.3g%s, worst %.2g of bound: %s  %s\n",
              name_of(dtype_of<T>()).data(), static_cast<long long>(m), static_cast<long long>(n),
              static_cast<long long>(k), op.accumulate, what, verdict.worst, first, verdict.worst_ratio,
              verdict.ok() ? "accepted" : "rejected", as_expected && reproduces ? "ok" : "FAILED");
  expect(as_expected && reproduces, std::string("the gemm bound on ") + what);
}

void host_checks() {
  // The models of the first run's failures, and what the bounds make of them.
  const GemmOp accumulate{false, false, true, Epilogue::none};
  check_bound_on_model<bf16>("one rounding of A·B + C", 64, 64, 64, accumulate, Model::once, 0.0, true, 0.0);
  check_bound_on_model<bf16>("A·B rounded to bf16, then + C", 64, 64, 64, accumulate, Model::twice, 0.0, false,
                             6.15e-3);
  check_bound_on_model<f16>("one rounding of A·B + C", 64, 64, 64, accumulate, Model::once, 0.0, true, 0.0);
  check_bound_on_model<f16>("A·B rounded to f16, then + C", 64, 64, 64, accumulate, Model::twice, 0.0, false, 9.03e-4);
  const GemmOp plain{false, false, false, Epilogue::none};
  check_bound_on_model<float>("f32 FMAs in K order", 257, 136, 129, plain, Model::once, 0.0, true, 7.43e-6);
  check_bound_on_model<float>("TF32 inputs, strict bound", 257, 136, 129, plain, Model::tf32, 0.0, false, 0.0);
  check_bound_on_model<float>("TF32 inputs, TF32 bound", 257, 1024, 512, {false, true, false, Epilogue::none},
                              Model::tf32, kTf32Input, true, 2.09e-2);

  // Errors name the value and the rule (gemm() runs these checks first).
  const auto expect_error = [](auto&& call, const char* text) {
    try {
      call();
      expect(false, std::string("expected an error containing '") + text + "'");
    } catch (const Error& e) {
      expect(std::strstr(e.what(), text) != nullptr, std::string("message '") + e.what() + "' lacks '" + text + "'");
    }
  };
  const float f = 0.0f;
  const bf16 h{};
  expect_error([&] { Blas::check_arguments<float>(nullptr, nullptr, -1, 2, 2, {}); },
               "gemm sizes must be >= 0, got M=-1");
  expect_error(
      [&] {
        Blas::check_arguments<float>(nullptr, nullptr, 2, 2, 2, {false, false, false, Epilogue::bias});
      },
      "needs a bias pointer");
  expect_error(
      [&] {
        Blas::check_arguments<float>(&f, &f, 2, 6, 2, {false, false, false, Epilogue::gelu_aux_bias});
      },
      "needs N (6) to be a multiple of 8");
  expect_error(
      [&] {
        Blas::check_arguments<bf16, float>(&h, nullptr, 2, 8, 2, {false, false, false, Epilogue::bias});
      },
      "with an f32 output of bf16 operands");

  // What a failing case prints about its algorithm.
  GemmAlgorithm algorithm;
  algorithm.split_k = 5;
  algorithm.reduction = CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
  algorithm.numerics = CUBLASLT_NUMERICAL_IMPL_FLAGS_HMMA | CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_16F |
                       CUBLASLT_NUMERICAL_IMPL_FLAGS_ACCUMULATOR_32F;
  const std::string described = algorithm.describe();
  expect(described.find("split-K 5 (reduced in the output type)") != std::string::npos &&
             described.find("compute 32F, HMMA input 16F accumulator 32F") != std::string::npos,
         "GemmAlgorithm::describe names the split, the reduction and the numerics: " + described);
}

}  // namespace

int main() {
  // Lines in the order they happen, stdout and stderr alike, when both go to one log.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (!gpu_test::run_host_checks(host_checks, "host checks")) return 1;
  if (device_count() == 0) {
    std::printf("host checks %s; skipped the device checks: no CUDA device\n", gpu_test::verdict());
    return gpu_test::skip_exit_code();
  }
  return gpu_test::run_device_checks([] {
    DeviceContext context(0);
    const cudaStream_t stream = context.compute();
    // A group that throws (cuBLASLt finding no algorithm, say) is one failure, and the
    // groups after it still run: a GPU is lent for minutes, not for one error at a time.
    const auto group = [](const char* what, auto&& checks) {
      try {
        checks();
      } catch (const std::exception& e) {
        expect(false, std::string(what) + " threw: " + e.what());
      }
    };
    Blas strict(Fp32Math::strict);
    Blas tf32(Fp32Math::tf32);
    group("f32 cases", [&] { check_type<float>(strict, stream); });
    group("bf16 cases", [&] { check_type<bf16>(strict, stream); });
    group("f16 cases", [&] { check_type<f16>(strict, stream); });
    group("the TF32 case", [&] {
      check_case<float>(tf32, stream, 257, 1024, 512, {false, true, false, Epilogue::none});
    });
    group("strict fp32 against TF32", [&] { check_strict_is_not_tf32(strict, tf32, stream); });
    group("the epilogue functions", [&] { check_epilogue_functions(strict, stream); });

    // Mixed precision against the CPU backend: f32 main grads from 16-bit operands, and
    // 16-bit outputs.
    group("bf16 -> f32", [&] { check_mixed_type<bf16, float>(strict, stream); });
    group("f16 -> f32", [&] { check_mixed_type<f16, float>(strict, stream); });
    group("bf16 -> bf16", [&] { check_mixed_type<bf16, bf16>(strict, stream); });
    group("f16 -> f16", [&] { check_mixed_type<f16, f16>(strict, stream); });

    // The cache: one plan per distinct key, none added by repeating a call.
    const std::size_t plans = strict.cached_plans();
    check_case<float>(strict, stream, 64, 64, 64, {false, false, false, Epilogue::none});
    expect(strict.cached_plans() == plans, "repeating a GEMM must reuse its cached plan");

    // Argument errors surface through gemm() too.
    DeviceBuffer<float> x(64, stream);
    try {
      strict.gemm<float>(stream, x.data(), x.data(), x.data(), nullptr, nullptr, -1, 2, 2, {});
      expect(false, "gemm with M = -1 must throw");
    } catch (const Error& e) {
      expect(std::strstr(e.what(), "gemm sizes must be >= 0, got M=-1") != nullptr,
             std::string("gemm's message '") + e.what() + "' names M=-1");
    }
    std::printf("data-sheet peak of device 0: bf16 %.1f, tf32 %.1f, fp32 %.1f TFLOP/s\n",
                datasheet_peak_tflops(0, DType::bf16), datasheet_peak_tflops(0, DType::f32, Fp32Math::tf32),
                datasheet_peak_tflops(0, DType::f32, Fp32Math::strict));
  });
}
