// comm_bench.hpp — what bench_collectives and bench_comm share: the operations they time,
// nccl-tests' size conventions, and algbw/busbw, defined once.
//
// Sizes follow nccl-tests (src/common.cu, src/*.cu): a requested size of `bytes` gives
// `bytes / sizeof(T)` elements in all; all_gather, reduce_scatter and all_to_all split
// them into one block per rank, so the size reported is the whole (gathered, scattered or
// exchanged) buffer and the count reported is one rank's block. algbw is that size over
// the time, busbw scales it to the traffic of a ring algorithm so that every collective
// can be held against the same link bandwidth (nccl-tests' doc/PERFORMANCE.md):
//
//   all_reduce                            2 (n - 1) / n
//   reduce_scatter, all_gather, all_to_all    (n - 1) / n
//   broadcast, reduce, sendrecv               1
//
// sendrecv: every rank sends to rank + 1 and receives from rank - 1 (modulo n).
#pragma once

#include <cstddef>
#include <cstdint>
#include <llmpar/comm/communicator.hpp>
#include <llmpar/comm/types.hpp>
#include <llmpar/core/dtype.hpp>
#include <optional>
#include <span>
#include <string_view>

namespace llmpar::bench {

enum class Test : std::uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all, sendrecv };

inline constexpr Test kTests[] = {Test::all_reduce, Test::reduce_scatter, Test::all_gather, Test::broadcast,
                                  Test::reduce,     Test::all_to_all,     Test::sendrecv};

constexpr std::string_view name_of(Test t) {
  switch (t) {
    case Test::all_reduce:
      return "all_reduce";
    case Test::reduce_scatter:
      return "reduce_scatter";
    case Test::all_gather:
      return "all_gather";
    case Test::broadcast:
      return "broadcast";
    case Test::reduce:
      return "reduce";
    case Test::all_to_all:
      return "all_to_all";
    case Test::sendrecv:
      return "sendrecv";
  }
  return "?";
}

inline std::optional<Test> parse_test(std::string_view name) {
  for (Test t : kTests)
    if (name == name_of(t)) return t;
  return std::nullopt;
}

constexpr bool has_reduction(Test t) { return t == Test::all_reduce || t == Test::reduce_scatter || t == Test::reduce; }
constexpr bool has_root(Test t) { return t == Test::broadcast || t == Test::reduce; }
// Whether the output of a rank is split into one block per rank.
constexpr bool is_blocked(Test t) {
  return t == Test::reduce_scatter || t == Test::all_gather || t == Test::all_to_all;
}

// One size of one operation on a group of n ranks, in elements per rank.
struct Shape {
  std::size_t count = 0;  // what nccl-tests prints: all elements, or one rank's block
  std::size_t send = 0;   // elements in this rank's send buffer
  std::size_t recv = 0;   // elements in this rank's receive buffer
  std::size_t bytes = 0;  // what nccl-tests prints as the size: the larger buffer
};

constexpr Shape shape_of(Test t, std::size_t bytes, std::size_t element_size, int ranks) {
  const std::size_t total = bytes / element_size, n = static_cast<std::size_t>(ranks);
  Shape s;
  switch (t) {
    case Test::reduce_scatter:
      s = {total / n, total / n * n, total / n, 0};
      break;
    case Test::all_gather:
      s = {total / n, total / n, total / n * n, 0};
      break;
    case Test::all_to_all:
      s = {total / n, total / n * n, total / n * n, 0};
      break;
    default:
      s = {total, total, total, 0};
  }
  s.bytes = (s.send > s.recv ? s.send : s.recv) * element_size;
  return s;
}

// busbw / algbw (see the table above): comm::bus_factor of the collective.
constexpr double bus_factor(Test t, int ranks) {
  switch (t) {
    case Test::all_reduce:
      return comm::bus_factor(comm::Collective::all_reduce, ranks);
    case Test::reduce_scatter:
      return comm::bus_factor(comm::Collective::reduce_scatter, ranks);
    case Test::all_gather:
      return comm::bus_factor(comm::Collective::all_gather, ranks);
    case Test::all_to_all:
      return comm::bus_factor(comm::Collective::all_to_all, ranks);
    default:
      return 1.0;
  }
}

// GB/s (1e9 bytes per second) of one operation of `shape` taking `seconds`.
inline double algbw(const Shape& shape, double seconds) { return static_cast<double>(shape.bytes) * 1e-9 / seconds; }
inline double busbw(Test t, int ranks, const Shape& shape, double seconds) {
  return algbw(shape, seconds) * bus_factor(t, ranks);
}

// The buffers one call reads and writes on this rank. Out of place they are the
// starts of `send` and `recv`; in place they overlap within `recv` as NCCL's in-place
// conventions put them (see comm/types.hpp).
template <class T>
struct Views {
  std::span<const T> send;
  std::span<T> recv;
};

template <class T>
Views<T> views_of(Test t, const Shape& s, int rank, bool in_place, std::span<T> send, std::span<T> recv) {
  if (!in_place) return {send.first(s.send), recv.first(s.recv)};
  const std::size_t block = s.count * static_cast<std::size_t>(rank);
  switch (t) {
    case Test::reduce_scatter:
      return {recv.first(s.send), recv.subspan(block, s.recv)};
    case Test::all_gather:
      return {recv.subspan(block, s.send), recv.first(s.recv)};
    default:
      return {recv.first(s.send), recv.first(s.recv)};
  }
}

// Whether the operation has an in-place form. sendrecv has none: on a ring, the receive
// would overwrite the buffer the same rank is still sending.
constexpr bool has_in_place(Test t) { return t != Test::sendrecv; }

// The typed front end broadcasts in place only; the engines' core (comm::Op) also
// takes a separate send buffer at the root.
template <class T>
comm::Op broadcast_out_of_place(int rank, const Views<T>& v, int root) {
  comm::Op o;
  o.kind = comm::Collective::broadcast;
  o.type = dtype_of<T>();
  o.count = v.recv.size();
  o.root = root;
  o.send = rank == root ? v.send.data() : nullptr;
  o.recv = v.recv.data();
  return o;
}

// Issues one operation on `comm` and waits for it (for an engine whose operations run
// on a stream, "waits" means: as far as the engine's blocking calls wait).
template <comm::Communicator Comm, class T>
void issue(Comm& comm, Test t, const Views<T>& v, bool in_place, comm::ReduceOp op, int root) {
  switch (t) {
    case Test::all_reduce:
      return comm.all_reduce(v.send, v.recv, op);
    case Test::reduce_scatter:
      return comm.reduce_scatter(v.send, v.recv, op);
    case Test::all_gather:
      return comm.all_gather(v.send, v.recv);
    case Test::broadcast:
      if (in_place) return comm.broadcast(v.recv, root);
      return comm.run(broadcast_out_of_place(comm.rank(), v, root));
    case Test::reduce:
      return comm.reduce(v.send, v.recv, op, root);
    case Test::all_to_all:
      return comm.all_to_all(v.send, v.recv);
    case Test::sendrecv: {
      const int n = comm.size(), r = comm.rank();
      auto sent = comm.send_async(v.send, (r + 1) % n);
      comm.recv(v.recv, (r + n - 1) % n);
      sent.wait();
      return;
    }
  }
}

}  // namespace llmpar::bench
