// llmpar/comm/communicator.hpp — the Communicator concept and its typed front end.
//
// An engine (ThreadComm, MpiComm, NcclComm) implements a small untyped core:
//
//   int rank() const; int size() const;        this rank and the group's size
//   const GroupInfo& group() const;            the group's name and world ranks
//   void run(const Op&);                       run one operation to completion
//   Request start(const Op&);                  issue it now, wait() later
//   Request start_batch(std::span<const Op>);  issue sends and recvs together (below)
//   Engine split(int color, int key, std::string name);
//
// and inherits `Collectives<Engine>`, which turns spans into validated `Op`s: every
// size rule of the table in comm/types.hpp is checked here, once, with a message that
// names the buffer, its size and what it should be. So the engines never see a
// malformed request, and a trainer written against the concept runs on any engine.
//
// Batched point to point (p2p, p2p_async) exists for pipeline parallelism, where two
// neighbouring stages each send to and receive from the other at once. Issued one by
// one, that deadlocks on NCCL (an ncclSend holds its stream until the peer's ncclRecv
// is posted, so both ranks wait in their sends), and needs care on every engine. A
// batch starts all of its sends and receives before it waits for any (NCCL: one
// ncclGroupStart/ncclGroupEnd), so any batch whose every send has its receive posted
// on the peer completes. Messages between a pair of ranks keep the order in which they
// were posted, within a batch and across batches, as single sends and receives do.
//
// Operations on one communicator are issued in the same order on every rank (as in
// MPI and NCCL). An asynchronous operation's buffers must stay alive and untouched
// until its Request's wait() returns. A communicator object belongs to one thread of
// its rank at a time.
#pragma once

#include <concepts>
#include <cstddef>
#include <initializer_list>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "llmpar/comm/types.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::comm {

// What a group is, for error messages: "tp[1] (world ranks 2, 3)".
struct GroupInfo {
  std::string name = "world";
  std::vector<int> world_ranks;  // world rank of each member, by group rank

  std::string describe() const {
    std::string s = detail::concat("group '", name, "' (world ranks ");
    for (std::size_t i = 0; i < world_ranks.size(); ++i) s += detail::concat(i ? ", " : "", world_ranks[i]);
    return s + ")";
  }
  // "rank 1 (world rank 3)"
  std::string member(int rank) const {
    if (rank >= 0 && static_cast<std::size_t>(rank) < world_ranks.size() && world_ranks[rank] != rank)
      return detail::concat("rank ", rank, " (world rank ", world_ranks[rank], ")");
    return detail::concat("rank ", rank);
  }
};

template <class R>
concept Request = std::movable<R> && requires(R r) {
  r.wait();
  { r.test() } -> std::same_as<bool>;
};

// A contiguous buffer of communicable elements: std::vector, std::span, std::array, ...
template <class B>
concept Buffer = std::ranges::contiguous_range<B> && std::ranges::sized_range<B> &&
    Element<std::remove_cv_t<std::ranges::range_value_t<B>>>;

template <class B>
concept MutableBuffer = Buffer<B> && !std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<B>>>;

template <Buffer B>
using element_t = std::remove_cv_t<std::ranges::range_value_t<B>>;

template <class C>
concept Communicator = std::movable<C> &&
    requires(C& c, const C& cc, const Op& op, std::span<const Op> ops, int color, int key, std::string name,
             std::vector<float>& data, std::span<const float> in) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  { cc.group() } -> std::convertible_to<const GroupInfo&>;
  c.run(op);
  { c.start(op) } -> Request;
  { c.start_batch(ops) } -> Request;
  { c.split(color, key, name) } -> std::same_as<C>;
  c.all_reduce(data, ReduceOp::sum);
  c.all_reduce(in, data, ReduceOp::avg);
  c.reduce_scatter(in, data, ReduceOp::sum);
  c.all_gather(in, data);
  c.broadcast(data, 0);
  c.reduce(in, data, ReduceOp::sum, 0);
  c.all_to_all(in, data);
  c.send(in, 0);
  c.recv(data, 0);
  { c.send_op(in, 0) } -> std::same_as<Op>;
  { c.recv_op(data, 0) } -> std::same_as<Op>;
  c.p2p(ops);
  { c.p2p_async(ops) } -> Request;
  c.barrier();
};

// The typed front end every engine inherits (CRTP). `_async` variants return the
// engine's Request; the others wait.
template <class Engine>
class Collectives {
 public:
  // ---- all_reduce: every rank gets op over all ranks' data.
  template <MutableBuffer B>
  void all_reduce(B&& data, ReduceOp op = ReduceOp::sum) {
    self().run(make_all_reduce(data, data, op));
  }
  template <Buffer S, MutableBuffer R>
  void all_reduce(const S& send, R&& recv, ReduceOp op = ReduceOp::sum) {
    self().run(make_all_reduce(send, recv, op));
  }
  template <MutableBuffer B>
  auto all_reduce_async(B&& data, ReduceOp op = ReduceOp::sum) {
    return self().start(make_all_reduce(data, data, op));
  }
  template <Buffer S, MutableBuffer R>
  auto all_reduce_async(const S& send, R&& recv, ReduceOp op = ReduceOp::sum) {
    return self().start(make_all_reduce(send, recv, op));
  }

  // ---- reduce_scatter: rank r gets block r of op over all ranks' send (size() blocks).
  template <Buffer S, MutableBuffer R>
  void reduce_scatter(const S& send, R&& recv, ReduceOp op = ReduceOp::sum) {
    self().run(make_reduce_scatter(send, recv, op));
  }
  template <Buffer S, MutableBuffer R>
  auto reduce_scatter_async(const S& send, R&& recv, ReduceOp op = ReduceOp::sum) {
    return self().start(make_reduce_scatter(send, recv, op));
  }

  // ---- all_gather: recv = concatenation of every rank's send, in rank order.
  template <Buffer S, MutableBuffer R>
  void all_gather(const S& send, R&& recv) {
    self().run(make_all_gather(send, recv));
  }
  template <Buffer S, MutableBuffer R>
  auto all_gather_async(const S& send, R&& recv) {
    return self().start(make_all_gather(send, recv));
  }

  // ---- broadcast: every rank's data becomes root's data.
  template <MutableBuffer B>
  void broadcast(B&& data, int root) {
    self().run(make_broadcast(data, root));
  }
  template <MutableBuffer B>
  auto broadcast_async(B&& data, int root) {
    return self().start(make_broadcast(data, root));
  }

  // ---- reduce: root's recv gets op over all ranks' send (recv may be empty elsewhere).
  template <Buffer S, MutableBuffer R>
  void reduce(const S& send, R&& recv, ReduceOp op, int root) {
    self().run(make_reduce(send, recv, op, root));
  }
  template <Buffer S, MutableBuffer R>
  auto reduce_async(const S& send, R&& recv, ReduceOp op, int root) {
    return self().start(make_reduce(send, recv, op, root));
  }

  // ---- all_to_all: block p of send goes to rank p; block p of recv came from rank p.
  template <Buffer S, MutableBuffer R>
  void all_to_all(const S& send, R&& recv) {
    self().run(make_all_to_all(send, recv));
  }
  template <Buffer S, MutableBuffer R>
  auto all_to_all_async(const S& send, R&& recv) {
    return self().start(make_all_to_all(send, recv));
  }

  // ---- point to point: messages between two ranks arrive in the order they were sent.
  template <Buffer S>
  void send(const S& data, int peer) {
    self().run(make_p2p(Collective::send, data, peer));
  }
  template <MutableBuffer R>
  void recv(R&& data, int peer) {
    self().run(make_p2p(Collective::recv, data, peer));
  }
  template <Buffer S>
  auto send_async(const S& data, int peer) {
    return self().start(make_p2p(Collective::send, data, peer));
  }
  template <MutableBuffer R>
  auto recv_async(R&& data, int peer) {
    return self().start(make_p2p(Collective::recv, data, peer));
  }

  // ---- batched point to point (see the note at the top): build each send and receive
  // with send_op / recv_op (checked like send / recv), then run them as one batch:
  //
  //   pp.p2p({pp.send_op(activations, next), pp.recv_op(gradients, next)});
  //
  // Every operation of the batch is started before any is waited on; the Request
  // completes when all have. An empty batch completes at once. The list itself need not
  // outlive the call (the engine copies it); the buffers must, until wait() returns.
  template <Buffer S>
  Op send_op(const S& data, int peer) {
    return make_p2p(Collective::send, data, peer);
  }
  template <MutableBuffer R>
  Op recv_op(R&& data, int peer) {
    return make_p2p(Collective::recv, data, peer);
  }
  auto p2p_async(std::span<const Op> ops) {
    for (std::size_t i = 0; i < ops.size(); ++i) check_batch_op(ops, i);
    return self().start_batch(ops);
  }
  auto p2p_async(std::initializer_list<Op> ops) { return p2p_async(std::span<const Op>(ops.begin(), ops.size())); }
  void p2p(std::span<const Op> ops) { p2p_async(ops).wait(); }
  void p2p(std::initializer_list<Op> ops) { p2p_async(ops).wait(); }

  void barrier() { self().run(Op{}); }
  auto barrier_async() { return self().start(Op{}); }

 protected:
  template <Buffer S, class R>
  Op make_all_reduce(const S& send, R& recv, ReduceOp op) {
    static_assert(std::is_same_v<element_t<S>, element_t<R>>, "all_reduce: send and recv hold different types");
    expect(Collective::all_reduce, "recv", std::ranges::size(recv), std::ranges::size(send), "the send count");
    return make(Collective::all_reduce, send, recv, std::ranges::size(send), op, 0);
  }
  template <Buffer S, class R>
  Op make_reduce_scatter(const S& send, R& recv, ReduceOp op) {
    static_assert(std::is_same_v<element_t<S>, element_t<R>>, "reduce_scatter: send and recv hold different types");
    const std::size_t count = std::ranges::size(recv);
    expect(Collective::reduce_scatter, "send", std::ranges::size(send), count * world(), "size() x the recv count");
    return make(Collective::reduce_scatter, send, recv, count, op, 0);
  }
  template <Buffer S, class R>
  Op make_all_gather(const S& send, R& recv) {
    static_assert(std::is_same_v<element_t<S>, element_t<R>>, "all_gather: send and recv hold different types");
    const std::size_t count = std::ranges::size(send);
    expect(Collective::all_gather, "recv", std::ranges::size(recv), count * world(), "size() x the send count");
    return make(Collective::all_gather, send, recv, count, ReduceOp::sum, 0);
  }
  template <class B>
  Op make_broadcast(B& data, int root) {
    check_rank(Collective::broadcast, "root", root);
    return make(Collective::broadcast, data, data, std::ranges::size(data), ReduceOp::sum, root);
  }
  template <Buffer S, class R>
  Op make_reduce(const S& send, R& recv, ReduceOp op, int root) {
    static_assert(std::is_same_v<element_t<S>, element_t<R>>, "reduce: send and recv hold different types");
    check_rank(Collective::reduce, "root", root);
    if (self().rank() == root)
      expect(Collective::reduce, "recv (at the root)", std::ranges::size(recv), std::ranges::size(send),
             "the send count");
    Op o = make(Collective::reduce, send, recv, std::ranges::size(send), op, root);
    if (self().rank() != root) o.recv = nullptr;
    return o;
  }
  template <Buffer S, class R>
  Op make_all_to_all(const S& send, R& recv) {
    static_assert(std::is_same_v<element_t<S>, element_t<R>>, "all_to_all: send and recv hold different types");
    const std::size_t total = std::ranges::size(send);
    expect(Collective::all_to_all, "recv", std::ranges::size(recv), total, "the send size");
    LLMPAR_CHECK(total % world() == 0, "all_to_all on ", self().group().describe(), ": the send buffer holds ", total,
                 " elements, which does not split into size() = ", world(), " equal blocks; use a multiple of ",
                 world());
    return make(Collective::all_to_all, send, recv, total / world(), ReduceOp::sum, 0);
  }
  template <class B>
  Op make_p2p(Collective kind, B& data, int peer) {
    check_peer(kind, peer);
    return make(kind, data, data, std::ranges::size(data), ReduceOp::sum, peer);
  }
  void check_peer(Collective kind, int peer) {
    check_rank(kind, "peer", peer);
    LLMPAR_CHECK(peer != self().rank(), name_of(kind), " on ", self().group().describe(), ": rank ", peer, " cannot ",
                 name_of(kind), kind == Collective::send ? " to" : " from", " itself; copy the data instead");
  }
  // An Op of a batch may have been filled in by hand: it must be a send or a recv to
  // another member.
  void check_batch_op(std::span<const Op> ops, std::size_t i) {
    const Op& op = ops[i];
    LLMPAR_CHECK(op.kind == Collective::send || op.kind == Collective::recv, "p2p on ", self().group().describe(),
                 ": operation ", i, " of the batch of ", ops.size(), " is ", op.describe(),
                 ", not a send or a recv; build a batch's operations with send_op() and recv_op()");
    check_peer(op.kind, op.root);
  }

 private:
  Engine& self() { return static_cast<Engine&>(*this); }
  std::size_t world() { return static_cast<std::size_t>(self().size()); }

  template <class S, class R>
  static Op make(Collective kind, const S& send, R& recv, std::size_t count, ReduceOp op, int root) {
    Op o;
    o.kind = kind;
    o.type = dtype_of<element_t<S>>();
    o.count = count;
    o.reduce = op;
    o.root = root;
    o.send = std::ranges::data(send);
    o.recv = const_cast<void*>(static_cast<const void*>(std::ranges::data(recv)));
    return o;
  }

  void expect(Collective kind, const char* buffer, std::size_t have, std::size_t want, const char* rule) {
    LLMPAR_CHECK(have == want, name_of(kind), " on ", self().group().describe(), ": the ", buffer, " buffer holds ",
                 have, " elements but needs ", want, " (", rule, ")");
  }
  void check_rank(Collective kind, const char* what, int r) {
    LLMPAR_CHECK(r >= 0 && r < self().size(), name_of(kind), " on ", self().group().describe(), ": ", what, " ", r,
                 " is not a rank of this group of size ", self().size(), "; use 0..", self().size() - 1);
  }
};

}  // namespace llmpar::comm
