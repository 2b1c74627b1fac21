// llmpar/nn/rmsnorm.hpp — RMSNorm over the last dimension (LLaMA), with its backward.
//
//   out = x * rstd * weight,   rstd = 1 / sqrt(mean(x^2) + eps)
//
// The counterpart of nn/layernorm.hpp without the mean and the bias: one gain per
// channel, initialised to ones. The one statistic its backward needs (1/rms per row, in
// the accumulation type) is its Saved, which the caller owns; the normalised output
// belongs to the caller too.
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
