// The rank grid: Megatron's layout for many (tp, cp, pp, dp) on thread worlds, every
// group (the embedding group and pp_grad included) checked against a brute-force
// enumeration of the ranks it must contain, a collective on each group, and the errors
// for degrees that do not fit the world.
#include <doctest/doctest.h>

#include <atomic>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "llmpar/comm/grid.hpp"
#include "llmpar/comm/thread_comm.hpp"

using namespace llmpar;
using comm::Grid;
using comm::GridCoords;
using comm::GridSizes;
using comm::ThreadComm;

namespace {

// The world ranks that agree with `me` on every axis where same[axis] is true, in the
// order of the others (tp fastest) — written out independently of Grid::split_by.
std::vector<int> expected_group(const Grid<ThreadComm>& g, GridCoords me, GridCoords same) {
  const auto s = g.sizes();
  std::vector<int> ranks;
  for (int pp = 0; pp < s.pp; ++pp)
    for (int dp = 0; dp < s.dp; ++dp)
      for (int cp = 0; cp < s.cp; ++cp)
        for (int tp = 0; tp < s.tp; ++tp) {
          const GridCoords c{tp, cp, dp, pp};
          if ((same.tp && c.tp != me.tp) || (same.cp && c.cp != me.cp) || (same.dp && c.dp != me.dp) ||
              (same.pp && c.pp != me.pp))
            continue;
          ranks.push_back(tp + s.tp * (cp + s.cp * (dp + s.dp * pp)));
        }
  return ranks;
}

// Megatron's embedding group: the first and last stage with my tp, cp and dp (once when
// they are one stage); a middle stage alone.
std::vector<int> expected_embedding(const Grid<ThreadComm>& g, GridCoords me) {
  const int last = g.sizes().pp - 1;
  if (me.pp != 0 && me.pp != last) return {g.rank_of(me)};
  GridCoords first = me, end = me;
  first.pp = 0;
  end.pp = last;
  if (last == 0) return {g.rank_of(first)};
  return {g.rank_of(first), g.rank_of(end)};
}

}  // namespace

TEST_CASE("Grid: Megatron layout and every group, for many layouts") {
  struct Layout {
    int world;
    GridSizes sizes;
  };
  const std::vector<Layout> layouts = {
      {1, {}},
      {2, {.tp = 2}},
      {4, {.tp = 2}},
      {4, {.pp = 2}},
      {6, {.tp = 3}},
      {6, {.tp = 2, .pp = 3}},
      {8, {.tp = 2, .cp = 2}},
      {8, {.tp = 2, .cp = 2, .pp = 2}},
      {8, {.pp = 4}},
      {8, {.cp = 2, .dp = 4}},
      {12, {.tp = 2, .pp = 3}},
      {16, {.tp = 2, .cp = 2, .pp = 2, .dp = 2}},
      {5, {.pp = 5}},
      {7, {}},
  };
  for (const auto& layout : layouts) {
    CAPTURE(layout.world);
    CAPTURE(layout.sizes.tp);
    CAPTURE(layout.sizes.cp);
    CAPTURE(layout.sizes.pp);
    std::atomic<int> failures{0};
    std::mutex mutex;
    std::string first;
    comm::run_threads(layout.world, [&](ThreadComm& world) {
      Grid grid(world, layout.sizes);
      const auto s = grid.sizes();
      const auto c = grid.coords();
      auto fail = [&](const std::string& what) {
        if (failures.fetch_add(1) == 0) {
          std::lock_guard lock(mutex);
          first = detail::concat("world rank ", world.rank(), ": ", what);
        }
      };
      if (s.tp * s.cp * s.pp * s.dp != world.size()) fail("sizes do not multiply to the world");
      if (grid.rank_of(c) != world.rank() || !(grid.coords_of(world.rank()) == c)) fail("rank_of/coords_of");
      struct Check {
        ThreadComm* comm;
        GridCoords same;
        int rank;
        const char* name;
      };
      const Check checks[] = {
          {&grid.tp(), {0, 1, 1, 1}, c.tp, "tp"},
          {&grid.cp(), {1, 0, 1, 1}, c.cp, "cp"},
          {&grid.dp(), {1, 1, 0, 1}, c.dp, "dp"},
          {&grid.pp(), {1, 1, 1, 0}, c.pp, "pp"},
          {&grid.dp_cp(), {1, 0, 0, 1}, c.cp + s.cp * c.dp, "dp_cp"},
          {&grid.mp(), {0, 1, 1, 0}, c.tp + s.tp * c.pp, "mp"},
          {&grid.pp_grad(), {1, 1, 1, 0}, c.pp, "pp_grad"},
          {&grid.embedding(), {}, c.pp == s.pp - 1 && s.pp > 1 ? 1 : 0, "embedding"},
      };
      for (const auto& check : checks) {
        const std::string_view name = check.name;
        const auto want = name == "embedding" ? expected_embedding(grid, c) : expected_group(grid, c, check.same);
        if (check.comm->group().world_ranks != want) fail(detail::concat(check.name, " members"));
        if (check.comm->rank() != check.rank) fail(detail::concat(check.name, " rank"));
        if (check.comm->group().name != check.name) fail(detail::concat(check.name, " name"));
        // The group really is a communicator over exactly those ranks.
        std::vector<std::int64_t> sum{world.rank()};
        check.comm->all_reduce(sum);
        std::int64_t want_sum = 0;
        for (int r : want) want_sum += r;
        if (sum[0] != want_sum) fail(detail::concat(check.name, " all_reduce"));
      }
      if (grid.first_stage() != (c.pp == 0) || grid.last_stage() != (c.pp == s.pp - 1)) fail("stages");
    });
    CHECK_MESSAGE(failures.load() == 0, first);
  }
}

TEST_CASE("Grid: tensor-parallel ranks are adjacent, pipeline stages outermost") {
  comm::run_threads(8, [](ThreadComm& world) {
    Grid grid(world, {.tp = 2, .pp = 2});  // dp = 2
    CHECK(grid.sizes().dp == 2);
    if (world.rank() == 5) {
      CHECK(grid.coords() == GridCoords{.tp = 1, .cp = 0, .dp = 0, .pp = 1});
      CHECK(grid.tp().group().world_ranks == std::vector<int>{4, 5});
      CHECK(grid.dp().group().world_ranks == std::vector<int>{5, 7});
      CHECK(grid.pp().group().world_ranks == std::vector<int>{1, 5});
      CHECK(grid.mp().group().world_ranks == std::vector<int>{0, 1, 4, 5});
    }
  });
}

TEST_CASE("Grid: the embedding group joins the first and last stage; pp_grad is a second pp communicator") {
  comm::run_threads(8, [](ThreadComm& world) {
    Grid grid(world, {.tp = 2, .pp = 2, .dp = 2});
    // Every rank is on the first or the last of the 2 stages: pairs (r, r + 4).
    const int r = world.rank(), first = r % 4, last = first + 4;
    CHECK(grid.embedding().group().name == "embedding");
    CHECK(grid.embedding().size() == 2);
    CHECK(grid.embedding().rank() == (r < 4 ? 0 : 1));
    CHECK(grid.embedding().group().world_ranks == std::vector<int>{first, last});
    CHECK(grid.pp_grad().group().name == "pp_grad");
    CHECK(grid.pp_grad().group().world_ranks == grid.pp().group().world_ranks);
    CHECK(grid.pp_grad().rank() == grid.pp().rank());
    // The tied embedding's gradient: summed over the two stages.
    std::vector<float> grad{static_cast<float>(r)};
    grid.embedding().all_reduce(grad);
    CHECK(grad[0] == static_cast<float>(first + last));
    // Two channels between the stages: the gradient posted first on pp_grad is not what
    // a recv on pp receives.
    std::vector<std::int32_t> activation{r}, gradient{100 + r}, got_activation{-1}, got_gradient{-1};
    const int peer = 1 - grid.pp().rank();
    if (grid.first_stage()) {
      auto sent = grid.pp_grad().send_async(gradient, peer);
      grid.pp().send(activation, peer);
      sent.wait();
    } else {
      grid.pp().recv(got_activation, peer);
      grid.pp_grad().recv(got_gradient, peer);
      CHECK(got_activation[0] == first);
      CHECK(got_gradient[0] == 100 + first);
    }
  });
  // Middle stages have groups of their own; with one stage the group is the rank alone.
  comm::run_threads(8, [](ThreadComm& world) {
    Grid grid(world, {.tp = 2, .pp = 4});  // dp = 1: stage s holds ranks 2s, 2s + 1
    const int r = world.rank(), stage = grid.coords().pp;
    if (stage == 0 || stage == 3)
      CHECK(grid.embedding().group().world_ranks == std::vector<int>{r % 2, r % 2 + 6});
    else
      CHECK(grid.embedding().group().world_ranks == std::vector<int>{r});
    CHECK(grid.embedding().group().name == "embedding");
    CHECK(grid.pp_grad().group().world_ranks == std::vector<int>{r % 2, r % 2 + 2, r % 2 + 4, r % 2 + 6});
    Grid flat(world, {.tp = 4});  // pp = 1
    CHECK(flat.embedding().size() == 1);
    CHECK(flat.embedding().group().world_ranks == std::vector<int>{r});
  });
}

TEST_CASE("Grid: degrees that do not fit the world fail with the sizes and what would work") {
  auto error_of = [](int world, GridSizes sizes) {
    std::string message;
    try {
      comm::run_threads(world, [&](ThreadComm& w) { Grid grid(w, sizes); });
    } catch (const Error& e) {
      message = e.what();
    }
    return message;
  };
  CHECK(error_of(8, {.tp = 3})
            .find("Grid: tp x cp x pp = 3 x 1 x 1 = 3 does not divide the world of 8 ranks; choose "
                  "degrees whose product divides 8 (its divisors: 1, 2, 4, 8)") != std::string::npos);
  CHECK(error_of(4, {.tp = 0}).find("Grid: tp = 0 is not a parallel degree; use a positive number") !=
        std::string::npos);
  CHECK(error_of(4, {.pp = -2}).find("Grid: pp = -2 is not a parallel degree") != std::string::npos);
  CHECK(error_of(4, {.dp = -1}).find("Grid: dp = -1 is not a parallel degree") != std::string::npos);
  CHECK(error_of(8, {.tp = 2, .dp = 2})
            .find("Grid: tp x cp x pp x dp = 2 x 1 x 1 x 2 = 4 but the world has 8 ranks; "
                  "use dp = 4 (or dp = 0, which takes the ranks left over)") != std::string::npos);
  CHECK(error_of(6, {.tp = 4, .pp = 2}).find("= 8 does not divide the world of 6 ranks") != std::string::npos);
}
