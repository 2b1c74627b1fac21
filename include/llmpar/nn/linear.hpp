// llmpar/nn/linear.hpp — y = x·Wᵀ + b, with its explicit backward.
//
// The weight is stored (out, in) like PyTorch and llm.c, so the forward is one GEMM
// with B transposed, the input gradient dX = dY·W one plain GEMM, and the weight
// gradient dW += dYᵀ·X one GEMM that accumulates in place (gradient accumulation over
// micro-batches needs no extra buffer). The layer keeps no activations: whoever owns
// x passes it again to backward — the block that owns its activations decides whether
// they are kept or recomputed. Backend is the policy tag (backend/backend.hpp) whose
// GEMM and bias-gradient kernels run it.
#pragma once

#include <cstdint>
#include <string>

#include "llmpar/backend/backend.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::nn {

template <class T, class Backend = backend::Cpu>
class Linear {
 public:
  // in/out features are the full (serial) layer's; weight_split and bias_split say
  // which part of the weight (out, in) and bias (out) this rank holds (tensor-parallel
  // layers, nn/tensor_parallel.hpp); the GEMMs run on the held part.
  Linear(const std::string& name, std::int64_t in_features, std::int64_t out_features, bool has_bias, float init_std,
         Split weight_split = {}, Split bias_split = {})
      : has_bias_(has_bias),
        weight_((check_sizes(name, in_features, out_features), name + ".weight"), {out_features, in_features},
                Init::normal(init_std), true, weight_split),
        bias_(name + ".bias", {out_features}, Init::zeros(), false, bias_split) {
    const Shape local = weight_.local_shape();
    out_ = local[0];
    in_ = local[1];
  }

  // y (rows, out) = x (rows, in) · Wᵀ + b
  void forward(typename Backend::Context& ctx, T* y, const T* x, std::int64_t rows) const {
    Backend::template gemm<T>(ctx, y, x, weight_.value, has_bias_ ? bias_.value : nullptr, rows, out_, in_,
                              {.trans_a = false, .trans_b = true, .accumulate = false});
  }

  // pre (rows, out) = x · Wᵀ + b and act = gelu(pre): this layer followed by a GELU, in
  // one GEMM where the backend can fuse it (cuBLASLt's epilogue).
  void forward_gelu(typename Backend::Context& ctx, T* act, T* pre, const T* x, std::int64_t rows) const {
    Backend::linear_gelu_forward(ctx, act, pre, x, weight_.value, has_bias_ ? bias_.value : nullptr, rows, out_, in_);
  }

  // The backward of this layer when its input x was gelu(pre): dpre (rows, in) =
  // (dy · W) * gelu'(pre), fused where the backend can; dW += dyᵀ · x; db += Σ dy.
  void backward_through_gelu(typename Backend::Context& ctx, T* dpre, const T* dy, const T* x, const T* pre,
                             std::int64_t rows) {
    Backend::linear_dgelu_backward(ctx, dpre, dy, weight_.value, pre, rows, in_, out_);
    weight_bias_backward(ctx, dy, x, rows);
  }

  // The input-gradient halves of the two above, for a schedule that runs the weight
  // gradient later (pipeline::zb_h1): dpre = (dy · W) * gelu'(pre); dx = dy · W. Then
  // weight_bias_backward(dy, x) with the same dy and x.
  void input_backward_through_gelu(typename Backend::Context& ctx, T* dpre, const T* dy, const T* pre,
                                   std::int64_t rows) const {
    Backend::linear_dgelu_backward(ctx, dpre, dy, weight_.value, pre, rows, in_, out_);
  }
  void input_backward(typename Backend::Context& ctx, T* dx, const T* dy, std::int64_t rows) const {
    Backend::template gemm<T>(ctx, dx, dy, weight_.value, nullptr, rows, in_, out_, {});
  }

  // dx (rows, in) = dy · W (skipped when dx is null); dW (out, in) += dyᵀ · x; db += Σ dy.
  void backward(typename Backend::Context& ctx, T* dx, const T* dy, const T* x, std::int64_t rows) {
    if (dx != nullptr) Backend::template gemm<T>(ctx, dx, dy, weight_.value, nullptr, rows, in_, out_, {});
    weight_bias_backward(ctx, dy, x, rows);
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    visit(weight_);
    if (has_bias_) visit(bias_);
  }

  // The features this rank computes with (the full layer's, unless split).
  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }
  bool has_bias() const { return has_bias_; }
  Parameter<T>& weight() { return weight_; }
  Parameter<T>& bias() { return bias_; }
  const Parameter<T>& weight() const { return weight_; }
  const Parameter<T>& bias() const { return bias_; }

  // dW (out, in) += dyᵀ · x; db += Σ_rows dy.
  void weight_bias_backward(typename Backend::Context& ctx, const T* dy, const T* x, std::int64_t rows) {
    Backend::template gemm<T>(ctx, weight_.grad, dy, x, nullptr, out_, in_, rows,
                              {.trans_a = true, .trans_b = false, .accumulate = true});
    if (has_bias_) Backend::bias_backward(ctx, bias_.grad, dy, rows, out_);
  }

 private:
  static int check_sizes(const std::string& name, std::int64_t in, std::int64_t out) {
    LLMPAR_CHECK(in > 0 && out > 0, "linear layer '", name, "' needs positive sizes, got in=", in, " out=", out);
    return 0;
  }

  std::int64_t in_ = 0, out_ = 0;
  bool has_bias_;
  Parameter<T> weight_;  // (out, in)
  Parameter<T> bias_;    // (out)
};

}  // namespace llmpar::nn
