// llmpar/nn/layer.hpp — the Layer concept: what a user's layer type must provide.
//
// A layer is a plain class with explicit forward and backward (no tape), one
// parameters(visit) call, and a Saved type: what its forward keeps for its backward
// (docs/design.md, "Activations belong to a micro-batch, not to a layer"):
//
//   struct Saved { ...buffers...; std::size_t bytes() const; };
//   void forward(Context& ctx, Saved& saved, T* out, const T* x, std::int64_t batch, std::int64_t seq);
//   void backward(Context& ctx, Saved& saved, T* dx, const T* dout, const T* x, std::int64_t batch,
//                 std::int64_t seq);
//   template <class Visit> void parameters(Visit&& visit);   // visit(Parameter<T>&) per parameter
//
// out, x, dx and dout are (batch, seq, C) activations in Backend::Space; backward gets
// the Saved and the x its forward got and accumulates parameter gradients. The Saved
// belongs to the caller, one per micro-batch in flight: a pipeline stage holds several
// (1F1B: up to p), and recomputation keeps none across the step, running forward again
// into a scratch Saved just before backward. Its bytes() are what the micro-batch's
// activations cost in this layer. Scratch that is dead once backward returns is not
// part of Saved; a layer owns it (a model that shares scratch between its own blocks,
// models::GPT2, may call a wider overload as well).
//
// Layer<L, Backend, T> is the conjunction of named concepts so that a failure says
// which member is missing: nn::check_layer<L, Backend, T>() static_asserts each one
// with its own sentence. Call it where a model takes a user's layer type:
//
//   static_assert(nn::check_layer<MyBlock, backend::Cpu>());
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "llmpar/backend/backend.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::nn {

// A block that can drop its attention core's outputs in forward and recompute them in
// backward (Korthikanti et al. 2022), bitwise the same: recompute::Selective. Full
// recomputation needs nothing of a layer (the model reruns its forward from its input).
template <class L>
concept HasSelectiveRecompute = requires(L& layer, bool on) {
  layer.set_selective_recompute(on);
};

// What a layer keeps for its backward: L::Saved, default-constructible and movable, with
// bytes().
template <class L>
concept HasSaved = requires(const typename L::Saved& s) {
  { s.bytes() } -> std::convertible_to<std::size_t>;
}
&&std::is_default_constructible_v<typename L::Saved>&& std::is_move_constructible_v<typename L::Saved>;

// l.forward(ctx, saved, out, x, batch, seq): out (batch, seq, C) from x (batch, seq, C).
template <class L, class Backend, class T = float>
concept HasLayerForward = HasSaved<L> && requires(L& layer, typename Backend::Context& ctx, typename L::Saved& saved,
                                                  T* out, const T* x, std::int64_t batch, std::int64_t seq) {
  layer.forward(ctx, saved, out, x, batch, seq);
};

// l.backward(ctx, saved, dx, dout, x, batch, seq): dx = ∂loss/∂x from dout = ∂loss/∂out,
// the forward's Saved and its input x; parameter gradients accumulate.
template <class L, class Backend, class T = float>
concept HasLayerBackward = HasSaved<L> &&
    requires(L& layer, typename Backend::Context& ctx, typename L::Saved& saved, T* dx, const T* dout, const T* x,
             std::int64_t batch, std::int64_t seq) {
  layer.backward(ctx, saved, dx, dout, x, batch, seq);
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
    static_assert(HasSaved<L>,
                  "llmpar: this layer type has no Saved member type (default-constructible, movable, with "
                  "std::size_t bytes() const) holding what its forward keeps for its backward; the caller owns one "
                  "per micro-batch in flight");
    if constexpr (HasSaved<L>) {  // without Saved, its sentence above is the one that matters
      static_assert(HasLayerForward<L, Backend, T>,
                    "llmpar: this layer type has no forward(ctx, saved, out, x, batch, seq) member callable with "
                    "(Backend::Context&, Saved&, T* out, const T* x, std::int64_t batch, std::int64_t seq); a Layer "
                    "computes its output activations with it and keeps what backward needs in saved");
      static_assert(HasLayerBackward<L, Backend, T>,
                    "llmpar: this layer type has no backward(ctx, saved, dx, dout, x, batch, seq) member callable with "
                    "(Backend::Context&, Saved&, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t "
                    "seq); a Layer computes its input gradient with it from what its forward saved");
    }
    static_assert(HasParameters<L, T>,
                  "llmpar: this layer type has no parameters(visit) member that calls visit(nn::Parameter<T>&) for "
                  "each of its parameters; a Layer with no parameters still needs one, with an empty body");
  }
  return true;
}

}  // namespace llmpar::nn
