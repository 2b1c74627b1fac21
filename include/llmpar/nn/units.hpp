// llmpar/nn/units.hpp — a model's units and the events a data-parallel strategy hears.
//
// A unit is a group of parameters that is used together: a transformer block, the
// embedding with the tied LM head, the final norm. A model that names its units
//
//   int num_units() const;
//   template <class Visit> void unit_parameters(int unit, Visit&& visit);
//   void set_unit_hooks(nn::UnitHooks* hooks);
//
// and calls the hooks around each use lets the data-parallel strategy
// (parallel/grad_sync.hpp) reduce a bucket of gradients as soon as its units' backward
// is done (overlapping the rest of backward), bind a unit's gradient buffer only while
// it is needed (ZeRO 2), and gather a unit's sharded parameters just before they are
// used and free them after (ZeRO 3). Units are numbered in forward order; a unit may be
// used more than once in a pass (the tied embedding: the lookup and the LM head), and
// after_backward(u) is called once per backward, when every gradient of u is final.
//
// The hooks are an interface (one virtual call per unit and event: nothing next to a
// block's GEMMs) so that a model does not depend on the strategy's types.
#pragma once

namespace llmpar::nn {

class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(int unit) = 0;   // u's parameter values are about to be read
  virtual void after_forward(int unit) = 0;    // ... and are not needed until the next before_*
  virtual void before_backward(int unit) = 0;  // u's values are read and its gradients written
  virtual void after_backward(int unit) = 0;   // u's gradients of this micro-batch are complete
};

// The models call these: a null hook set (no data-parallel strategy) does nothing.
inline void before_forward(UnitHooks* h, int unit) {
  if (h != nullptr) h->before_forward(unit);
}
inline void after_forward(UnitHooks* h, int unit) {
  if (h != nullptr) h->after_forward(unit);
}
inline void before_backward(UnitHooks* h, int unit) {
  if (h != nullptr) h->before_backward(unit);
}
inline void after_backward(UnitHooks* h, int unit) {
  if (h != nullptr) h->after_backward(unit);
}

}  // namespace llmpar::nn
