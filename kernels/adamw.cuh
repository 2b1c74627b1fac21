// llmpar/kernels/adamw.cuh — multi-tensor AdamW on the device: gradient norm, loss-scale
// removal, inf/NaN detection, global-norm clipping and the update, with master weights.
//
// This is optim/adamw.hpp's step (backend/cpu/adamw.hpp + backend/cpu/reduce.hpp) for
// the CUDA backend. The element math is math::adamw_step, the bias corrections come from
// math::adamw_bias_corrections once per step, on the host, exactly as on the CPU.
//
// Why two launches and a device flag. A step must not wait for the host: the clip
// factor depends on the global gradient norm, and reading that norm back would stall
// the stream every step. So the norm stays on the device. grad_norm_squared() leaves
// the sum of squares of every gradient in one device float; step() reads it in every
// block and decides there: a non-finite norm (an fp16 loss scale that overflowed, or a
// real NaN) sets *found_inf = 1 and leaves every weight and moment untouched, so the
// loss scaler can skip the step and lower its scale; otherwise each gradient is
// multiplied by inv_loss_scale * clip in the same multiply the CPU uses for its
// grad_scale, and no pass rewrites the gradients.
//
// Why multi-tensor. A GPT-2 has ~150 parameter tensors, many of them tiny (biases,
// LayerNorm gains). One launch per tensor would spend more time launching than
// updating, so, as in Apex and DeepSpeed, all tensors are cut into chunks of
// kAdamWChunk elements and one block updates one chunk. The chunk table depends only on
// the tensor list, so AdamWPlan builds it once and keeps it on the device.
//
// Determinism. The sum of squares is accumulated in double (each element squared in
// double, exactly as backend/cpu/reduce.hpp does) per thread, then over the block in a
// fixed shuffle tree; each chunk's double is stored as an unevaluated float pair (hi,
// lo), which keeps ~48 bits in a float workspace without alignment demands; a single
// block then adds the pairs in double in an order fixed by the chunk index alone, and
// the total is rounded to float once. No atomics: the same gradients give the same bits
// on every run. The chunking (and so the summation order) depends on the tensor list
// only, not on the GPU. The result differs from the CPU's sum_of_squares in the last
// bits of the double (different grouping), far below the float it is returned in.
//
// Masters. Parameters stored as P = bf16/f16 keep a float master copy (`master`): the
// update runs on master, m and v in float and writes param = P(master). With P = float
// the master is the parameter and there is no copy (param must be nullptr).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/bits.hpp"
#include "llmpar/kernels/common.cuh"
#include "llmpar/math/adamw.hpp"

namespace llmpar::kernels {

// One parameter tensor of the optimizer: all pointers are device memory of n elements.
template <Storage G, Storage P>
struct AdamWTensor {
  float* master;   // (n) float master weights; for P == float, the parameters themselves
  P* param;        // (n) storage copy written as P(master); nullptr when P is float
  const G* grad;   // (n) gradients, still multiplied by the loss scale
  float* m;        // (n) first moment (zero before the first step)
  float* v;        // (n) second moment (zero before the first step)
  std::int64_t n;  // elements; 0 is allowed (the tensor is skipped)
  bool decay;      // apply weight decay (matrices, embeddings) or not (biases, gains)
  // This tensor's step runs at hp.lr x lr_scale, decay included (optim::Segment's
  // lr_scale: µP's hidden matrices); the product is the CPU optimizer's, in float.
  float lr_scale = 1.0f;
};

namespace detail::adamw {

// Elements per chunk: one block's share of one tensor (Apex uses the same size).
inline constexpr std::int64_t kAdamWChunk = 65536;
inline constexpr int kAdamWThreads = 512;
// The final reduction of the per-chunk partials runs in one block of this many threads.
inline constexpr int kAdamWFinalThreads = 1024;

// Chunk c covers elements [begin, begin + count) of tensor `tensor`.
struct AdamWChunk {
  std::int32_t tensor;
  std::int32_t count;  // 1 .. kAdamWChunk
  std::int64_t begin;
};

// x is neither inf nor NaN (on the bits, so no host/device overload question arises).
LLMPAR_HOST_DEVICE bool is_finite(double x) { return (bits::of(x) & 0x7FF0000000000000ull) != 0x7FF0000000000000ull; }

#if defined(__CUDACC__)
// Sum of v over the block, in double, in an order fixed by the thread layout alone.
// The result is valid in thread 0. Called once per kernel (the shared array is reused
// by nothing else).
template <int kThreads>
__device__ __forceinline__ double block_sum_double(double v) {
  static_assert(kThreads % kWarp == 0 && kThreads <= 1024, "block_sum_double: kThreads is whole warps, <= 1024");
  constexpr int kWarps = kThreads / kWarp;
  __shared__ double warp_sums[kWarps];  // (kWarps)
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  double total = 0.0;
  if (warp == 0) {
    total = lane < kWarps ? warp_sums[lane] : 0.0;
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) total += __shfl_xor_sync(0xFFFFFFFFu, total, offset);
  }
  return total;
}

// Pass 1 of the norm: one block per chunk writes its sum of squares as a float pair.
// tensors: (num_tensors); chunks: (gridDim.x); partials: (gridDim.x, 2) = (hi, lo).
template <class G, class P>
__global__ void __launch_bounds__(kAdamWThreads)
    adamw_norm_partials_kernel(const AdamWTensor<G, P>* tensors, const AdamWChunk* chunks, float* partials) {
  const AdamWChunk chunk = chunks[blockIdx.x];
  const G* grad = tensors[chunk.tensor].grad + chunk.begin;  // (chunk.count)
  double acc = 0.0;
  for (int i = static_cast<int>(threadIdx.x); i < chunk.count; i += kAdamWThreads) {
    const double g = static_cast<double>(load(grad[i]));
    acc += g * g;
  }
  acc = block_sum_double<kAdamWThreads>(acc);
  if (threadIdx.x == 0) {
    const float hi = static_cast<float>(acc);
    // An infinite (or NaN) hi carries the verdict alone; acc - hi would turn inf into NaN.
    const float lo = is_finite(static_cast<double>(hi)) ? static_cast<float>(acc - static_cast<double>(hi)) : 0.0f;
    partials[2 * static_cast<std::int64_t>(blockIdx.x)] = hi;
    partials[2 * static_cast<std::int64_t>(blockIdx.x) + 1] = lo;
  }
}

// Pass 2 of the norm: one block adds the chunk pairs in double, in chunk order per
// thread and then over the fixed tree, and rounds once. partials: (num_chunks, 2).
// (A template only so that the header may be included by several translation units.)
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    adamw_norm_final_kernel(const float* partials, std::int64_t num_chunks, float* norm_sq) {
  double acc = 0.0;
  for (std::int64_t c = threadIdx.x; c < num_chunks; c += kThreads) {
    acc += static_cast<double>(partials[2 * c]) + static_cast<double>(partials[2 * c + 1]);
  }
  acc = block_sum_double<kThreads>(acc);
  if (threadIdx.x == 0) *norm_sq = static_cast<float>(acc);
}

// The update: one block per chunk (gridDim.x may exceed num_chunks by one when there is
// no chunk, so that found_inf is still set). Every block derives the same scale from
// *norm_sq; block 0 alone reports a non-finite norm.
template <class G, class P>
__global__ void __launch_bounds__(kAdamWThreads)
    adamw_step_kernel(const AdamWTensor<G, P>* tensors, const AdamWChunk* chunks, std::int64_t num_chunks,
                      math::AdamWParams hp, float c1, float c2, const float* norm_sq, float inv_loss_scale,
                      float max_norm, int* found_inf) {
  __shared__ float grad_scale;
  __shared__ int step_ok;
  if (threadIdx.x == 0) {
    // In double, with the CPU optimizer's clip factor (math::clip_factor).
    const double norm = sqrt(static_cast<double>(*norm_sq)) * static_cast<double>(inv_loss_scale);
    const bool ok = is_finite(norm);
    if (!ok && blockIdx.x == 0) *found_inf = 1;
    grad_scale = static_cast<float>(static_cast<double>(inv_loss_scale) * math::clip_factor(norm, max_norm));
    step_ok = ok ? 1 : 0;
  }
  __syncthreads();
  if (step_ok == 0 || static_cast<std::int64_t>(blockIdx.x) >= num_chunks) return;

  const AdamWChunk chunk = chunks[blockIdx.x];
  const AdamWTensor<G, P> t = tensors[chunk.tensor];
  math::AdamWParams local = hp;
  if (!t.decay) local.weight_decay = 0.0f;
  local.lr = hp.lr * t.lr_scale;
  const float scale = grad_scale;
  float* master = t.master + chunk.begin;  // (chunk.count)
  float* m = t.m + chunk.begin;            // (chunk.count)
  float* v = t.v + chunk.begin;            // (chunk.count)
  const G* grad = t.grad + chunk.begin;    // (chunk.count)
  for (int i = static_cast<int>(threadIdx.x); i < chunk.count; i += kAdamWThreads) {
    float p = master[i];
    float mi = m[i];
    float vi = v[i];
    math::adamw_step(p, mi, vi, load(grad[i]) * scale, local, c1, c2);
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if constexpr (!std::is_same_v<P, float>) t.param[chunk.begin + i] = store<P>(p);
  }
}
#endif  // __CUDACC__

}  // namespace detail::adamw

// The chunk table of a list of tensors, on the device, and the two launches of a step.
//
// Usage per step (nothing synchronises):
//   cudaMemsetAsync(found_inf, 0, sizeof(int), stream);      // the caller clears the flag
//   plan.grad_norm_squared(stream, norm_sq, workspace);       // workspace: workspace_floats()
//   plan.step(stream, hp, step, norm_sq, 1 / loss_scale, max_norm, found_inf);
// step() only ever writes 1 into found_inf, so one flag can collect several checks.
// The tables are uploaded on the constructor's stream, which is then synchronised once,
// so the plan may be used from any stream afterwards; destroy it only when no queued
// work still uses it.
template <Storage G, Storage P>
class AdamWPlan {
 public:
  using Tensor = AdamWTensor<G, P>;

  AdamWPlan(cudaStream_t stream, std::span<const Tensor> tensors) {
    LLMPAR_CHECK(tensors.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                 "AdamWPlan: ", tensors.size(), " tensors; at most 2^31 - 1 are supported");
    std::vector<detail::adamw::AdamWChunk> chunks;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      LLMPAR_CHECK(t.n >= 0, "AdamWPlan: tensor ", i, " has n = ", t.n, "; element counts must be >= 0");
      if (t.n == 0) continue;
      LLMPAR_CHECK(t.master != nullptr, "AdamWPlan: tensor ", i,
                   " has master == nullptr; pass its float master weights (for float parameters, the parameters)");
      LLMPAR_CHECK(t.grad != nullptr, "AdamWPlan: tensor ", i, " has grad == nullptr; pass its gradient buffer");
      LLMPAR_CHECK(t.m != nullptr, "AdamWPlan: tensor ", i,
                   " has m == nullptr; pass its first-moment buffer (n floats, zero before the first step)");
      LLMPAR_CHECK(t.v != nullptr, "AdamWPlan: tensor ", i,
                   " has v == nullptr; pass its second-moment buffer (n floats, zero before the first step)");
      if constexpr (std::is_same_v<P, float>) {
        LLMPAR_CHECK(t.param == nullptr, "AdamWPlan: tensor ", i,
                     " has param != nullptr, but the parameter type is float, so master is the parameter; pass "
                     "param = nullptr, or use AdamWPlan<G, bf16> or <G, f16> to keep a low-precision copy");
      } else {
        LLMPAR_CHECK(t.param != nullptr, "AdamWPlan: tensor ", i,
                     " has param == nullptr, but the parameter type is 16-bit: the step writes P(master) there; pass "
                     "the parameter buffer, or use AdamWPlan<G, float> to update float parameters in place");
        LLMPAR_CHECK(static_cast<const void*>(t.param) != static_cast<const void*>(t.master), "AdamWPlan: tensor ", i,
                     " has param == master; the 16-bit parameters need their own buffer");
      }
      LLMPAR_CHECK(t.m != t.v && t.m != t.master && t.v != t.master, "AdamWPlan: tensor ", i,
                   " passes the same buffer twice among master, m and v; each needs its own n floats");
      for (std::int64_t begin = 0; begin < t.n; begin += detail::adamw::kAdamWChunk) {
        const std::int64_t count = std::min(detail::adamw::kAdamWChunk, t.n - begin);
        chunks.push_back({static_cast<std::int32_t>(i), static_cast<std::int32_t>(count), begin});
      }
      numel_ += t.n;
    }
    LLMPAR_CHECK(chunks.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                 "AdamWPlan: ", chunks.size(), " chunks of ", detail::adamw::kAdamWChunk,
                 " elements exceed one launch's 2^31 - 1 blocks; split the parameters over several plans");
    num_tensors_ = static_cast<std::int64_t>(tensors.size());
    num_chunks_ = static_cast<std::int64_t>(chunks.size());
    if (num_chunks_ == 0) return;  // nothing to upload: no CUDA call at all
    tensors_ = backend::cuda::DeviceBuffer<Tensor>(tensors.size(), stream);
    chunks_ = backend::cuda::DeviceBuffer<detail::adamw::AdamWChunk>(chunks.size(), stream);
    tensors_.upload(tensors);
    chunks_.upload(chunks);
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream), "uploading the AdamW chunk table");
  }

  std::int64_t num_tensors() const { return num_tensors_; }
  std::int64_t num_chunks() const { return num_chunks_; }
  std::int64_t numel() const { return numel_; }
  // Floats of scratch grad_norm_squared needs: a (hi, lo) pair per chunk.
  std::int64_t workspace_floats() const { return 2 * num_chunks_; }

  // *norm_sq (one device float) = sum of grad^2 over every tensor, loss scale included.
  // workspace: workspace_floats() device floats (may be nullptr when that is 0).
  void grad_norm_squared(cudaStream_t stream, float* norm_sq, float* workspace) const {
    LLMPAR_CHECK(norm_sq != nullptr, "AdamWPlan::grad_norm_squared: norm_sq is nullptr; pass one device float");
    LLMPAR_CHECK(workspace != nullptr || num_chunks_ == 0,
                 "AdamWPlan::grad_norm_squared: workspace is nullptr; "
                 "pass workspace_floats() = ",
                 workspace_floats(), " device floats");
    if (num_chunks_ > 0) {
      detail::adamw::adamw_norm_partials_kernel<G, P>
          <<<static_cast<unsigned>(num_chunks_), detail::adamw::kAdamWThreads, 0, stream>>>(tensors_.data(),
                                                                                            chunks_.data(), workspace);
      LLMPAR_CHECK_LAUNCH("adamw_norm_partials_kernel");
    }
    detail::adamw::adamw_norm_final_kernel<detail::adamw::kAdamWFinalThreads>
        <<<1, detail::adamw::kAdamWFinalThreads, 0, stream>>>(workspace, num_chunks_, norm_sq);
    LLMPAR_CHECK_LAUNCH("adamw_norm_final_kernel");
  }

  // One AdamW step of every tensor at hp.lr (already scheduled) x Tensor::lr_scale;
  // weight decay applies where Tensor::decay. norm_sq: grad_norm_squared's result
  // (device); the norm is sqrt(*norm_sq) * inv_loss_scale; max_norm = 0 disables clipping. A non-finite norm
  // sets *found_inf = 1 (device int) and changes nothing. step counts from 1.
  void step(cudaStream_t stream, const math::AdamWParams& hp, int step, const float* norm_sq, float inv_loss_scale,
            float max_norm, int* found_inf) const {
    math::validate(hp);
    const math::AdamWBiasCorrections corrections = math::adamw_bias_corrections(hp, step);
    LLMPAR_CHECK(detail::adamw::is_finite(inv_loss_scale) && inv_loss_scale > 0.0f,
                 "AdamWPlan::step: inv_loss_scale is ", inv_loss_scale,
                 "; it must be finite and > 0 (1 / loss_scale, or 1 without loss scaling)");
    LLMPAR_CHECK(detail::adamw::is_finite(max_norm) && max_norm >= 0.0f, "AdamWPlan::step: max_norm is ", max_norm,
                 "; use a finite norm > 0, or 0 to disable clipping");
    LLMPAR_CHECK(norm_sq != nullptr,
                 "AdamWPlan::step: norm_sq is nullptr; pass the device float that "
                 "grad_norm_squared wrote");
    LLMPAR_CHECK(found_inf != nullptr,
                 "AdamWPlan::step: found_inf is nullptr; pass a device int (cleared to 0 by "
                 "the caller) that the step sets to 1 when the gradient norm is not finite");
    const unsigned blocks = static_cast<unsigned>(num_chunks_ > 0 ? num_chunks_ : 1);
    detail::adamw::adamw_step_kernel<G, P><<<blocks, detail::adamw::kAdamWThreads, 0, stream>>>(
        tensors_.data(), chunks_.data(), num_chunks_, hp, static_cast<float>(corrections.first),
        static_cast<float>(corrections.second), norm_sq, inv_loss_scale, max_norm, found_inf);
    LLMPAR_CHECK_LAUNCH("adamw_step_kernel");
  }

 private:
  std::int64_t num_tensors_ = 0;
  std::int64_t num_chunks_ = 0;
  std::int64_t numel_ = 0;
  backend::cuda::DeviceBuffer<Tensor> tensors_;                    // (num_tensors)
  backend::cuda::DeviceBuffer<detail::adamw::AdamWChunk> chunks_;  // (num_chunks)
};

}  // namespace llmpar::kernels
