// A model without placement(): the pipeline executor cannot know which chunks of layers
// this rank runs, and the trainer cannot check the model against the layout.
// expect: llmpar: this model type has no placement() const returning its pipeline::Placement
#include <cstddef>
#include <cstdint>
#include <llmpar/pipeline/executor.hpp>
using namespace llmpar;

struct NoPlacement {
  using value_type = float;
  using BackendTag = struct Tag;
  using Acc = float;
  struct Stash {};
  nn::ParameterStore<float>& parameter_store();
  std::int64_t num_parameters() const;
  int num_units() const;
  template <class Visit>
  void unit_parameters(int, Visit&&) {}
  void set_unit_hooks(nn::UnitHooks*) {}
  nn::TensorParallelGroup tensor_parallel() const;
  const nn::Parameter<float>* token_table() const;
  const nn::Parameter<float>* tied_copy() const;
  std::size_t activation_bytes() const;
  void set_recompute(recompute::Mode) {}
};

static_assert(pipeline::check_model<NoPlacement>());  // what the trainer checks
