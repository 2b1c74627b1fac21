// llmpar/math/welford.hpp — running mean and variance that stay accurate in float.
//
// LayerNorm needs the mean and variance of rows whose mean can be large compared with
// their spread; E[x^2] - E[x]^2 then cancels catastrophically in float. Welford's
// update keeps (count, mean, M2 = sum of squared deviations) and never subtracts two
// large sums. Chan et al.'s combine merges two partial states exactly as if one had
// pushed all values, which is what lets a row be split: a CUDA warp combines its
// lanes, a CPU kernel combines per-chunk states computed with vector instructions.
// Both backends call this one struct, so they agree on the statistics.
#pragma once

#include <cstdint>

#include "llmpar/config.hpp"

namespace llmpar::math {

// An aggregate, so a partial state computed elsewhere (a chunk's count, mean and M2)
// is built with Welford<Acc>{mean, m2, count} and merged with combine().
template <class Acc>
struct Welford {
  Acc mean = Acc(0);
  Acc m2 = Acc(0);  // sum of squared deviations from mean
  std::int64_t count = 0;

  LLMPAR_HOST_DEVICE void push(Acc x) {
    ++count;
    const Acc delta = x - mean;
    mean += delta / static_cast<Acc>(count);
    m2 += delta * (x - mean);
  }

  // Chan, Golub & LeVeque: merges other into this; either side may be empty.
  LLMPAR_HOST_DEVICE void combine(const Welford& other) {
    if (other.count == 0) return;
    if (count == 0) {
      *this = other;
      return;
    }
    const std::int64_t n = count + other.count;
    const Acc na = static_cast<Acc>(count);
    const Acc nb = static_cast<Acc>(other.count);
    const Acc inv_n = Acc(1) / static_cast<Acc>(n);
    const Acc delta = other.mean - mean;
    mean += delta * (nb * inv_n);
    m2 += other.m2 + delta * delta * (na * nb * inv_n);
    count = n;
  }

  // Biased (population) variance, M2 / n: what LayerNorm normalizes by. 0 when empty.
  LLMPAR_HOST_DEVICE Acc variance() const { return count > 0 ? m2 / static_cast<Acc>(count) : Acc(0); }

  // Unbiased (sample) variance, M2 / (n - 1). 0 with fewer than two values.
  LLMPAR_HOST_DEVICE Acc sample_variance() const { return count > 1 ? m2 / static_cast<Acc>(count - 1) : Acc(0); }
};

}  // namespace llmpar::math
