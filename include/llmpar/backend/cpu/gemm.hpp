// llmpar/backend/cpu/gemm.hpp — row-major GEMM on the CPU through oneDNN.
//
// Every matrix product of a training step goes through gemm(): forward (Y = X·Wᵀ),
// input gradient (dX = dY·W) and weight gradient (dW += dYᵀ·X). On these shapes
// oneDNN's matmul primitive measured as fast as OpenBLAS and faster than BLIS
// (docs/cpu-gemm.md); it shares the OpenMP runtime with llmpar's own kernels, so no two
// thread pools fight over cores, and it has a bf16 path on CPUs that support one.
//
// Creating a oneDNN primitive costs far more than running a small one, so the Context
// caches one primitive per (shape, transposes, accumulate, bias) and only wraps the
// caller's pointers on each call. The Context is passed explicitly — no process-wide
// state — so two models with different configurations can live in one process.
//
// double is supported through a plain reference loop: it exists for the finite-
// difference tests of whole layers, never for training.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <type_traits>

#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"

namespace llmpar::backend::cpu {

// Which operand is used transposed. Storage is row-major: A is (M,K), or (K,M) when
// transposed; B is (K,N), or (N,K) when transposed; C is (M,N).
struct GemmOp {
  bool trans_a = false;
  bool trans_b = false;
  bool accumulate = false;  // C += A·B instead of C = A·B
};

// The CPU execution context: oneDNN engine and stream, and the primitive cache.
class Context {
 public:
  Context() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // C(M,N) [+]= op(A)·op(B) [+ bias(N) broadcast over rows].
  void sgemm(float* c, const float* a, const float* b, const float* bias, std::int64_t m, std::int64_t n,
             std::int64_t k, GemmOp op) {
    LLMPAR_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm sizes must be >= 0, got M=", m, " N=", n, " K=", k);
    if (m == 0 || n == 0) return;
    using tag = dnnl::memory::data_type;
    const Key key{m, n, k, op.trans_a, op.trans_b, op.accumulate, bias != nullptr};
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      const dnnl::memory::desc a_md({m, k}, tag::f32, op.trans_a ? dnnl::memory::dims{1, m} : dnnl::memory::dims{k, 1});
      const dnnl::memory::desc b_md({k, n}, tag::f32, op.trans_b ? dnnl::memory::dims{1, k} : dnnl::memory::dims{n, 1});
      const dnnl::memory::desc c_md({m, n}, tag::f32, dnnl::memory::dims{n, 1});
      const dnnl::memory::desc bias_md =
          bias ? dnnl::memory::desc({1, n}, tag::f32, dnnl::memory::dims{n, 1}) : dnnl::memory::desc();
      dnnl::primitive_attr attr;
      if (op.accumulate) {
        dnnl::post_ops post;
        post.append_sum(1.0f);
        attr.set_post_ops(post);
      }
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, bias_md, c_md), attr, engine_);
      it = cache_.emplace(key, Entry{dnnl::matmul(pd), a_md, b_md, c_md, bias_md}).first;
    }
    const Entry& e = it->second;
    dnnl::memory a_mem(e.a_md, engine_, const_cast<float*>(a));
    dnnl::memory b_mem(e.b_md, engine_, const_cast<float*>(b));
    dnnl::memory c_mem(e.c_md, engine_, c);
    if (bias) {
      dnnl::memory bias_mem(e.bias_md, engine_, const_cast<float*>(bias));
      e.primitive.execute(
          stream_,
          {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_BIAS, bias_mem}, {DNNL_ARG_DST, c_mem}});
    } else {
      e.primitive.execute(stream_, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
    }
    stream_.wait();
  }

  std::size_t cached_primitives() const { return cache_.size(); }

 private:
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, bool, bool, bool>;
  struct Entry {
    dnnl::matmul primitive;
    dnnl::memory::desc a_md, b_md, c_md, bias_md;
  };
  dnnl::engine engine_;
  dnnl::stream stream_;
  std::map<Key, Entry> cache_;
};

// The reference product in the element type itself, for tests in double precision.
template <class T>
void reference_gemm(T* c, const T* a, const T* b, const T* bias, std::int64_t m, std::int64_t n, std::int64_t k,
                    GemmOp op) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      T acc = bias ? bias[j] : T(0);
      for (std::int64_t p = 0; p < k; ++p) {
        const T av = op.trans_a ? a[p * m + i] : a[i * k + p];
        const T bv = op.trans_b ? b[j * k + p] : b[p * n + j];
        acc += av * bv;
      }
      c[i * n + j] = op.accumulate ? c[i * n + j] + acc : acc;
    }
  }
}

// C(M,N) [+]= op(A)·op(B) [+ bias]: oneDNN for float, the reference loop for double.
template <class T>
void gemm(Context& ctx, T* c, const T* a, const T* b, const T* bias, std::int64_t m, std::int64_t n, std::int64_t k,
          GemmOp op = {}) {
  if constexpr (std::is_same_v<T, float>) {
    ctx.sgemm(c, a, b, bias, m, n, k, op);
  } else {
    static_assert(std::is_same_v<T, double>, "llmpar: CPU gemm supports float (oneDNN) and double (reference)");
    reference_gemm(c, a, b, bias, m, n, k, op);
  }
}

// Best sgemm throughput of this machine in GFLOP/s, measured on square products large
// enough to reach the library's peak: the denominator of MFU on the CPU.
inline double measure_sgemm_peak_gflops(Context& ctx, std::int64_t size = 1536, int repeats = 4) {
  Buffer<float> a(size * size), b(size * size), c(size * size);
  for (std::int64_t i = 0; i < size * size; ++i) {
    a[i] = static_cast<float>(i % 7) * 0.01f;
    b[i] = static_cast<float>(i % 5) * 0.01f;
  }
  double best = 0.0;
  for (int r = 0; r <= repeats; ++r) {  // the first run warms caches and the primitive
    const auto t0 = std::chrono::steady_clock::now();
    ctx.sgemm(c.data(), a.data(), b.data(), nullptr, size, size, size, {});
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::max(best, 2.0 * static_cast<double>(size) * size * size / s * 1e-9);
  }
  return best;
}

}  // namespace llmpar::backend::cpu
