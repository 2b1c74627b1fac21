// llmpar/backend/cpu/cross_entropy.hpp — fused softmax + cross-entropy, and softmax.
//
//   loss_r   = logsumexp(logits[r, 0:V]) - logits[r, target_r]
//   dlogit_r = dloss * (softmax(logits[r, 0:V]) - onehot(target_r)),  0 on [V, Vp)
//
// Logits are (rows, Vp): only the first V columns are vocabulary, the rest is padding
// that makes the LM-head GEMM aligned (GPT-2: V = 50257, Vp = 50304). The padded
// columns never enter the softmax and get a zero gradient.
//
// Why fused and in place: the probabilities are never stored. A row's statistics
// come from one streaming read (a math::OnlineSoftmax over L1-sized chunks: a
// vectorised max, then a vectorised sum of math::exp relative to it, merged with
// `combine`; math/exp.hpp says why that exp vectorises and where it under- and
// overflows); the second read writes dlogits over the logits, which are dead
// after the loss. That is two passes over a (rows, Vp) tensor, the minimum, and no
// (rows, V) workspace. The CUDA kernel does the same with one block per row, and a
// vocabulary-parallel loss combines per-rank OnlineSoftmax states in rank order.
//
// Targets are validated before the parallel region (an exception cannot leave an
// OpenMP region). Rows are independent, so results do not depend on the thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/math/exp.hpp"
#include "llmpar/math/online_softmax.hpp"

namespace llmpar::backend::cpu {

namespace detail::xent {

// Elements per statistics chunk: 4 KiB of float, so the chunk's second look hits L1.
inline constexpr std::int64_t kChunk = 1024;

// Softmax statistics of x[0, n) * inv_temperature.   x: (n)
template <class T>
math::OnlineSoftmax<acc_t<T>> row_stats(const T* LLMPAR_RESTRICT x, std::int64_t n, acc_t<T> inv_temperature) {
  using Acc = acc_t<T>;
  math::OnlineSoftmax<Acc> total;
  for (std::int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const std::int64_t len = std::min(kChunk, n - c0);
    const T* LLMPAR_RESTRICT xc = x + c0;
    Acc m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (std::int64_t i = 0; i < len; ++i) m = std::max(m, load(xc, i) * inv_temperature);
    if (m == Acc(-INFINITY)) continue;  // only -inf logits: contributes nothing
    Acc sum = 0;
#pragma omp simd reduction(+ : sum)
    for (std::int64_t i = 0; i < len; ++i) sum += math::exp(load(xc, i) * inv_temperature - m);
    // A NaN logit is invisible to the max but makes the sum NaN: the loss reports it.
    total.combine(math::OnlineSoftmax<Acc>{m, sum});
  }
  return total;
}

inline void check_shape(const char* who, std::int64_t rows, std::int64_t V, std::int64_t Vp) {
  LLMPAR_CHECK(rows >= 0, who, ": rows = ", rows, "; it must be >= 0");
  LLMPAR_CHECK(V >= 1 && Vp >= V, who, ": V = ", V, ", Vp = ", Vp,
               "; need 1 <= V <= Vp (Vp is V padded up for the GEMM)");
}

inline void check_targets(const std::int32_t* targets, std::int64_t rows, std::int64_t V) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int32_t t = targets[r];
    LLMPAR_CHECK(t >= 0 && t < V, "target token ", t, " at row ", r, " is outside the vocabulary [0, ", V,
                 "); check the dataset's tokenizer against the model's vocab_size");
  }
}

}  // namespace detail::xent

// logits: (rows, Vp), in: logits, out: dlogits; losses: (rows); targets: (rows).
// dloss is d(total loss)/d(loss_r), the same for every row (1/rows for a mean).
template <class T>
void cross_entropy_forward_backward(T* LLMPAR_RESTRICT logits, acc_t<T>* LLMPAR_RESTRICT losses,
                                    const std::int32_t* LLMPAR_RESTRICT targets, std::int64_t rows, std::int64_t V,
                                    std::int64_t Vp, acc_t<T> dloss) {
  using Acc = acc_t<T>;
  detail::xent::check_shape("cross_entropy_forward_backward", rows, V, Vp);
  detail::xent::check_targets(targets, rows, V);
#pragma omp parallel for schedule(static) if (rows * Vp >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    T* LLMPAR_RESTRICT x = logits + r * Vp;  // (Vp)
    const std::int32_t target = targets[r];
    const Acc lse = detail::xent::row_stats(x, V, Acc(1)).log_sum_exp();
    const Acc target_logit = load(x, target);
    losses[r] = lse - target_logit;
#pragma omp simd
    for (std::int64_t i = 0; i < V; ++i) store(x, i, dloss * math::exp(load(x, i) - lse));
    store(x, target, dloss * (math::exp(target_logit - lse) - Acc(1)));
    std::fill(x + V, x + Vp, static_cast<T>(0.0f));
  }
}

// Loss only (evaluation). losses: (rows); logits: (rows, Vp); targets: (rows).
template <class T>
void cross_entropy_forward(acc_t<T>* LLMPAR_RESTRICT losses, const T* LLMPAR_RESTRICT logits,
                           const std::int32_t* LLMPAR_RESTRICT targets, std::int64_t rows, std::int64_t V,
                           std::int64_t Vp) {
  using Acc = acc_t<T>;
  detail::xent::check_shape("cross_entropy_forward", rows, V, Vp);
  detail::xent::check_targets(targets, rows, V);
#pragma omp parallel for schedule(static) if (rows * Vp >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* LLMPAR_RESTRICT x = logits + r * Vp;  // (Vp)
    losses[r] = detail::xent::row_stats(x, V, Acc(1)).log_sum_exp() - static_cast<Acc>(x[targets[r]]);
  }
}

// ---- Vocabulary parallel -----------------------------------------------------------
//
// With the LM head split over a tensor-parallel group by vocabulary rows, rank i holds
// columns [v0, v0 + Vlocal) of every row of the (rows, Vp) logits; of those, the first
// vocab_columns(V, v0, Vlocal) are vocabulary and the rest padding. The loss never
// gathers the logits (Megatron's vocab-parallel cross-entropy, made deterministic):
//   1. vocab_parallel_cross_entropy_stats: per row, this rank's softmax state (max, sum)
//      and the target's logit if this rank holds it (else 0): kVocabStats values;
//   2. the group all-gathers those (rows x kVocabStats values per rank, tiny);
//   3. vocab_parallel_cross_entropy_finish: every rank combines the states in rank order
//      ((s0 + s1) + s2) ... and sums the target logits (one is nonzero), so every rank
//      computes the same loss bits, then writes its own columns' dlogits.
// The CUDA kernels (kernels/cross_entropy.cuh) take the same arguments and layout.

using math::kVocabStats;  // per row: softmax max, softmax sum, target logit

// Columns of the slice [v0, v0 + Vlocal) that are vocabulary (< V); the rest are padding.
inline std::int64_t vocab_columns(std::int64_t V, std::int64_t v0, std::int64_t Vlocal) {
  return std::clamp<std::int64_t>(V - v0, 0, Vlocal);
}

namespace detail::xent {
inline void check_slice(const char* who, std::int64_t rows, std::int64_t V, std::int64_t v0, std::int64_t Vlocal) {
  LLMPAR_CHECK(rows >= 0, who, ": rows = ", rows, "; it must be >= 0");
  LLMPAR_CHECK(V >= 1 && v0 >= 0 && Vlocal >= 1, who, ": V = ", V, ", v0 = ", v0, ", Vlocal = ", Vlocal,
               "; this rank's slice [v0, v0 + Vlocal) of a vocabulary of V needs V >= 1, v0 >= 0, Vlocal >= 1");
}
}  // namespace detail::xent

// stats: (rows, kVocabStats); logits: (rows, Vlocal), this rank's columns [v0, v0 + Vlocal);
// targets: (rows) in [0, V).
template <class T>
void vocab_parallel_cross_entropy_stats(acc_t<T>* LLMPAR_RESTRICT stats, const T* LLMPAR_RESTRICT logits,
                                        const std::int32_t* LLMPAR_RESTRICT targets, std::int64_t rows, std::int64_t V,
                                        std::int64_t v0, std::int64_t Vlocal) {
  using Acc = acc_t<T>;
  detail::xent::check_slice("vocab_parallel_cross_entropy_stats", rows, V, v0, Vlocal);
  detail::xent::check_targets(targets, rows, V);
  const std::int64_t n = vocab_columns(V, v0, Vlocal);
#pragma omp parallel for schedule(static) if (rows * Vlocal >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* LLMPAR_RESTRICT x = logits + r * Vlocal;  // (Vlocal)
    const math::OnlineSoftmax<Acc> st = detail::xent::row_stats(x, n, Acc(1));
    const std::int64_t local = targets[r] - v0;
    Acc* LLMPAR_RESTRICT out = stats + r * kVocabStats;
    out[0] = st.max;
    out[1] = st.sum;
    out[2] = local >= 0 && local < n ? load(x, local) : Acc(0);
  }
}

// gathered: (ranks, rows, kVocabStats), every rank's stats in rank order. losses (rows)
// = logsumexp - target logit, the same on every rank; with dlogits (may be logits, for
// in place): dlogits (rows, Vlocal) = dloss * (softmax - onehot) on this rank's vocabulary
// columns, 0 on its padding. dlogits = nullptr: the loss only (evaluation).
template <class T>
void vocab_parallel_cross_entropy_finish(T* dlogits, acc_t<T>* LLMPAR_RESTRICT losses, const T* logits,
                                         const acc_t<T>* LLMPAR_RESTRICT gathered, int ranks,
                                         const std::int32_t* LLMPAR_RESTRICT targets, std::int64_t rows, std::int64_t V,
                                         std::int64_t v0, std::int64_t Vlocal, acc_t<T> dloss) {
  using Acc = acc_t<T>;
  detail::xent::check_slice("vocab_parallel_cross_entropy_finish", rows, V, v0, Vlocal);
  LLMPAR_CHECK(ranks >= 1, "vocab_parallel_cross_entropy_finish: ranks = ", ranks, "; it must be >= 1");
  const std::int64_t n = vocab_columns(V, v0, Vlocal);
#pragma omp parallel for schedule(static) if (rows * Vlocal >= kMinParallelWork)
  for (std::int64_t r = 0; r < rows; ++r) {
    const math::VocabRowStats<Acc> row = math::vocab_row_stats(gathered, ranks, rows, r);
    const Acc lse = row.softmax.log_sum_exp();
    losses[r] = lse - row.target_logit;
    if (dlogits == nullptr) continue;
    const T* x = logits + r * Vlocal;  // (Vlocal)
    T* d = dlogits + r * Vlocal;       // (Vlocal), may be x
    const std::int64_t local = targets[r] - v0;
    const bool here = local >= 0 && local < n;
    const Acc x_target = here ? load(x, local) : Acc(0);
#pragma omp simd
    for (std::int64_t i = 0; i < n; ++i) store(d, i, dloss * math::exp(load(x, i) - lse));
    if (here) d[local] = static_cast<T>(dloss * (math::exp(x_target - lse) - Acc(1)));
    std::fill(d + n, d + Vlocal, static_cast<T>(0.0f));
  }
}

// probs = softmax(logits / temperature) over one row (sampling).
// probs: (V); logits: (V). temperature > 0.
template <class T>
void softmax_forward(acc_t<T>* LLMPAR_RESTRICT probs, const T* LLMPAR_RESTRICT logits, std::int64_t V,
                     acc_t<T> temperature) {
  using Acc = acc_t<T>;
  LLMPAR_CHECK(V >= 1, "softmax_forward: V = ", V, "; it must be >= 1");
  LLMPAR_CHECK(temperature > Acc(0), "softmax_forward: temperature = ", temperature,
               "; it must be > 0 (use argmax for greedy decoding)");
  const Acc inv_temperature = Acc(1) / temperature;
  const Acc lse = detail::xent::row_stats(logits, V, inv_temperature).log_sum_exp();
#pragma omp simd
  for (std::int64_t i = 0; i < V; ++i) probs[i] = math::exp(load(logits, i) * inv_temperature - lse);
}

}  // namespace llmpar::backend::cpu
