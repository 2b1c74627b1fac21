// llmpar/train/trace.hpp — a pipeline step's timeline as Chrome trace JSON.
//
// Every rank's executor records its actions of a step (pipeline::ActionTiming: when it
// waited for its input and when it computed). gather_timeline collects them on every
// rank of the world (each rank's list has its own length); write_chrome_trace writes
// them as Trace Event Format "complete" events, one row (tid) per rank, that
// chrome://tracing and Perfetto (ui.perfetto.dev) open: forwards, backwards, input and
// weight gradients as named slices, the wait before each as a "wait" slice, so the
// bubble is visible where it is.
#pragma once

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "llmpar/comm/init.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/pipeline/executor.hpp"

namespace llmpar::train {

struct RankTimeline {
  int rank = 0;   // world rank
  int stage = 0;  // pipeline stage
  std::vector<pipeline::ActionTiming> actions;
};

// Every rank's timeline of its last step, on every rank (collective over world).
inline std::vector<RankTimeline> gather_timeline(comm::Comm& world, int stage,
                                                 std::span<const pipeline::ActionTiming> mine) {
  constexpr int kFields = 7;  // op, micro, chunk, start, end, wait, stage
  std::vector<std::int64_t> counts(static_cast<std::size_t>(world.size()));
  const std::int64_t n = static_cast<std::int64_t>(mine.size());
  world.all_gather(std::span<const std::int64_t>(&n, 1), std::span<std::int64_t>(counts));
  std::int64_t most = 0;
  for (std::int64_t c : counts) most = std::max(most, c);
  std::vector<float> local(static_cast<std::size_t>(most * kFields), 0.0f);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    float* f = local.data() + i * kFields;
    f[0] = static_cast<float>(mine[i].action.op);
    f[1] = static_cast<float>(mine[i].action.micro);
    f[2] = static_cast<float>(mine[i].action.chunk);
    f[3] = static_cast<float>(mine[i].start * 1e6);  // microseconds
    f[4] = static_cast<float>(mine[i].end * 1e6);
    f[5] = static_cast<float>(mine[i].wait * 1e6);
    f[6] = static_cast<float>(stage);
  }
  std::vector<float> all(local.size() * static_cast<std::size_t>(world.size()));
  world.all_gather(std::span<const float>(local), std::span<float>(all));
  std::vector<RankTimeline> out(static_cast<std::size_t>(world.size()));
  for (int r = 0; r < world.size(); ++r) {
    RankTimeline& t = out[static_cast<std::size_t>(r)];
    t.rank = r;
    for (std::int64_t i = 0; i < counts[static_cast<std::size_t>(r)]; ++i) {
      const float* f = all.data() + (static_cast<std::size_t>(r) * static_cast<std::size_t>(most) + i) * kFields;
      pipeline::ActionTiming a;
      a.action = {static_cast<pipeline::Op>(static_cast<int>(f[0])), static_cast<int>(f[1]), static_cast<int>(f[2])};
      a.start = f[3] * 1e-6;
      a.end = f[4] * 1e-6;
      a.wait = f[5] * 1e-6;
      t.stage = static_cast<int>(f[6]);
      t.actions.push_back(a);
    }
  }
  return out;
}

// The timeline as Chrome trace JSON at `path`.
LLMPAR_INLINE void write_chrome_trace(const std::string& path, const std::vector<RankTimeline>& ranks);

}  // namespace llmpar::train

// The bodies: compiled here (header-only), or once in a program that defines
// LLMPAR_COMPILED and links the compiled part of llmpar (config.hpp).
#if !defined(LLMPAR_COMPILED)
#include "llmpar/train/trace-inl.hpp"
#endif
