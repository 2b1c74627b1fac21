// llmpar/math/adamw.hpp — one AdamW step on one parameter, shared by CPU and CUDA.
//
// Decoupled weight decay as in PyTorch's AdamW and llm.c:
//   m <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g^2
//   p <- p - lr (m / c1 / (sqrt(v / c2) + eps) + wd p),   c1 = 1 - b1^t, c2 = 1 - b2^t
// The bias corrections c1, c2 depend only on the step, so the caller computes them
// once per step (adamw_bias_corrections, in double) instead of a pow per element; the
// element update then has no transcendental call and a CPU loop over it vectorizes.
// The struct of hyper-parameters lives here, not in optim/, so CUDA code can take it
// by value without pulling in host-only headers; lr is the already-scheduled rate.
#pragma once

#include <cmath>
#include <cstdint>

#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::math {

struct AdamWParams {
  float lr = 0.0f;  // this step's rate, after warm-up/decay; the schedule sets it every step
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: multiplies lr * p, not added to the gradient
};

// One tensor of an optimizer's update, as a backend's AdamW kernel takes it: n elements
// of the master weights (the parameters themselves when Param is Master: param is then
// nullptr), the storage copy the update refreshes (Param = bf16/f16), the gradients and
// the two moments, all in the backend's memory. optim::AdamW builds the table; the
// backends' kernels (backend::cpu::AdamWKernel, backend::cuda::AdamWKernel) run it.
template <class Master, class Param>
struct AdamWSlot {
  Master* master = nullptr;
  Param* param = nullptr;
  const Master* grad = nullptr;  // still multiplied by the loss scale
  Master* m = nullptr;
  Master* v = nullptr;
  std::int64_t n = 0;
  bool decay = false;     // weight decay applies (matrices, embeddings)
  float lr_scale = 1.0f;  // this tensor's step runs at lr x lr_scale (µP's hidden matrices)
};

// The clip factor for a gradient of global norm `norm` (1 when clipping is off or the
// norm is within max_norm): the same expression on both backends, in double.
LLMPAR_HOST_DEVICE double clip_factor(double norm, float max_norm) {
  return max_norm > 0.0f && norm > max_norm ? static_cast<double>(max_norm) / (norm + 1e-6) : 1.0;
}

// 1 - beta^step for both moments; step counts from 1.
struct AdamWBiasCorrections {
  double first;   // 1 - beta1^step
  double second;  // 1 - beta2^step
};

// Host-side checks, run once per update call: every message names the field and value.
inline void validate(const AdamWParams& hp) {
  LLMPAR_CHECK(hp.lr >= 0.0f && std::isfinite(hp.lr), "AdamW lr is ", hp.lr, "; it must be finite and >= 0");
  LLMPAR_CHECK(hp.beta1 >= 0.0f && hp.beta1 < 1.0f, "AdamW beta1 is ", hp.beta1, "; it must be in [0, 1), e.g. 0.9");
  LLMPAR_CHECK(hp.beta2 >= 0.0f && hp.beta2 < 1.0f, "AdamW beta2 is ", hp.beta2,
               "; it must be in [0, 1), e.g. 0.95 or 0.999");
  LLMPAR_CHECK(hp.eps > 0.0f && std::isfinite(hp.eps), "AdamW eps is ", hp.eps,
               "; it must be finite and > 0, e.g. 1e-8");
  LLMPAR_CHECK(hp.weight_decay >= 0.0f && std::isfinite(hp.weight_decay), "AdamW weight_decay is ", hp.weight_decay,
               "; it must be finite and >= 0");
}

inline AdamWBiasCorrections adamw_bias_corrections(const AdamWParams& hp, int step) {
  LLMPAR_CHECK(step >= 1, "AdamW step is ", step, "; steps count from 1");
  return {1.0 - std::pow(static_cast<double>(hp.beta1), step), 1.0 - std::pow(static_cast<double>(hp.beta2), step)};
}

// One element. T is float (training) or double (reference tests); grad is the final
// gradient (already unscaled/clipped). c1, c2 are the bias corrections of this step.
template <class T>
LLMPAR_HOST_DEVICE void adamw_step(T& param, T& m, T& v, T grad, const AdamWParams& hp, T c1, T c2) {
  using std::sqrt;
  const T beta1 = static_cast<T>(hp.beta1);
  const T beta2 = static_cast<T>(hp.beta2);
  m = beta1 * m + (T(1) - beta1) * grad;
  v = beta2 * v + (T(1) - beta2) * grad * grad;
  const T m_hat = m / c1;
  const T v_hat = v / c2;
  param -= static_cast<T>(hp.lr) *
           (m_hat / (sqrt(v_hat) + static_cast<T>(hp.eps)) + static_cast<T>(hp.weight_decay) * param);
}

}  // namespace llmpar::math
