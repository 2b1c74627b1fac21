// A layer without parameters(visit).
// expect: llmpar: this layer type has no parameters(visit) member
#include <cstddef>
#include <cstdint>
#include <llmpar/nn/layer.hpp>
using namespace llmpar;

struct TinyBackend {  // the least a backend tag provides, so no kernel headers are needed
  static constexpr const char* kName = "tiny";
  struct Context {};
  using Space = memory::Host;
};

struct NoParameters {
  struct Saved {
    std::size_t bytes() const { return 0; }
  };
  void forward(TinyBackend::Context&, Saved&, float*, const float*, std::int64_t, std::int64_t) {}
  void backward(TinyBackend::Context&, Saved&, float*, const float*, const float*, std::int64_t, std::int64_t) {}
};

static_assert(nn::check_layer<NoParameters, TinyBackend>());
