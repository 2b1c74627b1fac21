// A layer whose backward takes an extra scratch argument, so backward(ctx, dx, dout, x,
// batch, seq) does not exist.
// expect: llmpar: this layer type has no backward(ctx, dx, dout, x, batch, seq) member
#include <cstdint>
#include <llmpar/nn/layer.hpp>
using namespace llmpar;

struct TinyBackend {  // the least a backend tag provides, so no kernel headers are needed
  static constexpr const char* kName = "tiny";
  struct Context {};
  using Space = memory::Host;
};

struct Scratch {};
struct NoBackward {
  void forward(TinyBackend::Context&, float*, const float*, std::int64_t, std::int64_t) {}
  void backward(TinyBackend::Context&, float*, const float*, const float*, std::int64_t, std::int64_t, Scratch&) {}
  template <class Visit>
  void parameters(Visit&&) {}
};

static_assert(nn::check_layer<NoBackward, TinyBackend>());
