// llmpar/nn/parameter.hpp — parameters, the one visitor interface, and their storage.
//
// A layer declares its parameters (name, shape, how to initialise, whether weight
// decay applies) and exposes them through one call, `parameters(visit)`. Everything
// that must touch every parameter — allocation, initialisation, the optimizer, gradient
// clipping, checkpoints, and later ZeRO sharding and precision casts — goes through
// that call, so a user's layer needs no per-feature code.
//
// ParameterStore gives all parameters of a model one contiguous value buffer and one
// contiguous gradient buffer (like llm.c and DeepSpeed's flat buffers): zeroing the
// gradients is one memset, the gradient norm one pass, the optimizer one stream over
// memory, and a data-parallel all-reduce or a ZeRO shard is a slice of one array.
//
// Initial values come from the counter-based RNG keyed by (seed, parameter name) and
// indexed by the element's position in the full tensor, so a rank that will hold only
// a slice computes the very values the serial model has there.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/core/tensor.hpp"

namespace llmpar::nn {

// How a parameter starts: zeros, ones, or normal(0, std).
struct Init {
  enum class Kind : std::uint8_t { zeros, ones, normal };
  Kind kind = Kind::zeros;
  float std = 0.0f;

  static constexpr Init zeros() { return {Kind::zeros, 0.0f}; }
  static constexpr Init ones() { return {Kind::ones, 0.0f}; }
  static constexpr Init normal(float s) { return {Kind::normal, s}; }
};

template <class T>
struct Parameter {
  std::string name;  // unique within a model, e.g. "h.3.attn.qkv.weight"
  Shape shape;       // of the full (unsplit) tensor
  Init init;
  bool decay = false;  // weight decay applies (matrices yes; biases and norm gains no)
  T* value = nullptr;  // bound by ParameterStore
  T* grad = nullptr;

  Parameter() = default;
  Parameter(std::string n, Shape s, Init i, bool d) : name(std::move(n)), shape(s), init(i), decay(d) {}
  std::int64_t numel() const { return shape.numel(); }
};

// A type whose parameters can be visited: `l.parameters(visit)` calls visit(Parameter&)
// once per parameter, in a fixed order.
namespace detail {
// A visitor that does nothing (a named type: nvcc's front end rejects a lambda here).
template <class T>
struct IgnoreParameter {
  void operator()(Parameter<T>&) const {}
};
}  // namespace detail

template <class L, class T = float>
concept HasParameters = requires(L& layer, detail::IgnoreParameter<T> visit) { layer.parameters(visit); };

// Space is where the flat buffers live: memory::Host for the CPU backend,
// memory::Device for the CUDA one (initial values are computed on the host and copied).
template <class T, class Space = memory::Host>
class ParameterStore {
 public:
  ParameterStore() = default;
  ParameterStore(const ParameterStore&) = delete;
  ParameterStore& operator=(const ParameterStore&) = delete;

  // Lays out every parameter of `model` in the flat buffers and points it there. The
  // model must not move afterwards (models holding a store are immovable).
  template <class Model>
  requires HasParameters<Model, T>
  void bind(Model& model) {
    params_.clear();
    std::unordered_set<std::string> names;
    std::int64_t total = 0;
    model.parameters([&](Parameter<T>& p) {
      LLMPAR_CHECK(names.insert(p.name).second, "parameter name '", p.name,
                   "' appears twice; every parameter of a model needs a unique name");
      params_.push_back(&p);
      total += round_up(p.numel());
    });
    values_.resize(total);
    grads_.resize(total);
    values_.zero();
    grads_.zero();
    std::int64_t offset = 0;
    for (Parameter<T>* p : params_) {
      p->value = values_.data() + offset;
      p->grad = grads_.data() + offset;
      offset += round_up(p->numel());
    }
  }

  // Every parameter from its own stream: value[i] = init(seed, name, i).
  void initialize(std::uint64_t seed) {
    for (Parameter<T>* p : params_) initialize(*p, seed);
  }
  static void initialize(Parameter<T>& p, std::uint64_t seed) {
    if constexpr (Space::kHostAccessible) {
      initial_values(p, seed, p.value);
    } else {
      Buffer<T> staging(p.numel());
      initial_values(p, seed, staging.data());
      Space::copy_from_host(p.value, staging.data(), staging.bytes());
    }
  }
  // out (numel) = the initial values of p under seed, on the host.
  static void initial_values(const Parameter<T>& p, std::uint64_t seed, T* out) {
    const std::int64_t n = p.numel();
    switch (p.init.kind) {
      case Init::Kind::zeros:
        for (std::int64_t i = 0; i < n; ++i) out[i] = T(0);
        break;
      case Init::Kind::ones:
        for (std::int64_t i = 0; i < n; ++i) out[i] = T(1);
        break;
      case Init::Kind::normal: {
        const rng::Stream stream = rng::Stream::named(seed, p.name);
#pragma omp parallel for schedule(static)
        for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(p.init.std * stream.normal(i));
        break;
      }
    }
  }

  void zero_grad() { grads_.zero(); }

  std::span<Parameter<T>* const> parameters() const { return params_; }
  // Number of parameter elements (without alignment padding).
  std::int64_t numel() const {
    std::int64_t n = 0;
    for (const Parameter<T>* p : params_) n += p->numel();
    return n;
  }
  // The flat buffers, padding included (padding is zero and stays zero).
  T* values() { return values_.data(); }
  T* grads() { return grads_.data(); }
  const T* values() const { return values_.data(); }
  const T* grads() const { return grads_.data(); }
  std::int64_t flat_size() const { return values_.size(); }

  Parameter<T>& find(std::string_view name) const {
    for (Parameter<T>* p : params_)
      if (p->name == name) return *p;
    LLMPAR_FAIL("no parameter named '", name, "'");
  }

 private:
  // Each parameter starts on a 64-byte boundary so kernels see aligned rows.
  static std::int64_t round_up(std::int64_t n) {
    constexpr std::int64_t kAlign = static_cast<std::int64_t>(kHostAlignment / sizeof(T));
    return (n + kAlign - 1) / kAlign * kAlign;
  }

  std::vector<Parameter<T>*> params_;
  Buffer<T, Space> values_;
  Buffer<T, Space> grads_;
};

}  // namespace llmpar::nn
