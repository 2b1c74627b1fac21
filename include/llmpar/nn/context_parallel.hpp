// llmpar/nn/context_parallel.hpp — context parallelism: every sequence split over the cp
// ranks of a group, in load-balanced causal chunks.
//
// A sequence of T tokens is cut into 2·cp chunks of T / (2 cp); rank r holds chunks r
// and 2·cp − 1 − r, one from each end (Megatron-Core's and torchtitan's layout). Under
// a causal mask a query chunk attends to the chunks at or before it, so chunk i costs
// i + 1 blocks and every rank's pair costs 2·cp + 1: the work is even. Each rank keeps
// T / cp rows of every activation; only attention needs the other ranks' rows, and it
// gets their keys and values by ring attention (nn::SelfAttention): cp − 1 steps, each
// passing the K/V block in hand to the next rank while attending to it, and in
// backward the dK/dV of each block travelling with it back to its owner.
//
// The tokens and targets arrive whole (every cp rank of a data-parallel replica reads
// the same sequences) and each rank takes its chunks (take_chunks); positions follow
// the chunks (position_of: the rotary angles, a learned position table's rows). Each
// rank's loss is the mean over its T / cp tokens, so the mean of the cp ranks' losses
// and gradients (the data-parallel strategy reduces over dp × cp) is the serial run's.
#pragma once

#include <cstdint>

#include "llmpar/comm/communicator.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/attention_shape.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::nn {

class ContextParallelGroup {
 public:
  ContextParallelGroup() = default;
  explicit ContextParallelGroup(comm::Comm* group) : group_(group && group->size() > 1 ? group : nullptr) {}

  bool split() const { return group_ != nullptr; }
  int size() const { return group_ ? group_->size() : 1; }
  int rank() const { return group_ ? group_->rank() : 0; }
  comm::Comm* communicator() const { return group_; }

  // Fails naming the sequence length when it cannot be cut into 2·cp chunks.
  void check_sequence(std::int64_t seq) const {
    LLMPAR_CHECK(!split() || seq % (2 * size()) == 0, "sequence length ", seq, " is not divisible by 2 x --cp ", size(),
                 " = ", 2 * size(),
                 " (context parallelism cuts each sequence into 2 x cp chunks); use a --seq that is a multiple of ",
                 2 * size());
  }
  // Rows per sequence this rank holds: seq / cp.
  std::int64_t local(std::int64_t seq) const { return seq / size(); }
  // The global chunk index of this rank's first (half 0) or second (half 1) chunk.
  int chunk_of(int half) const { return half == 0 ? rank() : 2 * size() - 1 - rank(); }
  int chunk_of(int cp_rank, int half) const { return half == 0 ? cp_rank : 2 * size() - 1 - cp_rank; }
  // The positions of this rank's rows of a sequence of `seq` tokens.
  ChunkPositions positions(std::int64_t seq) const {
    if (!split()) return {};
    const std::int64_t c = seq / (2 * size());
    return {c, chunk_of(0) * c, chunk_of(1) * c};
  }
  // local (batch, seq / cp) = this rank's chunks of every sequence of full (batch, seq).
  template <class T>
  void take_chunks(T* local, const T* full, std::int64_t batch, std::int64_t seq) const {
    check_sequence(seq);
    const std::int64_t c = seq / (2 * size()), rows = seq / size();
    for (std::int64_t b = 0; b < batch; ++b)
      for (int half = 0; half < 2; ++half)
        for (std::int64_t t = 0; t < c; ++t) local[b * rows + half * c + t] = full[b * seq + chunk_of(half) * c + t];
  }

 private:
  comm::Comm* group_ = nullptr;
};

}  // namespace llmpar::nn
