// llmpar/backend/cpu/convert.hpp — conversion between float, bf16 and f16 arrays.
//
// One element-wise loop around llmpar::convert (core/dtype.hpp: round to nearest even,
// the same bits as the CUDA kernels): the upconvert GEMM path, the optimizer's master
// weights and the tests use it. Element-wise, so the result does not depend on the
// thread count; small arrays stay on the calling thread.
#pragma once

#include <cstdint>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/dtype.hpp"

namespace llmpar::backend::cpu {

// out (n) = in (n) converted to To.
template <class To, class From>
void convert(To* LLMPAR_RESTRICT out, const From* LLMPAR_RESTRICT in, std::int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (std::int64_t i = 0; i < n; ++i) store(out, i, static_cast<acc_t<To>>(load(in, i)));
}

}  // namespace llmpar::backend::cpu
