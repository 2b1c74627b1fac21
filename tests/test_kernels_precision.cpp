// Every CPU kernel in bf16 and f16 storage against the f32 kernel, with tolerances
// derived from the formats, not picked to pass.
//
// The method. The 16-bit kernel gets 16-bit inputs; the f32 kernel gets the same values
// widened to f32 (exactly). Both compute in f32 (acc_t), so they differ in two ways only:
//  1. the 16-bit kernel rounds each stored output to nearest in its format: an error of
//     at most u·|x| with the unit roundoff u = 2^-8 (bf16, 8 significant bits) or 2^-11
//     (f16, 11), plus, for f16, half the subnormal spacing 2^-25 below 2^-14;
//  2. the two instantiations may order their f32 sums differently (vectorisation): a
//     reduction of n terms differs by at most 2·n·2^-24 times the sum of the terms'
//     magnitudes (twice the standard bound γ_n ≈ n·u32 on each side).
// So an output rounded to T must satisfy |got - want| <= u·|want| + floor + (1 + u)·slack,
// and an f32 output (gradients, statistics) |got - want| <= slack, where slack is the
// kernel's term-2 bound, written next to each check from the kernel's formula. Where the
// kernel's formula makes a magnitude sum awkward (attention, the loss) the bound is
// norm-wise: the largest magnitude of the quantity's terms times the reduction length,
// with the reason given.
//
// GEMMs: products of bf16 or f16 values are exact in f32 (8 + 8 and 11 + 11 significant
// bits fit in 24), so a 16-bit GEMM differs from the f32 GEMM of the widened operands
// only by summation order, 2·(K + 2)·2^-24·Σ|a||b| per element, and by its output's
// rounding. bf16 is checked on both of its CPU paths (oneDNN's native kernel where this
// CPU has one, and the upconvert path every CPU has).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_test_util.hpp"
#include "llmpar/backend/cpu/adamw.hpp"
#include "llmpar/backend/cpu/attention.hpp"
#include "llmpar/backend/cpu/bias.hpp"
#include "llmpar/backend/cpu/convert.hpp"
#include "llmpar/backend/cpu/cross_entropy.hpp"
#include "llmpar/backend/cpu/elementwise.hpp"
#include "llmpar/backend/cpu/embedding.hpp"
#include "llmpar/backend/cpu/gelu.hpp"
#include "llmpar/backend/cpu/gemm.hpp"
#include "llmpar/backend/cpu/layernorm.hpp"
#include "llmpar/backend/cpu/rmsnorm.hpp"

using namespace llmpar;
using namespace llmpar::kernel_test;
namespace cpu = llmpar::backend::cpu;

namespace {

constexpr double kU32 = 0x1p-24;  // f32 unit roundoff

template <class T>
constexpr double kUnitRoundoff = std::is_same_v<T, bf16> ? 0x1p-8 : 0x1p-11;
// Half the spacing of the smallest subnormals: f16's absolute rounding error below 2^-14.
template <class T>
constexpr double kFloor = std::is_same_v<T, f16> ? 0x1p-25 : 0x1p-134;

template <class T>
const char* format_name() {
  return std::is_same_v<T, bf16> ? "bf16" : "f16";
}

template <class T>
std::vector<float> widen(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}

// got (rounded to T) against the f32 kernel's want: term 1 + term 2 of the file's note.
template <class T>
void check_rounded(const std::vector<T>& got, const std::vector<float>& want,
                   const std::function<double(std::size_t)>& slack, const std::string& what) {
  REQUIRE(got.size() == want.size());
  const double u = kUnitRoundoff<T>;
  std::size_t bad = 0, first = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double w = want[i];
    const double d = std::fabs(static_cast<double>(static_cast<float>(got[i])) - w);
    const double bound = u * std::fabs(w) + kFloor<T> + (1.0 + u) * slack(i);
    worst = std::max(worst, d / bound);
    if (!(d <= bound) && bad++ == 0) first = i;
  }
  INFO(what, " in ", format_name<T>(), ": worst |error| / bound = ", worst, "; first beyond at ", first);
  CHECK(bad == 0);
}

// got and want both f32 (gradients, statistics): only term 2.
inline void check_f32(const std::vector<float>& got, const std::vector<float>& want,
                      const std::function<double(std::size_t)>& slack, const std::string& what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    if (!(d <= slack(i)) && bad++ == 0) first = i;
  }
  INFO(what, ": first element beyond the f32 reduction bound at ", first);
  CHECK(bad == 0);
}

// Inputs of one test: N(0, 1) values rounded to T, and their exact f32 widening.
template <class T>
struct Input {
  std::vector<T> low;
  std::vector<float> f32;
  Input(std::int64_t n, const std::string& name, double stddev = 1.0, double mean = 0.0)
      : low(cast_to<T>(random_normal(n, name, stddev, mean))), f32(widen(low)) {}
};

}  // namespace

TEST_CASE_TEMPLATE("layernorm forward and backward in 16 bits: the f32 kernel's result, rounded", T, bf16, f16) {
  const std::int64_t rows = 37, C = 300;
  const Input<T> x(rows * C, "p.ln.x", 1.0, 0.5), w(C, "p.ln.w", 0.2, 1.0), b(C, "p.ln.b", 0.2),
      dout(rows * C, "p.ln.dout");
  std::vector<T> out(rows * C), dx(rows * C);
  std::vector<float> out_f(rows * C), dx_f(rows * C), mean(rows), rstd(rows), mean_f(rows), rstd_f(rows);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.low.data(), w.low.data(), b.low.data(), rows, C);
  cpu::layernorm_forward(out_f.data(), mean_f.data(), rstd_f.data(), x.f32.data(), w.f32.data(), b.f32.data(), rows, C);
  // mean: C terms of |x|; rstd = (var + eps)^-1/2 with var of C terms (x - m)^2: a relative
  // error of (C + 4)·u32 in var, half of it in rstd, plus the sqrt and division.
  const auto row = [&](std::size_t i) { return static_cast<std::int64_t>(i) / C; };
  std::vector<double> abs_mean(rows, 0.0);
  for (std::int64_t i = 0; i < rows * C; ++i) abs_mean[i / C] += std::fabs(x.f32[i]) / static_cast<double>(C);
  check_f32(
      mean, mean_f, [&](std::size_t r) { return 2.0 * (C + 2) * kU32 * abs_mean[r]; }, "layernorm mean");
  check_f32(
      rstd, rstd_f, [&](std::size_t r) { return 2.0 * (C + 8) * kU32 * rstd_f[r]; }, "layernorm rstd");
  // out = (x - m)·s·w + b: the errors of m and s above, carried through.
  const auto out_slack = [&](std::size_t i) {
    const std::size_t c = i % static_cast<std::size_t>(C);
    const double s = rstd_f[row(i)];
    return 2.0 * (C + 8) * kU32 * ((std::fabs(x.f32[i]) + abs_mean[row(i)]) * s * std::fabs(w.f32[c])) +
           4.0 * kU32 * std::fabs(b.f32[c]);
  };
  check_rounded(out, out_f, out_slack, "layernorm out");

  // Backward from the same statistics (the f32 kernel's, given to both).
  std::vector<float> dw(C, 0.0f), db(C, 0.0f), dw_f(C, 0.0f), db_f(C, 0.0f);
  cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dout.low.data(), x.low.data(), w.low.data(), mean_f.data(),
                          rstd_f.data(), rows, C);
  cpu::layernorm_backward(dx_f.data(), dw_f.data(), db_f.data(), dout.f32.data(), x.f32.data(), w.f32.data(),
                          mean_f.data(), rstd_f.data(), rows, C);
  // dx = s·(g - mean(g) - n·mean(g·n)), g = dout·w, n = (x - m)·s: two reductions of C.
  std::vector<double> mag_g(rows, 0.0), mag_gn(rows, 0.0), mag_dw(C, 0.0), mag_db(C, 0.0);
  for (std::int64_t i = 0; i < rows * C; ++i) {
    const std::int64_t r = i / C, c = i % C;
    const double n = (x.f32[i] - mean_f[r]) * rstd_f[r], g = dout.f32[i] * w.f32[c];
    mag_g[r] += std::fabs(g) / C;
    mag_gn[r] += std::fabs(g * n) / C;
    mag_dw[c] += std::fabs(dout.f32[i] * n);
    mag_db[c] += std::fabs(dout.f32[i]);
  }
  check_rounded(
      dx, dx_f,
      [&](std::size_t i) {
        const std::int64_t r = row(i), c = static_cast<std::int64_t>(i) % C;
        const double n = std::fabs((x.f32[i] - mean_f[r]) * rstd_f[r]);
        return 2.0 * (C + 8) * kU32 * rstd_f[r] * (std::fabs(dout.f32[i] * w.f32[c]) + mag_g[r] + n * mag_gn[r]);
      },
      "layernorm dx");
  // dweight, dbias: f32 main grads, column sums over the rows.
  check_f32(
      dw, dw_f, [&](std::size_t c) { return 2.0 * (rows + 4) * kU32 * mag_dw[c]; }, "layernorm dweight");
  check_f32(
      db, db_f, [&](std::size_t c) { return 2.0 * (rows + 2) * kU32 * mag_db[c]; }, "layernorm dbias");
}

TEST_CASE_TEMPLATE("rmsnorm forward and backward in 16 bits: the f32 kernel's result, rounded", T, bf16, f16) {
  const std::int64_t rows = 19, C = 257;
  const Input<T> x(rows * C, "p.rms.x"), w(C, "p.rms.w", 0.2, 1.0), dout(rows * C, "p.rms.dout");
  std::vector<T> out(rows * C), dx(rows * C);
  std::vector<float> out_f(rows * C), dx_f(rows * C), rstd(rows), rstd_f(rows), dw(C, 0.0f), dw_f(C, 0.0f);
  cpu::rmsnorm_forward(out.data(), rstd.data(), x.low.data(), w.low.data(), rows, C, 1e-5f);
  cpu::rmsnorm_forward(out_f.data(), rstd_f.data(), x.f32.data(), w.f32.data(), rows, C, 1e-5f);
  check_f32(
      rstd, rstd_f, [&](std::size_t r) { return 2.0 * (C + 8) * kU32 * rstd_f[r]; }, "rmsnorm rstd");
  check_rounded(
      out, out_f,
      [&](std::size_t i) {
        return 2.0 * (C + 8) * kU32 * std::fabs(x.f32[i]) * rstd_f[i / C] * std::fabs(w.f32[i % C]);
      },
      "rmsnorm out");
  cpu::rmsnorm_backward(dx.data(), dw.data(), dout.low.data(), x.low.data(), w.low.data(), rstd_f.data(), rows, C);
  cpu::rmsnorm_backward(dx_f.data(), dw_f.data(), dout.f32.data(), x.f32.data(), w.f32.data(), rstd_f.data(), rows, C);
  std::vector<double> mag_gn(rows, 0.0), mag_dw(C, 0.0);
  for (std::int64_t i = 0; i < rows * C; ++i) {
    const double n = x.f32[i] * rstd_f[i / C];
    mag_gn[i / C] += std::fabs(dout.f32[i] * w.f32[i % C] * n) / C;
    mag_dw[i % C] += std::fabs(dout.f32[i] * n);
  }
  check_rounded(
      dx, dx_f,
      [&](std::size_t i) {
        const double s = rstd_f[i / C];
        return 2.0 * (C + 8) * kU32 * s *
               (std::fabs(dout.f32[i] * w.f32[i % C]) + std::fabs(x.f32[i] * s) * mag_gn[i / C]);
      },
      "rmsnorm dx");
  check_f32(
      dw, dw_f, [&](std::size_t c) { return 2.0 * (rows + 4) * kU32 * mag_dw[c]; }, "rmsnorm dweight");
}

TEST_CASE_TEMPLATE("gelu, add and add_inplace in 16 bits round the f32 kernel's result", T, bf16, f16) {
  const std::int64_t n = 4099;
  const Input<T> x(n, "p.gelu.x", 2.0), y(n, "p.gelu.y"), dout(n, "p.gelu.dout");
  std::vector<T> g(n), dg(n), s(n), acc = x.low;
  std::vector<float> g_f(n), dg_f(n), s_f(n), acc_f = x.f32;
  cpu::gelu_forward(g.data(), x.low.data(), n);
  cpu::gelu_forward(g_f.data(), x.f32.data(), n);
  cpu::gelu_backward(dg.data(), x.low.data(), dout.low.data(), n);
  cpu::gelu_backward(dg_f.data(), x.f32.data(), dout.f32.data(), n);
  cpu::add(s.data(), x.low.data(), y.low.data(), n);
  cpu::add(s_f.data(), x.f32.data(), y.f32.data(), n);
  cpu::add_inplace(acc.data(), y.low.data(), n);
  cpu::add_inplace(acc_f.data(), y.f32.data(), n);
  // Element-wise: the same f32 operations on the same values, so term 2 is zero; the
  // ordering argument does not apply (no reduction).
  const auto none = [](std::size_t) { return 0.0; };
  check_rounded(g, g_f, none, "gelu_forward");
  check_rounded(dg, dg_f, none, "gelu_backward");
  check_rounded(s, s_f, none, "add");
  check_rounded(acc, acc_f, none, "add_inplace");
}

TEST_CASE_TEMPLATE("bias_backward sums 16-bit gradients into f32 main grads", T, bf16, f16) {
  const std::int64_t rows = 513, n = 130;
  const Input<T> dout(rows * n, "p.bias.dout");
  std::vector<float> db(n, 0.5f), db_f(n, 0.5f);
  cpu::bias_backward(db.data(), dout.low.data(), rows, n);
  cpu::bias_backward(db_f.data(), dout.f32.data(), rows, n);
  std::vector<double> mag(n, 0.5);
  for (std::int64_t i = 0; i < rows * n; ++i) mag[i % n] += std::fabs(dout.f32[i]);
  check_f32(
      db, db_f, [&](std::size_t j) { return 2.0 * (rows + 2) * kU32 * mag[j]; }, "bias_backward");
}

TEST_CASE_TEMPLATE("embedding forward rounds the f32 sum; backward accumulates into f32 main grads", T, bf16, f16) {
  const std::int64_t B = 3, S = 17, C = 96, V = 23;
  const Input<T> wte(V * C, "p.emb.wte", 0.1), wpe(S * C, "p.emb.wpe", 0.1), dout(B * S * C, "p.emb.dout");
  std::vector<std::int32_t> tokens(B * S);
  for (std::int64_t i = 0; i < B * S; ++i) tokens[i] = static_cast<std::int32_t>((i * 7) % 5);  // repeated tokens
  std::vector<T> out(B * S * C);
  std::vector<float> out_f(B * S * C);
  cpu::encoder_forward(out.data(), tokens.data(), wte.low.data(), wpe.low.data(), B, S, C);
  cpu::encoder_forward(out_f.data(), tokens.data(), wte.f32.data(), wpe.f32.data(), B, S, C);
  check_rounded(
      out, out_f, [](std::size_t) { return 0.0; }, "encoder_forward (one addition)");
  std::vector<float> dwte(V * C, 0.0f), dwpe(S * C, 0.0f), dwte_f = dwte, dwpe_f = dwpe;
  cpu::encoder_backward(dwte.data(), dwpe.data(), dout.low.data(), tokens.data(), B, S, C);
  cpu::encoder_backward(dwte_f.data(), dwpe_f.data(), dout.f32.data(), tokens.data(), B, S, C);
  // The same additions in the same order (positions ascending, per column): bitwise.
  CHECK(bitwise_equal(dwte, dwte_f));
  CHECK(bitwise_equal(dwpe, dwpe_f));
}

TEST_CASE_TEMPLATE("attention forward and backward in 16 bits: the f32 kernel's result, rounded", T, bf16, f16) {
  const std::int64_t B = 2, S = 70, C = 64, NH = 2, hs = C / NH;
  const Input<T> qkv(B * S * 3 * C, "p.att.qkv"), dout(B * S * C, "p.att.dout");
  std::vector<T> out(B * S * C), dqkv(B * S * 3 * C);
  std::vector<float> out_f(B * S * C), dqkv_f(B * S * 3 * C), lse(B * NH * S), lse_f(B * NH * S);
  cpu::attention_forward(out.data(), lse.data(), qkv.low.data(), AttentionShape::mha(B, S, C, NH));
  cpu::attention_forward(out_f.data(), lse_f.data(), qkv.f32.data(), AttentionShape::mha(B, S, C, NH));
  // out = Σ_s p_s v_s with Σ p = 1 (p from S scores of hs products each), so the sums'
  // magnitude is at most max|v|: norm-wise, (S + hs + 8) terms' worth of rounding of it.
  double max_v = 0.0, max_score = 0.0;
  for (std::int64_t i = 0; i < B * S * 3 * C; ++i)
    if (i % (3 * C) >= 2 * C) max_v = std::max(max_v, static_cast<double>(std::fabs(qkv.f32[i])));
  for (std::int64_t i = 0; i < B * S * 3 * C; ++i) max_score = std::max(max_score, std::fabs(double(qkv.f32[i])));
  max_score = max_score * max_score * static_cast<double>(hs) / std::sqrt(static_cast<double>(hs));
  const double reduction = 2.0 * static_cast<double>(S + hs + 8) * kU32;
  check_rounded(
      out, out_f, [&](std::size_t) { return reduction * max_v; }, "attention out");
  // lse = log Σ exp(score): an absolute error of the scores' rounding.
  check_f32(
      lse, lse_f, [&](std::size_t) { return reduction * (max_score + 1.0); }, "attention lse");

  // Backward on the same forward results (the f32 kernel's out, rounded as T stores it).
  const std::vector<T> out_low = cast_to<T>(std::vector<double>(out_f.begin(), out_f.end()));
  const std::vector<float> out_wide = widen(out_low);
  cpu::attention_backward(dqkv.data(), dout.low.data(), qkv.low.data(), out_low.data(), lse_f.data(),
                          AttentionShape::mha(B, S, C, NH));
  cpu::attention_backward(dqkv_f.data(), dout.f32.data(), qkv.f32.data(), out_wide.data(), lse_f.data(),
                          AttentionShape::mha(B, S, C, NH));
  // dq = scale·Σ_s ds·k, dk = scale·Σ_t ds·q, dv = Σ_t p·dout with ds = p·(dout·v - dout·out):
  // each a reduction over at most S positions of terms built from hs-long products, so
  // norm-wise per part (q, k, v): (S + 2·hs + 8) terms of rounding of the part's largest
  // value times the number of summed terms' magnitude growth (bounded by S).
  double max_part[3] = {0.0, 0.0, 0.0};
  for (std::int64_t i = 0; i < B * S * 3 * C; ++i)
    max_part[(i % (3 * C)) / C] = std::max(max_part[(i % (3 * C)) / C], std::fabs(double(dqkv_f[i])));
  const double backward = 2.0 * static_cast<double>(S + 2 * hs + 8) * kU32 * static_cast<double>(S);
  check_rounded(
      dqkv, dqkv_f, [&](std::size_t i) { return backward * max_part[(i % (3 * C)) / C]; }, "attention dqkv");
}

TEST_CASE_TEMPLATE("cross-entropy in 16 bits: f32 losses and rounded dlogits of the f32 kernel", T, bf16, f16) {
  const std::int64_t rows = 9, V = 3001, Vp = 3072;
  const Input<T> logits(rows * Vp, "p.xent.logits", 3.0);
  std::vector<std::int32_t> targets(rows);
  for (std::int64_t r = 0; r < rows; ++r) targets[r] = static_cast<std::int32_t>((r * 331) % V);
  const float dloss = 64.0f / static_cast<float>(rows);  // a loss-scaled dloss: 64/rows
  std::vector<T> d = logits.low;
  std::vector<float> d_f = logits.f32, losses(rows), losses_f(rows);
  cpu::cross_entropy_forward_backward(d.data(), losses.data(), targets.data(), rows, V, Vp, dloss);
  cpu::cross_entropy_forward_backward(d_f.data(), losses_f.data(), targets.data(), rows, V, Vp, dloss);
  // loss = logsumexp over V - the target's logit: V terms of exp in f32, norm-wise in
  // the largest logit (exp errors are relative, so the log's error is absolute).
  double max_logit = 0.0;
  for (float v : logits.f32) max_logit = std::max(max_logit, static_cast<double>(std::fabs(v)));
  const double reduction = 2.0 * static_cast<double>(V + 8) * kU32;
  check_f32(
      losses, losses_f, [&](std::size_t) { return reduction * (max_logit + 1.0); }, "cross-entropy loss");
  // dlogit = dloss·(exp(x - lse) - onehot): exp's relative error plus lse's absolute one.
  check_rounded(
      d, d_f,
      [&](std::size_t i) {
        const double p = std::fabs(static_cast<double>(d_f[i])) + std::fabs(dloss);
        return reduction * (max_logit + 2.0) * p;
      },
      "cross-entropy dlogits");
  // The vocabulary-parallel kernels (stats on two halves, then finish) likewise.
  const std::int64_t half = Vp / 2;
  std::vector<T> left(rows * half), right(rows * half);
  std::vector<float> left_f(rows * half), right_f(rows * half);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = 0; i < half; ++i) {
      left[r * half + i] = logits.low[r * Vp + i];
      right[r * half + i] = logits.low[r * Vp + half + i];
      left_f[r * half + i] = logits.f32[r * Vp + i];
      right_f[r * half + i] = logits.f32[r * Vp + half + i];
    }
  std::vector<float> stats(2 * rows * cpu::kVocabStats), stats_f(stats.size());
  cpu::vocab_parallel_cross_entropy_stats(stats.data(), left.data(), targets.data(), rows, V, 0, half);
  cpu::vocab_parallel_cross_entropy_stats(stats.data() + rows * cpu::kVocabStats, right.data(), targets.data(), rows, V,
                                          half, half);
  cpu::vocab_parallel_cross_entropy_stats(stats_f.data(), left_f.data(), targets.data(), rows, V, 0, half);
  cpu::vocab_parallel_cross_entropy_stats(stats_f.data() + rows * cpu::kVocabStats, right_f.data(), targets.data(),
                                          rows, V, half, half);
  // Maxima and target logits are exact (a copy of a stored value); the sums of exp are
  // reductions of at most half the vocabulary, relative.
  check_f32(
      stats, stats_f,
      [&](std::size_t i) {
        return i % cpu::kVocabStats == 1 ? reduction * std::fabs(static_cast<double>(stats_f[i])) : 0.0;
      },
      "vocabulary-parallel stats");
  std::vector<float> vp_losses(rows);
  std::vector<T> dleft(rows * half);
  cpu::vocab_parallel_cross_entropy_finish(dleft.data(), vp_losses.data(), left.data(), stats_f.data(), 2,
                                           targets.data(), rows, V, 0, half, dloss);
  std::vector<float> dleft_f(rows * half);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = 0; i < half; ++i) dleft_f[r * half + i] = d_f[r * Vp + i];
  check_f32(
      vp_losses, losses_f, [&](std::size_t) { return reduction * (max_logit + 1.0); }, "vocabulary-parallel loss");
  check_rounded(
      dleft, dleft_f,
      [&](std::size_t i) {
        return reduction * (max_logit + 2.0) * (std::fabs(static_cast<double>(dleft_f[i])) + dloss);
      },
      "vocabulary-parallel dlogits");
}

namespace {

struct GemmCase {
  std::int64_t m, n, k;
  cpu::GemmOp op;
};

// The GEMMs of a linear layer (forward, input gradient, weight gradient accumulating),
// with ragged sizes.
const GemmCase kGemmCases[] = {{37, 70, 129, {.trans_a = false, .trans_b = true, .accumulate = false}},
                               {37, 129, 70, {}},
                               {70, 129, 37, {.trans_a = true, .trans_b = false, .accumulate = true}},
                               {256, 384, 128, {.trans_a = false, .trans_b = true, .accumulate = false}}};

// Σ_k |a_ik||b_kj| for every (i, j): the magnitude the summation-order bound scales.
std::vector<double> magnitudes(const std::vector<float>& a, const std::vector<float>& b, const GemmCase& g) {
  std::vector<double> out(static_cast<std::size_t>(g.m * g.n), 0.0);
  for (std::int64_t i = 0; i < g.m; ++i)
    for (std::int64_t j = 0; j < g.n; ++j) {
      double s = 0.0;
      for (std::int64_t p = 0; p < g.k; ++p) {
        const double av = g.op.trans_a ? a[p * g.m + i] : a[i * g.k + p];
        const double bv = g.op.trans_b ? b[j * g.k + p] : b[p * g.n + j];
        s += std::fabs(av * bv);
      }
      out[i * g.n + j] = s;
    }
  return out;
}

template <class T>
void check_gemms(cpu::Context& ctx, const char* path) {
  for (const GemmCase& g : kGemmCases) {
    CAPTURE(path);
    CAPTURE(g.m);
    CAPTURE(g.n);
    CAPTURE(g.k);
    const Input<T> a(g.m * g.k, "p.gemm.a"), b(g.k * g.n, "p.gemm.b"), bias(g.n, "p.gemm.bias");
    const Input<T> c0(g.m * g.n, "p.gemm.c0");
    const std::vector<double> mag = magnitudes(a.f32, b.f32, g);
    const auto slack = [&](std::size_t i) { return 2.0 * static_cast<double>(g.k + 2) * kU32 * (mag[i] + 1.0); };
    // f32 output (main grads): the dW form accumulates into it.
    std::vector<float> c32 = c0.f32, want = c0.f32;
    ctx.gemm<T, float>(c32.data(), a.low.data(), b.low.data(), nullptr, g.m, g.n, g.k, g.op);
    ctx.gemm<float, float>(want.data(), a.f32.data(), b.f32.data(), nullptr, g.m, g.n, g.k, g.op);
    check_f32(c32, want, slack, std::string(format_name<T>()) + " GEMM, f32 output");
    // Output in T, with a bias for the forward form.
    const bool with_bias = g.op.trans_b && !g.op.accumulate;
    std::vector<T> c16 = c0.low;
    std::vector<float> want16 = c0.f32;
    ctx.gemm<T, T>(c16.data(), a.low.data(), b.low.data(), with_bias ? bias.low.data() : nullptr, g.m, g.n, g.k, g.op);
    ctx.gemm<float, float>(want16.data(), a.f32.data(), b.f32.data(), with_bias ? bias.f32.data() : nullptr, g.m, g.n,
                           g.k, g.op);
    check_rounded(c16, want16, slack, std::string(format_name<T>()) + " GEMM, 16-bit output");
  }
  const std::string how = std::string(format_name<T>()) + " GEMM via " + path + ": " +
                          ctx.implementation<T, T>(256, 384, 128, kGemmCases[3].op);
  MESSAGE(how);
}

}  // namespace

TEST_CASE("bf16 GEMMs with f32 accumulation, on oneDNN's native kernel and on the upconvert path") {
  cpu::Context native(cpu::Context::Config{.bf16 = cpu::Bf16Gemm::native});
  cpu::Context upconvert(cpu::Context::Config{.bf16 = cpu::Bf16Gemm::upconvert});
  check_gemms<bf16>(native, "native");
  check_gemms<bf16>(upconvert, "upconvert");
  CHECK(upconvert.implementation<bf16, bf16>(8, 8, 8).rfind("upconvert to f32", 0) == 0);
  CHECK(upconvert.implementation<bf16, float>(8, 8, 8, {.accumulate = true}).rfind("upconvert to f32", 0) == 0);
  // A pinned path is not measured.
  CHECK_FALSE(native.measurement<bf16, bf16>(64, 96, 32).has_value());
  CHECK_FALSE(upconvert.measurement<bf16, bf16>(64, 96, 32).has_value());
}

TEST_CASE("each bf16 GEMM shape takes the path measured faster, once per process, and runs it") {
  cpu::Context measured, other;
  cpu::Context native(cpu::Context::Config{.bf16 = cpu::Bf16Gemm::native});
  cpu::Context upconvert(cpu::Context::Config{.bf16 = cpu::Bf16Gemm::upconvert});
  CHECK(measured.config().bf16 == cpu::Bf16Gemm::measured);
  check_gemms<bf16>(measured, "measured");  // correct on whichever path each shape took
  // A step's three GEMMs of a linear layer (the weight gradient into f32 main grads).
  for (const cpu::GemmShape& s : cpu::linear_layer_shapes(96, 160, 224)) {
    CAPTURE(s.m);
    CAPTURE(s.n);
    CAPTURE(s.k);
    const Input<bf16> a(s.m * s.k, "p.gemm.measured.a"), b(s.k * s.n, "p.gemm.measured.b");
    const Input<bf16> c0(s.m * s.n, "p.gemm.measured.c0");
    auto run = [&](cpu::Context& ctx) {
      if (s.op.accumulate) {
        std::vector<float> c = c0.f32;
        ctx.gemm<bf16, float>(c.data(), a.low.data(), b.low.data(), nullptr, s.m, s.n, s.k, s.op);
        return std::pair{c, ctx.measurement<bf16, float>(s.m, s.n, s.k, s.op)};
      }
      std::vector<bf16> c = c0.low;
      ctx.gemm<bf16, bf16>(c.data(), a.low.data(), b.low.data(), nullptr, s.m, s.n, s.k, s.op);
      return std::pair{widen(c), ctx.measurement<bf16, bf16>(s.m, s.n, s.k, s.op)};
    };
    const auto [got, how] = run(measured);
    const auto [got_native, none_native] = run(native);
    const auto [got_upconvert, none_upconvert] = run(upconvert);
    const std::string native_impl = s.op.accumulate ? native.implementation<bf16, float>(s.m, s.n, s.k, s.op)
                                                    : native.implementation<bf16, bf16>(s.m, s.n, s.k, s.op);
    const std::string impl = s.op.accumulate ? measured.implementation<bf16, float>(s.m, s.n, s.k, s.op)
                                             : measured.implementation<bf16, bf16>(s.m, s.n, s.k, s.op);
    MESSAGE("measured bf16 GEMM ", s.m, "x", s.n, "x", s.k, ": ", impl);
    if (native_impl.rfind("native", 0) != 0) {
      // oneDNN has only its reference loop for bf16 here: upconvert, unmeasured.
      CHECK_FALSE(how.has_value());
      CHECK(impl.rfind("upconvert to f32", 0) == 0);
      CHECK(bitwise_equal(got, got_upconvert));
      continue;
    }
    REQUIRE(how.has_value());
    CHECK(how->native_s > 0.0);
    CHECK(how->upconvert_s > 0.0);
    // Native only when it is clearly faster.
    CHECK((how->path == cpu::GemmPath::native) == (how->native_s < cpu::kNativeMargin * how->upconvert_s));
    CHECK(impl.rfind(how->path == cpu::GemmPath::native ? "native " : "upconvert to f32", 0) == 0);
    CHECK(impl.find("(measured: ") != std::string::npos);
    // The chosen path is the one that runs: bit for bit the pinned Context of that path.
    CHECK(bitwise_equal(got, how->path == cpu::GemmPath::native ? got_native : got_upconvert));
    // Another Context of the process takes the measured choice (the same times: not
    // measured again), with a bias epilogue too.
    const auto again = s.op.accumulate ? other.measurement<bf16, float>(s.m, s.n, s.k, s.op)
                                       : other.measurement<bf16, bf16>(s.m, s.n, s.k, s.op, true);
    REQUIRE(again.has_value());
    CHECK(again->path == how->path);
    CHECK(again->native_s == how->native_s);
    CHECK(again->upconvert_s == how->upconvert_s);
  }
  // The start-up choice over a step's shapes counts every shape once.
  const auto shapes = cpu::step_gemm_shapes(32, std::array{std::pair<std::int64_t, std::int64_t>{64, 192}});
  const cpu::Bf16Paths paths = cpu::choose_bf16_paths(measured, shapes);
  CHECK(paths.native + paths.upconvert == 3);
  CHECK(paths.describe().find("of 3 shapes") != std::string::npos);
  const cpu::Bf16Paths pinned = cpu::choose_bf16_paths(upconvert, shapes);
  CHECK(pinned.upconvert == 3);
  CHECK(pinned.measured == 0);
  CHECK(pinned.describe() ==
        "native on 0 of 3 shapes, upconvert on 3 (not measured: pinned, or oneDNN has no bf16 "
        "kernel on this CPU)");
  // The choice's names, and a wrong one named.
  for (const cpu::Bf16Gemm g : {cpu::Bf16Gemm::measured, cpu::Bf16Gemm::native, cpu::Bf16Gemm::upconvert})
    CHECK(cpu::bf16_gemm_of_flag(cpu::name_of(g)) == g);
  CHECK_THROWS_WITH(cpu::bf16_gemm_of_flag("fast"),
                    doctest::Contains("bf16 GEMM choice 'fast' is not one of measured, native, upconvert"));
}

TEST_CASE("f16 GEMMs are upconverted to f32 on the CPU, with f32 accumulation") {
  cpu::Context ctx;
  check_gemms<f16>(ctx, "upconvert");
  CHECK(ctx.implementation<f16, f16>(8, 8, 8).rfind("upconvert to f32", 0) == 0);
}

TEST_CASE_TEMPLATE("AdamW on f32 master weights refreshes the 16-bit copy from the f32 update", T, bf16, f16) {
  const std::int64_t n = 70001;  // more than one parallel chunk, odd
  const Input<T> p0(n, "p.adam.p", 0.05), g(n, "p.adam.g", 1e-2);
  std::vector<float> master = p0.f32, m(n, 0.0f), v(n, 0.0f);
  std::vector<float> master_ref = p0.f32, m_ref(n, 0.0f), v_ref(n, 0.0f);
  std::vector<T> params = p0.low;
  const math::AdamWParams hp{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
  for (int step = 1; step <= 3; ++step) {
    cpu::adamw_update_master(master.data(), params.data(), m.data(), v.data(), g.f32.data(), n, hp, step, 0.5f);
    cpu::adamw_update(master_ref.data(), m_ref.data(), v_ref.data(), g.f32.data(), n, hp, step, 0.5f);
  }
  // The master update is the f32 optimizer's, bit for bit; the copy is its rounding.
  CHECK(bitwise_equal(master, master_ref));
  CHECK(bitwise_equal(m, m_ref));
  CHECK(bitwise_equal(v, v_ref));
  std::vector<T> rounded(n);
  cpu::convert(rounded.data(), master.data(), n);
  CHECK(bitwise_equal(params, rounded));
}

TEST_CASE("convert rounds to nearest even and round-trips every 16-bit value") {
  std::vector<bf16> all_bf(65536);
  std::vector<f16> all_h(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    all_bf[i] = bf16::from_bits(static_cast<std::uint16_t>(i));
    all_h[i] = f16::from_bits(static_cast<std::uint16_t>(i));
  }
  std::vector<float> wide(65536);
  std::vector<bf16> back_bf(65536);
  std::vector<f16> back_h(65536);
  cpu::convert(wide.data(), all_bf.data(), 65536);
  cpu::convert(back_bf.data(), wide.data(), 65536);
  cpu::convert(wide.data(), all_h.data(), 65536);
  cpu::convert(back_h.data(), wide.data(), 65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const bool bf_nan = std::isnan(static_cast<float>(all_bf[i])), h_nan = std::isnan(static_cast<float>(all_h[i]));
    if (!bf_nan) REQUIRE(back_bf[i].bits == all_bf[i].bits);
    if (!h_nan) REQUIRE(back_h[i].bits == all_h[i].bits);
    if (bf_nan) REQUIRE(std::isnan(static_cast<float>(back_bf[i])));
    if (h_nan) REQUIRE(std::isnan(static_cast<float>(back_h[i])));
  }
  // Ties go to even: 1 + 2^-8 is halfway between bf16's 1 and 1 + 2^-7.
  const float tie = 1.0f + 0x1p-8f;
  bf16 out;
  cpu::convert(&out, &tie, 1);
  CHECK(out.bits == bf16(1.0f).bits);
}
