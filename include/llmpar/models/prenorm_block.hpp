// llmpar/models/prenorm_block.hpp — the pre-norm transformer block, composed of parts:
//
//   mid = x + attention(attention_norm(x)),   out = mid + mlp(mlp_norm(mid))
//
// GPT-2's block is this block of GPT2Parts (models/gpt2.hpp); a block that swaps only
// the MLP is a Parts type of a few lines naming another nn::Mlp (examples/01_swap_mlp),
// one that changes the attention names another Attention (examples/02_custom_attention),
// as Megatron-Core's module specs swap a TransformerLayer's submodules.
//
//   struct Parts {
//     using Config = ...;                     // the model's config (models::Transformer's Spec)
//     using Norm = ...;                       // nn::LayerNorm, nn::RMSNorm: forward(ctx, saved, out, x, rows)
//                                             // (and, optionally, forward_residual, backward_residual)
//     using Attention = ...;                  // nn::SelfAttention<T, Backend, Positions>, or a user's
//     using Mlp = ...;                        // nn::Mlp<T, Backend, Activation>, or a user's
//     static Norm attention_norm(const std::string& block, const Config&);
//     static Norm mlp_norm(const std::string& block, const Config&);
//     static Attention attention(const std::string& block, const Config&, nn::TensorParallelGroup);
//     static Mlp mlp(const std::string& block, const Config&, nn::TensorParallelGroup);
//   };
//
// Attention and Mlp are nn::Layers whose forward takes this rank's rows of the
// normalised stream and returns this rank's rows of their output, summed over the
// tensor-parallel group (they do their own communication); the block is the norms and
// the residual adds between them, all on this rank's rows. What the block adds beyond
// that, when its parts support it (llmpar's do; checked at compile time, not probed):
//  - one nn::BlockScratch shared by both parts (and, via use_scratch, by every block of
//    a model): the gradients between the parts live in its c0 and c1;
//  - the zero-bubble schedule's split backward (Deferred, backward_weights), when both
//    parts have it;
//  - selective recomputation, when the attention has it;
//  - the residual adds fused into the norms (one pass over the rows instead of two),
//    when the Norm has forward_residual and backward_residual (nn::RMSNorm does;
//    nn::LayerNorm does not, and its blocks run the adds as separate passes). The fused
//    calls compute the unfused ones' bits.
// The numbers are the parts' own: GPT-2's block computes what it computed as one class,
// bit for bit.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

#include "llmpar/backend/backend.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/nn/context_parallel.hpp"
#include "llmpar/nn/layer.hpp"
#include "llmpar/nn/scratch.hpp"
#include "llmpar/nn/tensor_parallel.hpp"

namespace llmpar::models {

namespace detail {
// A part whose calls take the block's shared scratch (and, with kDeferred, a Deferred*).
template <class Part, class T, class Space>
concept TakesScratch = requires(Part& p, typename Part::Saved& sv, typename Part::Context& ctx, T* y, const T* x,
                                nn::BlockScratch<T, Space>& s) {
  p.forward(ctx, sv, y, x, std::int64_t{}, std::int64_t{}, s);
  p.backward(ctx, sv, y, x, x, std::int64_t{}, std::int64_t{}, s);
};
template <class Part, class T, class Space>
concept DefersWeights = TakesScratch<Part, T, Space> &&
    requires(Part& p, typename Part::Saved& sv, typename Part::Deferred& d, typename Part::Context& ctx, T* y,
             const T* x, nn::BlockScratch<T, Space>& s) {
  { d.bytes() } -> std::convertible_to<std::size_t>;
  p.backward(ctx, sv, y, x, x, std::int64_t{}, std::int64_t{}, s, &d);
  p.backward_weights(ctx, sv, d, x, std::int64_t{}, std::int64_t{});
};

// A norm that takes the residual add around it (nn::RMSNorm): residual += delta, then
// out = norm(residual); and dx = norm backward(dout) + dresidual.
template <class Norm, class T, class Context>
concept FusesResidualAdd = requires(Norm& n, typename Norm::Saved& sv, Context& ctx, T* y, const T* x) {
  n.forward_residual(ctx, sv, y, y, x, std::int64_t{});
  n.backward_residual(ctx, sv, y, x, x, x, std::int64_t{});
};

template <class Attention, class Mlp, bool kDefers>
struct PartsDeferred {
  struct type {
    std::size_t bytes() const { return 0; }
  };
};
template <class Attention, class Mlp>
struct PartsDeferred<Attention, Mlp, true> {
  struct type {
    typename Mlp::Deferred mlp;
    typename Attention::Deferred attn;
    std::size_t bytes() const { return mlp.bytes() + attn.bytes(); }
  };
};
}  // namespace detail

template <class Parts, class T, class Backend>
class PreNormBlock {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Config = typename Parts::Config;
  using Norm = typename Parts::Norm;
  using Attention = typename Parts::Attention;
  using Mlp = typename Parts::Mlp;
  using Scratch = nn::BlockScratch<T, Space>;
  static constexpr bool kSharedScratch =
      detail::TakesScratch<Attention, T, Space> && detail::TakesScratch<Mlp, T, Space>;
  static constexpr bool kDefers = detail::DefersWeights<Attention, T, Space> && detail::DefersWeights<Mlp, T, Space>;
  static constexpr bool kFusedResidual = detail::FusesResidualAdd<Norm, T, Context>;

  // What forward keeps for backward, one per micro-batch in flight (nn/layer.hpp).
  // Rl = B·S, or B·S / tp under sequence parallelism.
  struct Saved {
    typename Norm::Saved norm1, norm2;
    Buffer<T, Space> norm1_out;      // (Rl, C)
    typename Attention::Saved attn;  // nn::SelfAttention: qkv, the core's output and lse
    Buffer<T, Space> x_mid;          // (Rl, C)  residual after attention
    Buffer<T, Space> norm2_out;      // (Rl, C)
    typename Mlp::Saved mlp;         // nn::Mlp: the up projection's output and the activation
    std::size_t bytes() const {
      return norm1.bytes() + norm2.bytes() + norm1_out.bytes() + attn.bytes() + x_mid.bytes() + norm2_out.bytes() +
             mlp.bytes();
    }
  };

  // name prefixes every parameter's name ("h.3"); tp: the tensor-parallel group the parts
  // split over (default: none). Under sequence parallelism each rank normalises its own
  // rows: the norms' gradients are partial sums, summed over the group once per step.
  PreNormBlock(const std::string& name, const Config& cfg, nn::TensorParallelGroup tp = {})
      : tp_(tp),
        dim_(cfg.dim),
        norm1_(Parts::attention_norm(name, cfg)),
        attn_(Parts::attention(name, cfg, tp)),
        norm2_(Parts::mlp_norm(name, cfg)),
        mlp_(Parts::mlp(name, cfg, tp)) {
    nn::mark_sequence_parallel<T>(norm1_, tp);
    nn::mark_sequence_parallel<T>(norm2_, tp);
  }

  // The scratch shared by the parts (the model shares its own between blocks; a block
  // alone uses one it owns).
  void use_scratch(Scratch* scratch) { shared_ = scratch; }
  // Context parallelism (nn/context_parallel.hpp), where the attention has it: this
  // rank's rows are its chunks of every sequence; only attention looks across them.
  void set_context_parallel(nn::ContextParallelGroup cp) requires requires(Attention& a) { a.set_context_parallel(cp); }
  { attn_.set_context_parallel(cp); }
  // Selective recomputation (Korthikanti et al. 2022), where the attention has it.
  void set_selective_recompute(bool on) requires nn::HasSelectiveRecompute<Attention> {
    attn_.set_selective_recompute(on);
  }

  // out = block(x); x and out are this rank's rows of (B·S, C) (tp.local_rows).
  void forward(Context& ctx, Saved& sv, T* out, const T* x, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_;
    sv.norm1_out.reserve(local * C);
    sv.x_mid.reserve(local * C);
    sv.norm2_out.reserve(local * C);
    Scratch& s = scratch();
    s.reserve(rows, C, tp_.sequence_parallel());
    norm1_.forward(ctx, sv.norm1, sv.norm1_out.data(), x, local);
    part_forward(attn_, ctx, sv.attn, sv.x_mid.data(), sv.norm1_out.data(), batch, seq, s);
    add_and_norm(norm2_, ctx, sv.norm2, sv.norm2_out.data(), sv.x_mid.data(), x, local);  // x_mid += x
    part_forward(mlp_, ctx, sv.mlp, out, sv.norm2_out.data(), batch, seq, s);
    Backend::add_inplace(ctx, out, sv.x_mid.data(), local * C);
  }

  // Both parts' weight-gradient operands, kept from the input-gradient pass to the
  // weight pass of a zero-bubble schedule (pipeline::zb_h1); empty when a part cannot
  // defer (and then backward_weights does not exist).
  using Deferred = typename detail::PartsDeferred<Attention, Mlp, kDefers>::type;

  // dx = ∂loss/∂x given dout = ∂loss/∂out (this rank's rows); parameter gradients
  // accumulate (the norms', under sequence parallelism, over this rank's rows only).
  // With `defer`, the parts' weight gradients wait for backward_weights.
  void backward(Context& ctx, Saved& sv, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq,
                Scratch& s, Deferred* defer = nullptr) requires kSharedScratch {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_;
    s.reserve(rows, C, tp_.sequence_parallel());
    if constexpr (kDefers) {
      mlp_.backward(ctx, sv.mlp, s.c0.data(), dout, sv.norm2_out.data(), batch, seq, s, defer ? &defer->mlp : nullptr);
    } else {
      mlp_.backward(ctx, sv.mlp, s.c0.data(), dout, sv.norm2_out.data(), batch, seq, s);
    }
    T* dx_mid = s.c1.data();
    norm_backward_add(norm2_, ctx, sv.norm2, dx_mid, s.c0.data(), dout, sv.x_mid.data(), local);  // + the residual path
    if constexpr (kDefers) {
      attn_.backward(ctx, sv.attn, s.c0.data(), dx_mid, sv.norm1_out.data(), batch, seq, s,
                     defer ? &defer->attn : nullptr);
    } else {
      attn_.backward(ctx, sv.attn, s.c0.data(), dx_mid, sv.norm1_out.data(), batch, seq, s);
    }
    norm_backward_add(norm1_, ctx, sv.norm1, dx, s.c0.data(), dx_mid, x, local);  // + the residual path
  }

  // The weight pass after backward(..., defer): the parts' weight gradients in the
  // order backward computes them (bitwise the undivided backward's).
  void backward_weights(Context& ctx, const Saved& sv, const Deferred& d, std::int64_t batch,
                        std::int64_t seq) requires kDefers {
    mlp_.backward_weights(ctx, sv.mlp, d.mlp, sv.norm2_out.data(), batch, seq);
    attn_.backward_weights(ctx, sv.attn, d.attn, sv.norm1_out.data(), batch, seq);
  }

  // The Layer concept's backward (nn/layer.hpp), with the block's scratch.
  void backward(Context& ctx, Saved& sv, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq) {
    if constexpr (kSharedScratch) {
      backward(ctx, sv, dx, dout, x, batch, seq, scratch());
    } else {  // parts with scratch of their own: the block's c0 and c1 carry the gradients between them
      const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_;
      Scratch& s = scratch();
      s.c0.reserve(local * C);
      s.c1.reserve(local * C);
      mlp_.backward(ctx, sv.mlp, s.c0.data(), dout, sv.norm2_out.data(), batch, seq);
      norm_backward_add(norm2_, ctx, sv.norm2, s.c1.data(), s.c0.data(), dout, sv.x_mid.data(), local);
      attn_.backward(ctx, sv.attn, s.c0.data(), s.c1.data(), sv.norm1_out.data(), batch, seq);
      norm_backward_add(norm1_, ctx, sv.norm1, dx, s.c0.data(), s.c1.data(), x, local);
    }
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    norm1_.parameters(visit);
    attn_.parameters(visit);
    norm2_.parameters(visit);
    mlp_.parameters(visit);
  }

  Attention& attention() { return attn_; }
  Mlp& mlp() { return mlp_; }
  // Bytes of the scratch this block owns (a block used alone; the model's is shared).
  std::size_t scratch_bytes() const { return own_scratch_.bytes(); }

 private:
  template <class Part>
  static void part_forward(Part& part, Context& ctx, typename Part::Saved& sv, T* out, const T* x, std::int64_t batch,
                           std::int64_t seq, Scratch& s) {
    if constexpr (detail::TakesScratch<Part, T, Space>)
      part.forward(ctx, sv, out, x, batch, seq, s);
    else
      part.forward(ctx, sv, out, x, batch, seq);
  }
  Scratch& scratch() { return shared_ != nullptr ? *shared_ : own_scratch_; }

  // residual (rows, C) += delta, then out = norm(residual): one pass where the norm fuses them.
  void add_and_norm(Norm& norm, Context& ctx, typename Norm::Saved& sv, T* out, T* residual, const T* delta,
                    std::int64_t rows) {
    if constexpr (kFusedResidual) {
      norm.forward_residual(ctx, sv, out, residual, delta, rows);
    } else {
      Backend::add_inplace(ctx, residual, delta, rows * dim_);
      norm.forward(ctx, sv, out, residual, rows);
    }
  }
  // dx (rows, C) = norm backward(dout) + dresidual (x fed the norm and the residual
  // stream): one pass where the norm fuses them.
  void norm_backward_add(Norm& norm, Context& ctx, const typename Norm::Saved& sv, T* dx, const T* dout,
                         const T* dresidual, const T* x, std::int64_t rows) {
    if constexpr (kFusedResidual) {
      norm.backward_residual(ctx, sv, dx, dout, dresidual, x, rows);
    } else {
      norm.backward(ctx, sv, dx, dout, x, rows);
      Backend::add_inplace(ctx, dx, dresidual, rows * dim_);
    }
  }

  nn::TensorParallelGroup tp_;
  std::int64_t dim_;
  Norm norm1_;
  Attention attn_;
  Norm norm2_;
  Mlp mlp_;
  Scratch own_scratch_;        // a block used alone
  Scratch* shared_ = nullptr;  // the model's, when it set one
};

}  // namespace llmpar::models
