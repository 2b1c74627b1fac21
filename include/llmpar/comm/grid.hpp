// llmpar/comm/grid.hpp — the rank grid: every process group comes from here.
//
// Ranks are laid out as Megatron-LM lays them out: tensor-parallel ranks adjacent
// (they talk most, so they get the fastest links: the same socket, the same NVLink
// island), then context-parallel, then data-parallel, then pipeline stages outermost:
//
//   world rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
//
// A Grid splits the world once into one communicator per group this rank belongs to:
// tp, cp, dp, pp, plus the composite groups parallel strategies need:
//
// * dp_cp: the ranks that hold the same parameters (gradients are reduced over it when
//   context parallelism is on);
// * mp: tp x pp, the ranks that together hold one copy of the model (gradient norms are
//   summed over it);
// * embedding: Megatron's embedding group, the first and the last pipeline stage's
//   ranks with this rank's tp, cp and dp coordinates. When the input embedding and the
//   output projection share one matrix (tied weights), both stages hold a copy, and its
//   gradient is summed over this group. Every rank of the world takes part in its split
//   (MPI_Comm_split and ThreadComm's split are collective over the world), so a rank on
//   a middle stage gets a group of its own, of size 1, also named "embedding"; with
//   pp = 1 the first stage is the last and the group is this rank alone;
// * pp_grad: the same members, in the same order, as pp, but a communicator of its
//   own, so that the gradients a pipeline sends back travel apart from the activations
//   it sends forward (on NCCL: another NCCL communicator, another stream).
//
// Nothing else in llmpar builds groups, so every strategy sees the same layout.
#pragma once

#include <string>
#include <vector>

#include "llmpar/comm/communicator.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::comm {

// Parallel degrees. dp = 0 means "whatever is left": world / (tp * cp * pp).
struct GridSizes {
  int tp = 1;  // tensor parallel (and sequence parallel, which shares its ranks)
  int cp = 1;  // context parallel
  int pp = 1;  // pipeline stages
  int dp = 0;  // data parallel
};

// A rank's position on each axis.
struct GridCoords {
  int tp = 0, cp = 0, dp = 0, pp = 0;
  friend bool operator==(const GridCoords&, const GridCoords&) = default;
};

namespace detail {

inline std::string divisors_of(int n) {
  std::string s;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) s += concat(s.empty() ? "" : ", ", d);
  return s;
}

// Checks the sizes against the world size and fills in dp; the message names the
// sizes and what would work.
inline GridSizes resolve(GridSizes s, int world) {
  auto positive = [](const char* name, int v) {
    LLMPAR_CHECK(v >= 1, "Grid: ", name, " = ", v, " is not a parallel degree; use a positive number (1 turns ", name,
                 " parallelism off)");
  };
  positive("tp", s.tp);
  positive("cp", s.cp);
  positive("pp", s.pp);
  LLMPAR_CHECK(s.dp >= 0, "Grid: dp = ", s.dp,
               " is not a parallel degree; use a positive number, or 0 to give data parallelism the ranks left over");
  const long long model = static_cast<long long>(s.tp) * s.cp * s.pp;
  LLMPAR_CHECK(world % model == 0, "Grid: tp x cp x pp = ", s.tp, " x ", s.cp, " x ", s.pp, " = ", model,
               " does not divide the world of ", world, " ranks; choose degrees whose product divides ", world,
               " (its divisors: ", divisors_of(world), ")");
  const int rest = static_cast<int>(world / model);
  if (s.dp == 0) s.dp = rest;
  LLMPAR_CHECK(s.dp == rest, "Grid: tp x cp x pp x dp = ", s.tp, " x ", s.cp, " x ", s.pp, " x ", s.dp, " = ",
               model * s.dp, " but the world has ", world, " ranks; use dp = ", rest,
               " (or dp = 0, which takes the ranks left over)");
  return s;
}

}  // namespace detail

template <Communicator C>
class Grid {
 public:
  // Collective over `world`: every rank constructs its Grid with the same sizes. The
  // world must outlive the Grid.
  Grid(C& world, GridSizes sizes)
      : world_(&world),
        sizes_(detail::resolve(sizes, world.size())),
        coords_(coords_of(world.rank())),
        tp_(split_by({0, 1, 1, 1}, "tp")),
        cp_(split_by({1, 0, 1, 1}, "cp")),
        dp_(split_by({1, 1, 0, 1}, "dp")),
        pp_(split_by({1, 1, 1, 0}, "pp")),
        dp_cp_(split_by({1, 0, 0, 1}, "dp_cp")),
        mp_(split_by({0, 1, 1, 0}, "mp")),
        embedding_(split_embedding()),
        pp_grad_(split_by({1, 1, 1, 0}, "pp_grad")) {}

  const GridSizes& sizes() const { return sizes_; }
  const GridCoords& coords() const { return coords_; }
  int world_size() const { return world_->size(); }
  int world_rank() const { return world_->rank(); }

  C& world() { return *world_; }
  C& tp() { return tp_; }
  C& cp() { return cp_; }
  C& dp() { return dp_; }
  C& pp() { return pp_; }
  C& dp_cp() { return dp_cp_; }          // same parameters: dp x cp
  C& mp() { return mp_; }                // one model copy: tp x pp
  C& embedding() { return embedding_; }  // the first and last stage (size 1 on a middle stage)
  C& pp_grad() { return pp_grad_; }      // pp's members, a channel of its own for gradients

  bool first_stage() const { return coords_.pp == 0; }
  bool last_stage() const { return coords_.pp == sizes_.pp - 1; }

  // The world rank at a position, and the position of a world rank.
  int rank_of(GridCoords c) const { return c.tp + sizes_.tp * (c.cp + sizes_.cp * (c.dp + sizes_.dp * c.pp)); }
  GridCoords coords_of(int rank) const {
    GridCoords c;
    c.tp = rank % sizes_.tp;
    rank /= sizes_.tp;
    c.cp = rank % sizes_.cp;
    rank /= sizes_.cp;
    c.dp = rank % sizes_.dp;
    c.pp = rank / sizes_.dp;
    return c;
  }

 private:
  // The group of ranks that share this rank's coordinates on the axes marked 1 (the
  // color) and differ on the axes marked 0 (ordered by them, tp fastest: the key).
  C split_by(GridCoords fixed, const char* name) {
    const int extent[4] = {sizes_.tp, sizes_.cp, sizes_.dp, sizes_.pp};
    const int coord[4] = {coords_.tp, coords_.cp, coords_.dp, coords_.pp};
    const int keep[4] = {fixed.tp, fixed.cp, fixed.dp, fixed.pp};
    int color = 0, key = 0, color_stride = 1, key_stride = 1;
    for (int axis = 0; axis < 4; ++axis) {
      if (keep[axis]) {
        color += coord[axis] * color_stride;
        color_stride *= extent[axis];
      } else {
        key += coord[axis] * key_stride;
        key_stride *= extent[axis];
      }
    }
    return world_->split(color, key, name);
  }

  // The first and last stage with this rank's tp, cp and dp (the color: that position,
  // below tp*cp*dp; the key: the stage); every other rank alone (a color of its own, from
  // the world size up).
  C split_embedding() {
    if (first_stage() || last_stage()) {
      const int color = coords_.tp + sizes_.tp * (coords_.cp + sizes_.cp * coords_.dp);
      return world_->split(color, coords_.pp, "embedding");
    }
    return world_->split(world_->size() + world_->rank(), 0, "embedding");
  }

  C* world_;
  GridSizes sizes_;
  GridCoords coords_;
  C tp_, cp_, dp_, pp_, dp_cp_, mp_, embedding_, pp_grad_;
};

}  // namespace llmpar::comm
