// A model without token_table(): the trainer would otherwise skip summing the tied
// table's gradient between the first and last pipeline stage, silently.
// expect: llmpar: this model type has no token_table() const or tied_copy() const
#include <cstddef>
#include <cstdint>
#include <llmpar/pipeline/executor.hpp>
using namespace llmpar;

struct NoTokenTable {
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
  const pipeline::Placement& placement() const;
  const nn::Parameter<float>* tied_copy() const;
  std::size_t activation_bytes() const;
  void set_recompute(recompute::Mode) {}
};

static_assert(pipeline::check_model<NoTokenTable>());  // what the trainer checks
