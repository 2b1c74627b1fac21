// The element-wise CUDA kernels (kernels/elementwise.cuh) against the CPU kernels.
//
// What each check proves:
//   - gelu_forward / gelu_backward agree with backend/cpu/gelu.hpp within the difference
//     of the device's expf and FMA contraction (float: 1e-5 relative + 2e-6 absolute;
//     bf16/f16: the CPU kernel on the same rounded inputs, within 1 ulp of the storage
//     type or that absolute bound), on the vectorized and the scalar path (a pointer
//     offset by one element), and in place (out == x, dx == dout) with identical bits.
//   - glu_forward / glu_backward (SwiGLU, GeGLU) agree with the CPU's glu kernels within
//     GELU's tolerances; their host checks name overlapping buffers and negative sizes.
//   - add, add_inplace, scale_inplace, bias_add, encoder_forward and convert round each
//     element once, as the CPU does, so they must give the CPU's bits exactly.
//   - bias_backward sums in a different grouping than the CPU kernel (row slices, then
//     slices in order), so its f32 dbias (the main grad, for every storage type) matches
//     to float rounding (1e-5 of the column's sum of magnitudes), and is bitwise
//     identical run to run.
//   - encoder_backward adds every position into its f32 dwte and dwpe rows in the CPU
//     kernel's order (positions ascending) with the CPU's f32 rounding after each
//     addition, so it must match backend/cpu/embedding.hpp BITWISE for float, bf16 and
//     f16 dout, including when all tokens are equal or drawn from a vocabulary of 5.
//   - with a row slice (a vocabulary-parallel table of 64 rows in 4 slices of 16),
//     encoder_forward and encoder_backward give the CPU's bits with and without the
//     position table; backward leaves the other slices' rows of the table alone; and
//     the 4 slices' forward outputs, summed with the position table on slice 0 only,
//     are the unsplit output's bits (each row has one nonzero token term and one
//     position term, so the sum rounds as the unsplit add).
//   - the launchers' host checks throw llmpar::Error with messages that name the value
//     and the fix, before any CUDA call (checked before the no-device skip).
// Sizes are ragged (n = 1, 7, 1000003; rows 1, 5, 1027; C = 1, 7, 771) and round
// (768) so both the vectorized paths and the scalar tails run. Exit codes: 0 pass,
// 1 failure, 77 no CUDA device (ctest reports that as skipped).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gpu_test.hpp"
#include "llmpar/backend/cpu/bias.hpp"
#include "llmpar/backend/cpu/elementwise.hpp"
#include "llmpar/backend/cpu/embedding.hpp"
#include "llmpar/backend/cpu/gelu.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/bits.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/core/slice.hpp"
#include "llmpar/kernels/elementwise.cuh"

namespace {

using llmpar::bf16;
using llmpar::f16;
using llmpar::backend::cuda::DeviceBuffer;
namespace kernels = llmpar::kernels;
namespace cpu = llmpar::backend::cpu;
namespace math = llmpar::math;
namespace gpu_test = llmpar::gpu_test;

using gpu_test::copy_out;
using gpu_test::ErrorWording;
using gpu_test::expect;
using gpu_test::ExpectError;
using gpu_test::ordered;
using gpu_test::report;
using gpu_test::same_bits;
using gpu_test::to_f;
using gpu_test::type_name;

constexpr ExpectError expect_error{ErrorWording::lacks};

// got is want within 1 ulp of T (16-bit types), or within rel * |want| + abs in float.
template <class T>
bool close(T got, T want, float rel_tol, float abs_tol) {
  if (ordered(got) == ordered(want)) return true;
  const float g = to_f(got), w = to_f(want);
  if (std::isnan(g) || std::isnan(w)) return false;
  if (!std::is_same_v<T, float> && std::llabs(ordered(got) - ordered(want)) <= 1) return true;
  return std::fabs(g - w) <= rel_tol * std::fabs(w) + abs_tol;
}

// Counts elements of got that are not close to want and prints the first few.
template <class T>
std::int64_t count_far(const std::vector<T>& got, const std::vector<T>& want, float rel_tol, float abs_tol,
                       const char* what) {
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!close(got[i], want[i], rel_tol, abs_tol) && ++bad <= 3)
      std::fprintf(stderr, "  %s[%zu]: device %.9g, cpu %.9g\n", what, i, to_f(got[i]), to_f(want[i]));
  }
  return bad;
}

template <class T>
std::int64_t count_different_bits(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (ordered(got[i]) != ordered(want[i]) && ++bad <= 3)
      std::fprintf(stderr, "  %s[%zu]: device %.9g, cpu %.9g\n", what, i, to_f(got[i]), to_f(want[i]));
  }
  return bad;
}

// n values of scale * N(0, 1), rounded to T, from the stream named `seed`.
template <class T>
std::vector<T> random_vector(std::uint64_t seed, std::int64_t n, double scale) {
  return gpu_test::random_vector<T>(llmpar::rng::Stream(seed), n, scale);
}

template <class T>
void copy_in(T* device, const std::vector<T>& host, cudaStream_t stream) {
  if (!host.empty())
    LLMPAR_CHECK_CUDA(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
}

// ---------------------------------------------------------------------------------------
// Host-side checks: every one throws before any CUDA call, so they run without a device.
void host_checks() {
  float fake[64] = {};  // never dereferenced: each call below must throw first
  float* p = fake;
  const std::int32_t tokens[4] = {};
  expect_error([&] { kernels::gelu_forward<float>(nullptr, p, p, -1); },
               "gelu_forward: n = -1; the element count must be >= 0", "gelu_forward with n < 0");
  expect_error([&] { kernels::gelu_forward<float>(nullptr, nullptr, p, 4); }, "gelu_forward: out is nullptr",
               "gelu_forward with a null out");
  expect_error([&] { kernels::gelu_forward<float>(nullptr, p + 1, p, 4); },
               "gelu_forward: out and x overlap without being the same buffer", "gelu_forward partial overlap");
  expect_error(
      [&] {
        kernels::gelu_backward<bf16>(nullptr, reinterpret_cast<bf16*>(p), reinterpret_cast<bf16*>(p + 8),
                                     reinterpret_cast<bf16*>(p) + 1, 4);
      },
      "gelu_backward: dx and dout overlap", "gelu_backward partial overlap");
  expect_error([&] { kernels::add<float>(nullptr, p + 1, p, p + 16, 4); },
               "add: out and a overlap without being the same buffer", "add partial overlap");
  expect_error([&] { kernels::add_inplace<f16>(nullptr, reinterpret_cast<f16*>(p), nullptr, 3); },
               "add_inplace: b is nullptr", "add_inplace with a null b");
  expect_error([&] { kernels::convert<bf16, float>(nullptr, reinterpret_cast<bf16*>(p + 2), p, 8); },
               "convert: out and in overlap; a conversion between types of different sizes needs disjoint buffers",
               "convert overlap");
  expect_error([&] { kernels::bias_add<float>(nullptr, p, p, -1, 3); }, "bias_add: rows = -1, n = 3",
               "bias_add with rows < 0");
  expect_error([&] { kernels::bias_add<float>(nullptr, p, p + 4, 2, 3); }, "bias_add: y and bias overlap",
               "bias_add overlap");
  expect_error([&] { kernels::bias_backward<float>(nullptr, p, p, nullptr, 5, 7); },
               "bias_backward: workspace is nullptr; pass bias_backward_workspace(5, 7) = 7 device floats",
               "bias_backward without workspace");
  expect_error([&] { kernels::bias_backward<float>(nullptr, p, p, p, 5, -7); }, "bias_backward: rows = 5, n = -7",
               "bias_backward with n < 0");
  expect_error([&] { static_cast<void>(kernels::bias_backward_workspace(-2, 7)); },
               "bias_backward_workspace: rows = -2", "bias_backward_workspace with rows < 0");
  expect(kernels::bias_backward_workspace(1, 7) == 7, "bias_backward_workspace(1, 7) == 7 (one slice)");
  expect(kernels::bias_backward_workspace(1027, 771) == 5 * 771, "bias_backward_workspace(1027, 771) == 5 slices");
  expect(kernels::bias_backward_workspace(1 << 20, 3) == 128 * 3, "bias_backward_workspace caps at 128 slices");
  expect_error([&] { kernels::encoder_forward<float>(nullptr, p, tokens, p, p, -1, 4, 8); },
               "encoder_forward: B = -1, T_len = 4, C = 8; sizes must be >= 0", "encoder_forward with B < 0");
  expect_error([&] { kernels::encoder_forward<float>(nullptr, p, nullptr, p, p, 1, 4, 8); },
               "encoder_forward: tokens is nullptr", "encoder_forward without tokens");
  expect_error(
      [&] {
        kernels::encoder_backward<float>(nullptr, p, p + 32, p, tokens, p, std::int64_t{1} << 20, std::int64_t{1} << 12,
                                         8);
      },
      "positions exceed 2^31 - 1", "encoder_backward with too many positions");
  expect_error([&] { kernels::encoder_backward<float>(nullptr, p, p + 32, p, tokens, nullptr, 1, 4, 8); },
               "encoder_backward: workspace is nullptr; pass encoder_backward_workspace_bytes(1, 4)",
               "encoder_backward without workspace");
  expect_error([&] { kernels::encoder_backward<float>(nullptr, p, p + 32, p, tokens, p, 1, 4, 65535 * 128 + 1); },
               "encoder_backward: C = 8388481 exceeds", "encoder_backward with too many columns");
  expect_error([&] { kernels::encoder_backward<float>(nullptr, p, p, p, tokens, p, 1, 4, 8); },
               "encoder_backward: dwte and dwpe are the same buffer", "encoder_backward with dwte == dwpe");
  expect_error([&] { static_cast<void>(kernels::encoder_backward_workspace_bytes(3, -1)); },
               "encoder_backward_workspace_bytes: B = 3, T_len = -1", "encoder_backward_workspace_bytes with T < 0");
  // No position gradient (dwpe null) is valid: a vocabulary-parallel embedding has it on
  // one rank only. These fail on a later argument, so the null dwpe passed the checks.
  expect_error(
      [&] {
        kernels::encoder_backward<float>(nullptr, p, nullptr, p, tokens, nullptr, 1, 4, 8, {16, 16});
      },
      "encoder_backward: workspace is nullptr", "encoder_backward without dwpe or workspace");
  expect_error([&] { kernels::encoder_backward<float>(nullptr, p, nullptr, p, tokens, p, 1, 4, 65535 * 128 + 1); },
               "encoder_backward: C = 8388481 exceeds", "encoder_backward without dwpe, too many columns");
  expect_error([&] { kernels::glu_forward<float>(nullptr, p, p + 1, 2, 4, math::Gate::silu); },
               "glu_forward: act overlaps pre", "glu_forward overlap");
  expect_error([&] { kernels::glu_backward<float>(nullptr, p, p + 8, p + 16, -1, 4, math::Gate::gelu); },
               "glu_backward: rows = -1, hidden = 4", "glu_backward with rows < 0");
  expect_error([&] { kernels::glu_forward<float>(nullptr, nullptr, p, 2, 4, math::Gate::silu); },
               "glu_forward: act is nullptr", "glu_forward without act");
  // Empty work launches nothing and needs no pointer.
  kernels::gelu_forward<float>(nullptr, nullptr, nullptr, 0);
  kernels::glu_forward<float>(nullptr, nullptr, nullptr, 0, 5, math::Gate::silu);
  kernels::bias_add<bf16>(nullptr, nullptr, nullptr, 0, 5);
  kernels::encoder_backward<f16>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 4, 8);
  kernels::encoder_forward<float>(nullptr, p, tokens, p, nullptr, 2, 0, 8, {16, 16});
  kernels::encoder_backward<float>(nullptr, p, nullptr, p, tokens, nullptr, 2, 0, 8, {16, 16});
  expect(kernels::encoder_backward_workspace_bytes(0, 7) == 0, "encoder_backward_workspace_bytes(0, 7) == 0");
}

// ---------------------------------------------------------------------------------------
// Device checks.

const std::int64_t kSizes[] = {1, 7, 1000003};

// GELU forward and backward, vectorized (offset 0) and scalar (offset 1 element).
template <class T>
void check_gelu(cudaStream_t stream) {
  const float rel_tol = std::is_same_v<T, float> ? 1e-5f : 0.0f;  // 16-bit: 1 ulp (see close)
  const float abs_tol = 2e-6f;
  for (const std::int64_t n : kSizes) {
    for (const std::int64_t offset : {0, 1}) {
      std::vector<T> x = random_vector<T>(11 + n, n, 3.0);
      const float specials[] = {0.0f, -0.0f, 10.0f, -10.0f, 100.0f, -100.0f, 0.5f};
      for (std::int64_t i = 0; i < n && i < 7; ++i) x[i] = llmpar::convert<T>(specials[i]);
      const std::vector<T> dout = random_vector<T>(23 + n, n, 1.0);
      DeviceBuffer<T> dx_buf(n + 1, stream), dy_buf(n + 1, stream), ddout_buf(n + 1, stream), dgrad_buf(n + 1, stream);
      T* dx = dx_buf.data() + offset;
      T* dy = dy_buf.data() + offset;
      T* ddout = ddout_buf.data() + offset;
      T* dgrad = dgrad_buf.data() + offset;
      copy_in(dx, x, stream);
      copy_in(ddout, dout, stream);

      kernels::gelu_forward(stream, dy, dx, n);
      const std::vector<T> y = copy_out(dy, n, stream);
      std::vector<T> y_cpu(n);
      cpu::gelu_forward(y_cpu.data(), x.data(), n);
      const std::int64_t far_y = count_far(y, y_cpu, rel_tol, abs_tol, "gelu");

      kernels::gelu_backward(stream, dgrad, dx, ddout, n);
      const std::vector<T> g = copy_out(dgrad, n, stream);
      std::vector<T> g_cpu(n);
      cpu::gelu_backward(g_cpu.data(), x.data(), dout.data(), n);
      const std::int64_t far_g = count_far(g, g_cpu, rel_tol, abs_tol, "gelu'");

      // In place: out == x, dx == dout give the same bits as out of place.
      copy_in(dy, x, stream);
      kernels::gelu_forward(stream, dy, dy, n);
      const bool same_y = same_bits(copy_out(dy, n, stream), y);
      copy_in(dgrad, dout, stream);
      kernels::gelu_backward(stream, dgrad, dx, dgrad, n);
      const bool same_g = same_bits(copy_out(dgrad, n, stream), g);

      report(far_y == 0 && far_g == 0 && same_y && same_g,
             std::string("gelu fwd/bwd ") + type_name<T>() + " n=" + std::to_string(n) +
                 (offset ? " (scalar path)" : " (vector path)") + ": " + std::to_string(far_y) + " + " +
                 std::to_string(far_g) + " beyond tolerance, in place " + (same_y && same_g ? "identical" : "DIFFERS"));
    }
  }
}

// add, add in place (out == a), add_inplace, scale_inplace: the CPU's bits.
template <class T>
void check_add(cudaStream_t stream) {
  for (const std::int64_t n : kSizes) {
    for (const std::int64_t offset : {0, 1}) {
      const std::vector<T> a = random_vector<T>(31 + n, n, 2.0);
      const std::vector<T> b = random_vector<T>(37 + n, n, 2.0);
      DeviceBuffer<T> da_buf(n + 1, stream), db_buf(n + 1, stream), dc_buf(n + 1, stream);
      T* da = da_buf.data() + offset;
      T* db = db_buf.data() + offset;
      T* dc = dc_buf.data() + offset;
      copy_in(da, a, stream);
      copy_in(db, b, stream);
      std::vector<T> sum(n);
      cpu::add(sum.data(), a.data(), b.data(), n);

      kernels::add(stream, dc, da, db, n);
      const std::int64_t bad_add = count_different_bits(copy_out(dc, n, stream), sum, "add");
      copy_in(dc, a, stream);
      kernels::add(stream, dc, dc, db, n);  // out == a
      const std::int64_t bad_alias = count_different_bits(copy_out(dc, n, stream), sum, "add (out == a)");
      std::vector<T> acc = a;
      cpu::add_inplace(acc.data(), b.data(), n);
      kernels::add_inplace(stream, da, db, n);
      const std::int64_t bad_inplace = count_different_bits(copy_out(da, n, stream), acc, "add_inplace");
      cpu::scale_inplace(acc.data(), 0.37f, n);
      kernels::scale_inplace(stream, da, 0.37f, n);
      const std::int64_t bad_scale = count_different_bits(copy_out(da, n, stream), acc, "scale_inplace");
      const std::int64_t bad = bad_add + bad_alias + bad_inplace + bad_scale;
      report(bad == 0, std::string("add / add_inplace / scale_inplace ") + type_name<T>() + " n=" + std::to_string(n) +
                           (offset ? " (scalar path)" : " (vector path)") + ": bitwise " +
                           (bad == 0 ? "equal to cpu" : "DIFFERENT"));
    }
  }
}

// convert: llmpar::convert's bits, including inf, NaN, f16 overflow and subnormals.
template <class To, class From>
void check_convert(cudaStream_t stream) {
  for (const std::int64_t n : kSizes) {
    for (const std::int64_t offset : {0, 1}) {
      std::vector<From> in = random_vector<From>(41 + n, n, 1000.0);
      const float specials[] = {std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::quiet_NaN(),
                                70000.0f,
                                1e-6f,
                                -3e-8f,
                                65519.0f};
      for (std::int64_t i = 0; i < n && i < 7; ++i) in[i] = llmpar::convert<From>(specials[i]);
      DeviceBuffer<From> din_buf(n + 1, stream);
      DeviceBuffer<To> dout_buf(n + 1, stream);
      copy_in(din_buf.data() + offset, in, stream);
      kernels::convert(stream, dout_buf.data() + offset, din_buf.data() + offset, n);
      std::vector<To> want(n);
      for (std::int64_t i = 0; i < n; ++i) want[i] = llmpar::convert<To>(in[i]);
      const std::vector<To> got = copy_out(dout_buf.data() + offset, n, stream);
      report(same_bits(got, want), std::string("convert ") + type_name<From>() + " -> " + type_name<To>() +
                                       " n=" + std::to_string(n) + (offset ? " (scalar path)" : " (vector path)") +
                                       ": bitwise " + (same_bits(got, want) ? "equal to host" : "DIFFERENT"));
    }
  }
}

// bias_add: the CPU's add, row by row, bit for bit.
template <class T>
void check_bias_add(cudaStream_t stream) {
  for (const std::int64_t rows : {1, 5, 1027}) {
    for (const std::int64_t n : {1, 7, 771, 768}) {
      const std::vector<T> y = random_vector<T>(51 + rows * n, rows * n, 1.0);
      const std::vector<T> bias = random_vector<T>(53 + n, n, 1.0);
      DeviceBuffer<T> dy(rows * n, stream), dbias(n, stream);
      dy.upload(y);
      dbias.upload(bias);
      kernels::bias_add(stream, dy.data(), dbias.data(), rows, n);
      std::vector<T> want = y;
      for (std::int64_t r = 0; r < rows; ++r) cpu::add(want.data() + r * n, want.data() + r * n, bias.data(), n);
      const std::int64_t bad = count_different_bits(copy_out(dy.data(), rows * n, stream), want, "bias_add");
      report(bad == 0, std::string("bias_add ") + type_name<T>() + " rows=" + std::to_string(rows) +
                           " n=" + std::to_string(n) + ": bitwise " + (bad == 0 ? "equal to cpu" : "DIFFERENT"));
    }
  }
}

// bias_backward: the CPU's float column sums added to the f32 dbias, within 1e-5 of each
// column's sum of magnitudes (different grouping); bitwise run to run.
template <class T>
void check_bias_backward(cudaStream_t stream) {
  for (const std::int64_t rows : {1, 5, 1027}) {
    for (const std::int64_t n : {1, 7, 771}) {
      const std::vector<T> dout = random_vector<T>(61 + rows * n, rows * n, 1.0);
      const std::vector<float> dbias0 = random_vector<float>(67 + n, n, 1.0);  // f32 main grads
      DeviceBuffer<T> ddout(rows * n, stream);
      DeviceBuffer<float> ddbias(n, stream);
      DeviceBuffer<float> workspace(kernels::bias_backward_workspace(rows, n), stream);
      ddout.upload(dout);
      ddbias.upload(dbias0);
      kernels::bias_backward(stream, ddbias.data(), ddout.data(), workspace.data(), rows, n);
      const std::vector<float> got = copy_out(ddbias.data(), n, stream);
      ddbias.upload(dbias0);
      kernels::bias_backward(stream, ddbias.data(), ddout.data(), workspace.data(), rows, n);
      const bool deterministic = same_bits(copy_out(ddbias.data(), n, stream), got);

      // Reference: cpu::bias_backward on the same dout into the same f32 dbias.
      std::vector<float> want = dbias0, magnitude(n, 0.0f);
      cpu::bias_backward(want.data(), dout.data(), rows, n);
      for (std::int64_t i = 0; i < rows * n; ++i) magnitude[i % n] += std::fabs(to_f(dout[i]));
      std::int64_t bad = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        if (!close(got[j], want[j], 0.0f, 1e-5f * (magnitude[j] + std::fabs(dbias0[j]))) && ++bad <= 3)
          std::fprintf(stderr, "  dbias[%lld]: device %.9g, cpu %.9g\n", static_cast<long long>(j), got[j], want[j]);
      }
      report(bad == 0 && deterministic, std::string("bias_backward ") + type_name<T>() +
                                            " rows=" + std::to_string(rows) + " n=" + std::to_string(n) + ": " +
                                            std::to_string(bad) + " beyond tolerance, run to run " +
                                            (deterministic ? "bitwise identical" : "DIFFERENT"));
    }
  }
}

std::vector<std::int32_t> random_tokens(std::uint64_t seed, std::int64_t count, std::int64_t vocab) {
  const llmpar::rng::Stream stream(seed);
  std::vector<std::int32_t> tokens(count);
  for (std::int64_t i = 0; i < count; ++i)
    tokens[i] = static_cast<std::int32_t>(stream.bits(static_cast<std::uint64_t>(i))[0] % vocab);
  return tokens;
}

struct EncoderShape {
  std::int64_t B, T, C, V;
};
const EncoderShape kEncoderShapes[] = {{1, 1, 1, 3}, {2, 5, 7, 11}, {3, 64, 771, 50}, {8, 128, 768, 1000}};

// encoder_forward: the CPU's bits.
template <class T>
void check_encoder_forward(cudaStream_t stream) {
  for (const EncoderShape& s : kEncoderShapes) {
    const std::vector<std::int32_t> tokens = random_tokens(71 + s.C, s.B * s.T, s.V);
    const std::vector<T> wte = random_vector<T>(73 + s.C, s.V * s.C, 0.1);
    const std::vector<T> wpe = random_vector<T>(79 + s.C, s.T * s.C, 0.1);
    DeviceBuffer<std::int32_t> dtokens(tokens.size(), stream);
    DeviceBuffer<T> dwte(wte.size(), stream), dwpe(wpe.size(), stream), dout(s.B * s.T * s.C, stream);
    dtokens.upload(tokens);
    dwte.upload(wte);
    dwpe.upload(wpe);
    kernels::encoder_forward(stream, dout.data(), dtokens.data(), dwte.data(), dwpe.data(), s.B, s.T, s.C);
    std::vector<T> want(s.B * s.T * s.C);
    cpu::encoder_forward(want.data(), tokens.data(), wte.data(), wpe.data(), s.B, s.T, s.C);
    const std::int64_t bad = count_different_bits(copy_out(dout.data(), s.B * s.T * s.C, stream), want, "encoder");
    report(bad == 0, std::string("encoder_forward ") + type_name<T>() + " B=" + std::to_string(s.B) +
                         " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) + ": bitwise " +
                         (bad == 0 ? "equal to cpu" : "DIFFERENT"));
  }
}

// encoder_backward: the CPU's bits (same order, same f32 rounding), for repeated tokens too.
template <class T>
void check_encoder_backward(cudaStream_t stream) {
  enum class Tokens { all_equal, vocab_of_5, random };
  for (const EncoderShape& s : kEncoderShapes) {
    for (const Tokens pattern : {Tokens::all_equal, Tokens::vocab_of_5, Tokens::random}) {
      std::vector<std::int32_t> tokens = random_tokens(83 + s.C, s.B * s.T, std::min<std::int64_t>(s.V, 5));
      if (pattern == Tokens::all_equal) tokens.assign(tokens.size(), static_cast<std::int32_t>(s.V - 1));
      if (pattern == Tokens::random) tokens = random_tokens(89 + s.C, s.B * s.T, s.V);
      const char* pattern_name = pattern == Tokens::all_equal    ? "all tokens equal"
                                 : pattern == Tokens::vocab_of_5 ? "vocab of 5"
                                                                 : "random";
      const std::vector<T> grad = random_vector<T>(97 + s.C, s.B * s.T * s.C, 1.0);
      const std::vector<float> dwte0 = random_vector<float>(101 + s.C, s.V * s.C, 1.0);  // f32 main grads
      const std::vector<float> dwpe0 = random_vector<float>(103 + s.C, s.T * s.C, 1.0);
      DeviceBuffer<std::int32_t> dtokens(tokens.size(), stream);
      DeviceBuffer<T> dgrad(grad.size(), stream);
      DeviceBuffer<float> ddwte(dwte0.size(), stream), ddwpe(dwpe0.size(), stream);
      DeviceBuffer<std::byte> workspace(static_cast<std::size_t>(kernels::encoder_backward_workspace_bytes(s.B, s.T)),
                                        stream);
      dtokens.upload(tokens);
      dgrad.upload(grad);

      std::vector<float> runs[2][2];  // [run][dwte, dwpe]
      for (auto& run : runs) {
        ddwte.upload(dwte0);
        ddwpe.upload(dwpe0);
        kernels::encoder_backward(stream, ddwte.data(), ddwpe.data(), dgrad.data(), dtokens.data(), workspace.data(),
                                  s.B, s.T, s.C);
        run[0] = copy_out(ddwte.data(), s.V * s.C, stream);
        run[1] = copy_out(ddwpe.data(), s.T * s.C, stream);
      }
      std::vector<float> dwte = dwte0, dwpe = dwpe0;
      cpu::encoder_backward(dwte.data(), dwpe.data(), grad.data(), tokens.data(), s.B, s.T, s.C);
      const std::int64_t bad =
          count_different_bits(runs[0][0], dwte, "dwte") + count_different_bits(runs[0][1], dwpe, "dwpe");
      const bool deterministic = same_bits(runs[0][0], runs[1][0]) && same_bits(runs[0][1], runs[1][1]);
      report(bad == 0 && deterministic, std::string("encoder_backward ") + type_name<T>() +
                                            " B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                                            " C=" + std::to_string(s.C) + " " + pattern_name + ": bitwise " +
                                            (bad == 0 ? "equal to cpu" : "DIFFERENT") + ", run to run " +
                                            (deterministic ? "identical" : "DIFFERENT"));
    }
  }
}

// Vocabulary parallel: a table of kSliceVocab rows split into kSlices slices of
// kSliceRows, as the ranks of a tensor-parallel group hold it.
constexpr std::int64_t kSlices = 4;
constexpr std::int64_t kSliceRows = 16;
constexpr std::int64_t kSliceVocab = kSlices * kSliceRows;
// C = 7 and 771 run encoder_forward's scalar path, 768 its vectorized one.
const EncoderShape kSliceShapes[] = {{2, 5, 7, kSliceVocab}, {3, 64, 771, kSliceVocab}, {8, 128, 768, kSliceVocab}};

// Slice k: rows [16 k, 16 k + 16) of the table.
llmpar::RowSlice slice_of(std::int64_t k) { return {k * kSliceRows, kSliceRows}; }

// Tokens in [0, 64) for the sliced checks: the even positions cycle through one token
// per slice, so a slice's token repeats every 8 positions (within a sequence and across
// the batch, for the larger shapes); the first odd positions are the rows on either side
// of each slice boundary, where an off-by-one in the slice test would show; the rest
// are random.
std::vector<std::int32_t> slice_tokens(std::uint64_t seed, std::int64_t count) {
  std::vector<std::int32_t> tokens = random_tokens(seed, count, kSliceVocab);
  const std::int32_t repeated[] = {3, 17, 40, 63};
  const std::int32_t boundaries[] = {15, 16, 31, 32, 47, 48, 0};
  for (std::int64_t i = 0; i < count; i += 2) tokens[i] = repeated[(i / 2) % 4];
  for (std::int64_t j = 0; j < std::ssize(boundaries) && 2 * j + 1 < count; ++j) tokens[2 * j + 1] = boundaries[j];
  return tokens;
}

// encoder_forward with a row slice: each slice's output, with and without wpe, is the
// CPU's bits; and the slices' outputs summed in slice order (rounding to T after each
// addition, as a reduction over the ranks does) with wpe on slice 0 only are the unsplit
// output's bits. The sum is exact because a row has one nonzero token term (from the
// slice holding its token) and one position term: at most one addition is not of a zero.
template <class T>
void check_encoder_forward_slices(cudaStream_t stream) {
  for (const EncoderShape& s : kSliceShapes) {
    const std::int64_t n = s.B * s.T * s.C;
    const std::vector<std::int32_t> tokens = slice_tokens(107 + s.C, s.B * s.T);
    const std::vector<T> wte = random_vector<T>(109 + s.C, s.V * s.C, 0.1);  // (V, C), the whole table
    const std::vector<T> wpe = random_vector<T>(113 + s.C, s.T * s.C, 0.1);
    DeviceBuffer<std::int32_t> dtokens(tokens.size(), stream);
    DeviceBuffer<T> dwte(wte.size(), stream), dwpe(wpe.size(), stream), dout(n, stream);
    dtokens.upload(tokens);
    dwte.upload(wte);
    dwpe.upload(wpe);
    kernels::encoder_forward(stream, dout.data(), dtokens.data(), dwte.data(), dwpe.data(), s.B, s.T, s.C);
    const std::vector<T> whole = copy_out(dout.data(), n, stream);  // (B, T, C), unsplit
    std::vector<T> whole_cpu(n);
    cpu::encoder_forward(whole_cpu.data(), tokens.data(), wte.data(), wpe.data(), s.B, s.T, s.C);
    std::int64_t bad = count_different_bits(whole, whole_cpu, "encoder (unsplit)");

    std::vector<T> sum;  // (B, T, C): slice 0 with wpe + slices 1..3 without
    for (std::int64_t k = 0; k < kSlices; ++k) {
      const llmpar::RowSlice slice = slice_of(k);
      // The slice's rows alone, (16, C), as the rank holding them has them.
      const std::vector<T> part(wte.begin() + slice.first * s.C, wte.begin() + (slice.first + slice.count) * s.C);
      DeviceBuffer<T> dpart(part.size(), stream);
      dpart.upload(part);
      for (const bool with_wpe : {false, true}) {
        // All bytes 0xFF (NaN in every type) first: a row the kernel should write as
        // zeros (token outside the slice, no wpe) but skips shows.
        LLMPAR_CHECK_CUDA(cudaMemsetAsync(dout.data(), 0xFF, dout.bytes(), stream));
        kernels::encoder_forward(stream, dout.data(), dtokens.data(), dpart.data(), with_wpe ? dwpe.data() : nullptr,
                                 s.B, s.T, s.C, slice);
        const std::vector<T> got = copy_out(dout.data(), n, stream);
        std::vector<T> want(n);
        cpu::encoder_forward(want.data(), tokens.data(), part.data(), with_wpe ? wpe.data() : nullptr, s.B, s.T, s.C,
                             slice);
        bad += count_different_bits(got, want, with_wpe ? "encoder slice (wpe)" : "encoder slice (no wpe)");
        if (with_wpe != (k == 0)) continue;  // wpe is added on slice 0 only
        if (sum.empty())
          sum = got;
        else
          cpu::add_inplace(sum.data(), got.data(), n);
      }
    }
    const std::int64_t bad_sum = count_different_bits(sum, whole, "sum of slices");
    report(bad == 0 && bad_sum == 0, std::string("encoder_forward ") + type_name<T>() + " B=" + std::to_string(s.B) +
                                         " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
                                         " in 4 slices of 16 rows, with and without wpe: bitwise " +
                                         (bad == 0 ? "equal to cpu" : "DIFFERENT") + ", sum of slices " +
                                         (bad_sum == 0 ? "equal to unsplit" : "DIFFERENT"));
  }
}

// encoder_backward with a row slice, with and without dwpe: the f32 dwte (the slice's
// rows) and dwpe are the CPU's bits, and the other slices' rows of the table keep their
// values.
// dwte and dwpe start from nonzero values, so accumulation (+=) is checked, not assignment.
template <class T>
void check_encoder_backward_slices(cudaStream_t stream) {
  for (const EncoderShape& s : kSliceShapes) {
    const std::vector<std::int32_t> tokens = slice_tokens(127 + s.C, s.B * s.T);
    const std::vector<T> grad = random_vector<T>(131 + s.C, s.B * s.T * s.C, 1.0);
    const std::vector<float> dwte0 = random_vector<float>(137 + s.C, s.V * s.C, 1.0);  // (V, C), the whole table
    const std::vector<float> dwpe0 = random_vector<float>(139 + s.C, s.T * s.C, 1.0);
    DeviceBuffer<std::int32_t> dtokens(tokens.size(), stream);
    DeviceBuffer<T> dgrad(grad.size(), stream);
    DeviceBuffer<float> ddwte(dwte0.size(), stream), ddwpe(dwpe0.size(), stream);
    DeviceBuffer<std::byte> workspace(static_cast<std::size_t>(kernels::encoder_backward_workspace_bytes(s.B, s.T)),
                                      stream);
    dtokens.upload(tokens);
    dgrad.upload(grad);

    std::int64_t bad = 0, touched = 0;
    for (std::int64_t k = 0; k < kSlices; ++k) {
      const llmpar::RowSlice slice = slice_of(k);
      const std::int64_t offset = slice.first * s.C;  // the slice's first element in the table
      for (const bool with_dwpe : {false, true}) {
        ddwte.upload(dwte0);
        ddwpe.upload(dwpe0);
        // The kernel gets the slice's rows of a whole table: a token outside the slice
        // that it failed to skip would write into another slice's rows, which must stay.
        kernels::encoder_backward(stream, ddwte.data() + offset, with_dwpe ? ddwpe.data() : nullptr, dgrad.data(),
                                  dtokens.data(), workspace.data(), s.B, s.T, s.C, slice);
        const std::vector<float> got_wte = copy_out(ddwte.data(), s.V * s.C, stream);
        const std::vector<float> got_wpe = copy_out(ddwpe.data(), s.T * s.C, stream);
        std::vector<float> dwte = dwte0, dwpe = dwpe0;
        cpu::encoder_backward(dwte.data() + offset, with_dwpe ? dwpe.data() : nullptr, grad.data(), tokens.data(), s.B,
                              s.T, s.C, slice);
        bad += count_different_bits(got_wte, dwte, with_dwpe ? "dwte slice (dwpe)" : "dwte slice (no dwpe)") +
               count_different_bits(got_wpe, dwpe, with_dwpe ? "dwpe slice" : "dwpe untouched");
        // Not through the CPU kernel: outside the slice the table is as it started.
        for (std::int64_t i = 0; i < s.V * s.C; ++i)
          if (!slice.holds(i / s.C) && ordered(got_wte[i]) != ordered(dwte0[i])) ++touched;
      }
    }
    report(bad == 0 && touched == 0, std::string("encoder_backward ") + type_name<T>() + " B=" + std::to_string(s.B) +
                                         " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
                                         " in 4 slices of 16 rows, with and without dwpe: bitwise " +
                                         (bad == 0 ? "equal to cpu" : "DIFFERENT") + ", other slices' rows " +
                                         (touched == 0 ? "untouched" : std::to_string(touched) + " elements CHANGED"));
  }
}

// The gated units (SwiGLU, GeGLU), forward and backward, against backend/cpu/gelu.hpp's
// glu kernels: the same tolerances as GELU (the same expf and FMA difference).
template <class T>
void check_glu(cudaStream_t stream) {
  const float rel_tol = std::is_same_v<T, float> ? 1e-5f : 0.0f;
  const float abs_tol = 2e-6f;
  for (const std::int64_t rows : {1, 5, 1027})
    for (const std::int64_t hidden : {1, 7, 771})
      for (const math::Gate gate : {math::Gate::silu, math::Gate::gelu}) {
        const std::int64_t n = rows * hidden;
        const std::vector<T> pre = random_vector<T>(31 + n, 2 * n, 3.0);
        const std::vector<T> dact = random_vector<T>(37 + n, n, 1.0);
        DeviceBuffer<T> d_pre(2 * n, stream), d_dact(n, stream), d_act(n, stream), d_dpre(2 * n, stream);
        copy_in(d_pre.data(), pre, stream);
        copy_in(d_dact.data(), dact, stream);
        kernels::glu_forward(stream, d_act.data(), d_pre.data(), rows, hidden, gate);
        kernels::glu_backward(stream, d_dpre.data(), d_dact.data(), d_pre.data(), rows, hidden, gate);
        std::vector<T> act_cpu(n), dpre_cpu(2 * n);
        cpu::glu_forward(act_cpu.data(), pre.data(), rows, hidden, gate);
        cpu::glu_backward(dpre_cpu.data(), dact.data(), pre.data(), rows, hidden, gate);
        const std::int64_t far_a = count_far(copy_out(d_act.data(), n, stream), act_cpu, rel_tol, abs_tol, "glu");
        const std::int64_t far_d = count_far(copy_out(d_dpre.data(), 2 * n, stream), dpre_cpu, rel_tol, abs_tol, "glu'");
        report(far_a == 0 && far_d == 0, std::string("glu ") + (gate == math::Gate::silu ? "silu " : "gelu ") +
                                             type_name<T>() + " rows=" + std::to_string(rows) +
                                             " hidden=" + std::to_string(hidden) + ": " + std::to_string(far_a) +
                                             " + " + std::to_string(far_d) + " beyond tolerance");
      }
}

template <class T>
void check_type(cudaStream_t stream) {
  check_gelu<T>(stream);
  check_glu<T>(stream);
  check_add<T>(stream);
  check_bias_add<T>(stream);
  check_bias_backward<T>(stream);
  check_encoder_forward<T>(stream);
  check_encoder_backward<T>(stream);
  check_encoder_forward_slices<T>(stream);
  check_encoder_backward_slices<T>(stream);
}

}  // namespace

int main() {
  if (!gpu_test::run_host_checks(host_checks, "host checks")) return 1;
  if (llmpar::backend::cuda::device_count() == 0) {
    std::printf("host checks %s; skipped the device checks: no CUDA device\n", gpu_test::verdict());
    return gpu_test::skip_exit_code();
  }
  return gpu_test::run_device_checks([] {
    llmpar::backend::cuda::DeviceContext context(0);
    const cudaStream_t stream = context.compute();
    check_type<float>(stream);
    check_type<bf16>(stream);
    check_type<f16>(stream);
    check_convert<bf16, float>(stream);
    check_convert<f16, float>(stream);
    check_convert<float, bf16>(stream);
    check_convert<float, f16>(stream);
    check_convert<f16, bf16>(stream);
    check_convert<bf16, f16>(stream);
    check_convert<float, float>(stream);
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream));
  });
}
