// llmpar/backend/cuda/ops.cuh — the device code of backend::Cuda's operations: each one
// runs its kernel template (kernels/*.cuh) on the context's compute stream, with the
// scratch the kernel asks for. backend/cuda/backend.hpp declares them and includes this
// file in translation units that nvcc compiles (header-only use); a program whose
// trainers are plain C++ compiles it once per storage type instead, in .cu files that
// expand LLMPAR_CUDA_INSTANTIATE_OPS (at the end).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "llmpar/backend/cuda/backend.hpp"
#include "llmpar/kernels/adamw.cuh"
#include "llmpar/kernels/attention.cuh"
#include "llmpar/kernels/attention_block.cuh"
#include "llmpar/kernels/cross_entropy.cuh"
#include "llmpar/kernels/elementwise.cuh"
#include "llmpar/kernels/layernorm.cuh"
#include "llmpar/kernels/rotary.cuh"

namespace llmpar::backend {

static_assert(Cuda::kVocabStats == kernels::detail::xent::kVocabStats,
              "backend::Cuda::kVocabStats and the CUDA loss's statistics per row disagree");

template <class T>
void Cuda::layernorm_forward(Context& ctx, T* out, float* mean, float* rstd, const T* x, const T* weight, const T* bias,
                             std::int64_t rows, std::int64_t C, float eps) {
  kernels::layernorm_forward(ctx.stream(), out, mean, rstd, x, weight, bias, rows, C, eps);
}

template <class T>
void Cuda::layernorm_backward(Context& ctx, T* dx, float* dweight, float* dbias, const T* dout, const T* x,
                              const T* weight, const float* mean, const float* rstd, std::int64_t rows,
                              std::int64_t C) {
  float* workspace = ctx.scratch_floats(kernels::layernorm_backward_workspace(rows, C));
  kernels::layernorm_backward(ctx.stream(), dx, dweight, dbias, dout, x, weight, mean, rstd, workspace, rows, C);
}

template <class T>
void Cuda::rmsnorm_forward(Context& ctx, T* out, float* rstd, const T* x, const T* weight, std::int64_t rows,
                           std::int64_t C, float eps) {
  kernels::rmsnorm_forward(ctx.stream(), out, rstd, x, weight, rows, C, eps);
}

template <class T>
void Cuda::rmsnorm_backward(Context& ctx, T* dx, float* dweight, const T* dout, const T* x, const T* weight,
                            const float* rstd, std::int64_t rows, std::int64_t C) {
  float* workspace = ctx.scratch_floats(kernels::rmsnorm_backward_workspace(rows, C));
  kernels::rmsnorm_backward(ctx.stream(), dx, dweight, dout, x, weight, rstd, workspace, rows, C);
}

template <class T>
void Cuda::residual_rmsnorm_forward(Context& ctx, T* out, float* rstd, T* residual, const T* delta, const T* weight,
                                    std::int64_t rows, std::int64_t C, float eps) {
  kernels::residual_rmsnorm_forward(ctx.stream(), residual, out, rstd, residual, delta, weight, rows, C, eps);
}

template <class T>
void Cuda::residual_rmsnorm_backward(Context& ctx, T* dx, float* dweight, const T* dout, const T* dresidual, const T* x,
                                     const T* weight, const float* rstd, std::int64_t rows, std::int64_t C) {
  float* workspace = ctx.scratch_floats(kernels::rmsnorm_backward_workspace(rows, C));
  kernels::residual_rmsnorm_backward(ctx.stream(), dx, dweight, dout, dresidual, x, weight, rstd, workspace, rows, C);
}

template <class T>
void Cuda::attention_forward(Context& ctx, T* out, float* lse, const T* qkv, const AttentionShape& shape) {
  kernels::attention_forward(ctx.stream(), out, lse, qkv, shape);
}

template <class T>
void Cuda::attention_backward(Context& ctx, T* dqkv, const T* dout, const T* qkv, const T* out, const float* lse,
                              const AttentionShape& shape) {
  float* workspace = ctx.scratch_floats(kernels::attention_backward_workspace(shape));
  kernels::attention_backward(ctx.stream(), dqkv, dout, qkv, out, lse, workspace, shape);
}

template <class A>
void Cuda::attention_state_init(Context& ctx, const AttentionState<A>& st, const AttentionShape& shape) {
  static_assert(std::is_same_v<A, float>, "backend::Cuda::attention_state_init: the CUDA attention state is float");
  kernels::attention_state_init(ctx.stream(), st, shape);
}

template <class T>
void Cuda::attention_block_forward(Context& ctx, const AttentionState<float>& st, const T* qkv, const T* kv,
                                   const AttentionShape& shape, const AttentionBlock& block) {
  kernels::attention_block_forward(ctx.stream(), st, qkv, kv, shape, block);
}

template <class T>
void Cuda::attention_state_finish(Context& ctx, T* out, float* lse, const AttentionState<float>& st,
                                  const AttentionShape& shape) {
  kernels::attention_state_finish(ctx.stream(), out, lse, st, shape);
}

template <class T>
void Cuda::attention_dsum(Context& ctx, float* dsum, const T* dout, const T* out, const AttentionShape& shape) {
  kernels::attention_dsum(ctx.stream(), dsum, dout, out, shape);
}

template <class T>
void Cuda::attention_block_backward(Context& ctx, float* dq, float* dkv, const T* dout, const T* qkv, const T* kv,
                                    const float* lse, const float* dsum, const AttentionShape& shape,
                                    const AttentionBlock& block) {
  kernels::attention_block_backward(ctx.stream(), dq, dkv, dout, qkv, kv, lse, dsum, shape, block);
}

template <class T>
void Cuda::gelu_forward(Context& ctx, T* out, const T* x, std::int64_t n) {
  kernels::gelu_forward(ctx.stream(), out, x, n);
}

template <class T>
void Cuda::gelu_backward(Context& ctx, T* dx, const T* x, const T* dout, std::int64_t n) {
  kernels::gelu_backward(ctx.stream(), dx, x, dout, n);
}

template <class T>
void Cuda::glu_forward(Context& ctx, T* act, const T* pre, std::int64_t rows, std::int64_t hidden, math::Gate gate) {
  kernels::glu_forward(ctx.stream(), act, pre, rows, hidden, gate);
}

template <class T>
void Cuda::glu_backward(Context& ctx, T* dpre, const T* dact, const T* pre, std::int64_t rows, std::int64_t hidden,
                        math::Gate gate) {
  kernels::glu_backward(ctx.stream(), dpre, dact, pre, rows, hidden, gate);
}

template <class T>
void Cuda::rotary(Context& ctx, T* qkv, const AttentionShape& shape, const math::RopeConfig& rope, bool inverse,
                  const ChunkPositions& positions) {
  kernels::rotary(ctx.stream(), qkv, shape, rope, inverse, positions);
}

template <class T>
void Cuda::add_inplace(Context& ctx, T* a, const T* b, std::int64_t n) {
  kernels::add_inplace(ctx.stream(), a, b, n);
}

template <class T>
void Cuda::scale_inplace(Context& ctx, T* a, float s, std::int64_t n) {
  kernels::scale_inplace(ctx.stream(), a, s, n);
}

template <class T>
void Cuda::bias_backward(Context& ctx, float* dbias, const T* dout, std::int64_t rows, std::int64_t n) {
  float* workspace = ctx.scratch_floats(kernels::bias_backward_workspace(rows, n));
  kernels::bias_backward(ctx.stream(), dbias, dout, workspace, rows, n);
}

template <class T>
void Cuda::encoder_forward(Context& ctx, T* out, const std::int32_t* tokens, const T* wte, const T* wpe, std::int64_t B,
                           std::int64_t T_len, std::int64_t C, RowSlice slice) {
  kernels::encoder_forward(ctx.stream(), out, tokens, wte, wpe, B, T_len, C, slice);
}

template <class T>
void Cuda::encoder_backward(Context& ctx, float* dwte, float* dwpe, const T* dout, const std::int32_t* tokens,
                            std::int64_t B, std::int64_t T_len, std::int64_t C, RowSlice slice) {
  void* workspace = ctx.scratch(static_cast<std::size_t>(kernels::encoder_backward_workspace_bytes(B, T_len)));
  kernels::encoder_backward(ctx.stream(), dwte, dwpe, dout, tokens, workspace, B, T_len, C, slice);
}

template <class T>
void Cuda::cross_entropy_forward_backward(Context& ctx, T* logits, float* losses, const std::int32_t* targets,
                                          std::int64_t rows, std::int64_t V, std::int64_t Vp, float dloss) {
  kernels::cross_entropy_forward_backward(ctx.stream(), logits, losses, targets, rows, V, Vp, dloss);
}

template <class T>
void Cuda::cross_entropy_forward(Context& ctx, float* losses, const T* logits, const std::int32_t* targets,
                                 std::int64_t rows, std::int64_t V, std::int64_t Vp) {
  kernels::cross_entropy_forward(ctx.stream(), losses, logits, targets, rows, V, Vp);
}

template <class T>
void Cuda::vocab_parallel_cross_entropy_stats(Context& ctx, float* stats, const T* logits, const std::int32_t* targets,
                                              std::int64_t rows, std::int64_t V, std::int64_t v0, std::int64_t Vlocal) {
  kernels::vocab_parallel_cross_entropy_stats(ctx.stream(), stats, logits, targets, rows, V, v0, Vlocal);
}

template <class T>
void Cuda::vocab_parallel_cross_entropy_finish(Context& ctx, T* dlogits, float* losses, const T* logits,
                                               const float* gathered, int ranks, const std::int32_t* targets,
                                               std::int64_t rows, std::int64_t V, std::int64_t v0, std::int64_t Vlocal,
                                               float dloss) {
  kernels::vocab_parallel_cross_entropy_finish(ctx.stream(), dlogits, losses, logits, gathered, ranks, targets, rows, V,
                                               v0, Vlocal, dloss);
}

template <class To, class From>
void Cuda::convert(Context& ctx, To* dst, const From* src, std::int64_t n) {
  if (n > 0) kernels::convert(ctx.stream(), dst, src, n);
}

template <class G>
double Cuda::sum_of_squares(Context& ctx, const G* x, std::int64_t n) {
  static_assert(std::is_same_v<G, float>, "backend::Cuda::sum_of_squares: the device gradients are float main grads");
  auto* workspace = static_cast<double*>(ctx.scratch(sizeof(double) * kernels::kSumOfSquaresWorkspace));
  return kernels::sum_of_squares(ctx.stream(), x, n, workspace);
}

}  // namespace llmpar::backend

namespace llmpar::backend::cuda {

template <class T>
struct AdamWKernel<T>::Plan {
  kernels::AdamWPlan<float, T> kernel;
};

template <class T>
AdamWKernel<T>::AdamWKernel(Context& ctx, const std::vector<Slot>& slots) : norm_sq_(1), found_inf_(1) {
  std::vector<kernels::AdamWTensor<float, T>> tensors;
  for (const Slot& s : slots)
    tensors.push_back({.master = s.master,
                       .param = s.param,
                       .grad = s.grad,
                       .m = s.m,
                       .v = s.v,
                       .n = s.n,
                       .decay = s.decay,
                       .lr_scale = s.lr_scale});
  plan_ = std::make_unique<Plan>(
      Plan{kernels::AdamWPlan<float, T>(ctx.stream(), std::span<const kernels::AdamWTensor<float, T>>(tensors))});
}

template <class T>
AdamWKernel<T>::AdamWKernel(AdamWKernel&&) noexcept = default;
template <class T>
AdamWKernel<T>& AdamWKernel<T>::operator=(AdamWKernel&&) noexcept = default;
template <class T>
AdamWKernel<T>::~AdamWKernel() = default;

template <class T>
void AdamWKernel<T>::step(Context& ctx, const math::AdamWParams& hp, int step, double norm, float inv_loss_scale,
                          float max_norm) {
  // The kernel computes the norm as sqrt(norm_sq) x inv_loss_scale. A copy from
  // pageable host memory has read its source when cudaMemcpyAsync returns (the driver
  // stages it), so host_norm_sq_ may change afterwards without a wait.
  const double scaled = norm / static_cast<double>(inv_loss_scale);
  host_norm_sq_ = static_cast<float>(scaled * scaled);
  LLMPAR_CHECK_CUDA(
      cudaMemcpyAsync(norm_sq_.data(), &host_norm_sq_, sizeof(float), cudaMemcpyHostToDevice, ctx.stream()));
  LLMPAR_CHECK_CUDA(cudaMemsetAsync(found_inf_.data(), 0, sizeof(int), ctx.stream()));
  plan_->kernel.step(ctx.stream(), hp, step, norm_sq_.data(), inv_loss_scale, max_norm, found_inf_.data());
}

namespace detail {

// Every operation of backend::Cuda over storage type T (and the conversions into T), by
// address: a variable of external linkage initialised with this table makes its
// translation unit compile and keep each of them, for the program's plain C++
// translation units to call.
template <class T>
constexpr auto ops_of() {
  return std::tuple{&Cuda::layernorm_forward<T>,
                    &Cuda::layernorm_backward<T>,
                    &Cuda::rmsnorm_forward<T>,
                    &Cuda::rmsnorm_backward<T>,
                    &Cuda::residual_rmsnorm_forward<T>,
                    &Cuda::residual_rmsnorm_backward<T>,
                    &Cuda::attention_forward<T>,
                    &Cuda::attention_backward<T>,
                    &Cuda::attention_state_init<float>,
                    &Cuda::attention_block_forward<T>,
                    &Cuda::attention_state_finish<T>,
                    &Cuda::attention_dsum<T>,
                    &Cuda::attention_block_backward<T>,
                    &Cuda::gelu_forward<T>,
                    &Cuda::gelu_backward<T>,
                    &Cuda::glu_forward<T>,
                    &Cuda::glu_backward<T>,
                    &Cuda::rotary<T>,
                    &Cuda::add_inplace<T>,
                    &Cuda::scale_inplace<T>,
                    &Cuda::bias_backward<T>,
                    &Cuda::encoder_forward<T>,
                    &Cuda::encoder_backward<T>,
                    &Cuda::cross_entropy_forward_backward<T>,
                    &Cuda::cross_entropy_forward<T>,
                    &Cuda::vocab_parallel_cross_entropy_stats<T>,
                    &Cuda::vocab_parallel_cross_entropy_finish<T>,
                    &Cuda::convert<T, float>,
                    &Cuda::convert<T, bf16>,
                    &Cuda::convert<T, f16>,
                    &Cuda::sum_of_squares<float>};
}

}  // namespace detail
}  // namespace llmpar::backend::cuda

// LLMPAR_CUDA_INSTANTIATE_OPS(T): compiles every operation of backend::Cuda for storage
// type T (float, bf16 or f16; the last two unqualified, as llmpar names them) and the
// AdamW kernel over it, in this translation unit. Expand it at global scope in one .cu
// per type of a program whose other translation units see backend/cuda/backend.hpp
// without this file (plain C++, or nvcc with LLMPAR_CUDA_OPS_EXTERN).
#define LLMPAR_CUDA_INSTANTIATE_OPS(T)            \
  namespace llmpar::backend::cuda {               \
  template class AdamWKernel<T>;                  \
  auto llmpar_cuda_ops_##T = detail::ops_of<T>(); \
  }
