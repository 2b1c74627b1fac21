// llmpar/math/online_softmax.hpp — the running (max, sum) of a softmax.
//
// Softmax, log-sum-exp, cross-entropy and attention all need max_i x_i and
// sum_i exp(x_i - max) over a row. Computing them in one pass, as a running state that
// rescales its sum whenever the max grows (Milakov & Gimelshein 2018, "Online
// normalizer calculation for softmax"), lets a kernel stream a row once: the
// attention kernels never store a T x T matrix, the cross-entropy kernel reads a
// 50k-wide row once for its statistics. Two states over disjoint parts of a row
// `combine` into the state of the whole row, which is what lets a row be split over
// tiles, threads, or vocabulary-parallel ranks.
//
// Written once as host/device functions: the CPU kernels and the CUDA kernels share
// it. Only <cmath> functions, math::exp and literals are used (no std::numeric_limits),
// so nvcc accepts every line in device code. Its exp is math::exp (math/exp.hpp), the
// same function the kernels' vectorised loops use for the terms they add to `sum`.
#pragma once

#include <cmath>
#include <cstdint>

#include "llmpar/config.hpp"
#include "llmpar/math/exp.hpp"

namespace llmpar::math {

// The running softmax normaliser of a sequence: after pushing x_1..x_n,
// max = max_i x_i and sum = sum_i exp(x_i - max). The empty state is (-inf, 0).
//
// Exactness and order. `push` and `combine` compute the same quantity; in exact
// arithmetic every order and grouping gives the same (max, sum). In floating point:
//   - `max` is always exact (a max of the inputs, independent of order);
//   - `combine(a, b)` is bitwise commutative: each side is rescaled to the common
//     max by its own factor exp(its max - common max), which is exactly 1 for the
//     side holding the max, and the two terms are added;
//   - it is not associative in the last bits, so a reduction across threads or
//     ranks that must be reproducible combines in a fixed order (llmpar combines in
//     ascending rank / tile order: ((s0 + s1) + s2) + ...), like any float sum.
template <class Acc>
struct OnlineSoftmax {
  // -INFINITY, not numeric_limits, so that device code can use it.
  Acc max = -INFINITY;
  Acc sum = 0;

  // Adds one element. exp(-inf - m) = 0, so a -inf element leaves the sum unchanged
  // (but it is skipped explicitly: -inf - -inf would be NaN on an empty state).
  LLMPAR_HOST_DEVICE void push(Acc x) {
    if (x > max) {
      sum = sum * math::exp(max - x) + Acc(1);
      max = x;
    } else if (x != Acc(-INFINITY)) {
      sum += math::exp(x - max);
    }
  }

  // Merges the state of a disjoint part of the same row (see the order note above).
  LLMPAR_HOST_DEVICE void combine(const OnlineSoftmax& other) {
    const Acc m = max > other.max ? max : other.max;
    if (m == Acc(-INFINITY)) return;  // both empty
    sum = scaled_sum(m) + other.scaled_sum(m);
    max = m;
  }

  // Moves the reference point to new_max (>= max) and returns the factor by which
  // anything accumulated with weights exp(x_i - old max) must be multiplied: the
  // flash-attention output accumulator rescales by it when a tile raises the max.
  // The factor is exactly 1 when the max does not change.
  LLMPAR_HOST_DEVICE Acc rescale(Acc new_max) {
    const Acc factor = max == new_max ? Acc(1) : math::exp(max - new_max);
    sum *= factor;
    max = new_max;
    return factor;
  }

  // log(sum_i exp(x_i)) = max + log(sum); -inf for the empty state.
  LLMPAR_HOST_DEVICE Acc log_sum_exp() const { return max + std::log(sum); }

 private:
  LLMPAR_HOST_DEVICE Acc scaled_sum(Acc m) const { return max == m ? sum : sum * math::exp(max - m); }
};

// ---- Vocabulary-parallel rows ------------------------------------------------------
// A row of logits whose vocabulary is split over ranks: each rank reduces its columns to
// kVocabStats values (its OnlineSoftmax's max and sum, and the target's logit if it holds
// the target, else 0), the group gathers them into (ranks, rows, kVocabStats), and every
// rank combines a row's in rank order with vocab_row_stats, so all get the same bits.
// The CPU and CUDA cross-entropy kernels both use it.
inline constexpr int kVocabStats = 3;

template <class Acc>
struct VocabRowStats {
  OnlineSoftmax<Acc> softmax;  // over the whole vocabulary
  Acc target_logit = 0;
};

// gathered: (ranks, rows, kVocabStats); the combined statistics of row `row`.
template <class Acc>
LLMPAR_HOST_DEVICE VocabRowStats<Acc> vocab_row_stats(const Acc* gathered, int ranks, std::int64_t rows,
                                                      std::int64_t row) {
  VocabRowStats<Acc> out;
  for (int k = 0; k < ranks; ++k) {
    const Acc* st = gathered + (static_cast<std::int64_t>(k) * rows + row) * kVocabStats;
    out.softmax.combine(OnlineSoftmax<Acc>{st[0], st[1]});
    out.target_logit += st[2];  // one rank holds the target: the others add 0
  }
  return out;
}

}  // namespace llmpar::math
