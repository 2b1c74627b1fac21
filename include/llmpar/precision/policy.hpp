// llmpar/precision/policy.hpp — the precision policy tags: FP32, BF16Mixed, FP16Mixed<Scaler>.
//
// A precision policy names five things (docs/design.md, "Precision"): the type parameters are
// stored in (Param), the type activations and GEMM operands are computed in (Compute),
// the type gradients are accumulated in (Grad), the type of the optimizer's master copy
// of the weights (Master), and the loss scaler (LossScale, NoLossScale when there is
// none). Reductions and optimizer math run in f32 whatever the policy says.
//
// Why these choices:
//  - Gradients are accumulated in f32 ("main grads") under every policy. bf16 has 8
//    mantissa bits, so adding micro-batch gradients in bf16 loses the small ones
//    (Megatron accumulates bf16 runs' gradients in f32 for the same reason); fp16 has
//    11, and loses them too once the sum is 2^11 times larger than one term. The weight
//    gradient GEMMs write f32 directly (bf16/f16 operands, f32 accumulator and output),
//    so main grads cost no extra pass. DeepSpeed's fp16 keeps f16 gradients to save two
//    bytes per parameter; llmpar spends them on exact accumulation instead.
//  - bf16 has f32's exponent range, so BF16Mixed needs no loss scaler.
//  - FP16Mixed's activations and their gradients are f16 (max 65504, smallest normal
//    2^-14), which is only safe because the loss is scaled up before backward: without
//    a scaler small activation gradients underflow to zero silently, so
//    FP16Mixed<Scaler> insists on a real scaler (FP16Mixed<void> and
//    FP16Mixed<NoLossScale> do not compile). The dynamic scaler itself (growth, backoff,
//    hysteresis, the minimum) is precision/loss_scaler.hpp.
//  - The tags are empty structs that carry their Kind (policy_kind::Precision) and their
//    name, so parallel::Compose can sort them among the other policies and name them in
//    messages. The kinds are only declared here; parallel/compose.hpp defines them.
//
// How the types are used: a model is instantiated for Compute (models::GPT2<bf16, B>;
// Param is the same type, the store's working copy of the weights), its gradients are
// acc_t<Compute> = float, and the optimizer keeps f32 master weights and moments when
// Param is not float (kSeparateMaster), refreshing the working copy after every step.
#pragma once

#include <type_traits>

#include "llmpar/core/dtype.hpp"

namespace llmpar::policy_kind {
struct Precision;  // defined in parallel/compose.hpp
}  // namespace llmpar::policy_kind

namespace llmpar::precision {

// No loss scaling (FP32, BF16Mixed).
struct NoLossScale {
  static constexpr const char* kName = "precision::NoLossScale";
};

// The dynamic loss scaler: multiply the loss by `scale` before backward. After
// `growth_interval` steps in a row without inf/NaN in any rank's gradients the scale is
// multiplied by `growth_factor`. A step with inf/NaN is skipped on every rank; the
// scale is multiplied by `backoff_factor` once `hysteresis` such steps have come without
// a growth between them (DeepSpeed's delayed shift and Megatron's hysteresis: one stray
// overflow does not halve the scale). An overflow at `min_scale` with the hysteresis
// used up stops the run with an error: the gradients overflow even unscaled. The
// defaults are Megatron's and DeepSpeed's.
struct DynamicLossScale {
  static constexpr const char* kName = "precision::DynamicLossScale";
  static constexpr bool kIsLossScaler = true;
  struct Config {
    float initial_scale = 65536.0f;  // 2^16
    float growth_factor = 2.0f;
    float backoff_factor = 0.5f;
    int growth_interval = 1000;
    int hysteresis = 2;
    float min_scale = 1.0f;
  };
};

// A loss scaler is a tag that says it is one (NoLossScale is not).
template <class S>
concept LossScaler = requires {
  requires S::kIsLossScaler;
  { S::kName } -> std::convertible_to<const char*>;
};

// Everything in f32; the optimizer updates the parameters themselves.
struct FP32 {
  using Kind = policy_kind::Precision;
  static constexpr const char* kName = "precision::FP32";
  using Param = float;
  using Compute = float;
  using Grad = float;
  using Master = float;
  using LossScale = NoLossScale;
  static constexpr bool kHasLossScale = false;
};

// bf16 parameters and compute, f32 gradient accumulation and f32 master weights.
struct BF16Mixed {
  using Kind = policy_kind::Precision;
  static constexpr const char* kName = "precision::BF16Mixed";
  using Param = bf16;
  using Compute = bf16;
  using Grad = float;
  using Master = float;
  using LossScale = NoLossScale;
  static constexpr bool kHasLossScale = false;
};

// fp16 parameters and compute, loss-scaled f32 gradients, f32 master weights.
template <class Scaler>
struct FP16Mixed {
  static_assert(LossScaler<Scaler>,
                "llmpar: precision::FP16Mixed<Scaler> needs a loss scaler, such as "
                "precision::FP16Mixed<precision::DynamicLossScale>; fp16 gradients underflow to zero without one "
                "(or use precision::BF16Mixed, which needs no scaler)");
  using Kind = policy_kind::Precision;
  static constexpr const char* kName = std::is_same_v<Scaler, DynamicLossScale>
                                           ? "precision::FP16Mixed<precision::DynamicLossScale>"
                                           : "precision::FP16Mixed<Scaler>";
  using Param = f16;
  using Compute = f16;
  using Grad = float;
  using Master = float;
  using LossScale = Scaler;
  static constexpr bool kHasLossScale = true;
};

// A precision policy: a tag of this kind whose types are ones llmpar computes with.
template <class P>
concept Policy = requires {
  requires std::is_same_v<typename P::Kind, policy_kind::Precision>;
  typename P::Param;
  typename P::Compute;
  typename P::Grad;
  typename P::Master;
  typename P::LossScale;
  { P::kHasLossScale } -> std::convertible_to<bool>;
  requires !P::kHasLossScale || LossScaler<typename P::LossScale>;
  requires kIsFloating<typename P::Param> && kIsFloating<typename P::Compute> && kIsFloating<typename P::Grad>;
  requires std::is_same_v<typename P::Master, float>;  // optimizer math runs in f32
  requires std::is_same_v<typename P::Grad, float>;    // main grads are f32 (see above)
  requires std::is_same_v<typename P::Param, typename P::Compute>;
};

static_assert(Policy<FP32> && Policy<BF16Mixed> && Policy<FP16Mixed<DynamicLossScale>>);

// Whether the optimizer keeps a separate master copy of the weights.
template <Policy P>
inline constexpr bool kSeparateMaster = !std::is_same_v<typename P::Param, typename P::Master>;

}  // namespace llmpar::precision
