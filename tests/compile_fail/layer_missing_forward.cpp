// A layer without forward(ctx, out, x, batch, seq).
// expect: llmpar: this layer type has no forward(ctx, out, x, batch, seq) member
#include <cstdint>
#include <llmpar/nn/layer.hpp>
using namespace llmpar;

struct TinyBackend {  // the least a backend tag provides, so no kernel headers are needed
  static constexpr const char* kName = "tiny";
  struct Context {};
  using Space = memory::Host;
};

struct NoForward {
  void backward(TinyBackend::Context&, float*, const float*, const float*, std::int64_t, std::int64_t) {}
  template <class Visit>
  void parameters(Visit&&) {}
};

static_assert(nn::check_layer<NoForward, TinyBackend>());
