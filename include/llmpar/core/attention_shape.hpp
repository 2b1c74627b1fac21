// llmpar/core/attention_shape.hpp — the shape of one attention problem, as every
// attention kernel (CPU and CUDA) and their callers name it.
//
//   qkv (B, T, R) with R = (heads + 2 kv_heads) · head_dim: per row the q of `heads`
//   heads, then the k of `kv_heads` heads, then their v; out (B, T, heads · head_dim);
//   lse (B, heads, T).
//
// Grouped-query attention (Ainslie et al. 2023) is kv_heads < heads, each kv head shared
// by group() = heads / kv_heads query heads; multi-head attention is kv_heads == heads
// (GPT-2), multi-query kv_heads == 1. Query head h reads kv head h % kv_heads. That is
// the order in which tensor parallelism hands out heads: the fused QKV weight is cut
// into group() + 2 equal blocks of kv_heads heads (nn::Split's groups), so a rank holds
// the same slice of every q block and of k and v, and its local query head h again reads
// its local kv head h % (kv_heads / tp), with nothing to exchange. (Hugging Face's
// Llama pairs query head h with kv head h / group(); checkpoint/hf_llama.hpp permutes the
// query heads on the way in and out.)
#pragma once

#include <cstdint>

#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar {

struct AttentionShape {
  std::int64_t batch = 0;     // B
  std::int64_t seq = 0;       // T: tokens per sequence
  std::int64_t heads = 0;     // query heads
  std::int64_t kv_heads = 0;  // key/value heads: divides heads
  std::int64_t head_dim = 0;  // channels per head

  // Multi-head attention over C channels in NH heads (GPT-2's layout: qkv (B, T, 3C)).
  static AttentionShape mha(std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t NH) {
    return {B, T, NH, NH, NH > 0 ? C / NH : 0};
  }

  LLMPAR_HOST_DEVICE std::int64_t q_dim() const { return heads * head_dim; }      // out's row
  LLMPAR_HOST_DEVICE std::int64_t kv_dim() const { return kv_heads * head_dim; }  // k's (and v's) part of a row
  LLMPAR_HOST_DEVICE std::int64_t row() const { return q_dim() + 2 * kv_dim(); }  // a qkv row
  LLMPAR_HOST_DEVICE std::int64_t group() const { return heads / kv_heads; }      // query heads per kv head
  LLMPAR_HOST_DEVICE std::int64_t kv_head_of(std::int64_t h) const { return h % kv_heads; }
  // Column offsets in a qkv row of query head h's q, and of kv head g's k and v.
  LLMPAR_HOST_DEVICE std::int64_t q_col(std::int64_t h) const { return h * head_dim; }
  LLMPAR_HOST_DEVICE std::int64_t k_col(std::int64_t g) const { return q_dim() + g * head_dim; }
  LLMPAR_HOST_DEVICE std::int64_t v_col(std::int64_t g) const { return q_dim() + kv_dim() + g * head_dim; }

  // Fails naming `who` and the value when the shape is not one the kernels take.
  void check(const char* who) const {
    LLMPAR_CHECK(batch >= 0 && seq >= 0, who, ": B = ", batch, ", T = ", seq, "; both must be >= 0");
    LLMPAR_CHECK(heads >= 1 && head_dim >= 1, who, ": heads = ", heads, ", head_dim = ", head_dim,
                 "; both must be >= 1 (the head size is the channels over the heads: pick channels a multiple of "
                 "the heads)");
    LLMPAR_CHECK(kv_heads >= 1 && heads % kv_heads == 0, who, ": kv_heads = ", kv_heads,
                 " does not divide the query heads ", heads,
                 "; grouped-query attention shares each kv head between heads / kv_heads query heads: pick "
                 "--kv-heads a divisor of --heads");
  }
};

// Where the rows of a rank's local sequence sit in the whole one (context parallelism,
// nn/context_parallel.hpp): rows [0, chunk) are positions [first, first + chunk), rows
// [chunk, 2 chunk) positions [second, second + chunk). chunk = 0: the local sequence is
// the whole one, row t at position t. The rotary kernels map rows to positions with it.
struct ChunkPositions {
  std::int64_t chunk = 0;
  std::int64_t first = 0, second = 0;
  LLMPAR_HOST_DEVICE std::int64_t position_of(std::int64_t t) const {
    return chunk == 0 ? t : (t < chunk ? first + t : second + (t - chunk));
  }
};

// One block of attention computed apart (ring attention): the queries of rows
// [q_first, q_first + len) of each sequence's `seq` rows in qkv against the keys and
// values of rows [kv_first, kv_first + len) of each sequence's kv_seq rows in a buffer
// whose rows are kv_stride elements apart, k at k_offset + g·hs and v at v_offset + g·hs
// (qkv itself: R, q_dim, q_dim + kv_dim; a packed copy: 2 kv_dim, 0, kv_dim). causal:
// the diagonal block (the same positions), key j visible to query i iff j <= i; else
// every key comes before every query and all are visible.
struct AttentionBlock {
  std::int64_t q_first = 0;
  std::int64_t kv_seq = 0;
  std::int64_t kv_first = 0;
  std::int64_t len = 0;
  std::int64_t kv_stride = 0, k_offset = 0, v_offset = 0;
  bool causal = false;

  void check(const AttentionShape& s, const char* who) const {
    s.check(who);
    LLMPAR_CHECK(len >= 0 && q_first >= 0 && q_first + len <= s.seq && kv_first >= 0 && kv_first + len <= kv_seq, who,
                 ": a block of ", len, " rows at query row ", q_first, " and key row ", kv_first,
                 " does not fit sequences of ", s.seq, " query and ", kv_seq, " key rows");
    LLMPAR_CHECK(kv_stride >= k_offset + s.kv_dim() && kv_stride >= v_offset + s.kv_dim(), who, ": key rows of ",
                 kv_stride, " elements cannot hold k at ", k_offset, " and v at ", v_offset, " (", s.kv_dim(),
                 " each)");
  }
};

// The flash-attention state of every query row across blocks, in the accumulation
// type: o (B, S, heads·hs) unnormalised, m the running max and l the running sum
// (B, heads, S).
template <class Acc>
struct AttentionState {
  Acc* o = nullptr;
  Acc* m = nullptr;
  Acc* l = nullptr;
};

}  // namespace llmpar
