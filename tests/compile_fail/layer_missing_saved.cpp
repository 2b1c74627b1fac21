// A layer whose Saved has no bytes(): a model could not say what a micro-batch's
// activations cost in it, nor a pipeline how many it can keep in flight.
// expect: llmpar: this layer type has no Saved member type (default-constructible, movable, with
#include <cstdint>
#include <llmpar/nn/layer.hpp>
#include <vector>
using namespace llmpar;

struct TinyBackend {  // the least a backend tag provides, so no kernel headers are needed
  static constexpr const char* kName = "tiny";
  struct Context {};
  using Space = memory::Host;
};

struct NoSavedBytes {
  struct Saved {
    std::vector<float> x;
  };
  void forward(TinyBackend::Context&, Saved&, float*, const float*, std::int64_t, std::int64_t) {}
  void backward(TinyBackend::Context&, Saved&, float*, const float*, const float*, std::int64_t, std::int64_t) {}
  template <class Visit>
  void parameters(Visit&&) {}
};

static_assert(nn::check_layer<NoSavedBytes, TinyBackend>());
