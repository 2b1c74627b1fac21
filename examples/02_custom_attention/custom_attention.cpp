// 02_custom_attention — attention with rotary position embeddings (Su et al. 2021)
// instead of GPT-2's position table: nn::SelfAttention takes the rotation as its
// Positions (a type with forward and backward over the projected q and k; the user's
// own code, examples/common/rotary.hpp), and the Spec drops the table. The rest is
// GPT-2's block (models::GPT2Parts).
#include "../common/block_example.hpp"
#include "../common/rotary.hpp"

using namespace llmpar;

template <class T, class Backend>
struct RotaryParts : models::GPT2Parts<T, Backend> {
  static_assert(Backend::Space::kHostAccessible, "the rotary code is host loops: train this block on backend::Cpu");
  using Attention = nn::SelfAttention<T, Backend, examples::Rotary<T>>;
  static Attention attention(const std::string& block, const models::GPT2Config& cfg, nn::TensorParallelGroup tp) {
    return Attention(block + ".attn.c_attn", block + ".attn.c_proj",
                     {.dim = cfg.dim, .heads = cfg.heads, .out_init_std = RotaryParts::residual_std(cfg)}, tp,
                     examples::Rotary<T>(cfg.dim / cfg.heads, cfg.max_seq));
  }
};

// GPT-2's names and final norm, these blocks, and no position table.
struct RotarySpec : models::GPT2Spec {
  template <class T, class Backend>
  using Block = models::PreNormBlock<RotaryParts<T, Backend>, T, Backend>;
  static constexpr const char* kPositionTable = nullptr;
};

int main(int argc, char** argv) {
  return block_example::main<RotarySpec>(argc, argv, "custom_attention", models::GPT2Config::preset("gpt2-tiny"));
}
