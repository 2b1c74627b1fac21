// llmpar/nn/scratch.hpp — the gradients and gathered rows that live only while one
// layer's forward or backward runs.
//
// A transformer block and its sub-layers (nn::SelfAttention, nn::Mlp) share one of
// these, and a model shares one between all its blocks (models::Transformer): what is
// dead once a call returns is not kept per layer, nor per micro-batch (that is a
// layer's Saved, nn/layer.hpp). Each field has one role, so that the sub-layers of one
// block can be written apart and still reuse each other's memory:
//   - attention: qkv (∂qkv), c0 (∂ of the attention core's output), att_out and lse
//     (the core's outputs under selective recomputation);
//   - MLP: wide0 (∂ of the up projection's output), wide1 (∂ of the activation, for
//     activations not fused into the GEMMs);
//   - a block: c0, c1 (∂ of the residual stream between its parts);
//   - sequence parallelism: gathered (every row of the region) and partial (partial
//     sums before a reduce-scatter);
//   - context parallelism: cp, the K/V blocks of ring attention, their gradients and
//     the queries' running state, or the all-to-all's buffers (nn/context_parallel.hpp).
// A layer reserves what it uses at the start of each call; a caller that holds
// pointers into the scratch across a call reserves (and so allocates) first.
#pragma once

#include <cstddef>
#include <cstdint>

#include "llmpar/core/dtype.hpp"
#include "llmpar/core/tensor.hpp"

namespace llmpar::nn {

// Context parallelism's buffers (nn/context_parallel.hpp). Ring attention: the K/V
// block in hand and the one arriving (rows, 2 KV/tp), three of their gradients in Acc
// (the block in hand's, the one passing on, the one arriving), the
// queries' flash state (o, m, l), dq and D = dout · out, and a T staging buffer. The
// all-to-all: its send and receive buffers, and the core's output, ∂output and ∂qkv
// over this rank's heads.
template <class T, class Space, class Acc = acc_t<T>>
struct ContextParallelScratch {
  Buffer<T, Space> kv[2];
  Buffer<Acc, Space> dkv[3];
  Buffer<Acc, Space> o, m, l, dq, dsum;
  Buffer<T, Space> stage, send, recv, out, dout, dqkv;
  std::size_t bytes() const {
    return kv[0].bytes() + kv[1].bytes() + dkv[0].bytes() + dkv[1].bytes() + dkv[2].bytes() + o.bytes() + m.bytes() +
           l.bytes() + dq.bytes() + dsum.bytes() + stage.bytes() + send.bytes() + recv.bytes() + out.bytes() +
           dout.bytes() + dqkv.bytes();
  }
};

template <class T, class Space, class Acc = acc_t<T>>
struct BlockScratch {
  Buffer<T, Space> att_out;                  // (rows, C/tp) selective recomputation only
  Buffer<Acc, Space> lse;                    // (B, NH/tp, S) selective recomputation only
  Buffer<T, Space> wide0;                    // (rows, up projection width / tp)
  Buffer<T, Space> wide1;                    // (rows, MLP hidden / tp) unfused activations only
  Buffer<T, Space> qkv;                      // (rows, 3C/tp)
  Buffer<T, Space> c0, c1;                   // (rows, C)
  Buffer<T, Space> gathered, partial;        // (rows, C) sequence parallelism only
  ContextParallelScratch<T, Space, Acc> cp;  // context parallelism only
  // A GPT-2-sized block's needs at once: the 4C-wide MLP, 3C-wide QKV and two (rows, C).
  void reserve(std::int64_t rows, std::int64_t dim, bool sequence_parallel = false) {
    wide0.reserve(rows * 4 * dim);
    qkv.reserve(rows * 3 * dim);
    c0.reserve(rows * dim);
    c1.reserve(rows * dim);
    if (sequence_parallel) reserve_sequence_parallel(rows, dim);
  }
  void reserve_sequence_parallel(std::int64_t rows, std::int64_t dim) {
    gathered.reserve(rows * dim);
    partial.reserve(rows * dim);
  }
  std::size_t bytes() const {
    return wide0.bytes() + wide1.bytes() + qkv.bytes() + c0.bytes() + c1.bytes() + gathered.bytes() + partial.bytes() +
           att_out.bytes() + lse.bytes() + cp.bytes();
  }
};

// dst (n) = a copy of src (n) in Backend's memory, grown to fit: what a part keeps from
// its input-gradient pass for the weight pass of a zero-bubble schedule.
template <class Backend, class T, class Space>
void keep_copy(typename Backend::Context& ctx, Buffer<T, Space>& dst, const T* src, std::int64_t n) {
  dst.reserve(n);
  Backend::copy(ctx, dst.data(), src, n);
}

}  // namespace llmpar::nn
