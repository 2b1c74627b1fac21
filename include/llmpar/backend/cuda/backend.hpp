// llmpar/backend/cuda/backend.hpp — backend::Cuda: device memory, llmpar's CUDA kernels,
// cuBLASLt GEMMs. Include it from a translation unit that nvcc compiles.
//
// The tag's static operations are those of backend::Cpu (backend/cpu/backend.hpp),
// same names, same arguments, run by the kernel templates in kernels/ and by cuBLASLt
// (backend/cuda/gemm.hpp), all queued on the context's compute stream. Nothing here
// synchronises except download(), which hands host memory back to the caller.
//
// cuda::Context is one rank's GPU: its DeviceContext (device, compute and communication
// streams, memory pool), its cuBLASLt handle and plan cache, and one scratch buffer
// that kernels needing a workspace borrow in turn. Every borrower runs on the compute
// stream, so stream order keeps them apart and one buffer, grown to the largest
// request, serves the whole step.
//
// cuda::AdamW is the optimizer the trainer builds for this backend: llmpar's
// multi-tensor AdamW (kernels/adamw.cuh) over the model's flat parameter store, with the
// gradient norm and the clipping factor computed on the device.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "llmpar/backend/backend.hpp"
#include "llmpar/backend/cuda/check.hpp"
#include "llmpar/backend/cuda/gemm.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/slice.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/kernels/adamw.cuh"
#include "llmpar/kernels/attention.cuh"
#include "llmpar/kernels/cross_entropy.cuh"
#include "llmpar/kernels/elementwise.cuh"
#include "llmpar/kernels/layernorm.cuh"
#include "llmpar/math/adamw.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/optim/adamw.hpp"

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

// AdamW over a shard of a ParameterStore in device memory: the same update as
// optim::AdamW (same clipping rule, same per-parameter weight decay and lr scale, the
// same calls a step), with f32 master weights for a bf16/f16 store (the update writes
// the 16-bit working copy in the same kernel: kernels::AdamWPlan<float, T>).
//
// sum_of_squares() runs the norm kernels over the shard and reads the sum back; the
// global norm over every group is parallel::GradSync's, which passes it to update().
// update() puts the norm's square on the device for the step kernel's clip factor and
// returns without waiting. The step kernel's own device check (found_inf) stays as a
// guard; it cannot fire for a step the host let through.
template <class T>
class AdamW {
 public:
  using Store = nn::ParameterStore<T, memory::Device>;
  static constexpr bool kSeparateMaster = !std::is_same_v<T, float>;

  AdamW(Context& ctx, std::vector<optim::Segment<T>> shard, const optim::AdamWConfig& cfg)
      : ctx_(ctx), shard_(std::move(shard)), cfg_(cfg), norm_sq_(1), found_inf_(1) {
    cfg.validate();
    std::int64_t total = 0;
    for (const auto& s : shard_) {
      offsets_.push_back(total);
      total += s.n;
    }
    m_.resize(total);
    v_.resize(total);
    if (total > 0) {
      LLMPAR_CHECK_CUDA(cudaMemsetAsync(m_.data(), 0, m_.bytes(), ctx.stream()));
      LLMPAR_CHECK_CUDA(cudaMemsetAsync(v_.data(), 0, v_.bytes(), ctx.stream()));
    }
    LLMPAR_CHECK_CUDA(cudaMemsetAsync(found_inf_.data(), 0, found_inf_.bytes(), ctx.stream()));
    if constexpr (kSeparateMaster) {
      master_.resize(total);
      for (std::size_t k = 0; k < shard_.size(); ++k)
        if (shard_[k].n > 0) kernels::convert(ctx.stream(), master_.data() + offsets_[k], shard_[k].value, shard_[k].n);
    }
    std::vector<kernels::AdamWTensor<float, T>> tensors;
    for (std::size_t k = 0; k < shard_.size(); ++k) {
      const auto& s = shard_[k];
      float* master = nullptr;
      T* param = nullptr;
      if constexpr (kSeparateMaster) {
        master = master_.data() + offsets_[k];
        param = s.value;
      } else {
        master = s.value;
      }
      tensors.push_back({.master = master,
                         .param = param,
                         .grad = s.grad,
                         .m = m_.data() + offsets_[k],
                         .v = v_.data() + offsets_[k],
                         .n = s.n,
                         .decay = s.decay,
                         .lr_scale = s.lr_scale});
    }
    plan_.emplace(ctx.stream(), std::span<const kernels::AdamWTensor<float, T>>(tensors));
  }
  AdamW(Context& ctx, Store& store, const optim::AdamWConfig& cfg) : AdamW(ctx, optim::whole_store(store), cfg) {}

  // Σ grad² over the shard (loss scale included), on the host.
  double sum_of_squares() {
    float host = 0.0f;
    if (plan_->num_tensors() == 0) return 0.0;
    plan_->grad_norm_squared(ctx_.stream(), norm_sq_.data(), ctx_.scratch_floats(plan_->workspace_floats()));
    LLMPAR_CHECK_CUDA(cudaMemcpyAsync(&host, norm_sq_.data(), sizeof(float), cudaMemcpyDeviceToHost, ctx_.stream()));
    ctx_.synchronize();
    return static_cast<double>(host);
  }

  // The norm of this shard's unscaled gradient: the global norm of a one-rank run.
  optim::GradNorm gradient_norm(float inv_loss_scale = 1.0f) {
    const double squares = sum_of_squares();
    return {std::sqrt(squares) * static_cast<double>(inv_loss_scale), std::isfinite(squares)};
  }

  // One update at learning rate lr with the global norm `norm`; queued, not waited for.
  void update(float lr, const optim::GradNorm& norm, float inv_loss_scale = 1.0f) {
    LLMPAR_CHECK(norm.finite, "cuda::AdamW::update with a non-finite gradient norm (", norm.norm,
                 "); skip the step instead (the trainer does, and its loss scaler backs off)");
    ++step_;
    const math::AdamWParams hp{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay};
    // The kernel computes the norm as sqrt(norm_sq) * inv_loss_scale. A copy from
    // pageable host memory has read its source when cudaMemcpyAsync returns (the driver
    // stages it), so host_norm_sq_ may change afterwards without a wait.
    const double scaled = norm.norm / static_cast<double>(inv_loss_scale);
    host_norm_sq_ = static_cast<float>(scaled * scaled);
    LLMPAR_CHECK_CUDA(
        cudaMemcpyAsync(norm_sq_.data(), &host_norm_sq_, sizeof(float), cudaMemcpyHostToDevice, ctx_.stream()));
    LLMPAR_CHECK_CUDA(cudaMemsetAsync(found_inf_.data(), 0, sizeof(int), ctx_.stream()));
    plan_->step(ctx_.stream(), hp, step_, norm_sq_.data(), inv_loss_scale, cfg_.grad_clip, found_inf_.data());
  }

  // gradient_norm and update in one call; a non-finite gradient skips the update.
  optim::StepResult step(float lr, float inv_loss_scale = 1.0f) {
    const optim::GradNorm g = gradient_norm(inv_loss_scale);
    if (g.finite) update(lr, g, inv_loss_scale);
    return {g.norm, !g.finite};
  }

  int steps_taken() const { return step_; }
  // A checkpoint's count (the state it restores was built by that many updates).
  void set_steps_taken(int n) {
    LLMPAR_CHECK(n >= 0, "AdamW: a step count of ", n, " is negative");
    step_ = n;
  }
  const optim::AdamWConfig& config() const { return cfg_; }
  std::span<const optim::Segment<T>> shard() const { return shard_; }
  std::size_t state_bytes() const { return m_.bytes() + v_.bytes() + master_.bytes(); }
  // The optimizer's state, segment after segment (as optim::AdamW lays out its own).
  Buffer<float, memory::Device>& first_moment() { return m_; }
  Buffer<float, memory::Device>& second_moment() { return v_; }
  // The f32 master weights of a 16-bit store (empty for a float store).
  Buffer<float, memory::Device>& master_weights() { return master_; }

 private:
  Context& ctx_;
  std::vector<optim::Segment<T>> shard_;
  std::vector<std::int64_t> offsets_;
  optim::AdamWConfig cfg_;
  Buffer<float, memory::Device> m_, v_, master_;
  Buffer<float, memory::Device> norm_sq_;  // (1)
  Buffer<int, memory::Device> found_inf_;
  float host_norm_sq_ = 0.0f;
  std::optional<kernels::AdamWPlan<float, T>> plan_;
  int step_ = 0;
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
  using Optimizer = cuda::AdamW<T>;
  template <class T>
  static Optimizer<T> make_optimizer(Context& ctx, std::vector<optim::Segment<T>> shard,
                                     const optim::AdamWConfig& cfg) {
    return Optimizer<T>(ctx, std::move(shard), cfg);
  }

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
                                const T* bias, std::int64_t rows, std::int64_t C, float eps) {
    kernels::layernorm_forward(ctx.stream(), out, mean, rstd, x, weight, bias, rows, C, eps);
  }
  template <class T>
  static void layernorm_backward(Context& ctx, T* dx, float* dweight, float* dbias, const T* dout, const T* x,
                                 const T* weight, const float* mean, const float* rstd, std::int64_t rows,
                                 std::int64_t C) {
    float* workspace = ctx.scratch_floats(kernels::layernorm_backward_workspace(rows, C));
    kernels::layernorm_backward(ctx.stream(), dx, dweight, dbias, dout, x, weight, mean, rstd, workspace, rows, C);
  }
  // out (rows, C) = x * rstd * weight (RMSNorm, no mean, no bias); rstd saved for backward.
  template <class T>
  static void rmsnorm_forward(Context& ctx, T* out, float* rstd, const T* x, const T* weight, std::int64_t rows,
                              std::int64_t C, float eps) {
    kernels::rmsnorm_forward(ctx.stream(), out, rstd, x, weight, rows, C, eps);
  }
  template <class T>
  static void rmsnorm_backward(Context& ctx, T* dx, float* dweight, const T* dout, const T* x, const T* weight,
                               const float* rstd, std::int64_t rows, std::int64_t C) {
    float* workspace = ctx.scratch_floats(kernels::rmsnorm_backward_workspace(rows, C));
    kernels::rmsnorm_backward(ctx.stream(), dx, dweight, dout, x, weight, rstd, workspace, rows, C);
  }
  template <class T>
  static void attention_forward(Context& ctx, T* out, float* lse, const T* qkv, std::int64_t B, std::int64_t T_len,
                                std::int64_t C, std::int64_t NH) {
    kernels::attention_forward(ctx.stream(), out, lse, qkv, B, T_len, C, NH);
  }
  template <class T>
  static void attention_backward(Context& ctx, T* dqkv, const T* dout, const T* qkv, const T* out, const float* lse,
                                 std::int64_t B, std::int64_t T_len, std::int64_t C, std::int64_t NH) {
    float* workspace = ctx.scratch_floats(kernels::attention_backward_workspace(B, T_len, C, NH));
    kernels::attention_backward(ctx.stream(), dqkv, dout, qkv, out, lse, workspace, B, T_len, C, NH);
  }
  template <class T>
  static void gelu_forward(Context& ctx, T* out, const T* x, std::int64_t n) {
    kernels::gelu_forward(ctx.stream(), out, x, n);
  }
  template <class T>
  static void gelu_backward(Context& ctx, T* dx, const T* x, const T* dout, std::int64_t n) {
    kernels::gelu_backward(ctx.stream(), dx, x, dout, n);
  }
  template <class T>
  static void add_inplace(Context& ctx, T* a, const T* b, std::int64_t n) {
    kernels::add_inplace(ctx.stream(), a, b, n);
  }
  // a (n) *= s.
  template <class T>
  static void scale_inplace(Context& ctx, T* a, float s, std::int64_t n) {
    kernels::scale_inplace(ctx.stream(), a, s, n);
  }
  template <class T>
  static void bias_backward(Context& ctx, float* dbias, const T* dout, std::int64_t rows, std::int64_t n) {
    float* workspace = ctx.scratch_floats(kernels::bias_backward_workspace(rows, n));
    kernels::bias_backward(ctx.stream(), dbias, dout, workspace, rows, n);
  }
  // wte holds the rows `slice` of the token table (default: all); wpe may be null.
  template <class T>
  static void encoder_forward(Context& ctx, T* out, const std::int32_t* tokens, const T* wte, const T* wpe,
                              std::int64_t B, std::int64_t T_len, std::int64_t C, RowSlice slice = {}) {
    kernels::encoder_forward(ctx.stream(), out, tokens, wte, wpe, B, T_len, C, slice);
  }
  template <class T>
  static void encoder_backward(Context& ctx, float* dwte, float* dwpe, const T* dout, const std::int32_t* tokens,
                               std::int64_t B, std::int64_t T_len, std::int64_t C, RowSlice slice = {}) {
    void* workspace = ctx.scratch(static_cast<std::size_t>(kernels::encoder_backward_workspace_bytes(B, T_len)));
    kernels::encoder_backward(ctx.stream(), dwte, dwpe, dout, tokens, workspace, B, T_len, C, slice);
  }
  template <class T>
  static void cross_entropy_forward_backward(Context& ctx, T* logits, float* losses, const std::int32_t* targets,
                                             std::int64_t rows, std::int64_t V, std::int64_t Vp, float dloss) {
    kernels::cross_entropy_forward_backward(ctx.stream(), logits, losses, targets, rows, V, Vp, dloss);
  }
  template <class T>
  static void cross_entropy_forward(Context& ctx, float* losses, const T* logits, const std::int32_t* targets,
                                    std::int64_t rows, std::int64_t V, std::int64_t Vp) {
    kernels::cross_entropy_forward(ctx.stream(), losses, logits, targets, rows, V, Vp);
  }
  // The vocabulary-parallel loss (kernels/cross_entropy.cuh), the CPU's arguments.
  static constexpr int kVocabStats = kernels::detail::xent::kVocabStats;  // values per row of the stats
  template <class T>
  static void vocab_parallel_cross_entropy_stats(Context& ctx, float* stats, const T* logits,
                                                 const std::int32_t* targets, std::int64_t rows, std::int64_t V,
                                                 std::int64_t v0, std::int64_t Vlocal) {
    kernels::vocab_parallel_cross_entropy_stats(ctx.stream(), stats, logits, targets, rows, V, v0, Vlocal);
  }
  template <class T>
  static void vocab_parallel_cross_entropy_finish(Context& ctx, T* dlogits, float* losses, const T* logits,
                                                  const float* gathered, int ranks, const std::int32_t* targets,
                                                  std::int64_t rows, std::int64_t V, std::int64_t v0,
                                                  std::int64_t Vlocal, float dloss) {
    kernels::vocab_parallel_cross_entropy_finish(ctx.stream(), dlogits, losses, logits, gathered, ranks, targets, rows,
                                                 V, v0, Vlocal, dloss);
  }

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
  // p (n) = 0, queued on the compute stream (the gradients before a step: no device-wide
  // wait, unlike memory::Device::zero's set-up fill).
  template <class T>
  static void zero(Context& ctx, T* p, std::int64_t n) {
    if (n > 0) LLMPAR_CHECK_CUDA(cudaMemsetAsync(p, 0, static_cast<std::size_t>(n) * sizeof(T), ctx.stream()));
  }
  static void synchronize(Context& ctx) { ctx.synchronize(); }
  // Σ x² of n device floats, on the host (waits for the stream).
  static double sum_of_squares(Context& ctx, const float* x, std::int64_t n) {
    auto* workspace = static_cast<double*>(ctx.scratch(sizeof(double) * kernels::kSumOfSquaresWorkspace));
    return kernels::sum_of_squares(ctx.stream(), x, n, workspace);
  }
};

}  // namespace llmpar::backend
