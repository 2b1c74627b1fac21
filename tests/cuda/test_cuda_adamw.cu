// Multi-tensor AdamW on the device (kernels/adamw.cuh) against the CPU optimizer's parts.
//
// What each check proves:
//   - grad_norm_squared equals the sum over tensors of backend::cpu::sum_of_squares of
//     the same gradients to float rounding (1e-6 relative; both square and add in
//     double, in different groupings), and is bitwise identical when recomputed;
//   - step() applies backend::cpu::adamw_update (math::adamw_step) with the CPU
//     optimizer's clip factor grad_clip / (norm + 1e-6) times inv_loss_scale, per-tensor
//     weight decay and learning-rate scale (lr_scale, µP's), over tensors of ragged sizes (1, 0, 7, 4097, 2^20 + 3, so
//     chunks of one element, empty tensors and a partial last chunk), for three steps: master weights, m and v within
//     1e-5 relative + 1e-6 of the tensor's rms (the device contracts a * b + c into FMAs, the host does not); the clip
//     factor is recomputed here from the device's norm with the kernel's double arithmetic, so both sides use the same
//     scale;
//   - with bf16/f16 parameters the step writes param = P(master) exactly, within 1 ulp
//     of P(CPU master);
//   - G = f16 gradients scaled by 1024 and unscaled by inv_loss_scale = 1/1024;
//   - clipping active (max_norm below the norm), inactive (above) and disabled (0);
//   - an inf or a NaN in one gradient sets found_inf = 1 and leaves every master
//     weight, moment and parameter bitwise unchanged; a clean step afterwards runs;
//   - the plan and step() reject bad tensors and hyper-parameters with messages that
//     name the tensor or field and the fix, before any CUDA call (checked before the
//     no-device skip).
// And the optimizer the trainer builds, optim::AdamW<bf16, backend::Cuda> over a
// ParameterStore<bf16, memory::Device> of three ragged parameters, against the CPU's
// same optimizer over the CPU's kernel (the same model on the host), fed the same f32 main grads:
//   - after each of 3 steps (clipping active): the gradient norm within 1e-6 relative,
//     the f32 master weights and both moments within f32 rounding (count_far's 1e-5
//     relative + 1e-6 rms), the bf16 working copy the bf16 rounding of the device's
//     master bit for bit and within 1 ulp of the CPU's copy;
//   - an inf in one gradient: gradient_norm() reports finite = false on both backends,
//     step() reports skipped and leaves the working copy, masters and moments bitwise
//     unchanged and steps_taken() at 3; update() with that norm throws;
//   - loss scaling: gradients times 1024 with inv_loss_scale 1/1024 give the unscaled
//     run's norm and state bit for bit (a power of two scales every sum and product
//     exactly), and the CPU optimizer's state within f32 rounding;
//   - Backend::zero (backend::Cuda::zero, how zero_grad clears main grads) zeroes its n
//     elements in the compute stream's order and nothing past them.
// Exit codes: 0 pass, 1 failure, 77 no CUDA device (ctest reports that as skipped).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test.hpp"
#include "llmpar/backend/cpu/adamw.hpp"
#include "llmpar/backend/cpu/convert.hpp"
#include "llmpar/backend/cpu/reduce.hpp"
#include "llmpar/backend/cuda/backend.hpp"
#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/bits.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/kernels/adamw.cuh"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/optim/adamw.hpp"

// The model of the AdamW<bf16, backend::Cuda> checks, outside the anonymous namespace: nvcc flags a
// member template of an internal-linkage class that only a concept check
// (nn::HasParameters) instantiates as declared but never referenced.
namespace llmpar::gpu_test::adamw {

// Three parameters of ragged sizes: a decayed matrix over two chunks of the plan, at
// half the learning rate (a µP hidden matrix's lr_scale), a bias and a gain that are not
// decayed.
struct ThreeParameters {
  nn::Parameter<bf16> weight{"weight", Shape{300, 257}, nn::Init::normal(0.5f), true};
  nn::Parameter<bf16> bias{"bias", Shape{257}, nn::Init::normal(0.1f), false};
  nn::Parameter<bf16> gain{"gain", Shape{7}, nn::Init::ones(), false};

  ThreeParameters() { weight.lr_scale = 0.5f; }

  template <class Visit>
  void parameters(Visit&& visit) {
    visit(weight);
    visit(bias);
    visit(gain);
  }
};

}  // namespace llmpar::gpu_test::adamw

namespace {

using llmpar::bf16;
using llmpar::f16;
using llmpar::backend::cuda::DeviceBuffer;
namespace kernels = llmpar::kernels;
namespace cpu = llmpar::backend::cpu;
namespace math = llmpar::math;
namespace gpu_test = llmpar::gpu_test;

using gpu_test::copy_out;
using gpu_test::ErrorWording;
using gpu_test::expect;
using gpu_test::ExpectError;
using gpu_test::ordered;
using gpu_test::report;
using gpu_test::to_f;
using gpu_test::type_name;

constexpr ExpectError expect_error{ErrorWording::lacks};

// Elements of got farther from want than 1e-5 |want| + 1e-6 rms(want); prints a few.
// Vectors of different lengths are all wrong (and never read past the shorter).
std::int64_t count_far(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  if (got.size() != want.size()) {
    std::fprintf(stderr, "  %s: device has %zu elements, cpu %zu\n", what, got.size(), want.size());
    return static_cast<std::int64_t>(std::max(got.size(), want.size()));
  }
  double sum_sq = 0.0;
  for (float w : want) sum_sq += static_cast<double>(w) * w;
  const double rms = want.empty() ? 0.0 : std::sqrt(sum_sq / static_cast<double>(want.size()));
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double tolerance = 1e-5 * std::fabs(want[i]) + 1e-6 * rms;
    if (!(std::fabs(static_cast<double>(got[i]) - want[i]) <= tolerance) && ++bad <= 3)
      std::fprintf(stderr, "  %s[%zu]: device %.9g, cpu %.9g\n", what, i, got[i], want[i]);
  }
  return bad;
}

// ---------------------------------------------------------------------------------------
// Host-side checks: every one throws before any CUDA call, so they run without a device.
void host_checks() {
  float fake[64] = {};  // never dereferenced: each plan below is rejected before upload
  float* p = fake;
  const float* g = fake + 32;
  using Plan = kernels::AdamWPlan<float, float>;
  using Tensor = kernels::AdamWTensor<float, float>;
  auto plan_of = [](std::vector<Tensor> tensors) { return Plan(nullptr, tensors); };
  expect_error(
      [&] {
        plan_of({{p, nullptr, g, p + 8, p + 16, 4, true}, {nullptr, nullptr, g, p + 8, p + 16, 4, true}});
      },
      "AdamWPlan: tensor 1 has master == nullptr; pass its float master weights", "null master");
  expect_error(
      [&] {
        plan_of({{p, nullptr, g, p + 8, p + 16, -5, true}});
      },
      "AdamWPlan: tensor 0 has n = -5; element counts must be >= 0", "negative n");
  expect_error(
      [&] {
        plan_of({{p, nullptr, nullptr, p + 8, p + 16, 4, false}});
      },
      "AdamWPlan: tensor 0 has grad == nullptr", "null grad");
  expect_error(
      [&] {
        plan_of({{p, nullptr, g, nullptr, p + 16, 4, false}});
      },
      "AdamWPlan: tensor 0 has m == nullptr; pass its first-moment buffer", "null m");
  expect_error(
      [&] {
        plan_of({{p, nullptr, g, p + 8, nullptr, 4, false}});
      },
      "AdamWPlan: tensor 0 has v == nullptr; pass its second-moment buffer", "null v");
  expect_error(
      [&] {
        plan_of({{p, p + 24, g, p + 8, p + 16, 4, false}});
      },
      "AdamWPlan: tensor 0 has param != nullptr, but the parameter type is float", "float param given");
  expect_error(
      [&] {
        plan_of({{p, nullptr, g, p + 8, p + 8, 4, false}});
      },
      "AdamWPlan: tensor 0 passes the same buffer twice among master, m and v", "m == v");
  {
    using Tensor16 = kernels::AdamWTensor<bf16, bf16>;
    std::vector<Tensor16> tensors = {{p, nullptr, reinterpret_cast<const bf16*>(g), p + 8, p + 16, 4, true}};
    expect_error([&] { kernels::AdamWPlan<bf16, bf16>(nullptr, tensors); },
                 "AdamWPlan: tensor 0 has param == nullptr, but the parameter type is 16-bit", "bf16 param missing");
  }

  // A plan without elements makes no CUDA call, so step()'s checks can run here.
  const Plan empty = plan_of({{nullptr, nullptr, nullptr, nullptr, nullptr, 0, true}});
  expect(empty.num_tensors() == 1 && empty.num_chunks() == 0 && empty.workspace_floats() == 0,
         "a plan of empty tensors has no chunks and needs no workspace");
  int flag = 0;
  const math::AdamWParams good{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
  math::AdamWParams bad_lr = good;
  bad_lr.lr = -1.0f;
  math::AdamWParams bad_beta2 = good;
  bad_beta2.beta2 = 1.0f;
  expect_error([&] { empty.step(nullptr, bad_lr, 1, p, 1.0f, 1.0f, &flag); }, "AdamW lr is -1", "negative lr");
  expect_error([&] { empty.step(nullptr, bad_beta2, 1, p, 1.0f, 1.0f, &flag); },
               "AdamW beta2 is 1; it must be in [0, 1)", "beta2 = 1");
  expect_error([&] { empty.step(nullptr, good, 0, p, 1.0f, 1.0f, &flag); }, "AdamW step is 0; steps count from 1",
               "step 0");
  expect_error([&] { empty.step(nullptr, good, 1, p, 0.0f, 1.0f, &flag); },
               "AdamWPlan::step: inv_loss_scale is 0; it must be finite and > 0", "inv_loss_scale 0");
  expect_error([&] { empty.step(nullptr, good, 1, p, std::numeric_limits<float>::infinity(), 1.0f, &flag); },
               "AdamWPlan::step: inv_loss_scale is inf", "inv_loss_scale inf");
  expect_error([&] { empty.step(nullptr, good, 1, p, 1.0f, -1.0f, &flag); },
               "AdamWPlan::step: max_norm is -1; use a finite norm > 0, or 0 to disable clipping", "max_norm < 0");
  expect_error([&] { empty.step(nullptr, good, 1, nullptr, 1.0f, 1.0f, &flag); }, "AdamWPlan::step: norm_sq is nullptr",
               "null norm_sq");
  expect_error([&] { empty.step(nullptr, good, 1, p, 1.0f, 1.0f, nullptr); }, "AdamWPlan::step: found_inf is nullptr",
               "null found_inf");
  expect_error([&] { empty.grad_norm_squared(nullptr, nullptr, p); },
               "AdamWPlan::grad_norm_squared: norm_sq is nullptr", "grad_norm_squared without norm_sq");
}

// ---------------------------------------------------------------------------------------
// Device checks.

// One tensor's device buffers and the CPU optimizer's copy of its state.
template <class G, class P>
struct TensorState {
  std::int64_t n = 0;
  bool decay = false;
  float lr_scale = 1.0f;  // every third tensor at a quarter of the rate (µP's hidden matrices)
  DeviceBuffer<float> master, m, v;
  DeviceBuffer<P> param;  // empty when P is float
  DeviceBuffer<G> grad;
  std::vector<float> cpu_master, cpu_m, cpu_v;  // backend::cpu::adamw_update's state
  std::vector<float> grad_values;               // the float values of the current G gradients
};

const math::AdamWParams kHp{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};

template <class G, class P>
class Harness {
 public:
  Harness(cudaStream_t stream, const std::vector<std::int64_t>& sizes, std::uint64_t seed)
      : stream_(stream), norm_sq_(1, stream), found_inf_(1, stream) {
    std::vector<kernels::AdamWTensor<G, P>> table;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      auto& t = tensors_.emplace_back();
      t.n = sizes[i];
      t.decay = i % 2 == 0;
      t.lr_scale = i % 3 == 1 ? 0.25f : 1.0f;
      t.master = DeviceBuffer<float>(t.n, stream);
      t.m = DeviceBuffer<float>(t.n, stream);
      t.v = DeviceBuffer<float>(t.n, stream);
      t.grad = DeviceBuffer<G>(t.n, stream);
      const llmpar::rng::Stream random(seed * 1000 + i);
      t.cpu_master.resize(t.n);
      for (std::int64_t k = 0; k < t.n; ++k) t.cpu_master[k] = static_cast<float>(0.5 * random.normal(k));
      t.cpu_m.assign(t.n, 0.0f);
      t.cpu_v.assign(t.n, 0.0f);
      t.master.upload(t.cpu_master);
      t.m.upload(t.cpu_m);
      t.v.upload(t.cpu_v);
      P* param = nullptr;
      if constexpr (!std::is_same_v<P, float>) {
        t.param = DeviceBuffer<P>(t.n, stream);
        std::vector<P> rounded(t.n);
        for (std::int64_t k = 0; k < t.n; ++k) rounded[k] = llmpar::convert<P>(t.cpu_master[k]);
        t.param.upload(rounded);
        param = t.param.data();
      }
      table.push_back({t.master.data(), param, t.grad.data(), t.m.data(), t.v.data(), t.n, t.decay, t.lr_scale});
    }
    plan_.emplace(stream, table);
    workspace_ = DeviceBuffer<float>(plan_->workspace_floats(), stream);
  }

  const kernels::AdamWPlan<G, P>& plan() const { return *plan_; }

  // New gradients: loss_scale * std * N(0, 1), stored as G; `poison` replaces one element.
  void set_grads(std::uint64_t seed, double std_dev, float loss_scale, std::size_t poison_tensor = ~std::size_t{0},
                 std::int64_t poison_index = 0, float poison = 0.0f) {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      auto& t = tensors_[i];
      const llmpar::rng::Stream random(seed * 1000 + i);
      std::vector<G> stored(t.n);
      t.grad_values.resize(t.n);
      for (std::int64_t k = 0; k < t.n; ++k) {
        stored[k] = llmpar::convert<G>(static_cast<float>(loss_scale * std_dev * random.normal(k)));
        if (i == poison_tensor && k == poison_index) stored[k] = llmpar::convert<G>(poison);
        t.grad_values[k] = to_f(stored[k]);
      }
      t.grad.upload(stored);
    }
  }

  // The device's norm^2 (computed twice: the two must be bitwise equal).
  float device_norm_sq(bool* deterministic) {
    plan_->grad_norm_squared(stream_, norm_sq_.data(), workspace_.data());
    const float first = copy_out(norm_sq_.data(), 1, stream_)[0];
    plan_->grad_norm_squared(stream_, norm_sq_.data(), workspace_.data());
    const float second = copy_out(norm_sq_.data(), 1, stream_)[0];
    *deterministic = llmpar::bits::of(first) == llmpar::bits::of(second);
    return second;
  }

  double cpu_norm_sq() const {
    double total = 0.0;
    for (const auto& t : tensors_) total += cpu::sum_of_squares(t.grad_values.data(), t.n);
    return total;
  }

  // The device step; returns found_inf.
  int device_step(int step, float inv_loss_scale, float max_norm) {
    LLMPAR_CHECK_CUDA(cudaMemsetAsync(found_inf_.data(), 0, sizeof(int), stream_));
    plan_->step(stream_, kHp, step, norm_sq_.data(), inv_loss_scale, max_norm, found_inf_.data());
    return copy_out(found_inf_.data(), 1, stream_)[0];
  }

  // The CPU step with the scale the kernel derives from the device's norm^2.
  void cpu_step(int step, float norm_sq, float inv_loss_scale, float max_norm, bool* clipped) {
    const double norm = std::sqrt(static_cast<double>(norm_sq)) * static_cast<double>(inv_loss_scale);
    const double clip =
        (max_norm > 0.0f && norm > static_cast<double>(max_norm)) ? static_cast<double>(max_norm) / (norm + 1e-6) : 1.0;
    *clipped = clip < 1.0;
    const float scale = static_cast<float>(static_cast<double>(inv_loss_scale) * clip);
    for (auto& t : tensors_) {
      math::AdamWParams hp = kHp;
      if (!t.decay) hp.weight_decay = 0.0f;
      hp.lr *= t.lr_scale;
      cpu::adamw_update(t.cpu_master.data(), t.cpu_m.data(), t.cpu_v.data(), t.grad_values.data(), t.n, hp, step,
                        scale);
    }
  }

  // Compares the device state with the CPU's; returns the number of bad elements.
  std::int64_t compare() {
    std::int64_t bad = 0;
    for (auto& t : tensors_) {
      const std::vector<float> master = copy_out(t.master.data(), t.n, stream_);
      bad += count_far(master, t.cpu_master, "master");
      bad += count_far(copy_out(t.m.data(), t.n, stream_), t.cpu_m, "m");
      bad += count_far(copy_out(t.v.data(), t.n, stream_), t.cpu_v, "v");
      if constexpr (!std::is_same_v<P, float>) {
        const std::vector<P> param = copy_out(t.param.data(), t.n, stream_);
        for (std::int64_t k = 0; k < t.n; ++k) {
          const bool exact = ordered(param[k]) == ordered(llmpar::convert<P>(master[k]));
          const bool near = std::llabs(ordered(param[k]) - ordered(llmpar::convert<P>(t.cpu_master[k]))) <= 1;
          if (!(exact && near) && ++bad <= 3)
            std::fprintf(stderr, "  param[%lld]: %.9g, P(device master) %.9g, P(cpu master) %.9g\n",
                         static_cast<long long>(k), to_f(param[k]), to_f(llmpar::convert<P>(master[k])),
                         to_f(llmpar::convert<P>(t.cpu_master[k])));
        }
      }
    }
    return bad;
  }

  // Every byte of device state, to prove a skipped step changed nothing.
  std::vector<std::vector<std::uint8_t>> snapshot() {
    std::vector<std::vector<std::uint8_t>> bytes;
    auto grab = [&](const void* data, std::size_t size) {
      std::vector<std::uint8_t> b(size);
      if (size) LLMPAR_CHECK_CUDA(cudaMemcpyAsync(b.data(), data, size, cudaMemcpyDeviceToHost, stream_));
      bytes.push_back(std::move(b));
    };
    for (auto& t : tensors_) {
      grab(t.master.data(), t.master.bytes());
      grab(t.m.data(), t.m.bytes());
      grab(t.v.data(), t.v.bytes());
      grab(t.param.data(), t.param.bytes());
    }
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream_));
    return bytes;
  }

 private:
  cudaStream_t stream_;
  std::vector<TensorState<G, P>> tensors_;
  std::optional<kernels::AdamWPlan<G, P>> plan_;
  DeviceBuffer<float> workspace_;
  DeviceBuffer<float> norm_sq_;
  DeviceBuffer<int> found_inf_;
};

const std::vector<std::int64_t> kSizes = {1, 0, 7, 4097, (std::int64_t{1} << 20) + 3};
// Chunks of 65536: 1 + 0 + 1 + 1 + 17.
constexpr std::int64_t kExpectedChunks = 20;

enum class Clip { active, inactive, disabled };

// Three steps of fresh gradients: the device against the CPU after each.
template <class G, class P>
void check_steps(cudaStream_t stream, Clip clip, float loss_scale) {
  Harness<G, P> h(stream, kSizes, 7);
  const double grad_std = 0.01;  // norm ~ 0.01 * sqrt(1.05e6) ~ 10
  const float max_norm = clip == Clip::active ? 1.0f : clip == Clip::inactive ? 1000.0f : 0.0f;
  const float inv_loss_scale = 1.0f / loss_scale;
  bool ok = h.plan().num_chunks() == kExpectedChunks && h.plan().workspace_floats() == 2 * kExpectedChunks;
  std::string detail;
  for (int step = 1; step <= 3; ++step) {
    h.set_grads(100 + step, grad_std, loss_scale);
    bool deterministic = false;
    const float norm_sq = h.device_norm_sq(&deterministic);
    const double want_norm_sq = h.cpu_norm_sq();
    const bool norm_ok = std::fabs(static_cast<double>(norm_sq) - want_norm_sq) <= 1e-6 * want_norm_sq;
    const int found_inf = h.device_step(step, inv_loss_scale, max_norm);
    bool clipped = false;
    h.cpu_step(step, norm_sq, inv_loss_scale, max_norm, &clipped);
    const std::int64_t bad = h.compare();
    const bool clip_as_asked = clipped == (clip == Clip::active);
    ok = ok && norm_ok && deterministic && found_inf == 0 && bad == 0 && clip_as_asked;
    detail += " step " + std::to_string(step) + ": norm " + std::to_string(std::sqrt(norm_sq) / loss_scale) +
              (norm_ok ? "" : " (NORM MISMATCH)") + (deterministic ? "" : " (NORM NOT DETERMINISTIC)") +
              (clipped ? " clipped" : "") + (clip_as_asked ? "" : " (CLIP STATE WRONG)") +
              (found_inf ? " (FOUND_INF SET)" : "") + ", " + std::to_string(bad) + " bad;";
  }
  const char* clip_name = clip == Clip::active ? "clip active" : clip == Clip::inactive ? "clip inactive" : "no clip";
  report(ok, std::string("adamw G=") + type_name<G>() + " P=" + type_name<P>() + " loss scale " +
                 std::to_string(static_cast<int>(loss_scale)) + ", " + clip_name + ":" + detail);
}

// One inf (or NaN) gradient: found_inf is set and nothing changes; a clean step then runs.
template <class G, class P>
void check_non_finite(cudaStream_t stream, float poison, const char* poison_name) {
  Harness<G, P> h(stream, kSizes, 9);
  const float loss_scale = std::is_same_v<G, f16> ? 1024.0f : 1.0f;
  h.set_grads(200, 0.01, loss_scale);
  bool deterministic = false;
  float norm_sq = h.device_norm_sq(&deterministic);
  bool ok = h.device_step(1, 1.0f / loss_scale, 1.0f) == 0;
  bool clipped = false;
  h.cpu_step(1, norm_sq, 1.0f / loss_scale, 1.0f, &clipped);

  const auto before = h.snapshot();
  h.set_grads(201, 0.01, loss_scale, /*poison_tensor=*/3, /*poison_index=*/4000, poison);
  norm_sq = h.device_norm_sq(&deterministic);
  const bool norm_non_finite = !std::isfinite(norm_sq);
  const int found_inf = h.device_step(2, 1.0f / loss_scale, 1.0f);
  const bool unchanged = h.snapshot() == before;
  ok = ok && norm_non_finite && found_inf == 1 && unchanged;

  // The loss scaler skips the step; the next clean step still matches the CPU.
  h.set_grads(202, 0.01, loss_scale);
  norm_sq = h.device_norm_sq(&deterministic);
  const int found_after = h.device_step(2, 1.0f / loss_scale, 1.0f);
  h.cpu_step(2, norm_sq, 1.0f / loss_scale, 1.0f, &clipped);
  const std::int64_t bad = h.compare();
  ok = ok && found_after == 0 && bad == 0;
  report(ok, std::string("adamw G=") + type_name<G>() + " P=" + type_name<P>() + " one " + poison_name +
                 " gradient: norm^2 " + (norm_non_finite ? "non-finite" : "FINITE") + ", found_inf " +
                 std::to_string(found_inf) + ", state " + (unchanged ? "bitwise unchanged" : "CHANGED") +
                 "; next clean step " + (found_after == 0 && bad == 0 ? "matches cpu" : "WRONG"));
}

// ---------------------------------------------------------------------------------------
// optim::AdamW<bf16, backend::Cuda> against the same optimizer over the CPU's kernel:
// one optimizer class, its update on each backend's kernel.

namespace nn = llmpar::nn;
namespace optim = llmpar::optim;
namespace cuda = llmpar::backend::cuda;

// The CPU backend's part of the optimizer (its AdamW kernel, zero, convert, sum of
// squares), as backend::Cpu has it: backend::Cpu itself cannot be compiled by nvcc (its
// GEMMs include oneDNN's headers, tests/cuda/cpu_gemm.hpp), and the optimizer needs no
// more of it than this.
struct HostOptimizerBackend {
  struct Context {};
  using Space = llmpar::memory::Host;
  template <class T>
  using AdamWKernel = cpu::AdamWKernel<T>;
  template <class T>
  static void zero(Context&, T* p, std::int64_t n) {
    std::fill(p, p + n, T{});
  }
  template <class To, class From>
  static void convert(Context&, To* dst, const From* src, std::int64_t n) {
    cpu::convert(dst, src, n);
  }
  template <class G>
  static double sum_of_squares(Context&, const G* x, std::int64_t n) {
    return cpu::sum_of_squares(x, n);
  }
};
using HostAdamW = optim::AdamW<bf16, HostOptimizerBackend>;

using llmpar::gpu_test::adamw::ThreeParameters;

void to_device(float* device, const std::vector<float>& host, cudaStream_t stream) {
  LLMPAR_CHECK_CUDA(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream));
}

// The same model on both backends, each with its optimizer.
class OptimizerPair {
 public:
  static constexpr std::uint64_t kSeed = 31;

  OptimizerPair(cuda::Context& ctx, const optim::AdamWConfig& cfg) : ctx_(ctx) {
    host_store_.bind(host_model_);
    host_store_.initialize(kSeed);
    device_store_.bind(device_model_);
    device_store_.initialize(kSeed);
    host_opt_.emplace(host_ctx_, host_store_, cfg);
    device_opt_.emplace(ctx, device_store_, cfg);
  }

  std::int64_t flat_size() const { return host_store_.flat_size(); }
  HostAdamW& host() { return *host_opt_; }
  optim::AdamW<bf16, llmpar::backend::Cuda>& device() { return *device_opt_; }

  // The flat f32 main grads of step `seed`: scale * 0.01 * N(0, 1) per parameter element,
  // padding 0; with `poisoned`, element 1000 of the weight is `poison` instead.
  std::vector<float> gradients(std::uint64_t seed, float scale, float poison = 0.0f, bool poisoned = false) const {
    std::vector<float> flat(static_cast<std::size_t>(flat_size()), 0.0f);
    for (const nn::Parameter<bf16>* p : host_store_.parameters()) {
      const std::int64_t offset = p->grad - host_store_.grads();
      const auto random = llmpar::rng::Stream::named(seed, p->name);
      for (std::int64_t i = 0; i < p->numel(); ++i)
        flat[offset + i] = scale * static_cast<float>(0.01 * random.normal(static_cast<std::uint64_t>(i)));
    }
    if (poisoned) flat[1000] = poison;
    return flat;
  }

  void set_gradients(const std::vector<float>& flat) {
    std::copy(flat.begin(), flat.end(), host_store_.grads());
    to_device(device_store_.grads(), flat, ctx_.stream());
  }

  // The device optimizer's state: the working copy (the store's flat value buffer,
  // flat_size() elements, each parameter at its 64-byte-aligned offset, zero padding
  // between), and the masters, m and v, which optim::AdamW lays out on either backend:
  // segment after segment, without padding (numel() elements). The first H200 run read
  // flat_size() elements of those too: 76 floats past the end of each allocation, which
  // cudaMemcpyAsync refused (cudaErrorInvalidValue).
  struct DeviceState {
    std::vector<bf16> values;
    std::vector<float> master, m, v;
    bool operator==(const DeviceState& o) const {
      return gpu_test::same_bits(values, o.values) && gpu_test::same_bits(master, o.master) &&
             gpu_test::same_bits(m, o.m) && gpu_test::same_bits(v, o.v);
    }
  };
  DeviceState device_state() {
    const cudaStream_t stream = ctx_.stream();
    optim::AdamW<bf16, llmpar::backend::Cuda>& opt = *device_opt_;
    return {copy_out(device_store_.values(), flat_size(), stream),
            copy_out(opt.master_weights().data(), opt.master_weights().size(), stream),
            copy_out(opt.first_moment().data(), opt.first_moment().size(), stream),
            copy_out(opt.second_moment().data(), opt.second_moment().size(), stream)};
  }

  // Elements where the device's state is farther from the CPU's than f32 rounding, or its
  // working copy is not P(device master) bit for bit, or is more than 1 ulp from the
  // CPU's working copy, or the padding between parameters is not zero.
  std::int64_t differences() {
    const DeviceState d = device_state();
    HostAdamW& h = *host_opt_;
    const auto host_vector = [&](const llmpar::Buffer<float>& b) { return std::vector<float>(b.begin(), b.end()); };
    std::int64_t bad = count_far(d.master, host_vector(h.master_weights()), "master");
    bad += count_far(d.m, host_vector(h.first_moment()), "m");
    bad += count_far(d.v, host_vector(h.second_moment()), "v");
    if (d.master.size() != static_cast<std::size_t>(host_store_.numel())) return bad + 1;
    // Walk the parameters: element e of the k-th is at its offset in the flat value
    // buffers and at state + e in the masters.
    std::vector<bool> in_parameter(static_cast<std::size_t>(flat_size()), false);
    std::int64_t state = 0;
    for (const nn::Parameter<bf16>* p : host_store_.parameters()) {
      const std::int64_t offset = p->value - host_store_.values();
      for (std::int64_t e = 0; e < p->numel(); ++e) {
        const auto i = static_cast<std::size_t>(offset + e), s = static_cast<std::size_t>(state + e);
        in_parameter[i] = true;
        const bf16 own = llmpar::convert<bf16>(d.master[s]);
        const bf16 cpu_value = host_store_.values()[i];
        const bool exact = ordered(d.values[i]) == ordered(own);
        const bool near = std::llabs(ordered(d.values[i]) - ordered(cpu_value)) <= 1;
        const bool cpu_exact = ordered(cpu_value) == ordered(llmpar::convert<bf16>(h.master_weights()[s]));
        if (!(exact && near && cpu_exact) && ++bad <= 3)
          std::fprintf(stderr, "  %s[%lld]: device %.9g, bf16(device master) %.9g, cpu %.9g\n", p->name.c_str(),
                       static_cast<long long>(e), to_f(d.values[i]), to_f(own), to_f(cpu_value));
      }
      state += p->numel();
    }
    for (std::size_t i = 0; i < in_parameter.size(); ++i)
      if (!in_parameter[i] && to_f(d.values[i]) != 0.0f && ++bad <= 3)
        std::fprintf(stderr, "  padding value[%zu] is %.9g, not 0\n", i, to_f(d.values[i]));
    return bad;
  }

 private:
  cuda::Context& ctx_;
  HostOptimizerBackend::Context host_ctx_;
  ThreeParameters host_model_, device_model_;
  nn::ParameterStore<bf16> host_store_;
  nn::ParameterStore<bf16, llmpar::memory::Device> device_store_;
  std::optional<HostAdamW> host_opt_;
  std::optional<optim::AdamW<bf16, llmpar::backend::Cuda>> device_opt_;
};

constexpr float kLr = 1e-3f;
constexpr int kSteps = 3;

// Three steps, then an inf gradient (skipped), on both backends; then the same three
// steps with the gradients scaled by 1024 and unscaled by inv_loss_scale.
void check_cuda_optimizer(cuda::Context& ctx) {
  const optim::AdamWConfig cfg;  // grad_clip 1: the norms below (~3) are clipped
  OptimizerPair pair(ctx, cfg);
  std::vector<double> norms;
  bool ok = true;
  std::string detail;
  for (int step = 1; step <= kSteps; ++step) {
    pair.set_gradients(pair.gradients(static_cast<std::uint64_t>(step), 1.0f));
    const optim::StepResult on_cpu = pair.host().step(kLr);
    const optim::StepResult on_gpu = pair.device().step(kLr);
    norms.push_back(on_gpu.grad_norm);
    const bool norm_ok = std::fabs(on_gpu.grad_norm - on_cpu.grad_norm) <= 1e-6 * on_cpu.grad_norm;
    const std::int64_t bad = pair.differences();
    ok = ok && norm_ok && !on_cpu.skipped && !on_gpu.skipped && bad == 0;
    detail += " step " + std::to_string(step) + ": norm " + std::to_string(on_gpu.grad_norm) +
              (norm_ok ? "" : " (cpu " + std::to_string(on_cpu.grad_norm) + ")") + (on_gpu.skipped ? " SKIPPED" : "") +
              ", " + std::to_string(bad) + " bad;";
  }
  ok = ok && pair.device().steps_taken() == kSteps && pair.host().steps_taken() == kSteps;
  report(ok, "AdamW<bf16> on the GPU vs on the CPU, 3 parameters, clip active:" + detail);

  // An inf gradient: reported, skipped, nothing changes.
  const float inf = std::numeric_limits<float>::infinity();
  pair.set_gradients(pair.gradients(4, 1.0f, inf, true));
  const auto before = pair.device_state();
  const optim::GradNorm cpu_norm = pair.host().gradient_norm();
  const optim::GradNorm gpu_norm = pair.device().gradient_norm();
  const optim::StepResult skipped = pair.device().step(kLr);
  const optim::StepResult cpu_skipped = pair.host().step(kLr);
  const bool unchanged = pair.device_state() == before;
  const bool still = pair.device().steps_taken() == kSteps && pair.host().steps_taken() == kSteps;
  report(!cpu_norm.finite && !gpu_norm.finite && skipped.skipped && cpu_skipped.skipped && unchanged && still &&
             pair.differences() == 0,
         std::string("AdamW<bf16> on the GPU, one inf gradient: gradient_norm finite=") +
             (gpu_norm.finite ? "true" : "false") + " (cpu " + (cpu_norm.finite ? "true" : "false") + "), step " +
             (skipped.skipped ? "skipped" : "TAKEN") + ", state " + (unchanged ? "bitwise unchanged" : "CHANGED") +
             ", steps_taken " + std::to_string(pair.device().steps_taken()));
  expect_error([&] { pair.device().update(kLr, gpu_norm); }, "AdamW::update with a non-finite gradient norm",
               "AdamW::update on the GPU after a non-finite norm");

  // Loss scaling: 1024 G with inv_loss_scale 1/1024 is the unscaled run, bit for bit.
  OptimizerPair scaled(ctx, cfg);
  const float loss_scale = 1024.0f, inv_loss_scale = 1.0f / loss_scale;
  bool norms_equal = true;
  std::int64_t bad = 0;
  for (int step = 1; step <= kSteps; ++step) {
    scaled.set_gradients(scaled.gradients(static_cast<std::uint64_t>(step), loss_scale));
    scaled.host().step(kLr, inv_loss_scale);
    const optim::StepResult on_gpu = scaled.device().step(kLr, inv_loss_scale);
    norms_equal = norms_equal && !on_gpu.skipped && on_gpu.grad_norm == norms[static_cast<std::size_t>(step - 1)];
    bad += scaled.differences();
  }
  const bool same_as_unscaled = scaled.device_state() == pair.device_state();
  report(norms_equal && same_as_unscaled && bad == 0,
         std::string("AdamW<bf16> on the GPU, gradients x1024, inv_loss_scale 1/1024, 3 steps: norms ") +
             (norms_equal ? "equal to" : "DIFFERENT from") + " the unscaled run's, state " +
             (same_as_unscaled ? "bitwise equal to" : "DIFFERENT from") + " the unscaled run's, " +
             std::to_string(bad) + " elements off the cpu");
}

// backend::Cuda::zero: n elements zeroed after the stream's earlier work (an upload
// queued just before, not waited for), none past them.
void check_backend_zero(cuda::Context& ctx) {
  const cudaStream_t stream = ctx.stream();
  const std::int64_t total = 5000, n = 4099;
  std::vector<float> ones(static_cast<std::size_t>(total), 1.0f);
  DeviceBuffer<float> buffer(static_cast<std::size_t>(total), stream);
  LLMPAR_CHECK_CUDA(cudaMemcpyAsync(buffer.data(), ones.data(), buffer.bytes(), cudaMemcpyHostToDevice, stream));
  llmpar::backend::Cuda::zero(ctx, buffer.data(), n);
  llmpar::backend::Cuda::zero(ctx, buffer.data(), 0);  // nothing to do
  const std::vector<float> got = copy_out(buffer.data(), total, stream);
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < total; ++i)
    if (got[static_cast<std::size_t>(i)] != (i < n ? 0.0f : 1.0f)) ++bad;
  report(bad == 0, "Backend::zero (cuda) of 4099 of 5000 floats on the compute stream: " + std::to_string(bad) +
                       " elements wrong");
}

}  // namespace

int main() {
  // Lines in the order they happen, stdout and stderr alike, when both go to one log.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (!gpu_test::run_host_checks(host_checks, "host checks")) return 1;
  if (llmpar::backend::cuda::device_count() == 0) {
    std::printf("host checks %s; skipped the device checks: no CUDA device\n", gpu_test::verdict());
    return gpu_test::skip_exit_code();
  }
  return gpu_test::run_device_checks([] {
    llmpar::backend::cuda::DeviceContext context(0);
    const cudaStream_t stream = context.compute();
    for (const Clip clip : {Clip::active, Clip::inactive, Clip::disabled})
      check_steps<float, float>(stream, clip, 1.0f);
    for (const Clip clip : {Clip::active, Clip::inactive}) check_steps<bf16, bf16>(stream, clip, 1.0f);
    for (const Clip clip : {Clip::active, Clip::inactive}) check_steps<f16, f16>(stream, clip, 1024.0f);
    check_steps<f16, float>(stream, Clip::active, 1024.0f);
    check_steps<float, bf16>(stream, Clip::active, 1.0f);
    const float inf = std::numeric_limits<float>::infinity();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    check_non_finite<float, float>(stream, inf, "inf");
    check_non_finite<float, float>(stream, nan, "NaN");
    check_non_finite<bf16, bf16>(stream, -inf, "-inf");
    check_non_finite<bf16, bf16>(stream, nan, "NaN");
    check_non_finite<f16, f16>(stream, 1e6f, "f16-overflow (inf)");
    check_non_finite<f16, f16>(stream, nan, "NaN");
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream));

    llmpar::backend::cuda::Context ctx(0);
    check_cuda_optimizer(ctx);
    check_backend_zero(ctx);
  });
}
