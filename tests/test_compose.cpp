// Policy composition (parallel/compose.hpp, precision/policy.hpp) and the Layer concept
// (nn/layer.hpp). Most of what they promise is checked at compile time, so most of this
// file is static_asserts; the CHECKs repeat the values a trainer reads at run time. The
// mistakes that must not compile are tests/compile_fail/*.cpp.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/nn/layer.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/precision/policy.hpp"

using namespace llmpar;

namespace {

// A trainer's policy sketch, with ZeRO stage 1 where it has 2 (a pipeline with
// stage 2 or 3 fails to compile with a sentence saying why:
// tests/compile_fail/pipeline_with_zero2.cpp), and without its tensor policy: sequence
// parallelism is the layout's value (parallel::LayoutConfig::sp), not a type.
using Sketch =
    Compose<backend::Cpu, precision::BF16Mixed, parallel::Pipeline<schedule::OneFOneB>, parallel::Data<zero::Stage<1>>>;

using Defaults = Compose<>;

}  // namespace

TEST_CASE("Compose fills every kind that is not given with its default") {
  static_assert(std::is_same_v<Defaults::backend, backend::Cpu>);
  static_assert(std::is_same_v<Defaults::precision, precision::FP32>);
  static_assert(std::is_same_v<Defaults::pipeline, parallel::NoPipeline>);
  static_assert(std::is_same_v<Defaults::data, parallel::Data<zero::Stage<0>>>);
  static_assert(std::is_same_v<Defaults::recompute, recompute::None>);
  CHECK_FALSE(Defaults::kOnCuda);
  CHECK(Defaults::kPipelineChunks == 1);
  CHECK(Defaults::kZeroStage == 0);
  CHECK_FALSE(Defaults::kHasLossScale);
  CHECK_FALSE(Defaults::kMixedPrecision);

  // One tag given: only its kind changes.
  using OnlyBf16 = Compose<precision::BF16Mixed>;
  static_assert(std::is_same_v<OnlyBf16::precision, precision::BF16Mixed>);
  static_assert(std::is_same_v<OnlyBf16::backend, backend::Cpu>);
  static_assert(std::is_same_v<OnlyBf16::pipeline, Defaults::pipeline>);
  CHECK(OnlyBf16::kMixedPrecision);
  // Spelling out the defaults is the same type as leaving them out.
  static_assert(std::is_same_v<Defaults, Compose<backend::Cpu, precision::FP32, parallel::NoPipeline,
                                                 parallel::Data<zero::Stage<0>>, recompute::None>>);
}

TEST_CASE("Compose reads the built part of a trainer's policy sketch") {
  static_assert(std::is_same_v<Sketch::backend, backend::Cpu>);
  static_assert(std::is_same_v<Sketch::precision, precision::BF16Mixed>);
  static_assert(std::is_same_v<Sketch::pipeline, parallel::Pipeline<schedule::OneFOneB>>);
  static_assert(std::is_same_v<Sketch::data::Zero, zero::Stage<1>>);
  static_assert(std::is_same_v<Sketch::recompute, recompute::None>);
  CHECK(Sketch::kZeroStage == 1);
  CHECK(Sketch::kPipelineChunks == 1);
  CHECK(Sketch::kMixedPrecision);
  CHECK_FALSE(Sketch::kHasLossScale);
  static_assert(ComposedPolicy<Sketch>);
  static_assert(!ComposedPolicy<precision::BF16Mixed>);
}

TEST_CASE("Compose does not depend on the order of its tags") {
  using Reordered = Compose<parallel::Data<zero::Stage<1>>, parallel::Pipeline<schedule::OneFOneB>,
                            precision::BF16Mixed, backend::Cpu>;
  static_assert(std::is_same_v<Sketch, Reordered>);
  static_assert(std::is_same_v<Compose<recompute::None, backend::Cuda>, Compose<backend::Cuda, recompute::None>>);
  static_assert(std::is_same_v<Compose<backend::Cuda, precision::BF16Mixed>::backend, backend::Cuda>);
  static_assert(std::is_same_v<Compose<precision::BF16Mixed, backend::Cuda>::backend, backend::Cuda>);
  CHECK(std::string_view(Sketch::kName) == std::string_view(Reordered::kName));
}

TEST_CASE("Compose's convenience values follow the tags") {
  using Fp16 = Compose<backend::Cuda, precision::FP16Mixed<precision::DynamicLossScale>>;
  static_assert(Fp16::kOnCuda);
  static_assert(Fp16::kPipelineChunks == 1);
  static_assert(Fp16::kZeroStage == 0);
  static_assert(Fp16::kHasLossScale && Fp16::kMixedPrecision);
  static_assert(std::is_same_v<Fp16::precision::LossScale, precision::DynamicLossScale>);
  // fp16 runs on the CPU too (f16 storage, f32 arithmetic): how CI tests the loss scaler.
  using Fp16Cpu = Compose<precision::FP16Mixed<precision::DynamicLossScale>>;
  static_assert(!Fp16Cpu::kOnCuda && Fp16Cpu::kHasLossScale);
  CHECK(std::string_view(Fp16::kName) ==
        "Compose<backend::Cuda, precision::FP16Mixed<precision::DynamicLossScale>, parallel::NoPipeline, "
        "parallel::Data<zero::Stage<0>>, recompute::None>");
  CHECK(std::string_view(Defaults::kName) ==
        "Compose<backend::Cpu, precision::FP32, parallel::NoPipeline, parallel::Data<zero::Stage<0>>, "
        "recompute::None>");
}

TEST_CASE("the tags of algorithms not built yet are still checked and named") {
  // Compose rejects them (tests/compile_fail/*_not_built.cpp); on their own they keep
  // their arguments, kinds and names for the changes that build them.
  static_assert(parallel::Pipeline<schedule::Interleaved1F1B<4>>::kChunks == 4);
  static_assert(parallel::Pipeline<schedule::GPipe>::kChunks == 1);
  static_assert(parallel::Data<zero::Stage<3>>::kZeroStage == 3);
  static_assert(std::is_same_v<parallel::PolicyTraits<recompute::Selective>::Kind, policy_kind::Recompute>);
  CHECK(std::string_view(recompute::Full::kName) == "recompute::Full");
}

TEST_CASE("every tag is classified by its kind and named as written") {
  using parallel::PolicyTraits;
  static_assert(std::is_same_v<PolicyTraits<backend::Cuda>::Kind, policy_kind::Backend>);
  static_assert(std::is_same_v<PolicyTraits<precision::FP32>::Kind, policy_kind::Precision>);
  static_assert(std::is_same_v<PolicyTraits<parallel::Pipeline<schedule::GPipe>>::Kind, policy_kind::Pipeline>);
  static_assert(std::is_same_v<PolicyTraits<parallel::Data<zero::Stage<3>>>::Kind, policy_kind::Data>);
  static_assert(std::is_same_v<PolicyTraits<recompute::Full>::Kind, policy_kind::Recompute>);
  static_assert(!parallel::PolicyTag<int>);
  static_assert(!parallel::PolicyTag<schedule::OneFOneB>);  // a schedule goes inside parallel::Pipeline<...>
  static_assert(!parallel::PolicyTag<zero::Stage<1>>);      // a ZeRO stage goes inside parallel::Data<...>
  CHECK(std::string_view(PolicyTraits<backend::Cpu>::kName) == "backend::Cpu");
  CHECK(std::string_view(parallel::Pipeline<schedule::Interleaved1F1B<12>>::kName) ==
        "parallel::Pipeline<schedule::Interleaved1F1B<12>>");
  CHECK(std::string_view(parallel::Data<zero::Stage<2>>::kName) == "parallel::Data<zero::Stage<2>>");
}

TEST_CASE("precision policies name their storage, compute, gradient and master types") {
  static_assert(std::is_same_v<precision::FP32::Param, float> && std::is_same_v<precision::FP32::Grad, float>);
  static_assert(!precision::kSeparateMaster<precision::FP32>);
  static_assert(std::is_same_v<precision::BF16Mixed::Param, bf16> &&
                std::is_same_v<precision::BF16Mixed::Compute, bf16>);
  static_assert(std::is_same_v<precision::BF16Mixed::Grad, float>);  // accumulated in f32
  static_assert(precision::kSeparateMaster<precision::BF16Mixed>);
  static_assert(!precision::BF16Mixed::kHasLossScale);
  using FP16 = precision::FP16Mixed<precision::DynamicLossScale>;
  static_assert(std::is_same_v<FP16::Param, f16> && std::is_same_v<FP16::Compute, f16> &&
                std::is_same_v<FP16::Grad, float> && std::is_same_v<FP16::Master, float>);  // f32 main grads
  static_assert(FP16::kHasLossScale && precision::LossScaler<FP16::LossScale>);
  static_assert(!precision::LossScaler<precision::NoLossScale> && !precision::LossScaler<void>);
  constexpr precision::DynamicLossScale::Config scale;
  CHECK(scale.initial_scale == 65536.0f);
  CHECK(scale.growth_factor == 2.0f);
  CHECK(scale.backoff_factor == 0.5f);
  CHECK(scale.growth_interval == 1000);
  CHECK(scale.hysteresis == 2);
  CHECK(scale.min_scale == 1.0f);
}

namespace {

// A user's layer as docs/design.md describes one: y = x * w elementwise over C = 1. Its Saved is
// empty (backward needs only x, which the caller passes again).
template <class T, class Backend>
struct ScaleLayer {
  struct Saved {
    std::size_t bytes() const { return 0; }
  };
  nn::Parameter<T> weight{"scale.weight", {1}, nn::Init::ones(), false};
  void forward(typename Backend::Context&, Saved&, T* out, const T* x, std::int64_t batch, std::int64_t seq) {
    for (std::int64_t i = 0; i < batch * seq; ++i) out[i] = x[i] * weight.value[0];
  }
  void backward(typename Backend::Context&, Saved&, T* dx, const T* dout, const T* x, std::int64_t batch,
                std::int64_t seq) {
    for (std::int64_t i = 0; i < batch * seq; ++i) {
      dx[i] = dout[i] * weight.value[0];
      weight.grad[0] += dout[i] * x[i];
    }
  }
  template <class Visit>
  void parameters(Visit&& visit) {
    visit(weight);
  }
};

struct EmptySaved {
  std::size_t bytes() const { return 0; }
};

struct NoForward {
  using Saved = EmptySaved;
  void backward(backend::Cpu::Context&, Saved&, float*, const float*, const float*, std::int64_t, std::int64_t) {}
  template <class Visit>
  void parameters(Visit&&) {}
};

// Forward and backward of the concept before Saved: where it keeps its activations the
// caller cannot see, so it is not a Layer (tests/compile_fail/layer_missing_saved.cpp).
struct NoSaved {
  void forward(backend::Cpu::Context&, float*, const float*, std::int64_t, std::int64_t) {}
  void backward(backend::Cpu::Context&, float*, const float*, const float*, std::int64_t, std::int64_t) {}
  template <class Visit>
  void parameters(Visit&&) {}
};

// A Saved without bytes() does not count.
struct SavedWithoutBytes {
  struct Saved {};
  void forward(backend::Cpu::Context&, Saved&, float*, const float*, std::int64_t, std::int64_t) {}
  void backward(backend::Cpu::Context&, Saved&, float*, const float*, const float*, std::int64_t, std::int64_t) {}
  template <class Visit>
  void parameters(Visit&&) {}
};

// A block that can drop its attention core's outputs.
struct Selective {
  using Saved = EmptySaved;
  void forward(backend::Cpu::Context&, Saved&, float*, const float*, std::int64_t, std::int64_t) {}
  void backward(backend::Cpu::Context&, Saved&, float*, const float*, const float*, std::int64_t, std::int64_t) {}
  template <class Visit>
  void parameters(Visit&&) {}
  void set_selective_recompute(bool) {}
};

}  // namespace

TEST_CASE("the Layer concept accepts a user layer and names what a type lacks") {
  static_assert(nn::Layer<ScaleLayer<float, backend::Cpu>, backend::Cpu>);
  static_assert(nn::Layer<ScaleLayer<double, backend::Cpu>, backend::Cpu, double>);
  static_assert(nn::check_layer<ScaleLayer<float, backend::Cpu>, backend::Cpu>());
  // A float layer is not a double layer.
  static_assert(!nn::HasLayerForward<ScaleLayer<float, backend::Cpu>, backend::Cpu, double>);
  static_assert(!nn::Layer<NoForward, backend::Cpu>);
  static_assert(!nn::HasLayerForward<NoForward, backend::Cpu>);
  static_assert(nn::HasSaved<NoForward> && nn::HasLayerBackward<NoForward, backend::Cpu> &&
                nn::HasParameters<NoForward>);
  static_assert(!nn::HasSaved<NoSaved> && !nn::Layer<NoSaved, backend::Cpu> && nn::HasParameters<NoSaved>);
  static_assert(!nn::HasSaved<SavedWithoutBytes> && !nn::Layer<SavedWithoutBytes, backend::Cpu>);
  static_assert(!nn::Layer<int, backend::Cpu>);
  // Selective recomputation is a block's option, not part of being a Layer.
  static_assert(nn::Layer<Selective, backend::Cpu> && nn::HasSelectiveRecompute<Selective>);
  static_assert(!nn::HasSelectiveRecompute<ScaleLayer<float, backend::Cpu>>);
  // GPT2Block is a Layer.
  static_assert(nn::check_layer<models::GPT2Block<float>, backend::Cpu>());

  ScaleLayer<float, backend::Cpu> layer;
  float w = 3.0f, dw = 0.0f;
  layer.weight.value = &w;
  layer.weight.grad = &dw;
  backend::Cpu::Context ctx;
  const float x[2] = {1.0f, 2.0f};
  float y[2] = {}, dy[2] = {1.0f, 1.0f}, dx[2] = {};
  ScaleLayer<float, backend::Cpu>::Saved saved;
  layer.forward(ctx, saved, y, x, 1, 2);
  layer.backward(ctx, saved, dx, dy, x, 1, 2);
  CHECK(y[1] == 6.0f);
  CHECK(dx[0] == 3.0f);
  CHECK(dw == 3.0f);
}
