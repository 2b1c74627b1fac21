// The CPU RMSNorm kernel (backend/cpu/rmsnorm.hpp): forward against a naive long double
// reference, backward against central finite differences of the double instantiation,
// the float instantiation against the double one, bf16 storage against the float
// kernel, bitwise independence of the OpenMP thread count, and the shape errors. The
// kernels fused with the residual add (residual_rmsnorm_forward, _backward) bit for bit
// against the unfused sequences they replace, and models::PreNormBlock of Llama's parts,
// which uses them, bit for bit against the same block running the unfused calls.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_test_util.hpp"
#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/backend/cpu/elementwise.hpp"
#include "llmpar/backend/cpu/rmsnorm.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/models/llama.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/rmsnorm.hpp"

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
  for (const Dims s : {Dims{1, 1}, Dims{1, 7}, Dims{3, 13}, Dims{2, 64}, Dims{5, 257}, Dims{4, 300}, Dims{2, 1029}}) {
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

namespace {

template <class T>
void append(std::vector<double>& all, const std::vector<T>& v) {
  const auto d = to_double(v);
  all.insert(all.end(), d.begin(), d.end());
}

// The fused kernels, or the unfused sequences they replace (models::PreNormBlock's calls
// before the fusion: add_inplace then rmsnorm_forward; rmsnorm_backward then
// add_inplace), on the same inputs: every output (the residual sum, out, rstd, dx,
// dweight accumulated onto 0.25), widened exactly, so that equal bits are equal vectors.
template <class T>
std::vector<double> residual_rmsnorm_run(std::int64_t rows, std::int64_t C, bool fused, int threads) {
  using Acc = cpu::acc_t<T>;
  const std::string tag = std::to_string(rows) + "x" + std::to_string(C);
  std::vector<T> residual = cast_to<T>(random_normal(rows * C, "rmsr.residual." + tag, 2.0, 0.5));
  const auto delta = cast_to<T>(random_normal(rows * C, "rmsr.delta." + tag));
  const auto w = cast_to<T>(random_normal(C, "rmsr.w." + tag, 0.3, 1.0));
  const auto dout = cast_to<T>(random_normal(rows * C, "rmsr.dout." + tag));
  const auto dresidual = cast_to<T>(random_normal(rows * C, "rmsr.dresidual." + tag));
  std::vector<T> out(residual.size()), dx = cast_to<T>(random_normal(rows * C, "rmsr.garbage." + tag));
  std::vector<Acc> rstd(static_cast<std::size_t>(rows)), dw(static_cast<std::size_t>(C), Acc(0.25));
  with_threads(threads, [&] {
    if (fused) {
      cpu::residual_rmsnorm_forward(out.data(), rstd.data(), residual.data(), delta.data(), w.data(), rows, C);
      cpu::residual_rmsnorm_backward(dx.data(), dw.data(), dout.data(), dresidual.data(), residual.data(), w.data(),
                                     rstd.data(), rows, C);
    } else {
      cpu::add_inplace(residual.data(), delta.data(), rows * C);
      cpu::rmsnorm_forward(out.data(), rstd.data(), residual.data(), w.data(), rows, C);
      cpu::rmsnorm_backward(dx.data(), dw.data(), dout.data(), residual.data(), w.data(), rstd.data(), rows, C);
      cpu::add_inplace(dx.data(), dresidual.data(), rows * C);
    }
  });
  std::vector<double> all;
  append(all, residual);
  append(all, out);
  append(all, rstd);
  append(all, dx);
  append(all, dw);
  return all;
}

}  // namespace

TEST_CASE_TEMPLATE(
    "residual_rmsnorm_forward and _backward are add_inplace + rmsnorm_forward and rmsnorm_backward + add_inplace, bit "
    "for bit, on ragged shapes and for 1 and 3 OpenMP threads",
    T, float, bf16, f16, double) {
  // The last shape is enough work to go parallel (and 3+ column tiles in backward).
  REQUIRE(std::int64_t{515} * 200 >= cpu::kMinParallelWork);
  for (const Dims s : {Dims{1, 1}, Dims{1, 7}, Dims{3, 13}, Dims{2, 64}, Dims{5, 257}, Dims{2, 1029}, Dims{515, 200}}) {
    CAPTURE(s.rows);
    CAPTURE(s.C);
    const std::vector<double> unfused = residual_rmsnorm_run<T>(s.rows, s.C, false, 1);
    for (const int threads : {1, 3}) {
      CAPTURE(threads);
      const std::vector<double> fused = residual_rmsnorm_run<T>(s.rows, s.C, true, threads);
      CHECK(bitwise_equal(fused, unfused));
    }
  }
  // dresidual is the residual stream's gradient and must be given.
  std::vector<T> v(4);
  std::vector<cpu::acc_t<T>> a(4);
  CHECK_THROWS_WITH_AS(cpu::residual_rmsnorm_backward(v.data(), a.data(), v.data(), static_cast<const T*>(nullptr),
                                                      v.data(), v.data(), a.data(), 1, 4),
                       doctest::Contains("residual_rmsnorm_backward: dresidual is null"), Error);
  CHECK_THROWS_WITH_AS(cpu::residual_rmsnorm_forward(v.data(), a.data(), v.data(), v.data(), v.data(), 1, 0),
                       doctest::Contains("residual_rmsnorm_forward: rows = 1, C = 0"), Error);
}

namespace {

// nn::RMSNorm without forward_residual and backward_residual: models::PreNormBlock then
// runs the residual adds as passes of their own, as it did before the fusion.
template <class T>
class UnfusedRMSNorm {
 public:
  using Saved = typename nn::RMSNorm<T>::Saved;
  explicit UnfusedRMSNorm(nn::RMSNorm<T> norm) : norm_(std::move(norm)) {}
  void forward(backend::cpu::Context& ctx, Saved& saved, T* out, const T* x, std::int64_t rows) {
    norm_.forward(ctx, saved, out, x, rows);
  }
  void backward(backend::cpu::Context& ctx, const Saved& saved, T* dx, const T* dout, const T* x, std::int64_t rows) {
    norm_.backward(ctx, saved, dx, dout, x, rows);
  }
  template <class Visit>
  void parameters(Visit&& visit) {
    norm_.parameters(visit);
  }

 private:
  nn::RMSNorm<T> norm_;
};

template <class T>
struct UnfusedLlamaParts : models::LlamaParts<T, backend::Cpu> {
  using Base = models::LlamaParts<T, backend::Cpu>;
  using Norm = UnfusedRMSNorm<T>;
  static Norm attention_norm(const std::string& block, const models::LlamaConfig& cfg) {
    return Norm(Base::attention_norm(block, cfg));
  }
  static Norm mlp_norm(const std::string& block, const models::LlamaConfig& cfg) {
    return Norm(Base::mlp_norm(block, cfg));
  }
};

// Forward and backward of one block on two micro-batches in flight: the outputs, the
// input gradients and the parameter gradients, widened exactly.
template <class Block, class T>
std::vector<double> block_run() {
  backend::cpu::Context ctx;
  models::LlamaConfig cfg{.layers = 2, .heads = 4, .kv_heads = 2, .dim = 64, .ffn_dim = 160, .max_seq = 32};
  cfg.init_std = 0.2f;
  Block block("layers.0", cfg);
  nn::ParameterStore<T> store;
  store.bind(block);
  store.initialize(5);
  const std::int64_t B = 2, S = 16, n = B * S * cfg.dim;
  std::vector<T> x[2], dout[2], out[2], dx[2];
  typename Block::Saved saved[2];
  for (int m = 0; m < 2; ++m) {
    x[m] = cast_to<T>(random_normal(n, "block.x." + std::to_string(m)));
    dout[m] = cast_to<T>(random_normal(n, "block.dout." + std::to_string(m)));
    out[m].resize(static_cast<std::size_t>(n));
    dx[m].resize(static_cast<std::size_t>(n));
    block.forward(ctx, saved[m], out[m].data(), x[m].data(), B, S);
  }
  for (int m = 0; m < 2; ++m) block.backward(ctx, saved[m], dx[m].data(), dout[m].data(), x[m].data(), B, S);
  std::vector<double> all;
  for (int m = 0; m < 2; ++m) {
    append(all, out[m]);
    append(all, dx[m]);
  }
  for (std::int64_t i = 0; i < store.flat_size(); ++i) all.push_back(static_cast<double>(store.grads()[i]));
  return all;
}

}  // namespace

TEST_CASE_TEMPLATE(
    "PreNormBlock of Llama's parts fuses the residual adds into its RMSNorms and computes the unfused block's "
    "outputs, input gradients and parameter gradients bit for bit",
    T, float, bf16) {
  using Fused = models::LlamaBlock<T>;
  using Unfused = models::PreNormBlock<UnfusedLlamaParts<T>, T, backend::Cpu>;
  static_assert(Fused::kFusedResidual, "nn::RMSNorm on the CPU backend has forward_residual and backward_residual");
  static_assert(!Unfused::kFusedResidual, "the wrapper hides them, so the block falls back to the unfused calls");
  static_assert(!models::GPT2Block<T>::kFusedResidual, "GPT-2's LayerNorm blocks keep their unfused adds");
  const std::vector<double> fused = block_run<Fused, T>(), unfused = block_run<Unfused, T>();
  CHECK(bitwise_equal(fused, unfused));
  CHECK(std::any_of(fused.begin(), fused.end(), [](double v) { return v != 0.0; }));
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
