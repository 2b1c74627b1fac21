// llmpar/backend/cpu/gemm.hpp — row-major GEMM on the CPU through oneDNN, in f32, bf16
// and f16 storage, always with f32 accumulation.
//
// Every matrix product of a training step goes through Context::gemm(): forward
// (Y = X·Wᵀ), input gradient (dX = dY·W) and weight gradient (dW += dYᵀ·X). On these
// shapes oneDNN's matmul primitive measured as fast as OpenBLAS and faster than BLIS
// (docs/cpu-gemm.md); it shares the OpenMP runtime with llmpar's own kernels, so no two
// thread pools fight over cores, and it has bf16 kernels on CPUs that support them.
//
// Types. The operands A and B (and the bias) are the storage type T; the output C is T
// or acc_t<T>: the weight-gradient GEMM of a bf16 or f16 model writes and accumulates
// its f32 main grads directly (gemm<bf16, float>), so no pass converts them and no
// micro-batch's gradient is rounded to 16 bits. Products of bf16/f16 values are exact in
// f32, and every path below sums them in f32.
//
// Paths, chosen once per (types, shape, transposes, accumulate, bias) and cached:
//   native     oneDNN's matmul in the storage types (f32: its sgemm; bf16: AMX tiles).
//   upconvert  A, B (and bias, and C when it is 16-bit) converted to f32 scratch, the f32
//              matmul, C converted back: the same products (exact in f32) summed in f32.
// Which one bf16 takes (Context::Config::bf16, default_bf16_path()):
//  - native where the CPU has AMX: its tile multiply runs bf16 at several times f32's
//    rate, far more than the conversions would cost;
//  - upconvert everywhere else. Measured on a Sapphire Rapids without AMX (AVX512-BF16
//    only; docs/cpu-gemm.md), oneDNN 2.6's bf16 kernels ran the GPT-2 124M step's GEMMs
//    at 130-150 GFLOP/s against 150-250 for its f32 kernels, so even with three extra
//    passes over memory the upconvert path was faster on 9 of its 10 shapes; on
//    AVX2-only CPUs (AMD Zen 1/2) oneDNN has only a reference loop for bf16, hundreds
//    of times slower. Being decided by the ISA, not by timing, the choice (and with it
//    the summation order) is the same on every run.
//  - f16 always upconverts on the CPU: oneDNN 2.6 has no fast f16 CPU matmul, and some
//    fp16-ISA kernels accumulate in f16, which would break the f32-accumulation contract.
// A native bf16 primitive that oneDNN can only give as its reference loop falls back to
// upconvert too. The path and oneDNN's implementation name of every cached primitive
// can be read back (implementation()); the tests run both paths on the same machine.
//
// Creating a oneDNN primitive costs far more than running a small one, so the Context
// caches one primitive per key and only wraps the caller's pointers on each call. The
// Context is passed explicitly — no process-wide state — so two models with different
// configurations can live in one process.
//
// double is supported through a plain reference loop: it exists for the finite-
// difference tests of whole layers, never for training.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/backend/cpu/convert.hpp"
#include "llmpar/core/dtype.hpp"
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

// How a 16-bit GEMM runs (see the file's note).
enum class GemmPath : std::uint8_t { native, upconvert };

// Whether oneDNN runs AMX (bf16 tile multiplies) on this CPU.
inline bool cpu_has_amx() {
  constexpr unsigned kAmx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
  return (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & kAmx) == kAmx;
}

// The bf16 path of this CPU: native with AMX, upconvert without (see the file's note).
inline GemmPath default_bf16_path() { return cpu_has_amx() ? GemmPath::native : GemmPath::upconvert; }

namespace detail {

template <class T>
constexpr dnnl::memory::data_type dnnl_type() {
  using tag = dnnl::memory::data_type;
  if constexpr (std::is_same_v<T, float>)
    return tag::f32;
  else if constexpr (std::is_same_v<T, bf16>)
    return tag::bf16;
  else {
    static_assert(std::is_same_v<T, f16>, "llmpar: CPU GEMMs store float, bf16 or f16 (double: reference loop)");
    return tag::f16;
  }
}

}  // namespace detail

// The CPU execution context: oneDNN engine and stream, the primitive cache, and the
// scratch of the upconvert path.
class Context {
 public:
  struct Config {
    // bf16 GEMMs: on oneDNN's bf16 kernels (native) or on its f32 kernels after widening
    // the operands (upconvert); by default, native where the CPU has AMX.
    GemmPath bf16 = default_bf16_path();
  };

  Context() : Context(Config{}) {}
  explicit Context(Config cfg) : cfg_(cfg), engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {}
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // C(M,N) [+]= op(A)·op(B) [+ bias(N) broadcast over rows]. T: float, bf16 or f16;
  // TC: T or float.
  template <class T, class TC>
  void gemm(TC* c, const T* a, const T* b, const T* bias, std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op) {
    static_assert(std::is_same_v<TC, T> || std::is_same_v<TC, float>,
                  "llmpar: a GEMM writes its storage type or f32 (main grads)");
    LLMPAR_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm sizes must be >= 0, got M=", m, " N=", n, " K=", k);
    if (m == 0 || n == 0) return;
    const Key key{m,
                  n,
                  k,
                  op.trans_a,
                  op.trans_b,
                  op.accumulate,
                  bias != nullptr,
                  static_cast<int>(dtype_of<T>()),
                  static_cast<int>(dtype_of<TC>())};
    Entry& e = entry<T, TC>(key, op, bias != nullptr);
    if (e.path == GemmPath::native) {
      execute(e, const_cast<T*>(a), const_cast<T*>(b), const_cast<T*>(bias), c);
      return;
    }
    // Upconvert: f32 copies of the operands, the f32 product, C converted back.
    if constexpr (!std::is_same_v<T, float>) {
      const std::int64_t mk = m * k, kn = k * n, mn = m * n;
      scratch_.reserve(mk + kn + n + (std::is_same_v<TC, float> ? 0 : mn));
      float* a32 = scratch_.data();
      float* b32 = a32 + mk;
      float* bias32 = b32 + kn;
      convert(a32, a, mk);
      convert(b32, b, kn);
      if (bias) convert(bias32, bias, n);
      float* c32 = nullptr;
      if constexpr (std::is_same_v<TC, float>) {
        c32 = c;
      } else {
        c32 = bias32 + n;
        if (op.accumulate) convert(c32, c, mn);
      }
      Entry& f = entry<float, float>(Key{m, n, k, op.trans_a, op.trans_b, op.accumulate, bias != nullptr,
                                         static_cast<int>(DType::f32), static_cast<int>(DType::f32)},
                                     op, bias != nullptr);
      execute(f, a32, b32, bias ? bias32 : nullptr, c32);
      if constexpr (!std::is_same_v<TC, float>) convert(c, c32, mn);
    }
  }

  // The f32 product, kept under its old name for callers that only ever had it.
  void sgemm(float* c, const float* a, const float* b, const float* bias, std::int64_t m, std::int64_t n,
             std::int64_t k, GemmOp op) {
    gemm<float, float>(c, a, b, bias, m, n, k, op);
  }

  // How a GEMM of these types and shape runs: "native <oneDNN implementation>" or
  // "upconvert to f32 (<implementation of the f32 product>)". Creates the primitive if
  // needed.
  template <class T, class TC = T>
  std::string implementation(std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op = {}, bool bias = false) {
    const Key key{m,
                  n,
                  k,
                  op.trans_a,
                  op.trans_b,
                  op.accumulate,
                  bias,
                  static_cast<int>(dtype_of<T>()),
                  static_cast<int>(dtype_of<TC>())};
    const Entry& e = entry<T, TC>(key, op, bias);
    if (e.path == GemmPath::native) return "native " + e.impl;
    const Entry& f = entry<float, float>(Key{m, n, k, op.trans_a, op.trans_b, op.accumulate, bias,
                                             static_cast<int>(DType::f32), static_cast<int>(DType::f32)},
                                         op, bias);
    return "upconvert to f32 (" + f.impl + ")";
  }

  std::size_t cached_primitives() const { return cache_.size(); }
  const Config& config() const { return cfg_; }
  // Bytes of the upconvert path's f32 scratch (0 when no GEMM needed it).
  std::size_t scratch_bytes() const { return scratch_.bytes(); }

 private:
  // m, n, k, trans_a, trans_b, accumulate, bias, operand DType, output DType.
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, bool, bool, bool, int, int>;
  struct Entry {
    GemmPath path = GemmPath::native;
    std::string impl;  // oneDNN's implementation name (native only)
    dnnl::matmul primitive;
    dnnl::memory::desc a_md, b_md, c_md, bias_md;
  };

  template <class T, class TC>
  Entry& entry(const Key& key, GemmOp op, bool has_bias) {
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    const std::int64_t m = std::get<0>(key), n = std::get<1>(key), k = std::get<2>(key);
    Entry e;
    if constexpr (std::is_same_v<T, f16>) {
      e.path = GemmPath::upconvert;
    } else {
      if (std::is_same_v<T, bf16> && cfg_.bf16 == GemmPath::upconvert) {
        e.path = GemmPath::upconvert;
      } else if (!create<T, TC>(e, m, n, k, op, has_bias)) {
        LLMPAR_CHECK((!std::is_same_v<T, float>), "oneDNN has no f32 matmul for M=", m, " N=", n, " K=", k,
                     " on this CPU; this oneDNN build is unusable here");
        e.path = GemmPath::upconvert;
      }
    }
    return cache_.emplace(key, std::move(e)).first->second;
  }

  // The native primitive; false when oneDNN has none for this CPU but its reference
  // loop (or none at all).
  template <class T, class TC>
  bool create(Entry& e, std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op, bool has_bias) {
    using dims = dnnl::memory::dims;
    const auto in = detail::dnnl_type<T>();
    const auto out = detail::dnnl_type<TC>();
    e.a_md = dnnl::memory::desc({m, k}, in, op.trans_a ? dims{1, m} : dims{k, 1});
    e.b_md = dnnl::memory::desc({k, n}, in, op.trans_b ? dims{1, k} : dims{n, 1});
    e.c_md = dnnl::memory::desc({m, n}, out, dims{n, 1});
    e.bias_md = has_bias ? dnnl::memory::desc({1, n}, in, dims{n, 1}) : dnnl::memory::desc();
    dnnl::primitive_attr attr;
    if (op.accumulate) {
      dnnl::post_ops post;
      post.append_sum(1.0f);
      attr.set_post_ops(post);
    }
    try {
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(e.a_md, e.b_md, e.bias_md, e.c_md), attr, engine_);
      e.impl = pd.impl_info_str();
      if (!std::is_same_v<T, float> && e.impl.rfind("ref", 0) == 0) return false;
      e.primitive = dnnl::matmul(pd);
    } catch (const dnnl::error&) {
      if constexpr (std::is_same_v<T, float>) throw;
      return false;
    }
    e.path = GemmPath::native;
    return true;
  }

  void execute(const Entry& e, void* a, void* b, void* bias, void* c) {
    dnnl::memory a_mem(e.a_md, engine_, a);
    dnnl::memory b_mem(e.b_md, engine_, b);
    dnnl::memory c_mem(e.c_md, engine_, c);
    if (bias) {
      dnnl::memory bias_mem(e.bias_md, engine_, bias);
      e.primitive.execute(
          stream_,
          {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_BIAS, bias_mem}, {DNNL_ARG_DST, c_mem}});
    } else {
      e.primitive.execute(stream_, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
    }
    stream_.wait();
  }

  Config cfg_;
  dnnl::engine engine_;
  dnnl::stream stream_;
  std::map<Key, Entry> cache_;
  Buffer<float> scratch_;  // upconvert: (M·K + K·N + N [+ M·N]) f32
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

// C(M,N) [+]= op(A)·op(B) [+ bias]: oneDNN for float, bf16 and f16 (C in the storage
// type or f32), the reference loop for double.
template <class T, class TC = T>
void gemm(Context& ctx, TC* c, const T* a, const T* b, const T* bias, std::int64_t m, std::int64_t n, std::int64_t k,
          GemmOp op = {}) {
  if constexpr (std::is_same_v<T, double>) {
    static_assert(std::is_same_v<TC, double>, "llmpar: the double reference GEMM writes double");
    reference_gemm(c, a, b, bias, m, n, k, op);
  } else {
    ctx.gemm<T, TC>(c, a, b, bias, m, n, k, op);
  }
}

}  // namespace llmpar::backend::cpu
