// 03_bf16_elementwise — an activation of one's own, written once for every element
// type: squared ReLU (So et al. 2021, "Primer"), act = max(x, 0)², in nn::Mlp.
//
// bf16 and f16 have no arithmetic in llmpar (x * y on two bf16 values does not
// compile): storage is 16 bits, compute is acc_t<T> (float; double for the gradient
// check's double layers). So element-wise code loads each element into acc_t<T> with
// llmpar::convert, computes there, and stores with one rounding. Written that way, the
// same loop serves float, bf16, f16 and double. Host loops: backend::Cpu.
#include "../common/block_example.hpp"

using namespace llmpar;

// nn::Mlp's activation interface (nn/mlp.hpp): kProjections, forward, backward.
struct SquaredRelu {
  static constexpr int kProjections = 1;  // act (rows, H) from pre (rows, H)
  template <class Backend, class T>
  static void forward(typename Backend::Context&, T* act, const T* pre, std::int64_t rows, std::int64_t hidden) {
    static_assert(Backend::Space::kHostAccessible, "SquaredRelu is host loops: use backend::Cpu");
    using Acc = acc_t<T>;
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < rows * hidden; ++i) {
      const Acc x = std::max(convert<Acc>(pre[i]), Acc(0));
      act[i] = convert<T>(x * x);
    }
  }
  // dpre = dact · 2 max(pre, 0) (overwritten).
  template <class Backend, class T>
  static void backward(typename Backend::Context&, T* dpre, const T* dact, const T* pre, std::int64_t rows,
                       std::int64_t hidden) {
    using Acc = acc_t<T>;
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < rows * hidden; ++i)
      dpre[i] = convert<T>(convert<Acc>(dact[i]) * Acc(2) * std::max(convert<Acc>(pre[i]), Acc(0)));
  }
};

template <class T, class Backend>
struct SquaredReluParts : models::GPT2Parts<T, Backend> {
  using Mlp = nn::Mlp<T, Backend, SquaredRelu>;
  static Mlp mlp(const std::string& block, const models::GPT2Config& cfg, nn::TensorParallelGroup tp) {
    return Mlp(block + ".mlp.c_fc", block + ".mlp.c_proj",
               {.dim = cfg.dim, .hidden = 4 * cfg.dim, .out_init_std = SquaredReluParts::residual_std(cfg)}, tp);
  }
};

struct SquaredReluSpec : models::GPT2Spec {
  template <class T, class Backend>
  using Block = models::PreNormBlock<SquaredReluParts<T, Backend>, T, Backend>;
};

int main(int argc, char** argv) {
  return block_example::main<SquaredReluSpec>(argc, argv, "bf16_elementwise", models::GPT2Config::preset("gpt2-tiny"));
}
