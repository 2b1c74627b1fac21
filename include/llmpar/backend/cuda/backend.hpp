// llmpar/backend/cuda/backend.hpp — backend::Cuda: device memory, llmpar's CUDA kernels,
// cuBLASLt GEMMs.
//
// The tag's static operations are those of backend::Cpu (backend/cpu/backend.hpp),
// same names, same arguments, run by the kernel templates in kernels/ and by cuBLASLt
// (backend/cuda/gemm.hpp), all queued on the context's compute stream. Nothing here
// synchronises except download(), which hands host memory back to the caller.
//
// Two ways to compile it. This header declares the operations that run llmpar's kernels
// and defines the rest (cuBLASLt, copies); their device code is backend/cuda/ops.cuh.
//   - Header-only: a translation unit that nvcc compiles gets ops.cuh too (included at
//     the end), and nothing else is needed.
//   - Kernels once per program: a plain C++ translation unit (or nvcc's, with
//     LLMPAR_CUDA_OPS_EXTERN defined) sees the declarations alone, and the program
//     compiles the device code once, in one .cu per storage type that expands
//     LLMPAR_CUDA_INSTANTIATE_OPS(T) (ops.cuh). This project's build does so (the
//     llmpar_cuda_ops library): its trainers over backend::Cuda are ordinary C++ that
//     the host compiler builds, and the kernels are compiled three times, not once per
//     file that trains.
//
// cuda::Context is one rank's GPU: its DeviceContext (device, compute and communication
// streams, memory pool), its cuBLASLt handle and plan cache, and one scratch buffer
// that kernels needing a workspace borrow in turn. Every borrower runs on the compute
// stream, so stream order keeps them apart and one buffer, grown to the largest
// request, serves the whole step.
//
// cuda::AdamWKernel is this backend's part of optim::AdamW (the one optimizer, over
// either backend): llmpar's multi-tensor AdamW (kernels/adamw.cuh), with the clipping
// factor computed on the device.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "llmpar/backend/backend.hpp"
#include "llmpar/backend/cuda/check.hpp"
#include "llmpar/backend/cuda/gemm.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/slice.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/math/activation.hpp"
#include "llmpar/math/adamw.hpp"
#include "llmpar/math/online_softmax.hpp"
#include "llmpar/math/rotary.hpp"

namespace llmpar::backend::cuda {

class Context {
 public:
  // adopt_communication: a communication stream owned elsewhere (NcclComm::stream()).
  explicit Context(int device = 0, Fp32Math fp32 = Fp32Math::strict, cudaStream_t adopt_communication = nullptr)
      : device_(device, adopt_communication), blas_(fp32) {}
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  cudaStream_t stream() const { return device_.compute(); }
  DeviceContext& device() { return device_; }
  Blas& blas() { return blas_; }

  // At least `bytes` of device scratch, valid for work queued on stream() until the
  // next call.
  void* scratch(std::size_t bytes) {
    if (bytes > scratch_.size()) scratch_ = DeviceBuffer<std::byte>(bytes + bytes / 4, stream());
    return scratch_.data();
  }
  float* scratch_floats(std::int64_t count) {
    return static_cast<float*>(scratch(static_cast<std::size_t>(count) * sizeof(float)));
  }

  void synchronize() { LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream())); }

 private:
  DeviceContext device_;  // first: it selects the device the others are created on
  Blas blas_;
  DeviceBuffer<std::byte> scratch_;
};

// A point in a context's compute-stream order (backend::Cuda::Fence): record() marks
// the work queued so far; wait() blocks the calling thread until the device has run it.
// The communication thread waits on one before a collective reads what the kernels
// wrote, so the thread that queues the kernels never waits for the device. Its event is
// made on the first record (on the thread and device that queue the kernels).
class Fence {
 public:
  void record(Context& ctx) {
    if (event_.get() == nullptr) event_ = Event(Event::Timing::off);
    event_.record(ctx.stream());
  }
  void wait() const {
    if (event_.get() != nullptr) event_.synchronize();
  }

 private:
  Event event_;
};

// The device's AdamW over an optimizer's table of tensors (optim::AdamW builds it and
// owns the state): llmpar's multi-tensor kernel (kernels/adamw.cuh), its chunk table
// built once. step() puts the square of the global norm (loss scale included) on the
// device for the kernel's clip factor and returns without waiting; the kernel's own
// device check (found_inf) stays as a guard, which cannot fire for a step the host let
// through.
template <class T>
class AdamWKernel {
 public:
  using Slot = math::AdamWSlot<float, T>;

  AdamWKernel(Context& ctx, const std::vector<Slot>& slots);
  AdamWKernel(AdamWKernel&&) noexcept;
  AdamWKernel& operator=(AdamWKernel&&) noexcept;
  ~AdamWKernel();

  // norm: the global norm of the unscaled gradient; inv_loss_scale and max_norm as the
  // CPU kernel's grad_scale = inv_loss_scale x clip_factor(norm, max_norm).
  void step(Context& ctx, const math::AdamWParams& hp, int step, double norm, float inv_loss_scale, float max_norm);

 private:
  struct Plan;                             // the kernel's chunk table (kernels::AdamWPlan), with the device code
  std::unique_ptr<Plan> plan_;             // never null
  Buffer<float, memory::Device> norm_sq_;  // (1)
  Buffer<int, memory::Device> found_inf_;  // (1)
  float host_norm_sq_ = 0.0f;
};

}  // namespace llmpar::backend::cuda

namespace llmpar::backend {

struct Cuda {
  static constexpr const char* kName = "cuda";
  using Context = cuda::Context;
  using Space = memory::Device;
  using GemmOp = cuda::GemmOp;
  template <class T>
  using Acc = float;
  template <class T>
  using AdamWKernel = cuda::AdamWKernel<T>;

  // C(M,N) [+]= op(A)·op(B) [+ bias(N)]; a bias becomes cuBLASLt's bias epilogue. C is T,
  // or float (16-bit operands writing f32 main grads).
  template <class T, class TC = T>
  static void gemm(Context& ctx, TC* c, const T* a, const T* b, const T* bias, std::int64_t m, std::int64_t n,
                   std::int64_t k, GemmOp op) {
    if (bias != nullptr && op.epilogue == cuda::Epilogue::none) op.epilogue = cuda::Epilogue::bias;
    ctx.blas().gemm<T, TC>(ctx.stream(), c, a, b, bias, nullptr, m, n, k, op);
  }
  // pre (M,N) = x·Wᵀ + bias, act = gelu(pre), in one GEMM (cuBLASLt's GELU_AUX_BIAS
  // epilogue writes pre as its aux output).
  template <class T>
  static void linear_gelu_forward(Context& ctx, T* act, T* pre, const T* x, const T* weight, const T* bias,
                                  std::int64_t m, std::int64_t n, std::int64_t k) {
    const cuda::GemmOp op{.trans_a = false,
                          .trans_b = true,
                          .accumulate = false,
                          .epilogue = bias != nullptr ? cuda::Epilogue::gelu_aux_bias : cuda::Epilogue::gelu_aux};
    ctx.blas().gemm<T>(ctx.stream(), act, x, weight, bias, pre, m, n, k, op);
  }
  // dpre (M,N) = (dy (M,K) · W (K,N)) * gelu'(pre), in one GEMM (the DGELU epilogue).
  template <class T>
  static void linear_dgelu_backward(Context& ctx, T* dpre, const T* dy, const T* weight, const T* pre, std::int64_t m,
                                    std::int64_t n, std::int64_t k) {
    ctx.blas().gemm<T>(ctx.stream(), dpre, dy, weight, nullptr, pre, m, n, k,
                       {.trans_a = false, .trans_b = false, .accumulate = false, .epilogue = cuda::Epilogue::dgelu});
  }
  template <class T>
  static void layernorm_forward(Context& ctx, T* out, float* mean, float* rstd, const T* x, const T* weight,
                                const T* bias, std::int64_t rows, std::int64_t C, float eps);
  template <class T>
  static void layernorm_backward(Context& ctx, T* dx, float* dweight, float* dbias, const T* dout, const T* x,
                                 const T* weight, const float* mean, const float* rstd, std::int64_t rows,
                                 std::int64_t C);
  // out (rows, C) = x * rstd * weight (RMSNorm, no mean, no bias); rstd saved for backward.
  template <class T>
  static void rmsnorm_forward(Context& ctx, T* out, float* rstd, const T* x, const T* weight, std::int64_t rows,
                              std::int64_t C, float eps);
  template <class T>
  static void rmsnorm_backward(Context& ctx, T* dx, float* dweight, const T* dout, const T* x, const T* weight,
                               const float* rstd, std::int64_t rows, std::int64_t C);
  // The residual add fused into the norm (kernels/layernorm.cuh): residual += delta,
  // out = RMSNorm(residual); and dx = RMSNorm backward(dout) + dresidual. The unfused
  // add_inplace and rmsnorm calls' roundings, as on the CPU (backend/cpu/rmsnorm.hpp).
  template <class T>
  static void residual_rmsnorm_forward(Context& ctx, T* out, float* rstd, T* residual, const T* delta, const T* weight,
                                       std::int64_t rows, std::int64_t C, float eps);
  template <class T>
  static void residual_rmsnorm_backward(Context& ctx, T* dx, float* dweight, const T* dout, const T* dresidual,
                                        const T* x, const T* weight, const float* rstd, std::int64_t rows,
                                        std::int64_t C);
  template <class T>
  static void attention_forward(Context& ctx, T* out, float* lse, const T* qkv, const AttentionShape& shape);
  template <class T>
  static void attention_backward(Context& ctx, T* dqkv, const T* dout, const T* qkv, const T* out, const float* lse,
                                 const AttentionShape& shape);
  // Attention one block at a time (ring attention, kernels/attention_block.cuh): the CPU
  // backend's operations and arguments (backend/cpu/attention_block.hpp), Acc = float.
  template <class A>
  static void attention_state_init(Context& ctx, const AttentionState<A>& st, const AttentionShape& shape);
  template <class T>
  static void attention_block_forward(Context& ctx, const AttentionState<float>& st, const T* qkv, const T* kv,
                                      const AttentionShape& shape, const AttentionBlock& block);
  template <class T>
  static void attention_state_finish(Context& ctx, T* out, float* lse, const AttentionState<float>& st,
                                     const AttentionShape& shape);
  template <class T>
  static void attention_dsum(Context& ctx, float* dsum, const T* dout, const T* out, const AttentionShape& shape);
  template <class T>
  static void attention_block_backward(Context& ctx, float* dq, float* dkv, const T* dout, const T* qkv, const T* kv,
                                       const float* lse, const float* dsum, const AttentionShape& shape,
                                       const AttentionBlock& block);
  template <class T>
  static void gelu_forward(Context& ctx, T* out, const T* x, std::int64_t n);
  template <class T>
  static void gelu_backward(Context& ctx, T* dx, const T* x, const T* dout, std::int64_t n);
  // act (rows, hidden) = gate(pre[:, :hidden]) · pre[:, hidden:] (SwiGLU, GeGLU), and its
  // backward into dpre (rows, 2·hidden), overwritten.
  template <class T>
  static void glu_forward(Context& ctx, T* act, const T* pre, std::int64_t rows, std::int64_t hidden, math::Gate gate);
  template <class T>
  static void glu_backward(Context& ctx, T* dpre, const T* dact, const T* pre, std::int64_t rows, std::int64_t hidden,
                           math::Gate gate);
  // Rotary position embeddings on q and k of qkv (B, T, R), in place; inverse: the
  // backward (kernels/rotary.cuh).
  template <class T>
  static void rotary(Context& ctx, T* qkv, const AttentionShape& shape, const math::RopeConfig& rope, bool inverse,
                     const ChunkPositions& positions = {});
  template <class T>
  static void add_inplace(Context& ctx, T* a, const T* b, std::int64_t n);
  // a (n) *= s.
  template <class T>
  static void scale_inplace(Context& ctx, T* a, float s, std::int64_t n);
  template <class T>
  static void bias_backward(Context& ctx, float* dbias, const T* dout, std::int64_t rows, std::int64_t n);
  // wte holds the rows `slice` of the token table (default: all); wpe may be null.
  template <class T>
  static void encoder_forward(Context& ctx, T* out, const std::int32_t* tokens, const T* wte, const T* wpe,
                              std::int64_t B, std::int64_t T_len, std::int64_t C, RowSlice slice = {});
  template <class T>
  static void encoder_backward(Context& ctx, float* dwte, float* dwpe, const T* dout, const std::int32_t* tokens,
                               std::int64_t B, std::int64_t T_len, std::int64_t C, RowSlice slice = {});
  template <class T>
  static void cross_entropy_forward_backward(Context& ctx, T* logits, float* losses, const std::int32_t* targets,
                                             std::int64_t rows, std::int64_t V, std::int64_t Vp, float dloss);
  template <class T>
  static void cross_entropy_forward(Context& ctx, float* losses, const T* logits, const std::int32_t* targets,
                                    std::int64_t rows, std::int64_t V, std::int64_t Vp);
  // The vocabulary-parallel loss (kernels/cross_entropy.cuh), the CPU's arguments.
  static constexpr int kVocabStats = math::kVocabStats;  // values per row of the stats
  template <class T>
  static void vocab_parallel_cross_entropy_stats(Context& ctx, float* stats, const T* logits,
                                                 const std::int32_t* targets, std::int64_t rows, std::int64_t V,
                                                 std::int64_t v0, std::int64_t Vlocal);
  template <class T>
  static void vocab_parallel_cross_entropy_finish(Context& ctx, T* dlogits, float* losses, const T* logits,
                                                  const float* gathered, int ranks, const std::int32_t* targets,
                                                  std::int64_t rows, std::int64_t V, std::int64_t v0,
                                                  std::int64_t Vlocal, float dloss);

  // Transfers between host memory and device memory, in the compute stream's order.
  // upload() may return before the copy lands, but the host data is already read
  // (pageable copies are staged); download() waits for it.
  template <class T>
  static void upload(Context& ctx, T* dst, const T* host, std::int64_t n) {
    if (n > 0)
      LLMPAR_CHECK_CUDA(
          cudaMemcpyAsync(dst, host, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyHostToDevice, ctx.stream()));
  }
  template <class T>
  static void download(Context& ctx, T* host, const T* src, std::int64_t n) {
    if (n > 0)
      LLMPAR_CHECK_CUDA(
          cudaMemcpyAsync(host, src, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToHost, ctx.stream()));
    ctx.synchronize();
  }
  // dst (n) = src (n), both in device memory, in the compute stream's order.
  template <class T>
  static void copy(Context& ctx, T* dst, const T* src, std::int64_t n) {
    if (n > 0)
      LLMPAR_CHECK_CUDA(
          cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToDevice, ctx.stream()));
  }
  // dst (rows, width) = src (rows, width), rows dst_stride and src_stride elements
  // apart, in device memory, in the compute stream's order.
  template <class T>
  static void copy_2d(Context& ctx, T* dst, std::int64_t dst_stride, const T* src, std::int64_t src_stride,
                      std::int64_t rows, std::int64_t width) {
    if (rows > 0 && width > 0)
      LLMPAR_CHECK_CUDA(cudaMemcpy2DAsync(dst, static_cast<std::size_t>(dst_stride) * sizeof(T), src,
                                          static_cast<std::size_t>(src_stride) * sizeof(T),
                                          static_cast<std::size_t>(width) * sizeof(T), static_cast<std::size_t>(rows),
                                          cudaMemcpyDeviceToDevice, ctx.stream()));
  }
  // p (n) = 0, queued on the compute stream (the gradients before a step: no device-wide
  // wait, unlike memory::Device::zero's set-up fill).
  template <class T>
  static void zero(Context& ctx, T* p, std::int64_t n) {
    if (n > 0) LLMPAR_CHECK_CUDA(cudaMemsetAsync(p, 0, static_cast<std::size_t>(n) * sizeof(T), ctx.stream()));
  }
  // dst (n) = src (n) converted (float, bf16, f16), in device memory.
  template <class To, class From>
  static void convert(Context& ctx, To* dst, const From* src, std::int64_t n);
  static void synchronize(Context& ctx) { ctx.synchronize(); }
  using Fence = cuda::Fence;
  // Σ x² of n device floats (G = float: the main gradients), on the host (waits for the
  // stream).
  template <class G>
  static double sum_of_squares(Context& ctx, const G* x, std::int64_t n);
};

}  // namespace llmpar::backend

#if defined(__CUDACC__) && !defined(LLMPAR_CUDA_OPS_EXTERN)
#include "llmpar/backend/cuda/ops.cuh"
#endif
