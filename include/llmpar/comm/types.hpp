// llmpar/comm/types.hpp — what a collective is, independent of the engine that runs it.
//
// Every engine (ThreadComm, MpiComm, NcclComm) receives the same plain description of
// an operation, `comm::Op`: which collective, the element type, the element count, the
// reduction, the root or peer, and the two buffers. The typed front end
// (comm/communicator.hpp) builds an Op from spans and checks their sizes once, so the
// engines see only validated, untyped requests; the element type becomes a C++ type
// again in exactly one place (`visit_dtype`). Counts follow NCCL's conventions:
//
//   all_reduce      send, recv: count            (recv == send: in place)
//   reduce_scatter  send: size*count, recv: count (recv == send + rank*count: in place)
//   all_gather      send: count, recv: size*count (send == recv + rank*count: in place)
//   broadcast       send (root only), recv: count (recv == send: in place)
//   reduce          send: count, recv (root only): count
//   all_to_all      send, recv: size*count; block p of send goes to rank p
//   send / recv     count elements to / from `peer`
//   barrier         no buffers
//
// `Op::fingerprint()` packs the fields that must agree across ranks (everything but the
// buffer addresses) so that engines can verify a collective before running it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::comm {

namespace detail {
using llmpar::detail::concat;  // comm::detail would otherwise hide it
}  // namespace detail

// A collective that waited past the communicator's timeout: a rank stopped answering.
// An llmpar::Error like any other, of its own type so that a trainer can tell it from
// the errors a restart would repeat (train_gpt ends the process with kLostRankExit).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// The exit status of a job ended because a rank stopped answering (the MPI watchdog's
// MPI_Abort, train_gpt on a TimeoutError): EX_TEMPFAIL (75, sysexits.h), "try again". A
// supervisor (tools/supervise.sh, behind `./llmpar.sh train --restarts N`) restarts a
// run on it and on signals, never on the errors a restart would repeat (exit 1).
inline constexpr int kLostRankExit = 75;

enum class ReduceOp : std::uint8_t { sum, avg, max, min };

enum class Collective : std::uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  reduce,
  all_to_all,
  send,
  recv,
  barrier,
};

// nccl-tests' bus bandwidth factor: busbw = algbw x bus_factor, the traffic of a ring
// algorithm per rank relative to the buffer (2(n-1)/n for an all-reduce, (n-1)/n for a
// reduce-scatter, all-gather or all-to-all, 1 for the rest). The collective benchmarks
// report busbw with it, and the planner (plan/cost.hpp) turns a link's busbw back into
// the time of a collective with it.
constexpr double bus_factor(Collective c, int ranks) {
  const double n = ranks;
  switch (c) {
    case Collective::all_reduce:
      return 2.0 * (n - 1.0) / n;
    case Collective::reduce_scatter:
    case Collective::all_gather:
    case Collective::all_to_all:
      return (n - 1.0) / n;
    default:
      return 1.0;
  }
}

constexpr std::string_view name_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "?";
}

constexpr std::string_view name_of(Collective c) {
  switch (c) {
    case Collective::all_reduce:
      return "all_reduce";
    case Collective::reduce_scatter:
      return "reduce_scatter";
    case Collective::all_gather:
      return "all_gather";
    case Collective::broadcast:
      return "broadcast";
    case Collective::reduce:
      return "reduce";
    case Collective::all_to_all:
      return "all_to_all";
    case Collective::send:
      return "send";
    case Collective::recv:
      return "recv";
    case Collective::barrier:
      return "barrier";
  }
  return "?";
}

// Whether the collective takes a reduction / a root.
constexpr bool has_reduction(Collective c) {
  return c == Collective::all_reduce || c == Collective::reduce_scatter || c == Collective::reduce;
}
constexpr bool has_root(Collective c) { return c == Collective::broadcast || c == Collective::reduce; }

// The element types a communicator moves: f32, bf16, f16, i32, i64 and bytes
// (std::byte or std::uint8_t; reductions treat bytes as unsigned 8-bit integers).
template <class T>
concept Element = std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16> ||
                  std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int64_t> ||
                  std::is_same_v<T, std::uint8_t> || std::is_same_v<T, std::byte>;

// The single runtime-to-type boundary for communication: calls f(T{}) with the C++
// element type of `t` (bytes come back as std::uint8_t).
template <class F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      return f(float{});
    case DType::bf16:
      return f(bf16{});
    case DType::f16:
      return f(f16{});
    case DType::i32:
      return f(std::int32_t{});
    case DType::i64:
      return f(std::int64_t{});
    case DType::u8:
      return f(std::uint8_t{});
  }
  LLMPAR_FAIL("unknown DType ", static_cast<int>(t));
}

// One operation as an engine receives it (see the table above).
struct Op {
  Collective kind = Collective::barrier;
  DType type = DType::u8;
  std::size_t count = 0;
  ReduceOp reduce = ReduceOp::sum;
  int root = 0;  // broadcast/reduce: the root; send/recv: the peer
  const void* send = nullptr;
  void* recv = nullptr;

  // The fields every rank must agree on, as integers (send/recv pair up instead).
  std::array<std::int64_t, 5> fingerprint() const {
    return {static_cast<std::int64_t>(kind), static_cast<std::int64_t>(type), static_cast<std::int64_t>(count),
            has_reduction(kind) ? static_cast<std::int64_t>(reduce) : -1, has_root(kind) ? root : -1};
  }

  // "all_reduce(f32, count 1024, sum)" — for error messages.
  std::string describe() const {
    std::string s = detail::concat(name_of(kind), "(", name_of(type), ", count ", count);
    if (has_reduction(kind)) s += detail::concat(", ", name_of(reduce));
    if (has_root(kind)) s += detail::concat(", root ", root);
    if (kind == Collective::send) s += detail::concat(", to ", root);
    if (kind == Collective::recv) s += detail::concat(", from ", root);
    return s + ")";
  }
};

// Elements in the send and receive buffers of `op` on a group of `size` ranks, for the
// rank `rank` (the root alone needs a receive buffer for reduce, a send buffer for
// broadcast).
struct BufferCounts {
  std::size_t send = 0;
  std::size_t recv = 0;
};

constexpr BufferCounts buffer_counts(const Op& op, int size, int rank) {
  const std::size_t n = static_cast<std::size_t>(size);
  switch (op.kind) {
    case Collective::all_reduce:
      return {op.count, op.count};
    case Collective::reduce_scatter:
      return {n * op.count, op.count};
    case Collective::all_gather:
      return {op.count, n * op.count};
    case Collective::broadcast:
      return {rank == op.root ? op.count : 0, op.count};
    case Collective::reduce:
      return {op.count, rank == op.root ? op.count : 0};
    case Collective::all_to_all:
      return {n * op.count, n * op.count};
    case Collective::send:
      return {op.count, 0};
    case Collective::recv:
      return {0, op.count};
    case Collective::barrier:
      return {0, 0};
  }
  return {};
}

namespace detail {

// Reductions on the host, shared by ThreadComm and by the MPI reduction operators for
// the types MPI lacks (bf16, f16). Floating types reduce in float; integers wrap
// (unsigned arithmetic) instead of overflowing; avg of integers truncates toward zero,
// as NCCL's ncclAvg does.
template <class T>
struct Accumulator {
  using type = std::conditional_t<kIsFloating<T>, float, T>;
};

template <class A>
A combine(ReduceOp op, A a, A b) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      if constexpr (std::is_integral_v<A>) {
        using U = std::make_unsigned_t<A>;
        return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
      } else {
        return a + b;
      }
    case ReduceOp::max:
      return b > a ? b : a;
    case ReduceOp::min:
      return b < a ? b : a;
  }
  return a;
}

// The last step of avg: divide the sum by the number of ranks.
template <class A>
A finish(ReduceOp op, A a, int size) {
  if (op != ReduceOp::avg) return a;
  if constexpr (std::is_integral_v<A>)
    return static_cast<A>(a / static_cast<A>(size));
  else
    return a / static_cast<A>(size);
}

}  // namespace detail
}  // namespace llmpar::comm
