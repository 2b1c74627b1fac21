// Shared math (exp, GELU, Welford, AdamW) and the basic CPU kernels (LayerNorm, GELU,
// embedding, element-wise, AdamW, sum of squares). Every forward is checked against a
// naive double reference written here; every backward against central finite
// differences of the double instantiation; the float instantiation against the double
// one; and every kernel that reduces or accumulates for bitwise independence of the
// OpenMP thread count.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_test_util.hpp"
#include "llmpar/backend/cpu/adamw.hpp"
#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/backend/cpu/elementwise.hpp"
#include "llmpar/backend/cpu/embedding.hpp"
#include "llmpar/backend/cpu/gelu.hpp"
#include "llmpar/backend/cpu/layernorm.hpp"
#include "llmpar/backend/cpu/reduce.hpp"
#include "llmpar/core/bits.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/core/slice.hpp"
#include "llmpar/math/activation.hpp"
#include "llmpar/math/adamw.hpp"
#include "llmpar/math/exp.hpp"
#include "llmpar/math/welford.hpp"

using namespace llmpar;
namespace cpu = llmpar::backend::cpu;
using namespace llmpar::kernel_test;

namespace {

// LayerNorm's eps as the kernels receive it (a float).
constexpr double kEps = static_cast<double>(1e-5f);

std::vector<std::int32_t> random_tokens(std::int64_t n, std::int32_t vocab, const std::string& name) {
  const auto stream = rng::Stream::named(kSeed, name);
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    v[i] = static_cast<std::int32_t>(stream.uniform(static_cast<std::uint64_t>(i)) * static_cast<float>(vocab));
    v[i] = std::min(v[i], vocab - 1);
  }
  return v;
}

// ---------------------------------------------------------------------------------------
// Naive references, in double.

void layernorm_reference(std::vector<double>& out, std::vector<double>& mean, std::vector<double>& rstd,
                         const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b,
                         std::int64_t rows, std::int64_t C, double eps) {
  out.assign(static_cast<std::size_t>(rows * C), 0.0);
  mean.assign(static_cast<std::size_t>(rows), 0.0);
  rstd.assign(static_cast<std::size_t>(rows), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    long double m = 0;
    for (std::int64_t c = 0; c < C; ++c) m += x[r * C + c];
    m /= C;
    long double var = 0;
    for (std::int64_t c = 0; c < C; ++c) var += (x[r * C + c] - m) * (x[r * C + c] - m);
    var /= C;
    const long double s = 1.0L / std::sqrt(var + eps);
    for (std::int64_t c = 0; c < C; ++c) {
      out[r * C + c] = static_cast<double>((x[r * C + c] - m) * s * w[c] + b[c]);
    }
    mean[r] = static_cast<double>(m);
    rstd[r] = static_cast<double>(s);
  }
}

// GPT-2's formula as written, with tanh, in long double.
double gelu_reference(double x) {
  const long double v = x;
  const long double u = 0.79788456080286535587989211986876L * (v + 0.044715L * v * v * v);
  return static_cast<double>(0.5L * v * (1.0L + std::tanh(u)));
}

double gelu_grad_reference(double x) {
  const long double v = x;
  const long double k = 0.79788456080286535587989211986876L;
  const long double t = std::tanh(k * (v + 0.044715L * v * v * v));
  return static_cast<double>(0.5L * (1.0L + t) + 0.5L * v * (1.0L - t * t) * k * (1.0L + 3.0L * 0.044715L * v * v));
}

struct LayerNormCase {
  std::int64_t rows, C;
};

}  // namespace

// =======================================================================================
// Shared math

TEST_CASE("math::exp(float) is within 1.1 ulp over the normal range, flushes below it, handles inf and NaN") {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr float kMinNormal = std::numeric_limits<float>::min();
  const double max_finite = std::numeric_limits<float>::max();
  // Every 257th float with |x| <= 89, both signs: tiny |x|, both reduction edges of
  // every binade, and both ends of the range.
  double worst_ulps = 0.0;  // normal results, in ulps of the exact value's binade
  std::int64_t unflushed = 0, missed_overflows = 0, subnormal_results = 0;
  for (std::uint32_t magnitude = 0; magnitude <= bits::of(89.0f); magnitude += 257) {
    for (const std::uint32_t sign : {0u, 0x80000000u}) {
      const float x = bits::to_float(sign | magnitude);
      const double exact = std::exp(static_cast<double>(x));
      const float got = math::exp(x);
      subnormal_results += got != 0.0f && got < kMinNormal ? 1 : 0;
      if (exact < kMinNormal) {
        unflushed += got == 0.0f ? 0 : 1;
      } else if (exact > max_finite) {
        missed_overflows += got == kInf ? 0 : 1;
      } else {
        worst_ulps = std::max(worst_ulps, std::fabs(got - exact) / std::ldexp(1.0, std::ilogb(exact) - 23));
      }
    }
  }
  CHECK(worst_ulps < 1.1);
  CHECK(unflushed == 0);
  CHECK(missed_overflows == 0);
  CHECK(subnormal_results == 0);

  CHECK(math::exp(0.0f) == 1.0f);
  CHECK(math::exp(-0.0f) == 1.0f);
  // The top of the range: ln(FLT_MAX) = 88.7228391 lies between these two floats, and
  // e^x overflows from the same float as expf.
  CHECK(math::exp(0x1.62e42ep+6f) == doctest::Approx(std::exp(static_cast<double>(0x1.62e42ep+6f))).epsilon(1e-6));
  CHECK(math::exp(0x1.62e430p+6f) == kInf);
  CHECK(math::exp(88.5f) == doctest::Approx(std::exp(static_cast<double>(88.5f))).epsilon(1e-6));
  CHECK(math::exp(88.37f) == doctest::Approx(std::exp(static_cast<double>(88.37f))).epsilon(1e-6));
  CHECK(math::exp(89.0f) == kInf);
  CHECK(math::exp(kInf) == kInf);
  // The bottom: ln(FLT_MIN) = -87.3365448 lies between these two floats; below it the
  // result is flushed to 0 rather than rounded to a subnormal.
  CHECK(math::exp(-0x1.5d589ep+6f) >= kMinNormal);
  CHECK(math::exp(-0x1.5d58a0p+6f) == 0.0f);
  CHECK(math::exp(-87.3f) == doctest::Approx(std::exp(static_cast<double>(-87.3f))).epsilon(1e-6));
  CHECK(math::exp(-100.0f) == 0.0f);
  CHECK(math::exp(-104.0f) == 0.0f);
  CHECK(math::exp(-kInf) == 0.0f);
  CHECK(std::isnan(math::exp(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isnan(math::exp(-std::numeric_limits<float>::quiet_NaN())));
  // double goes to libm unchanged: it is the accurate reference.
  CHECK(math::exp(1.0) == std::exp(1.0));
  CHECK(math::exp(-1.5) == std::exp(-1.5));
}

TEST_CASE("math::gelu_tanh equals GPT-2's tanh formula, in double and in float") {
  for (double x = -6.0; x <= 6.0; x += 0.01) {
    const double expected = gelu_reference(x);
    // Below about -3, 1 + tanh(u) itself cancels; compare there on an absolute scale.
    CHECK(std::fabs(math::gelu_tanh(x) - expected) <= 1e-14 * std::max(1.0, std::fabs(x)));
    const float xf = static_cast<float>(x);
    CHECK(std::fabs(math::gelu_tanh(xf) - gelu_reference(xf)) <= 4e-7 * std::max(1.0, std::fabs(x)));
  }
  CHECK(math::gelu_tanh(0.0) == 0.0);
  CHECK(math::gelu_tanh(0.0f) == 0.0f);
  // Far tails: identity on the right, zero on the left, and never NaN.
  CHECK(math::gelu_tanh(50.0f) == 50.0f);
  CHECK(math::gelu_tanh(1e30f) == 1e30f);
  CHECK(std::fabs(math::gelu_tanh(-50.0f)) < 1e-30f);
  CHECK(std::fabs(math::gelu_tanh(-1e30)) < 1e-200);
  CHECK(std::isnan(math::gelu_tanh(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isnan(math::gelu_tanh(std::numeric_limits<double>::quiet_NaN())));
}

TEST_CASE("math::gelu_tanh_grad is the derivative of gelu_tanh (analytic and finite differences)") {
  for (double x = -8.0; x <= 8.0; x += 0.0137) {
    const double analytic = gelu_grad_reference(x);
    CHECK(std::fabs(math::gelu_tanh_grad(x) - analytic) <= 1e-14);
    const double fd = (math::gelu_tanh(x + kFdStep) - math::gelu_tanh(x - kFdStep)) / (2 * kFdStep);
    CHECK(std::fabs(math::gelu_tanh_grad(x) - fd) <= 1e-8);
    const float xf = static_cast<float>(x);
    CHECK(std::fabs(math::gelu_tanh_grad(xf) - gelu_grad_reference(xf)) <= 5e-7);
  }
  // The tails stay finite (a naive 1 - s or inf * 0 would give NaN there).
  for (float x : {-1e3f, -60.0f, -20.0f, -12.0f, 12.0f, 20.0f, 60.0f, 1e3f}) {
    const float g = math::gelu_tanh_grad(x);
    CHECK(std::isfinite(g));
    CHECK(std::fabs(g - (x > 0 ? 1.0f : 0.0f)) < 1e-6f);
    CHECK(std::isfinite(math::gelu_tanh_grad(static_cast<double>(x))));
  }
  CHECK(std::isnan(math::gelu_tanh_grad(std::numeric_limits<float>::quiet_NaN())));
}

TEST_CASE("math::Welford push gives the two-pass mean and variance") {
  const std::vector<double> x = random_normal(1001, "welford.push", 3.0, -2.0);
  math::Welford<double> w;
  for (double v : x) w.push(v);
  double mean = 0;
  for (double v : x) mean += v;
  mean /= static_cast<double>(x.size());
  double m2 = 0;
  for (double v : x) m2 += (v - mean) * (v - mean);
  CHECK(w.count == 1001);
  CHECK(w.mean == doctest::Approx(mean).epsilon(1e-13));
  CHECK(w.variance() == doctest::Approx(m2 / 1001).epsilon(1e-13));
  CHECK(w.sample_variance() == doctest::Approx(m2 / 1000).epsilon(1e-13));
  CHECK(math::Welford<double>{}.variance() == 0.0);
  CHECK(math::Welford<double>{}.sample_variance() == 0.0);
}

TEST_CASE("math::Welford combine equals pushing everything, for any split including empty parts") {
  const std::vector<double> x = random_normal(300, "welford.combine", 0.5, 7.0);
  math::Welford<double> all;
  for (double v : x) all.push(v);
  for (std::size_t split :
       {std::size_t{0}, std::size_t{1}, std::size_t{37}, std::size_t{150}, std::size_t{299}, std::size_t{300}}) {
    math::Welford<double> left, right;
    for (std::size_t i = 0; i < split; ++i) left.push(x[i]);
    for (std::size_t i = split; i < x.size(); ++i) right.push(x[i]);
    left.combine(right);
    CHECK(left.count == all.count);
    CHECK(left.mean == doctest::Approx(all.mean).epsilon(1e-13));
    CHECK(left.m2 == doctest::Approx(all.m2).epsilon(1e-12));
  }
  // A state built from a chunk's (mean, M2, count) merges like pushed values.
  math::Welford<double> parts{1.0, 2.0, 4};
  parts.combine(math::Welford<double>{3.0, 2.0, 4});
  CHECK(parts.count == 8);
  CHECK(parts.mean == 2.0);
  CHECK(parts.m2 == doctest::Approx(2.0 + 2.0 + 4.0 * 4.0 * 4.0 / 8.0));
}

TEST_CASE("math::Welford in float keeps the variance of large-mean data where E[x^2]-E[x]^2 fails") {
  const std::vector<double> x = to_double(cast_to<float>(random_normal(10000, "welford.offset", 1.0, 1e4)));
  math::Welford<double> exact;
  for (double v : x) exact.push(v);
  math::Welford<float> w;
  float sum = 0.0f, sum_sq = 0.0f;
  for (double v : x) {
    const float f = static_cast<float>(v);
    w.push(f);
    sum += f;
    sum_sq += f * f;
  }
  const double naive = sum_sq / 10000.0 - (sum / 10000.0) * (sum / 10000.0);
  CHECK(std::fabs(w.variance() - exact.variance()) / exact.variance() < 1e-2);
  CHECK(std::fabs(naive - exact.variance()) / exact.variance() > 0.1);  // the failure it avoids
}

TEST_CASE("math::adamw_step follows PyTorch AdamW with decoupled weight decay") {
  const math::AdamWParams hp{0.01f, 0.9f, 0.999f, 1e-8f, 0.1f};
  const auto c = math::adamw_bias_corrections(hp, 3);
  CHECK(c.first == doctest::Approx(1.0 - 0.9 * 0.9 * 0.9).epsilon(1e-7));
  CHECK(c.second == doctest::Approx(1.0 - std::pow(static_cast<double>(0.999f), 3)).epsilon(1e-12));
  double p = 0.5, m = 0.1, v = 0.02;
  const double g = -0.3;
  math::adamw_step(p, m, v, g, hp, c.first, c.second);
  const double b1 = hp.beta1, b2 = hp.beta2;
  const double m_new = b1 * 0.1 + (1 - b1) * g;
  const double v_new = b2 * 0.02 + (1 - b2) * g * g;
  const double p_new = 0.5 - static_cast<double>(hp.lr) *
                                 (m_new / c.first / (std::sqrt(v_new / c.second) + static_cast<double>(hp.eps)) +
                                  static_cast<double>(hp.weight_decay) * 0.5);
  CHECK(m == doctest::Approx(m_new).epsilon(1e-15));
  CHECK(v == doctest::Approx(v_new).epsilon(1e-15));
  CHECK(p == doctest::Approx(p_new).epsilon(1e-15));
  // Weight decay alone (zero gradient, zero moments) shrinks p by lr * wd * p.
  double p2 = 2.0, m2 = 0.0, v2 = 0.0;
  math::adamw_step(p2, m2, v2, 0.0, hp, c.first, c.second);
  CHECK(p2 ==
        doctest::Approx(2.0 - static_cast<double>(hp.lr) * static_cast<double>(hp.weight_decay) * 2.0).epsilon(1e-14));
}

TEST_CASE("math AdamW hyper-parameters and steps are validated with messages naming the field") {
  CHECK_NOTHROW(math::validate(math::AdamWParams{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f}));
  CHECK_NOTHROW(math::validate(math::AdamWParams{0.0f, 0.9f, 0.95f, 1e-8f, 0.0f}));  // warm-up step 0
  CHECK_THROWS_WITH_AS(math::validate(math::AdamWParams{-1.0f, 0.9f, 0.95f, 1e-8f, 0.0f}), doctest::Contains("lr"),
                       Error);
  CHECK_THROWS_WITH_AS(math::validate(math::AdamWParams{1e-3f, 1.0f, 0.95f, 1e-8f, 0.0f}), doctest::Contains("beta1"),
                       Error);
  CHECK_THROWS_WITH_AS(math::validate(math::AdamWParams{1e-3f, 0.9f, -0.5f, 1e-8f, 0.0f}), doctest::Contains("beta2"),
                       Error);
  CHECK_THROWS_WITH_AS(math::validate(math::AdamWParams{1e-3f, 0.9f, 0.95f, 0.0f, 0.0f}), doctest::Contains("eps"),
                       Error);
  CHECK_THROWS_WITH_AS(math::validate(math::AdamWParams{1e-3f, 0.9f, 0.95f, 1e-8f, std::nanf("")}),
                       doctest::Contains("weight_decay"), Error);
  CHECK_THROWS_WITH_AS(math::adamw_bias_corrections(math::AdamWParams{}, 0), doctest::Contains("step"), Error);
}

// =======================================================================================
// LayerNorm

TEST_CASE_TEMPLATE("layernorm_forward matches the naive reference, on ragged shapes", T, double, float) {
  const double tol = std::is_same_v<T, double> ? 1e-13 : 2e-6;
  for (const LayerNormCase s : {LayerNormCase{1, 1}, LayerNormCase{1, 7}, LayerNormCase{3, 13}, LayerNormCase{2, 64},
                                LayerNormCase{5, 257}, LayerNormCase{4, 300}, LayerNormCase{2, 1029}}) {
    CAPTURE(s.rows);
    CAPTURE(s.C);
    const std::string tag = std::to_string(s.rows) + "x" + std::to_string(s.C);
    const auto x = cast_to<T>(random_normal(s.rows * s.C, "ln.x." + tag, 2.0, 0.5));
    const auto w = cast_to<T>(random_normal(s.C, "ln.w." + tag, 0.3, 1.0));
    const auto b = cast_to<T>(random_normal(s.C, "ln.b." + tag, 0.2));
    std::vector<T> out(x.size());
    std::vector<cpu::acc_t<T>> mean(static_cast<std::size_t>(s.rows)), rstd(mean.size());
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), s.rows, s.C);
    std::vector<double> out_ref, mean_ref, rstd_ref;
    layernorm_reference(out_ref, mean_ref, rstd_ref, to_double(x), to_double(w), to_double(b), s.rows, s.C, kEps);
    CHECK(relative_error(out, out_ref) < tol);
    CHECK(relative_error(mean, mean_ref) < tol);
    CHECK(relative_error(rstd, rstd_ref) < tol);
    // Without statistics (inference) the output is the same.
    std::vector<T> out_no_stats(x.size());
    cpu::layernorm_forward(out_no_stats.data(), static_cast<cpu::acc_t<T>*>(nullptr),
                           static_cast<cpu::acc_t<T>*>(nullptr), x.data(), w.data(), b.data(), s.rows, s.C);
    CHECK(bitwise_equal(out, out_no_stats));
  }
}

TEST_CASE("layernorm_forward in float keeps rows with a large mean accurate (Welford chunks)") {
  const std::int64_t rows = 4, C = 1000;
  const auto x = cast_to<float>(random_normal(rows * C, "ln.offset.x", 0.01, 300.0));
  const std::vector<float> w(C, 1.0f), b(C, 0.0f);
  std::vector<float> out(x.size()), mean(rows), rstd(rows);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows, C);
  std::vector<double> out_ref, mean_ref, rstd_ref;
  layernorm_reference(out_ref, mean_ref, rstd_ref, to_double(x), to_double(w), to_double(b), rows, C, kEps);
  // A float mean near 300 is only known to ~1.5e-5, i.e. 1.5e-3 of the 0.01 spread (out);
  // E[x^2] - E[x]^2 in float would not even get the sign of the variance right here.
  CHECK(relative_error(rstd, rstd_ref) < 1e-3);
  CHECK(relative_error(out, out_ref) < 3e-3);
}

TEST_CASE("layernorm_backward matches finite differences in double; dx overwritten, dweight/dbias accumulated") {
  for (const LayerNormCase s : {LayerNormCase{1, 5}, LayerNormCase{3, 13}, LayerNormCase{2, 70}}) {
    CAPTURE(s.rows);
    CAPTURE(s.C);
    const std::string tag = std::to_string(s.rows) + "x" + std::to_string(s.C);
    std::vector<double> x = random_normal(s.rows * s.C, "lnb.x." + tag, 1.5, 0.3);
    std::vector<double> w = random_normal(s.C, "lnb.w." + tag, 0.5, 1.0);
    std::vector<double> b = random_normal(s.C, "lnb.b." + tag, 0.5);
    const std::vector<double> probe = random_normal(s.rows * s.C, "lnb.probe." + tag);  // loss = <out, probe>
    std::vector<double> out(x.size()), mean(static_cast<std::size_t>(s.rows)), rstd(mean.size());
    const auto loss = [&] {
      cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), s.rows, s.C);
      return dot(out, probe);
    };
    const std::vector<double> fd_x = finite_difference(x, loss);
    const std::vector<double> fd_w = finite_difference(w, loss);
    const std::vector<double> fd_b = finite_difference(b, loss);

    loss();                                     // mean and rstd of the unperturbed input
    std::vector<double> dx(x.size(), 12345.0);  // overwritten
    const std::vector<double> dw0 = random_normal(s.C, "lnb.dw0." + tag);
    const std::vector<double> db0 = random_normal(s.C, "lnb.db0." + tag);
    std::vector<double> dw = dw0, db = db0;
    cpu::layernorm_backward(dx.data(), dw.data(), db.data(), probe.data(), x.data(), w.data(), mean.data(), rstd.data(),
                            s.rows, s.C);
    CHECK(relative_error(dx, fd_x) < kFdTolerance);
    CHECK(relative_error(minus(dw, dw0), fd_w) < kFdTolerance);
    CHECK(relative_error(minus(db, db0), fd_b) < kFdTolerance);
  }
}

TEST_CASE("layernorm float instantiation matches double, forward and backward") {
  const std::int64_t rows = 37, C = 515;
  const auto xd = to_double(cast_to<float>(random_normal(rows * C, "lnf.x", 1.0, 0.2)));
  const auto wd = to_double(cast_to<float>(random_normal(C, "lnf.w", 0.2, 1.0)));
  const auto bd = to_double(cast_to<float>(random_normal(C, "lnf.b", 0.2)));
  const auto gd = to_double(cast_to<float>(random_normal(rows * C, "lnf.dout")));
  const auto xf = cast_to<float>(xd), wf = cast_to<float>(wd), bf = cast_to<float>(bd), gf = cast_to<float>(gd);

  std::vector<double> out_d(xd.size()), mean_d(rows), rstd_d(rows), dx_d(xd.size()), dw_d(C, 0.0), db_d(C, 0.0);
  cpu::layernorm_forward(out_d.data(), mean_d.data(), rstd_d.data(), xd.data(), wd.data(), bd.data(), rows, C);
  cpu::layernorm_backward(dx_d.data(), dw_d.data(), db_d.data(), gd.data(), xd.data(), wd.data(), mean_d.data(),
                          rstd_d.data(), rows, C);
  std::vector<float> out_f(xf.size()), mean_f(rows), rstd_f(rows), dx_f(xf.size()), dw_f(C, 0.0f), db_f(C, 0.0f);
  cpu::layernorm_forward(out_f.data(), mean_f.data(), rstd_f.data(), xf.data(), wf.data(), bf.data(), rows, C);
  cpu::layernorm_backward(dx_f.data(), dw_f.data(), db_f.data(), gf.data(), xf.data(), wf.data(), mean_f.data(),
                          rstd_f.data(), rows, C);
  CHECK(relative_error(out_f, out_d) < 2e-6);
  CHECK(relative_error(dx_f, dx_d) < 1e-5);
  CHECK(relative_error(dw_f, dw_d) < 1e-5);
  CHECK(relative_error(db_f, db_d) < 1e-5);
}

TEST_CASE("layernorm_backward is bitwise identical for 1, 2 and 3 OpenMP threads") {
  const std::int64_t rows = 515, C = 200;  // 3+ column tiles, and enough work to go parallel
  REQUIRE(rows * C >= cpu::kMinParallelWork);
  const auto x = cast_to<float>(random_normal(rows * C, "lnd.x"));
  const auto w = cast_to<float>(random_normal(C, "lnd.w", 0.2, 1.0));
  const auto b = cast_to<float>(random_normal(C, "lnd.b"));
  const auto g = cast_to<float>(random_normal(rows * C, "lnd.dout"));
  std::vector<float> out(x.size()), mean(rows), rstd(rows);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows, C);
  const auto run = [&](int threads) {
    std::vector<float> dx(x.size()), dw(C, 0.25f), db(C, -0.5f), fwd(x.size()), mu(rows), rs(rows);
    with_threads(threads, [&] {
      cpu::layernorm_forward(fwd.data(), mu.data(), rs.data(), x.data(), w.data(), b.data(), rows, C);
      cpu::layernorm_backward(dx.data(), dw.data(), db.data(), g.data(), x.data(), w.data(), mean.data(), rstd.data(),
                              rows, C);
      // Twice: the second call accumulates onto the first.
      cpu::layernorm_backward(dx.data(), dw.data(), db.data(), g.data(), x.data(), w.data(), mean.data(), rstd.data(),
                              rows, C);
    });
    std::vector<float> all = fwd;
    all.insert(all.end(), dx.begin(), dx.end());
    all.insert(all.end(), dw.begin(), dw.end());
    all.insert(all.end(), db.begin(), db.end());
    return all;
  };
  const std::vector<float> one = run(1);
  CHECK(bitwise_equal(one, run(2)));
  CHECK(bitwise_equal(one, run(3)));
}

TEST_CASE("layernorm rejects shapes it cannot normalize") {
  std::vector<float> v(4);
  CHECK_THROWS_AS(cpu::layernorm_forward(v.data(), v.data(), v.data(), v.data(), v.data(), v.data(), 1, 0), Error);
  CHECK_THROWS_AS(
      cpu::layernorm_backward(v.data(), v.data(), v.data(), v.data(), v.data(), v.data(), v.data(), v.data(), -1, 4),
      Error);
}

// =======================================================================================
// GELU

TEST_CASE_TEMPLATE("gelu_forward matches the naive tanh formula, on odd sizes", T, double, float) {
  const double tol = std::is_same_v<T, double> ? 1e-14 : 4e-7;
  for (std::int64_t n : {1, 7, 1001, 40001}) {
    const auto x = cast_to<T>(random_normal(n, "gelu.x." + std::to_string(n), 2.5));
    std::vector<T> out(x.size());
    cpu::gelu_forward(out.data(), x.data(), n);
    for (std::int64_t i = 0; i < n; ++i) {
      const double xi = static_cast<double>(x[i]);
      REQUIRE(std::fabs(static_cast<double>(out[i]) - gelu_reference(xi)) <= tol * std::max(1.0, std::fabs(xi)));
    }
    // In place (out == x) gives the same values.
    std::vector<T> in_place = x;
    cpu::gelu_forward(in_place.data(), in_place.data(), n);
    CHECK(bitwise_equal(in_place, out));
  }
}

TEST_CASE("gelu_backward matches finite differences in double and overwrites dx") {
  const std::int64_t n = 513;
  std::vector<double> x = random_normal(n, "gelub.x", 2.0);
  const std::vector<double> probe = random_normal(n, "gelub.probe");
  std::vector<double> out(x.size());
  const auto loss = [&] {
    cpu::gelu_forward(out.data(), x.data(), n);
    return dot(out, probe);
  };
  const std::vector<double> fd = finite_difference(x, loss);
  std::vector<double> dx(x.size(), 777.0);
  cpu::gelu_backward(dx.data(), x.data(), probe.data(), n);
  CHECK(relative_error(dx, fd) < kFdTolerance);
  // In place (dx == dout).
  std::vector<double> in_place = probe;
  cpu::gelu_backward(in_place.data(), x.data(), in_place.data(), n);
  CHECK(bitwise_equal(in_place, dx));
}

TEST_CASE("gelu float instantiation matches double, and is bitwise identical for 1 and 2 threads") {
  const std::int64_t n = 100003;
  REQUIRE(n >= cpu::kMinParallelWork);
  const auto xf = cast_to<float>(random_normal(n, "geluf.x", 3.0));
  const auto gf = cast_to<float>(random_normal(n, "geluf.dout"));
  const auto xd = to_double(xf), gd = to_double(gf);
  std::vector<double> out_d(n), dx_d(n);
  cpu::gelu_forward(out_d.data(), xd.data(), n);
  cpu::gelu_backward(dx_d.data(), xd.data(), gd.data(), n);
  std::vector<float> out1(n), dx1(n), out2(n), dx2(n);
  with_threads(1, [&] {
    cpu::gelu_forward(out1.data(), xf.data(), n);
    cpu::gelu_backward(dx1.data(), xf.data(), gf.data(), n);
  });
  with_threads(2, [&] {
    cpu::gelu_forward(out2.data(), xf.data(), n);
    cpu::gelu_backward(dx2.data(), xf.data(), gf.data(), n);
  });
  CHECK(relative_error(out1, out_d) < 1e-6);
  CHECK(relative_error(dx1, dx_d) < 1e-6);
  CHECK(bitwise_equal(out1, out2));
  CHECK(bitwise_equal(dx1, dx2));
}

// =======================================================================================
// Embedding (encoder)

TEST_CASE_TEMPLATE("encoder_forward adds the token row and the position row", T, double, float) {
  for (const LayerNormCase s : {LayerNormCase{1, 1}, LayerNormCase{2, 13}, LayerNormCase{3, 70}}) {
    const std::int64_t B = s.rows, Tlen = 5, C = s.C, V = 11;
    const std::string tag = std::to_string(B) + "x" + std::to_string(C);
    const auto tokens = random_tokens(B * Tlen, static_cast<std::int32_t>(V), "enc.tokens." + tag);
    const auto wte = cast_to<T>(random_normal(V * C, "enc.wte." + tag));
    const auto wpe = cast_to<T>(random_normal(Tlen * C, "enc.wpe." + tag));
    std::vector<T> out(static_cast<std::size_t>(B * Tlen * C));
    cpu::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, Tlen, C);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < Tlen; ++t)
        for (std::int64_t c = 0; c < C; ++c) {
          const double expected =
              static_cast<double>(wte[tokens[b * Tlen + t] * C + c]) + static_cast<double>(wpe[t * C + c]);
          REQUIRE(static_cast<double>(out[(b * Tlen + t) * C + c]) == doctest::Approx(expected).epsilon(1e-7));
        }
  }
}

TEST_CASE("encoder_backward matches finite differences in double and accumulates into dwte/dwpe") {
  const std::int64_t B = 3, Tlen = 4, C = 67, V = 5;  // few tokens: rows are hit many times
  const auto tokens = random_tokens(B * Tlen, static_cast<std::int32_t>(V), "encb.tokens");
  std::vector<double> wte = random_normal(V * C, "encb.wte");
  std::vector<double> wpe = random_normal(Tlen * C, "encb.wpe");
  const std::vector<double> probe = random_normal(B * Tlen * C, "encb.probe");
  std::vector<double> out(probe.size());
  const auto loss = [&] {
    cpu::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, Tlen, C);
    return dot(out, probe);
  };
  const std::vector<double> fd_wte = finite_difference(wte, loss);
  const std::vector<double> fd_wpe = finite_difference(wpe, loss);
  const std::vector<double> dwte0 = random_normal(V * C, "encb.dwte0");
  const std::vector<double> dwpe0 = random_normal(Tlen * C, "encb.dwpe0");
  std::vector<double> dwte = dwte0, dwpe = dwpe0;
  cpu::encoder_backward(dwte.data(), dwpe.data(), probe.data(), tokens.data(), B, Tlen, C);
  CHECK(relative_error(minus(dwte, dwte0), fd_wte) < kFdTolerance);
  CHECK(relative_error(minus(dwpe, dwpe0), fd_wpe) < kFdTolerance);
}

TEST_CASE("encoder float instantiation matches double, and backward is bitwise identical for 1, 2, 3 threads") {
  const std::int64_t B = 8, Tlen = 64, C = 130, V = 17;  // tokens repeat across many positions
  REQUIRE(B * Tlen * C >= cpu::kMinParallelWork);
  const auto tokens = random_tokens(B * Tlen, static_cast<std::int32_t>(V), "encd.tokens");
  const auto wte = cast_to<float>(random_normal(V * C, "encd.wte"));
  const auto wpe = cast_to<float>(random_normal(Tlen * C, "encd.wpe"));
  const auto dout = cast_to<float>(random_normal(B * Tlen * C, "encd.dout"));
  const auto run = [&](int threads) {
    std::vector<float> out(dout.size()), dwte(wte.size(), 0.5f), dwpe(wpe.size(), -0.25f);
    with_threads(threads, [&] {
      cpu::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, Tlen, C);
      cpu::encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, Tlen, C);
    });
    out.insert(out.end(), dwte.begin(), dwte.end());
    out.insert(out.end(), dwpe.begin(), dwpe.end());
    return out;
  };
  const std::vector<float> one = run(1);
  CHECK(bitwise_equal(one, run(2)));
  CHECK(bitwise_equal(one, run(3)));

  const auto wte_d = to_double(wte), wpe_d = to_double(wpe), dout_d = to_double(dout);
  std::vector<double> out_d(dout.size()), dwte_d(wte.size(), 0.5), dwpe_d(wpe.size(), -0.25);
  cpu::encoder_forward(out_d.data(), tokens.data(), wte_d.data(), wpe_d.data(), B, Tlen, C);
  cpu::encoder_backward(dwte_d.data(), dwpe_d.data(), dout_d.data(), tokens.data(), B, Tlen, C);
  out_d.insert(out_d.end(), dwte_d.begin(), dwte_d.end());
  out_d.insert(out_d.end(), dwpe_d.begin(), dwpe_d.end());
  CHECK(relative_error(one, out_d) < 1e-6);
}

// =======================================================================================
// Element-wise

TEST_CASE_TEMPLATE("encoder over row slices: the slices' partial sums are the whole table's embedding, bit for bit", T,
                   double, float) {
  // A table of 12 rows over 4 slices of 3: each slice looks up only its tokens (zero for
  // the others), slice 0 adds the positions, and the partials summed in slice order give
  // the unsplit embedding exactly. Backward: each slice's dwte gets only its tokens' rows,
  // and together they are the unsplit dwte.
  const std::int64_t B = 2, Tlen = 5, C = 7, V = 12, parts = 4, rows_per = V / parts;
  const std::vector<T> wte = cast_to<T>(random_normal(V * C, "slice.wte"));
  const std::vector<T> wpe = cast_to<T>(random_normal(Tlen * C, "slice.wpe"));
  const std::vector<T> dout = cast_to<T>(random_normal(B * Tlen * C, "slice.dout"));
  const std::vector<std::int32_t> tokens{0, 3, 11, 3, 5, 6, 2, 11, 9, 0};
  std::vector<T> whole(B * Tlen * C), sum(whole.size(), T(0)), part(whole.size());
  cpu::encoder_forward(whole.data(), tokens.data(), wte.data(), wpe.data(), B, Tlen, C);
  std::vector<T> dwte_whole(V * C, T(0)), dwpe_whole(Tlen * C, T(0)), dwte_split(V * C, T(0));
  cpu::encoder_backward(dwte_whole.data(), dwpe_whole.data(), dout.data(), tokens.data(), B, Tlen, C);
  for (std::int64_t k = 0; k < parts; ++k) {
    const RowSlice slice{k * rows_per, rows_per};
    cpu::encoder_forward(part.data(), tokens.data(), wte.data() + k * rows_per * C, k == 0 ? wpe.data() : nullptr, B,
                         Tlen, C, slice);
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = sum[i] + part[i];
    cpu::encoder_backward<T>(dwte_split.data() + k * rows_per * C, nullptr, dout.data(), tokens.data(), B, Tlen, C,
                             slice);
  }
  CHECK(sum == whole);
  CHECK(dwte_split == dwte_whole);
}

TEST_CASE_TEMPLATE("add, add_inplace and scale_inplace compute a+b, a+=b and a*=s on odd sizes", T, double, float) {
  for (std::int64_t n : {1, 3, 999, 70001}) {
    const auto a = cast_to<T>(random_normal(n, "ew.a." + std::to_string(n)));
    const auto b = cast_to<T>(random_normal(n, "ew.b." + std::to_string(n)));
    std::vector<T> sum(a.size());
    cpu::add(sum.data(), a.data(), b.data(), n);
    std::vector<T> acc = a;
    cpu::add_inplace(acc.data(), b.data(), n);
    std::vector<T> scaled = a;
    const cpu::acc_t<T> s = static_cast<cpu::acc_t<T>>(-0.375);  // one rounded product, as below
    cpu::scale_inplace(scaled.data(), s, n);
    std::vector<T> aliased = a;  // out == a
    cpu::add(aliased.data(), aliased.data(), b.data(), n);
    for (std::int64_t i = 0; i < n; ++i) {
      REQUIRE(sum[i] == static_cast<T>(a[i] + b[i]));
      REQUIRE(acc[i] == sum[i]);
      REQUIRE(aliased[i] == sum[i]);
      REQUIRE(scaled[i] == static_cast<T>(a[i] * s));
    }
  }
}

// =======================================================================================
// AdamW

namespace {

// The scalar formula, in double, over several steps with a different gradient each.
struct AdamWReference {
  std::vector<double> p, m, v;
  void step(const std::vector<double>& grad, const math::AdamWParams& hp, int t, double grad_scale) {
    const double b1 = hp.beta1, b2 = hp.beta2, lr = hp.lr, eps = hp.eps, wd = hp.weight_decay;
    for (std::size_t i = 0; i < p.size(); ++i) {
      const double g = grad[i] * grad_scale;
      m[i] = b1 * m[i] + (1.0 - b1) * g;
      v[i] = b2 * v[i] + (1.0 - b2) * g * g;
      const double m_hat = m[i] / (1.0 - std::pow(b1, t));
      const double v_hat = v[i] / (1.0 - std::pow(b2, t));
      p[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + wd * p[i]);
    }
  }
};

}  // namespace

TEST_CASE_TEMPLATE("adamw_update follows the scalar AdamW formula over several steps", T, double, float) {
  const std::int64_t n = 1037;
  const math::AdamWParams hp{2e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
  const float grad_scale = 0.5f;
  auto p = cast_to<T>(random_normal(n, "adam.p"));
  std::vector<T> m(n, T(0)), v(n, T(0));
  AdamWReference ref{to_double(p), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  for (int step = 1; step <= 6; ++step) {
    const auto g = cast_to<T>(random_normal(n, "adam.g." + std::to_string(step), 0.1));
    cpu::adamw_update(p.data(), m.data(), v.data(), g.data(), n, hp, step, grad_scale);
    ref.step(to_double(g), hp, step, grad_scale);
  }
  const double tol = std::is_same_v<T, double> ? 1e-13 : 1e-5;
  CHECK(relative_error(p, ref.p) < tol);
  CHECK(relative_error(m, ref.m) < tol);
  CHECK(relative_error(v, ref.v) < tol);
}

TEST_CASE("adamw_update is bitwise identical for 1 and 2 threads and rejects bad steps") {
  const std::int64_t n = 200001;
  REQUIRE(n >= cpu::kMinParallelWork);
  const auto p0 = cast_to<float>(random_normal(n, "adamd.p"));
  const auto g = cast_to<float>(random_normal(n, "adamd.g"));
  const math::AdamWParams hp{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f};
  const auto run = [&](int threads) {
    std::vector<float> p = p0, m(n, 0.0f), v(n, 0.0f);
    with_threads(threads, [&] {
      for (int step = 1; step <= 3; ++step) cpu::adamw_update(p.data(), m.data(), v.data(), g.data(), n, hp, step);
    });
    p.insert(p.end(), m.begin(), m.end());
    p.insert(p.end(), v.begin(), v.end());
    return p;
  };
  CHECK(bitwise_equal(run(1), run(2)));
  std::vector<float> p = p0, m(n), v(n);
  CHECK_THROWS_WITH_AS(cpu::adamw_update(p.data(), m.data(), v.data(), g.data(), n, hp, 0), doctest::Contains("step"),
                       Error);
  CHECK_THROWS_AS(
      cpu::adamw_update(p.data(), m.data(), v.data(), g.data(), n, hp, 1, std::numeric_limits<float>::infinity()),
      Error);
}

// =======================================================================================
// Sum of squares

TEST_CASE_TEMPLATE("sum_of_squares matches a long double sum across block and batch boundaries", T, double, float) {
  for (std::int64_t n :
       {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, cpu::kReduceBlock - 1, cpu::kReduceBlock,
        cpu::kReduceBlock + 1, 3 * cpu::kReduceBlock + 5, cpu::kReduceBlock * cpu::kReduceBatch + 17}) {
    CAPTURE(n);
    const auto x = cast_to<T>(random_normal(n, "sos.x." + std::to_string(n), 0.01));
    long double expected = 0;
    for (T v : x) expected += static_cast<long double>(v) * static_cast<long double>(v);
    const double got = cpu::sum_of_squares(x.data(), n);
    CHECK(std::fabs(got - static_cast<double>(expected)) <= 1e-12 * static_cast<double>(expected));
  }
}

TEST_CASE("sum_of_squares is bitwise identical for 1, 2 and 3 threads and equals its blocks summed in order") {
  const std::int64_t n = cpu::kReduceBlock * cpu::kReduceBatch + 3 * cpu::kReduceBlock + 11;  // two batches
  const auto x = cast_to<float>(random_normal(n, "sosd.x"));
  double one = 0, two = 0, three = 0;
  with_threads(1, [&] { one = cpu::sum_of_squares(x.data(), n); });
  with_threads(2, [&] { two = cpu::sum_of_squares(x.data(), n); });
  with_threads(3, [&] { three = cpu::sum_of_squares(x.data(), n); });
  CHECK(std::memcmp(&one, &two, sizeof(double)) == 0);
  CHECK(std::memcmp(&one, &three, sizeof(double)) == 0);
  // The contract a sharded caller relies on: blocks of kReduceBlock, added in index order.
  double in_order = 0;
  for (std::int64_t begin = 0; begin < n; begin += cpu::kReduceBlock) {
    in_order += cpu::block_sum_of_squares(x.data() + begin, std::min(cpu::kReduceBlock, n - begin));
  }
  CHECK(std::memcmp(&one, &in_order, sizeof(double)) == 0);
}

// =======================================================================================
// Low-precision storage

TEST_CASE("bf16 storage: layernorm, gelu and add round the float kernel's result") {
  const std::int64_t rows = 6, C = 100, n = rows * C;
  const auto xb = cast_to<bf16>(random_normal(n, "bf.x"));
  const auto yb = cast_to<bf16>(random_normal(n, "bf.y"));
  const auto wb = cast_to<bf16>(random_normal(C, "bf.w", 0.2, 1.0));
  const auto bb = cast_to<bf16>(random_normal(C, "bf.b", 0.2));
  const auto widen = [](const std::vector<bf16>& v) { return cast_to<float>(to_double(v)); };
  const auto xf = widen(xb), yf = widen(yb), wf = widen(wb), bf = widen(bb);

  std::vector<bf16> ln_b(n), gelu_b(n), add_b(n);
  std::vector<float> ln_f(n), gelu_f(n), add_f(n), mean(rows), rstd(rows);
  cpu::layernorm_forward(ln_b.data(), mean.data(), rstd.data(), xb.data(), wb.data(), bb.data(), rows, C);
  cpu::layernorm_forward(ln_f.data(), mean.data(), rstd.data(), xf.data(), wf.data(), bf.data(), rows, C);
  cpu::gelu_forward(gelu_b.data(), xb.data(), n);
  cpu::gelu_forward(gelu_f.data(), xf.data(), n);
  cpu::add(add_b.data(), xb.data(), yb.data(), n);
  cpu::add(add_f.data(), xf.data(), yf.data(), n);
  // At most one bf16 ulp apart (the float path may be vectorized differently).
  const auto near = [](bf16 a, float f) {
    const int d = static_cast<int>(a.bits) - static_cast<int>(bf16(f).bits);
    return d >= -1 && d <= 1;
  };
  for (std::int64_t i = 0; i < n; ++i) {
    REQUIRE(near(ln_b[i], ln_f[i]));
    REQUIRE(near(gelu_b[i], gelu_f[i]));
    REQUIRE(near(add_b[i], add_f[i]));
  }
}
