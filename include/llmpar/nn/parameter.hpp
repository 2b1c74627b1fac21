// llmpar/nn/parameter.hpp — parameters, the one visitor interface, and their storage.
//
// A layer declares its parameters (name, shape, how to initialise, whether weight
// decay applies, a learning-rate multiplier) and exposes them through one call,
// `parameters(visit)`. Everything that must touch every parameter — allocation, initialisation, the optimizer, gradient
// clipping, checkpoints, and later ZeRO sharding and precision casts — goes through
// that call, so a user's layer needs no per-feature code.
//
// ParameterStore gives all parameters of a model one contiguous value buffer and one
// contiguous gradient buffer (like llm.c and DeepSpeed's flat buffers). Values are the
// storage type T (bf16 or f16 under mixed precision: the working copy the GEMMs read);
// gradients are acc_t<T>, f32 for every 16-bit T (main grads, accumulated over
// micro-batches without rounding to 16 bits), at the same offsets. Zeroing the
// gradients is one memset, the gradient norm one pass, the optimizer one stream over
// memory, and a data-parallel all-reduce or a ZeRO shard is a slice of one array.
//
// A data-parallel strategy re-lays the store out (relayout): parameters in the order
// backward produces their gradients, cut into buckets padded so that every dp rank's
// shard of a bucket is aligned, and, under ZeRO, without the whole-model gradient
// buffer (stages 2 and 3) or value buffer (stage 3), whose shards then live with the
// data-parallel strategy (parallel/grad_sync.hpp).
//
// Initial values come from the counter-based RNG keyed by (seed, parameter name) and
// indexed by the element's position in the full tensor, so a rank that will hold only
// a slice computes the very values the serial model has there.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "llmpar/core/dtype.hpp"
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

// Which part of a parameter's full tensor this rank holds. A tensor-parallel layer
// splits dimension `dim` of the full shape into `parts` equal slices and keeps slice
// `index`; with `groups` > 1 the dimension is first cut into `groups` equal blocks and
// each block is split the same way (a fused QKV weight: this rank holds its slice of
// q, of k and of v, in that order). dim = -1: the whole tensor (replicated).
struct Split {
  int dim = -1;
  int parts = 1;
  int index = 0;
  int groups = 1;

  bool is_split() const { return dim >= 0 && parts > 1; }
  friend bool operator==(const Split&, const Split&) = default;
};

namespace detail {
// The extent of dimension d of the full shape held by one rank under split s.
inline std::int64_t local_extent(const Shape& full, const Split& s, int d) {
  return s.is_split() && s.dim == d ? full[d] / s.parts : full[d];
}
}  // namespace detail

// The shape a rank holds of `full` under `s`; checks that the split divides it.
inline Shape local_shape(const Shape& full, const Split& s, std::string_view name = "") {
  if (!s.is_split()) return full;
  LLMPAR_CHECK(s.dim < full.rank, "parameter '", name, "' of shape ", full, " has no dimension ", s.dim, " to split");
  LLMPAR_CHECK(s.index >= 0 && s.index < s.parts, "parameter '", name, "': slice ", s.index, " of ", s.parts,
               " does not exist");
  LLMPAR_CHECK(s.groups >= 1 && full[s.dim] % (static_cast<std::int64_t>(s.groups) * s.parts) == 0, "parameter '", name,
               "' of shape ", full, ": dimension ", s.dim, " (", full[s.dim], ") is not divisible by ",
               s.groups > 1 ? "groups x parts = " : "parts = ", static_cast<std::int64_t>(s.groups) * s.parts,
               "; choose sizes the tensor-parallel degree divides");
  Shape local = full;
  local.dims[s.dim] = full[s.dim] / s.parts;
  return local;
}

// The position in the full tensor (row-major) of element i of a rank's slice.
inline std::int64_t full_index(const Shape& full, const Split& s, std::int64_t i) {
  if (!s.is_split()) return i;
  // Row-major: i = (outer, j, inner) with j along the split dimension.
  std::int64_t inner = 1;
  for (int d = s.dim + 1; d < full.rank; ++d) inner *= full[d];
  const std::int64_t local_dim = full[s.dim] / s.parts;
  const std::int64_t j = (i / inner) % local_dim;
  const std::int64_t outer = i / (inner * local_dim);
  const std::int64_t per_group_local = local_dim / s.groups;   // this rank's rows of one group
  const std::int64_t per_group_full = full[s.dim] / s.groups;  // rows of one group in full
  const std::int64_t group = j / per_group_local, within = j % per_group_local;
  const std::int64_t full_j = group * per_group_full + s.index * per_group_local + within;
  return (outer * full[s.dim] + full_j) * inner + i % inner;
}

template <class T>
struct Parameter {
  std::string name;  // unique within a model, e.g. "h.3.attn.qkv.weight"
  Shape shape;       // of the full (unsplit) tensor
  Init init;
  bool decay = false;  // weight decay applies (matrices yes; biases and norm gains no)
  // The optimizer's learning rate for this parameter is lr x lr_scale (the decoupled
  // weight decay, lr x wd x p, scales with it, as with a PyTorch parameter group's lr).
  // 1 for every parameter but those a parametrisation scales: µP's hidden matrices
  // (models/gpt2.hpp, GPT2Config::mup) take 1 / width multiplier.
  float lr_scale = 1.0f;
  // The part of the full tensor this rank holds (default: all of it).
  Split split;
  // Whole on every rank of a tensor-parallel group, but each rank's gradient covers only
  // its rows of the sequence (a norm under sequence parallelism): the gradients are
  // summed over the group once per step (by parallel::GradSync).
  bool sequence_parallel = false;
  using Grad = acc_t<T>;  // f32 main grads for 16-bit T (double for double)
  T* value = nullptr;     // bound by ParameterStore; local_shape() elements
  Grad* grad = nullptr;

  Parameter() = default;
  Parameter(std::string n, Shape s, Init i, bool d, Split sp = {})
      : name(std::move(n)), shape(s), init(i), decay(d), split(sp) {
    static_cast<void>(nn::local_shape(shape, split, name));  // checks that the split divides the shape
  }
  // The shape and number of elements this rank holds.
  Shape local_shape() const { return nn::local_shape(shape, split, name); }
  std::int64_t numel() const { return local_shape().numel(); }
  std::int64_t full_numel() const { return shape.numel(); }
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
concept HasParameters = requires(L& layer, detail::IgnoreParameter<T> visit) {
  layer.parameters(visit);
};

// Space is where the flat buffers live: memory::Host for the CPU backend,
// memory::Device for the CUDA one (initial values are computed on the host and copied).
template <class T, class Space = memory::Host>
class ParameterStore {
 public:
  using Grad = acc_t<T>;

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
    size_ = total;
    values_.zero();
    grads_.zero();
    std::int64_t offset = 0;
    for (Parameter<T>* p : params_) {
      p->value = values_.data() + offset;
      p->grad = grads_.data() + offset;
      offset += round_up(p->numel());
    }
  }

  // Where each parameter goes in a new layout, and which whole-model buffers it keeps.
  struct Layout {
    std::vector<std::int64_t> offsets;  // per parameter, in parameters() order
    std::int64_t size = 0;              // elements of the flat buffers, padding included
    bool values = true;                 // keep the whole-model value buffer (false: ZeRO stage 3)
    bool grads = true;                  // keep the whole-model gradient buffer (false: ZeRO stages 2, 3)
  };

  // Moves every parameter to its offset in `layout`, keeping its values (copied into the
  // new value buffer, or left for the caller to take from old_values() when the layout
  // keeps none); gradients start at zero. Pointers of buffers not kept are null until the
  // caller binds them. The model must not be in the middle of a step.
  void relayout(const Layout& layout) {
    LLMPAR_CHECK(layout.offsets.size() == params_.size(), "ParameterStore::relayout: ", layout.offsets.size(),
                 " offsets for ", params_.size(), " parameters");
    for (std::size_t k = 0; k < params_.size(); ++k)
      LLMPAR_CHECK(layout.offsets[k] >= 0 && layout.offsets[k] + params_[k]->numel() <= layout.size,
                   "ParameterStore::relayout: parameter '", params_[k]->name, "' at offset ", layout.offsets[k],
                   " does not fit in ", layout.size, " elements");
    Buffer<T, Space> values(layout.values ? layout.size : 0);
    values.zero();
    if (layout.values)
      for (std::size_t k = 0; k < params_.size(); ++k)
        Space::copy(values.data() + layout.offsets[k], params_[k]->value, params_[k]->numel());
    old_values_ = std::move(values_);
    values_ = std::move(values);
    if (layout.values) old_values_.reset();
    grads_.resize(layout.grads ? layout.size : 0);
    grads_.zero();
    size_ = layout.size;
    old_offsets_.clear();
    for (std::size_t k = 0; k < params_.size(); ++k) {
      Parameter<T>& p = *params_[k];
      if (!layout.values) old_offsets_.push_back(p.value - old_values_.data());
      p.value = layout.values ? values_.data() + layout.offsets[k] : nullptr;
      p.grad = layout.grads ? grads_.data() + layout.offsets[k] : nullptr;
    }
  }
  // After a relayout that keeps no value buffer: parameter k's values until release_old_values().
  const T* old_value(std::size_t k) const { return old_values_.data() + old_offsets_.at(k); }
  void release_old_values() {
    old_values_.reset();
    old_offsets_.clear();
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
        // Drawn at each element's position in the full tensor: a slice gets exactly the
        // serial model's values there.
        const rng::Stream stream = rng::Stream::named(seed, p.name);
        const Shape full = p.shape;
        const Split split = p.split;
#pragma omp parallel for schedule(static)
        for (std::int64_t i = 0; i < n; ++i)
          out[i] = static_cast<T>(p.init.std * stream.normal(static_cast<std::uint64_t>(full_index(full, split, i))));
        break;
      }
    }
  }

  // Synchronous (set-up code and tests); a training step zeroes through its backend's
  // context instead (Backend::zero, in the compute stream's order).
  void zero_grad() { grads_.zero(); }
  bool has_values() const { return values_.size() > 0 || size_ == 0; }
  bool has_grads() const { return grads_.size() > 0 || size_ == 0; }

  std::span<Parameter<T>* const> parameters() const { return params_; }
  // Number of parameter elements (without alignment padding).
  std::int64_t numel() const {
    std::int64_t n = 0;
    for (const Parameter<T>* p : params_) n += p->numel();
    return n;
  }
  // Elements of the full (unsplit) parameters: the model's size, whatever the split.
  std::int64_t full_numel() const {
    std::int64_t n = 0;
    for (const Parameter<T>* p : params_) n += p->full_numel();
    return n;
  }
  // The flat buffers, padding included (padding is zero and stays zero).
  T* values() { return values_.data(); }
  Grad* grads() { return grads_.data(); }
  const T* values() const { return values_.data(); }
  const Grad* grads() const { return grads_.data(); }
  std::int64_t flat_size() const { return size_; }
  // Bytes the store's own buffers hold (what a ZeRO stage leaves here).
  std::size_t value_bytes() const { return values_.bytes(); }
  std::size_t grad_bytes() const { return grads_.bytes(); }

  Parameter<T>& find(std::string_view name) const {
    for (Parameter<T>* p : params_)
      if (p->name == name) return *p;
    LLMPAR_FAIL("no parameter named '", name, "'");
  }

 private:
  // Each parameter starts on a 64-byte boundary of both buffers, so kernels see aligned
  // rows (values are never wider than gradients: a multiple of 64 bytes of T is one of
  // the gradients too).
  static std::int64_t round_up(std::int64_t n) {
    static_assert(sizeof(T) <= sizeof(Grad));
    constexpr std::int64_t kAlign = static_cast<std::int64_t>(kHostAlignment / sizeof(T));
    return (n + kAlign - 1) / kAlign * kAlign;
  }

  std::vector<Parameter<T>*> params_;
  Buffer<T, Space> values_;
  Buffer<Grad, Space> grads_;
  std::int64_t size_ = 0;
  Buffer<T, Space> old_values_;  // relayout without a value buffer: the values until taken
  std::vector<std::int64_t> old_offsets_;
};

}  // namespace llmpar::nn
