// The CUDA LayerNorm and RMSNorm kernels (kernels/layernorm.cuh), compiled by the host
// compiler and run on the CPU by the host emulation (cuda_emulation.hpp: one fiber per
// CUDA thread, warp shuffles and barriers between them), against the CPU kernels
// (backend/cpu/layernorm.hpp, rmsnorm.hpp): forward, backward, and the residual-fused
// forms (the sum written beside the norm; RMSNorm's backward with the residual gradient
// added as dx is written), for float and bf16, on rows that fill several CTAs and rows
// whose width is not a multiple of a vector (the scalar path). The fused kernels are
// also checked bit for bit against their unfused sequence on the emulation, as
// test_cuda_layernorm checks them on a GPU.
// A ctest (label cpu).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "llmpar/backend/cpu/layernorm.hpp"
#include "llmpar/backend/cpu/rmsnorm.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/kernels/layernorm.cuh"

namespace {

using llmpar::bf16;
namespace cpu = llmpar::backend::cpu;
namespace kernels = llmpar::kernels;

template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t seed, float scale = 1.0f, float offset = 0.0f) {
  const auto stream = llmpar::rng::Stream::named(seed, "layernorm emulation");
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(offset + scale * stream.normal(i));
  return v;
}

template <class T>
float value(T x) {
  return static_cast<float>(x);
}

// The largest |got - want| over max(|want|), with the name of what is compared.
template <class A, class B>
void check_close(const std::vector<A>& got, const std::vector<B>& want, double tolerance, const std::string& what) {
  REQUIRE(got.size() == want.size());
  double worst = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(value(got[i])) - static_cast<double>(value(want[i]))));
    scale = std::max(scale, std::abs(static_cast<double>(value(want[i]))));
  }
  INFO(what << ": worst difference " << worst << " of " << scale);
  CHECK(worst <= tolerance * std::max(scale, 1e-30));
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

struct Shape {
  std::int64_t rows, C;
};
// One row per CTA's group and partial groups, several backward blocks, and widths that
// are not a multiple of a 16-byte vector (the scalar path).
constexpr Shape kShapes[] = {{3, 64}, {37, 200}, {300, 128}, {5, 1030}};

// fp32 differs from the CPU in its reduction order only; bf16 also by a rounding of
// the 16-bit output where that order moves a value across a rounding boundary.
template <class T>
constexpr double kOutputTolerance = std::is_same_v<T, float> ? 2e-6 : 8e-3;
constexpr double kSumTolerance = 2e-5;  // float statistics and parameter gradients

}  // namespace

TEST_CASE_TEMPLATE("the CUDA RMSNorm kernels compute the CPU's, fused with the residual or not", T, float, bf16) {
  for (const Shape sh : kShapes) {
    CAPTURE(sh.rows);
    CAPTURE(sh.C);
    const auto n = static_cast<std::size_t>(sh.rows * sh.C), C = static_cast<std::size_t>(sh.C);
    const std::vector<T> x = random_values<T>(n, 1), delta = random_values<T>(n, 2, 0.5f);
    const std::vector<T> weight = random_values<T>(C, 3, 0.1f, 1.0f), dout = random_values<T>(n, 4);
    const std::vector<T> dres = random_values<T>(n, 5);
    const std::vector<float> no_rows(static_cast<std::size_t>(sh.rows));

    // Forward.
    std::vector<T> out(n), want_out(n);
    std::vector<float> rstd(no_rows), want_rstd(no_rows);
    kernels::rmsnorm_forward(nullptr, out.data(), rstd.data(), x.data(), weight.data(), sh.rows, sh.C);
    cpu::rmsnorm_forward(want_out.data(), want_rstd.data(), x.data(), weight.data(), sh.rows, sh.C);
    check_close(out, want_out, kOutputTolerance<T>, "rmsnorm_forward out");
    check_close(rstd, want_rstd, kSumTolerance, "rmsnorm_forward rstd");

    // Forward with the residual: sum = x + delta, then the norm of the sum.
    std::vector<T> sum(n), fused_out(n), residual = x, want_fused(n);
    std::vector<float> fused_rstd(no_rows), want_fused_rstd(no_rows);
    kernels::residual_rmsnorm_forward(nullptr, sum.data(), fused_out.data(), fused_rstd.data(), x.data(), delta.data(),
                                      weight.data(), sh.rows, sh.C);
    cpu::residual_rmsnorm_forward(want_fused.data(), want_fused_rstd.data(), residual.data(), delta.data(),
                                  weight.data(), sh.rows, sh.C);
    CHECK(same_bits(sum, residual));  // one rounding of x + delta to T on both
    check_close(fused_out, want_fused, kOutputTolerance<T>, "residual_rmsnorm_forward out");
    check_close(fused_rstd, want_fused_rstd, kSumTolerance, "residual_rmsnorm_forward rstd");
    std::vector<T> unfused_out(n);
    std::vector<float> unfused_rstd(no_rows);
    kernels::rmsnorm_forward(nullptr, unfused_out.data(), unfused_rstd.data(), sum.data(), weight.data(), sh.rows,
                             sh.C);
    CHECK(same_bits(fused_out, unfused_out));
    CHECK(same_bits(fused_rstd, unfused_rstd));

    // Backward, and with the residual gradient added.
    std::vector<float> workspace(static_cast<std::size_t>(kernels::rmsnorm_backward_workspace(sh.rows, sh.C)));
    std::vector<T> dx(n), want_dx(n);
    std::vector<float> dw(C, 0.25f), want_dw(C, 0.25f);
    kernels::rmsnorm_backward(nullptr, dx.data(), dw.data(), dout.data(), x.data(), weight.data(), rstd.data(),
                              workspace.data(), sh.rows, sh.C);
    cpu::rmsnorm_backward(want_dx.data(), want_dw.data(), dout.data(), x.data(), weight.data(), want_rstd.data(),
                          sh.rows, sh.C);
    check_close(dx, want_dx, kOutputTolerance<T> * 4, "rmsnorm_backward dx");
    check_close(dw, want_dw, kSumTolerance, "rmsnorm_backward dweight");
    std::vector<T> fused_dx(n), want_fused_dx(n);
    std::vector<float> fused_dw(C, 0.25f), want_fused_dw(C, 0.25f);
    kernels::residual_rmsnorm_backward(nullptr, fused_dx.data(), fused_dw.data(), dout.data(), dres.data(), x.data(),
                                       weight.data(), rstd.data(), workspace.data(), sh.rows, sh.C);
    cpu::residual_rmsnorm_backward(want_fused_dx.data(), want_fused_dw.data(), dout.data(), dres.data(), x.data(),
                                   weight.data(), want_rstd.data(), sh.rows, sh.C);
    check_close(fused_dx, want_fused_dx, kOutputTolerance<T> * 4, "residual_rmsnorm_backward dx");
    check_close(fused_dw, want_fused_dw, kSumTolerance, "residual_rmsnorm_backward dweight");
    // Bitwise the unfused backward followed by the add, on the emulation as on a GPU.
    std::vector<T> unfused_dx = dx;
    for (std::size_t i = 0; i < n; ++i) unfused_dx[i] = static_cast<T>(value(dx[i]) + value(dres[i]));
    CHECK(same_bits(fused_dx, unfused_dx));
    CHECK(same_bits(fused_dw, dw));
  }
}

TEST_CASE_TEMPLATE("the CUDA LayerNorm kernels compute the CPU's", T, float, bf16) {
  for (const Shape sh : kShapes) {
    CAPTURE(sh.rows);
    CAPTURE(sh.C);
    const auto n = static_cast<std::size_t>(sh.rows * sh.C), C = static_cast<std::size_t>(sh.C);
    const std::vector<T> x = random_values<T>(n, 11, 2.0f, 0.5f);
    const std::vector<T> weight = random_values<T>(C, 12, 0.1f, 1.0f), bias = random_values<T>(C, 13, 0.1f);
    const std::vector<T> dout = random_values<T>(n, 14);
    std::vector<T> out(n), want_out(n);
    std::vector<float> mean(static_cast<std::size_t>(sh.rows)), rstd(mean), want_mean(mean), want_rstd(mean);
    kernels::layernorm_forward(nullptr, out.data(), mean.data(), rstd.data(), x.data(), weight.data(), bias.data(),
                               sh.rows, sh.C);
    cpu::layernorm_forward(want_out.data(), want_mean.data(), want_rstd.data(), x.data(), weight.data(), bias.data(),
                           sh.rows, sh.C);
    check_close(out, want_out, kOutputTolerance<T>, "layernorm_forward out");
    check_close(mean, want_mean, kSumTolerance, "layernorm_forward mean");
    check_close(rstd, want_rstd, kSumTolerance, "layernorm_forward rstd");

    std::vector<float> workspace(static_cast<std::size_t>(kernels::layernorm_backward_workspace(sh.rows, sh.C)));
    std::vector<T> dx(n), want_dx(n);
    std::vector<float> dw(C, 0.5f), db(C, -0.5f), want_dw(dw), want_db(db);
    kernels::layernorm_backward(nullptr, dx.data(), dw.data(), db.data(), dout.data(), x.data(), weight.data(),
                                mean.data(), rstd.data(), workspace.data(), sh.rows, sh.C);
    cpu::layernorm_backward(want_dx.data(), want_dw.data(), want_db.data(), dout.data(), x.data(), weight.data(),
                            want_mean.data(), want_rstd.data(), sh.rows, sh.C);
    check_close(dx, want_dx, kOutputTolerance<T> * 4, "layernorm_backward dx");
    check_close(dw, want_dw, kSumTolerance, "layernorm_backward dweight");
    check_close(db, want_db, kSumTolerance, "layernorm_backward dbias");
  }
}
