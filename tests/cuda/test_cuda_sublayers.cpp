// The sub-layers (nn::SelfAttention, also grouped-query with rotary positions as Llama's,
// nn::Mlp over GELU, SwiGLU and GeGLU) on the CUDA
// backend against the same layers on the CPU backend: the same weights (drawn from the
// same seed and names), the same input and output gradient, one forward and backward;
// the outputs, input gradients and every parameter's gradient within the storage
// type's tolerance (float 1e-5 relative + 1e-4 of the largest value; bf16 2^-5 + 1e-2,
// check() says why). Exit codes: 0 pass, 1 failure, 77 no CUDA device.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "gpu_test.hpp"
#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/backend/cuda/backend.hpp"
#include "llmpar/nn/attention.hpp"
#include "llmpar/nn/mlp.hpp"
#include "llmpar/nn/parameter.hpp"

using namespace llmpar;
using gpu_test::failures;

namespace {

constexpr std::int64_t kB = 2, kS = 16, kC = 64;

template <class T, class Backend>
nn::SelfAttention<T, Backend> make(nn::SelfAttention<T, Backend>*) {
  return {"attn.qkv", "attn.proj", {.dim = kC, .heads = 4, .init_std = 0.2f, .out_init_std = 0.1f}};
}
// Llama's: grouped-query attention (8 query heads on 2 kv heads of 8 channels) with
// rotary positions (Llama 3.1's frequency scaling, context 8 so that it changes angles).
template <class T, class Backend>
nn::SelfAttention<T, Backend, nn::Rotary<Backend>> make(nn::SelfAttention<T, Backend, nn::Rotary<Backend>>*) {
  return {"attn.qkv",
          "attn.proj",
          {.dim = kC, .heads = 8, .kv_heads = 2, .bias = false, .init_std = 0.2f, .out_init_std = 0.1f},
          {},
          nn::Rotary<Backend>{{.theta = 10000.0f, .factor = 8.0f, .original_max_position = 8}}};
}
template <class T, class Backend, class Act>
nn::Mlp<T, Backend, Act> make(nn::Mlp<T, Backend, Act>*) {
  return {"mlp.up", "mlp.down", {.dim = kC, .hidden = 96, .init_std = 0.2f, .out_init_std = 0.1f}};
}

struct Run {
  std::vector<float> out, dx;
  std::vector<std::vector<float>> grads;
  std::vector<std::string> names;
};

// One forward and backward of Part<T, Backend> on x and dout (host vectors of kB·kS·kC).
template <template <class, class> class Part, class T, class Backend>
Run run(typename Backend::Context& ctx, const std::vector<T>& x, const std::vector<T>& dout) {
  using Space = typename Backend::Space;
  using Layer = Part<T, Backend>;
  Layer layer = make<T, Backend>(static_cast<Layer*>(nullptr));
  nn::ParameterStore<T, Space> store;
  store.bind(layer);
  store.initialize(5);
  const std::int64_t n = kB * kS * kC;
  Buffer<T, Space> dx_in(n), dout_in(n), out(n), dx(n);
  Space::copy_from_host(dx_in.data(), x.data(), n * sizeof(T));
  Space::copy_from_host(dout_in.data(), dout.data(), n * sizeof(T));
  typename Layer::Saved saved;
  layer.forward(ctx, saved, out.data(), dx_in.data(), kB, kS);
  layer.backward(ctx, saved, dx.data(), dout_in.data(), dx_in.data(), kB, kS);
  Backend::synchronize(ctx);
  auto host = [&](const T* p, std::int64_t count) {
    std::vector<T> h(static_cast<std::size_t>(count));
    Space::copy_to_host(h.data(), p, h.size() * sizeof(T));
    std::vector<float> f;
    for (const T& v : h) f.push_back(convert<float>(v));
    return f;
  };
  Run r{host(out.data(), n), host(dx.data(), n), {}, {}};
  for (const nn::Parameter<T>* p : store.parameters()) {
    std::vector<float> g(static_cast<std::size_t>(p->numel()));
    Space::copy_to_host(g.data(), p->grad, g.size() * sizeof(float));
    r.grads.push_back(g);
    r.names.push_back(p->name);
  }
  return r;
}

template <class T, class Backend>
using RotaryAttention = nn::SelfAttention<T, Backend, nn::Rotary<Backend>>;

template <class Act>
struct MlpOf {
  template <class T, class Backend>
  using type = nn::Mlp<T, Backend, Act>;
};

template <template <class, class> class Part, class T>
void check(backend::cuda::Context& gpu, const char* what) {
  backend::cpu::Context cpu;
  const std::int64_t n = kB * kS * kC;
  const std::vector<T> x = gpu_test::random_vector<T>(rng::Stream::named(8, "x"), n);
  const std::vector<T> dout = gpu_test::random_vector<T>(rng::Stream::named(8, "dout"), n);
  const Run want = run<Part, T, backend::Cpu>(cpu, x, dout);
  const Run got = run<Part, T, backend::Cuda>(gpu, x, dout);
  // float: cuBLASLt (strict fp32) and the attention kernel sum in other orders than
  // oneDNN and the CPU kernel. bf16: each part rounds to bf16 after each of its three
  // stages (2^-8 relative), differently summed values may round apart by an ulp at each,
  // and the gradients inherit that from the rounded intermediates.
  const gpu_test::Tolerance tol =
      std::is_same_v<T, float> ? gpu_test::Tolerance{1e-5, 1e-4} : gpu_test::Tolerance{1.0 / 32.0, 1e-2};
  const std::string name = std::string(what) + " " + gpu_test::type_name<T>();
  gpu_test::compare(got.out, want.out, tol, name + " out");
  gpu_test::compare(got.dx, want.dx, tol, name + " dx");
  for (std::size_t k = 0; k < want.grads.size(); ++k)
    gpu_test::compare(got.grads[k], want.grads[k], tol, name + " d" + want.names[k]);
  std::printf("%s: forward, backward and %zu parameter gradients match the CPU backend\n", name.c_str(),
              want.grads.size());
}

template <class T>
void check_type(backend::cuda::Context& gpu) {
  check<nn::SelfAttention, T>(gpu, "SelfAttention");
  check<RotaryAttention, T>(gpu, "SelfAttention<Rotary> GQA 8/2");
  check<MlpOf<nn::Gelu>::template type, T>(gpu, "Mlp<Gelu>");
  check<MlpOf<nn::SwiGlu>::template type, T>(gpu, "Mlp<SwiGlu>");
  check<MlpOf<nn::GeGlu>::template type, T>(gpu, "Mlp<GeGlu>");
}

}  // namespace

int main() {
  if (backend::cuda::device_count() == 0) {
    std::printf("skipped: no CUDA device\n");
    return gpu_test::kSkip;
  }
  return gpu_test::run_device_checks([] {
    backend::cuda::Context gpu(0);
    check_type<float>(gpu);
    check_type<bf16>(gpu);
  });
}
