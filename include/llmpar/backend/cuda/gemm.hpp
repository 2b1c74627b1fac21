// llmpar/backend/cuda/gemm.hpp — row-major GEMM on the GPU through cuBLASLt.
//
// The CPU backend's gemm() contract, on the device: C(M,N) [+]= op(A)·op(B), row-major,
// with A (M,K) or (K,M) when transposed, B (K,N) or (N,K) when transposed. cuBLASLt is
// column-major, so the product is computed as its transpose: Cᵀ = op(B)ᵀ·op(A)ᵀ, which
// in column-major terms is "B first, A second" with the same transposition flags and
// m = N, n = M. No data moves; only the roles are swapped.
//
// Why cuBLASLt and not cuBLAS: its epilogues fuse what follows a linear layer into the
// GEMM's store (bias; GELU keeping its input for backward; dGELU; the bias gradient),
// saving a full read and write of the activation each time, which is how llm.c and
// TransformerEngine run GPT's MLP.
//
// Algorithm choice: cublasLtMatmulAlgoGetHeuristic costs tens of microseconds, more
// than a small GEMM, so the first call of each (types, shape, transposes, epilogue,
// accumulate, operand alignment) asks it once and caches the descriptors and the
// algorithm; later calls only set the epilogue pointers. Alignment is part of the key
// because the heuristic may pick a kernel that needs 16-byte-aligned operands.
//
// Workspace: 32 MiB on Hopper (its best kernels want it), 4 MiB before, allocated once.
//
// fp32 storage computes in full fp32 by default (Fp32Math::strict: CUBLAS_COMPUTE_32F,
// and the heuristic is told to exclude algorithms that read their inputs as TF32, bf16
// or f16, so "strict" is a guarantee, not a default) or, when asked, through TF32 tensor
// cores (Fp32Math::tf32, about 8x faster, inputs rounded to 10-bit mantissas). bf16/f16
// storage always accumulates in fp32, and its output is bf16/f16 or f32: the
// weight-gradient GEMMs of a 16-bit model write (and accumulate into) its f32 main grads
// directly, which cuBLASLt supports for 16-bit A and B with 32F compute and 32F C/D.
//
// Split-K and 16-bit outputs: an algorithm that splits K may reduce its partial products
// in place in D or through a workspace in the output type (CUBLASLT_REDUCTION_SCHEME_
// INPLACE, _OUTPUT_TYPE). With a bf16/f16 D that rounds each partial product to 16 bits
// before beta*C, the epilogue (dGELU, the bias gradient) and the final rounding are
// applied: C += A*B becomes T(T(A*B) + C), off by u*|A*B| rather than u*|A*B + C|. The
// first H200 run showed exactly that (tests/cuda/test_cuda_gemm.cu: accumulating bf16
// and f16 GEMMs, dGELU and bias gradients off by one extra 16-bit rounding), so for a
// 16-bit output the heuristic may only pick algorithms that reduce in the compute type
// (f32) or do not split K. An f32 output loses nothing either way and keeps them all.
//
// Every plan remembers the algorithm the heuristic chose (GemmAlgorithm), so a test that
// finds a GEMM off can print which kernel, split and reduction produced it.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "llmpar/backend/cuda/check.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"

// LLMPAR_CHECK_CUBLAS(call, message parts...): throws llmpar::Error naming the cuBLAS status.
#define LLMPAR_CHECK_CUBLAS(call, ...)                                                                                \
  do {                                                                                                                \
    const cublasStatus_t llmpar_cublas_status_ = (call);                                                              \
    if (llmpar_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                                  \
      ::llmpar::detail::throw_error(__FILE__, __LINE__, #call, "cuBLAS error ",                                       \
                                    cublasLtGetStatusName(llmpar_cublas_status_), ": ",                               \
                                    cublasLtGetStatusString(llmpar_cublas_status_) __VA_OPT__(, "; ", ) __VA_ARGS__); \
  } while (0)

namespace llmpar::backend::cuda {

// What the GEMM's store does besides writing op(A)·op(B) (cuBLASLt's epilogues, in
// row-major terms; `bias` and `aux` are the pointers given to gemm()):
//   bias          C = AB + bias(N)
//   gelu_aux_bias aux = AB + bias, C = gelu(aux)     (forward of Linear + GELU)
//   gelu_aux      aux = AB,        C = gelu(aux)
//   dgelu         C = AB * gelu'(aux)                (backward through the GELU)
//   dgelu_bgrad   as dgelu, and bias(N) = Σ_rows C   (written, not accumulated)
//   bgradb        bias(N) = Σ_K of op(A)'s columns... see below: the bias gradient of the
//                 weight-gradient GEMM dW(out,in) = dYᵀ·X, i.e. bias(M) = Σ_K op(A)(m,k)
//                 (written, not accumulated)
// aux is (M, N) row-major; N must be a multiple of 8 (cuBLASLt's rule for its stride).
enum class Epilogue : std::uint8_t { none, bias, gelu_aux, gelu_aux_bias, dgelu, dgelu_bgrad, bgradb };

struct GemmOp {
  bool trans_a = false;
  bool trans_b = false;
  bool accumulate = false;  // C += A·B instead of C = A·B
  Epilogue epilogue = Epilogue::none;
};

enum class Fp32Math : std::uint8_t { strict, tf32 };

// The algorithm cuBLASLt's heuristic chose for a plan, as its configuration attributes
// report it: what to print when a GEMM's result is off.
struct GemmAlgorithm {
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  int id = -1;                        // CUBLASLT_ALGO_CONFIG_ID
  std::uint32_t tile = 0;             // CUBLASLT_ALGO_CONFIG_TILE_ID (cublasLtMatmulTile_t)
  std::uint32_t stages = 0;           // CUBLASLT_ALGO_CONFIG_STAGES_ID
  int split_k = 1;                    // CUBLASLT_ALGO_CONFIG_SPLITK_NUM
  std::uint32_t reduction = 0;        // CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME (cublasLtReductionScheme_t)
  std::uint64_t numerics = 0;         // CUBLASLT_ALGO_CAP_NUMERICAL_IMPL_FLAGS
  std::size_t workspace_bytes = 0;    // the heuristic's workspace size for it
  bool restricted_reduction = false;  // the heuristic was limited to reductions in the compute type

  // "algo 21 tile 15 stages 8 split-K 1 (no reduction), compute 32F, FMA input 32F accumulator 32F, workspace 0 B"
  std::string describe() const {
    std::string out = "algo " + std::to_string(id) + " tile " + std::to_string(tile) + " stages " +
                      std::to_string(stages) + " split-K " + std::to_string(split_k) + " (";
    switch (reduction) {
      case CUBLASLT_REDUCTION_SCHEME_NONE:
        out += "no reduction";
        break;
      case CUBLASLT_REDUCTION_SCHEME_INPLACE:
        out += "reduced in place in the output type";
        break;
      case CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE:
        out += "reduced in the compute type";
        break;
      case CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE:
        out += "reduced in the output type";
        break;
      default:
        out += reduction == ~0u ? "reduction not reported" : "reduction " + std::to_string(reduction);
    }
    out += restricted_reduction ? ", output-type reductions excluded), compute " : "), compute ";
    switch (compute) {
      case CUBLAS_COMPUTE_32F:
        out += "32F";
        break;
      case CUBLAS_COMPUTE_32F_PEDANTIC:
        out += "32F_PEDANTIC";
        break;
      case CUBLAS_COMPUTE_32F_FAST_TF32:
        out += "32F_FAST_TF32";
        break;
      default:
        out += std::to_string(static_cast<int>(compute));
    }
    out += ",";
    const std::pair<std::uint64_t, const char*> flags[] = {
        {CUBLASLT_NUMERICAL_IMPL_FLAGS_FMA, " FMA"},
        {CUBLASLT_NUMERICAL_IMPL_FLAGS_HMMA, " HMMA"},
        {CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_16F, " input 16F"},
        {CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_16BF, " input 16BF"},
        {CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_TF32, " input TF32"},
        {CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_32F, " input 32F"},
        {CUBLASLT_NUMERICAL_IMPL_FLAGS_ACCUMULATOR_16F, " accumulator 16F"},
        {CUBLASLT_NUMERICAL_IMPL_FLAGS_ACCUMULATOR_32F, " accumulator 32F"},
        {CUBLASLT_NUMERICAL_IMPL_FLAGS_GAUSSIAN, " gaussian"},
    };
    for (const auto& [bit, name] : flags)
      if ((numerics & bit) != 0) out += name;
    return out + ", workspace " + std::to_string(workspace_bytes) + " B";
  }
};

namespace detail {

template <class T>
constexpr cudaDataType_t cuda_type() {
  if constexpr (std::is_same_v<T, float>)
    return CUDA_R_32F;
  else if constexpr (std::is_same_v<T, bf16>)
    return CUDA_R_16BF;
  else {
    static_assert(std::is_same_v<T, f16>, "llmpar: cuBLASLt GEMMs store float, bf16 or f16");
    return CUDA_R_16F;
  }
}

constexpr cublasLtEpilogue_t to_cublas(Epilogue e) {
  switch (e) {
    case Epilogue::none:
      return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::bias:
      return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::gelu_aux:
      return CUBLASLT_EPILOGUE_GELU_AUX;
    case Epilogue::gelu_aux_bias:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::dgelu:
      return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::dgelu_bgrad:
      return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case Epilogue::bgradb:
      return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

constexpr const char* name_of(Epilogue e) {
  switch (e) {
    case Epilogue::none:
      return "none";
    case Epilogue::bias:
      return "bias";
    case Epilogue::gelu_aux:
      return "gelu_aux";
    case Epilogue::gelu_aux_bias:
      return "gelu_aux_bias";
    case Epilogue::dgelu:
      return "dgelu";
    case Epilogue::dgelu_bgrad:
      return "dgelu_bgrad";
    case Epilogue::bgradb:
      return "bgradb";
  }
  return "?";
}

constexpr bool uses_bias(Epilogue e) {
  return e == Epilogue::bias || e == Epilogue::gelu_aux_bias || e == Epilogue::dgelu_bgrad || e == Epilogue::bgradb;
}
constexpr bool uses_aux(Epilogue e) {
  return e == Epilogue::gelu_aux || e == Epilogue::gelu_aux_bias || e == Epilogue::dgelu || e == Epilogue::dgelu_bgrad;
}

// The largest power of two (up to 16) dividing the address: what an algorithm may assume.
inline int alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  int align = 16;
  while (align > 1 && a % static_cast<std::uintptr_t>(align) != 0) align /= 2;
  return align;
}

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const noexcept { cublasLtMatmulDescDestroy(d); }
};
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const noexcept { cublasLtMatrixLayoutDestroy(l); }
};
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const noexcept { cublasLtMatmulPreferenceDestroy(p); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LayoutDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter>;

inline Layout make_layout(cudaDataType_t type, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  LLMPAR_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&layout, type, static_cast<std::uint64_t>(rows),
                                                 static_cast<std::uint64_t>(cols), ld));
  return Layout(layout);
}

template <class V>
void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const V& value) {
  LLMPAR_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

template <class V>
void set(cublasLtMatmulPreference_t preference, cublasLtMatmulPreferenceAttributes_t attribute, const V& value) {
  LLMPAR_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)));
}

// An algorithm configuration attribute; V is the attribute's documented type. Only a
// description reads these, so an attribute cuBLASLt will not report keeps `fallback`
// rather than failing the GEMM.
template <class V>
V config_of(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute, V fallback) {
  V value{};
  std::size_t written = 0;
  return cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value), &written) ==
                 CUBLAS_STATUS_SUCCESS
             ? value
             : fallback;
}

inline GemmAlgorithm describe(const cublasLtMatmulHeuristicResult_t& result, cublasComputeType_t compute,
                              bool restricted_reduction) {
  const cublasLtMatmulAlgo_t& algo = result.algo;
  GemmAlgorithm out;
  out.compute = compute;
  out.id = config_of<std::int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID, -1);
  out.tile = config_of<std::uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, 0);
  out.stages = config_of<std::uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, 0);
  out.split_k = config_of<std::int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, -1);
  out.reduction = config_of<std::uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, ~0u);
  std::size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_NUMERICAL_IMPL_FLAGS, &out.numerics,
                                        sizeof(out.numerics), &written) != CUBLAS_STATUS_SUCCESS)
    out.numerics = 0;
  out.workspace_bytes = result.workspaceSize;
  out.restricted_reduction = restricted_reduction;
  return out;
}

}  // namespace detail

// A cuBLASLt handle, its workspace and the per-shape plan cache. One per rank (it is
// not thread-safe: the cache is mutated by gemm()).
class Blas {
 public:
  explicit Blas(Fp32Math fp32 = Fp32Math::strict) : fp32_(fp32) {
    cublasLtHandle_t handle = nullptr;
    LLMPAR_CHECK_CUBLAS(cublasLtCreate(&handle));
    handle_.reset(handle);
    int device = 0, major = 0;
    LLMPAR_CHECK_CUDA(cudaGetDevice(&device));
    LLMPAR_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    workspace_bytes_ = major >= 9 ? (std::size_t{32} << 20) : (std::size_t{4} << 20);
    void* workspace = nullptr;
    LLMPAR_CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes_), "allocating the ", workspace_bytes_ >> 20,
                      " MiB cuBLASLt workspace");
    workspace_.reset(workspace);
  }

  // C(M,N) [+]= op(A)·op(B) with op.epilogue applied; see Epilogue for bias and aux.
  // A, B, bias and aux are T; C is T or float (16-bit operands, f32 main grads; no
  // epilogue then).
  template <class T, class TC = T>
  void gemm(cudaStream_t stream, TC* c, const T* a, const T* b, const T* bias, const T* aux, std::int64_t m,
            std::int64_t n, std::int64_t k, GemmOp op) {
    check_arguments<T, TC>(bias, aux, m, n, k, op);
    if (m == 0 || n == 0) return;
    constexpr cudaDataType_t type = detail::cuda_type<T>();
    constexpr cudaDataType_t out_type = detail::cuda_type<TC>();
    // Column-major view: m' = N, n' = M; first operand B, second A.
    const std::int64_t cm = n, cn = m;
    const Key key{static_cast<int>(type) * 1000 + static_cast<int>(out_type),
                  cm,
                  cn,
                  k,
                  op.trans_b,
                  op.trans_a,
                  op.accumulate,
                  static_cast<int>(op.epilogue),
                  detail::alignment_of(a) * 100 + detail::alignment_of(b) * 10 + std::min(detail::alignment_of(c), 9),
                  detail::alignment_of(bias) + 100 * detail::alignment_of(aux)};
    auto it = plans_.find(key);
    if (it == plans_.end()) it = plans_.emplace(key, make_plan<T, TC>(cm, cn, k, op, a, b, c, bias, aux)).first;
    Plan& plan = it->second;
    last_ = &plan.algorithm;
    if (detail::uses_bias(op.epilogue)) detail::set(plan.desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
    if (detail::uses_aux(op.epilogue)) detail::set(plan.desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
    const float alpha = 1.0f;
    const float beta = op.accumulate ? 1.0f : 0.0f;
    // k == 0: cuBLASLt still scales C by beta (C = 0, or unchanged when accumulating).
    LLMPAR_CHECK_CUBLAS(
        cublasLtMatmul(handle_.get(), plan.desc.get(), &alpha, b, plan.first.get(), a, plan.second.get(), &beta, c,
                       plan.out.get(), c, plan.out.get(), &plan.algo, workspace_.get(), workspace_bytes_, stream),
        "GEMM M=", m, " N=", n, " K=", k, " epilogue ", detail::name_of(op.epilogue));
  }

  // gemm()'s argument checks, which need no device: throws llmpar::Error naming the
  // value and the rule.
  template <class T, class TC = T>
  static void check_arguments(const T* bias, const T* aux, std::int64_t m, std::int64_t n, std::int64_t k, GemmOp op) {
    static_assert(std::is_same_v<TC, T> || std::is_same_v<TC, float>,
                  "llmpar: a GEMM writes its storage type or f32 (main grads)");
    LLMPAR_CHECK((std::is_same_v<TC, T> || op.epilogue == Epilogue::none), "gemm: epilogue ",
                 detail::name_of(op.epilogue), " with an f32 output of ", name_of(dtype_of<T>()),
                 " operands; epilogues run on GEMMs whose output is their operands' type");
    LLMPAR_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm sizes must be >= 0, got M=", m, " N=", n, " K=", k);
    LLMPAR_CHECK(!detail::uses_bias(op.epilogue) || bias != nullptr, "gemm epilogue ", detail::name_of(op.epilogue),
                 " needs a bias pointer; pass one or use Epilogue::none");
    LLMPAR_CHECK(!detail::uses_aux(op.epilogue) || aux != nullptr, "gemm epilogue ", detail::name_of(op.epilogue),
                 " needs an aux pointer (the GELU input, (M, N)); pass one");
    LLMPAR_CHECK(!detail::uses_aux(op.epilogue) || n % 8 == 0, "gemm epilogue ", detail::name_of(op.epilogue),
                 " needs N (", n, ") to be a multiple of 8, cuBLASLt's rule for the GELU input's stride");
  }

  std::size_t cached_plans() const { return plans_.size(); }
  // The algorithm of the most recent gemm() call (nullptr before the first, or when it
  // returned early on an empty output).
  const GemmAlgorithm* last_algorithm() const { return last_; }
  std::size_t workspace_bytes() const { return workspace_bytes_; }
  Fp32Math fp32_math() const { return fp32_; }

 private:
  using Key = std::tuple<int, std::int64_t, std::int64_t, std::int64_t, bool, bool, bool, int, int, int>;
  struct Plan {
    detail::MatmulDesc desc;
    detail::Layout first, second, out;
    cublasLtMatmulAlgo_t algo;
    GemmAlgorithm algorithm;
  };
  struct HandleDeleter {
    void operator()(cublasLtContext* h) const noexcept { cublasLtDestroy(h); }
  };
  struct DeviceFree {
    void operator()(void* p) const noexcept { cudaFree(p); }
  };

  template <class T, class TC>
  Plan make_plan(std::int64_t cm, std::int64_t cn, std::int64_t k, GemmOp op, const T* a, const T* b, const TC* c,
                 const T* bias, const T* aux) {
    constexpr cudaDataType_t type = detail::cuda_type<T>();
    constexpr cudaDataType_t out_type = detail::cuda_type<TC>();
    const cublasComputeType_t compute =
        std::is_same_v<T, float> && fp32_ == Fp32Math::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    Plan plan;
    cublasLtMatmulDesc_t desc = nullptr;
    LLMPAR_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F));
    plan.desc.reset(desc);
    const cublasOperation_t ta = op.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // first operand: our B
    const cublasOperation_t tb = op.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // second operand: our A
    detail::set(desc, CUBLASLT_MATMUL_DESC_TRANSA, ta);
    detail::set(desc, CUBLASLT_MATMUL_DESC_TRANSB, tb);
    const cublasLtEpilogue_t epilogue = detail::to_cublas(op.epilogue);
    detail::set(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
    if (detail::uses_bias(op.epilogue)) detail::set(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
    if (detail::uses_aux(op.epilogue)) {
      detail::set(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
      detail::set(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, cm);  // aux is (M, N) row-major: ld N
    }
    // Stored shapes, column-major: first operand (cm x k) or (k x cm) transposed, second
    // (k x cn) or (cn x k) transposed, output (cm x cn) with ld cm.
    plan.first = op.trans_b ? detail::make_layout(type, k, cm, k) : detail::make_layout(type, cm, k, cm);
    plan.second = op.trans_a ? detail::make_layout(type, cn, k, cn) : detail::make_layout(type, k, cn, k);
    plan.out = detail::make_layout(out_type, cm, cn, cm);

    cublasLtMatmulPreference_t preference = nullptr;
    LLMPAR_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
    const detail::Preference owned(preference);
    detail::set(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t{workspace_bytes_});
    // A 16-bit output: no split-K reduction in the output type (see the note at the top).
    constexpr bool kRestrictReduction = !std::is_same_v<TC, float>;
    if constexpr (kRestrictReduction)
      detail::set(preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                  std::uint32_t{CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE});
    // Strict fp32: no algorithm that rounds its inputs to TF32, bf16 or f16.
    if (compute == CUBLAS_COMPUTE_32F && std::is_same_v<T, float>)
      detail::set(preference, CUBLASLT_MATMUL_PREF_IMPL_MASK,
                  static_cast<std::uint64_t>(~(CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_TF32 |
                                               CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_16F |
                                               CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_16BF)));
    const auto set_alignment = [&](cublasLtMatmulPreferenceAttributes_t attribute, const void* p) {
      const auto bytes = static_cast<std::uint32_t>(detail::alignment_of(p));
      LLMPAR_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &bytes, sizeof(bytes)));
    };
    set_alignment(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, b);
    set_alignment(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, a);
    set_alignment(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c);
    set_alignment(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c);

    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    LLMPAR_CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle_.get(), desc, plan.first.get(), plan.second.get(),
                                                       plan.out.get(), plan.out.get(), preference, 1, &result, &found));
    LLMPAR_CHECK(found > 0, "cuBLASLt has no algorithm for the ", name_of(dtype_of<T>()), " GEMM (",
                 name_of(dtype_of<TC>()), " output) M=", cn, " N=", cm, " K=", k, " trans_a=", op.trans_a,
                 " trans_b=", op.trans_b, " epilogue ", detail::name_of(op.epilogue),
                 kRestrictReduction ? " among those that do not reduce split-K partials in the 16-bit output type" : "",
                 "; check the operands' alignment (16 bytes is best) and sizes");
    plan.algo = result.algo;
    plan.algorithm = detail::describe(result, compute, kRestrictReduction);
    return plan;
  }

  Fp32Math fp32_;
  std::unique_ptr<cublasLtContext, HandleDeleter> handle_;
  std::unique_ptr<void, DeviceFree> workspace_;
  std::size_t workspace_bytes_ = 0;
  std::map<Key, Plan> plans_;
  const GemmAlgorithm* last_ = nullptr;  // points into plans_ (std::map nodes do not move)
};

// The data sheet's dense peak of a device in TFLOP/s for GEMMs of storage type `dtype`:
// bf16/f16 on tensor cores with fp32 accumulation, fp32 on TF32 tensor cores when
// `fp32` is Fp32Math::tf32 and on CUDA cores otherwise. The denominator of MFU, so it
// follows the run's precision. Known parts only (A100 SXM/PCIe, H100/H200 SXM, H100
// PCIe); any other device returns 0 and MFU is not reported rather than guessed.
inline double datasheet_peak_tflops(int device, DType dtype, Fp32Math fp32 = Fp32Math::strict) {
  int major = 0, minor = 0, sms = 0;
  LLMPAR_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  LLMPAR_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  LLMPAR_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  struct Part {
    double half, tf32, fp32;  // dense bf16/f16, TF32, FP32
  };
  Part part{0.0, 0.0, 0.0};
  if (major == 8 && minor == 0 && sms == 108) part = {312.0, 156.0, 19.5};  // A100
  if (major == 9 && minor == 0 && sms == 132) part = {989.4, 494.7, 66.9};  // H100 SXM, H200
  if (major == 9 && minor == 0 && sms == 114) part = {756.0, 378.0, 51.2};  // H100 PCIe
  if (dtype == DType::bf16 || dtype == DType::f16) return part.half;
  return fp32 == Fp32Math::tf32 ? part.tf32 : part.fp32;
}

}  // namespace llmpar::backend::cuda
