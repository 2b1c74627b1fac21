// custom_layer.hpp — a LLaMA-style transformer block written by a user of llmpar, and a
// small language model around it. examples/custom_layer.cpp trains it;
// tests/test_custom_layer.cpp checks it against finite differences and checks that it
// trains under tensor parallelism exactly as it trains alone.
//
// What a user writes, and why it is enough:
//
//  - A layer is a plain class with forward(ctx, out, x, batch, seq), backward(ctx, dx,
//    dout, x, batch, seq) and parameters(visit) (nn/layer.hpp). There is no autograd
//    tape to extend and no base class: the block calls llmpar's layers and kernels, runs
//    its own element-wise code between them, and writes the backward in the reverse
//    order. `static_assert(nn::check_layer<...>())` says in a sentence what is missing
//    if a member is.
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
//  - Every parameter is declared once (name, shape, init, split) and reached only
//    through parameters(visit). The store, the initialisation from (seed, name, index),
//    the optimizer, gradient clipping across tensor-parallel ranks and the trainer all
//    work from that call, so nothing in llmpar changes for a new block.
//
// The user's own code here is rotary position embeddings (Su et al. 2021) and the
// SwiGLU activation (Shazeer 2020), each with its exact backward. It runs in plain host
// loops, so the block is for backends whose memory the host can read (backend::Cpu); on
// the CUDA backend the same two functions would be small kernels, and the static_assert
// in LlamaBlock says so.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <llmpar/llmpar.hpp>
#include <llmpar/nn/rmsnorm.hpp>
#include <string>
#include <vector>

namespace custom_layer {

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

// Rotary position embedding: in every head, channel pair (2i, 2i+1) of q and of k at
// position t is rotated by the angle t · base^(-2i/hs). The score q_t · k_s then
// depends on t - s only, which is how the model knows positions (it has no position
// table). A rotation is orthogonal, so the backward is the rotation by the opposite
// angle (the transpose), and nothing from the forward needs to be kept.
template <class T>
class Rotary {
 public:
  Rotary(std::int64_t head_size, std::int64_t max_seq, double base)
      : half_(head_size / 2), max_seq_(max_seq), cos_(static_cast<std::size_t>(max_seq * half_)), sin_(cos_.size()) {
    for (std::int64_t t = 0; t < max_seq; ++t)
      for (std::int64_t i = 0; i < half_; ++i) {
        const double angle =
            static_cast<double>(t) * std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(head_size));
        cos_[static_cast<std::size_t>(t * half_ + i)] = static_cast<T>(std::cos(angle));
        sin_[static_cast<std::size_t>(t * half_ + i)] = static_cast<T>(std::sin(angle));
      }
  }

  enum class Direction { forward, backward };

  // Rotates q and k of qkv (B, S, 3·Cl) in place, Cl = this rank's channels: q in
  // [0, Cl), k in [Cl, 2Cl), v untouched. forward: by +angle (the forward pass);
  // backward: by -angle, which carries dq and dk back through the forward rotation.
  void rotate(T* qkv, std::int64_t batch, std::int64_t seq, std::int64_t local_dim, Direction direction) const {
    LLMPAR_CHECK(seq <= max_seq_, "rotary embedding: sequence length ", seq, " is longer than the tables' ", max_seq_);
    const T sign = direction == Direction::forward ? T(1) : T(-1);
    const std::int64_t rows = batch * seq, pairs = local_dim / 2;  // pairs of q (and of k) per row
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* c = cos_.data() + (r % seq) * half_;  // (hs/2) for this position
      const T* s = sin_.data() + (r % seq) * half_;
      for (T* x : {qkv + r * 3 * local_dim, qkv + r * 3 * local_dim + local_dim})  // q, then k
        for (std::int64_t p = 0; p < pairs; ++p) {
          const std::int64_t i = p % half_;  // the pair's index within its head
          const T x0 = x[2 * p], x1 = x[2 * p + 1];
          x[2 * p] = x0 * c[i] - sign * x1 * s[i];
          x[2 * p + 1] = sign * x0 * s[i] + x1 * c[i];
        }
    }
  }

 private:
  std::int64_t half_, max_seq_;
  std::vector<T> cos_, sin_;  // (max_seq, hs/2)
};

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
// norms and the residual stream are whole on every rank.
template <class T, class Backend = backend::Cpu>
class LlamaBlock {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  static_assert(Space::kHostAccessible,
                "LlamaBlock: the rotary and SwiGLU code is written as host loops over the backend's memory; use "
                "backend::Cpu, or write those two functions as kernels for a device backend");

  LlamaBlock(const std::string& name, const LlamaConfig& cfg, nn::TensorParallelGroup tp = {})
      : dim_(cfg.dim),
        heads_((tp.check_divides(cfg.heads, "heads"), cfg.heads / tp.size())),
        local_dim_(cfg.dim / tp.size()),
        hidden_local_((tp.check_divides(cfg.hidden, "hidden"), cfg.hidden / tp.size())),
        rotary_(cfg.dim / cfg.heads, cfg.max_seq, cfg.rope_base),
        attention_norm_(name + ".attention_norm", cfg.dim, cfg.norm_eps),
        wqkv_(name + ".attention.wqkv", cfg.dim, 3 * cfg.dim, false, cfg.init_std, tp, 3),
        wo_(name + ".attention.wo", cfg.dim, cfg.dim, false, residual_std(cfg), tp),
        ffn_norm_(name + ".ffn_norm", cfg.dim, cfg.norm_eps),
        w_gate_up_(name + ".feed_forward.w_gate_up", cfg.dim, 2 * cfg.hidden, false, cfg.init_std, tp, 2),
        w_down_(name + ".feed_forward.w_down", cfg.hidden, cfg.dim, false, residual_std(cfg), tp) {}

  // out (B, S, C) = block(x (B, S, C)); keeps what backward needs.
  void forward(Context& ctx, T* out, const T* x, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, C = dim_;
    reserve(batch, seq);
    // Attention on this rank's heads.
    attention_norm_.forward(ctx, norm1_out_.data(), x, rows);
    wqkv_.forward(ctx, qkv_.data(), norm1_out_.data(), rows);
    rotary_.rotate(qkv_.data(), batch, seq, local_dim_, Rotary<T>::Direction::forward);
    Backend::attention_forward(ctx, att_out_.data(), lse_.data(), qkv_.data(), batch, seq, local_dim_, heads_);
    wo_.forward(ctx, x_mid_.data(), att_out_.data(), rows);  // all-reduce: the heads' sum
    Backend::add_inplace(ctx, x_mid_.data(), x, rows * C);
    // SwiGLU MLP on this rank's hidden units.
    ffn_norm_.forward(ctx, norm2_out_.data(), x_mid_.data(), rows);
    w_gate_up_.forward(ctx, gate_up_.data(), norm2_out_.data(), rows);
    swiglu_forward(act_.data(), gate_up_.data(), rows, hidden_local_);
    w_down_.forward(ctx, out, act_.data(), rows);  // all-reduce: the hidden units' sum
    Backend::add_inplace(ctx, out, x_mid_.data(), rows * C);
  }

  // dx (B, S, C) = ∂loss/∂x given dout = ∂loss/∂out; parameter gradients accumulate.
  void backward(Context& ctx, T* dx, const T* dout, const T* x, std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, C = dim_;
    reserve_scratch(rows);
    // MLP, last layer first.
    w_down_.backward(ctx, d_act_.data(), dout, act_.data(), rows);
    swiglu_backward(d_gate_up_.data(), d_act_.data(), gate_up_.data(), rows, hidden_local_);
    w_gate_up_.backward(ctx, d_c0_.data(), d_gate_up_.data(), norm2_out_.data(), rows);  // all-reduce of dx
    T* dx_mid = d_c1_.data();
    ffn_norm_.backward(ctx, dx_mid, d_c0_.data(), x_mid_.data(), rows);
    Backend::add_inplace(ctx, dx_mid, dout, rows * C);  // the residual path
    // Attention.
    wo_.backward(ctx, d_att_.data(), dx_mid, att_out_.data(), rows);
    Backend::attention_backward(ctx, d_qkv_.data(), d_att_.data(), qkv_.data(), att_out_.data(), lse_.data(), batch,
                                seq, local_dim_, heads_);
    rotary_.rotate(d_qkv_.data(), batch, seq, local_dim_, Rotary<T>::Direction::backward);
    wqkv_.backward(ctx, d_c0_.data(), d_qkv_.data(), norm1_out_.data(), rows);  // all-reduce of dx
    attention_norm_.backward(ctx, dx, d_c0_.data(), x, rows);
    Backend::add_inplace(ctx, dx, dx_mid, rows * C);  // the residual path
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

 private:
  // GPT-2's scaling of the projections that write into the residual stream.
  static float residual_std(const LlamaConfig& cfg) {
    return cfg.init_std / std::sqrt(2.0f * static_cast<float>(cfg.layers));
  }

  void reserve(std::int64_t batch, std::int64_t seq) {
    const std::int64_t rows = batch * seq, C = dim_, Cl = local_dim_, Hl = hidden_local_;
    norm1_out_.reserve(rows * C);
    qkv_.reserve(rows * 3 * Cl);
    att_out_.reserve(rows * Cl);
    lse_.reserve(batch * heads_ * seq);
    x_mid_.reserve(rows * C);
    norm2_out_.reserve(rows * C);
    gate_up_.reserve(rows * 2 * Hl);
    act_.reserve(rows * Hl);
  }
  void reserve_scratch(std::int64_t rows) {
    d_act_.reserve(rows * hidden_local_);
    d_gate_up_.reserve(rows * 2 * hidden_local_);
    d_att_.reserve(rows * local_dim_);
    d_qkv_.reserve(rows * 3 * local_dim_);
    d_c0_.reserve(rows * dim_);
    d_c1_.reserve(rows * dim_);
  }

  std::int64_t dim_;
  std::int64_t heads_;         // this rank's heads: NH / tp
  std::int64_t local_dim_;     // this rank's attention channels: C / tp
  std::int64_t hidden_local_;  // this rank's MLP hidden units: H / tp
  Rotary<T> rotary_;
  nn::RMSNorm<T, Backend> attention_norm_;
  nn::ColumnParallelLinear<T, Backend> wqkv_;  // (3C, C): q, k, v of this rank's heads
  nn::RowParallelLinear<T, Backend> wo_;       // (C, C)
  nn::RMSNorm<T, Backend> ffn_norm_;
  nn::ColumnParallelLinear<T, Backend> w_gate_up_;  // (2H, C): gate and up of this rank's hidden units
  nn::RowParallelLinear<T, Backend> w_down_;        // (C, H)
  // Activations kept for backward (Cl = C / tp, Hl = H / tp).
  Buffer<T, Space> norm1_out_;  // (B, S, C)
  Buffer<T, Space> qkv_;        // (B, S, 3Cl), q and k rotated
  Buffer<T, Space> att_out_;    // (B, S, Cl)
  Buffer<Acc, Space> lse_;      // (B, NH/tp, S)
  Buffer<T, Space> x_mid_;      // (B, S, C)  residual after attention
  Buffer<T, Space> norm2_out_;  // (B, S, C)
  Buffer<T, Space> gate_up_;    // (B, S, 2Hl)
  Buffer<T, Space> act_;        // (B, S, Hl)
  // Gradients that are dead once backward returns.
  Buffer<T, Space> d_act_, d_gate_up_, d_att_, d_qkv_, d_c0_, d_c1_;
};

static_assert(nn::check_layer<LlamaBlock<float, backend::Cpu>, backend::Cpu>());

// ---- The model ----------------------------------------------------------------------

// Token embedding, L LlamaBlocks, a final RMSNorm and an LM head tied to the embedding.
// The same structure and interface as models::GPT2 (forward, backward, evaluate,
// logits, zero_grad, parameter_store, config, num_parameters, tensor_parallel), so
// train::Trainer, optim::AdamW and train::sample take it as they take GPT-2.
template <class T, class Backend = backend::Cpu>
class LlamaModel {
 public:
  using Acc = typename Backend::template Acc<T>;
  using Context = typename Backend::Context;
  using Space = typename Backend::Space;
  using BackendTag = Backend;

  // tp: the group the blocks are split over; the embedding, the LM head and the loss
  // are whole (replicated) on every rank of it and get the same gradient on each.
  LlamaModel(const LlamaConfig& cfg, std::uint64_t seed, nn::TensorParallelGroup tp = {})
      : cfg_(cfg), tp_(tp), norm_((cfg.validate(), "norm"), cfg.dim, cfg.norm_eps) {
    tok_embeddings_ =
        nn::Parameter<T>("tok_embeddings", {cfg.padded_vocab, cfg.dim}, nn::Init::normal(cfg.init_std), true);
    blocks_.reserve(static_cast<std::size_t>(cfg.layers));
    for (std::int64_t l = 0; l < cfg.layers; ++l) blocks_.emplace_back("layers." + std::to_string(l), cfg, tp);
    store_.bind(*this);
    store_.initialize(seed);
    Space::zero(tok_embeddings_.value + cfg.vocab * cfg.dim,
                static_cast<std::size_t>((cfg.padded_vocab - cfg.vocab) * cfg.dim) * sizeof(T));
    // Positions enter through the rotary embedding, not a table: the backend's encoder
    // (token + position) gets a position table of zeros that is not a parameter.
    no_positions_.resize(cfg.max_seq * cfg.dim);
    no_positions_.zero();
    no_positions_grad_.resize(cfg.max_seq * cfg.dim);
  }
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  // Training forward: the mean loss over B·S tokens; leaves ∂loss/∂logits (times
  // loss_scale, for gradient accumulation) ready for backward().
  Acc forward(Context& ctx, const std::int32_t* tokens, const std::int32_t* targets, std::int64_t batch,
              std::int64_t seq, Acc loss_scale = Acc(1)) {
    compute_logits(ctx, tokens, batch, seq);
    const std::int64_t rows = batch * seq;
    copy_targets(ctx, targets, rows);
    Backend::cross_entropy_forward_backward(ctx, logits_.data(), losses_.data(), targets_.data(), rows, cfg_.vocab,
                                            cfg_.padded_vocab, loss_scale / static_cast<Acc>(rows));
    backward_ready_ = true;
    return mean_loss(ctx, rows);
  }

  // Accumulates ∂loss/∂parameter into the gradients (zero them first with zero_grad()).
  void backward(Context& ctx) {
    LLMPAR_CHECK(backward_ready_, "backward() needs a training forward() first");
    backward_ready_ = false;
    const std::int64_t batch = batch_, seq = seq_, rows = batch * seq, C = cfg_.dim, L = cfg_.layers;
    dnorm_.reserve(rows * C);
    dres_[0].reserve(rows * C);
    dres_[1].reserve(rows * C);
    // LM head, tied to the embedding: logits = norm_out · tok_embeddingsᵀ.
    Backend::template gemm<T>(ctx, dnorm_.data(), logits_.data(), tok_embeddings_.value, nullptr, rows, C,
                              cfg_.padded_vocab, {});
    Backend::template gemm<T>(ctx, tok_embeddings_.grad, logits_.data(), norm_out_.data(), nullptr, cfg_.padded_vocab,
                              C, rows, {.trans_a = true, .trans_b = false, .accumulate = true});
    norm_.backward(ctx, dres_[0].data(), dnorm_.data(), residual(L), rows);
    for (std::int64_t l = L - 1; l >= 0; --l) {
      T* dout = dres_[(L - 1 - l) % 2].data();
      T* dx = dres_[(L - l) % 2].data();
      blocks_[static_cast<std::size_t>(l)].backward(ctx, dx, dout, residual(l), batch, seq);
    }
    no_positions_grad_.zero();
    Backend::encoder_backward(ctx, tok_embeddings_.grad, no_positions_grad_.data(), dres_[L % 2].data(), tokens_.data(),
                              batch, seq, C);
  }

  // Mean loss without touching any gradient state.
  Acc evaluate(Context& ctx, const std::int32_t* tokens, const std::int32_t* targets, std::int64_t batch,
               std::int64_t seq) {
    compute_logits(ctx, tokens, batch, seq);
    backward_ready_ = false;
    copy_targets(ctx, targets, batch * seq);
    Backend::cross_entropy_forward(ctx, losses_.data(), logits_.data(), targets_.data(), batch * seq, cfg_.vocab,
                                   cfg_.padded_vocab);
    return mean_loss(ctx, batch * seq);
  }

  // Logits (B, S, padded_vocab); only the first `vocab` columns are meaningful.
  const T* logits(Context& ctx, const std::int32_t* tokens, std::int64_t batch, std::int64_t seq) {
    compute_logits(ctx, tokens, batch, seq);
    backward_ready_ = false;
    return logits_.data();
  }

  void zero_grad() { store_.zero_grad(); }

  template <class Visit>
  void parameters(Visit&& visit) {
    visit(tok_embeddings_);
    for (auto& block : blocks_) block.parameters(visit);
    norm_.parameters(visit);
  }

  nn::ParameterStore<T, Space>& parameter_store() { return store_; }
  nn::TensorParallelGroup tensor_parallel() const { return tp_; }
  const LlamaConfig& config() const { return cfg_; }
  // Parameters of the whole model (not this rank's share of a split one).
  std::int64_t num_parameters() const { return store_.full_numel(); }

 private:
  T* residual(std::int64_t l) { return residual_.data() + l * batch_ * seq_ * cfg_.dim; }

  void compute_logits(Context& ctx, const std::int32_t* tokens, std::int64_t batch, std::int64_t seq) {
    LLMPAR_CHECK(batch > 0, "batch size is ", batch, "; it must be positive");
    LLMPAR_CHECK(seq > 0 && seq <= cfg_.max_seq, "sequence length ", seq, " is outside [1, ", cfg_.max_seq, "]");
    batch_ = batch;
    seq_ = seq;
    const std::int64_t rows = batch * seq, C = cfg_.dim, L = cfg_.layers;
    for (std::int64_t i = 0; i < rows; ++i)
      LLMPAR_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab, "token id ", tokens[i], " at position ", i,
                   " is outside the vocabulary [0, ", cfg_.vocab, ")");
    tokens_.reserve(rows);
    Backend::upload(ctx, tokens_.data(), tokens, rows);
    residual_.reserve((L + 1) * rows * C);
    norm_out_.reserve(rows * C);
    logits_.reserve(rows * cfg_.padded_vocab);
    losses_.reserve(rows);
    Backend::encoder_forward(ctx, residual(0), tokens_.data(), tok_embeddings_.value, no_positions_.data(), batch, seq,
                             C);
    for (std::int64_t l = 0; l < L; ++l)
      blocks_[static_cast<std::size_t>(l)].forward(ctx, residual(l + 1), residual(l), batch, seq);
    norm_.forward(ctx, norm_out_.data(), residual(L), rows);
    Backend::template gemm<T>(ctx, logits_.data(), norm_out_.data(), tok_embeddings_.value, nullptr, rows,
                              cfg_.padded_vocab, C, {.trans_a = false, .trans_b = true, .accumulate = false});
  }

  void copy_targets(Context& ctx, const std::int32_t* targets, std::int64_t rows) {
    for (std::int64_t i = 0; i < rows; ++i)
      LLMPAR_CHECK(targets[i] >= 0 && targets[i] < cfg_.vocab, "target id ", targets[i], " at position ", i,
                   " is outside the vocabulary [0, ", cfg_.vocab, ")");
    targets_.reserve(rows);
    Backend::upload(ctx, targets_.data(), targets, rows);
  }

  // The mean of the per-token losses, summed on the host in position order.
  Acc mean_loss(Context& ctx, std::int64_t rows) {
    host_losses_.reserve(rows);
    Backend::download(ctx, host_losses_.data(), losses_.data(), rows);
    Acc sum = 0;
    for (std::int64_t i = 0; i < rows; ++i) sum += host_losses_[i];
    return sum / static_cast<Acc>(rows);
  }

  LlamaConfig cfg_;
  nn::TensorParallelGroup tp_;
  nn::Parameter<T> tok_embeddings_;  // (Vp, C), also the LM head
  std::vector<LlamaBlock<T, Backend>> blocks_;
  nn::RMSNorm<T, Backend> norm_;
  nn::ParameterStore<T, Space> store_;

  std::int64_t batch_ = 0, seq_ = 0;
  bool backward_ready_ = false;
  Buffer<T, Space> no_positions_;        // (max_seq, C) zeros: the encoder's position table
  Buffer<T, Space> no_positions_grad_;   // (max_seq, C) its gradient, never read
  Buffer<std::int32_t, Space> tokens_;   // (B, S)
  Buffer<std::int32_t, Space> targets_;  // (B, S)
  Buffer<T, Space> residual_;            // (L+1, B, S, C): every block's input, and the last output
  Buffer<T, Space> norm_out_;            // (B, S, C)
  Buffer<T, Space> logits_;              // (B, S, Vp); ∂loss/∂logits after a training forward
  Buffer<Acc, Space> losses_;            // (B, S)
  Buffer<Acc> host_losses_;              // (B, S) on the host
  Buffer<T, Space> dnorm_;               // (B, S, C)
  Buffer<T, Space> dres_[2];             // (B, S, C) ping-pong residual gradients
};

}  // namespace custom_layer
