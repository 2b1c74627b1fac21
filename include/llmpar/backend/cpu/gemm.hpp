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
//   native     oneDNN's matmul in the storage types (f32: its sgemm; bf16: its bf16
//              kernels: AMX tiles, or AVX512-BF16 dot products).
//   upconvert  A, B (and bias, and C when it is 16-bit) converted to f32 scratch, the f32
//              matmul, C converted back: the same products (exact in f32) summed in f32.
// Which one bf16 takes (Context::Config::bf16):
//  - measured (the default): the first GEMM of a shape times both paths on scratch
//    operands and keeps native only when it is at least kNativeMargin faster. Whether
//    bf16 kernels pay is a fact of the CPU and of the oneDNN build that no ISA flag
//    settles: with AMX they run several times f32's rate; on an Emerald Rapids without
//    AMX (AVX512-BF16 only) oneDNN 2.6's bf16 kernels ran the GPT-2 124M step's GEMMs at
//    130-150 GFLOP/s against 150-250 for its f32 kernels, so upconverting won on 9 of
//    10 shapes (docs/cpu-gemm.md); on CPUs whose AVX512-BF16 dot product runs at twice
//    the FMA rate (AMD Zen 5) native should win again. A close call stays on upconvert,
//    so a shape does not flip between runs on noise. The measurements are kept per
//    process (measured_paths()): every Context of a process, and so every rank of a
//    threaded run, takes the same path for the same shape, and layouts stay bit-
//    comparable. Separate processes (MPI ranks, a resumed run) measure for themselves;
//    a run that must repeat another bit for bit in bf16 pins the path instead.
//  - native or upconvert: pinned (tests, benchmarks, bit-exact reruns).
//  - f16 always upconverts on the CPU: oneDNN 2.6 has no fast f16 CPU matmul, and some
//    fp16-ISA kernels accumulate in f16, which would break the f32-accumulation contract.
// A native bf16 primitive that oneDNN can only give as its reference loop (AVX2-only
// CPUs: hundreds of times slower) is never taken: such shapes upconvert, unmeasured.
// The path, oneDNN's implementation name and the measurement of every cached primitive
// can be read back (implementation(), measurement()); the tests run both paths.
//
// Creating a oneDNN primitive costs far more than running a small one, so the Context
// caches one primitive per key and only wraps the caller's pointers on each call. The
// Context is passed explicitly, so two models with different configurations can live in
// one process; the only state shared across Contexts is the measured bf16 paths, a fact
// of the machine (as oneDNN's own primitive cache is process-wide).
//
// double is supported through a plain reference loop: it exists for the finite-
// difference tests of whole layers, never for training.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
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

// How a Context picks the bf16 path: by measuring each shape, or pinned to one path.
enum class Bf16Gemm : std::uint8_t { measured, native, upconvert };

// The names of Bf16Gemm's values, as train_gpt's --cpu-bf16-gemm takes them.
inline const char* name_of(Bf16Gemm g) {
  switch (g) {
    case Bf16Gemm::native:
      return "native";
    case Bf16Gemm::upconvert:
      return "upconvert";
    default:
      return "measured";
  }
}
inline Bf16Gemm bf16_gemm_of_flag(std::string_view name) {
  if (name == "measured") return Bf16Gemm::measured;
  if (name == "native") return Bf16Gemm::native;
  if (name == "upconvert") return Bf16Gemm::upconvert;
  LLMPAR_FAIL("bf16 GEMM choice '", name, "' is not one of measured, native, upconvert");
}

// A measured bf16 shape keeps native only when native_s < kNativeMargin · upconvert_s.
inline constexpr double kNativeMargin = 0.9;

// One measured choice: the path taken and the best time of each path on the shape.
struct GemmMeasurement {
  GemmPath path = GemmPath::upconvert;
  double native_s = 0.0;
  double upconvert_s = 0.0;
};

// One GEMM of a step: C(M,N) [+]= op(A)·op(B).
struct GemmShape {
  std::int64_t m = 0, n = 0, k = 0;
  GemmOp op{};
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
};

// The three GEMMs of a linear layer in (out, in) weight layout over `rows` rows:
// forward Y = X·Wᵀ, input gradient dX = dY·W, weight gradient dW += dYᵀ·X.
inline std::vector<GemmShape> linear_layer_shapes(std::int64_t rows, std::int64_t in, std::int64_t out) {
  return {{rows, out, in, {.trans_a = false, .trans_b = true, .accumulate = false}},
          {rows, in, out, {}},
          {out, in, rows, {.trans_a = true, .trans_b = false, .accumulate = true}}};
}

// The GEMMs of a step at `rows` rows whose linear layers have these (in, out) sizes
// (e.g. models::GPT2Config::linear_sizes()).
inline std::vector<GemmShape> step_gemm_shapes(std::int64_t rows,
                                               std::span<const std::pair<std::int64_t, std::int64_t>> linear_sizes) {
  std::vector<GemmShape> shapes;
  for (const auto& [in, out] : linear_sizes)
    for (const GemmShape& s : linear_layer_shapes(rows, in, out)) shapes.push_back(s);
  return shapes;
}

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

// m, n, k, trans_a, trans_b, accumulate, bias, operand DType, output DType.
using GemmKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, bool, bool, bool, int, int>;

// The bf16 paths measured in this process, by key without the bias (a bias epilogue
// does not change which path is faster): shared by every Context (the file's note).
struct MeasuredPaths {
  std::mutex mutex;
  std::map<GemmKey, GemmMeasurement> paths;
};
inline MeasuredPaths& measured_paths() {
  static MeasuredPaths paths;
  return paths;
}

}  // namespace detail

// The CPU execution context: oneDNN engine and stream, the primitive cache, and the
// scratch of the upconvert path.
class Context {
 public:
  struct Config {
    // bf16 GEMMs: measured per shape (the file's note), or pinned to oneDNN's bf16
    // kernels (native) or its f32 kernels after widening the operands (upconvert).
    Bf16Gemm bf16 = Bf16Gemm::measured;
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
    Entry& e = entry<T, TC>(key_of<T, TC>(m, n, k, op, bias != nullptr), op);
    if (e.path == GemmPath::native)
      execute(e, const_cast<T*>(a), const_cast<T*>(b), const_cast<T*>(bias), c);
    else if constexpr (!std::is_same_v<T, float>)
      upconvert(c, a, b, bias, m, n, k, op);
  }

  // The f32 product, kept under its old name for callers that only ever had it.
  void sgemm(float* c, const float* a, const float* b, const float* bias, std::int64_t m, std::int64_t n,
             std::int64_t k, GemmOp op) {
    gemm<float, float>(c, a, b, bias, m, n, k, op);
  }

  // How a GEMM of these types and shape runs: "native <oneDNN implementation>" or
  // "upconvert to f32 (<implementation of the f32 product>)", and for a measured bf16
  // shape the two times, e.g. "native brg:avx512_core_amx (measured: 0.21 ms; upconvert
  // 0.93 ms)". Creates the primitive (and measures) if needed.
  template <class T, class TC = T>
  std::string implementation(std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op = {}, bool bias = false) {
    const Entry& e = entry<T, TC>(key_of<T, TC>(m, n, k, op, bias), op);
    std::string how;
    if (e.path == GemmPath::native) {
      how = "native " + e.impl;
    } else {
      const Entry& f = entry<float, float>(key_of<float, float>(m, n, k, op, bias), op);
      how = "upconvert to f32 (" + f.impl + ")";
    }
    if (e.measurement) {
      char times[96];
      std::snprintf(times, sizeof times, " (measured: %.3g ms; %s %.3g ms)",
                    1e3 * (e.path == GemmPath::native ? e.measurement->native_s : e.measurement->upconvert_s),
                    e.path == GemmPath::native ? "upconvert" : "native",
                    1e3 * (e.path == GemmPath::native ? e.measurement->upconvert_s : e.measurement->native_s));
      how += times;
    }
    return how;
  }

  // The path a GEMM of these types and shape takes. Creates the primitive (and
  // measures) if needed.
  template <class T, class TC = T>
  GemmPath path(std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op = {}, bool bias = false) {
    return entry<T, TC>(key_of<T, TC>(m, n, k, op, bias), op).path;
  }

  // The measurement that chose this bf16 GEMM's path; none when the path was pinned,
  // the types are not bf16, or oneDNN has no bf16 kernel for it. Creates the primitive
  // (and measures) if needed.
  template <class T, class TC = T>
  std::optional<GemmMeasurement> measurement(std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op = {},
                                             bool bias = false) {
    return entry<T, TC>(key_of<T, TC>(m, n, k, op, bias), op).measurement;
  }

  std::size_t cached_primitives() const { return cache_.size(); }
  const Config& config() const { return cfg_; }
  // Bytes of the upconvert path's f32 scratch (0 when no GEMM needed it).
  std::size_t scratch_bytes() const { return scratch_.bytes(); }

 private:
  using Key = detail::GemmKey;
  struct Entry {
    GemmPath path = GemmPath::native;
    std::string impl;  // oneDNN's implementation name (native only)
    dnnl::matmul primitive;
    dnnl::memory::desc a_md, b_md, c_md, bias_md;
    std::optional<GemmMeasurement> measurement;  // measured bf16 shapes only
  };

  template <class T, class TC>
  static Key key_of(std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op, bool bias) {
    return {m,
            n,
            k,
            op.trans_a,
            op.trans_b,
            op.accumulate,
            bias,
            static_cast<int>(dtype_of<T>()),
            static_cast<int>(dtype_of<TC>())};
  }

  template <class T, class TC>
  Entry& entry(const Key& key, GemmOp op) {
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    const std::int64_t m = std::get<0>(key), n = std::get<1>(key), k = std::get<2>(key);
    const bool has_bias = std::get<6>(key);
    Entry e;
    if constexpr (std::is_same_v<T, float>) {
      LLMPAR_CHECK((create<T, TC>(e, m, n, k, op, has_bias)), "oneDNN has no f32 matmul for M=", m, " N=", n, " K=", k,
                   " on this CPU; this oneDNN build is unusable here");
    } else if constexpr (std::is_same_v<T, bf16>) {
      if (cfg_.bf16 == Bf16Gemm::upconvert || !create<T, TC>(e, m, n, k, op, has_bias)) {
        e.path = GemmPath::upconvert;
      } else if (cfg_.bf16 == Bf16Gemm::measured) {
        e.measurement = measured<T, TC>(key, op, has_bias ? nullptr : &e);
        e.path = e.measurement->path;
      }
    } else {
      e.path = GemmPath::upconvert;  // f16 (the file's note)
    }
    return cache_.emplace(key, std::move(e)).first->second;
  }

  // The process's measured path for a bf16 key (measured now if this is its first use
  // in the process): the best of kRepeats alternating runs of each path, on scratch
  // operands of small non-zero values, after one warm-up run of each. `native`: the
  // key's own bias-less primitive, or null to create one without the bias.
  template <class T, class TC>
  GemmMeasurement measured(const Key& key, GemmOp op, const Entry* native) {
    static constexpr int kRepeats = 3;
    Key shape = key;
    std::get<6>(shape) = false;
    detail::MeasuredPaths& memo = detail::measured_paths();
    const std::lock_guard lock(memo.mutex);
    if (auto it = memo.paths.find(shape); it != memo.paths.end()) return it->second;
    const std::int64_t m = std::get<0>(key), n = std::get<1>(key), k = std::get<2>(key);
    Entry without_bias;
    if (native == nullptr) {
      LLMPAR_CHECK((create<T, TC>(without_bias, m, n, k, op, false)), "oneDNN gave a bf16 matmul for M=", m, " N=", n,
                   " K=", k, " with a bias but none without");
      native = &without_bias;
    }
    Buffer<T> a(m * k), b(k * n);
    Buffer<TC> c(m * n);
    for (std::int64_t i = 0; i < m * k; ++i) a[i] = static_cast<T>(static_cast<float>(i % 7 + 1) * 0.01f);
    for (std::int64_t i = 0; i < k * n; ++i) b[i] = static_cast<T>(static_cast<float>(i % 5 + 1) * 0.01f);
    c.zero();
    using clock = std::chrono::steady_clock;
    const auto timed = [](auto&& run) {
      const auto t0 = clock::now();
      run();
      return std::chrono::duration<double>(clock::now() - t0).count();
    };
    const auto run_native = [&] { execute(*native, a.data(), b.data(), nullptr, c.data()); };
    const auto run_upconvert = [&] { upconvert<T, TC>(c.data(), a.data(), b.data(), nullptr, m, n, k, op); };
    run_native();
    run_upconvert();
    GemmMeasurement best{.native_s = 1e30, .upconvert_s = 1e30};
    for (int r = 0; r < kRepeats; ++r) {
      best.native_s = std::min(best.native_s, timed(run_native));
      best.upconvert_s = std::min(best.upconvert_s, timed(run_upconvert));
    }
    best.path = best.native_s < kNativeMargin * best.upconvert_s ? GemmPath::native : GemmPath::upconvert;
    return memo.paths.emplace(shape, best).first->second;
  }

  // Upconvert: f32 copies of the operands, the f32 product, C converted back.
  template <class T, class TC>
  void upconvert(TC* c, const T* a, const T* b, const T* bias, std::int64_t m, std::int64_t n, std::int64_t k,
                 GemmOp op) {
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
    Entry& f = entry<float, float>(key_of<float, float>(m, n, k, op, bias != nullptr), op);
    execute(f, a32, b32, bias ? bias32 : nullptr, c32);
    if constexpr (!std::is_same_v<TC, float>) convert(c, c32, mn);
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

// The bf16 paths of a step's GEMMs (C in bf16, or f32 for the accumulating weight-
// gradient form, as a step writes them), chosen now rather than in the first step:
// measured, unless the Context pins them. Every rank of a process may call it at once.
struct Bf16Paths {
  int native = 0, upconvert = 0;  // shapes on each path
  int measured = 0;               // of them, chosen by measuring
  double chosen_s = 0.0;          // measured shapes: the chosen paths' summed times
  double upconvert_s = 0.0;       // ... and upconvert's
  double seconds = 0.0;           // wall time of the choice

  // "native on 14 of 15 shapes, upconvert on 1 (measured: 0.38x upconvert's time; 0.9 s)"
  std::string describe() const {
    char line[192];
    int len = std::snprintf(line, sizeof line, "native on %d of %d shapes, upconvert on %d", native, native + upconvert,
                            upconvert);
    if (measured > 0 && upconvert_s > 0.0)
      std::snprintf(line + len, sizeof line - static_cast<std::size_t>(len),
                    " (measured: %.2fx upconvert's time; %.1f s)", chosen_s / upconvert_s, seconds);
    else if (measured == 0 && native + upconvert > 0)
      std::snprintf(line + len, sizeof line - static_cast<std::size_t>(len), " (not measured: %s)",
                    native == 0 ? "pinned, or oneDNN has no bf16 kernel on this CPU" : "pinned");
    return line;
  }
};

inline Bf16Paths choose_bf16_paths(Context& ctx, std::span<const GemmShape> shapes) {
  const auto start = std::chrono::steady_clock::now();
  Bf16Paths paths;
  for (const GemmShape& s : shapes) {
    const GemmPath path =
        s.op.accumulate ? ctx.path<bf16, float>(s.m, s.n, s.k, s.op) : ctx.path<bf16, bf16>(s.m, s.n, s.k, s.op);
    const std::optional<GemmMeasurement> m = s.op.accumulate ? ctx.measurement<bf16, float>(s.m, s.n, s.k, s.op)
                                                             : ctx.measurement<bf16, bf16>(s.m, s.n, s.k, s.op);
    ++(path == GemmPath::native ? paths.native : paths.upconvert);
    if (m) {
      ++paths.measured;
      paths.chosen_s += m->path == GemmPath::native ? m->native_s : m->upconvert_s;
      paths.upconvert_s += m->upconvert_s;
    }
  }
  paths.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return paths;
}

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
