// llmpar/train/trace-inl.hpp — the body of trace.hpp's Chrome trace writer.
//
// trace.hpp includes this file unless LLMPAR_COMPILED is defined; a program that
// defines it compiles this file once, in the compiled part of llmpar (src/), where
// LLMPAR_INLINE is empty (config.hpp).
#pragma once

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "llmpar/train/trace.hpp"

namespace llmpar::train {

LLMPAR_INLINE void write_chrome_trace(const std::string& path, const std::vector<RankTimeline>& ranks) {
  nlohmann::json events = nlohmann::json::array();
  for (const RankTimeline& t : ranks) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", t.rank},
                      {"args", {{"name", detail::concat("rank ", t.rank, " (stage ", t.stage, ")")}}}});
    for (const pipeline::ActionTiming& a : t.actions) {
      const double start = a.start * 1e6, end = a.end * 1e6, wait = a.wait * 1e6;
      if (wait > 0.0)
        events.push_back({{"name", "wait"},
                          {"cat", "bubble"},
                          {"ph", "X"},
                          {"pid", 0},
                          {"tid", t.rank},
                          {"ts", start - wait},
                          {"dur", wait}});
      events.push_back({{"name", pipeline::describe(a.action)},
                        {"cat", pipeline::op_name(a.action.op)},
                        {"ph", "X"},
                        {"pid", 0},
                        {"tid", t.rank},
                        {"ts", start},
                        {"dur", end - start},
                        {"args", {{"micro_batch", a.action.micro}, {"chunk", a.action.chunk}}}});
    }
  }
  std::ofstream out(path, std::ios::out | std::ios::trunc);
  LLMPAR_CHECK(out.good(), "cannot open trace file '", path,
               "' for writing; check the directory exists and is writable");
  out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << '\n';
  LLMPAR_CHECK(out.good(), "writing the trace file '", path, "' failed");
}

}  // namespace llmpar::train
