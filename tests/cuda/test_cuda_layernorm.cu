// LayerNorm and RMSNorm on CUDA (kernels/layernorm.cuh) against the CPU kernels
// (backend/cpu/layernorm.hpp, rmsnorm.hpp, elementwise.hpp for the residual sum).
//
// For float, bf16 and f16 storage and ragged shapes (C = 1, 7, 771, 1600, and 20000, whose
// rows are longer than the registers hold), each of LayerNorm, residual LayerNorm,
// RMSNorm and residual RMSNorm is run forward and backward (dx overwritten, and dx
// accumulated into) on the same rounded inputs as the CPU kernel. The CPU backward runs
// in float on the widened inputs and dx is rounded once to the storage type, which is
// what the GPU does; dweight and dbias are f32 main grads for every storage type (the
// CPU kernel's acc_t<T>), accumulated into f32 starting values and compared in f32 with
// the float tolerance (the same f32 arithmetic on both sides, summed in different
// orders). Also: rows with a large mean (1000 + noise) against a long
// double reference, which E[x^2] - E[x]^2 in float could not pass; bitwise determinism
// run to run; and bitwise equality of the 16-byte vector path and the element path (a
// misaligned pointer). The fused residual RMSNorm of Llama's block (forward in place,
// residual += delta; backward with the residual stream's gradient added,
// residual_rmsnorm_backward) against the CPU's fused kernels, and bitwise against the
// GPU's own unfused sequence. Host-side errors are checked first, without a device.
// Exit codes: 0 pass, 1 failure, 77 no CUDA device (ctest reports that as skipped).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "gpu_test.hpp"
#include "llmpar/backend/cpu/elementwise.hpp"
#include "llmpar/backend/cpu/layernorm.hpp"
#include "llmpar/backend/cpu/rmsnorm.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/kernels/layernorm.cuh"

namespace {

using llmpar::bf16;
using llmpar::f16;
namespace cpu = llmpar::backend::cpu;
namespace kernels = llmpar::kernels;
using llmpar::backend::cuda::DeviceBuffer;
using llmpar::backend::cuda::DeviceContext;
namespace gpu_test = llmpar::gpu_test;

constexpr std::uint64_t kSeed = 20240611;
// The atol of float in the per-storage-type tolerance (gpu_test::tolerance).
constexpr double kFloatAtol = 2e-6;

using gpu_test::compare;
using gpu_test::download;
using gpu_test::dtype_name;
using gpu_test::ErrorWording;
using gpu_test::expect;
using gpu_test::ExpectError;
using gpu_test::same_bits;
using gpu_test::Tolerance;
using gpu_test::upload;

constexpr ExpectError expect_error{ErrorWording::names};

std::vector<float> random_normal(std::int64_t n, const std::string& name, double stddev = 1.0, double mean = 0.0) {
  const auto stream = llmpar::rng::Stream::named(kSeed, name);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(mean + stddev * stream.normal(static_cast<std::uint64_t>(i)));
  return v;
}

template <class T>
std::vector<T> round_to(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = llmpar::convert<T>(v[i]);
  return out;
}

template <class T>
std::vector<float> widen(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = llmpar::convert<float>(v[i]);
  return out;
}

// The same values at an address 2 bytes past a 16-byte boundary: forces the element path.
template <class T>
struct Misaligned {
  DeviceBuffer<T> buffer;
  Misaligned(const std::vector<T>& host, cudaStream_t stream) : buffer(host.size() + 1, stream) {
    LLMPAR_CHECK_CUDA(
        cudaMemcpyAsync(buffer.data() + 1, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  T* get() { return buffer.data() + 1; }
};

// ---------------------------------------------------------------------------------------
// Host-side errors: thrown before any CUDA call, so they are checked without a device.

void check_host_errors() {
  std::vector<float> host(64);
  float* p = host.data();
  const cudaStream_t s = nullptr;
  expect_error([&] { kernels::layernorm_forward<float>(s, p, p, p, p, p, p, 1, 0); },
               "layernorm_forward: rows = 1, C = 0", "layernorm_forward C = 0");
  expect_error([&] { kernels::layernorm_forward<float>(s, p, p, p, p, p, p, -3, 4); }, "rows = -3",
               "layernorm_forward rows < 0");
  expect_error([&] { kernels::layernorm_forward<float>(s, p, p, p, p, p, p, 2, 4, -1.0f); }, "eps = -1",
               "layernorm_forward eps < 0");
  expect_error([&] { kernels::layernorm_forward<float>(s, p, p, p, p, p, p, 2, 4, std::nanf("")); }, "eps = nan",
               "layernorm_forward eps NaN");
  expect_error([&] { kernels::layernorm_forward<float>(s, p, p, p, p, nullptr, p, 2, 4); }, "weight is null",
               "layernorm_forward null weight");
  expect_error([&] { kernels::layernorm_forward<float>(s, p, p, p, p, p, p, 1, (std::int64_t{1} << 30) + 1); },
               "columns a row may have", "layernorm_forward C too large");
  expect_error([&] { kernels::residual_layernorm_forward<float>(s, p, p, p, p, p, p, p, p, 2, 4); },
               "sum and out are the same buffer", "residual_layernorm_forward sum == out");
  expect_error([&] { kernels::residual_layernorm_forward<float>(s, p, p + 8, p, p, nullptr, p, p, p, 2, 4); },
               "a is null", "residual_layernorm_forward null a");
  expect_error([&] { kernels::layernorm_backward<float>(s, p, p, p, p, p, p, p, p, nullptr, 2, 4); },
               "workspace (layernorm_backward_workspace", "layernorm_backward null workspace");
  expect_error([&] { kernels::layernorm_backward<float>(s, p, p, p, p, p, p, nullptr, p, p, 2, 4); }, "mean (saved",
               "layernorm_backward null mean");
  expect_error([&] { kernels::layernorm_backward<float>(s, p, p, p, p, p, p, p, p, p, 2, 0); }, "C = 0",
               "layernorm_backward C = 0");
  expect_error([&] { kernels::rmsnorm_forward<bf16>(s, nullptr, p, nullptr, nullptr, 1, 0); },
               "rmsnorm_forward: rows = 1, C = 0", "rmsnorm_forward C = 0");
  expect_error([&] { kernels::rmsnorm_forward<float>(s, p, p, p, p, 1, 4, -2.0f); }, "eps = -2",
               "rmsnorm_forward eps < 0");
  expect_error([&] { kernels::residual_rmsnorm_forward<float>(s, p, p, p, p, p, p, 1, 4); },
               "sum and out are the same buffer", "residual_rmsnorm_forward sum == out");
  expect_error([&] { kernels::rmsnorm_backward<float>(s, p, p, p, p, p, nullptr, p, 1, 4); }, "rstd (saved",
               "rmsnorm_backward null rstd");
  expect_error([&] { kernels::rmsnorm_backward<f16>(s, nullptr, nullptr, nullptr, nullptr, nullptr, p, p, -1, 4); },
               "rmsnorm_backward: rows = -1", "rmsnorm_backward rows < 0");
  expect_error([&] { static_cast<void>(kernels::layernorm_backward_workspace(4, 0)); },
               "layernorm_backward_workspace: rows = 4, C = 0", "layernorm_backward_workspace C = 0");
  expect_error([&] { kernels::residual_rmsnorm_backward<float>(s, p, p, p, nullptr, p, p, p, p, 1, 4); },
               "dresidual is null", "residual_rmsnorm_backward null dresidual");
  expect_error(
      [&] {
        kernels::residual_rmsnorm_backward<bf16>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                 nullptr, 2, 0);
      },
      "residual_rmsnorm_backward: rows = 2, C = 0", "residual_rmsnorm_backward C = 0");
  expect_error([&] { static_cast<void>(kernels::rmsnorm_backward_workspace(-1, 4)); },
               "rmsnorm_backward_workspace: rows = -1", "rmsnorm_backward_workspace rows < 0");

  // Workspace sizes: a partial row (2 C for LayerNorm, C for RMSNorm) per backward block,
  // at most 256 blocks and never more than rows.
  expect(kernels::layernorm_backward_workspace(0, 768) == 0, "layernorm workspace for no rows");
  expect(kernels::layernorm_backward_workspace(10, 768) == 10 * 2 * 768, "layernorm workspace for 10 rows");
  expect(kernels::layernorm_backward_workspace(8192, 768) == 256 * 2 * 768, "layernorm workspace for 8192 rows");
  expect(kernels::rmsnorm_backward_workspace(8192, 7) == 256 * 7, "rmsnorm workspace for 8192 rows");

  // No rows is not an error and launches nothing (so it works without a device).
  try {
    kernels::layernorm_forward<float>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 4);
    kernels::residual_rmsnorm_forward<bf16>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 4);
    kernels::layernorm_backward<f16>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                     0, 4, true);
    kernels::residual_rmsnorm_backward<float>(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                              0, 4);
  } catch (const std::exception& e) {
    expect(false, std::string("rows = 0 should be a no-op: ") + e.what());
  }
}

// ---------------------------------------------------------------------------------------
// Device cases.

enum class Kind { layer, residual_layer, rms, residual_rms };

const char* name_of(Kind k) {
  switch (k) {
    case Kind::layer:
      return "layernorm";
    case Kind::residual_layer:
      return "residual_layernorm";
    case Kind::rms:
      return "rmsnorm";
    case Kind::residual_rms:
      return "residual_rmsnorm";
  }
  return "?";
}

// GPU forward of `kind`: out (rows, C), and sum (rows, C) for the residual kinds.
template <class T>
void gpu_forward(cudaStream_t stream, Kind kind, T* sum, T* out, float* mean, float* rstd, const T* a, const T* b,
                 const T* w, const T* bias, std::int64_t rows, std::int64_t C) {
  switch (kind) {
    case Kind::layer:
      kernels::layernorm_forward<T>(stream, out, mean, rstd, a, w, bias, rows, C);
      break;
    case Kind::residual_layer:
      kernels::residual_layernorm_forward<T>(stream, sum, out, mean, rstd, a, b, w, bias, rows, C);
      break;
    case Kind::rms:
      kernels::rmsnorm_forward<T>(stream, out, rstd, a, w, rows, C);
      break;
    case Kind::residual_rms:
      kernels::residual_rmsnorm_forward<T>(stream, sum, out, rstd, a, b, w, rows, C);
      break;
  }
}

template <class T>
void gpu_backward(cudaStream_t stream, bool layer, T* dx, float* dw, float* db, const T* dout, const T* x, const T* w,
                  const float* mean, const float* rstd, float* workspace, std::int64_t rows, std::int64_t C,
                  bool accumulate) {
  if (layer)
    kernels::layernorm_backward<T>(stream, dx, dw, db, dout, x, w, mean, rstd, workspace, rows, C, accumulate);
  else
    kernels::rmsnorm_backward<T>(stream, dx, dw, dout, x, w, rstd, workspace, rows, C, accumulate);
}

template <class T>
void norm_case(const DeviceContext& context, Kind kind, std::int64_t rows, std::int64_t C) {
  const cudaStream_t stream = context.compute();
  const bool layer = kind == Kind::layer || kind == Kind::residual_layer;
  const bool residual = kind == Kind::residual_layer || kind == Kind::residual_rms;
  const std::string tag =
      std::string(name_of(kind)) + " " + dtype_name<T>() + " rows=" + std::to_string(rows) + " C=" + std::to_string(C);
  const std::string seed = std::to_string(rows) + "x" + std::to_string(C);
  const std::int64_t n = rows * C;
  const Tolerance tol = gpu_test::tolerance<T>(kFloatAtol);

  const auto a = round_to<T>(random_normal(n, "a." + seed, 2.0, 0.5));
  const auto b = round_to<T>(random_normal(n, "b." + seed));
  const auto w = round_to<T>(random_normal(C, "w." + seed, 0.3, 1.0));
  const auto bias = round_to<T>(random_normal(C, "bias." + seed, 0.2));
  const auto dout = round_to<T>(random_normal(n, "dout." + seed));
  const auto dx0 = round_to<T>(random_normal(n, "dx0." + seed));
  // f32 main grads: the starting values of the accumulation need not be T-rounded.
  const std::vector<float> dw0 = random_normal(C, "dw0." + seed);
  const std::vector<float> db0 = random_normal(C, "db0." + seed);

  // CPU forward on the rounded inputs (the residual sum rounded to T first, as stored).
  std::vector<T> x = a;
  if (residual) cpu::add(x.data(), a.data(), b.data(), n);
  std::vector<T> out_cpu(n);
  std::vector<float> mean_cpu(rows), rstd_cpu(rows);
  if (layer)
    cpu::layernorm_forward(out_cpu.data(), mean_cpu.data(), rstd_cpu.data(), x.data(), w.data(), bias.data(), rows, C);
  else
    cpu::rmsnorm_forward(out_cpu.data(), rstd_cpu.data(), x.data(), w.data(), rows, C);

  // CPU backward in float on the widened values; dx rounded once at the end as the GPU does.
  const auto xf = widen(x), gf = widen(dout), wf = widen(w);
  std::vector<float> dx_f(n), dw_want = dw0, db_want = db0;
  if (layer)
    cpu::layernorm_backward(dx_f.data(), dw_want.data(), db_want.data(), gf.data(), xf.data(), wf.data(),
                            mean_cpu.data(), rstd_cpu.data(), rows, C);
  else
    cpu::rmsnorm_backward(dx_f.data(), dw_want.data(), gf.data(), xf.data(), wf.data(), rstd_cpu.data(), rows, C);
  const auto dx_want = round_to<T>(dx_f);
  std::vector<float> dx_acc_f(n);
  for (std::int64_t i = 0; i < n; ++i) dx_acc_f[i] = llmpar::convert<float>(dx0[i]) + dx_f[i];
  const auto dx_acc_want = round_to<T>(dx_acc_f);

  // GPU forward.
  auto d_a = upload(a, stream), d_b = upload(b, stream), d_w = upload(w, stream), d_bias = upload(bias, stream);
  DeviceBuffer<T> d_sum(residual ? n : 0, stream), d_out(n, stream);
  DeviceBuffer<float> d_mean(rows, stream), d_rstd(rows, stream);
  gpu_forward<T>(stream, kind, d_sum.data(), d_out.data(), d_mean.data(), d_rstd.data(), d_a.data(), d_b.data(),
                 d_w.data(), d_bias.data(), rows, C);
  const auto out_gpu = download(d_out);
  const auto rstd_gpu = download(d_rstd);
  const auto mean_gpu = download(d_mean);
  if (residual) expect(same_bits(download(d_sum), x), tag + ": sum is T(a + b), bit for bit");
  const double out_err = compare(out_gpu, out_cpu, tol, tag + " out");
  compare(rstd_gpu, rstd_cpu, {1e-5, 0.0}, tag + " rstd");
  if (layer) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const double spread = 1.0 / rstd_cpu[r];
      if (!(std::fabs(mean_gpu[r] - mean_cpu[r]) <= 1e-5 * (std::fabs(mean_cpu[r]) + spread))) {
        expect(false, tag + " mean of row " + std::to_string(r));
        break;
      }
    }
  }

  // Forward again, and through the element path: the same bits.
  {
    DeviceBuffer<T> d_sum2(residual ? n : 0, stream), d_out2(n, stream);
    DeviceBuffer<float> d_mean2(rows, stream), d_rstd2(rows, stream);
    gpu_forward<T>(stream, kind, d_sum2.data(), d_out2.data(), d_mean2.data(), d_rstd2.data(), d_a.data(), d_b.data(),
                   d_w.data(), d_bias.data(), rows, C);
    expect(same_bits(download(d_out2), out_gpu) && same_bits(download(d_rstd2), rstd_gpu),
           tag + ": forward is bitwise reproducible");
    Misaligned<T> a_odd(a, stream);
    DeviceBuffer<T> d_sum3(residual ? n : 0, stream), d_out3(n, stream);
    gpu_forward<T>(stream, kind, d_sum3.data(), d_out3.data(), nullptr, nullptr, a_odd.get(), d_b.data(), d_w.data(),
                   d_bias.data(), rows, C);
    expect(same_bits(download(d_out3), out_gpu), tag + ": element path (misaligned x) = vector path, bitwise");
  }

  // GPU backward, from the GPU's own statistics on the stored x (the sum for residual).
  auto d_x = upload(x, stream), d_dout = upload(dout, stream);
  const std::int64_t ws =
      layer ? kernels::layernorm_backward_workspace(rows, C) : kernels::rmsnorm_backward_workspace(rows, C);
  DeviceBuffer<float> d_ws(ws, stream);
  // dx (T) and the f32 dweight, dbias of one backward from dx0, dw0, db0.
  struct Grads {
    std::vector<T> dx;
    std::vector<float> dw, db;
    bool operator==(const Grads& o) const { return same_bits(dx, o.dx) && same_bits(dw, o.dw) && same_bits(db, o.db); }
  };
  const auto backward = [&](bool accumulate, const T* dout_ptr) {
    auto d_dx = upload(dx0, stream);
    auto d_dw = upload(dw0, stream), d_db = upload(db0, stream);
    gpu_backward<T>(stream, layer, d_dx.data(), d_dw.data(), d_db.data(), dout_ptr, d_x.data(), d_w.data(),
                    d_mean.data(), d_rstd.data(), d_ws.data(), rows, C, accumulate);
    return Grads{download(d_dx), download(d_dw), download(d_db)};
  };
  const Tolerance grad_tol = gpu_test::tolerance<float>(kFloatAtol);  // f32 main grads, whatever T
  const Grads over = backward(false, d_dout.data());
  const double dx_err = compare(over.dx, dx_want, tol, tag + " dx");
  const double dw_err = compare(over.dw, dw_want, grad_tol, tag + " dweight (f32)");
  if (layer) compare(over.db, db_want, grad_tol, tag + " dbias (f32)");
  if (!layer) expect(same_bits(over.db, db0), tag + ": rmsnorm leaves dbias alone");
  const Grads acc = backward(true, d_dout.data());
  const double acc_err = compare(acc.dx, dx_acc_want, tol, tag + " dx accumulated");
  expect(same_bits(acc.dw, over.dw) && same_bits(acc.db, over.db),
         tag + ": accumulate_dx does not change dweight/dbias");
  const Grads again = backward(false, d_dout.data());
  expect(again == over, tag + ": backward (dx, dweight, dbias) is bitwise reproducible");
  Misaligned<T> dout_odd(dout, stream);
  const Grads odd = backward(false, dout_odd.get());
  expect(odd == over, tag + ": backward element path (misaligned dout) = vector path, bitwise");

  std::printf("%-48s out %.2e  dx %.2e  dx+= %.2e  dweight %.2e\n", tag.c_str(), out_err, dx_err, acc_err, dw_err);
}

// The fused residual RMSNorm as backend::Cuda runs it for nn::RMSNorm's forward_residual
// and backward_residual: the sum written over the residual itself, and dx = backward
// + dresidual. Against the CPU's fused kernels (backend/cpu/rmsnorm.hpp, which
// tests/test_kernels_rmsnorm.cpp checks bitwise against the CPU's unfused sequence), and
// bitwise against the GPU's unfused sequence: rmsnorm_backward, then the add.
template <class T>
void fused_residual_rms_case(const DeviceContext& context, std::int64_t rows, std::int64_t C) {
  const cudaStream_t stream = context.compute();
  const std::string tag = std::string("fused residual rmsnorm ") + dtype_name<T>() + " rows=" + std::to_string(rows) +
                          " C=" + std::to_string(C);
  const std::string seed = "fused." + std::to_string(rows) + "x" + std::to_string(C);
  const std::int64_t n = rows * C;
  const Tolerance tol = gpu_test::tolerance<T>(kFloatAtol);
  const Tolerance grad_tol = gpu_test::tolerance<float>(kFloatAtol);

  const auto residual0 = round_to<T>(random_normal(n, "residual." + seed, 2.0, 0.5));
  const auto delta = round_to<T>(random_normal(n, "delta." + seed));
  const auto w = round_to<T>(random_normal(C, "w." + seed, 0.3, 1.0));
  const auto dout = round_to<T>(random_normal(n, "dout." + seed));
  const auto dresidual = round_to<T>(random_normal(n, "dresidual." + seed));
  const std::vector<float> dw0 = random_normal(C, "dw0." + seed);

  // The CPU's fused kernels on the same storage type.
  std::vector<T> residual_cpu = residual0, out_cpu(n), dx_cpu(n);
  std::vector<float> rstd_cpu(rows), dw_cpu = dw0;
  cpu::residual_rmsnorm_forward(out_cpu.data(), rstd_cpu.data(), residual_cpu.data(), delta.data(), w.data(), rows, C);
  cpu::residual_rmsnorm_backward(dx_cpu.data(), dw_cpu.data(), dout.data(), dresidual.data(), residual_cpu.data(),
                                 w.data(), rstd_cpu.data(), rows, C);

  // GPU forward in place (sum = a = residual), as backend::Cuda::residual_rmsnorm_forward.
  auto d_residual = upload(residual0, stream), d_delta = upload(delta, stream), d_w = upload(w, stream);
  DeviceBuffer<T> d_out(n, stream);
  DeviceBuffer<float> d_rstd(rows, stream);
  kernels::residual_rmsnorm_forward<T>(stream, d_residual.data(), d_out.data(), d_rstd.data(), d_residual.data(),
                                       d_delta.data(), d_w.data(), rows, C);
  const auto residual_gpu = download(d_residual);
  expect(same_bits(residual_gpu, residual_cpu), tag + ": residual += delta in place is the CPU's T(a + b), bitwise");
  const double out_err = compare(download(d_out), out_cpu, tol, tag + " out vs CPU fused");
  compare(download(d_rstd), rstd_cpu, {1e-5, 0.0}, tag + " rstd vs CPU fused");

  // GPU backward, fused and unfused, from the GPU's statistics.
  auto d_dout = upload(dout, stream), d_dresidual = upload(dresidual, stream);
  DeviceBuffer<float> d_ws(kernels::rmsnorm_backward_workspace(rows, C), stream);
  struct Grads {
    std::vector<T> dx;
    std::vector<float> dw;
  };
  // dx_init: dx's contents before the call; dres: the residual gradient's buffer, or
  // null for the unfused rmsnorm_backward; dres_is_dx: pass dx itself (its contents dx_init).
  const auto backward = [&](const std::vector<T>& dx_init, const T* dres, bool dres_is_dx) {
    auto d_dx = upload(dx_init, stream);
    auto d_dw = upload(dw0, stream);
    if (dres == nullptr && !dres_is_dx)
      kernels::rmsnorm_backward<T>(stream, d_dx.data(), d_dw.data(), d_dout.data(), d_residual.data(), d_w.data(),
                                   d_rstd.data(), d_ws.data(), rows, C);
    else
      kernels::residual_rmsnorm_backward<T>(stream, d_dx.data(), d_dw.data(), d_dout.data(),
                                            dres_is_dx ? d_dx.data() : dres, d_residual.data(), d_w.data(),
                                            d_rstd.data(), d_ws.data(), rows, C);
    return Grads{download(d_dx), download(d_dw)};
  };
  const std::vector<T> garbage = round_to<T>(random_normal(n, "garbage." + seed));  // overwritten
  const Grads fused = backward(garbage, d_dresidual.data(), false);
  Grads unfused = backward(garbage, nullptr, false);
  cpu::add_inplace(unfused.dx.data(), dresidual.data(), n);  // the add kernel's T(a + b), on the host
  expect(same_bits(fused.dx, unfused.dx), tag + ": fused dx = rmsnorm_backward then add, bitwise");
  expect(same_bits(fused.dw, unfused.dw), tag + ": fused dweight = rmsnorm_backward's, bitwise");
  const double dx_err = compare(fused.dx, dx_cpu, tol, tag + " dx vs CPU fused");
  const double dw_err = compare(fused.dw, dw_cpu, grad_tol, tag + " dweight (f32) vs CPU fused");
  const Grads in_place = backward(dresidual, nullptr, true);
  expect(same_bits(in_place.dx, fused.dx) && same_bits(in_place.dw, fused.dw),
         tag + ": dresidual = dx (added in place) gives the same bits");
  Misaligned<T> dresidual_odd(dresidual, stream);
  const Grads odd = backward(garbage, dresidual_odd.get(), false);
  expect(same_bits(odd.dx, fused.dx) && same_bits(odd.dw, fused.dw),
         tag + ": element path (misaligned dresidual) = vector path, bitwise");

  std::printf("%-48s out %.2e  dx %.2e  dweight %.2e\n", tag.c_str(), out_err, dx_err, dw_err);
}

// Rows of 1000 + noise: the variance is 1e-2 against a mean square of 1e6, which
// E[x^2] - E[x]^2 in float cannot resolve; Welford can.
void large_mean_case(const DeviceContext& context, std::int64_t rows, std::int64_t C) {
  const cudaStream_t stream = context.compute();
  const std::string tag = "layernorm f32 large mean rows=" + std::to_string(rows) + " C=" + std::to_string(C);
  const auto x = random_normal(rows * C, "offset.x." + std::to_string(C), 0.1, 1000.0);
  const std::vector<float> w(C, 1.0f), bias(C, 0.0f);
  auto d_x = upload(x, stream), d_w = upload(w, stream), d_b = upload(bias, stream);
  DeviceBuffer<float> d_out(rows * C, stream), d_mean(rows, stream), d_rstd(rows, stream);
  kernels::layernorm_forward<float>(stream, d_out.data(), d_mean.data(), d_rstd.data(), d_x.data(), d_w.data(),
                                    d_b.data(), rows, C);
  const auto out = download(d_out), rstd = download(d_rstd);
  std::vector<double> out_ref(rows * C), rstd_ref(rows);
  double naive_worst = 0.0;  // what E[x^2] - E[x]^2 in float would give, for the record
  for (std::int64_t r = 0; r < rows; ++r) {
    long double m = 0, v = 0;
    float sx = 0.0f, sxx = 0.0f;
    for (std::int64_t c = 0; c < C; ++c) {
      m += x[r * C + c];
      sx += x[r * C + c];
      sxx += x[r * C + c] * x[r * C + c];
    }
    m /= C;
    for (std::int64_t c = 0; c < C; ++c) v += (x[r * C + c] - m) * (x[r * C + c] - m);
    v /= C;
    const float naive_var = sxx / C - (sx / C) * (sx / C);
    naive_worst = std::max(naive_worst,
                           std::fabs(static_cast<double>(naive_var) - static_cast<double>(v)) / static_cast<double>(v));
    const long double s = 1.0L / std::sqrt(v + static_cast<long double>(1e-5f));
    rstd_ref[r] = static_cast<double>(s);
    for (std::int64_t c = 0; c < C; ++c) out_ref[r * C + c] = static_cast<double>((x[r * C + c] - m) * s);
  }
  // A float mean near 1000 is known to ~6e-5, i.e. 6e-4 of the 0.1 spread.
  const double rstd_err = compare(rstd, rstd_ref, {1e-3, 0.0}, tag + " rstd vs long double");
  const double out_err = compare(out, out_ref, {0.0, 3e-3}, tag + " out vs long double");
  std::printf("%-48s out %.2e  rstd %.2e  (naive float variance off by %.0f%%)\n", tag.c_str(), out_err, rstd_err,
              100.0 * naive_worst);
}

struct Shape {
  std::int64_t rows, C;
};

template <class T>
void all_cases(const DeviceContext& context) {
  // C = 1 and 7: ragged, element path; 771: ragged, several warps; 768, 1600: vector path
  // (for every T); 96 with 4099 rows: several iterations per group in backward, 256
  // backward blocks; 20000: rows longer than the registers (the re-read path).
  for (const Shape s :
       {Shape{1, 1}, Shape{5, 7}, Shape{257, 771}, Shape{3, 768}, Shape{64, 1600}, Shape{4099, 96}, Shape{3, 20000}}) {
    for (const Kind kind : {Kind::layer, Kind::residual_layer, Kind::rms, Kind::residual_rms})
      norm_case<T>(context, kind, s.rows, s.C);
    fused_residual_rms_case<T>(context, s.rows, s.C);
  }
}

}  // namespace

int main() {
  check_host_errors();
  if (llmpar::backend::cuda::device_count() == 0) {
    std::printf("host-side checks %s; skipped: no CUDA device\n", gpu_test::verdict());
    return gpu_test::skip_exit_code();
  }
  return gpu_test::run_device_checks([] {
    DeviceContext context(0);
    all_cases<float>(context);
    all_cases<bf16>(context);
    all_cases<f16>(context);
    large_mean_case(context, 64, 1600);
    large_mean_case(context, 33, 771);
  });
}
