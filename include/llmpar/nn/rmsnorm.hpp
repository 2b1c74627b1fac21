// llmpar/nn/rmsnorm.hpp — RMSNorm over the last dimension (LLaMA), with its backward.
//
//   out = x * rstd * weight,   rstd = 1 / sqrt(mean(x^2) + eps)
//
// The counterpart of nn/layernorm.hpp without the mean and the bias: one gain per
// channel, initialised to ones. The one statistic its backward needs (1/rms per row, in
// the accumulation type) is its Saved, which the caller owns; the normalised output
// belongs to the caller too.
//
// Where the backend has the fused kernels (backend::Cpu and backend::Cuda do), the norm
// also takes the residual add that precedes it in a pre-norm block, in the same pass
// over the rows (llm.c's fused_residual_forward, Apex's fused add + RMSNorm):
// forward_residual adds the branch into the stream and normalises the sum, and
// backward_residual adds the stream's gradient into dx as it writes it. Their results
// are bitwise those of add_inplace and forward, backward and add_inplace: a block that
// uses them (models::PreNormBlock does, when its Norm has them) computes the same bits.
#pragma once

#include <cstdint>
#include <string>

#include "llmpar/backend/backend.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::nn {

namespace detail {
// A backend with RMSNorm fused with the residual add (backend/cpu/rmsnorm.hpp).
template <class Backend, class T>
concept HasResidualRmsnorm = requires(typename Backend::Context& ctx, T* y, const T* x,
                                      typename Backend::template Acc<T>* acc, std::int64_t n) {
  Backend::template residual_rmsnorm_forward<T>(ctx, y, acc, y, x, x, n, n, 0.0f);
  Backend::template residual_rmsnorm_backward<T>(ctx, y, acc, x, x, x, x, acc, n, n);
};
}  // namespace detail

template <class T, class Backend = backend::Cpu>
class RMSNorm {
 public:
  using Acc = typename Backend::template Acc<T>;
  struct Saved {
    Buffer<Acc, typename Backend::Space> rstd;  // (rows)
    std::size_t bytes() const { return rstd.bytes(); }
  };

  RMSNorm(const std::string& name, std::int64_t channels, float eps = 1e-5f)
      : channels_(channels), eps_(eps), weight_(name + ".weight", {channels}, Init::ones(), false) {}

  // out (rows, C) = x * rstd * w; keeps rstd in saved.
  void forward(typename Backend::Context& ctx, Saved& saved, T* out, const T* x, std::int64_t rows) {
    saved.rstd.reserve(rows);
    Backend::rmsnorm_forward(ctx, out, saved.rstd.data(), x, weight_.value, rows, channels_, eps_);
  }

  // dx (rows, C) overwritten; dw accumulated. x is the input given to forward.
  void backward(typename Backend::Context& ctx, const Saved& saved, T* dx, const T* dout, const T* x,
                std::int64_t rows) {
    Backend::rmsnorm_backward(ctx, dx, weight_.grad, dout, x, weight_.value, saved.rstd.data(), rows, channels_);
  }

  // residual (rows, C) += delta, then out = RMSNorm(residual), in one pass; keeps rstd.
  // Bitwise Backend::add_inplace(residual, delta) then forward(out, residual).
  void forward_residual(typename Backend::Context& ctx, Saved& saved, T* out, T* residual, const T* delta,
                        std::int64_t rows) requires detail::HasResidualRmsnorm<Backend, T> {
    saved.rstd.reserve(rows);
    Backend::residual_rmsnorm_forward(ctx, out, saved.rstd.data(), residual, delta, weight_.value, rows, channels_,
                                      eps_);
  }

  // dx (rows, C) = backward(dout) + dresidual, in one pass: x fed both this norm and the
  // residual stream, whose gradient is dresidual. dw accumulated. Bitwise backward(dx)
  // then Backend::add_inplace(dx, dresidual). dx must not overlap dout, dresidual or x.
  void backward_residual(typename Backend::Context& ctx, const Saved& saved, T* dx, const T* dout, const T* dresidual,
                         const T* x, std::int64_t rows) requires detail::HasResidualRmsnorm<Backend, T> {
    Backend::residual_rmsnorm_backward(ctx, dx, weight_.grad, dout, dresidual, x, weight_.value, saved.rstd.data(),
                                       rows, channels_);
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    visit(weight_);
  }

 private:
  std::int64_t channels_;
  float eps_;
  Parameter<T> weight_;
};

}  // namespace llmpar::nn
