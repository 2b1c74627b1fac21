// The host-compiled half of test_cuda_gemm: the CPU backend's f32 GEMM (see cpu_gemm.hpp).
#include "cpu_gemm.hpp"

#include "llmpar/backend/cpu/gemm.hpp"

namespace llmpar::gpu_test {

void cpu_sgemm(float* c, const float* a, const float* b, std::int64_t m, std::int64_t n, std::int64_t k, bool trans_a,
               bool trans_b, bool accumulate) {
  static backend::cpu::Context context;
  context.gemm<float, float>(c, a, b, nullptr, m, n, k,
                             {.trans_a = trans_a, .trans_b = trans_b, .accumulate = accumulate});
}

}  // namespace llmpar::gpu_test
