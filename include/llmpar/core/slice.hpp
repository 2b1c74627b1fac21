// llmpar/core/slice.hpp — the rows of a table that one rank holds.
//
// A vocabulary-parallel token table (nn::VocabParallelEmbedding) is split by rows: rank
// i of a tensor-parallel group holds rows [first, first + count). The embedding kernels
// of both backends take the slice and skip the tokens outside it (their rows live on
// another rank); the default slice is the whole table. Host/device, so the CUDA kernels
// receive it by value.
#pragma once

#include <cstdint>

#include "llmpar/config.hpp"

namespace llmpar {

struct RowSlice {
  std::int64_t first = 0;
  std::int64_t count = INT64_MAX;  // the whole table

  // Whether global row `row` is one of this slice's.
  LLMPAR_HOST_DEVICE bool holds(std::int64_t row) const { return row >= first && row - first < count; }
};

}  // namespace llmpar
