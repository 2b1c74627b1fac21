// An MLP activation without kProjections: nn::Mlp names the member it needs.
// expect: the activation type has no `static constexpr int kProjections`
#include <cstdint>
#include <llmpar/backend/cpu/backend.hpp>
#include <llmpar/nn/mlp.hpp>
using namespace llmpar;

struct NoWidth {
  template <class Backend, class T>
  static void forward(typename Backend::Context&, T*, const T*, std::int64_t, std::int64_t) {}
  template <class Backend, class T>
  static void backward(typename Backend::Context&, T*, const T*, const T*, std::int64_t, std::int64_t) {}
};

void touch() { static_cast<void>(sizeof(nn::Mlp<float, backend::Cpu, NoWidth>)); }
