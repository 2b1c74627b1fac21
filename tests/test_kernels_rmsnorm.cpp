// The CPU RMSNorm kernel (backend/cpu/rmsnorm.hpp): forward against a naive long double
// reference, backward against central finite differences of the double instantiation,
// the float instantiation against the double one, bf16 storage against the float
// kernel, bitwise independence of the OpenMP thread count, and the shape errors.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_test_util.hpp"
#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/backend/cpu/rmsnorm.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"

using namespace llmpar;
namespace cpu = llmpar::backend::cpu;
using namespace llmpar::kernel_test;

namespace {

// RMSNorm's eps as the kernels receive it (a float).
constexpr double kEps = static_cast<double>(1e-5f);

struct Dims {
  std::int64_t rows, C;
};

double max_abs(const std::vector<double>& a) {
  double m = 0.0;
  for (const double v : a) m = std::max(m, std::fabs(v));
  return m;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// out = x / sqrt(mean(x^2) + eps) * w, in long double.
void rmsnorm_reference(std::vector<double>& out, std::vector<double>& rstd, const std::vector<double>& x,
                       const std::vector<double>& w, std::int64_t rows, std::int64_t C, double eps) {
  out.assign(static_cast<std::size_t>(rows * C), 0.0);
  rstd.assign(static_cast<std::size_t>(rows), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    long double ms = 0;
    for (std::int64_t c = 0; c < C; ++c) ms += static_cast<long double>(x[r * C + c]) * x[r * C + c];
    ms /= C;
    const long double s = 1.0L / std::sqrt(ms + eps);
    for (std::int64_t c = 0; c < C; ++c) out[r * C + c] = static_cast<double>(x[r * C + c] * s * w[c]);
    rstd[r] = static_cast<double>(s);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("rmsnorm_forward matches the naive reference, on ragged shapes", T, double, float) {
  const double tol = std::is_same_v<T, double> ? 1e-13 : 2e-6;
  for (const Dims s :
       {Dims{1, 1}, Dims{1, 7}, Dims{3, 13}, Dims{2, 64}, Dims{5, 257}, Dims{4, 300}, Dims{2, 1029}}) {
    CAPTURE(s.rows);
    CAPTURE(s.C);
    const std::string tag = std::to_string(s.rows) + "x" + std::to_string(s.C);
    const auto x = cast_to<T>(random_normal(s.rows * s.C, "rms.x." + tag, 2.0, 0.5));
    const auto w = cast_to<T>(random_normal(s.C, "rms.w." + tag, 0.3, 1.0));
    std::vector<T> out(x.size());
    std::vector<cpu::acc_t<T>> rstd(static_cast<std::size_t>(s.rows));
    cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), s.rows, s.C);
    std::vector<double> out_ref, rstd_ref;
    rmsnorm_reference(out_ref, rstd_ref, to_double(x), to_double(w), s.rows, s.C, kEps);
    CHECK(relative_error(out, out_ref) < tol);
    CHECK(relative_error(rstd, rstd_ref) < tol);
    // Without rstd (inference) the output is the same.
    std::vector<T> out_no_stats(x.size());
    cpu::rmsnorm_forward(out_no_stats.data(), static_cast<cpu::acc_t<T>*>(nullptr), x.data(), w.data(), s.rows, s.C);
    CHECK(bitwise_equal(out, out_no_stats));
  }
}

TEST_CASE("rmsnorm_forward of an all-zero row is zero with rstd = 1/sqrt(eps), and honours eps") {
  const std::int64_t C = 9;
  const std::vector<float> x(C, 0.0f), w(C, 2.0f);
  std::vector<float> out(C, 7.0f), rstd(1);
  cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), 1, C);
  CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 0.0f; }));
  CHECK(rstd[0] == doctest::Approx(1.0 / std::sqrt(kEps)).epsilon(1e-6));
  // A constant row of 3 with eps = 7: mean square 9, rstd = 1/4.
  const std::vector<float> threes(C, 3.0f);
  cpu::rmsnorm_forward(out.data(), rstd.data(), threes.data(), w.data(), 1, C, 7.0f);
  CHECK(rstd[0] == 0.25f);
  CHECK(out[0] == 1.5f);
}

TEST_CASE("rmsnorm_backward matches finite differences in double; dx overwritten, dweight accumulated") {
  for (const Dims s : {Dims{1, 1}, Dims{1, 5}, Dims{3, 13}, Dims{2, 70}}) {
    CAPTURE(s.rows);
    CAPTURE(s.C);
    const std::string tag = std::to_string(s.rows) + "x" + std::to_string(s.C);
    std::vector<double> x = random_normal(s.rows * s.C, "rmsb.x." + tag, 1.5, 0.3);
    std::vector<double> w = random_normal(s.C, "rmsb.w." + tag, 0.5, 1.0);
    const std::vector<double> probe = random_normal(s.rows * s.C, "rmsb.probe." + tag);  // loss = <out, probe>
    std::vector<double> out(x.size()), rstd(static_cast<std::size_t>(s.rows));
    const auto loss = [&] {
      cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), s.rows, s.C);
      return dot(out, probe);
    };
    const std::vector<double> fd_x = finite_difference(x, loss);
    const std::vector<double> fd_w = finite_difference(w, loss);

    loss();                                     // rstd of the unperturbed input
    std::vector<double> dx(x.size(), 12345.0);  // overwritten
    const std::vector<double> dw0 = random_normal(s.C, "rmsb.dw0." + tag);
    std::vector<double> dw = dw0;
    cpu::rmsnorm_backward(dx.data(), dw.data(), probe.data(), x.data(), w.data(), rstd.data(), s.rows, s.C);
    // With C = 1, dx = w dout eps / (x^2 + eps)^(3/2) is ~1e-5: compared at the scale of
    // the other gradients (1), not its own, since the differences carry ~1e-11 of noise.
    const double dx_scale = s.C == 1 ? 1.0 : 0.0;
    CHECK(max_abs_diff(dx, fd_x) / std::max(dx_scale, max_abs(fd_x)) < kFdTolerance);
    CHECK(relative_error(minus(dw, dw0), fd_w) < kFdTolerance);
  }
}

TEST_CASE("rmsnorm float instantiation matches double, forward and backward") {
  const std::int64_t rows = 37, C = 515;
  const auto xd = to_double(cast_to<float>(random_normal(rows * C, "rmsf.x", 1.0, 0.2)));
  const auto wd = to_double(cast_to<float>(random_normal(C, "rmsf.w", 0.2, 1.0)));
  const auto gd = to_double(cast_to<float>(random_normal(rows * C, "rmsf.dout")));
  const auto xf = cast_to<float>(xd), wf = cast_to<float>(wd), gf = cast_to<float>(gd);

  std::vector<double> out_d(xd.size()), rstd_d(rows), dx_d(xd.size()), dw_d(C, 0.0);
  cpu::rmsnorm_forward(out_d.data(), rstd_d.data(), xd.data(), wd.data(), rows, C);
  cpu::rmsnorm_backward(dx_d.data(), dw_d.data(), gd.data(), xd.data(), wd.data(), rstd_d.data(), rows, C);
  std::vector<float> out_f(xf.size()), rstd_f(rows), dx_f(xf.size()), dw_f(C, 0.0f);
  cpu::rmsnorm_forward(out_f.data(), rstd_f.data(), xf.data(), wf.data(), rows, C);
  cpu::rmsnorm_backward(dx_f.data(), dw_f.data(), gf.data(), xf.data(), wf.data(), rstd_f.data(), rows, C);
  CHECK(relative_error(out_f, out_d) < 2e-6);
  CHECK(relative_error(rstd_f, rstd_d) < 2e-6);
  CHECK(relative_error(dx_f, dx_d) < 1e-5);
  CHECK(relative_error(dw_f, dw_d) < 1e-5);
}

TEST_CASE("rmsnorm forward and backward are bitwise identical for 1, 2 and 3 OpenMP threads") {
  const std::int64_t rows = 515, C = 200;  // 3+ column tiles, and enough work to go parallel
  REQUIRE(rows * C >= cpu::kMinParallelWork);
  const auto x = cast_to<float>(random_normal(rows * C, "rmsd.x"));
  const auto w = cast_to<float>(random_normal(C, "rmsd.w", 0.2, 1.0));
  const auto g = cast_to<float>(random_normal(rows * C, "rmsd.dout"));
  std::vector<float> out(x.size()), rstd(rows);
  cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), rows, C);
  const auto run = [&](int threads) {
    std::vector<float> dx(x.size()), dw(C, 0.25f), fwd(x.size()), rs(rows);
    with_threads(threads, [&] {
      cpu::rmsnorm_forward(fwd.data(), rs.data(), x.data(), w.data(), rows, C);
      cpu::rmsnorm_backward(dx.data(), dw.data(), g.data(), x.data(), w.data(), rstd.data(), rows, C);
      // Twice: the second call accumulates onto the first.
      cpu::rmsnorm_backward(dx.data(), dw.data(), g.data(), x.data(), w.data(), rstd.data(), rows, C);
    });
    std::vector<float> all = fwd;
    all.insert(all.end(), rs.begin(), rs.end());
    all.insert(all.end(), dx.begin(), dx.end());
    all.insert(all.end(), dw.begin(), dw.end());
    return all;
  };
  const std::vector<float> one = run(1);
  CHECK(bitwise_equal(one, run(2)));
  CHECK(bitwise_equal(one, run(3)));
}

TEST_CASE("bf16 storage: rmsnorm rounds the float kernel's result") {
  const std::int64_t rows = 6, C = 100, n = rows * C;
  const auto xb = cast_to<bf16>(random_normal(n, "rmsbf.x"));
  const auto wb = cast_to<bf16>(random_normal(C, "rmsbf.w", 0.2, 1.0));
  const auto xf = cast_to<float>(to_double(xb)), wf = cast_to<float>(to_double(wb));
  std::vector<bf16> out_b(n);
  std::vector<float> out_f(n), rstd_b(rows), rstd_f(rows);
  cpu::rmsnorm_forward(out_b.data(), rstd_b.data(), xb.data(), wb.data(), rows, C);
  cpu::rmsnorm_forward(out_f.data(), rstd_f.data(), xf.data(), wf.data(), rows, C);
  // The same float arithmetic on the same values, though the two instantiations may be
  // vectorized differently (a different order of the sum of squares): within a few float
  // ulps, and the outputs at most one bf16 ulp apart.
  CHECK(relative_error(rstd_b, rstd_f) < 1e-6);
  for (std::int64_t i = 0; i < n; ++i) {
    const int d = static_cast<int>(out_b[i].bits) - static_cast<int>(bf16(out_f[i]).bits);
    REQUIRE((d >= -1 && d <= 1));
  }
}

TEST_CASE("rmsnorm rejects shapes and eps it cannot normalize, naming the value") {
  std::vector<float> v(4);
  CHECK_THROWS_WITH_AS(cpu::rmsnorm_forward(v.data(), v.data(), v.data(), v.data(), 1, 0),
                       doctest::Contains("rmsnorm_forward: rows = 1, C = 0"), Error);
  CHECK_THROWS_WITH_AS(cpu::rmsnorm_forward(v.data(), v.data(), v.data(), v.data(), -2, 4),
                       doctest::Contains("rows = -2"), Error);
  CHECK_THROWS_WITH_AS(cpu::rmsnorm_forward(v.data(), v.data(), v.data(), v.data(), 1, 4, -1.0f),
                       doctest::Contains("eps = -1"), Error);
  CHECK_THROWS_WITH_AS(cpu::rmsnorm_forward(v.data(), v.data(), v.data(), v.data(), 1, 4, std::nanf("")),
                       doctest::Contains("eps = nan"), Error);
  CHECK_THROWS_WITH_AS(cpu::rmsnorm_backward(v.data(), v.data(), v.data(), v.data(), v.data(), v.data(), -1, 4),
                       doctest::Contains("rmsnorm_backward: rows = -1"), Error);
  CHECK_THROWS_WITH_AS(cpu::rmsnorm_backward(v.data(), v.data(), v.data(), v.data(), v.data(), v.data(), 2, 0),
                       doctest::Contains("C = 0"), Error);
  // No rows is not an error, and touches nothing.
  std::vector<float> w(4, 1.0f), dw(4, 0.5f);
  CHECK_NOTHROW(cpu::rmsnorm_forward(v.data(), v.data(), v.data(), w.data(), 0, 4));
  CHECK_NOTHROW(cpu::rmsnorm_backward(v.data(), dw.data(), v.data(), v.data(), w.data(), v.data(), 0, 4));
  CHECK(dw == std::vector<float>(4, 0.5f));
}
