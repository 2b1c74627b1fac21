// llmpar/nn/mlp.hpp — the transformer's MLP as a sub-layer: an up projection
// (column-parallel), an activation, a down projection (row-parallel).
//
//   out = down(act(up(x)))
//
// The activation is a type (the MLP's policy):
//   nn::Gelu    GPT-2: act = gelu_tanh(pre), pre of width H; fused into the up
//               projection's GEMM epilogue and the down projection's backward GEMM
//               where the backend can (cuBLASLt), so the GPT-2 block runs exactly the
//               kernels it always has.
//   nn::SwiGlu  LLaMA (Shazeer 2020): act = silu(g) · u, pre = [g, u] of width 2H.
//   nn::GeGlu   Gemma: act = gelu_tanh(g) · u.
// or a user's type with the same three members (examples/03_bf16_elementwise):
//   static constexpr int kProjections;  // up projection width / H: 1, or 2 for a gated unit
//   template <class Backend, class T> static void forward(Context&, T* act, const T* pre,
//       std::int64_t rows, std::int64_t hidden);     // act (rows, H) from pre (rows, kP·H)
//   template <class Backend, class T> static void backward(Context&, T* dpre, const T* dact,
//       const T* pre, std::int64_t rows, std::int64_t hidden);   // dpre overwritten
// (nn::check_activation says which is missing).
//
// What it communicates: the up projection is split by output features (with groups =
// kProjections, so each rank holds the gate and the up values of the same hidden
// units and the activation is local), the down projection by input features; forward
// returns this rank's rows of the output summed over the group (one all-reduce, or the
// all-gather / reduce-scatter pair under sequence parallelism), backward the same for
// dx. As nn::SelfAttention: an nn::Layer, scratch shared or owned, and dx may be the
// scratch's c0 (written last).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "llmpar/backend/backend.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/math/activation.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/scratch.hpp"
#include "llmpar/nn/tensor_parallel.hpp"

namespace llmpar::nn {

// GELU (tanh approximation): fused into the projections' GEMMs by nn::Mlp.
struct Gelu {
  static constexpr int kProjections = 1;
  template <class Backend, class T>
  static void forward(typename Backend::Context& ctx, T* act, const T* pre, std::int64_t rows, std::int64_t hidden) {
    Backend::gelu_forward(ctx, act, pre, rows * hidden);
  }
  template <class Backend, class T>
  static void backward(typename Backend::Context& ctx, T* dpre, const T* dact, const T* pre, std::int64_t rows,
                       std::int64_t hidden) {
    Backend::gelu_backward(ctx, dpre, pre, dact, rows * hidden);
  }
};

// A gated linear unit over the backend's kernel: act = gate(g) · u.
template <math::Gate G>
struct GatedUnit {
  static constexpr int kProjections = 2;
  template <class Backend, class T>
  static void forward(typename Backend::Context& ctx, T* act, const T* pre, std::int64_t rows, std::int64_t hidden) {
    Backend::glu_forward(ctx, act, pre, rows, hidden, G);
  }
  template <class Backend, class T>
  static void backward(typename Backend::Context& ctx, T* dpre, const T* dact, const T* pre, std::int64_t rows,
                       std::int64_t hidden) {
    Backend::glu_backward(ctx, dpre, dact, pre, rows, hidden, G);
  }
};
using SwiGlu = GatedUnit<math::Gate::silu>;
using GeGlu = GatedUnit<math::Gate::gelu>;

// Checks an activation type member by member, each with its own sentence.
template <class A, class Backend, class T>
consteval bool check_activation() {
  static_assert(requires { A::kProjections; },
                "llmpar::nn::Mlp: the activation type has no `static constexpr int kProjections` (1: act = f(pre), "
                "2: a gated unit over [g, u])");
  if constexpr (requires { A::kProjections; })
    static_assert(A::kProjections == 1 || A::kProjections == 2,
                  "llmpar::nn::Mlp: the activation's kProjections must be 1 or 2");
  static_assert(requires(typename Backend::Context& ctx, T* out, const T* in, std::int64_t n) {
    A::template forward<Backend>(ctx, out, in, n, n);
  }, "llmpar::nn::Mlp: the activation type has no `template <class Backend, class T> static void "
     "forward(Backend::Context&, T* act, const T* pre, std::int64_t rows, std::int64_t hidden)`");
  static_assert(requires(typename Backend::Context& ctx, T* out, const T* in, std::int64_t n) {
    A::template backward<Backend>(ctx, out, in, in, n, n);
  }, "llmpar::nn::Mlp: the activation type has no `template <class Backend, class T> static void "
     "backward(Backend::Context&, T* dpre, const T* dact, const T* pre, std::int64_t rows, std::int64_t hidden)`");
  return true;
}

// The MLP's sizes and initialisation (the whole layer's; a rank holds hidden / tp).
struct MlpConfig {
  std::int64_t dim = 0;        // C: the input and output channels
  std::int64_t hidden = 0;     // H: GPT-2 4C, LLaMA about 8C/3
  bool bias = true;            // biases on both projections
  float init_std = 0.02f;      // the up projection's normal init
  float out_init_std = 0.02f;  // the down projection's
  void validate() const {
    LLMPAR_CHECK(dim > 0, "MLP dim is ", dim, "; it must be positive");
    LLMPAR_CHECK(hidden > 0, "MLP hidden is ", hidden, "; the MLP needs at least 1 hidden unit");
  }
};

template <class T, class Backend = backend::Cpu, class Act = Gelu>
class Mlp {
  static_assert(check_activation<Act, Backend, T>());

 public:
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Scratch = BlockScratch<T, Space>;
  static constexpr int kProjections = Act::kProjections;
  // GELU runs in the GEMMs' epilogues.
  static constexpr bool kFused = std::is_same_v<Act, Gelu>;

  // One micro-batch's activations (Hl = H / tp).
  struct Saved {
    Buffer<T, Space> pre;  // (B·S, kProjections·Hl) the up projection's output
    Buffer<T, Space> act;  // (B·S, Hl)
    std::size_t bytes() const { return pre.bytes() + act.bytes(); }
  };
  // The weight pass's operands (pipeline::zb_h1), as nn::SelfAttention::Deferred.
  struct Deferred {
    Buffer<T, Space> dy_down, dy_up;  // (B·S, C), (B·S, kP·Hl)
    Buffer<T, Space> x_up;            // (B·S, C) sequence parallelism only
    std::size_t bytes() const { return dy_down.bytes() + dy_up.bytes() + x_up.bytes(); }
  };

  // up_name, down_name: the projections' parameter names (GPT-2's "h.0.mlp.c_fc" and
  // "h.0.mlp.c_proj").
  Mlp(const std::string& up_name, const std::string& down_name, const MlpConfig& cfg, TensorParallelGroup tp = {})
      : tp_(tp),
        dim_((cfg.validate(), cfg.dim)),
        hidden_local_((tp.check_divides(cfg.hidden, "MLP hidden"), cfg.hidden / tp.size())),
        up_(up_name, cfg.dim, kProjections * cfg.hidden, cfg.bias, cfg.init_std, tp, kProjections),
        down_(down_name, cfg.hidden, cfg.dim, cfg.bias, cfg.out_init_std, tp) {}

  // out = mlp(x): x and out are this rank's rows of (B·S, C); out is summed over the
  // group. out may not be x.
  void forward(Context& ctx, Saved& sv, T* out, const T* x, std::int64_t batch, std::int64_t seq, Scratch& s) {
    const std::int64_t rows = batch * seq, C = dim_, Hl = hidden_local_;
    const bool sp = tp_.sequence_parallel();
    tp_.check_sequence(seq);
    sv.pre.reserve(rows * kProjections * Hl);
    sv.act.reserve(rows * Hl);
    if (sp) s.reserve_sequence_parallel(rows, C);
    tp_.template wait_for_kernels<Backend>(ctx);
    const T* x_up = tp_.gather_rows(s.gathered.data(), x, rows, C);
    if constexpr (kFused) {
      up_.forward_gelu(ctx, sv.act.data(), sv.pre.data(), x_up, rows);
    } else {
      up_.forward(ctx, sv.pre.data(), x_up, rows);
      Act::template forward<Backend>(ctx, sv.act.data(), sv.pre.data(), rows, Hl);
    }
    T* partial = sp ? s.partial.data() : out;
    down_.forward_partial(ctx, partial, sv.act.data(), rows);
    tp_.reduce_rows(out, partial, rows, C);  // "g"
  }
  void forward(Context& ctx, Saved& sv, T* out, const T* x, std::int64_t batch, std::int64_t seq) {
    forward(ctx, sv, out, x, batch, seq, own_scratch_);
  }

  // dx = ∂loss/∂x from dout (this rank's rows), x the forward's input; the projections'
  // gradients accumulate, or with `defer` their weight gradients wait for
  // backward_weights.
  void backward(Context& ctx, Saved& sv, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq,
                Scratch& s, Deferred* defer = nullptr) {
    const std::int64_t rows = batch * seq, C = dim_, Hl = hidden_local_;
    const bool sp = tp_.sequence_parallel();
    s.wide0.reserve(rows * kProjections * Hl);
    if constexpr (!kFused) s.wide1.reserve(rows * Hl);
    if (sp) s.reserve_sequence_parallel(rows, C);
    T* dpre = s.wide0.data();
    tp_.template wait_for_kernels<Backend>(ctx);
    // The row-parallel projection sees every row of dout ("g" backward).
    const T* dy = tp_.gather_rows(s.gathered.data(), dout, rows, C);
    if constexpr (kFused) {
      if (defer) {
        down_.linear().input_backward_through_gelu(ctx, dpre, dy, sv.pre.data(), rows);
        keep_copy<Backend>(ctx, defer->dy_down, dy, rows * C);
      } else {
        down_.backward_through_gelu(ctx, dpre, dy, sv.act.data(), sv.pre.data(), rows);
      }
    } else {
      if (defer) {
        down_.linear().input_backward(ctx, s.wide1.data(), dy, rows);
        keep_copy<Backend>(ctx, defer->dy_down, dy, rows * C);
      } else {
        down_.backward(ctx, s.wide1.data(), dy, sv.act.data(), rows);
      }
      Act::template backward<Backend>(ctx, dpre, s.wide1.data(), sv.pre.data(), rows, Hl);
    }
    tp_.template wait_for_kernels<Backend>(ctx);
    T* dx_partial = sp ? s.partial.data() : dx;
    const T* x_up = tp_.gather_rows(s.gathered.data(), x, rows, C);
    if (defer) {
      up_.linear().input_backward(ctx, dx_partial, dpre, rows);
      tp_.template wait_for_kernels<Backend>(ctx);
      keep_copy<Backend>(ctx, defer->dy_up, dpre, rows * kProjections * Hl);
      if (sp) keep_copy<Backend>(ctx, defer->x_up, x_up, rows * C);
    } else {
      up_.backward_partial(ctx, dx_partial, dpre, x_up, rows);
    }
    tp_.reduce_rows(dx, dx_partial, rows, C);  // "f" backward
  }
  void backward(Context& ctx, Saved& sv, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq) {
    backward(ctx, sv, dx, dout, x, batch, seq, own_scratch_);
  }

  // The weight pass after backward(..., defer), in backward's order. x: the forward's input.
  void backward_weights(Context& ctx, const Saved& sv, const Deferred& d, const T* x, std::int64_t batch,
                        std::int64_t seq) {
    const std::int64_t rows = batch * seq;
    down_.linear().weight_bias_backward(ctx, d.dy_down.data(), sv.act.data(), rows);
    up_.linear().weight_bias_backward(ctx, d.dy_up.data(), tp_.sequence_parallel() ? d.x_up.data() : x, rows);
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    up_.parameters(visit);
    down_.parameters(visit);
  }

  ColumnParallelLinear<T, Backend>& up() { return up_; }
  RowParallelLinear<T, Backend>& down() { return down_; }
  std::int64_t local_hidden() const { return hidden_local_; }
  std::size_t scratch_bytes() const { return own_scratch_.bytes(); }

 private:

  TensorParallelGroup tp_;
  std::int64_t dim_;
  std::int64_t hidden_local_;             // this rank's hidden units: H / tp
  ColumnParallelLinear<T, Backend> up_;   // (kP·H, C)
  RowParallelLinear<T, Backend> down_;    // (C, H)
  Scratch own_scratch_;                   // used alone
};

}  // namespace llmpar::nn
