// llmpar/nn/rmsnorm.hpp — RMSNorm over the last dimension (LLaMA), with its backward.
//
//   out = x * rstd * weight,   rstd = 1 / sqrt(mean(x^2) + eps)
//
// The counterpart of nn/layernorm.hpp without the mean and the bias: one gain per
// channel, initialised to ones. The layer owns the one statistic its backward needs
// (1/rms per row, in the accumulation type) and nothing else; the normalised output
// belongs to the caller.
#pragma once

#include <cstdint>
#include <string>

#include "llmpar/backend/backend.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::nn {

template <class T, class Backend = backend::Cpu>
class RMSNorm {
 public:
  using Acc = typename Backend::template Acc<T>;

  RMSNorm(const std::string& name, std::int64_t channels, float eps = 1e-5f)
      : channels_(channels), eps_(eps), weight_(name + ".weight", {channels}, Init::ones(), false) {}

  // out (rows, C) = x * rstd * w; keeps rstd for backward.
  void forward(typename Backend::Context& ctx, T* out, const T* x, std::int64_t rows) {
    rstd_.reserve(rows);
    Backend::rmsnorm_forward(ctx, out, rstd_.data(), x, weight_.value, rows, channels_, eps_);
  }

  // dx (rows, C) overwritten; dw accumulated. x is the input given to forward.
  void backward(typename Backend::Context& ctx, T* dx, const T* dout, const T* x, std::int64_t rows) {
    Backend::rmsnorm_backward(ctx, dx, weight_.grad, dout, x, weight_.value, rstd_.data(), rows, channels_);
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    visit(weight_);
  }

  std::size_t activation_bytes() const { return rstd_.bytes(); }

 private:
  std::int64_t channels_;
  float eps_;
  Parameter<T> weight_;
  Buffer<Acc, typename Backend::Space> rstd_;  // (rows)
};

}  // namespace llmpar::nn
