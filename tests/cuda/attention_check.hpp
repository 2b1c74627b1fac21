// tests/cuda/attention_check.hpp — what "the CUDA attention is right" means, written once
// for the two programs that check it: test_cuda_attention on a GPU and
// test_cuda_emulation_attention on the CPU (tests/cuda_emulation). Host code only; no CUDA.
//
// References (Reference): the CPU backend's kernel (backend/cpu/attention.hpp, causal
// only) and a naive softmax attention in double (either mask), both over
// core/attention_shape.hpp's layout, multi-head and grouped-query alike; the backward of
// both is fed the reference forward's out (stored as T) and lse, so each kernel is
// checked on its own.
//
// Tolerances: as |got - ref| <= ulps * ulp_T(ref) + rel * max|ref| per tensor, with the
// constants below; why those, at the top of test_cuda_attention.cu.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cpu/attention.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"

namespace llmpar::attention_check {

// A case's shape but for its head size, which the tests vary on their own: B sequences
// of T tokens, NH query heads reading KVH kv heads (KVH = NH: multi-head attention).
struct Shape {
  std::int64_t B, T, NH, KVH;
  AttentionShape at(std::int64_t hs) const { return {B, T, NH, KVH, hs}; }
};

// What a case's results are compared with.
enum class Reference {
  cpu_kernel,    // backend/cpu/attention.hpp: the causal mask only
  naive_double,  // reference_forward / reference_backward below: either mask
};
// The CPU kernel where it applies (it is the one llmpar trains with on the CPU).
inline Reference default_reference(bool causal) { return causal ? Reference::cpu_kernel : Reference::naive_double; }

// Random stored values: element i of the named stream, standard normal, rounded to T.
template <class T>
std::vector<T> random_tensor(const char* name, std::size_t n, std::uint64_t seed) {
  const rng::Stream stream = rng::Stream::named(seed, name);
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = convert<T>(static_cast<float>(stream.normal(i)));
  return v;
}

template <class T>
double value(T x) {
  return static_cast<double>(convert<float>(x));
}

template <class T>
std::vector<double> as_double(const std::vector<T>& v) {
  std::vector<double> d(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) d[i] = value(v[i]);
  return d;
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

template <class T>
constexpr double storage_ulps() {
  return std::is_same_v<T, float> ? 0.0 : 2.0;
}
inline constexpr double kForwardRel = 2e-5;
inline constexpr double kBackwardRel = 5e-5;

// Whether attention_forward<T> takes the tensor-core path (with 16-byte aligned qkv and
// 4-byte aligned out: every 16-bit T, at every head size), and the out tolerance's rel
// term for it.
template <class T>
constexpr bool tensor_core_forward() {
  return !std::is_same_v<T, float>;
}
template <class T>
double forward_out_rel(bool tensor_cores) {
  if (!tensor_cores) return kForwardRel;
  return std::is_same_v<T, bf16> ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);  // p rounded to T
}

// Naive softmax attention in double on the stored inputs, query head h reading kv head
// h % KVH. qkv: (B, T, R) -> out: (B, T, NH hs), lse: (B, NH, T).
inline void reference_forward(std::vector<double>& out, std::vector<double>& lse, const std::vector<double>& qkv,
                              const AttentionShape& s, bool causal) {
  const std::int64_t hs = s.head_dim, R = s.row(), Q = s.q_dim(), T = s.seq;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  out.assign(s.batch * T * Q, 0.0);
  lse.assign(s.batch * s.heads * T, 0.0);
  std::vector<double> p(T);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.heads; ++h) {
      const std::int64_t g = s.kv_head_of(h);
      for (std::int64_t i = 0; i < T; ++i) {
        const std::int64_t n = causal ? i + 1 : T;
        const double* q = &qkv[(b * T + i) * R + s.q_col(h)];
        double m = -INFINITY;
        for (std::int64_t j = 0; j < n; ++j) {
          const double* k = &qkv[(b * T + j) * R + s.k_col(g)];
          double dot = 0.0;
          for (std::int64_t d = 0; d < hs; ++d) dot += q[d] * k[d];
          p[j] = dot * scale;
          m = std::fmax(m, p[j]);
        }
        double sum = 0.0;
        for (std::int64_t j = 0; j < n; ++j) sum += std::exp(p[j] - m);
        const double l = m + std::log(sum);
        lse[(b * s.heads + h) * T + i] = l;
        double* o = &out[(b * T + i) * Q + h * hs];
        for (std::int64_t j = 0; j < n; ++j) {
          const double w = std::exp(p[j] - l);
          const double* v = &qkv[(b * T + j) * R + s.v_col(g)];
          for (std::int64_t d = 0; d < hs; ++d) o[d] += w * v[d];
        }
      }
    }
}

// The matching backward: dqkv (B, T, R) from dout and out (B, T, NH hs), lse (B, NH, T);
// a kv head's dk and dv are the sums over the query heads that read it.
inline void reference_backward(std::vector<double>& dqkv, const std::vector<double>& dout,
                               const std::vector<double>& qkv, const std::vector<double>& out,
                               const std::vector<double>& lse, const AttentionShape& s, bool causal) {
  const std::int64_t hs = s.head_dim, R = s.row(), Q = s.q_dim(), T = s.seq;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  dqkv.assign(s.batch * T * R, 0.0);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.heads; ++h) {
      const std::int64_t g = s.kv_head_of(h);
      for (std::int64_t i = 0; i < T; ++i) {
        const double* q = &qkv[(b * T + i) * R + s.q_col(h)];
        const double* go = &dout[(b * T + i) * Q + h * hs];
        const double* o = &out[(b * T + i) * Q + h * hs];
        double D = 0.0;
        for (std::int64_t d = 0; d < hs; ++d) D += go[d] * o[d];
        const double l = lse[(b * s.heads + h) * T + i];
        double* dq = &dqkv[(b * T + i) * R + s.q_col(h)];
        for (std::int64_t j = 0; j < (causal ? i + 1 : T); ++j) {
          const double* k = &qkv[(b * T + j) * R + s.k_col(g)];
          const double* v = &qkv[(b * T + j) * R + s.v_col(g)];
          double dot = 0.0, dp = 0.0;
          for (std::int64_t d = 0; d < hs; ++d) {
            dot += q[d] * k[d];
            dp += go[d] * v[d];
          }
          const double p = std::exp(dot * scale - l);
          const double ds = p * (dp - D) * scale;
          double* dk = &dqkv[(b * T + j) * R + s.k_col(g)];
          double* dv = &dqkv[(b * T + j) * R + s.v_col(g)];
          for (std::int64_t d = 0; d < hs; ++d) {
            dq[d] += ds * k[d];
            dk[d] += ds * q[d];
            dv[d] += p * go[d];
          }
        }
      }
    }
}

// The inputs and references of one case. out and lse (as T and float) are what the
// backward under test is fed; the doubles are what results are compared with.
template <class T>
struct Case {
  AttentionShape shape{};
  bool causal = true;
  Reference reference = Reference::cpu_kernel;
  std::vector<T> qkv, dout;
  std::vector<T> ref_out;
  std::vector<float> ref_lse;
  std::vector<double> ref_out_d, ref_lse_d, ref_dqkv_d;
};

template <class T>
Case<T> make_case(const AttentionShape& s, bool causal, Reference reference) {
  namespace cpu = llmpar::backend::cpu;
  LLMPAR_CHECK(causal || reference == Reference::naive_double,
               "attention_check: the CPU kernel is causal; check a case without a mask against naive_double");
  Case<T> c;
  c.shape = s;
  c.causal = causal;
  c.reference = reference;
  const std::size_t n_qkv = s.batch * s.seq * s.row(), n_out = s.batch * s.seq * s.q_dim();
  const std::size_t n_lse = s.batch * s.heads * s.seq;
  const std::uint64_t seed = 1000 * s.head_dim + 10 * s.seq + s.batch * s.heads;
  c.qkv = random_tensor<T>("qkv", n_qkv, seed);
  c.dout = random_tensor<T>("dout", n_out, seed);
  c.ref_out.resize(n_out);
  c.ref_lse.resize(n_lse);
  if (reference == Reference::cpu_kernel) {
    std::vector<T> dqkv(n_qkv);
    cpu::attention_forward<T>(c.ref_out.data(), c.ref_lse.data(), c.qkv.data(), s);
    cpu::attention_backward<T>(dqkv.data(), c.dout.data(), c.qkv.data(), c.ref_out.data(), c.ref_lse.data(), s);
    c.ref_out_d = as_double(c.ref_out);
    c.ref_lse_d.assign(c.ref_lse.begin(), c.ref_lse.end());
    c.ref_dqkv_d = as_double(dqkv);
  } else {
    const std::vector<double> qkv_d = as_double(c.qkv);
    reference_forward(c.ref_out_d, c.ref_lse_d, qkv_d, s, causal);
    for (std::size_t i = 0; i < n_out; ++i) c.ref_out[i] = convert<T>(static_cast<float>(c.ref_out_d[i]));
    for (std::size_t i = 0; i < n_lse; ++i) c.ref_lse[i] = static_cast<float>(c.ref_lse_d[i]);
    // The backward's D uses out as stored: the reference does too.
    reference_backward(c.ref_dqkv_d, as_double(c.dout), qkv_d, as_double(c.ref_out), c.ref_lse_d, s, causal);
  }
  return c;
}

// Worst error / tolerance of each output of one case (<= 1 passes).
struct Ratios {
  double out = 0, lse = 0, dqkv = 0;
  bool pass() const { return out <= 1.0 && lse <= 1.0 && dqkv <= 1.0; }
};

template <class T>
Ratios ratios(const Case<T>& c, std::span<const T> out, std::span<const float> lse, std::span<const T> dqkv,
              bool tensor_cores) {
  Ratios r;
  r.out = worst_ratio<T, double>(out, c.ref_out_d, storage_ulps<T>(), forward_out_rel<T>(tensor_cores));
  r.lse = worst_ratio<float, double>(lse, c.ref_lse_d, 0.0, kForwardRel);
  r.dqkv = worst_ratio<T, double>(dqkv, c.ref_dqkv_d, storage_ulps<T>(), kBackwardRel);
  return r;
}

}  // namespace llmpar::attention_check
