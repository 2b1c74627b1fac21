// llmpar/nn/layer.hpp — the Layer concept: what a user's layer type must provide.
//
// A layer is a plain class with explicit forward and backward (no tape) and one
// parameters(visit) call (DESIGN.md, "The shape of a trainer"):
//
//   void forward(Context& ctx, T* out, const T* x, std::int64_t batch, std::int64_t seq);
//   void backward(Context& ctx, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq);
//   template <class Visit> void parameters(Visit&& visit);   // visit(Parameter<T>&) per parameter
//
// out, x, dx and dout are (batch, seq, C) activations in Backend::Space; backward gets
// the same x forward got and accumulates parameter gradients. A layer owns whatever
// scratch its backward needs: scratch is not part of the concept, because what a layer
// needs (and whether a model shares it between blocks) is the layer's business, and a
// user's layer should not have to know a model's scratch type. A model that shares
// scratch between its own blocks (models::GPT2) may call a wider overload as well.
//
// Layer<L, Backend, T> is the conjunction of three named concepts so that a failure says
// which member is missing: nn::check_layer<L, Backend, T>() static_asserts each one
// with its own sentence. Call it where a model takes a user's layer type:
//
//   static_assert(nn::check_layer<MyBlock, backend::Cpu>());
#pragma once

#include <cstdint>

#include "llmpar/backend/backend.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::nn {

// l.forward(ctx, out, x, batch, seq): out (batch, seq, C) from x (batch, seq, C).
template <class L, class Backend, class T = float>
concept HasLayerForward = requires(L& layer, typename Backend::Context& ctx, T* out, const T* x, std::int64_t batch,
                                   std::int64_t seq) {
  layer.forward(ctx, out, x, batch, seq);
};

// l.backward(ctx, dx, dout, x, batch, seq): dx = ∂loss/∂x from dout = ∂loss/∂out and the
// forward's input x; parameter gradients accumulate.
template <class L, class Backend, class T = float>
concept HasLayerBackward = requires(L& layer, typename Backend::Context& ctx, T* dx, const T* dout, const T* x,
                                    std::int64_t batch, std::int64_t seq) {
  layer.backward(ctx, dx, dout, x, batch, seq);
};

// A layer of element type T on Backend (HasParameters is nn/parameter.hpp's).
template <class L, class Backend, class T = float>
concept Layer = backend::Backend<Backend> && HasLayerForward<L, Backend, T> && HasLayerBackward<L, Backend, T> &&
    HasParameters<L, T>;

// Checks L member by member, each with its own sentence; true when L is a Layer. The
// compiler's "in instantiation of check_layer<...>" note names the layer type.
template <class L, class Backend, class T = float>
consteval bool check_layer() {
  static_assert(backend::Backend<Backend>,
                "llmpar::nn::check_layer: the Backend argument is not a complete backend tag; pass backend::Cpu or "
                "backend::Cuda and include its header (llmpar/backend/cpu/backend.hpp or "
                "llmpar/backend/cuda/backend.hpp)");
  if constexpr (backend::Backend<Backend>) {
    static_assert(HasLayerForward<L, Backend, T>,
                  "llmpar: this layer type has no forward(ctx, out, x, batch, seq) member callable with "
                  "(Backend::Context&, T* out, const T* x, std::int64_t batch, std::int64_t seq); a Layer computes "
                  "its output activations with it");
    static_assert(HasLayerBackward<L, Backend, T>,
                  "llmpar: this layer type has no backward(ctx, dx, dout, x, batch, seq) member callable with "
                  "(Backend::Context&, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq); a "
                  "Layer computes its input gradient with it and keeps (or recomputes) what it needs from forward");
    static_assert(HasParameters<L, T>,
                  "llmpar: this layer type has no parameters(visit) member that calls visit(nn::Parameter<T>&) for "
                  "each of its parameters; a Layer with no parameters still needs one, with an empty body");
  }
  return true;
}

}  // namespace llmpar::nn
