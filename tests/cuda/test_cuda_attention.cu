// Flash attention on CUDA (kernels/attention.cuh) against its references.
//
//   - causal: forward (out, lse) and backward (dqkv) against the CPU backend's kernel
//     (backend/cpu/attention.hpp) on the same stored inputs, for float, bf16 and f16,
//     hs = 32, 64, 128, and T = 1, 17, 64, 65, 200 with B * NH up to 6; the backward of
//     both is fed the CPU forward's out and lse, so each kernel is checked on its own;
//   - no mask: forward and backward against a naive softmax attention in double;
//   - every output element is written (outputs are pre-filled with NaN);
//   - forward and backward are bitwise reproducible run to run;
//   - bf16/f16 at hs = 64, 128 run the forward's tensor-core path (the launcher picks it);
//     a qkv view offset by one element (not 16-byte aligned) runs the SIMT path instead,
//     and both agree with the reference;
//   - the host-side errors (hs = 48, C not divisible by NH, a negative B, no workspace)
//     throw before any CUDA call; they run first, also where there is no device.
// Tolerances, as |gpu - ref| <= ulps * ulp_T(ref) + rel * max|ref| per tensor: float
// rel 2e-5 forward, 5e-5 backward (ulps 0); bf16/f16 the same rel plus 2 ulps of the
// storage type (both sides round their float results, which differ in the last float
// bits because the tiles differ). The tensor-core forward rounds p to T before p v (the
// mma takes 16-bit operands; the softmax sum uses p unrounded), an error of at most
// u_T |v| per row, u_T the unit roundoff of T (2^-8 bf16, 2^-11 f16): its out tolerance
// is 2 ulps + u_T * max|ref| (its lse keeps rel 2e-5: s is accumulated in f32 from exact
// products). In the host emulation of that kernel (one thread per CUDA thread, mma and
// ldmatrix emulated from the PTX ISA) the worst ratio was 0.37 against a double
// reference, and every injected fragment-layout bug gave ratios above 70.
// A summary line per case gives the worst ratio of error to tolerance.
// Exit codes: 0 pass, 1 failure, 77 no CUDA device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cpu/attention.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/kernels/attention.cuh"

#include "gpu_test.hpp"

namespace {

using llmpar::bf16;
using llmpar::f16;
using llmpar::backend::cuda::DeviceBuffer;
using llmpar::backend::cuda::DeviceContext;
using llmpar::kernels::AttentionMask;
namespace gpu_test = llmpar::gpu_test;

using gpu_test::download;
using gpu_test::ErrorWording;
using gpu_test::expect;
using gpu_test::ExpectError;
using gpu_test::same_bits;

constexpr ExpectError expect_error{ErrorWording::lacks_message_last};

// The host-side checks: each throws before anything touches CUDA.
void check_host_errors() {
  using namespace llmpar::kernels;
  float lse = 0.f, ws = 0.f;
  bf16 x{};
  // hs = 96 / 2 = 48: not a compiled head size.
  expect_error([&] { attention_forward<bf16>(nullptr, &x, &lse, &x, 1, 8, 96, 2); },
               "head size hs = C / NH = 96 / 2 = 48 is not supported", "forward hs = 48");
  expect_error([&] { attention_forward<bf16>(nullptr, &x, &lse, &x, 1, 8, 96, 2); },
               "supported head sizes are 32, 64 and 128", "forward hs = 48 names the supported sizes");
  expect_error([&] { attention_backward<bf16>(nullptr, &x, &x, &x, &x, &lse, &ws, 1, 8, 96, 2); },
               "head size hs = C / NH = 96 / 2 = 48 is not supported", "backward hs = 48");
  expect_error([] { static_cast<void>(attention_backward_workspace(1, 8, 96, 2)); }, "hs = C / NH = 96 / 2 = 48",
               "workspace hs = 48");
  // C = 100 is not a multiple of NH = 3.
  expect_error([&] { attention_forward<float>(nullptr, &lse, &lse, &lse, 1, 8, 100, 3); },
               "the number of heads NH = 3 does not divide the channels C = 100", "forward C % NH");
  expect_error([&] { attention_backward<f16>(nullptr, nullptr, nullptr, nullptr, nullptr, &lse, &ws, 1, 8, 100, 3); },
               "the number of heads NH = 3 does not divide the channels C = 100", "backward C % NH");
  expect_error([&] { attention_forward<float>(nullptr, &lse, &lse, &lse, -1, 8, 64, 1); }, "B = -1, T = 8",
               "forward negative B");
  expect_error([&] { attention_backward<float>(nullptr, &lse, &lse, &lse, &lse, &lse, nullptr, 1, 8, 64, 1); },
               "workspace is null", "backward without a workspace");
  expect(attention_backward_workspace(2, 17, 192, 3) == 2 * 3 * 17, "workspace size is B * NH * T floats");
}

// Random stored values: element i of the named stream, standard normal, rounded to T.
template <class T>
std::vector<T> random_tensor(const char* name, std::size_t n, std::uint64_t seed) {
  return gpu_test::random_vector<T>(llmpar::rng::Stream::named(seed, name), static_cast<std::int64_t>(n));
}

template <class T>
double value(T x) {
  return static_cast<double>(llmpar::convert<float>(x));
}

// One unit in the last place of T at |x|.
template <class T>
double ulp(double x) {
  if constexpr (std::is_same_v<T, float>) return 0.0;
  const int mantissa = std::is_same_v<T, bf16> ? 7 : 10;
  const int min_exponent = std::is_same_v<T, bf16> ? -126 : -14;
  int exponent = x == 0.0 ? min_exponent : std::ilogb(std::fabs(x));
  if (exponent < min_exponent) exponent = min_exponent;
  return std::ldexp(1.0, exponent - mantissa);
}

// Worst |got - ref| / (ulps * ulp(ref) + rel * max|ref|); infinity for a NaN or inf.
template <class T, class Ref>
double worst_ratio(std::span<const T> got, std::span<const Ref> ref, double ulps, double rel) {
  double maxabs = 0.0;
  for (Ref r : ref) maxabs = std::fmax(maxabs, std::fabs(static_cast<double>(r)));
  const double floor_tol = rel * std::fmax(maxabs, 1e-30);
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = value(got[i]);
    const double r = static_cast<double>(ref[i]);
    if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
    worst = std::fmax(worst, std::fabs(g - r) / (ulps * ulp<T>(r) + floor_tol));
  }
  return worst;
}

// Fills a device buffer with NaN bytes, so an element a kernel forgets to write shows.
template <class T>
void poison(DeviceBuffer<T>& buffer, cudaStream_t stream) {
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(buffer.data(), 0xFF, buffer.bytes(), stream));
}

struct Shape {
  std::int64_t B, T, NH;
};

// Naive softmax attention in double on the stored inputs. qkv: (B, T, 3C) ->
// out: (B, T, C), lse: (B, NH, T).
void reference_forward(std::vector<double>& out, std::vector<double>& lse, const std::vector<double>& qkv, Shape s,
                       std::int64_t C, bool causal) {
  const std::int64_t hs = C / s.NH, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  out.assign(s.B * s.T * C, 0.0);
  lse.assign(s.B * s.NH * s.T, 0.0);
  std::vector<double> p(s.T);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.NH; ++h)
      for (std::int64_t i = 0; i < s.T; ++i) {
        const std::int64_t n = causal ? i + 1 : s.T;
        const double* q = &qkv[(b * s.T + i) * C3 + h * hs];
        double m = -INFINITY;
        for (std::int64_t j = 0; j < n; ++j) {
          const double* k = &qkv[(b * s.T + j) * C3 + C + h * hs];
          double dot = 0.0;
          for (std::int64_t d = 0; d < hs; ++d) dot += q[d] * k[d];
          p[j] = dot * scale;
          m = std::fmax(m, p[j]);
        }
        double sum = 0.0;
        for (std::int64_t j = 0; j < n; ++j) sum += std::exp(p[j] - m);
        const double l = m + std::log(sum);
        lse[(b * s.NH + h) * s.T + i] = l;
        double* o = &out[(b * s.T + i) * C + h * hs];
        for (std::int64_t j = 0; j < n; ++j) {
          const double w = std::exp(p[j] - l);
          const double* v = &qkv[(b * s.T + j) * C3 + 2 * C + h * hs];
          for (std::int64_t d = 0; d < hs; ++d) o[d] += w * v[d];
        }
      }
}

// The matching backward: dqkv (B, T, 3C) from dout and out (B, T, C), lse (B, NH, T).
void reference_backward(std::vector<double>& dqkv, const std::vector<double>& dout, const std::vector<double>& qkv,
                        const std::vector<double>& out, const std::vector<double>& lse, Shape s, std::int64_t C,
                        bool causal) {
  const std::int64_t hs = C / s.NH, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  dqkv.assign(s.B * s.T * C3, 0.0);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.NH; ++h)
      for (std::int64_t i = 0; i < s.T; ++i) {
        const double* q = &qkv[(b * s.T + i) * C3 + h * hs];
        const double* g = &dout[(b * s.T + i) * C + h * hs];
        const double* o = &out[(b * s.T + i) * C + h * hs];
        double D = 0.0;
        for (std::int64_t d = 0; d < hs; ++d) D += g[d] * o[d];
        const double l = lse[(b * s.NH + h) * s.T + i];
        double* dq = &dqkv[(b * s.T + i) * C3 + h * hs];
        for (std::int64_t j = 0; j < (causal ? i + 1 : s.T); ++j) {
          const double* k = &qkv[(b * s.T + j) * C3 + C + h * hs];
          const double* v = &qkv[(b * s.T + j) * C3 + 2 * C + h * hs];
          double dot = 0.0, dp = 0.0;
          for (std::int64_t d = 0; d < hs; ++d) {
            dot += q[d] * k[d];
            dp += g[d] * v[d];
          }
          const double p = std::exp(dot * scale - l);
          const double ds = p * (dp - D) * scale;
          double* dk = &dqkv[(b * s.T + j) * C3 + C + h * hs];
          double* dv = &dqkv[(b * s.T + j) * C3 + 2 * C + h * hs];
          for (std::int64_t d = 0; d < hs; ++d) {
            dq[d] += ds * k[d];
            dk[d] += ds * q[d];
            dv[d] += p * g[d];
          }
        }
      }
}

template <class T>
constexpr double storage_ulps() {
  return std::is_same_v<T, float> ? 0.0 : 2.0;
}
constexpr double kForwardRel = 2e-5;
constexpr double kBackwardRel = 5e-5;

// Whether attention_forward<T> takes the tensor-core path at head size hs (with aligned
// pointers, as DeviceBuffer's are), and the out tolerance's rel term for it.
template <class T>
constexpr bool tensor_core_forward(std::int64_t hs) {
  return !std::is_same_v<T, float> && (hs == 64 || hs == 128);
}
template <class T>
double forward_out_rel(std::int64_t hs) {
  if (!tensor_core_forward<T>(hs)) return kForwardRel;
  return std::is_same_v<T, bf16> ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);  // p rounded to T
}

template <class T>
std::vector<double> as_double(const std::vector<T>& v) {
  std::vector<double> d(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) d[i] = value(v[i]);
  return d;
}

// One case: GPU forward and backward against the reference for `mask`, plus determinism.
template <class T>
void run_case(const DeviceContext& context, std::int64_t hs, Shape s, AttentionMask mask) {
  namespace kernels = llmpar::kernels;
  namespace cpu = llmpar::backend::cpu;
  const cudaStream_t stream = context.compute();
  const std::int64_t C = hs * s.NH;
  const std::size_t n_qkv = s.B * s.T * 3 * C, n_out = s.B * s.T * C, n_lse = s.B * s.NH * s.T;
  const bool causal = mask == AttentionMask::causal;
  const std::uint64_t seed = 1000 * hs + 10 * s.T + s.B * s.NH;
  const std::vector<T> qkv = random_tensor<T>("qkv", n_qkv, seed);
  const std::vector<T> dout = random_tensor<T>("dout", n_out, seed);

  // References: the CPU kernel (causal) or double (no mask). The backward of both
  // sides is fed ref_out (stored as T) and ref_lse, so it is checked on its own.
  std::vector<double> ref_out_d, ref_lse_d, ref_dqkv_d;
  std::vector<T> ref_out(n_out), cpu_dqkv(n_qkv);
  std::vector<float> ref_lse(n_lse);
  if (causal) {
    cpu::attention_forward<T>(ref_out.data(), ref_lse.data(), qkv.data(), s.B, s.T, C, s.NH);
    cpu::attention_backward<T>(cpu_dqkv.data(), dout.data(), qkv.data(), ref_out.data(), ref_lse.data(), s.B, s.T, C,
                               s.NH);
    ref_out_d = as_double(ref_out);
    ref_lse_d.assign(ref_lse.begin(), ref_lse.end());
    ref_dqkv_d = as_double(cpu_dqkv);
  } else {
    const std::vector<double> qkv_d = as_double(qkv);
    reference_forward(ref_out_d, ref_lse_d, qkv_d, s, C, false);
    for (std::size_t i = 0; i < n_out; ++i) ref_out[i] = llmpar::convert<T>(static_cast<float>(ref_out_d[i]));
    for (std::size_t i = 0; i < n_lse; ++i) ref_lse[i] = static_cast<float>(ref_lse_d[i]);
    // The backward's D uses out as stored: the reference does too.
    reference_backward(ref_dqkv_d, as_double(dout), qkv_d, as_double(ref_out), ref_lse_d, s, C, false);
  }

  DeviceBuffer<T> d_qkv(n_qkv, stream), d_dout(n_out, stream), d_out(n_out, stream), d_ref_out(n_out, stream);
  DeviceBuffer<T> d_dqkv(n_qkv, stream);
  DeviceBuffer<float> d_lse(n_lse, stream), d_ref_lse(n_lse, stream);
  DeviceBuffer<float> d_ws(static_cast<std::size_t>(kernels::attention_backward_workspace(s.B, s.T, C, s.NH)), stream);
  d_qkv.upload(qkv);
  d_dout.upload(dout);
  d_ref_out.upload(ref_out);
  d_ref_lse.upload(ref_lse);

  // Forward, twice.
  poison(d_out, stream);
  poison(d_lse, stream);
  kernels::attention_forward<T>(stream, d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, C, s.NH, mask);
  const std::vector<T> out1 = download(d_out);
  const std::vector<float> lse1 = download(d_lse);
  poison(d_out, stream);
  poison(d_lse, stream);
  kernels::attention_forward<T>(stream, d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, C, s.NH, mask);
  const std::vector<T> out2 = download(d_out);
  const std::vector<float> lse2 = download(d_lse);

  // Backward, twice, on the reference's out and lse.
  poison(d_dqkv, stream);
  kernels::attention_backward<T>(stream, d_dqkv.data(), d_dout.data(), d_qkv.data(), d_ref_out.data(), d_ref_lse.data(),
                                 d_ws.data(), s.B, s.T, C, s.NH, mask);
  const std::vector<T> dqkv1 = download(d_dqkv);
  poison(d_dqkv, stream);
  kernels::attention_backward<T>(stream, d_dqkv.data(), d_dout.data(), d_qkv.data(), d_ref_out.data(), d_ref_lse.data(),
                                 d_ws.data(), s.B, s.T, C, s.NH, mask);
  const std::vector<T> dqkv2 = download(d_dqkv);

  const double r_out = worst_ratio<T, double>(out1, ref_out_d, storage_ulps<T>(), forward_out_rel<T>(hs));
  const double r_lse = worst_ratio<float, double>(lse1, ref_lse_d, 0.0, kForwardRel);
  const double r_dqkv = worst_ratio<T, double>(dqkv1, ref_dqkv_d, storage_ulps<T>(), kBackwardRel);
  const bool deterministic = same_bits(out1, out2) && same_bits(lse1, lse2) && same_bits(dqkv1, dqkv2);

  char name[160];
  std::snprintf(name, sizeof name, "%-6s %-4s %-4s hs=%-3lld B=%lld T=%-3lld NH=%lld", causal ? "causal" : "full",
                std::string(llmpar::name_of(llmpar::dtype_of<T>())).c_str(),
                tensor_core_forward<T>(hs) ? "tc" : "simt", static_cast<long long>(hs),
                static_cast<long long>(s.B), static_cast<long long>(s.T), static_cast<long long>(s.NH));
  const bool ok = r_out <= 1.0 && r_lse <= 1.0 && r_dqkv <= 1.0 && deterministic;
  std::printf("%s %s: error/tolerance out %.3f lse %.3f dqkv %.3f; bitwise reproducible: %s\n", ok ? "ok  " : "FAIL",
              name, r_out, r_lse, r_dqkv, deterministic ? "yes" : "NO");
  expect(r_out <= 1.0, std::string(name) + ": out");
  expect(r_lse <= 1.0, std::string(name) + ": lse");
  expect(r_dqkv <= 1.0, std::string(name) + ": dqkv");
  expect(deterministic, std::string(name) + ": run-to-run bitwise reproducibility");
}

// The SIMT fallback of a 16-bit forward at a tensor-core head size: qkv and out are
// views one element into their buffers (2-byte aligned), which the tensor-core kernel's
// 16-byte loads cannot serve. Checked against the double reference like run_case.
template <class T>
void run_unaligned_case(const DeviceContext& context, std::int64_t hs, Shape s, AttentionMask mask) {
  namespace kernels = llmpar::kernels;
  const cudaStream_t stream = context.compute();
  const std::int64_t C = hs * s.NH;
  const std::size_t n_qkv = s.B * s.T * 3 * C, n_out = s.B * s.T * C, n_lse = s.B * s.NH * s.T;
  const bool causal = mask == AttentionMask::causal;
  const std::vector<T> qkv = random_tensor<T>("qkv", n_qkv, 7 * hs + s.T);
  std::vector<double> ref_out, ref_lse;
  reference_forward(ref_out, ref_lse, as_double(qkv), s, C, causal);

  std::vector<T> padded(n_qkv + 1, llmpar::convert<T>(0.0f));  // element 0 is the offset
  std::copy(qkv.begin(), qkv.end(), padded.begin() + 1);
  DeviceBuffer<T> d_qkv(n_qkv + 1, stream), d_out(n_out + 1, stream);
  DeviceBuffer<float> d_lse(n_lse, stream);
  d_qkv.upload(padded);
  poison(d_out, stream);
  poison(d_lse, stream);
  kernels::attention_forward<T>(stream, d_out.data() + 1, d_lse.data(), d_qkv.data() + 1, s.B, s.T, C, s.NH, mask);
  const std::vector<T> out_all = download(d_out);
  const std::vector<float> lse = download(d_lse);
  const std::span<const T> out(out_all.data() + 1, n_out);

  const double r_out = worst_ratio<T, double>(out, ref_out, storage_ulps<T>(), kForwardRel);
  const double r_lse = worst_ratio<float, double>(lse, ref_lse, 0.0, kForwardRel);
  char name[160];
  std::snprintf(name, sizeof name, "%-6s %-4s simt hs=%-3lld B=%lld T=%-3lld NH=%lld, unaligned views",
                causal ? "causal" : "full", std::string(llmpar::name_of(llmpar::dtype_of<T>())).c_str(),
                static_cast<long long>(hs), static_cast<long long>(s.B), static_cast<long long>(s.T),
                static_cast<long long>(s.NH));
  const bool ok = r_out <= 1.0 && r_lse <= 1.0;
  std::printf("%s %s: error/tolerance out %.3f lse %.3f\n", ok ? "ok  " : "FAIL", name, r_out, r_lse);
  expect(r_out <= 1.0, std::string(name) + ": out");
  expect(r_lse <= 1.0, std::string(name) + ": lse");
}

template <class T>
void run_all(const DeviceContext& context) {
  const Shape causal_shapes[] = {{1, 1, 1}, {1, 17, 2}, {2, 64, 3}, {1, 65, 1}, {2, 200, 3}};
  const Shape full_shapes[] = {{1, 1, 1}, {1, 17, 2}, {2, 65, 3}, {1, 200, 1}};
  for (std::int64_t hs : {32, 64, 128}) {
    for (const Shape& s : causal_shapes) run_case<T>(context, hs, s, AttentionMask::causal);
    for (const Shape& s : full_shapes) run_case<T>(context, hs, s, AttentionMask::none);
  }
  if constexpr (!std::is_same_v<T, float>) {
    run_unaligned_case<T>(context, 64, {2, 65, 3}, AttentionMask::causal);
    run_unaligned_case<T>(context, 128, {1, 200, 2}, AttentionMask::none);
  }
}

// Throughput of the causal bf16 kernels at a GPT-sized shape (reported, not checked).
void report_speed(const DeviceContext& context) {
  namespace kernels = llmpar::kernels;
  using llmpar::backend::cuda::Event;
  const cudaStream_t stream = context.compute();
  const std::int64_t B = 2, T = 4096, NH = 16, hs = 128, C = NH * hs;
  DeviceBuffer<bf16> qkv(B * T * 3 * C, stream), out(B * T * C, stream), dqkv(B * T * 3 * C, stream);
  DeviceBuffer<float> lse(B * NH * T, stream), ws(kernels::attention_backward_workspace(B, T, C, NH), stream);
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(qkv.data(), 0, qkv.bytes(), stream));
  kernels::attention_forward<bf16>(stream, out.data(), lse.data(), qkv.data(), B, T, C, NH);  // warm-up
  Event start(Event::Timing::on), mid(Event::Timing::on), stop(Event::Timing::on);
  start.record(stream);
  kernels::attention_forward<bf16>(stream, out.data(), lse.data(), qkv.data(), B, T, C, NH);
  mid.record(stream);
  kernels::attention_backward<bf16>(stream, dqkv.data(), out.data(), qkv.data(), out.data(), lse.data(), ws.data(), B,
                                    T, C, NH);
  stop.record(stream);
  stop.synchronize();
  const double flops = 4.0 * B * NH * T * T * hs / 2;  // causal q k^T and p v
  const double fwd_ms = mid.ms_since(start), bwd_ms = stop.ms_since(mid);
  std::printf(
      "speed  causal bf16 hs=128 B=%lld T=%lld NH=%lld: forward %.3f ms (%.1f TFLOP/s), "
      "backward %.3f ms (%.1f TFLOP/s at 2.5x forward FLOPs)\n",
      static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(NH), fwd_ms, flops / fwd_ms * 1e-9,
      bwd_ms, 2.5 * flops / bwd_ms * 1e-9);
}

}  // namespace

int main() {
  if (!gpu_test::run_host_checks(check_host_errors, "host-side checks")) return 1;
  if (llmpar::backend::cuda::device_count() == 0) {
    std::printf("skipped: no CUDA device (host-side checks %s)\n", gpu_test::verdict());
    return gpu_test::skip_exit_code();
  }
  return gpu_test::run_device_checks([] {
    DeviceContext context(0);
    run_all<float>(context);
    run_all<bf16>(context);
    run_all<f16>(context);
    report_speed(context);
  });
}
