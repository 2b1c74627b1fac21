// 01_swap_mlp — GPT-2 with its MLP swapped for a GeGLU (Shazeer 2020). A block is a
// pre-norm block of parts (models::PreNormBlock): two norms, an attention and an MLP.
// GPT-2's parts are models::GPT2Parts; these are the same but for the MLP. Tensor and
// sequence parallelism, bf16 and the zero-bubble split backward come with the parts
// (nn::SelfAttention, nn::Mlp). README.md beside this file walks through it.
#include "../common/block_example.hpp"

using namespace llmpar;

template <class T, class Backend>
struct GeGluParts : models::GPT2Parts<T, Backend> {
  // act = gelu(g) · u over a (2H, C) up projection and a (C, H) down projection, H = 3C:
  // the weights of a 4C GELU MLP (8C² parameters, against 9C² here at C = 128).
  using Mlp = nn::Mlp<T, Backend, nn::GeGlu>;
  static Mlp mlp(const std::string& block, const models::GPT2Config& cfg, nn::TensorParallelGroup tp) {
    return Mlp(block + ".mlp.up", block + ".mlp.down",
               {.dim = cfg.dim, .hidden = 3 * cfg.dim, .bias = false, .out_init_std = GeGluParts::residual_std(cfg)},
               tp);
  }
};

// GPT-2 in every other respect: its final LayerNorm, position table and names.
struct GeGluSpec : models::GPT2Spec {
  template <class T, class Backend>
  using Block = models::PreNormBlock<GeGluParts<T, Backend>, T, Backend>;
};

int main(int argc, char** argv) {
  return block_example::main<GeGluSpec>(argc, argv, "swap_mlp", models::GPT2Config::preset("gpt2-tiny"));
}
