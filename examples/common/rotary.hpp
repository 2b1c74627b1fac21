// examples/common/rotary.hpp — rotary position embeddings (Su et al. 2021), the user's
// own element-wise code of examples 02 (as nn::SelfAttention's Positions) and 04 (the
// LLaMA-style block, examples/custom_layer.hpp, which calls rotate itself).
//
// In every head, channel pair (2i, 2i+1) of q and of k at position t is rotated by the
// angle t · base^(-2i/hs). The score q_t · k_s then depends on t - s only, which is how
// the model knows positions (it has no position table). A rotation is orthogonal, so
// the backward is the rotation by the opposite angle (the transpose), and nothing from
// the forward needs to be kept.
//
// bf16-safe: each element is loaded into acc_t<T> (float for float, bf16 and f16;
// double for the gradient check's double layers), rotated there, and stored back with
// one rounding (llmpar::convert). bf16 has no arithmetic of its own: `x0 * c` on two
// bf16 values does not compile, by design (examples/03_bf16_elementwise says more).
// Host loops: for backends whose memory the host reads (backend::Cpu).
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <llmpar/core/attention_shape.hpp>
#include <llmpar/core/dtype.hpp>
#include <llmpar/core/error.hpp>
#include <vector>

namespace examples {

template <class T>
class Rotary {
 public:
  using Acc = llmpar::acc_t<T>;

  Rotary(std::int64_t head_size, std::int64_t max_seq, double base = 10000.0)
      : half_(head_size / 2), max_seq_(max_seq), cos_(static_cast<std::size_t>(max_seq * half_)), sin_(cos_.size()) {
    LLMPAR_CHECK(head_size % 2 == 0, "the head size ", head_size,
                 " is odd; rotary embeddings rotate pairs of channels, so choose an even head size");
    for (std::int64_t t = 0; t < max_seq; ++t)
      for (std::int64_t i = 0; i < half_; ++i) {
        const double angle =
            static_cast<double>(t) * std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(head_size));
        cos_[static_cast<std::size_t>(t * half_ + i)] = static_cast<Acc>(std::cos(angle));
        sin_[static_cast<std::size_t>(t * half_ + i)] = static_cast<Acc>(std::sin(angle));
      }
  }

  enum class Direction { forward, backward };

  // Rotates q and k of qkv (B, S, R) in place, `shape` this rank's heads
  // (core/attention_shape.hpp): the q of its query heads and the k of its kv heads sit
  // side by side at the start of each row, v after them untouched. forward: by +angle
  // (the forward pass); backward: by -angle, which carries dq and dk back through the
  // forward rotation.
  void rotate(T* qkv, const llmpar::AttentionShape& shape, Direction direction) const {
    LLMPAR_CHECK(shape.seq <= max_seq_, "rotary embedding: sequence length ", shape.seq, " is longer than the tables' ",
                 max_seq_);
    LLMPAR_CHECK(shape.head_dim == 2 * half_, "rotary embedding: head size ", shape.head_dim, " is not the tables' ",
                 2 * half_);
    const Acc sign = direction == Direction::forward ? Acc(1) : Acc(-1);
    const std::int64_t rows = shape.batch * shape.seq, R = shape.row();
    const std::int64_t pairs = (shape.q_dim() + shape.kv_dim()) / 2;  // pairs of q and k per row
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      const Acc* c = cos_.data() + (r % shape.seq) * half_;  // (hs/2) for this position
      const Acc* s = sin_.data() + (r % shape.seq) * half_;
      T* x = qkv + r * R;
      for (std::int64_t p = 0; p < pairs; ++p) {
        const std::int64_t i = p % half_;  // the pair's index within its head
        const Acc x0 = llmpar::convert<Acc>(x[2 * p]), x1 = llmpar::convert<Acc>(x[2 * p + 1]);
        x[2 * p] = llmpar::convert<T>(x0 * c[i] - sign * x1 * s[i]);
        x[2 * p + 1] = llmpar::convert<T>(sign * x0 * s[i] + x1 * c[i]);
      }
    }
  }

  // nn::SelfAttention's Positions: rotate q and k after the projection, and their
  // gradients back before it.
  template <class Context>
  void forward(Context&, T* qkv, const llmpar::AttentionShape& shape) const {
    rotate(qkv, shape, Direction::forward);
  }
  template <class Context>
  void backward(Context&, T* dqkv, const llmpar::AttentionShape& shape) const {
    rotate(dqkv, shape, Direction::backward);
  }

 private:
  std::int64_t half_, max_seq_;
  std::vector<Acc> cos_, sin_;  // (max_seq, hs/2)
};

}  // namespace examples
