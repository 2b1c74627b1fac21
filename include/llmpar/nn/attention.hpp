// llmpar/nn/attention.hpp — causal multi-head self-attention as a sub-layer: the fused
// QKV projection (column-parallel), the attention kernel, the output projection
// (row-parallel), with a hook for positions.
//
//   out = proj(attention(positions(qkv(x))))
//
// A block is norms, residual adds and sub-layers (models::GPT2Block is two LayerNorms,
// this and an nn::Mlp); a user who changes the MLP keeps this one as it is, and one who
// changes the attention keeps the MLP. It is an nn::Layer (nn/layer.hpp): a Saved per
// micro-batch, forward, backward, parameters.
//
// Grouped-query attention (Ainslie et al. 2023; Llama 2 70B, Llama 3): kv_heads < heads
// key/value heads, each read by heads / kv_heads query heads (core/attention_shape.hpp
// says which). The fused QKV weight is ((heads + 2 kv_heads) · hs, C): q of every head,
// then k, then v. kv_heads == heads is multi-head attention (GPT-2, QKV (3C, C)).
//
// What it communicates. Under tensor parallelism (a TensorParallelGroup of tp ranks)
// each rank holds heads / tp query heads and kv_heads / tp kv heads (tp divides both):
// the QKV weight is split by output features in heads / kv_heads + 2 equal blocks of
// kv_heads heads (nn::Split's groups), so this rank's q, k and v channels sit next to
// each other as the attention kernel reads them and its query heads read its own kv
// heads; the output projection is split by input features, in the same heads / kv_heads
// blocks, so that its columns are this rank's query heads.
// forward receives this rank's rows of the (normalised) input and returns this rank's
// rows of the output, summed over the group: one all-reduce ("g"), or with sequence
// parallelism an all-gather of the input rows before the QKV projection and a
// reduce-scatter after the output projection. backward mirrors it ("f"): dx is summed
// over the group the same way. Nothing else in the block needs to know.
//
// Positions. `Positions` is a type with
//     void forward(Context&, T* qkv, const AttentionShape& local);
//     void backward(Context&, T* dqkv, const AttentionShape& local);
// forward changes q and k of qkv (B, S, R; `local` is this rank's heads, its q_col and
// k_col say where they are) in place after the projection, backward carries ∂q and ∂k
// back through that change in place: rotary embeddings (nn::Rotary in nn/rotary.hpp;
// examples/02_custom_attention has a user's) rotate by +θ and by -θ. The default,
// NoPositions, leaves them alone (GPT-2 adds a learned table to the tokens instead).
//
// Selective recomputation (Korthikanti et al. 2022): forward then keeps the attention
// core's input (the projected qkv) but not its output and lse, which backward recomputes
// by running the same kernel on the same qkv: the same bits.
//
// Scratch: the calls that take an nn::BlockScratch use that one (a block shares its
// own between its sub-layers, a model between its blocks); the others use one this
// layer owns. In backward dx may be the scratch's c0: it is written last.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "llmpar/backend/backend.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/math/rotary.hpp"
#include "llmpar/nn/context_parallel.hpp"
#include "llmpar/nn/parameter.hpp"
#include "llmpar/nn/scratch.hpp"
#include "llmpar/nn/tensor_parallel.hpp"

namespace llmpar::nn {

// The attention's sizes and initialisation (those of the whole layer; a tensor-parallel
// rank holds heads / tp of the heads).
struct AttentionConfig {
  std::int64_t dim = 0;        // C: model width, the input and output channels
  std::int64_t heads = 0;      // NH: C / NH channels per head
  std::int64_t kv_heads = 0;   // key/value heads, dividing heads (0: heads, multi-head attention)
  bool bias = true;            // biases on the QKV and output projections (GPT-2: yes, LLaMA: no)
  float init_std = 0.02f;      // the QKV weight's normal init
  float out_init_std = 0.02f;  // the output projection's (GPT-2 divides by sqrt(2 layers))
  void validate() const {
    LLMPAR_CHECK(heads > 0, "attention heads is ", heads, "; use at least 1 head");
    LLMPAR_CHECK(dim > 0 && dim % heads == 0, "attention dim ", dim, " is not divisible by heads ", heads,
                 "; choose dim as a multiple of heads");
    LLMPAR_CHECK(kv_heads >= 0 && (kv_heads == 0 || heads % kv_heads == 0), "attention kv_heads ", kv_heads,
                 " does not divide the heads ", heads,
                 "; grouped-query attention shares each kv head between heads / kv_heads query heads: pick "
                 "--kv-heads a divisor of --heads");
  }
  std::int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  std::int64_t head_dim() const { return dim / heads; }
  // Output features of the fused QKV projection: (heads + 2 kv_heads) · head_dim.
  std::int64_t qkv_features() const { return (heads + 2 * kv()) * head_dim(); }
};

// No position information inside attention: the default Positions.
struct NoPositions {
  template <class Context, class T>
  void forward(Context&, T*, const AttentionShape&) const {}
  template <class Context, class T>
  void backward(Context&, T*, const AttentionShape&) const {}
};

// Rotary position embeddings (math/rotary.hpp: the rotate-half layout, θ and Llama 3's
// frequency scaling) as a Positions, on the backend's kernel: Llama's. Under context
// parallelism a row's angle is its position in the whole sequence.
template <class Backend>
struct Rotary {
  math::RopeConfig rope;
  ContextParallelGroup cp{};
  void set_context_parallel(ContextParallelGroup group) { cp = group; }
  template <class T>
  void forward(typename Backend::Context& ctx, T* qkv, const AttentionShape& local) const {
    Backend::rotary(ctx, qkv, local, rope, false, cp.positions(local.seq * cp.size()));
  }
  template <class T>
  void backward(typename Backend::Context& ctx, T* dqkv, const AttentionShape& local) const {
    Backend::rotary(ctx, dqkv, local, rope, true, cp.positions(local.seq * cp.size()));
  }
};

template <class T, class Backend = backend::Cpu, class Positions = NoPositions>
class SelfAttention {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Scratch = BlockScratch<T, Space>;

  // One micro-batch's activations (Cl = C / tp, Rl = this rank's QKV features: 3Cl
  // for multi-head attention). att_out and lse stay empty under selective
  // recomputation. Under context parallelism by all-to-all, qkv holds every row of the
  // whole sequences (B, cp·S, Rl / cp) for this rank's 1/cp of the heads, and lse
  // those heads' (detail::ContextParallelCore::prepare).
  struct Saved {
    Buffer<T, Space> qkv;      // (B, S, Rl) after Positions::forward
    Buffer<T, Space> att_out;  // (B, S, Cl)
    Buffer<Acc, Space> lse;    // (B, NH/tp, S)
    std::size_t bytes() const { return qkv.bytes() + att_out.bytes() + lse.bytes(); }
  };

  // The weight gradients' operands, kept from the input-gradient pass for the weight
  // pass of a zero-bubble schedule (pipeline::zb_h1): each projection's dy, and the
  // inputs Saved does not hold (gathered rows under sequence parallelism, the core's
  // output under selective recomputation).
  struct Deferred {
    Buffer<T, Space> dy_proj, dy_qkv;  // (B·S, C), (B·S, Rl)
    Buffer<T, Space> x_proj, x_qkv;    // (B·S, Cl), (B·S, C) when not in Saved
    std::size_t bytes() const { return dy_proj.bytes() + dy_qkv.bytes() + x_proj.bytes() + x_qkv.bytes(); }
  };

  // qkv_name, proj_name: the two projections' parameter names (GPT-2's "h.0.attn.c_attn"
  // and "h.0.attn.c_proj"; ".weight" and ".bias" are appended).
  SelfAttention(const std::string& qkv_name, const std::string& proj_name, const AttentionConfig& cfg,
                TensorParallelGroup tp = {}, Positions positions = {})
      : tp_(tp),
        dim_((cfg.validate(), cfg.dim)),
        heads_((tp.check_divides(cfg.heads, "heads"), cfg.heads / tp.size())),
        kv_heads_((tp.check_divides(cfg.kv(), "kv heads"), cfg.kv() / tp.size())),
        head_dim_(cfg.head_dim()),
        local_dim_(cfg.dim / tp.size()),
        positions_(std::move(positions)),
        qkv_(qkv_name, cfg.dim, cfg.qkv_features(), cfg.bias, cfg.init_std, tp,
             static_cast<int>(cfg.heads / cfg.kv() + 2)),
        proj_(proj_name, cfg.dim, cfg.dim, cfg.bias, cfg.out_init_std, tp, static_cast<int>(cfg.heads / cfg.kv())) {}

  void set_selective_recompute(bool on) { selective_ = on; }
  bool selective_recompute() const { return selective_; }

  // Context parallelism over `cp`: this rank's rows are its two chunks of every
  // sequence (nn/context_parallel.hpp), and the core reaches the other ranks' rows by
  // ring attention or by an all-to-all over the heads (cp.how()). The Positions must
  // follow the chunks (set_context_parallel), or place nothing.
  void set_context_parallel(ContextParallelGroup cp) {
    if (cp.split()) {
      LLMPAR_CHECK(Core::supports(cp.how()), "context parallelism (--cp-comm ", cp_comm_name(cp.how()), ") on the ",
                   Backend::kName, " backend",
                   std::is_same_v<T, double> ? " of a double model (communicators carry float, bf16 and f16)"
                                             : " is not built yet (ring attention runs on backend::Cpu)",
                   "; use --cp 1 there");
      cp.check_heads(kv_heads_, tp_.size());
      if constexpr (requires { positions_.set_context_parallel(cp); })
        positions_.set_context_parallel(cp);
      else
        LLMPAR_CHECK((std::is_same_v<Positions, NoPositions>), "context parallelism (--cp ", cp.size(),
                     "): this attention's Positions type places rows by their index in the rank's chunks; give it "
                     "set_context_parallel(nn::ContextParallelGroup) and place each row at cp.positions(seq)'s "
                     "position in the whole sequence (nn::Rotary does)");
    }
    cp_ = cp;
  }

  // out = attention(x): x and out are this rank's rows of (B·S, C) (all of them, or
  // B·S/tp under sequence parallelism); out is summed over the group. out may not be x.
  void forward(Context& ctx, Saved& sv, T* out, const T* x, std::int64_t batch, std::int64_t seq, Scratch& s) {
    const std::int64_t rows = batch * seq, C = dim_;
    const bool sp = tp_.sequence_parallel();
    tp_.check_sequence(seq);
    sv.qkv.reserve(rows * qkv_width());
    if (sp) s.reserve_sequence_parallel(rows, C);
    tp_.template wait_for_kernels<Backend>(ctx);
    qkv_.forward(ctx, sv.qkv.data(), tp_.gather_rows(s.gathered.data(), x, rows, C), rows);
    positions_.forward(ctx, sv.qkv.data(), shape(batch, seq));
    if (cp_.split()) Core::prepare(ctx, cp_, sv.qkv.data(), shape(batch, seq), s);
    const T* att_out = core(ctx, sv, s, batch, seq);
    T* partial = sp ? s.partial.data() : out;
    proj_.forward_partial(ctx, partial, att_out, rows);
    tp_.reduce_rows(out, partial, rows, C);  // "g"
  }
  void forward(Context& ctx, Saved& sv, T* out, const T* x, std::int64_t batch, std::int64_t seq) {
    forward(ctx, sv, out, x, batch, seq, own_scratch_);
  }

  // dx = ∂loss/∂x from dout = ∂loss/∂out (this rank's rows, as in forward), x the
  // forward's input; the projections' gradients accumulate. With `defer` their weight
  // gradients are left for backward_weights and their operands go into *defer.
  void backward(Context& ctx, Saved& sv, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq,
                Scratch& s, Deferred* defer = nullptr) {
    const std::int64_t rows = batch * seq, C = dim_, Cl = local_dim_, Rl = qkv_width();
    const bool sp = tp_.sequence_parallel();
    s.c0.reserve(rows * Cl);
    s.qkv.reserve(rows * Rl);
    if (sp) s.reserve_sequence_parallel(rows, C);
    const T* att_out = selective_ ? core(ctx, sv, s, batch, seq) : sv.att_out.data();
    const Acc* lse = selective_ ? s.lse.data() : sv.lse.data();
    tp_.template wait_for_kernels<Backend>(ctx);
    // The row-parallel projection sees every row of dout ("g" backward).
    const T* dy = tp_.gather_rows(s.gathered.data(), dout, rows, C);
    if (defer) {
      proj_.linear().input_backward(ctx, s.c0.data(), dy, rows);
      keep_copy<Backend>(ctx, defer->dy_proj, dy, rows * C);
      if (selective_) keep_copy<Backend>(ctx, defer->x_proj, att_out, rows * Cl);
    } else {
      proj_.backward(ctx, s.c0.data(), dy, att_out, rows);
    }
    if (cp_.split())
      Core::backward(ctx, cp_, s.qkv.data(), s.c0.data(), sv.qkv.data(), att_out, lse, shape(batch, seq), s);
    else
      Backend::attention_backward(ctx, s.qkv.data(), s.c0.data(), sv.qkv.data(), att_out, lse, shape(batch, seq));
    positions_.backward(ctx, s.qkv.data(), shape(batch, seq));
    T* dx_partial = sp ? s.partial.data() : dx;
    const T* x_qkv = tp_.gather_rows(s.gathered.data(), x, rows, C);
    if (defer) {
      qkv_.linear().input_backward(ctx, dx_partial, s.qkv.data(), rows);
      tp_.template wait_for_kernels<Backend>(ctx);
      keep_copy<Backend>(ctx, defer->dy_qkv, s.qkv.data(), rows * Rl);
      if (sp) keep_copy<Backend>(ctx, defer->x_qkv, x_qkv, rows * C);
    } else {
      qkv_.backward_partial(ctx, dx_partial, s.qkv.data(), x_qkv, rows);
    }
    tp_.reduce_rows(dx, dx_partial, rows, C);  // "f" backward
  }
  void backward(Context& ctx, Saved& sv, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq) {
    backward(ctx, sv, dx, dout, x, batch, seq, own_scratch_);
  }

  // The weight pass after backward(..., defer): the projections' weight and bias
  // gradients from the kept operands, in the order backward computes them (bitwise the
  // undivided backward's). x: the forward's input, as backward got it.
  void backward_weights(Context& ctx, const Saved& sv, const Deferred& d, const T* x, std::int64_t batch,
                        std::int64_t seq) {
    const std::int64_t rows = batch * seq;
    proj_.linear().weight_bias_backward(ctx, d.dy_proj.data(), selective_ ? d.x_proj.data() : sv.att_out.data(), rows);
    qkv_.linear().weight_bias_backward(ctx, d.dy_qkv.data(), tp_.sequence_parallel() ? d.x_qkv.data() : x, rows);
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    qkv_.parameters(visit);
    proj_.parameters(visit);
  }

  ColumnParallelLinear<T, Backend>& qkv() { return qkv_; }
  RowParallelLinear<T, Backend>& proj() { return proj_; }
  Positions& positions() { return positions_; }
  std::int64_t local_heads() const { return heads_; }
  std::int64_t local_kv_heads() const { return kv_heads_; }
  std::int64_t local_dim() const { return local_dim_; }
  // This rank's heads of a (batch, seq) micro-batch, as the attention kernels take them.
  AttentionShape shape(std::int64_t batch, std::int64_t seq) const {
    return {batch, seq, heads_, kv_heads_, head_dim_};
  }
  // This rank's QKV features per row: (heads + 2 kv_heads) / tp · head_dim.
  std::int64_t qkv_width() const { return (heads_ + 2 * kv_heads_) * head_dim_; }
  // Bytes of the scratch this layer owns (used alone; a block's sub-layers share its),
  // and of ring attention's buffers.
  std::size_t scratch_bytes() const { return own_scratch_.bytes(); }

 private:
  using Core = detail::ContextParallelCore<T, Backend>;

  // The attention core on sv.qkv (under context parallelism: against every cp rank's
  // keys), into sv (kept) or the scratch (selective recomputation); returns its output.
  const T* core(Context& ctx, Saved& sv, Scratch& s, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq;
    Buffer<T, Space>& out = selective_ ? s.att_out : sv.att_out;
    Buffer<Acc, Space>& lse = selective_ ? s.lse : sv.lse;
    out.reserve(rows * local_dim_);
    lse.reserve(batch * heads_ * seq);
    if (cp_.split())
      Core::forward(ctx, cp_, out.data(), lse.data(), sv.qkv.data(), shape(batch, seq), s);
    else
      Backend::attention_forward(ctx, out.data(), lse.data(), sv.qkv.data(), shape(batch, seq));
    return out.data();
  }

  TensorParallelGroup tp_;
  ContextParallelGroup cp_;
  std::int64_t dim_;
  std::int64_t heads_;      // this rank's query heads: NH / tp
  std::int64_t kv_heads_;   // this rank's kv heads: KVH / tp
  std::int64_t head_dim_;   // hs = C / NH
  std::int64_t local_dim_;  // this rank's channels: C / tp
  bool selective_ = false;
  Positions positions_;
  ColumnParallelLinear<T, Backend> qkv_;  // ((NH + 2 KVH) hs, C): q, k, v of this rank's heads
  RowParallelLinear<T, Backend> proj_;    // (C, C)
  Scratch own_scratch_;                   // used alone
};

}  // namespace llmpar::nn
