// A Spec whose block is a complete Layer but is constructed as Block(name, dim), not
// Block(name, config, tp): the Transformer says which constructor it calls.
// expect: the Spec's Block cannot be constructed as Block(const std::string& name, const Spec::Config& config, nn::TensorParallelGroup tp)
#include <cstddef>
#include <cstdint>
#include <llmpar/backend/cpu/backend.hpp>
#include <llmpar/models/gpt2.hpp>
#include <string>
using namespace llmpar;

template <class T, class Backend>
struct WrongConstructor {
  struct Saved {
    std::size_t bytes() const { return 0; }
  };
  WrongConstructor(const std::string&, std::int64_t) {}
  void forward(typename Backend::Context&, Saved&, T*, const T*, std::int64_t, std::int64_t) {}
  void backward(typename Backend::Context&, Saved&, T*, const T*, const T*, std::int64_t, std::int64_t) {}
  template <class Visit>
  void parameters(Visit&&) {}
};

struct WrongSpec : models::GPT2Spec {
  template <class T, class Backend>
  using Block = WrongConstructor<T, Backend>;
};

models::Transformer<float, backend::Cpu, WrongSpec>* model = nullptr;
void touch() { static_cast<void>(sizeof(*model)); }
