// llmpar/nn/layernorm.hpp — LayerNorm over the last dimension, with its backward.
//
// The layer owns the two statistics its backward needs (mean and 1/std per row, in the
// accumulation type) and nothing else; the normalised output belongs to the caller.
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

  LayerNorm(const std::string& name, std::int64_t channels, float eps = 1e-5f)
      : channels_(channels),
        eps_(eps),
        weight_(name + ".weight", {channels}, Init::ones(), false),
        bias_(name + ".bias", {channels}, Init::zeros(), false) {}

  // out (rows, C) = (x - mean) * rstd * w + b; keeps mean and rstd for backward.
  void forward(typename Backend::Context& ctx, T* out, const T* x, std::int64_t rows) {
    mean_.reserve(rows);
    rstd_.reserve(rows);
    Backend::layernorm_forward(ctx, out, mean_.data(), rstd_.data(), x, weight_.value, bias_.value, rows, channels_,
                                    eps_);
  }

  // dx (rows, C) overwritten; dw, db accumulated. x is the input given to forward.
  void backward(typename Backend::Context& ctx, T* dx, const T* dout, const T* x, std::int64_t rows) {
    Backend::layernorm_backward(ctx, dx, weight_.grad, bias_.grad, dout, x, weight_.value, mean_.data(), rstd_.data(),
                                     rows, channels_);
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    visit(weight_);
    visit(bias_);
  }

  std::size_t activation_bytes() const { return mean_.bytes() + rstd_.bytes(); }

 private:
  std::int64_t channels_;
  float eps_;
  Parameter<T> weight_;
  Parameter<T> bias_;
  Buffer<Acc, typename Backend::Space> mean_;  // (rows)
  Buffer<Acc, typename Backend::Space> rstd_;  // (rows)
};

}  // namespace llmpar::nn
