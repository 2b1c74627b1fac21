// bench_gemm_libraries — which CPU GEMM library the CPU backend should call.
//
// Measures fp32 GFLOP/s of oneDNN's matmul primitive, OpenBLAS's cblas_sgemm and BLIS's
// bli_sgemm (the last two where CMake found their OpenMP builds), and oneDNN's bf16
// matmul with f32 accumulation, on the GEMMs of one GPT-2 124M training step at B=4,
// T=64: M = B*T = 256 rows through each linear layer (in -> out), in the three forms a
// step runs, with weights stored [out, in] as in llm.c and PyTorch:
//   fwd  Y[M,out]   = X[M,in] . W[out,in]^T
//   dX   dX[M,in]   = dY[M,out] . W[out,in]
//   dW   dW[out,in] += dY[M,out]^T . X[M,in]      (accumulates, as a trainer does)
// Every library gets the same operands in the same row-major layout, and its
// transposes are expressed as strides or flags, never as copies. oneDNN primitives are
// created once per shape and executed repeatedly, as the CPU backend does.
//
// Also measured: the peak FMA rate of this CPU (independent 256-bit FMA chains), one
// thread and all threads, the ceiling the GEMM numbers are read against.
//
// Threads: OMP_NUM_THREADS (all three libraries use the OpenMP runtime here). Before
// timing anything the program checks each library's result on small problems of the
// same three forms against a plain reference loop, so a wrong stride cannot produce
// a fast wrong answer.
#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if LLMPAR_BENCH_OPENBLAS
#include <cblas.h>  // OpenBLAS's, found first: it also guards BLIS's copy of the CBLAS API
#endif
#if LLMPAR_BENCH_BLIS
#include <blis.h>
#endif

#include "llmpar/core/dtype.hpp"
#include "llmpar/core/rng.hpp"

namespace {

// One GEMM: C[m,n] = A[m,k] . B[k,n] + beta * C, all row-major. A is stored [k,m]
// when trans_a (a transposed view), B is stored [n,k] when trans_b.
struct Gemm {
  std::string name;  // layer_pass, e.g. "qkv_fwd"
  std::int64_t m, n, k;
  bool trans_a, trans_b;
  float beta;

  std::int64_t lda() const { return trans_a ? m : k; }
  std::int64_t ldb() const { return trans_b ? k : n; }
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
};

struct Linear {
  const char* name;
  std::int64_t in, out;
};

// GPT-2 124M (C = 768, 4C MLP, vocabulary padded to 50304) at B*T = 256 tokens.
std::vector<Gemm> gpt2_step_gemms(std::int64_t tokens) {
  const Linear layers[] = {
      {"qkv", 768, 2304}, {"attn_proj", 768, 768}, {"fc", 768, 3072}, {"fc_proj", 3072, 768}, {"lm_head", 768, 50304}};
  std::vector<Gemm> gemms;
  for (const Linear& l : layers) {
    gemms.push_back({std::string(l.name) + "_fwd", tokens, l.out, l.in, false, true, 0.0f});
    gemms.push_back({std::string(l.name) + "_dX", tokens, l.in, l.out, false, false, 0.0f});
    gemms.push_back({std::string(l.name) + "_dW", l.out, l.in, tokens, true, false, 1.0f});
  }
  return gemms;
}

// ---------------------------------------------------------------------------------------
// Operands, aligned and filled with uniform values in [-1, 1).

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <class T>
using HostArray = std::unique_ptr<T[], FreeDeleter>;

template <class T>
HostArray<T> allocate(std::int64_t count) {
  const std::size_t bytes = (static_cast<std::size_t>(count) * sizeof(T) + 63) / 64 * 64;
  T* p = static_cast<T*>(std::aligned_alloc(64, bytes));
  if (p == nullptr) {
    std::fprintf(stderr, "bench_gemm_libraries: out of memory allocating %zu bytes\n", bytes);
    std::exit(1);
  }
  return HostArray<T>(p);
}

struct Operands {
  std::int64_t a_size, b_size, c_size;
  HostArray<float> a, b, c;
  HostArray<llmpar::bf16> a_bf16, b_bf16;  // made on first use

  explicit Operands(const Gemm& g)
      : a_size(g.m * g.k),
        b_size(g.k * g.n),
        c_size(g.m * g.n),
        a(allocate<float>(a_size)),
        b(allocate<float>(b_size)),
        c(allocate<float>(c_size)) {
    fill(a.get(), a_size, "A");
    fill(b.get(), b_size, "B");
    fill(c.get(), c_size, "C");
  }
  static void fill(float* x, std::int64_t count, const char* name) {
    const auto stream = llmpar::rng::Stream::named(42, name);
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < count; ++i) x[i] = 2.0f * stream.uniform(static_cast<std::uint64_t>(i)) - 1.0f;
  }
  void make_bf16() {
    if (a_bf16) return;
    a_bf16 = allocate<llmpar::bf16>(a_size);
    b_bf16 = allocate<llmpar::bf16>(b_size);
    for (std::int64_t i = 0; i < a_size; ++i) a_bf16[i] = llmpar::bf16(a[i]);
    for (std::int64_t i = 0; i < b_size; ++i) b_bf16[i] = llmpar::bf16(b[i]);
  }
};

// The lm_head operands are 150 MB each: keep only the current shape's (benchmarks are
// registered shape by shape, every library in turn).
Operands& operands_for(const Gemm& g) {
  static std::string current;
  static std::unique_ptr<Operands> ops;
  if (!ops || current != g.name) {
    ops.reset();
    ops = std::make_unique<Operands>(g);
    current = g.name;
  }
  return *ops;
}

// ---------------------------------------------------------------------------------------
// The libraries. Each returns a callable that runs the GEMM once on the given operands.

using Runner = std::function<void()>;

struct OneDnn {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};

  static dnnl::memory::desc desc(std::int64_t rows, std::int64_t cols, bool transposed, dnnl::memory::data_type t) {
    // A logical [rows, cols] matrix stored row-major, or stored [cols, rows] when transposed.
    const dnnl::memory::dims strides = transposed ? dnnl::memory::dims{1, rows} : dnnl::memory::dims{cols, 1};
    return dnnl::memory::desc({rows, cols}, t, strides);
  }

  // bf16: A and B in bf16, C in f32 (the library accumulates in f32).
  struct Primitive {
    dnnl::matmul matmul;
    dnnl::memory a, b, c;
    std::string impl;
  };
  Primitive make(const Gemm& g, void* a, void* b, float* c, bool bf16) {
    using dt = dnnl::memory::data_type;
    const dt in_type = bf16 ? dt::bf16 : dt::f32;
    const auto a_md = desc(g.m, g.k, g.trans_a, in_type);
    const auto b_md = desc(g.k, g.n, g.trans_b, in_type);
    const auto c_md = desc(g.m, g.n, false, dt::f32);
    dnnl::primitive_attr attr;
    if (g.beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(g.beta);
      attr.set_post_ops(ops);
    }
#if DNNL_VERSION_MAJOR >= 3
    const dnnl::matmul::primitive_desc pd(engine, a_md, b_md, c_md, attr);
#else
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine);
#endif
    return {dnnl::matmul(pd), dnnl::memory(a_md, engine, a), dnnl::memory(b_md, engine, b),
            dnnl::memory(c_md, engine, c), pd.impl_info_str()};
  }
  Runner runner(const Primitive& p) {
    return [this, p] {
      p.matmul.execute(stream, {{DNNL_ARG_SRC, p.a}, {DNNL_ARG_WEIGHTS, p.b}, {DNNL_ARG_DST, p.c}});
      stream.wait();
    };
  }
};

OneDnn& onednn() {
  static OneDnn instance;
  return instance;
}

struct Library {
  std::string name;
  // Makes a runner for g on ops; `impl` receives what the library chose, if it says.
  std::function<Runner(const Gemm&, Operands&, std::string& impl)> make;
  bool bf16_inputs = false;
};

std::vector<Library> libraries() {
  std::vector<Library> libs;
  libs.push_back({"onednn_f32", [](const Gemm& g, Operands& o, std::string& impl) {
                    auto p = onednn().make(g, o.a.get(), o.b.get(), o.c.get(), false);
                    impl = p.impl;
                    return onednn().runner(p);
                  }});
#if LLMPAR_BENCH_OPENBLAS
  libs.push_back({"openblas_f32", [](const Gemm& g, Operands& o, std::string& impl) -> Runner {
                    impl = "cblas_sgemm";
                    return [g, a = o.a.get(), b = o.b.get(), c = o.c.get()] {
                      cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                                  g.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(g.m), static_cast<int>(g.n),
                                  static_cast<int>(g.k), 1.0f, a, static_cast<int>(g.lda()), b,
                                  static_cast<int>(g.ldb()), g.beta, c, static_cast<int>(g.n));
                    };
                  }});
#endif
#if LLMPAR_BENCH_BLIS
  libs.push_back({"blis_f32", [](const Gemm& g, Operands& o, std::string& impl) -> Runner {
                    impl = "bli_sgemm";
                    return [g, a = o.a.get(), b = o.b.get(), c = o.c.get()] {
                      // Transposes as strides: (row stride, column stride) of each operand.
                      float alpha = 1.0f, beta = g.beta;
                      const inc_t rsa = g.trans_a ? 1 : g.k, csa = g.trans_a ? g.m : 1;
                      const inc_t rsb = g.trans_b ? 1 : g.n, csb = g.trans_b ? g.k : 1;
                      bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, g.m, g.n, g.k, &alpha, a, rsa, csa, b, rsb, csb,
                                &beta, c, g.n, 1);
                    };
                  }});
#endif
  libs.push_back({"onednn_bf16",
                  [](const Gemm& g, Operands& o, std::string& impl) {
                    o.make_bf16();
                    auto p = onednn().make(g, o.a_bf16.get(), o.b_bf16.get(), o.c.get(), true);
                    impl = p.impl;
                    return onednn().runner(p);
                  },
                  true});
  return libs;
}

// ---------------------------------------------------------------------------------------
// Correctness first: each library against a plain loop on small problems of each form.

enum class Check { ok, wrong, unavailable };

Check check_library(const Library& lib) {
  const std::int64_t m = 67, n = 45, k = 33;  // odd sizes: edge tiles in every direction
  const Gemm forms[] = {{"check_fwd", m, n, k, false, true, 0.0f},
                        {"check_dX", m, n, k, false, false, 0.0f},
                        {"check_dW", m, n, k, true, false, 1.0f}};
  Check result = Check::ok;
  for (const Gemm& g : forms) {
    Operands o(g);
    std::vector<float> expected(static_cast<std::size_t>(g.m * g.n));
    auto in = [&](const float* x) { return lib.bf16_inputs ? static_cast<float>(llmpar::bf16(*x)) : *x; };
    for (std::int64_t i = 0; i < g.m; ++i) {
      for (std::int64_t j = 0; j < g.n; ++j) {
        double sum = 0;
        for (std::int64_t p = 0; p < g.k; ++p) {
          const float a = in(&o.a[g.trans_a ? p * g.m + i : i * g.k + p]);
          const float b = in(&o.b[g.trans_b ? j * g.k + p : p * g.n + j]);
          sum += static_cast<double>(a) * b;
        }
        expected[static_cast<std::size_t>(i * g.n + j)] =
            static_cast<float>(sum + static_cast<double>(g.beta) * o.c[i * g.n + j]);
      }
    }
    std::string impl;
    try {
      lib.make(g, o, impl)();
    } catch (const dnnl::error& e) {  // no implementation for this data type on this CPU
      benchmark::AddCustomContext(lib.name, std::string("unavailable on this CPU: ") + e.what());
      return Check::unavailable;
    }
    double worst = 0;
    for (std::int64_t i = 0; i < g.m * g.n; ++i) {
      worst = std::max(worst, static_cast<double>(std::fabs(o.c[i] - expected[static_cast<std::size_t>(i)])));
    }
    if (!(worst <= 1e-3)) {  // sums of 33 products in [-1, 1]: f32 error is ~1e-6
      std::fprintf(stderr, "bench_gemm_libraries: %s gives a wrong %s (max abs error %g)\n", lib.name.c_str(),
                   g.name.c_str(), worst);
      result = Check::wrong;
    }
  }
  return result;
}

// ---------------------------------------------------------------------------------------
// Peak FMA rate: 12 independent chains of 256-bit FMAs (enough to cover the FMA latency
// on every x86 core), acc = acc * a + b, which stays finite and normal.

#if defined(__AVX__) && defined(__FMA__)
__attribute__((noinline)) float fma_chains(std::int64_t repeats) {
  __m256 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_ps(1.0f + 0.01f * static_cast<float>(j));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-6f);
  for (std::int64_t r = 0; r < repeats; ++r) {
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  }
  __m256 sum = acc[0];
  for (int j = 1; j < 12; ++j) sum = _mm256_add_ps(sum, acc[j]);
  return _mm256_cvtss_f32(sum);
}

void BM_fma_peak(benchmark::State& state) {
  const int threads = state.range(0) == 0 ? omp_get_max_threads() : static_cast<int>(state.range(0));
  constexpr std::int64_t kRepeats = 1 << 20;
  for (auto _ : state) {
    float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    total += fma_chains(kRepeats);
    benchmark::DoNotOptimize(total);
  }
  const double flops = static_cast<double>(threads) * kRepeats * 12 * 8 * 2;
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
}
#endif

#if LLMPAR_BENCH_OPENBLAS
std::string openmp_kind(int parallel) {
  switch (parallel) {
    case 0:
      return "sequential";
    case 1:
      return "pthreads";
    case 2:
      return "OpenMP";
    default:
      return "unknown (" + std::to_string(parallel) + ")";
  }
}
#endif

std::string library_of(void* symbol) {
  Dl_info info{};
  if (dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return "?";
  return info.dli_fname;
}

void describe_libraries() {
  const int threads = omp_get_max_threads();
  benchmark::AddCustomContext("omp_max_threads", std::to_string(threads));
  const dnnl_version_t* v = dnnl_version();
  benchmark::AddCustomContext("onednn", std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                                            std::to_string(v->patch) + " (" +
                                            library_of(reinterpret_cast<void*>(&dnnl_version)) + ")");
#if LLMPAR_BENCH_OPENBLAS
  openblas_set_num_threads(threads);
  benchmark::AddCustomContext("openblas", std::string(openblas_get_config()) + ", " +
                                              openmp_kind(openblas_get_parallel()) + " build, " +
                                              std::to_string(openblas_get_num_threads()) + " threads");
  benchmark::AddCustomContext("cblas_sgemm_from", library_of(reinterpret_cast<void*>(&cblas_sgemm)));
#endif
#if LLMPAR_BENCH_BLIS
  bli_thread_set_num_threads(threads);
  benchmark::AddCustomContext("blis", std::string(bli_info_get_version_str()) + ", " +
                                          bli_arch_string(bli_arch_query_id()) + " kernels, " +
                                          (bli_info_get_enable_openmp() ? "OpenMP" : "no OpenMP") + " build, " +
                                          std::to_string(bli_thread_get_num_threads()) + " threads (" +
                                          library_of(reinterpret_cast<void*>(&bli_sgemm)) + ")");
#endif
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  describe_libraries();

  std::vector<Library> libs;
  for (Library& lib : libraries()) {
    const Check c = check_library(lib);
    if (c == Check::wrong) return 1;
    if (c == Check::ok) libs.push_back(std::move(lib));
  }

#if defined(__AVX__) && defined(__FMA__)
  benchmark::RegisterBenchmark("fma_peak", BM_fma_peak)->Arg(1)->Arg(0)->UseRealTime()->Unit(benchmark::kMillisecond);
#endif

  // Shape by shape, every library in turn (they share one shape's operands).
  for (const Gemm& g : gpt2_step_gemms(256)) {
    for (const Library& lib : libs) {
      const std::string name = "gemm/" + g.name + "/" + lib.name + "/m:" + std::to_string(g.m) +
                               "/n:" + std::to_string(g.n) + "/k:" + std::to_string(g.k);
      benchmark::RegisterBenchmark(name.c_str(),
                                   [g, lib](benchmark::State& state) {
                                     Operands& ops = operands_for(g);
                                     std::string impl;
                                     const Runner run = lib.make(g, ops, impl);
                                     run();  // first call: one-time setup inside the library (packing buffers, JIT)
                                     for (auto _ : state) run();
                                     state.counters["GFLOPS"] = benchmark::Counter(
                                         g.flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
                                     state.SetLabel(impl);
                                   })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
