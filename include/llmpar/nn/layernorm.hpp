// llmpar/nn/layernorm.hpp — LayerNorm over the last dimension, with its backward.
//
// What backward needs are two statistics per row (mean and 1/std, in the accumulation
// type): the layer's Saved, which the caller owns (one per micro-batch in flight, as for
// every layer: nn/layer.hpp). The normalised output belongs to the caller too.
#pragma once

#include <cstdint>
#include <string>

#include "llmpar/backend/backend.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::nn {

template <class T, class Backend = backend::Cpu>
class LayerNorm {
 public:
  using Acc = typename Backend::template Acc<T>;
  struct Saved {
    Buffer<Acc, typename Backend::Space> mean;  // (rows)
    Buffer<Acc, typename Backend::Space> rstd;  // (rows)
    std::size_t bytes() const { return mean.bytes() + rstd.bytes(); }
  };

  LayerNorm(const std::string& name, std::int64_t channels, float eps = 1e-5f)
      : channels_(channels),
        eps_(eps),
        weight_(name + ".weight", {channels}, Init::ones(), false),
        bias_(name + ".bias", {channels}, Init::zeros(), false) {}

  // out (rows, C) = (x - mean) * rstd * w + b; keeps mean and rstd in saved.
  void forward(typename Backend::Context& ctx, Saved& saved, T* out, const T* x, std::int64_t rows) {
    saved.mean.reserve(rows);
    saved.rstd.reserve(rows);
    Backend::layernorm_forward(ctx, out, saved.mean.data(), saved.rstd.data(), x, weight_.value, bias_.value, rows,
                               channels_, eps_);
  }

  // dx (rows, C) overwritten; dw, db accumulated. x is the input given to forward.
  void backward(typename Backend::Context& ctx, const Saved& saved, T* dx, const T* dout, const T* x,
                std::int64_t rows) {
    Backend::layernorm_backward(ctx, dx, weight_.grad, bias_.grad, dout, x, weight_.value, saved.mean.data(),
                                saved.rstd.data(), rows, channels_);
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    visit(weight_);
    visit(bias_);
  }

 private:
  std::int64_t channels_;
  float eps_;
  Parameter<T> weight_;
  Parameter<T> bias_;
};

}  // namespace llmpar::nn
