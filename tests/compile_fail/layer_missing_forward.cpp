// A layer whose forward is still the one without the Saved (forward(ctx, out, x, batch,
// seq)): where it keeps its activations the caller cannot see.
// expect: llmpar: this layer type has no forward(ctx, saved, out, x, batch, seq) member
#include <cstddef>
#include <cstdint>
#include <llmpar/nn/layer.hpp>
using namespace llmpar;

struct TinyBackend {  // the least a backend tag provides, so no kernel headers are needed
  static constexpr const char* kName = "tiny";
  struct Context {};
  using Space = memory::Host;
};

struct NoForward {
  struct Saved {
    std::size_t bytes() const { return 0; }
  };
  void forward(TinyBackend::Context&, float*, const float*, std::int64_t, std::int64_t) {}
  void backward(TinyBackend::Context&, Saved&, float*, const float*, const float*, std::int64_t, std::int64_t) {}
  template <class Visit>
  void parameters(Visit&&) {}
};

static_assert(nn::check_layer<NoForward, TinyBackend>());
