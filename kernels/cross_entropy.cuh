// llmpar/kernels/cross_entropy.cuh — fused softmax + cross-entropy on CUDA, and its
// vocabulary-parallel split.
//
//   loss_r   = logsumexp(logits[r, 0:V]) - logits[r, target_r]
//   dlogit_r = dloss * (softmax(logits[r, 0:V]) - onehot(target_r)),  0 on [V, Vp)
//
// This is backend/cpu/cross_entropy.hpp for the CUDA backend: logits (rows, Vp) of which
// the first V columns are vocabulary and the rest GEMM padding (never in the softmax,
// zero gradient); dlogits written in place over the logits; losses float per row;
// dloss the same d(total)/d(loss_r) for every row.
//
// Why this shape. One block per row: a row is 50k wide, enough for 512 threads. Pass 1
// streams the row once with 16-byte loads (when Vp is a multiple of the vector width
// and the logits are 16-byte aligned; else element by element) into a per-thread
// math::OnlineSoftmax — the shared running (max, sum) — combined over the warp in a
// fixed shuffle tree and over the warps in warp order, so every thread holds the same
// bits and the result is the same on every run. Pass 2 reads the row again (from L2: a
// row is 100 KB in bf16) and writes dlogits over it. Two passes over (rows, Vp), the
// minimum, and no (rows, V) workspace.
//
// Targets. The CPU kernel validates targets on the host; here they live on the device
// and reading them back would stall the stream. A target outside [0, V) never causes
// an out-of-bounds read: its row's loss is NaN and its dlogits in [0, V) are NaN
// (padding stays 0), so the trainer's finite-loss check fires and a step that ignored
// it would poison the weights visibly rather than train on a wrong target silently.
//
// Vocabulary parallel. With the vocabulary split over tensor-parallel ranks, rank i holds
// columns [v0, v0 + Vlocal) of every row; of those the first clamp(V - v0, 0, Vlocal)
// are vocabulary and the rest padding. vocab_parallel_cross_entropy_stats writes, per
// row, kVocabStats floats: this rank's OnlineSoftmax (max, sum) over its vocabulary
// columns and the target's logit if this rank holds it (else 0). The caller all-gathers
// them over the group into (ranks, rows, kVocabStats); vocab_parallel_cross_entropy_finish
// combines them in rank order ((s0 + s1) + s2 ..., the same bits on every rank), sums
// the target logits (one rank contributes a nonzero value), writes the loss and, when
// asked, this rank's dlogits (0 on its padding columns). The arguments and the layout are
// those of the CPU functions (backend/cpu/cross_entropy.hpp). A target outside [0, V)
// gives a NaN target logit and so NaN loss and dlogits, as above.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "llmpar/core/error.hpp"
#include "llmpar/kernels/common.cuh"
#include "llmpar/math/exp.hpp"
#include "llmpar/math/online_softmax.hpp"

namespace llmpar::kernels {

namespace detail::xent {

inline constexpr int kThreads = 512;
using math::kVocabStats;  // per row: softmax max, softmax sum, target logit
inline constexpr int kWarps = kThreads / kWarp;
inline constexpr std::int64_t kMaxRows = std::numeric_limits<int>::max();              // one block per row
inline constexpr std::int64_t kMaxColumns = std::numeric_limits<std::int32_t>::max();  // int32 targets



inline void check_pointer(const char* who, const void* p, const char* name) {
  LLMPAR_CHECK(p != nullptr, who, ": ", name, " is null; pass a device buffer (rows > 0)");
}

inline void check_shape(const char* who, std::int64_t rows, std::int64_t V, std::int64_t Vp) {
  LLMPAR_CHECK(rows >= 0, who, ": rows = ", rows, "; it must be >= 0");
  LLMPAR_CHECK(rows <= kMaxRows, who, ": rows = ", rows, " is more than one grid of blocks (", kMaxRows,
               "); compute the loss in several calls");
  LLMPAR_CHECK(V >= 1 && Vp >= V, who, ": V = ", V, ", Vp = ", Vp,
               "; need 1 <= V <= Vp (Vp is V padded up for the GEMM)");
  LLMPAR_CHECK(Vp <= kMaxColumns, who, ": Vp = ", Vp, " exceeds ", kMaxColumns, " (targets are int32)");
}

inline void check_slice(const char* who, std::int64_t rows, std::int64_t V, std::int64_t v0, std::int64_t Vlocal) {
  LLMPAR_CHECK(rows >= 0, who, ": rows = ", rows, "; it must be >= 0");
  LLMPAR_CHECK(rows <= kMaxRows, who, ": rows = ", rows, " is more than one grid of blocks (", kMaxRows,
               "); compute the loss in several calls");
  LLMPAR_CHECK(V >= 1 && v0 >= 0 && Vlocal >= 1, who, ": V = ", V, ", v0 = ", v0, ", Vlocal = ", Vlocal,
               "; this rank's slice [v0, v0 + Vlocal) of a vocabulary of V needs V >= 1, v0 >= 0 and Vlocal >= 1");
  LLMPAR_CHECK(v0 + Vlocal <= kMaxColumns && V <= kMaxColumns, who, ": v0 + Vlocal = ", v0 + Vlocal, ", V = ", V,
               "; both must be at most ", kMaxColumns, " (targets are int32)");
}

// Columns of the slice [v0, v0 + Vlocal) that are vocabulary (< V).
inline std::int64_t vocab_columns(std::int64_t V, std::int64_t v0, std::int64_t Vlocal) {
  return V - v0 < 0 ? 0 : (V - v0 < Vlocal ? V - v0 : Vlocal);
}

#if defined(__CUDACC__)


// The thread's OnlineSoftmax over its chunks of x[0, n).   x: (n, allocated up to the stride)
template <Storage T>
__device__ __forceinline__ math::OnlineSoftmax<float> thread_stats(const T* x, int n, bool vectorized) {
  constexpr int kVec = Pack<T>::kSize;
  math::OnlineSoftmax<float> st;
  const int chunks = (n + kVec - 1) / kVec;
  for (int chunk = static_cast<int>(threadIdx.x); chunk < chunks; chunk += kThreads) {
    const int c0 = chunk * kVec;
    const Pack<T> pk = load_pack(x, c0, n, vectorized);
#pragma unroll
    for (int i = 0; i < kVec; ++i)
      if (c0 + i < n) st.push(load(pk.v[i]));
  }
  return st;
}

// The row's OnlineSoftmax, the same bits in every thread: a fixed shuffle tree into lane
// 0 of each warp, then the warps in order. Contains a __syncthreads; once per kernel.
__device__ __forceinline__ math::OnlineSoftmax<float> block_stats(math::OnlineSoftmax<float> st) {
  // Plain arrays: a __shared__ variable cannot have OnlineSoftmax's member initialisers.
  __shared__ float slot_max[kWarps];  // (kWarps)
  __shared__ float slot_sum[kWarps];  // (kWarps)
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const math::OnlineSoftmax<float> other{__shfl_down_sync(0xFFFFFFFFu, st.max, offset),
                                           __shfl_down_sync(0xFFFFFFFFu, st.sum, offset)};
    st.combine(other);
  }
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  if (threadIdx.x % kWarp == 0) {
    slot_max[warp] = st.max;
    slot_sum[warp] = st.sum;
  }
  __syncthreads();
  math::OnlineSoftmax<float> total{slot_max[0], slot_sum[0]};
  for (int w = 1; w < kWarps; ++w) total.combine({slot_max[w], slot_sum[w]});
  return total;
}

// dlogits over one row: grad[c] = dloss * (exp(x[c] - lse) - [c == target]) for c < n_vocab,
// 0 for n_vocab <= c < n_stored; NaN on [0, n_vocab) when the target is invalid.
// x, grad: (n_stored), may be the same memory (each thread rewrites its own chunks).
template <Storage T>
__device__ __forceinline__ void write_dlogits(T* grad, const T* x, int n_vocab, int n_stored, float lse, int target,
                                              bool target_valid, float dloss, bool vectorized) {
  constexpr int kVec = Pack<T>::kSize;
  const int chunks = (n_stored + kVec - 1) / kVec;
  for (int chunk = static_cast<int>(threadIdx.x); chunk < chunks; chunk += kThreads) {
    const int c0 = chunk * kVec;
    const Pack<T> pk = load_pack(x, c0, n_stored, vectorized);
    Pack<T> out;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int c = c0 + i;
      const float onehot = c == target ? 1.0f : 0.0f;
      const float g = dloss * (math::exp(load(pk.v[i]) - lse) - onehot);
      out.v[i] = store<T>(c >= n_vocab ? 0.0f : target_valid ? g : NAN);
    }
    store_pack(grad, c0, n_stored, vectorized, out);
  }
}

// One block per row. logits: (rows, Vp); grad: (rows, Vp) or null (loss only), may equal
// logits; losses, targets: (rows).
template <Storage T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(T* grad, float* losses, const T* logits, const std::int32_t* targets, int V, int Vp,
                         float dloss, bool vectorized) {
  const std::int64_t row = blockIdx.x;
  const T* x = logits + row * Vp;  // (Vp)
  const int target = targets[row];
  const bool valid = target >= 0 && target < V;
  // Read before block_stats' barrier: pass 2 may overwrite x[target].
  const float target_logit = valid ? load(x[target]) : NAN;
  const float lse = block_stats(thread_stats(x, V, vectorized)).log_sum_exp();
  if (threadIdx.x == 0) losses[row] = lse - target_logit;
  if (grad != nullptr) write_dlogits(grad + row * Vp, x, V, Vp, lse, target, valid, dloss, vectorized);
}

// One block per row. logits: (rows, Vlocal), columns [v0, v0 + Vlocal) of the padded
// vocabulary, the first n_vocab of them vocabulary; stats: (rows, kVocabStats); targets: (rows).
template <Storage T>
__global__ void __launch_bounds__(kThreads)
    vocab_parallel_stats_kernel(float* stats, const T* logits, const std::int32_t* targets, int V, std::int64_t v0,
                                int Vlocal, int n_vocab, bool vectorized) {
  const std::int64_t row = blockIdx.x;
  const T* x = logits + row * Vlocal;  // (Vlocal)
  const std::int32_t target = targets[row];
  const std::int64_t local = static_cast<std::int64_t>(target) - v0;
  const bool valid = target >= 0 && target < V;
  const float tl = !valid ? NAN : (local >= 0 && local < n_vocab ? load(x[local]) : 0.0f);
  const math::OnlineSoftmax<float> st = block_stats(thread_stats(x, n_vocab, vectorized));
  if (threadIdx.x == 0) {
    float* out = stats + row * kVocabStats;
    out[0] = st.max;
    out[1] = st.sum;
    out[2] = tl;
  }
}

// One block per row. gathered: (ranks, rows, kVocabStats); losses, targets: (rows);
// logits, grad: (rows, Vlocal), grad null (loss only) or possibly logits.
template <Storage T>
__global__ void __launch_bounds__(kThreads)
    vocab_parallel_finish_kernel(T* grad, float* losses, const T* logits, const float* gathered, int ranks,
                                 const std::int32_t* targets, std::int64_t rows, int V, std::int64_t v0, int Vlocal,
                                 int n_vocab, float dloss, bool vectorized) {
  const std::int64_t row = blockIdx.x;
  // Every thread combines the ranks' states in rank order: the same bits everywhere.
  const math::VocabRowStats<float> stats = math::vocab_row_stats(gathered, ranks, rows, row);
  const float lse = stats.softmax.log_sum_exp();
  if (threadIdx.x == 0) losses[row] = lse - stats.target_logit;
  if (grad == nullptr) return;
  const std::int32_t target = targets[row];
  const std::int64_t local = static_cast<std::int64_t>(target) - v0;
  const int onehot_at = local >= 0 && local < n_vocab ? static_cast<int>(local) : -1;
  write_dlogits(grad + row * Vlocal, logits + row * Vlocal, n_vocab, Vlocal, lse, onehot_at,
                target >= 0 && target < V, dloss, vectorized);
}

#endif  // __CUDACC__

}  // namespace detail::xent

#if defined(__CUDACC__)

// logits: (rows, Vp), in: logits, out: dlogits (0 on the padding [V, Vp)); losses: (rows);
// targets: (rows), device memory. dloss is d(total loss)/d(loss_r), the same for every
// row (1/rows for a mean). A target outside [0, V) makes its row's loss and dlogits NaN.
template <Storage T>
void cross_entropy_forward_backward(cudaStream_t stream, T* logits, float* losses, const std::int32_t* targets,
                                    std::int64_t rows, std::int64_t V, std::int64_t Vp, float dloss) {
  constexpr const char* kWho = "cross_entropy_forward_backward";
  detail::xent::check_shape(kWho, rows, V, Vp);
  LLMPAR_CHECK(std::isfinite(dloss), kWho, ": dloss = ", dloss, "; it must be finite");
  if (rows == 0) return;
  detail::xent::check_pointer(kWho, logits, "logits");
  detail::xent::check_pointer(kWho, losses, "losses");
  detail::xent::check_pointer(kWho, targets, "targets");
  const bool vectorized = Vp % Pack<T>::kSize == 0 && aligned16(logits);
  detail::xent::cross_entropy_kernel<T><<<static_cast<unsigned>(rows), detail::xent::kThreads, 0, stream>>>(
      logits, losses, logits, targets, static_cast<int>(V), static_cast<int>(Vp), dloss, vectorized);
  LLMPAR_CHECK_LAUNCH(kWho);
}

// Loss only (evaluation). losses: (rows); logits: (rows, Vp); targets: (rows).
template <Storage T>
void cross_entropy_forward(cudaStream_t stream, float* losses, const T* logits, const std::int32_t* targets,
                           std::int64_t rows, std::int64_t V, std::int64_t Vp) {
  constexpr const char* kWho = "cross_entropy_forward";
  detail::xent::check_shape(kWho, rows, V, Vp);
  if (rows == 0) return;
  detail::xent::check_pointer(kWho, logits, "logits");
  detail::xent::check_pointer(kWho, losses, "losses");
  detail::xent::check_pointer(kWho, targets, "targets");
  const bool vectorized = Vp % Pack<T>::kSize == 0 && aligned16(logits);
  detail::xent::cross_entropy_kernel<T><<<static_cast<unsigned>(rows), detail::xent::kThreads, 0, stream>>>(
      nullptr, losses, logits, targets, static_cast<int>(V), static_cast<int>(Vp), 0.0f, vectorized);
  LLMPAR_CHECK_LAUNCH(kWho);
}

// Per row, stats (rows, kVocabStats): this rank's softmax (max, sum) over its vocabulary
// columns and the target's logit if it holds it (else 0; NaN for a target outside
// [0, V)). logits: (rows, Vlocal), this rank's columns [v0, v0 + Vlocal); targets: (rows).
template <Storage T>
void vocab_parallel_cross_entropy_stats(cudaStream_t stream, float* stats, const T* logits,
                                        const std::int32_t* targets, std::int64_t rows, std::int64_t V,
                                        std::int64_t v0, std::int64_t Vlocal) {
  constexpr const char* kWho = "vocab_parallel_cross_entropy_stats";
  detail::xent::check_slice(kWho, rows, V, v0, Vlocal);
  if (rows == 0) return;
  detail::xent::check_pointer(kWho, stats, "stats");
  detail::xent::check_pointer(kWho, logits, "logits");
  detail::xent::check_pointer(kWho, targets, "targets");
  const bool vectorized = Vlocal % Pack<T>::kSize == 0 && aligned16(logits);
  detail::xent::vocab_parallel_stats_kernel<T><<<static_cast<unsigned>(rows), detail::xent::kThreads, 0, stream>>>(
      stats, logits, targets, static_cast<int>(V), v0, static_cast<int>(Vlocal),
      static_cast<int>(detail::xent::vocab_columns(V, v0, Vlocal)), vectorized);
  LLMPAR_CHECK_LAUNCH(kWho);
}

// gathered (ranks, rows, kVocabStats): every rank's stats in rank order. losses (rows) =
// logsumexp - target logit (the same on every rank); with grad (may equal logits): grad
// (rows, Vlocal) = dloss * (softmax - onehot) on this rank's vocabulary columns, 0 on its
// padding. grad = nullptr: the loss only.
template <Storage T>
void vocab_parallel_cross_entropy_finish(cudaStream_t stream, T* grad, float* losses, const T* logits,
                                         const float* gathered, int ranks, const std::int32_t* targets,
                                         std::int64_t rows, std::int64_t V, std::int64_t v0, std::int64_t Vlocal,
                                         float dloss) {
  constexpr const char* kWho = "vocab_parallel_cross_entropy_finish";
  detail::xent::check_slice(kWho, rows, V, v0, Vlocal);
  LLMPAR_CHECK(ranks >= 1, kWho, ": ranks = ", ranks, "; it must be >= 1");
  LLMPAR_CHECK(std::isfinite(dloss), kWho, ": dloss = ", dloss, "; it must be finite");
  if (rows == 0) return;
  detail::xent::check_pointer(kWho, losses, "losses");
  detail::xent::check_pointer(kWho, gathered, "gathered");
  detail::xent::check_pointer(kWho, targets, "targets");
  if (grad != nullptr) detail::xent::check_pointer(kWho, logits, "logits");
  const bool vectorized = Vlocal % Pack<T>::kSize == 0 && aligned16(logits) && aligned16(grad);
  detail::xent::vocab_parallel_finish_kernel<T><<<static_cast<unsigned>(rows), detail::xent::kThreads, 0, stream>>>(
      grad, losses, logits, gathered, ranks, targets, rows, static_cast<int>(V), v0, static_cast<int>(Vlocal),
      static_cast<int>(detail::xent::vocab_columns(V, v0, Vlocal)), dloss, vectorized);
  LLMPAR_CHECK_LAUNCH(kWho);
}

#endif  // __CUDACC__

}  // namespace llmpar::kernels
