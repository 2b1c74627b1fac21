// llmpar/pipeline/partition.hpp — which layers each pipeline stage holds.
//
// A model of L blocks runs on p pipeline ranks with v chunks each: p·v virtual stages,
// virtual stage s = chunk·p + rank (pipeline/schedule.hpp), each a contiguous run of
// blocks. Virtual stage 0 also holds the token embedding (and position table), the last
// one the final norm, the tied LM head and the loss. A Partition is the p·v + 1 layer
// boundaries; a Placement is one rank's view of it (which chunks it holds, whether it
// holds the first and the last virtual stage).
//
//   even        L / (p·v) blocks per stage, the remainder one each on the middle stages
//               (the first and last stages already carry the embedding and the head);
//   parameters  contiguous runs that minimise the largest stage's parameter count, the
//               embedding counted on the first stage and the head (and final norm) on
//               the last: what balances memory;
//   explicit    the blocks per stage, as given (train_gpt --partition 3,3,2,4).
//
// Every stage must hold at least one block: a pipeline of more stages than blocks, or
// an explicit list that does not sum to L, is an error naming the numbers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "llmpar/core/error.hpp"

namespace llmpar::pipeline {

struct Partition {
  std::vector<std::int64_t> bounds;  // p·v + 1 layer boundaries: stage s holds [bounds[s], bounds[s+1])
  int stages() const { return static_cast<int>(bounds.size()) - 1; }
  std::int64_t begin(int s) const { return bounds[static_cast<std::size_t>(s)]; }
  std::int64_t end(int s) const { return bounds[static_cast<std::size_t>(s) + 1]; }
  std::string describe() const {
    std::string out;
    for (int s = 0; s < stages(); ++s) out += detail::concat(s ? "," : "", end(s) - begin(s));
    return out;
  }
};

// Every virtual stage needs a block.
inline void check_stage_count(std::int64_t layers, int virtual_stages, int pp, int chunks) {
  LLMPAR_CHECK(virtual_stages >= 1, "a pipeline of ", virtual_stages, " virtual stages; use at least 1");
  LLMPAR_CHECK(layers >= virtual_stages, "the model has ", layers, " layers but the pipeline has ", pp, " stages x ",
               chunks, " chunks = ", virtual_stages,
               " virtual stages; every stage needs at least one layer: use --pp and --virtual-stages whose product "
               "is at most ",
               layers);
}

// Blocks split evenly over p·v stages; the remainder goes to the middle stages.
inline Partition even_partition(std::int64_t layers, int pp, int chunks = 1) {
  const int vs = pp * chunks;
  check_stage_count(layers, vs, pp, chunks);
  std::vector<std::int64_t> count(static_cast<std::size_t>(vs), layers / vs);
  std::int64_t extra = layers % vs;
  // Middle stages first (from the centre outwards), then the ends.
  std::vector<int> order;
  for (int s = 1; s + 1 < vs; ++s) order.push_back(s);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const double mid = (vs - 1) / 2.0;
    return std::abs(a - mid) < std::abs(b - mid);
  });
  order.push_back(vs - 1);
  order.push_back(0);
  for (std::size_t i = 0; extra > 0; i = (i + 1) % order.size(), --extra) ++count[static_cast<std::size_t>(order[i])];
  Partition p;
  p.bounds.push_back(0);
  for (std::int64_t c : count) p.bounds.push_back(p.bounds.back() + c);
  return p;
}

// Contiguous stages minimising the largest parameter count: block l has block_params[l]
// parameters, the first stage carries `first_extra` more (embedding), the last
// `last_extra` (final norm and head). Exact (a dynamic program over the boundaries;
// ties go to the earliest boundaries).
inline Partition parameter_partition(const std::vector<std::int64_t>& block_params, std::int64_t first_extra,
                                     std::int64_t last_extra, int pp, int chunks = 1) {
  const int vs = pp * chunks;
  const auto layers = static_cast<std::int64_t>(block_params.size());
  check_stage_count(layers, vs, pp, chunks);
  std::vector<std::int64_t> prefix{0};
  for (std::int64_t x : block_params) prefix.push_back(prefix.back() + x);
  auto load = [&](int stage, std::int64_t a, std::int64_t b) {
    return prefix[static_cast<std::size_t>(b)] - prefix[static_cast<std::size_t>(a)] + (stage == 0 ? first_extra : 0) +
           (stage == vs - 1 ? last_extra : 0);
  };
  constexpr std::int64_t kInf = std::numeric_limits<std::int64_t>::max();
  const auto L = static_cast<std::size_t>(layers);
  // best[s][l]: the smallest largest load of stages 0..s covering blocks [0, l).
  std::vector<std::vector<std::int64_t>> best(static_cast<std::size_t>(vs), std::vector<std::int64_t>(L + 1, kInf));
  std::vector<std::vector<std::int64_t>> cut(static_cast<std::size_t>(vs), std::vector<std::int64_t>(L + 1, 0));
  for (std::int64_t l = 1; l <= layers; ++l) best[0][static_cast<std::size_t>(l)] = load(0, 0, l);
  for (int s = 1; s < vs; ++s)
    for (std::int64_t l = s + 1; l <= layers; ++l)
      for (std::int64_t a = s; a < l; ++a) {
        const std::int64_t prev = best[static_cast<std::size_t>(s - 1)][static_cast<std::size_t>(a)];
        if (prev == kInf) continue;
        const std::int64_t v = std::max(prev, load(s, a, l));
        if (v < best[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)]) {
          best[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)] = v;
          cut[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)] = a;
        }
      }
  Partition p;
  p.bounds.assign(static_cast<std::size_t>(vs) + 1, 0);
  p.bounds[static_cast<std::size_t>(vs)] = layers;
  for (int s = vs - 1; s >= 1; --s)
    p.bounds[static_cast<std::size_t>(s)] =
        cut[static_cast<std::size_t>(s)][static_cast<std::size_t>(p.bounds[static_cast<std::size_t>(s) + 1])];
  return p;
}

// Blocks per stage as given; they must be p·v positive numbers summing to the layers.
inline Partition explicit_partition(const std::vector<std::int64_t>& blocks_per_stage, std::int64_t layers, int pp,
                                    int chunks = 1) {
  const int vs = pp * chunks;
  check_stage_count(layers, vs, pp, chunks);
  LLMPAR_CHECK(static_cast<int>(blocks_per_stage.size()) == vs, "the partition lists ", blocks_per_stage.size(),
               " stages but the pipeline has ", pp, " stages x ", chunks, " chunks = ", vs,
               " virtual stages; give one block count per virtual stage");
  Partition p;
  p.bounds.push_back(0);
  for (std::size_t s = 0; s < blocks_per_stage.size(); ++s) {
    LLMPAR_CHECK(blocks_per_stage[s] >= 1, "the partition gives virtual stage ", s, " ", blocks_per_stage[s],
                 " layers; every stage needs at least one");
    p.bounds.push_back(p.bounds.back() + blocks_per_stage[s]);
  }
  LLMPAR_CHECK(p.bounds.back() == layers, "the partition's stages hold ", p.bounds.back(), " layers but the model has ",
               layers, "; the block counts must sum to ", layers);
  return p;
}

// One pipeline rank's share of a Partition: its chunks (virtual stages chunk·p + rank).
struct Placement {
  int stages = 1;       // p
  int chunks = 1;       // v
  int rank = 0;         // this rank's pipeline stage
  Partition partition;  // empty: the whole model in one stage

  bool whole() const { return stages == 1 && chunks == 1; }
  int virtual_stage(int chunk) const { return chunk * stages + rank; }
  int virtual_stages() const { return stages * chunks; }
  bool first() const { return rank == 0; }          // chunk 0 is virtual stage 0
  bool last() const { return rank == stages - 1; }  // chunk v−1 is the last virtual stage
  std::int64_t begin(int chunk) const { return partition.begin(virtual_stage(chunk)); }
  std::int64_t end(int chunk) const { return partition.end(virtual_stage(chunk)); }

  // The placement of the whole model of `layers` blocks (no pipeline).
  static Placement whole_model(std::int64_t layers) {
    Placement p;
    p.partition.bounds = {0, layers};
    return p;
  }
  void validate(std::int64_t layers) const {
    LLMPAR_CHECK(stages >= 1 && chunks >= 1 && rank >= 0 && rank < stages, "pipeline placement: rank ", rank, " of ",
                 stages, " stages with ", chunks, " chunks is not a placement");
    LLMPAR_CHECK(partition.stages() == virtual_stages(), "pipeline placement: the partition has ", partition.stages(),
                 " stages but the pipeline has ", virtual_stages(), " virtual stages");
    LLMPAR_CHECK(partition.bounds.front() == 0 && partition.bounds.back() == layers, "pipeline placement: the ",
                 "partition covers layers [", partition.bounds.front(), ", ", partition.bounds.back(),
                 ") but the model has ", layers);
  }
};

}  // namespace llmpar::pipeline
