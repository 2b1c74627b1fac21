// custom_layer.hpp — a LLaMA-style transformer block written by a user of llmpar, and
// the language model of those blocks. examples/custom_layer.cpp trains it;
// tests/test_custom_layer.cpp checks it against finite differences and checks that it
// trains under tensor and sequence parallelism exactly as it trains alone.
//
// What a user writes, and why it is enough:
//
//  - A layer is a plain class with a Saved type, forward(ctx, saved, out, x, batch, seq),
//    backward(ctx, saved, dx, dout, x, batch, seq) and parameters(visit) (nn/layer.hpp).
//    There is no autograd tape to extend and no base class: the block calls llmpar's
//    layers and kernels, runs its own element-wise code between them, and writes the
//    backward in the reverse order. `static_assert(nn::check_layer<...>())` says in a
//    sentence what is missing if a member is.
//
//  - What forward keeps for backward is a plain struct of buffers, Saved, with bytes():
//    the caller owns one per micro-batch in flight (a pipeline holds several, and full
//    recomputation refills a scratch one just before backward), so the block's own
//    members are its parameters and the scratch that is dead after each call. Splitting
//    the two is the user's only bookkeeping; the norms' Saved nest inside the block's.
//
//  - Selective recomputation is one flag (set_selective_recompute): forward writes the
//    attention core's outputs to the block's scratch instead of its Saved, and backward
//    runs the attention kernel again on the saved qkv first. The kernel is
//    deterministic, so the gradients are the same bits.
//
//  - Tensor parallelism comes from the building blocks, not from the block: the QKV and
//    gate/up projections are ColumnParallelLinear, the output projections
//    RowParallelLinear (Megatron's f and g, nn/tensor_parallel.hpp). Everything between
//    a column-parallel and a row-parallel layer is local to a rank — this rank's heads,
//    this rank's slice of the MLP's hidden units — so the user's element-wise code runs
//    on local tensors and needs no communication, as long as each rank holds *matching*
//    slices: the q and k of the same heads (QKV with groups 3) and the gate and up of
//    the same hidden units (gate/up with groups 2). That is all `groups` is for.
//
//  - Sequence parallelism is four calls of the group around each split pair
//    (gather_rows before, forward_partial + reduce_rows after), and marking the norms,
//    whose gradients each rank computes over its rows only (nn::mark_sequence_parallel).
//
//  - Every parameter is declared once (name, shape, init, split) and reached only
//    through parameters(visit). The store, the initialisation from (seed, name, index),
//    the optimizer, gradient clipping across tensor-parallel ranks and the trainer all
//    work from that call, so nothing in llmpar changes for a new block.
//
//  - The model around the blocks is llmpar's (models::Transformer): a LlamaSpec of a
//    dozen lines names the block, the final norm and the parameter names.
//
// Example 04 of examples/README.md: the whole block by hand, where 01 and 02 build
// theirs from llmpar's parts (models::PreNormBlock). The user's own code here is rotary
// position embeddings (Su et al. 2021; examples/common/rotary.hpp, shared with 02) and
// the SwiGLU activation (Shazeer 2020), each with its exact backward. It runs in plain host
// loops, so the block is for backends whose memory the host can read (backend::Cpu); on
// the CUDA backend the same two functions would be small kernels, and the static_assert
// in LlamaBlock says so.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <llmpar/llmpar.hpp>
#include <llmpar/nn/rmsnorm.hpp>
#include <string>
#include <vector>

#include "common/rotary.hpp"

namespace custom_layer {

using examples::Rotary;

using namespace llmpar;

struct LlamaConfig {
  std::int64_t layers = 4;
  std::int64_t heads = 4;
  std::int64_t dim = 128;
  std::int64_t hidden = 384;        // SwiGLU width: about 8/3 · dim, rounded to a multiple of 64
  std::int64_t max_seq = 64;        // the longest sequence (rows of the rotary tables)
  std::int64_t vocab = 256;         // bytes
  std::int64_t padded_vocab = 256;  // rows of the token table, >= vocab
  float init_std = 0.02f;
  float rope_base = 10000.0f;
  float norm_eps = 1e-5f;

  void validate() const {
    LLMPAR_CHECK(layers > 0, "layers is ", layers, "; the model needs at least 1 layer");
    LLMPAR_CHECK(heads > 0, "heads is ", heads, "; use at least 1 attention head");
    LLMPAR_CHECK(dim > 0 && dim % heads == 0, "dim ", dim, " is not divisible by heads ", heads,
                 "; choose dim as a multiple of heads");
    LLMPAR_CHECK((dim / heads) % 2 == 0, "the head size dim / heads = ", dim / heads,
                 " is odd; rotary embeddings rotate pairs of channels, so choose an even head size");
    LLMPAR_CHECK(hidden > 0, "hidden is ", hidden, "; the MLP needs at least 1 hidden unit");
    LLMPAR_CHECK(max_seq > 0, "max_seq is ", max_seq, "; the sequence length must be positive");
    LLMPAR_CHECK(vocab > 0 && vocab <= 65536, "vocab is ", vocab, "; it must be in [1, 65536]");
    LLMPAR_CHECK(padded_vocab >= vocab, "padded_vocab ", padded_vocab, " is smaller than vocab ", vocab);
    LLMPAR_CHECK(rope_base > 1.0f, "rope_base is ", rope_base, "; rotary frequencies need a base > 1");
  }

  // Token table, per block 4·C² (attention) + 3·C·H (MLP) + 2·C (norms), the final norm.
  std::int64_t num_parameters() const {
    return padded_vocab * dim + layers * (4 * dim * dim + 3 * dim * hidden + 2 * dim) + dim;
  }
};

// ---- The user's element-wise code ---------------------------------------------------

// SwiGLU: act = silu(gate) · up, silu(g) = g · σ(g). gate_up (rows, 2·Hl) holds, per
// row, this rank's Hl gate units followed by the same Hl up units (ColumnParallelLinear
// with groups 2 lays them out that way); act (rows, Hl).
template <class T>
void swiglu_forward(T* act, const T* gate_up, std::int64_t rows, std::int64_t hidden_local) {
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * hidden_local;
    const T* u = g + hidden_local;
    for (std::int64_t j = 0; j < hidden_local; ++j) {
      const T sigma = T(1) / (T(1) + std::exp(-g[j]));
      act[r * hidden_local + j] = g[j] * sigma * u[j];
    }
  }
}

// dgate_up (rows, 2·Hl) from dact (rows, Hl): dgate = dact · up · silu'(gate) with
// silu'(g) = σ(g) (1 + g (1 - σ(g))), dup = dact · silu(gate).
template <class T>
void swiglu_backward(T* dgate_up, const T* dact, const T* gate_up, std::int64_t rows, std::int64_t hidden_local) {
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * hidden_local;
    const T* u = g + hidden_local;
    const T* d = dact + r * hidden_local;
    T* dg = dgate_up + r * 2 * hidden_local;
    T* du = dg + hidden_local;
    for (std::int64_t j = 0; j < hidden_local; ++j) {
      const T sigma = T(1) / (T(1) + std::exp(-g[j]));
      dg[j] = d[j] * u[j] * sigma * (T(1) + g[j] * (T(1) - sigma));
      du[j] = d[j] * g[j] * sigma;
    }
  }
}

// ---- The block ----------------------------------------------------------------------

// x + attn(rmsnorm(x)), then + swiglu_mlp(rmsnorm(·)). Under tensor parallelism (tp) the
// attention splits its heads and the MLP its hidden units over the group's ranks; the
// norms and the residual stream are whole on every rank, or, with sequence parallelism,
// hold this rank's rows. The four calls around each split pair are the whole of it:
// gather_rows before a column-parallel layer, forward_partial + reduce_rows after a
// row-parallel one (and the same in backward); without sequence parallelism they are an
// all-reduce and three no-ops.
//
// What forward keeps for backward is the block's Saved, one per micro-batch in flight,
// owned by the caller. What is dead once a call returns (the gradients, the gathered
// rows and partial sums of sequence parallelism, and under selective recomputation the
// attention core's outputs) is scratch the block owns, shared by every micro-batch.
template <class T, class Backend = backend::Cpu>
class LlamaBlock {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using Norm = nn::RMSNorm<T, Backend>;
  static_assert(Space::kHostAccessible,
                "LlamaBlock: the rotary and SwiGLU code is written as host loops over the backend's memory; use "
                "backend::Cpu, or write those two functions as kernels for a device backend");

  // One micro-batch's activations (Cl = C / tp, Hl = H / tp; Rl = B·S, or B·S/tp under
  // sequence parallelism). att_out and lse stay empty under selective recomputation.
  struct Saved {
    typename Norm::Saved attention_norm;  // (Rl) 1/rms
    Buffer<T, Space> norm1_out;           // (Rl, C)
    Buffer<T, Space> qkv;                 // (B, S, 3Cl), q and k rotated
    Buffer<T, Space> att_out;             // (B, S, Cl)
    Buffer<Acc, Space> lse;               // (B, NH/tp, S)
    Buffer<T, Space> x_mid;               // (Rl, C)  residual after attention
    typename Norm::Saved ffn_norm;        // (Rl) 1/rms
    Buffer<T, Space> norm2_out;           // (Rl, C)
    Buffer<T, Space> gate_up;             // (B, S, 2Hl)
    Buffer<T, Space> act;                 // (B, S, Hl)
    std::size_t bytes() const {
      return attention_norm.bytes() + norm1_out.bytes() + qkv.bytes() + att_out.bytes() + lse.bytes() + x_mid.bytes() +
             ffn_norm.bytes() + norm2_out.bytes() + gate_up.bytes() + act.bytes();
    }
  };

  LlamaBlock(const std::string& name, const LlamaConfig& cfg, nn::TensorParallelGroup tp = {})
      : tp_(tp),
        dim_(cfg.dim),
        heads_((tp.check_divides(cfg.heads, "heads"), cfg.heads / tp.size())),
        local_dim_(cfg.dim / tp.size()),
        hidden_local_((tp.check_divides(cfg.hidden, "hidden"), cfg.hidden / tp.size())),
        rotary_(cfg.dim / cfg.heads, cfg.max_seq, cfg.rope_base),
        attention_norm_(name + ".attention_norm", cfg.dim, cfg.norm_eps),
        wqkv_(name + ".attention.wqkv", cfg.dim, 3 * cfg.dim, false, cfg.init_std, tp, 3),
        wo_(name + ".attention.wo", cfg.dim, cfg.dim, false, residual_std(cfg), tp),
        ffn_norm_(name + ".ffn_norm", cfg.dim, cfg.norm_eps),
        w_gate_up_(name + ".feed_forward.w_gate_up", cfg.dim, 2 * cfg.hidden, false, cfg.init_std, tp, 2),
        w_down_(name + ".feed_forward.w_down", cfg.hidden, cfg.dim, false, residual_std(cfg), tp) {
    nn::mark_sequence_parallel<T>(attention_norm_, tp);
    nn::mark_sequence_parallel<T>(ffn_norm_, tp);
  }

  // Selective recomputation (Korthikanti et al. 2022): forward keeps the attention core's
  // inputs (the rotated qkv) but not its outputs, and backward runs attention_forward
  // again before it needs them. The core's output and lse are B·S·Cl + B·NH/tp·S of a
  // Saved, for one attention_forward per backward; the recomputed values are the saved
  // ones bit for bit (the same kernel on the same qkv), so training does not change.
  // Takes effect from the next forward: a Saved filled with it off still holds them.
  void set_selective_recompute(bool on) { selective_ = on; }
  bool selective_recompute() const { return selective_; }

  // out = block(x). x and out are (B, S, C), or under sequence parallelism this rank's
  // B·S/tp rows of them (tp.local_rows). Keeps what backward needs in saved.
  void forward(Context& ctx, Saved& saved, T* out, const T* x, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_;
    const bool sp = tp_.sequence_parallel();
    reserve(saved, batch, seq);
    // Attention on this rank's heads: every row enters ("f": all-gather of the rows under
    // sequence parallelism, nothing without), the heads' partial sums leave ("g").
    attention_norm_.forward(ctx, saved.attention_norm, saved.norm1_out.data(), x, local);
    wqkv_.forward(ctx, saved.qkv.data(), tp_.gather_rows(gathered_.data(), saved.norm1_out.data(), rows, C), rows);
    rotary_.rotate(saved.qkv.data(), shape(batch, seq), Rotary<T>::Direction::forward);
    T* att_out = selective_ ? att_out_.data() : saved.att_out.data();
    Acc* lse = selective_ ? lse_.data() : saved.lse.data();
    Backend::attention_forward(ctx, att_out, lse, saved.qkv.data(), shape(batch, seq));
    T* attention_partial = sp ? partial_.data() : saved.x_mid.data();
    wo_.forward_partial(ctx, attention_partial, att_out, rows);
    tp_.reduce_rows(saved.x_mid.data(), attention_partial, rows, C);
    Backend::add_inplace(ctx, saved.x_mid.data(), x, local * C);
    // SwiGLU MLP on this rank's hidden units, the same way.
    ffn_norm_.forward(ctx, saved.ffn_norm, saved.norm2_out.data(), saved.x_mid.data(), local);
    w_gate_up_.forward(ctx, saved.gate_up.data(), tp_.gather_rows(gathered_.data(), saved.norm2_out.data(), rows, C),
                       rows);
    swiglu_forward(saved.act.data(), saved.gate_up.data(), rows, hidden_local_);
    T* mlp_partial = sp ? partial_.data() : out;
    w_down_.forward_partial(ctx, mlp_partial, saved.act.data(), rows);
    tp_.reduce_rows(out, mlp_partial, rows, C);
    Backend::add_inplace(ctx, out, saved.x_mid.data(), local * C);
  }

  // dx = ∂loss/∂x given dout = ∂loss/∂out (this rank's rows, as in forward), from the
  // Saved of the forward that got x; parameter gradients accumulate (the norms', under
  // sequence parallelism, over this rank's rows: they are marked, and the trainer sums
  // them over the group).
  void backward(Context& ctx, Saved& saved, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_;
    const bool sp = tp_.sequence_parallel();
    // A Saved without the attention core's outputs: recompute them (its forward ran
    // with selective recomputation on).
    const bool recompute = saved.att_out.size() < rows * local_dim_;
    reserve_scratch(rows, local, recompute ? batch * heads_ * seq : 0);
    const T* att_out = saved.att_out.data();
    const Acc* lse = saved.lse.data();
    if (recompute) {
      Backend::attention_forward(ctx, att_out_.data(), lse_.data(), saved.qkv.data(), shape(batch, seq));
      att_out = att_out_.data();
      lse = lse_.data();
    }
    // MLP, last layer first. The row-parallel layer sees every row of dout.
    w_down_.backward(ctx, d_act_.data(), tp_.gather_rows(gathered_.data(), dout, rows, C), saved.act.data(), rows);
    swiglu_backward(d_gate_up_.data(), d_act_.data(), saved.gate_up.data(), rows, hidden_local_);
    T* dnorm2 = sp ? partial_.data() : d_c0_.data();
    w_gate_up_.backward_partial(ctx, dnorm2, d_gate_up_.data(),
                                tp_.gather_rows(gathered_.data(), saved.norm2_out.data(), rows, C), rows);
    tp_.reduce_rows(d_c0_.data(), dnorm2, rows, C);
    T* dx_mid = d_c1_.data();
    ffn_norm_.backward(ctx, saved.ffn_norm, dx_mid, d_c0_.data(), saved.x_mid.data(), local);
    Backend::add_inplace(ctx, dx_mid, dout, local * C);  // the residual path
    // Attention.
    wo_.backward(ctx, d_att_.data(), tp_.gather_rows(gathered_.data(), dx_mid, rows, C), att_out, rows);
    Backend::attention_backward(ctx, d_qkv_.data(), d_att_.data(), saved.qkv.data(), att_out, lse, shape(batch, seq));
    rotary_.rotate(d_qkv_.data(), shape(batch, seq), Rotary<T>::Direction::backward);
    T* dnorm1 = sp ? partial_.data() : d_c0_.data();
    wqkv_.backward_partial(ctx, dnorm1, d_qkv_.data(),
                           tp_.gather_rows(gathered_.data(), saved.norm1_out.data(), rows, C), rows);
    tp_.reduce_rows(d_c0_.data(), dnorm1, rows, C);
    attention_norm_.backward(ctx, saved.attention_norm, dx, d_c0_.data(), x, local);
    Backend::add_inplace(ctx, dx, dx_mid, local * C);  // the residual path
  }

  template <class Visit>
  void parameters(Visit&& visit) {
    attention_norm_.parameters(visit);
    wqkv_.parameters(visit);
    wo_.parameters(visit);
    ffn_norm_.parameters(visit);
    w_gate_up_.parameters(visit);
    w_down_.parameters(visit);
  }

  // Bytes of the scratch this block owns, whatever the micro-batches in flight: the
  // largest batch · seq it has run so far.
  std::size_t scratch_bytes() const {
    return gathered_.bytes() + partial_.bytes() + att_out_.bytes() + lse_.bytes() + d_act_.bytes() +
           d_gate_up_.bytes() + d_att_.bytes() + d_qkv_.bytes() + d_c0_.bytes() + d_c1_.bytes();
  }

 private:
  // This rank's heads of a (batch, seq) micro-batch, for the attention kernels.
  AttentionShape shape(std::int64_t batch, std::int64_t seq) const {
    return AttentionShape::mha(batch, seq, local_dim_, heads_);
  }
  // GPT-2's scaling of the projections that write into the residual stream.
  static float residual_std(const LlamaConfig& cfg) {
    return cfg.init_std / std::sqrt(2.0f * static_cast<float>(cfg.layers));
  }

  void reserve(Saved& saved, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, local = tp_.local_rows(rows), C = dim_, Cl = local_dim_, Hl = hidden_local_;
    tp_.check_sequence(seq);
    saved.norm1_out.reserve(local * C);
    saved.qkv.reserve(rows * 3 * Cl);
    if (selective_) {  // kept out of saved: its bytes() count what it holds
      saved.att_out.reset();
      saved.lse.reset();
      att_out_.reserve(rows * Cl);
      lse_.reserve(batch * heads_ * seq);
    } else {
      saved.att_out.reserve(rows * Cl);
      saved.lse.reserve(batch * heads_ * seq);
    }
    saved.x_mid.reserve(local * C);
    saved.norm2_out.reserve(local * C);
    saved.gate_up.reserve(rows * 2 * Hl);
    saved.act.reserve(rows * Hl);
    reserve_sequence_parallel(rows);
  }
  void reserve_scratch(std::int64_t rows, std::int64_t local, std::int64_t recomputed_lse) {
    d_act_.reserve(rows * hidden_local_);
    d_gate_up_.reserve(rows * 2 * hidden_local_);
    d_att_.reserve(rows * local_dim_);
    d_qkv_.reserve(rows * 3 * local_dim_);
    d_c0_.reserve(rows * dim_);
    d_c1_.reserve(local * dim_);
    if (recomputed_lse > 0) {
      att_out_.reserve(rows * local_dim_);
      lse_.reserve(recomputed_lse);
    }
    reserve_sequence_parallel(rows);
  }
  void reserve_sequence_parallel(std::int64_t rows) {
    if (tp_.sequence_parallel()) {
      gathered_.reserve(rows * dim_);
      partial_.reserve(rows * dim_);
    }
  }

  nn::TensorParallelGroup tp_;
  std::int64_t dim_;
  std::int64_t heads_;         // this rank's heads: NH / tp
  std::int64_t local_dim_;     // this rank's attention channels: C / tp
  std::int64_t hidden_local_;  // this rank's MLP hidden units: H / tp
  bool selective_ = false;     // selective recomputation of the attention core
  Rotary<T> rotary_;
  Norm attention_norm_;
  nn::ColumnParallelLinear<T, Backend> wqkv_;  // (3C, C): q, k, v of this rank's heads
  nn::RowParallelLinear<T, Backend> wo_;       // (C, C)
  Norm ffn_norm_;
  nn::ColumnParallelLinear<T, Backend> w_gate_up_;  // (2H, C): gate and up of this rank's hidden units
  nn::RowParallelLinear<T, Backend> w_down_;        // (C, H)
  // Scratch, dead once forward or backward returns. Sequence parallelism: every row
  // gathered, and partial sums before a reduce-scatter.
  Buffer<T, Space> gathered_, partial_;  // (B·S, C)
  // Selective recomputation: the attention core's outputs, written by forward for wo and
  // by backward's recomputation for attention_backward.
  Buffer<T, Space> att_out_;  // (B, S, Cl)
  Buffer<Acc, Space> lse_;    // (B, NH/tp, S)
  // Gradients.
  Buffer<T, Space> d_act_, d_gate_up_, d_att_, d_qkv_, d_c0_, d_c1_;
};

static_assert(nn::check_layer<LlamaBlock<float, backend::Cpu>, backend::Cpu>());

// ---- The model ----------------------------------------------------------------------

// What makes llmpar's Transformer this model: the block above, a final RMSNorm, no
// position table (positions enter through the rotary embedding), and the names. The
// token embedding, the LM head tied to it, the loss, the vocabulary split, sequence
// parallelism's final norm, sampling and everything the trainer needs come with it.
struct LlamaSpec {
  using Config = LlamaConfig;
  template <class T, class Backend>
  using Block = LlamaBlock<T, Backend>;
  template <class T, class Backend>
  using Norm = nn::RMSNorm<T, Backend>;
  static constexpr const char* kTokenTable = "tok_embeddings";
  static constexpr const char* kPositionTable = nullptr;
  static constexpr const char* kBlockPrefix = "layers.";
  template <class T, class Backend>
  static nn::RMSNorm<T, Backend> final_norm(const LlamaConfig& cfg) {
    return nn::RMSNorm<T, Backend>("norm", cfg.dim, cfg.norm_eps);
  }
};

// Token embedding, L LlamaBlocks, a final RMSNorm and an LM head tied to the embedding:
// train::Trainer, optim::AdamW and train::sample take it as they take models::GPT2.
// LlamaModel<float>, or LlamaModel<Policy> (a composed policy names T and the backend).
template <class TypeOrPolicy, class Backend = backend::Cpu>
using LlamaModel = models::Transformer<TypeOrPolicy, Backend, LlamaSpec>;

}  // namespace custom_layer
