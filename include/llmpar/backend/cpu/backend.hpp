// llmpar/backend/cpu/backend.hpp — backend::Cpu: host memory, OpenMP kernels, oneDNN GEMMs.
//
// The tag's static operations are the CPU kernels of backend/cpu/ under the names and
// argument orders every model uses; backend::Cuda (backend/cuda/backend.hpp) has the
// same list with the same arguments. The context carries the oneDNN primitive cache.
// Transfers (upload/download/zero) are plain memory operations here.
#pragma once

#include <cstdint>
#include <cstring>

#include "llmpar/backend/backend.hpp"
#include "llmpar/backend/cpu/adamw.hpp"
#include "llmpar/backend/cpu/attention.hpp"
#include "llmpar/backend/cpu/attention_block.hpp"
#include "llmpar/backend/cpu/bias.hpp"
#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/backend/cpu/convert.hpp"
#include "llmpar/backend/cpu/cross_entropy.hpp"
#include "llmpar/backend/cpu/elementwise.hpp"
#include "llmpar/backend/cpu/embedding.hpp"
#include "llmpar/backend/cpu/gelu.hpp"
#include "llmpar/backend/cpu/gemm.hpp"
#include "llmpar/backend/cpu/instances.hpp"
#include "llmpar/backend/cpu/layernorm.hpp"
#include "llmpar/backend/cpu/reduce.hpp"
#include "llmpar/backend/cpu/rmsnorm.hpp"
#include "llmpar/backend/cpu/rotary.hpp"
#include "llmpar/core/slice.hpp"
#include "llmpar/core/tensor.hpp"

namespace llmpar::backend {

struct Cpu {
  static constexpr const char* kName = "cpu";
  using Context = cpu::Context;
  using Space = memory::Host;
  using GemmOp = cpu::GemmOp;
  template <class T>
  using Acc = cpu::acc_t<T>;
  template <class T>
  using AdamWKernel = cpu::AdamWKernel<T>;

  // C(M,N) [+]= op(A)·op(B) [+ bias(N)]; C is T, or acc_t<T> (f32 main grads).
  template <class T, class TC = T>
  static void gemm(Context& ctx, TC* c, const T* a, const T* b, const T* bias, std::int64_t m, std::int64_t n,
                   std::int64_t k, GemmOp op) {
    cpu::gemm<T, TC>(ctx, c, a, b, bias, m, n, k, op);
  }
  // pre (M,N) = x·Wᵀ + bias, act = gelu(pre): a Linear followed by GELU.
  template <class T>
  static void linear_gelu_forward(Context& ctx, T* act, T* pre, const T* x, const T* weight, const T* bias,
                                  std::int64_t m, std::int64_t n, std::int64_t k) {
    cpu::gemm<T>(ctx, pre, x, weight, bias, m, n, k, {.trans_a = false, .trans_b = true, .accumulate = false});
    cpu::gelu_forward(act, pre, m * n);
  }
  // dpre (M,N) = (dy (M,K) · W (K,N)) * gelu'(pre): the input gradient of a Linear whose
  // input was gelu(pre), carried back through the GELU.
  template <class T>
  static void linear_dgelu_backward(Context& ctx, T* dpre, const T* dy, const T* weight, const T* pre, std::int64_t m,
                                    std::int64_t n, std::int64_t k) {
    cpu::gemm<T>(ctx, dpre, dy, weight, nullptr, m, n, k, {});
    cpu::gelu_backward(dpre, pre, dpre, m * n);
  }
  template <class T>
  static void layernorm_forward(Context&, T* out, Acc<T>* mean, Acc<T>* rstd, const T* x, const T* weight,
                                const T* bias, std::int64_t rows, std::int64_t C, float eps) {
    cpu::layernorm_forward(out, mean, rstd, x, weight, bias, rows, C, eps);
  }
  template <class T>
  static void layernorm_backward(Context&, T* dx, Acc<T>* dweight, Acc<T>* dbias, const T* dout, const T* x,
                                 const T* weight, const Acc<T>* mean, const Acc<T>* rstd, std::int64_t rows,
                                 std::int64_t C) {
    cpu::layernorm_backward(dx, dweight, dbias, dout, x, weight, mean, rstd, rows, C);
  }
  // out (rows, C) = x * rstd * weight (RMSNorm, no mean, no bias); rstd saved for backward.
  template <class T>
  static void rmsnorm_forward(Context&, T* out, Acc<T>* rstd, const T* x, const T* weight, std::int64_t rows,
                              std::int64_t C, float eps) {
    cpu::rmsnorm_forward(out, rstd, x, weight, rows, C, eps);
  }
  template <class T>
  static void rmsnorm_backward(Context&, T* dx, Acc<T>* dweight, const T* dout, const T* x, const T* weight,
                               const Acc<T>* rstd, std::int64_t rows, std::int64_t C) {
    cpu::rmsnorm_backward(dx, dweight, dout, x, weight, rstd, rows, C);
  }
  // The residual add fused into the norm (backend/cpu/rmsnorm.hpp): residual += delta,
  // out = RMSNorm(residual); and dx = RMSNorm backward(dout) + dresidual. Bitwise the
  // unfused add_inplace and rmsnorm calls.
  template <class T>
  static void residual_rmsnorm_forward(Context&, T* out, Acc<T>* rstd, T* residual, const T* delta, const T* weight,
                                       std::int64_t rows, std::int64_t C, float eps) {
    cpu::residual_rmsnorm_forward(out, rstd, residual, delta, weight, rows, C, eps);
  }
  template <class T>
  static void residual_rmsnorm_backward(Context&, T* dx, Acc<T>* dweight, const T* dout, const T* dresidual, const T* x,
                                        const T* weight, const Acc<T>* rstd, std::int64_t rows, std::int64_t C) {
    cpu::residual_rmsnorm_backward(dx, dweight, dout, dresidual, x, weight, rstd, rows, C);
  }
  template <class T>
  static void attention_forward(Context&, T* out, Acc<T>* lse, const T* qkv, const AttentionShape& shape) {
    cpu::attention_forward(out, lse, qkv, shape);
  }
  template <class T>
  static void attention_backward(Context&, T* dqkv, const T* dout, const T* qkv, const T* out, const Acc<T>* lse,
                                 const AttentionShape& shape) {
    cpu::attention_backward(dqkv, dout, qkv, out, lse, shape);
  }
  // Rotary position embeddings on q and k of qkv (B, T, R), in place; inverse: the
  // backward (backend/cpu/rotary.hpp).
  template <class T>
  static void rotary(Context&, T* qkv, const AttentionShape& shape, const math::RopeConfig& rope, bool inverse,
                     const ChunkPositions& positions = {}) {
    cpu::rotary(qkv, shape, rope, inverse, positions);
  }
  // Attention one block at a time (ring attention, backend/cpu/attention_block.hpp).
  template <class A>
  static void attention_state_init(Context&, const AttentionState<A>& st, const AttentionShape& shape) {
    cpu::attention_state_init(st, shape);
  }
  template <class T>
  static void attention_block_forward(Context&, const AttentionState<Acc<T>>& st, const T* qkv, const T* kv,
                                      const AttentionShape& shape, const AttentionBlock& block) {
    cpu::attention_block_forward(st, qkv, kv, shape, block);
  }
  template <class T>
  static void attention_state_finish(Context&, T* out, Acc<T>* lse, const AttentionState<Acc<T>>& st,
                                     const AttentionShape& shape) {
    cpu::attention_state_finish(out, lse, st, shape);
  }
  template <class T>
  static void attention_dsum(Context&, Acc<T>* dsum, const T* dout, const T* out, const AttentionShape& shape) {
    cpu::attention_dsum(dsum, dout, out, shape);
  }
  template <class T>
  static void attention_block_backward(Context&, Acc<T>* dq, Acc<T>* dkv, const T* dout, const T* qkv, const T* kv,
                                       const Acc<T>* lse, const Acc<T>* dsum, const AttentionShape& shape,
                                       const AttentionBlock& block) {
    cpu::attention_block_backward(dq, dkv, dout, qkv, kv, lse, dsum, shape, block);
  }
  template <class T>
  static void gelu_forward(Context&, T* out, const T* x, std::int64_t n) {
    cpu::gelu_forward(out, x, n);
  }
  template <class T>
  static void gelu_backward(Context&, T* dx, const T* x, const T* dout, std::int64_t n) {
    cpu::gelu_backward(dx, x, dout, n);
  }
  // act (rows, hidden) = gate(pre[:, :hidden]) · pre[:, hidden:]: a gated linear unit
  // (SwiGLU, GeGLU) over the two halves of each row of pre (rows, 2·hidden).
  template <class T>
  static void glu_forward(Context&, T* act, const T* pre, std::int64_t rows, std::int64_t hidden, math::Gate gate) {
    cpu::glu_forward(act, pre, rows, hidden, gate);
  }
  // dpre (rows, 2·hidden) from dact (rows, hidden) and the forward's pre (overwritten).
  template <class T>
  static void glu_backward(Context&, T* dpre, const T* dact, const T* pre, std::int64_t rows, std::int64_t hidden,
                           math::Gate gate) {
    cpu::glu_backward(dpre, dact, pre, rows, hidden, gate);
  }
  template <class T>
  static void add_inplace(Context&, T* a, const T* b, std::int64_t n) {
    cpu::add_inplace(a, b, n);
  }
  // a (n) *= s.
  template <class T>
  static void scale_inplace(Context&, T* a, Acc<T> s, std::int64_t n) {
    cpu::scale_inplace(a, s, n);
  }
  template <class T>
  static void bias_backward(Context&, Acc<T>* dbias, const T* dout, std::int64_t rows, std::int64_t n) {
    cpu::bias_backward(dbias, dout, rows, n);
  }
  // wte holds the rows `slice` of the token table (default: all); wpe may be null.
  template <class T>
  static void encoder_forward(Context&, T* out, const std::int32_t* tokens, const T* wte, const T* wpe, std::int64_t B,
                              std::int64_t T_len, std::int64_t C, RowSlice slice = {}) {
    cpu::encoder_forward(out, tokens, wte, wpe, B, T_len, C, slice);
  }
  template <class T>
  static void encoder_backward(Context&, Acc<T>* dwte, Acc<T>* dwpe, const T* dout, const std::int32_t* tokens,
                               std::int64_t B, std::int64_t T_len, std::int64_t C, RowSlice slice = {}) {
    cpu::encoder_backward(dwte, dwpe, dout, tokens, B, T_len, C, slice);
  }
  // Targets are checked here (on the host) before any row is touched.
  template <class T>
  static void cross_entropy_forward_backward(Context&, T* logits, Acc<T>* losses, const std::int32_t* targets,
                                             std::int64_t rows, std::int64_t V, std::int64_t Vp, Acc<T> dloss) {
    cpu::cross_entropy_forward_backward(logits, losses, targets, rows, V, Vp, dloss);
  }
  template <class T>
  static void cross_entropy_forward(Context&, Acc<T>* losses, const T* logits, const std::int32_t* targets,
                                    std::int64_t rows, std::int64_t V, std::int64_t Vp) {
    cpu::cross_entropy_forward(losses, logits, targets, rows, V, Vp);
  }
  // The vocabulary-parallel loss (backend/cpu/cross_entropy.hpp): this rank's softmax
  // states, then, after the group all-gathers them, the loss and this rank's dlogits.
  static constexpr int kVocabStats = cpu::kVocabStats;  // values per row of the stats
  template <class T>
  static void vocab_parallel_cross_entropy_stats(Context&, Acc<T>* stats, const T* logits, const std::int32_t* targets,
                                                 std::int64_t rows, std::int64_t V, std::int64_t v0,
                                                 std::int64_t Vlocal) {
    cpu::vocab_parallel_cross_entropy_stats(stats, logits, targets, rows, V, v0, Vlocal);
  }
  template <class T>
  static void vocab_parallel_cross_entropy_finish(Context&, T* dlogits, Acc<T>* losses, const T* logits,
                                                  const Acc<T>* gathered, int ranks, const std::int32_t* targets,
                                                  std::int64_t rows, std::int64_t V, std::int64_t v0,
                                                  std::int64_t Vlocal, Acc<T> dloss) {
    cpu::vocab_parallel_cross_entropy_finish(dlogits, losses, logits, gathered, ranks, targets, rows, V, v0, Vlocal,
                                             dloss);
  }

  // Transfers between host memory and this backend's memory.
  template <class T>
  static void upload(Context&, T* dst, const T* host, std::int64_t n) {
    if (n > 0) std::memcpy(static_cast<void*>(dst), host, static_cast<std::size_t>(n) * sizeof(T));
  }
  template <class T>
  static void download(Context&, T* host, const T* src, std::int64_t n) {
    if (n > 0) std::memcpy(static_cast<void*>(host), src, static_cast<std::size_t>(n) * sizeof(T));
  }
  // dst (n) = src (n), both in this backend's memory.
  template <class T>
  static void copy(Context&, T* dst, const T* src, std::int64_t n) {
    if (n > 0) std::memcpy(static_cast<void*>(dst), src, static_cast<std::size_t>(n) * sizeof(T));
  }
  // dst (rows, width) = src (rows, width), rows dst_stride and src_stride elements apart
  // (columns of one matrix into another: context parallelism's exchanges).
  template <class T>
  static void copy_2d(Context&, T* dst, std::int64_t dst_stride, const T* src, std::int64_t src_stride,
                      std::int64_t rows, std::int64_t width) {
    if (width <= 0) return;
    for (std::int64_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<void*>(dst + r * dst_stride), src + r * src_stride,
                  static_cast<std::size_t>(width) * sizeof(T));
  }
  // p (n) = 0, in this backend's memory (the gradients before a step).
  template <class T>
  static void zero(Context&, T* p, std::int64_t n) {
    if (n > 0) std::memset(static_cast<void*>(p), 0, static_cast<std::size_t>(n) * sizeof(T));
  }
  // dst (n) = src (n) converted (float, bf16, f16).
  template <class To, class From>
  static void convert(Context&, To* dst, const From* src, std::int64_t n) {
    cpu::convert(dst, src, n);
  }
  static void synchronize(Context&) {}
  // A point in the order of a context's work, for another thread to wait on (the
  // communication thread, before it reads what the kernels wrote). The CPU's kernels
  // have run when they return, so every fence is reached as soon as it is recorded.
  struct Fence {
    void record(Context&) {}
    void wait() const {}
  };
  // Σ x² of n elements, deterministic whatever the thread count.
  template <class G>
  static double sum_of_squares(Context&, const G* x, std::int64_t n) {
    return cpu::sum_of_squares(x, n);
  }
};

}  // namespace llmpar::backend
