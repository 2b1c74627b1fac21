// The CPU backend's f32 GEMM for the GPU tests: test_cuda_gemm's reference.
//
// backend::cpu::Context::gemm runs oneDNN, whose C++ header (dnnl.hpp) nvcc 13's front
// end cannot compile (an internal error), so the reference lives in a translation unit
// of the host compiler (cpu_gemm.cpp, linked into test_cuda_gemm) behind this plain
// declaration.
#pragma once

#include <cstdint>

namespace llmpar::gpu_test {

// C(M,N) [+]= op(A)·op(B) in f32 through backend::cpu::Context::gemm<float, float>, with
// one Context for the whole program. Row-major: A (M,K) or (K,M) with trans_a, B (K,N)
// or (N,K) with trans_b.
void cpu_sgemm(float* c, const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t k, bool trans_a,
               bool trans_b, bool accumulate);

}  // namespace llmpar::gpu_test
