// llmpar/nn/model.hpp — the Model concept: what the trainer, the data-parallel strategy
// and the pipeline executor need of a model's layers and parameters.
//
// A model is what models::Transformer<T, Backend, Spec> is (GPT-2, a user's LLaMA-style
// block: examples/custom_layer.hpp): a flat store of parameters cut into units, split
// over a tensor-parallel group, with a tied token table whose
// last-stage copy the trainer keeps in step. Every member below is required: a model
// without one is a compile error naming it (nn::check_model), never a run that quietly
// skips what the member was for (the tied table's gradient sum, the memory report, ...).
//
//   using value_type = T;  using BackendTag = Backend;  using Acc = ...;  struct Stash;
//   ParameterStore<T, Space>& parameter_store();   std::int64_t num_parameters() const;
//   int num_units() const;  void unit_parameters(int u, Visit&&);  void set_unit_hooks(UnitHooks*);
//   TensorParallelGroup tensor_parallel() const;
//   const Parameter<T>* token_table() const;       // the embedding's table, or nullptr on this stage
//   const Parameter<T>* tied_copy() const;         // the last stage's copy of it, or nullptr
//   std::size_t activation_bytes() const;          void set_recompute(recompute::Mode);
//
// Like nn::Layer (nn/layer.hpp) it is a conjunction of named concepts, and
// check_model<M>() static_asserts each with its own sentence; GradSync calls it. Where
// the model sits on the pipeline's stages (placement()) is the pipeline's to ask:
// pipeline::Model and pipeline::check_model (pipeline/executor.hpp) add it, and the
// trainer and the executor check those.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/recompute.hpp"
#include "llmpar/nn/tensor_parallel.hpp"
#include "llmpar/nn/units.hpp"

namespace llmpar::nn {

template <class M>
concept HasModelTypes = requires {
  typename M::value_type;
  typename M::BackendTag;
  typename M::Acc;
  typename M::Stash;
};

template <class M>
concept HasParameterStore = requires(M& m, const M& cm) {
  m.parameter_store().parameters();
  { cm.num_parameters() } -> std::convertible_to<std::int64_t>;
};

template <class M>
concept HasUnits = requires(M& m, const M& cm, UnitHooks* hooks,
                            detail::IgnoreParameter<typename M::value_type> visit) {
  { cm.num_units() } -> std::convertible_to<int>;
  m.unit_parameters(0, visit);
  m.set_unit_hooks(hooks);
};

template <class M>
concept HasTensorParallelGroup = requires(const M& cm) {
  { cm.tensor_parallel() } -> std::convertible_to<TensorParallelGroup>;
};

template <class M>
concept HasTiedTable = requires(const M& cm) {
  { cm.token_table() } -> std::convertible_to<const Parameter<typename M::value_type>*>;
  { cm.tied_copy() } -> std::convertible_to<const Parameter<typename M::value_type>*>;
};

template <class M>
concept HasActivations = requires(M& m, const M& cm, recompute::Mode mode) {
  { cm.activation_bytes() } -> std::convertible_to<std::size_t>;
  m.set_recompute(mode);
};

template <class M>
concept Model = HasModelTypes<M> && HasParameterStore<M> && HasUnits<M> && HasTensorParallelGroup<M> &&
    HasTiedTable<M> && HasActivations<M>;

// Checks M member by member, each with its own sentence; true when M is a Model. The
// compiler's "in instantiation of check_model<...>" note names the model type.
template <class M>
consteval bool check_model() {
  static_assert(HasModelTypes<M>,
                "llmpar: this model type lacks a member type of value_type (its storage type T), BackendTag "
                "(backend::Cpu or backend::Cuda), Acc (its accumulation type) or Stash (what one micro-batch keeps "
                "for backward); build it on models::Transformer, or name them");
  if constexpr (HasModelTypes<M>) {
    static_assert(HasParameterStore<M>,
                  "llmpar: this model type has no parameter_store() returning its nn::ParameterStore, or no "
                  "num_parameters() const (the serial model's count, for MFU)");
    static_assert(HasUnits<M>,
                  "llmpar: this model type does not name its units: num_units() const, unit_parameters(unit, "
                  "visit) and set_unit_hooks(nn::UnitHooks*) (nn/units.hpp); the data-parallel strategy reduces, "
                  "binds and gathers per unit");
    static_assert(HasTensorParallelGroup<M>,
                  "llmpar: this model type has no tensor_parallel() const returning its nn::TensorParallelGroup; the "
                  "trainer checks it against the layout");
    static_assert(HasTiedTable<M>,
                  "llmpar: this model type has no token_table() const or tied_copy() const returning const "
                  "nn::Parameter<T>* (nullptr where the stage holds none); the trainer sums the tied table's "
                  "gradient between the first and last pipeline stage with them");
    static_assert(HasActivations<M>,
                  "llmpar: this model type has no activation_bytes() const (what its activations hold, for the "
                  "memory report) or no set_recompute(recompute::Mode)");
  }
  return true;
}

// The type whose code a model runs: its Core where the model adds only a composed
// policy to one (models::Transformer), else the model itself. What is instantiated per
// model and reads nothing of the policy (pipeline::Executor) takes it, so models that
// differ in the policy alone (one per ZeRO stage) share that code.
template <class M>
struct CoreOf {
  using type = M;
};
template <class M>
  requires std::derived_from<M, typename M::Core>
struct CoreOf<M> {
  using type = typename M::Core;
};
template <class M>
using core_of_t = typename CoreOf<M>::type;

}  // namespace llmpar::nn
