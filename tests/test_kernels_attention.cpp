// Online softmax, flash attention and fused cross-entropy: each against a naive double
// reference, gradients against central finite differences in double, and bitwise
// independence of the thread count.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cpu/attention.hpp"
#include "llmpar/backend/cpu/attention_block.hpp"
#include "llmpar/backend/cpu/cross_entropy.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/math/online_softmax.hpp"

using namespace llmpar;
namespace cpu = llmpar::backend::cpu;

namespace {

std::vector<double> random_normal(std::int64_t n, const char* name, double stddev = 1.0) {
  const auto stream = rng::Stream::named(1234, name);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[i] = stddev * stream.normal(static_cast<std::uint64_t>(i));
  return v;
}

// Rounds to T (through float for float, bf16 and f16).
template <class T>
std::vector<T> cast_to(const std::vector<double>& v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    std::vector<T> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<T>(static_cast<float>(v[i]));
    return out;
  }
}

template <class T>
std::vector<double> to_double(const std::vector<T>& v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    std::vector<double> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<double>(static_cast<float>(v[i]));
    return out;
  }
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::fabs(x));
  return m;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Runs f with n OpenMP threads and restores the previous setting.
template <class F>
void with_threads(int n, F&& f) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(n);
  f();
  omp_set_num_threads(before);
}

// ---- attention reference: the T x T softmax materialised, in double -------------------

// C: the query channels NH·hs; KVH: kv heads (0: NH, multi-head attention).
struct AttnShape {
  std::int64_t B, T, C, NH, KVH = 0;
  AttentionShape shape() const { return {B, T, NH, KVH > 0 ? KVH : NH, C / NH}; }
  std::int64_t row() const { return shape().row(); }  // a qkv row
  std::int64_t qkv_size() const { return B * T * row(); }
};

void attention_reference(std::vector<double>& out, std::vector<double>& lse, const std::vector<double>& qkv,
                         const AttnShape& s) {
  const AttentionShape a = s.shape();
  const std::int64_t hs = a.head_dim, R = a.row();
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  out.assign(static_cast<std::size_t>(s.B * s.T * s.C), 0.0);
  lse.assign(static_cast<std::size_t>(s.B * s.NH * s.T), 0.0);
  std::vector<double> att(static_cast<std::size_t>(s.T * s.T));
  for (std::int64_t b = 0; b < s.B; ++b) {
    for (std::int64_t h = 0; h < s.NH; ++h) {
      const std::int64_t g = h % a.kv_heads;  // the kv head query head h reads
      auto q = [&](std::int64_t t, std::int64_t d) { return qkv[(b * s.T + t) * R + h * hs + d]; };
      auto k = [&](std::int64_t t, std::int64_t d) { return qkv[(b * s.T + t) * R + a.q_dim() + g * hs + d]; };
      auto v = [&](std::int64_t t, std::int64_t d) {
        return qkv[(b * s.T + t) * R + a.q_dim() + a.kv_dim() + g * hs + d];
      };
      for (std::int64_t t = 0; t < s.T; ++t) {
        double m = -INFINITY;
        for (std::int64_t j = 0; j <= t; ++j) {
          double dot = 0;
          for (std::int64_t d = 0; d < hs; ++d) dot += q(t, d) * k(j, d);
          att[t * s.T + j] = dot * scale;
          m = std::max(m, dot * scale);
        }
        double sum = 0;
        for (std::int64_t j = 0; j <= t; ++j) sum += std::exp(att[t * s.T + j] - m);
        lse[(b * s.NH + h) * s.T + t] = m + std::log(sum);
        for (std::int64_t d = 0; d < hs; ++d) {
          double acc = 0;
          for (std::int64_t j = 0; j <= t; ++j) acc += std::exp(att[t * s.T + j] - m) / sum * v(j, d);
          out[(b * s.T + t) * s.C + h * hs + d] = acc;
        }
      }
    }
  }
}

template <class T>
void run_attention_forward(std::vector<T>& out, std::vector<cpu::acc_t<T>>& lse, const std::vector<T>& qkv,
                           const AttnShape& s) {
  out.assign(static_cast<std::size_t>(s.B * s.T * s.C), T{});
  lse.assign(static_cast<std::size_t>(s.B * s.NH * s.T), 0);
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.shape());
}

template <class T>
std::vector<T> run_attention_backward(const std::vector<T>& dout, const std::vector<T>& qkv, const AttnShape& s) {
  std::vector<T> out;
  std::vector<cpu::acc_t<T>> lse;
  run_attention_forward(out, lse, qkv, s);
  std::vector<T> dqkv(qkv.size(), static_cast<T>(123.0f));  // garbage: backward must overwrite
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.shape());
  return dqkv;
}

const AttnShape kForwardShapes[] = {
    {1, 1, 8, 1},        // one token: out = v
    {2, 7, 16, 2},       // hs = 8, generic head size
    {1, 33, 64, 1},      // hs = 64, NH = 1, T not a multiple of anything
    {2, 64, 64, 2},      // hs = 32, exactly one tile
    {1, 65, 64, 4},      // hs = 16, one row into the second tile
    {1, 130, 128, 2},    // hs = 64, three tiles, ragged last tile
    {1, 70, 24, 1},      // hs = 24, generic head size over two tiles
    {1, 40, 256, 2},     // hs = 128
    {2, 70, 128, 4, 2},  // grouped-query: 2 query heads per kv head, hs = 32, two tiles
    {1, 65, 96, 6, 2},   // 3 query heads per kv head, hs = 16
    {1, 33, 128, 4, 1},  // multi-query: one kv head
    {1, 37, 160, 2},     // hs = 80, generic head size (the CUDA kernels' references reach 256)
    {1, 66, 256, 1},     // hs = 256, generic head size over two tiles
};

}  // namespace

// ---- online softmax ---------------------------------------------------------------------

TEST_CASE_TEMPLATE("OnlineSoftmax combine of any split equals pushing the whole row", Acc, float, double) {
  const std::vector<double> x = random_normal(1000, "online_softmax.row", 4.0);
  math::OnlineSoftmax<Acc> sequential;
  for (double v : x) sequential.push(static_cast<Acc>(v));
  double m = -INFINITY;
  for (double v : x) m = std::max(m, static_cast<double>(static_cast<Acc>(v)));
  double sum = 0;
  for (double v : x) sum += std::exp(static_cast<double>(static_cast<Acc>(v)) - m);
  CHECK(sequential.max == static_cast<Acc>(m));
  const double tol = std::is_same_v<Acc, float> ? 2e-6 : 1e-14;
  CHECK(std::fabs(sequential.log_sum_exp() - (m + std::log(sum))) <= tol * std::fabs(m + std::log(sum)));

  const auto cuts = rng::Stream::named(7, "online_softmax.cuts");
  for (int trial = 0; trial < 50; ++trial) {
    // 1..8 cut points at random positions (empty parts allowed), combined left to right.
    const int parts = 1 + static_cast<int>(cuts.uniform(trial * 16) * 8);
    std::vector<std::size_t> at{0, x.size()};
    for (int p = 0; p < parts; ++p) at.push_back(static_cast<std::size_t>(cuts.uniform(trial * 16 + 1 + p) * x.size()));
    std::sort(at.begin(), at.end());
    math::OnlineSoftmax<Acc> combined;
    for (std::size_t p = 0; p + 1 < at.size(); ++p) {
      math::OnlineSoftmax<Acc> part;
      for (std::size_t i = at[p]; i < at[p + 1]; ++i) part.push(static_cast<Acc>(x[i]));
      combined.combine(part);
    }
    REQUIRE(combined.max == sequential.max);  // the max is exact in any order
    CHECK(std::fabs(combined.sum - sequential.sum) <= 4 * tol * sequential.sum);
  }
}

TEST_CASE("OnlineSoftmax combine is bitwise commutative and the empty state is its identity") {
  const std::vector<double> x = random_normal(300, "online_softmax.commute", 3.0);
  math::OnlineSoftmax<float> a, b;
  for (std::size_t i = 0; i < 170; ++i) a.push(static_cast<float>(x[i]));
  for (std::size_t i = 170; i < x.size(); ++i) b.push(static_cast<float>(x[i]));
  math::OnlineSoftmax<float> ab = a, ba = b;
  ab.combine(b);
  ba.combine(a);
  CHECK(ab.max == ba.max);
  CHECK(ab.sum == ba.sum);
  math::OnlineSoftmax<float> empty, a_copy = a;
  a_copy.combine(empty);
  CHECK((a_copy.max == a.max && a_copy.sum == a.sum));
  empty.combine(a);
  CHECK((empty.max == a.max && empty.sum == a.sum));
  math::OnlineSoftmax<float> both_empty;
  both_empty.combine(math::OnlineSoftmax<float>{});
  CHECK(both_empty.sum == 0.0f);
  CHECK(both_empty.log_sum_exp() == -INFINITY);
  // A -inf element (a masked position) adds nothing and produces no NaN.
  math::OnlineSoftmax<float> masked;
  masked.push(-INFINITY);
  masked.push(1.0f);
  masked.push(-INFINITY);
  CHECK(masked.max == 1.0f);
  CHECK(masked.sum == 1.0f);
  // rescale moves the reference point and reports the factor for accumulators.
  math::OnlineSoftmax<double> r;
  r.push(0.0);
  r.push(-1.0);
  const double factor = r.rescale(2.0);
  CHECK(factor == doctest::Approx(std::exp(-2.0)));
  CHECK(r.log_sum_exp() == doctest::Approx(std::log(1.0 + std::exp(-1.0))));
}

// ---- attention ---------------------------------------------------------------------------

TEST_CASE_TEMPLATE("attention_forward matches a materialised T x T softmax reference", T, float, double) {
  for (const AttnShape& s : kForwardShapes) {
    CAPTURE(s.B);
    CAPTURE(s.T);
    CAPTURE(s.C);
    CAPTURE(s.NH);
    const std::vector<T> qkv = cast_to<T>(random_normal(s.qkv_size(), "attention.qkv", 1.5));
    std::vector<double> ref_out, ref_lse;
    attention_reference(ref_out, ref_lse, to_double(qkv), s);
    std::vector<T> out;
    std::vector<cpu::acc_t<T>> lse;
    run_attention_forward(out, lse, qkv, s);
    const double tol = std::is_same_v<T, float> ? 2e-6 : 1e-14;
    CHECK(max_abs_diff(to_double(out), ref_out) <= tol * (1.0 + max_abs(ref_out)));
    std::vector<double> lse_d(lse.begin(), lse.end());
    CHECK(max_abs_diff(lse_d, ref_lse) <= tol / 2 * (1.0 + max_abs(ref_lse)));
  }
}

TEST_CASE("attention_forward of one token copies its value row") {
  const AttnShape s{3, 1, 32, 4};
  const std::vector<float> qkv = cast_to<float>(random_normal(s.B * 3 * s.C, "attention.one"));
  std::vector<float> out;
  std::vector<float> lse;
  run_attention_forward(out, lse, qkv, s);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t c = 0; c < s.C; ++c) CHECK(out[b * s.C + c] == qkv[b * 3 * s.C + 2 * s.C + c]);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.NH; ++h) {
      // lse of a single score is the score itself.
      double dot = 0;
      for (std::int64_t d = 0; d < 8; ++d) dot += qkv[b * 3 * s.C + h * 8 + d] * qkv[b * 3 * s.C + s.C + h * 8 + d];
      CHECK(lse[b * s.NH + h] == doctest::Approx(dot / std::sqrt(8.0)).epsilon(1e-6));
    }
}

TEST_CASE("attention_backward matches central finite differences of sum(out * W) in double") {
  const AttnShape shapes[] = {
      {2, 7, 16, 2},       // hs = 8: generic head size, tails of every row kernel
      {1, 33, 64, 1},      // hs = 64 specialisation
      {1, 70, 64, 2},      // hs = 32 specialisation, two key tiles and the diagonal tile
      {1, 9, 24, 3, 1},    // multi-query: dk and dv summed over 3 query heads
      {2, 70, 128, 4, 2},  // grouped-query, hs = 32, two key tiles
  };
  for (const AttnShape& s : shapes) {
    CAPTURE(s.T);
    CAPTURE(s.C);
    CAPTURE(s.NH);
    CAPTURE(s.KVH);
    std::vector<double> qkv = random_normal(s.qkv_size(), "attention.fd.qkv");
    const std::vector<double> W = random_normal(s.B * s.T * s.C, "attention.fd.w");
    const std::vector<double> dqkv = run_attention_backward(W, qkv, s);
    auto loss = [&](const std::vector<double>& x) {
      std::vector<double> out;
      std::vector<double> lse;
      run_attention_forward(out, lse, x, s);
      double l = 0;
      for (std::size_t i = 0; i < out.size(); ++i) l += out[i] * W[i];
      return l;
    };
    // Every element for small shapes, a fixed random subset for the larger one.
    const std::int64_t n = static_cast<std::int64_t>(qkv.size());
    const std::int64_t checks = std::min<std::int64_t>(n, 400);
    const auto pick = rng::Stream::named(3, "attention.fd.pick");
    const double eps = 1e-5;
    double worst = 0, scale = 0;
    for (std::int64_t c = 0; c < checks; ++c) {
      const std::int64_t i = checks == n ? c : static_cast<std::int64_t>(pick.uniform(c) * n);
      const double saved = qkv[i];
      qkv[i] = saved + eps;
      const double up = loss(qkv);
      qkv[i] = saved - eps;
      const double down = loss(qkv);
      qkv[i] = saved;
      const double fd = (up - down) / (2 * eps);
      worst = std::max(worst, std::fabs(fd - dqkv[i]));
      scale = std::max(scale, std::fabs(fd));
    }
    CHECK(scale > 0.1);
    CHECK(worst <= 1e-7 * scale);
  }
}

TEST_CASE("attention_backward in float matches the double backward on the same inputs") {
  const AttnShape shapes[] = {{2, 7, 16, 2},   {1, 130, 128, 2}, {2, 64, 64, 2},     {1, 70, 24, 1},
                              {1, 65, 160, 2}, {1, 70, 256, 1},  {2, 70, 128, 4, 2}, {1, 65, 512, 4, 1}};
  for (const AttnShape& s : shapes) {
    CAPTURE(s.T);
    CAPTURE(s.C);
    const std::vector<float> qkv = cast_to<float>(random_normal(s.qkv_size(), "attention.fb.qkv", 1.5));
    const std::vector<float> dout = cast_to<float>(random_normal(s.B * s.T * s.C, "attention.fb.dout"));
    const std::vector<double> ref = run_attention_backward(to_double(dout), to_double(qkv), s);
    const std::vector<double> got = to_double(run_attention_backward(dout, qkv, s));
    CHECK(max_abs_diff(got, ref) <= 3e-6 * max_abs(ref));
  }
}

TEST_CASE("attention forward and backward are bitwise identical for 1, 2 and 3 threads") {
  for (const AttnShape& s : {AttnShape{2, 150, 128, 4},  // hs = 32, three query tiles, parallel at any thread count
                             AttnShape{2, 150, 128, 4, 2}}) {  // grouped-query
    CAPTURE(s.KVH);
    const std::vector<float> qkv = cast_to<float>(random_normal(s.qkv_size(), "attention.det.qkv"));
    const std::vector<float> dout = cast_to<float>(random_normal(s.B * s.T * s.C, "attention.det.dout"));
    std::vector<float> out[3], lse[3], dqkv[3];
    for (int n = 1; n <= 3; ++n) {
      with_threads(n, [&] {
        run_attention_forward(out[n - 1], lse[n - 1], qkv, s);
        dqkv[n - 1] = run_attention_backward(dout, qkv, s);
      });
    }
    for (int n = 2; n <= 3; ++n) {
      CAPTURE(n);
      CHECK(bitwise_equal(out[0], out[n - 1]));
      CHECK(bitwise_equal(lse[0], lse[n - 1]));
      CHECK(bitwise_equal(dqkv[0], dqkv[n - 1]));
    }
  }
}

TEST_CASE("attention stores bf16 and computes in float") {
  const AttnShape s{1, 40, 64, 2};
  const std::vector<bf16> qkv = cast_to<bf16>(random_normal(s.qkv_size(), "attention.bf16.qkv"));
  const std::vector<bf16> dout = cast_to<bf16>(random_normal(s.B * s.T * s.C, "attention.bf16.dout"));
  std::vector<double> ref_out, ref_lse;
  attention_reference(ref_out, ref_lse, to_double(qkv), s);
  std::vector<bf16> out;
  std::vector<float> lse;
  run_attention_forward(out, lse, qkv, s);
  CHECK(max_abs_diff(to_double(out), ref_out) <= 1e-2 * max_abs(ref_out));  // bf16 rounding of out
  std::vector<double> lse_d(lse.begin(), lse.end());
  CHECK(max_abs_diff(lse_d, ref_lse) <= 1e-5 * (1.0 + max_abs(ref_lse)));
  const std::vector<double> ref_d = run_attention_backward(to_double(dout), to_double(qkv), s);
  CHECK(max_abs_diff(to_double(run_attention_backward(dout, qkv, s)), ref_d) <= 2e-2 * max_abs(ref_d));
}

TEST_CASE("attention rejects kv heads that do not divide the query heads") {
  std::vector<float> qkv(10 * 8), out(6 * 8), lse(6), dqkv(qkv.size());
  const AttentionShape bad{1, 1, 6, 4, 8};
  CHECK_THROWS_WITH_AS(cpu::attention_forward(out.data(), lse.data(), qkv.data(), bad),
                       doctest::Contains("kv_heads = 4 does not divide the query heads 6"), llmpar::Error);
  CHECK_THROWS_WITH_AS(cpu::attention_backward(dqkv.data(), out.data(), qkv.data(), out.data(), lse.data(), bad),
                       doctest::Contains("pick --kv-heads a divisor of --heads"), llmpar::Error);
}

// ---- cross-entropy ------------------------------------------------------------------------

namespace {

// losses[r] = logsumexp(x[r, 0:V]) - x[r, t_r], in double.
std::vector<double> cross_entropy_reference(const std::vector<double>& logits, const std::vector<std::int32_t>& targets,
                                            std::int64_t rows, std::int64_t V, std::int64_t Vp) {
  std::vector<double> losses(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    double m = -INFINITY;
    for (std::int64_t i = 0; i < V; ++i) m = std::max(m, logits[r * Vp + i]);
    double sum = 0;
    for (std::int64_t i = 0; i < V; ++i) sum += std::exp(logits[r * Vp + i] - m);
    losses[r] = m + std::log(sum) - logits[r * Vp + targets[r]];
  }
  return losses;
}

std::vector<std::int32_t> random_targets(std::int64_t rows, std::int64_t V, const char* name) {
  const auto stream = rng::Stream::named(99, name);
  std::vector<std::int32_t> t(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r)
    t[r] = static_cast<std::int32_t>(stream.uniform(r) * V) % static_cast<std::int32_t>(V);
  return t;
}

struct VocabShape {
  std::int64_t rows, V, Vp;
};

const VocabShape kVocabShapes[] = {
    {3, 1, 1},        // a single class: loss 0, gradient 0
    {5, 7, 8},        // tiny, one padded column
    {4, 1024, 1024},  // exactly one statistics chunk
    {6, 3001, 3072},  // three chunks, ragged, 71 padded columns
    {2, 5000, 5000},  // no padding
};

}  // namespace

TEST_CASE_TEMPLATE("cross_entropy_forward and the fused kernel's losses match a double reference", T, float, double) {
  for (const VocabShape& s : kVocabShapes) {
    CAPTURE(s.V);
    std::vector<T> logits = cast_to<T>(random_normal(s.rows * s.Vp, "xent.logits", 3.0));
    const std::vector<std::int32_t> targets = random_targets(s.rows, s.V, "xent.targets");
    const std::vector<double> ref = cross_entropy_reference(to_double(logits), targets, s.rows, s.V, s.Vp);
    std::vector<cpu::acc_t<T>> losses(static_cast<std::size_t>(s.rows)), fused(losses.size());
    cpu::cross_entropy_forward(losses.data(), logits.data(), targets.data(), s.rows, s.V, s.Vp);
    cpu::cross_entropy_forward_backward(logits.data(), fused.data(), targets.data(), s.rows, s.V, s.Vp,
                                        cpu::acc_t<T>(1));
    const double tol = std::is_same_v<T, float> ? 5e-7 : 1e-14;
    for (std::int64_t r = 0; r < s.rows; ++r) {
      CHECK(std::fabs(losses[r] - ref[r]) <= tol * (1.0 + std::fabs(ref[r])));
      CHECK(fused[r] == losses[r]);  // same statistics code: identical bits
    }
  }
}

TEST_CASE("cross_entropy gradient matches central finite differences of the mean loss in double") {
  const std::int64_t rows = 4, V = 37, Vp = 40;
  const std::vector<double> logits = random_normal(rows * Vp, "xent.fd.logits", 2.0);
  const std::vector<std::int32_t> targets = random_targets(rows, V, "xent.fd.targets");
  const double dloss = 1.0 / rows;
  std::vector<double> grad = logits, losses(rows);
  cpu::cross_entropy_forward_backward(grad.data(), losses.data(), targets.data(), rows, V, Vp, dloss);
  auto mean_loss = [&](const std::vector<double>& x) {
    std::vector<double> l(rows);
    cpu::cross_entropy_forward(l.data(), x.data(), targets.data(), rows, V, Vp);
    double total = 0;
    for (double v : l) total += v;
    return total * dloss;
  };
  std::vector<double> x = logits;
  const double eps = 1e-5;
  double worst = 0, scale = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = 0; i < V; ++i) {
      const std::int64_t at = r * Vp + i;
      x[at] = logits[at] + eps;
      const double up = mean_loss(x);
      x[at] = logits[at] - eps;
      const double down = mean_loss(x);
      x[at] = logits[at];
      const double fd = (up - down) / (2 * eps);
      worst = std::max(worst, std::fabs(fd - grad[at]));
      scale = std::max(scale, std::fabs(fd));
    }
  }
  CHECK(scale > 0.05);
  CHECK(worst <= 1e-8 * scale);
  // Each row's gradient sums to zero (softmax minus a one-hot, times dloss).
  for (std::int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (std::int64_t i = 0; i < V; ++i) sum += grad[r * Vp + i];
    CHECK(std::fabs(sum) < 1e-15);
  }
}

TEST_CASE("cross_entropy ignores the padded columns and gives them a zero gradient") {
  const std::int64_t rows = 3, V = 50, Vp = 64;
  std::vector<float> logits = cast_to<float>(random_normal(rows * Vp, "xent.pad.logits"));
  const std::vector<std::int32_t> targets = random_targets(rows, V, "xent.pad.targets");
  std::vector<float> clean(rows), losses(rows);
  cpu::cross_entropy_forward(clean.data(), logits.data(), targets.data(), rows, V, Vp);
  // Padding holding NaN and huge values must not reach the loss.
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = V; i < Vp; ++i) logits[r * Vp + i] = (i % 2) ? NAN : 1e30f;
  cpu::cross_entropy_forward_backward(logits.data(), losses.data(), targets.data(), rows, V, Vp, 1.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    CHECK(losses[r] == clean[r]);
    for (std::int64_t i = V; i < Vp; ++i) CHECK(logits[r * Vp + i] == 0.0f);
    for (std::int64_t i = 0; i < V; ++i) CHECK(std::isfinite(logits[r * Vp + i]));
  }
}

namespace {

// The vocabulary-parallel loss run over `ranks` equal slices of (rows, Vp) logits: each
// slice's stats, gathered in rank order, then every slice's finish. Returns rank 0's
// losses (checking every rank computed the same bits) and the slices' dlogits put back
// into (rows, Vp).
template <class T>
std::vector<cpu::acc_t<T>> vocab_parallel_loss(const std::vector<T>& logits, std::vector<T>& dlogits,
                                               const std::vector<std::int32_t>& targets, std::int64_t rows,
                                               std::int64_t V, std::int64_t Vp, int ranks, cpu::acc_t<T> dloss) {
  using Acc = cpu::acc_t<T>;
  const std::int64_t Vlocal = Vp / ranks;
  std::vector<std::vector<T>> local(static_cast<std::size_t>(ranks), std::vector<T>(rows * Vlocal));
  std::vector<Acc> gathered(static_cast<std::size_t>(ranks * rows * cpu::kVocabStats));
  for (int k = 0; k < ranks; ++k) {
    for (std::int64_t r = 0; r < rows; ++r)
      std::copy_n(logits.begin() + r * Vp + k * Vlocal, Vlocal, local[k].begin() + r * Vlocal);
    cpu::vocab_parallel_cross_entropy_stats(gathered.data() + k * rows * cpu::kVocabStats, local[k].data(),
                                            targets.data(), rows, V, k * Vlocal, Vlocal);
  }
  std::vector<Acc> first(static_cast<std::size_t>(rows)), losses(first.size());
  dlogits.assign(logits.size(), T(0));
  for (int k = 0; k < ranks; ++k) {
    cpu::vocab_parallel_cross_entropy_finish(local[k].data(), losses.data(), local[k].data(), gathered.data(), ranks,
                                             targets.data(), rows, V, k * Vlocal, Vlocal, dloss);
    if (k == 0) first = losses;
    CHECK(losses == first);  // every rank: the same loss bits
    for (std::int64_t r = 0; r < rows; ++r)
      std::copy_n(local[k].begin() + r * Vlocal, Vlocal, dlogits.begin() + r * Vp + k * Vlocal);
  }
  return first;
}

}  // namespace

TEST_CASE_TEMPLATE("the vocabulary-parallel loss over 1, 2, 4 and 8 slices equals the fused kernel", T, float, double) {
  // Slices of the padded vocabulary: with 8 slices of 3072 / 8 = 384 columns the last
  // holds 313 vocabulary columns and 71 of padding; {5, 40, 64} over 4 leaves rank 3
  // nothing but padding (the empty softmax state).
  for (const VocabShape s : {VocabShape{6, 3001, 3072}, VocabShape{5, 40, 64}, VocabShape{4, 1024, 1024}}) {
    for (const int ranks : {1, 2, 4, 8}) {
      CAPTURE(s.V);
      CAPTURE(ranks);
      std::vector<T> logits = cast_to<T>(random_normal(s.rows * s.Vp, "xent.vp.logits", 3.0));
      for (std::int64_t r = 0; r < s.rows; ++r)
        for (std::int64_t i = s.V; i < s.Vp; ++i) logits[r * s.Vp + i] = T(NAN);  // padding never read
      const std::vector<std::int32_t> targets = random_targets(s.rows, s.V, "xent.vp.targets");
      const cpu::acc_t<T> dloss = cpu::acc_t<T>(1) / static_cast<cpu::acc_t<T>>(s.rows);
      std::vector<T> want = logits, got;
      std::vector<cpu::acc_t<T>> want_losses(static_cast<std::size_t>(s.rows));
      cpu::cross_entropy_forward_backward(want.data(), want_losses.data(), targets.data(), s.rows, s.V, s.Vp, dloss);
      const auto losses = vocab_parallel_loss(logits, got, targets, s.rows, s.V, s.Vp, ranks, dloss);
      const double tol = std::is_same_v<T, float> ? 2e-6 : 1e-14;
      for (std::int64_t r = 0; r < s.rows; ++r)
        CHECK(std::fabs(losses[r] - want_losses[r]) <= tol * (1 + want_losses[r]));
      double worst = 0.0;
      for (std::size_t i = 0; i < want.size(); ++i)
        worst = std::max(worst, std::fabs(double(got[i]) - double(want[i])));
      CHECK(worst <= tol * dloss);
      for (std::int64_t r = 0; r < s.rows; ++r)
        for (std::int64_t i = s.V; i < s.Vp; ++i) CHECK(got[r * s.Vp + i] == T(0));
    }
  }
}

TEST_CASE("the vocabulary-parallel loss without dlogits leaves the logits and names bad slices") {
  const std::int64_t rows = 3, V = 30, Vp = 32;
  const std::vector<float> logits = cast_to<float>(random_normal(rows * Vp, "xent.vp.eval"));
  const std::vector<std::int32_t> targets = random_targets(rows, V, "xent.vp.eval.targets");
  std::vector<float> stats(rows * cpu::kVocabStats), losses(rows), fused(rows);
  cpu::vocab_parallel_cross_entropy_stats(stats.data(), logits.data(), targets.data(), rows, V, 0, Vp);
  std::vector<float> copy = logits;
  cpu::vocab_parallel_cross_entropy_finish<float>(nullptr, losses.data(), copy.data(), stats.data(), 1, targets.data(),
                                                  rows, V, 0, Vp, 0.0f);
  CHECK(copy == logits);
  cpu::cross_entropy_forward(fused.data(), logits.data(), targets.data(), rows, V, Vp);
  for (std::int64_t r = 0; r < rows; ++r) CHECK(std::fabs(losses[r] - fused[r]) <= 2e-6f * (1 + fused[r]));
  CHECK_THROWS_WITH_AS(
      cpu::vocab_parallel_cross_entropy_stats(stats.data(), logits.data(), targets.data(), rows, V, -16, 16),
      doctest::Contains("v0 = -16, Vlocal = 16"), Error);
  CHECK_THROWS_WITH_AS(cpu::vocab_parallel_cross_entropy_finish(copy.data(), losses.data(), copy.data(), stats.data(),
                                                                0, targets.data(), rows, V, 0, Vp, 1.0f),
                       doctest::Contains("ranks = 0"), Error);
  std::vector<std::int32_t> bad = targets;
  bad[1] = static_cast<std::int32_t>(V);
  CHECK_THROWS_WITH_AS(cpu::vocab_parallel_cross_entropy_stats(stats.data(), logits.data(), bad.data(), rows, V, 0, Vp),
                       doctest::Contains("target token 30 at row 1 is outside the vocabulary [0, 30)"), Error);
}

TEST_CASE("cross_entropy names the row, the token and the vocabulary of an out-of-range target") {
  const std::int64_t rows = 8, V = 256, Vp = 256;
  std::vector<float> logits = cast_to<float>(random_normal(rows * Vp, "xent.bad.logits"));
  const std::vector<float> before = logits;
  std::vector<std::int32_t> targets = random_targets(rows, V, "xent.bad.targets");
  std::vector<float> losses(rows, 0.0f);
  targets[5] = 300;
  CHECK_THROWS_WITH_AS(
      cpu::cross_entropy_forward_backward(logits.data(), losses.data(), targets.data(), rows, V, Vp, 1.0f / rows),
      doctest::Contains("target token 300 at row 5 is outside the vocabulary [0, 256)"), llmpar::Error);
  CHECK(bitwise_equal(logits, before));  // validated before anything was written
  CHECK_THROWS_WITH_AS(cpu::cross_entropy_forward(losses.data(), logits.data(), targets.data(), rows, V, Vp),
                       doctest::Contains("target token 300 at row 5 is outside the vocabulary [0, 256)"),
                       llmpar::Error);
  targets[5] = 0;
  targets[2] = -1;
  CHECK_THROWS_WITH_AS(cpu::cross_entropy_forward(losses.data(), logits.data(), targets.data(), rows, V, Vp),
                       doctest::Contains("target token -1 at row 2 is outside the vocabulary [0, 256)"), llmpar::Error);
  CHECK_THROWS_WITH_AS(cpu::cross_entropy_forward(losses.data(), logits.data(), targets.data(), rows, 300, 256),
                       doctest::Contains("V = 300, Vp = 256"), llmpar::Error);
}

TEST_CASE("cross_entropy results are bitwise identical for 1, 2 and 3 threads") {
  const std::int64_t rows = 64, V = 2000, Vp = 2048;
  const std::vector<float> logits = cast_to<float>(random_normal(rows * Vp, "xent.det.logits", 2.0));
  const std::vector<std::int32_t> targets = random_targets(rows, V, "xent.det.targets");
  std::vector<float> grads[3], losses[3];
  for (int n = 1; n <= 3; ++n) {
    with_threads(n, [&] {
      grads[n - 1] = logits;
      losses[n - 1].assign(rows, 0.0f);
      cpu::cross_entropy_forward_backward(grads[n - 1].data(), losses[n - 1].data(), targets.data(), rows, V, Vp,
                                          1.0f / rows);
    });
  }
  CHECK(bitwise_equal(grads[0], grads[1]));
  CHECK(bitwise_equal(grads[0], grads[2]));
  CHECK(bitwise_equal(losses[0], losses[1]));
  CHECK(bitwise_equal(losses[0], losses[2]));
}

TEST_CASE("softmax_forward with a temperature matches the reference and sums to one") {
  const std::int64_t V = 2500;
  const std::vector<double> x = random_normal(V, "softmax.logits", 3.0);
  for (double temperature : {0.5, 1.0, 2.0}) {
    CAPTURE(temperature);
    std::vector<double> probs(V);
    cpu::softmax_forward(probs.data(), x.data(), V, temperature);
    double m = -INFINITY, sum = 0;
    for (double v : x) m = std::max(m, v / temperature);
    for (double v : x) sum += std::exp(v / temperature - m);
    double total = 0, worst = 0;
    for (std::int64_t i = 0; i < V; ++i) {
      worst = std::max(worst, std::fabs(probs[i] - std::exp(x[i] / temperature - m) / sum));
      total += probs[i];
    }
    CHECK(worst < 1e-14);
    CHECK(total == doctest::Approx(1.0).epsilon(1e-13));

    const std::vector<float> xf = cast_to<float>(x);
    std::vector<float> pf(V);
    cpu::softmax_forward(pf.data(), xf.data(), V, static_cast<float>(temperature));
    double total_f = 0;
    for (float p : pf) total_f += p;
    CHECK(total_f == doctest::Approx(1.0).epsilon(1e-5));
  }
  std::vector<float> p(4), l(4, 0.0f);
  CHECK_THROWS_WITH_AS(cpu::softmax_forward(p.data(), l.data(), 4, 0.0f), doctest::Contains("temperature = 0"),
                       llmpar::Error);
}

// ---- attention block by block (ring attention's kernels) ------------------------------

namespace {

// The whole causal attention of (B, T) sequences as blocks of `chunk` rows: every query
// chunk against every key chunk at or before it (the diagonal one causal), into one
// state, then finished; and the backward of the same blocks. kv: the keys and values
// read from qkv itself, or from a packed (B, T, 2 KV) copy.
template <class T>
void blockwise(std::vector<T>& out, std::vector<float>& lse, std::vector<float>& dq, std::vector<float>& dkv,
               const std::vector<T>& qkv, const std::vector<T>& dout, const AttentionShape& a, std::int64_t chunk,
               bool packed) {
  const std::int64_t rows = a.batch * a.seq, Q = a.q_dim(), KV = a.kv_dim();
  std::vector<T> kv;
  if (packed) {
    kv.resize(static_cast<std::size_t>(rows * 2 * KV));
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < 2 * KV; ++c) kv[r * 2 * KV + c] = qkv[r * a.row() + Q + c];
  }
  const T* kv_data = packed ? kv.data() : qkv.data();
  std::vector<float> o(rows * Q), m(rows * a.heads), l(rows * a.heads);
  const AttentionState<float> st{o.data(), m.data(), l.data()};
  cpu::attention_state_init(st, a);
  auto block = [&](std::int64_t qc, std::int64_t kc) {
    return AttentionBlock{.q_first = qc * chunk,
                          .kv_seq = a.seq,
                          .kv_first = kc * chunk,
                          .len = chunk,
                          .kv_stride = packed ? 2 * KV : a.row(),
                          .k_offset = packed ? 0 : Q,
                          .v_offset = packed ? KV : Q + KV,
                          .causal = qc == kc};
  };
  const std::int64_t chunks = a.seq / chunk;
  for (std::int64_t kc = chunks - 1; kc >= 0; --kc)  // any order: the state does not care
    for (std::int64_t qc = kc; qc < chunks; ++qc)
      cpu::attention_block_forward(st, qkv.data(), kv_data, a, block(qc, kc));
  out.assign(static_cast<std::size_t>(rows * Q), T{});
  lse.assign(static_cast<std::size_t>(rows * a.heads), 0.0f);
  cpu::attention_state_finish(out.data(), lse.data(), st, a);
  std::vector<float> dsum(rows * a.heads);
  cpu::attention_dsum(dsum.data(), dout.data(), out.data(), a);
  dq.assign(static_cast<std::size_t>(rows * Q), 0.0f);
  dkv.assign(static_cast<std::size_t>(rows * 2 * KV), 0.0f);
  for (std::int64_t qc = 0; qc < chunks; ++qc)
    for (std::int64_t kc = 0; kc <= qc; ++kc)
      cpu::attention_block_backward(dq.data(), dkv.data(), dout.data(), qkv.data(), kv_data, lse.data(), dsum.data(), a,
                                    block(qc, kc));
}

}  // namespace

TEST_CASE("attention block by block (every query chunk against the key chunks before it) is the whole attention") {
  for (const AttnShape& s : {AttnShape{2, 128, 64, 4}, AttnShape{1, 96, 128, 4, 2}, AttnShape{2, 40, 48, 6, 3}}) {
    for (std::int64_t chunk : {s.T / 2, s.T / 4})
      for (bool packed : {false, true}) {
        CAPTURE(s.T);
        CAPTURE(s.KVH);
        CAPTURE(chunk);
        CAPTURE(packed);
        const AttentionShape a = s.shape();
        const std::vector<float> qkv = cast_to<float>(random_normal(s.qkv_size(), "block.qkv", 1.5));
        const std::vector<float> dout = cast_to<float>(random_normal(s.B * s.T * s.C, "block.dout"));
        std::vector<float> ref_out, ref_lse;
        run_attention_forward(ref_out, ref_lse, qkv, s);
        const std::vector<float> ref_d = run_attention_backward(dout, qkv, s);
        std::vector<float> out, lse, dq, dkv;
        blockwise(out, lse, dq, dkv, qkv, dout, a, chunk, packed);
        CHECK(max_abs_diff(to_double(out), to_double(ref_out)) <= 2e-6 * (1.0 + max_abs(to_double(ref_out))));
        CHECK(max_abs_diff(to_double(lse), to_double(ref_lse)) <= 2e-6 * (1.0 + max_abs(to_double(ref_lse))));
        // The whole kernel's dqkv, split into the blocks' dq and dk/dv.
        std::vector<double> got(ref_d.size());
        const std::int64_t Q = a.q_dim(), KV = a.kv_dim();
        for (std::int64_t r = 0; r < s.B * s.T; ++r) {
          for (std::int64_t c = 0; c < Q; ++c) got[r * a.row() + c] = dq[r * Q + c];
          for (std::int64_t c = 0; c < 2 * KV; ++c) got[r * a.row() + Q + c] = dkv[r * 2 * KV + c];
        }
        CHECK(max_abs_diff(got, to_double(ref_d)) <= 3e-6 * max_abs(to_double(ref_d)));
      }
  }
}
