// llmpar/comm/detail/verify.hpp — how every engine words ranks that disagree.
//
// Each engine checks in its own way that the ranks issue the same operation: ThreadComm
// compares the members' posts in shared memory, MpiComm and NcclComm all-reduce
// fingerprints over MPI. They report a difference in one place, here, so that a user
// reads the same sentence whatever the engine: from a table of every rank's fingerprint
// (Op::fingerprint(), then any fields of the engine's own, such as MpiComm's blocking
// or async), the first field that differs with each rank's value:
//
//   all_reduce on group 'world' (world ranks 0, 1): element count differs between
//   ranks: rank 0 has 1024, rank 1 has 1000
//
// and, for a send/recv pair, both sides. Verify mode's switch (LLMPAR_COMM_VERIFY) is
// read here too, for the engines that have a verify mode.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "llmpar/comm/communicator.hpp"
#include "llmpar/comm/types.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::comm::detail {

// One field of a fingerprint: its name in messages, and how one of its values reads.
struct FingerprintField {
  std::string_view name;
  std::string (*value)(std::int64_t) = nullptr;
};

// The collective field of split(), which is not an Op but is checked like one.
inline constexpr std::int64_t kSplitKind = -1;

// The fields of Op::fingerprint(), in its order.
inline constexpr std::array<FingerprintField, 5> kFingerprintFields{{
    {"collective",
     [](std::int64_t v) {
       return v == kSplitKind ? std::string("split") : std::string(name_of(static_cast<Collective>(v)));
     }},
    {"element type", [](std::int64_t v) { return std::string(name_of(static_cast<DType>(v))); }},
    {"element count", [](std::int64_t v) { return std::to_string(v); }},
    {"reduction",
     [](std::int64_t v) {
       return v < 0 ? std::string("no reduction") : std::string(name_of(static_cast<ReduceOp>(v)));
     }},
    {"root", [](std::int64_t v) { return v < 0 ? std::string("no root") : std::to_string(v); }},
}};

// Op::fingerprint()'s fields followed by an engine's own.
template <std::size_t N>
constexpr std::array<FingerprintField, kFingerprintFields.size() + N> fingerprint_fields_and(
    const std::array<FingerprintField, N>& own) {
  std::array<FingerprintField, kFingerprintFields.size() + N> all{};
  std::copy(kFingerprintFields.begin(), kFingerprintFields.end(), all.begin());
  std::copy(own.begin(), own.end(), all.begin() + kFingerprintFields.size());
  return all;
}

// "rank 0 has 1024, rank 1 has 1000"; beyond 16 ranks, ranks with equal values are
// grouped ("ranks 0-511, 513-1023 have 1024, rank 512 has 1000").
inline std::string list_rank_values(const GroupInfo& group, const std::vector<std::string>& values) {
  const std::size_t n = values.size();
  std::string out;
  if (n <= 16) {
    for (std::size_t r = 0; r < n; ++r)
      out += concat(r ? ", " : "", group.member(static_cast<int>(r)), " has ", values[r]);
    return out;
  }
  std::vector<bool> listed(n, false);
  for (std::size_t first = 0; first < n; ++first) {
    if (listed[first]) continue;
    std::vector<std::size_t> ranks;
    for (std::size_t r = first; r < n; ++r)
      if (!listed[r] && values[r] == values[first]) {
        listed[r] = true;
        ranks.push_back(r);
      }
    std::string spans;
    for (std::size_t i = 0; i < ranks.size();) {
      std::size_t j = i;
      while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
      spans += concat(i ? ", " : "", ranks[i]);
      if (j > i) spans += concat("-", ranks[j]);
      i = j + 1;
    }
    out += concat(out.empty() ? "" : ", ", ranks.size() > 1 ? "ranks " : "rank ", spans,
                  ranks.size() > 1 ? " have " : " has ", values[first]);
  }
  return out;
}

// The error every rank throws when the fingerprints of `what` (an operation's name)
// differ between the ranks of `group`, or "" when they agree. `table` holds one row of
// `width` values per rank, in rank order; its first fields.size() columns are compared,
// in order, and the first that differs is named with every rank's value.
inline std::string mismatch_message(std::string_view what, const GroupInfo& group, std::span<const std::int64_t> table,
                                    std::size_t width, std::span<const FingerprintField> fields) {
  const std::size_t ranks = table.size() / width;
  for (std::size_t field = 0; field < fields.size(); ++field) {
    const auto at = [&](std::size_t r) { return table[r * width + field]; };
    bool differs = false;
    for (std::size_t r = 1; r < ranks; ++r) differs = differs || at(r) != at(0);
    if (!differs) continue;
    std::vector<std::string> values;
    for (std::size_t r = 0; r < ranks; ++r) values.push_back(fields[field].value(at(r)));
    return concat(what, " on ", group.describe(), ": ", fields[field].name,
                  " differs between ranks: ", list_rank_values(group, values));
  }
  return {};
}

// The check of a send/recv pair ("" when their element types and counts match).
inline std::string p2p_mismatch_message(const Op& send, int sender, const Op& recv, int receiver,
                                        const GroupInfo& group) {
  if (send.type == recv.type && send.count == recv.count) return {};
  return concat(send.describe(), " by ", group.member(sender), " does not match ", recv.describe(), " by ",
                group.member(receiver), " on ", group.describe(), ": the element ",
                send.type != recv.type ? "types" : "counts", " differ");
}

// Verify mode as asked for in the options (`verify`) or by LLMPAR_COMM_VERIFY=1.
inline bool verify_from_environment(bool verify) {
  const char* value = std::getenv("LLMPAR_COMM_VERIFY");
  if (value == nullptr || *value == '\0') return verify;
  const std::string_view v(value);
  LLMPAR_CHECK(v == "0" || v == "1", "LLMPAR_COMM_VERIFY=", v,
               " is not 0 or 1; set LLMPAR_COMM_VERIFY=1 to check every collective across ranks, 0 not to");
  return verify || v == "1";
}

}  // namespace llmpar::comm::detail
