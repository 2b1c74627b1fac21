// llmpar/backend/cpu/adamw.hpp — the AdamW update over a flat parameter range.
//
// Memory-bound: each element reads param, m, v, grad and writes param, m, v (28 bytes
// in float), so the loop must run at memory bandwidth. The element math is the shared
// math::adamw_step; the step's bias corrections are computed once here (in double)
// rather than per element, which leaves only mul/add/div/sqrt in the loop and lets it
// vectorize across `parallel for simd`. The hyper-parameters are copied to a local
// first: through a reference the compiler must assume the float stores into params
// could change hp.lr and would reload it every element. Element-wise, so the result
// does not depend on the thread count.
//
// grad_scale multiplies every gradient before the update: 1 / loss_scale, the global
// gradient-clipping factor, or 1 / accumulation_steps, folded into one multiply.
//
// Master weights. A model stored in bf16/f16 keeps its parameters' f32 master copy in
// the optimizer: the update runs on master, m and v in f32, and the same loop writes the
// model's working copy param = P(master) (round to nearest even), so refreshing the
// 16-bit weights costs no pass of its own.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "llmpar/backend/cpu/common.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/math/adamw.hpp"

namespace llmpar::backend::cpu {

namespace detail {

// The update of n elements on `master` (the parameters themselves for float and double),
// m and v, writing copy[i] = P(master[i]) when P is a 16-bit storage type (copy is unused
// when P is T). `who` names the caller in messages.
template <class T, class P>
void adamw_elements(T* LLMPAR_RESTRICT master, P* LLMPAR_RESTRICT copy, T* LLMPAR_RESTRICT m, T* LLMPAR_RESTRICT v,
                    const T* LLMPAR_RESTRICT grads, std::int64_t n, const math::AdamWParams& hp, int step,
                    float grad_scale, const char* who) {
  math::validate(hp);
  LLMPAR_CHECK(n >= 0, who, ": n = ", n, "; it must be >= 0");
  LLMPAR_CHECK(std::isfinite(grad_scale), who, ": grad_scale = ", grad_scale,
               "; it must be finite (a non-finite scale means the step should be skipped)");
  const math::AdamWBiasCorrections corrections = math::adamw_bias_corrections(hp, step);
  const math::AdamWParams local = hp;
  const T c1 = static_cast<T>(corrections.first);
  const T c2 = static_cast<T>(corrections.second);
  const T scale = static_cast<T>(grad_scale);
#pragma omp parallel for simd schedule(static) if (n >= kMinParallelWork)
  for (std::int64_t i = 0; i < n; ++i) {
    T p = master[i];
    T mi = m[i];
    T vi = v[i];
    math::adamw_step(p, mi, vi, grads[i] * scale, local, c1, c2);
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if constexpr (!std::is_same_v<P, T>) copy[i] = llmpar::convert<P>(p);
  }
}

}  // namespace detail

// params, m, v: (n), updated in place; grads: (n). step counts from 1.
template <class T>
void adamw_update(T* params, T* m, T* v, const T* grads, std::int64_t n, const math::AdamWParams& hp, int step,
                  float grad_scale = 1.0f) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "adamw_update keeps parameters and moments in float (or double for tests); "
                "low-precision weights are updated through their float master copy (adamw_update_master)");
  detail::adamw_elements<T, T>(params, nullptr, m, v, grads, n, hp, step, grad_scale, "adamw_update");
}

// The same update on f32 master weights, writing the storage copy params = P(master)
// (P: bf16 or f16). master, m, v: (n) f32, updated in place; params: (n); grads: (n) f32.
template <class P>
void adamw_update_master(float* master, P* params, float* m, float* v, const float* grads, std::int64_t n,
                         const math::AdamWParams& hp, int step, float grad_scale = 1.0f) {
  static_assert(std::is_same_v<P, bf16> || std::is_same_v<P, f16>,
                "adamw_update_master refreshes a 16-bit copy; float parameters are their own master (adamw_update)");
  detail::adamw_elements<float, P>(master, params, m, v, grads, n, hp, step, grad_scale, "adamw_update_master");
}

// The CPU's AdamW over an optimizer's table of tensors (optim::AdamW builds it): one
// update of every tensor, each at lr x its lr_scale and with its own decay flag, every
// gradient multiplied by 1 / loss scale x the clip factor of the global norm.
template <class T>
class AdamWKernel {
 public:
  using Master = acc_t<T>;
  using Slot = math::AdamWSlot<Master, T>;

  template <class Context>
  AdamWKernel(Context&, std::vector<Slot> slots) : slots_(std::move(slots)) {}

  // norm: the global norm of the unscaled gradient.
  template <class Context>
  void step(Context&, const math::AdamWParams& hp, int step, double norm, float inv_loss_scale, float max_norm) const {
    const float grad_scale =
        static_cast<float>(static_cast<double>(inv_loss_scale) * math::clip_factor(norm, max_norm));
    for (const Slot& s : slots_) {
      math::AdamWParams local = hp;
      local.lr = hp.lr * s.lr_scale;
      if (!s.decay) local.weight_decay = 0.0f;
      detail::adamw_elements<Master, T>(s.master, s.param, s.m, s.v, s.grad, s.n, local, step, grad_scale, "AdamW");
    }
  }

 private:
  std::vector<Slot> slots_;
};

}  // namespace llmpar::backend::cpu
