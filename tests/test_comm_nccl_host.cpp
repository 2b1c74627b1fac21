// NcclComm's host side, without a GPU: the NCCL mappings, the messages of verify mode and
// of a timeout, the error macros, and its MPI control channel (arrival counters, verify
// mode's exchanges, timeouts that name the missing rank). Built where LLMPAR_NCCL is on,
// with the MPI doctest main; ctest runs it alone (MPI's singleton start, where the
// multi-rank parts are skipped) and under mpirun with 3 ranks (test_comm_nccl_host_np3).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "llmpar/comm/nccl_comm.hpp"

using namespace llmpar;
using namespace llmpar::comm;

namespace {

Op make_op(Collective kind, DType type, std::size_t count, ReduceOp reduce = ReduceOp::sum, int root = 0) {
  Op op;
  op.kind = kind;
  op.type = type;
  op.count = count;
  op.reduce = reduce;
  op.root = root;
  return op;
}

GroupInfo group_of(std::string name, std::vector<int> world_ranks) {
  GroupInfo g;
  g.name = std::move(name);
  g.world_ranks = std::move(world_ranks);
  return g;
}

std::vector<comm::detail::VerifyRow> rows_of(const std::vector<Op>& ops) {
  std::vector<comm::detail::VerifyRow> rows;
  for (const Op& op : ops)
    rows.push_back(comm::detail::verify_row(op, comm::detail::kUsable, comm::detail::kUsable, 0));
  return rows;
}

// verify_message over the rows, as the control channel gathers them (one after another).
std::string message_of(const Op& mine, const GroupInfo& group, const std::vector<comm::detail::VerifyRow>& rows) {
  std::vector<std::int64_t> table;
  for (const auto& row : rows) table.insert(table.end(), row.begin(), row.end());
  return comm::detail::verify_message(mine, group, table);
}

// Verify mode's exchange of a collective's row, as NcclComm runs it.
comm::detail::mpi::ControlOutcome verify(comm::detail::mpi::Channel& channel, const Op& op, const GroupInfo& group,
                                         const comm::detail::VerifyRow& row, std::uint64_t number,
                                         comm::detail::Clock::time_point deadline) {
  return channel.verify(op, group, row, comm::detail::kFingerprintFields.size(), 2, number, deadline);
}

// MPI_COMM_WORLD (MPI is initialised by the MPI doctest main: a singleton without mpirun).
struct World {
  int rank = 0, size = 1;
  World() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  }
  GroupInfo group() const {
    std::vector<int> ranks;
    for (int r = 0; r < size; ++r) ranks.push_back(r);
    return group_of("world", ranks);
  }
};

}  // namespace

TEST_SUITE("nccl host") {
  TEST_CASE("to_nccl maps every element type and reduction to NCCL's") {
    static_assert(comm::detail::to_nccl(DType::f32) == ncclFloat32);
    static_assert(comm::detail::to_nccl(DType::bf16) == ncclBfloat16);
    static_assert(comm::detail::to_nccl(DType::f16) == ncclFloat16);
    static_assert(comm::detail::to_nccl(DType::i32) == ncclInt32);
    static_assert(comm::detail::to_nccl(DType::i64) == ncclInt64);
    static_assert(comm::detail::to_nccl(DType::u8) == ncclUint8);
    static_assert(comm::detail::to_nccl(ReduceOp::sum) == ncclSum);
    static_assert(comm::detail::to_nccl(ReduceOp::avg) == ncclAvg);
    static_assert(comm::detail::to_nccl(ReduceOp::max) == ncclMax);
    static_assert(comm::detail::to_nccl(ReduceOp::min) == ncclMin);
    CHECK(comm::detail::to_nccl(DType::bf16) == ncclBfloat16);
  }

  TEST_CASE("verify_message is empty when every rank issues the same operation") {
    const Op op = make_op(Collective::all_reduce, DType::f32, 1024);
    const auto rows = rows_of({op, op, op});
    CHECK(message_of(op, group_of("world", {0, 1, 2}), rows).empty());
  }

  TEST_CASE("verify_message names the first field that differs and every rank's value, as the CPU engines do") {
    const GroupInfo world = group_of("world", {0, 1});
    const Op a = make_op(Collective::all_reduce, DType::f32, 1024);
    CHECK(message_of(a, world, rows_of({a, make_op(Collective::all_reduce, DType::f32, 1000)})) ==
          "all_reduce on group 'world' (world ranks 0, 1): element count differs between ranks: rank 0 has 1024, "
          "rank 1 has 1000");
    // The collective itself first: the other fields mean nothing when it differs.
    CHECK(message_of(a, world, rows_of({a, make_op(Collective::broadcast, DType::bf16, 7)})) ==
          "all_reduce on group 'world' (world ranks 0, 1): collective differs between ranks: rank 0 has all_reduce, "
          "rank 1 has broadcast");
    CHECK(message_of(a, world, rows_of({a, make_op(Collective::all_reduce, DType::bf16, 1024)})) ==
          "all_reduce on group 'world' (world ranks 0, 1): element type differs between ranks: rank 0 has f32, "
          "rank 1 has bf16");
    CHECK(message_of(a, world, rows_of({a, make_op(Collective::all_reduce, DType::f32, 1024, ReduceOp::avg)})) ==
          "all_reduce on group 'world' (world ranks 0, 1): reduction differs between ranks: rank 0 has sum, "
          "rank 1 has avg");
    const Op b0 = make_op(Collective::broadcast, DType::i64, 8, ReduceOp::sum, 0);
    const Op b1 = make_op(Collective::broadcast, DType::i64, 8, ReduceOp::sum, 1);
    CHECK(message_of(b0, world, rows_of({b0, b1})) ==
          "broadcast on group 'world' (world ranks 0, 1): root differs between ranks: rank 0 has 0, rank 1 has 1");
  }

  TEST_CASE("verify_message names the members of a subgroup by group and world rank") {
    const GroupInfo tp = group_of("tp[1]", {2, 3});
    const Op a = make_op(Collective::reduce_scatter, DType::bf16, 64);
    CHECK(message_of(a, tp, rows_of({a, make_op(Collective::reduce_scatter, DType::bf16, 32)})) ==
          "reduce_scatter on group 'tp[1]' (world ranks 2, 3): element count differs between ranks: rank 0 (world "
          "rank 2) has 64, rank 1 (world rank 3) has 32");
  }

  TEST_CASE("verify_message groups ranks with equal values when there are more than 16") {
    std::vector<Op> ops(20, make_op(Collective::all_gather, DType::u8, 1024));
    ops[7].count = 1000;
    std::vector<int> ranks;
    for (int r = 0; r < 20; ++r) ranks.push_back(r);
    const std::string message = message_of(ops[0], group_of("world", ranks), rows_of(ops));
    CHECK(message.ends_with("element count differs between ranks: ranks 0-6, 8-19 have 1024, rank 7 has 1000"));
  }

  TEST_CASE("verify_message names buffers that the ranks' devices cannot use") {
    const Op op = make_op(Collective::all_reduce, DType::f32, 16);
    auto rows = rows_of({op, op, op});
    rows[1][comm::detail::kSendPlace] = comm::detail::kHostMemory;
    rows[2][comm::detail::kRecvPlace] = comm::detail::kOtherDevice + 3;
    rows[2][comm::detail::kRowDevice] = 2;
    CHECK(message_of(op, group_of("world", {0, 1, 2}), rows) ==
          "all_reduce(f32, count 16, sum) on group 'world' (world ranks 0, 1, 2): NcclComm moves device memory, but "
          "on rank 1 the send buffer is host memory the GPU cannot access; on rank 2 the recv buffer is memory of "
          "device 3, not of the communicator's device 2 (allocate the buffers with cudaMalloc on the communicator's "
          "device)");
  }

  TEST_CASE("p2p_mismatch_message names both sides of a send/recv pair that differ") {
    const GroupInfo world = group_of("world", {0, 1});
    const Op send = make_op(Collective::send, DType::f32, 8, ReduceOp::sum, 1);
    const Op recv = make_op(Collective::recv, DType::f32, 4, ReduceOp::sum, 0);
    CHECK(comm::detail::p2p_mismatch_message(send, 0, recv, 1, world) ==
          "send(f32, count 8, to 1) by rank 0 does not match recv(f32, count 4, from 0) by rank 1 on group 'world' "
          "(world ranks 0, 1): the element counts differ");
    CHECK(comm::detail::p2p_mismatch_message(send, 0, make_op(Collective::recv, DType::f32, 8, ReduceOp::sum, 0), 1,
                                             world)
              .empty());
  }

  TEST_CASE("describe_batch lists a batch's operations, the first kListedBatchOps of a long one") {
    using comm::detail::describe_batch;
    const std::vector<Op> pair{make_op(Collective::send, DType::f32, 4, ReduceOp::sum, 1),
                               make_op(Collective::recv, DType::bf16, 8, ReduceOp::sum, 1)};
    CHECK(describe_batch(pair) ==
          "a batch of 2 sends and receives (send(f32, count 4, to 1), recv(bf16, count 8, from 1))");
    CHECK(describe_batch(std::span(pair).first(1)) == "a batch of 1 send or receive (send(f32, count 4, to 1))");
    const std::vector<Op> many(comm::detail::kListedBatchOps + 3, pair[1]);
    const std::string long_one = describe_batch(many);
    CHECK(long_one.find("a batch of 11 sends and receives (recv(bf16, count 8, from 1), ") == 0);
    CHECK(long_one.find(", and 3 more)") != std::string::npos);
  }

  TEST_CASE("arrival_report names the ranks behind, those that do not answer, or why it cannot tell") {
    using comm::detail::mpi::arrival_report;
    const GroupInfo world = group_of("world", {0, 1, 2, 3});
    const std::vector<int> others{1, 2, 3};
    const std::string_view hint = comm::detail::kNcclStalled;
    using Counts = std::vector<std::optional<std::uint64_t>>;
    CHECK(arrival_report(world, 0, Collective::all_reduce, 0, others, Counts{42, 41, 42}, 42, "", hint) ==
          "waiting for rank 2, which did not arrive (this is collective #42 on this communicator; rank 2 has issued "
          "41)");
    CHECK(arrival_report(world, 0, Collective::all_reduce, 0, others, Counts{40, std::nullopt, 43}, 42, "", hint) ==
          "waiting for rank 1, which did not arrive (this is collective #42 on this communicator; rank 1 has issued "
          "40); rank 2 does not answer the arrival check within 1000 ms");
    CHECK(arrival_report(world, 0, Collective::all_reduce, 0, others, Counts{42, 42, 42}, 42, "", hint) ==
          "every rank has arrived, yet the collective did not complete (NCCL_DEBUG=WARN may say why)");
    CHECK(arrival_report(world, 0, Collective::all_reduce, 0, others, Counts(3), 42, "no window", hint) ==
          "which ranks did not arrive is unknown: no window");
    const std::vector<int> peer{1};
    CHECK(arrival_report(world, 0, Collective::send, 1, peer, Counts{3}, 4, "", hint) ==
          "waiting for rank 1, which has not posted the matching recv (this is send #4 to rank 1; rank 1 has posted 3 "
          "recvs from rank 0)");
    CHECK(arrival_report(world, 1, Collective::recv, 0, std::vector<int>{0}, Counts{4}, 4, "", hint) ==
          "rank 0 has posted the matching send; the transfer did not complete (NCCL_DEBUG=WARN may say why)");
  }

  TEST_CASE("LLMPAR_CHECK_CUDA throws the CUDA error with the call and the message") {
    const auto fails = [] { LLMPAR_CHECK_CUDA(cudaSetDevice(-1), "while testing"); };
    CHECK_THROWS_WITH_AS(fails(), doctest::Contains("CUDA error cuda"), Error);
    CHECK_THROWS_WITH_AS(fails(), doctest::Contains("; while testing [check failed: cudaSetDevice(-1)]"), Error);
    int devices = 0;
    if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
      CHECK_THROWS_AS(fails(), Error);
      CHECK(cudaGetLastError() == cudaSuccess);  // nothing left behind for the next launch check
    }  // (without a driver, every call reports that again, cudaGetLastError too)
    LLMPAR_CHECK_CUDA(cudaSuccess);
  }

  TEST_CASE("LLMPAR_CHECK_NCCL throws NCCL's description of the error") {
    int count = 0;
    const auto fails = [&] { LLMPAR_CHECK_NCCL(ncclCommCount(nullptr, &count)); };
    CHECK_THROWS_WITH_AS(fails(), doctest::Contains("NCCL error 4: invalid argument"), Error);
    CHECK_THROWS_WITH_AS(fails(), doctest::Contains("[check failed: ncclCommCount(nullptr, &count)]"), Error);
    int version = 0;
    LLMPAR_CHECK_NCCL(ncclGetVersion(&version));
    CHECK(version >= NCCL_VERSION(2, 18, 0));
  }

  TEST_CASE("NcclComm checks its options and its device before anything collective") {
    const NcclOptions zero{.timeout = std::chrono::milliseconds(0)};
    CHECK_THROWS_WITH_AS(NcclComm(MPI_COMM_WORLD, 0, zero),
                         doctest::Contains("NcclComm 'world': NcclOptions::timeout is 0 ms; use a positive duration"),
                         Error);
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      static_cast<void>(cudaGetLastError());
      CHECK_THROWS_WITH_AS(NcclComm(MPI_COMM_WORLD, 0, {}, "tp"),
                           doctest::Contains("NcclComm 'tp' needs a CUDA device"), Error);
    } else {
      CHECK_THROWS_WITH_AS(NcclComm(MPI_COMM_WORLD, devices, {}, "tp"),
                           doctest::Contains("does not exist; this process sees"), Error);
    }
  }
}

TEST_SUITE("mpi") {
  TEST_CASE("the arrival counters of every rank can be read by every rank") {
    const World w;
    comm::detail::mpi::Channel control;
    control.open(MPI_COMM_WORLD, std::chrono::seconds(30), "test", comm::detail::kNcclStalled);
    REQUIRE(control.board().unknown().empty());
    auto& board = control.board();
    for (int i = 0; i <= w.rank; ++i) board.enter(Op{});
    const int next = (w.rank + 1) % w.size;
    for (int i = 0; i < 2; ++i) board.enter(make_op(Collective::send, DType::f32, 1, ReduceOp::sum, next));
    MPI_Barrier(MPI_COMM_WORLD);
    std::vector<int> everyone;
    for (int r = 0; r < w.size; ++r) everyone.push_back(r);
    const auto collectives = board.read(comm::detail::mpi::ArrivalBoard::kCollectives, everyone);
    for (int r = 0; r < w.size; ++r)
      CHECK(collectives[static_cast<std::size_t>(r)] == std::optional<std::uint64_t>(r + 1));
    const int previous = (w.rank + w.size - 1) % w.size;
    const std::vector<int> from{previous};
    CHECK(board.read(board.send_slot(w.rank), from)[0] == std::optional<std::uint64_t>(2));
    MPI_Barrier(MPI_COMM_WORLD);
    control.close(true);
  }

  TEST_CASE("the groups of one split keep arrival counters of their own") {
    // Each group's board is its own (Open MPI 4's osc/rdma can give the windows of
    // disjoint groups from one split one shared segment, open-mpi/ompi#9492).
    const World w;
    MPI_Comm half = MPI_COMM_NULL;
    REQUIRE(MPI_Comm_split(MPI_COMM_WORLD, w.rank % 2, w.rank, &half) == MPI_SUCCESS);
    comm::detail::mpi::Channel channel;
    channel.adopt(half, "test", comm::detail::kNcclStalled);
    REQUIRE(channel.board().unknown().empty());
    const std::uint64_t entered = w.rank % 2 ? 3 : 1;  // a different count in each group
    for (std::uint64_t i = 0; i < entered; ++i) channel.board().enter(Op{});
    MPI_Barrier(MPI_COMM_WORLD);
    std::vector<int> members;
    for (int r = 0; r < channel.size(); ++r) members.push_back(r);
    for (const auto& count : channel.board().read(comm::detail::mpi::ArrivalBoard::kCollectives, members))
      CHECK(count == std::optional<std::uint64_t>(entered));
    MPI_Barrier(MPI_COMM_WORLD);
    channel.close(true);
  }

  TEST_CASE("verify mode passes matching operations and names a differing count on every rank") {
    const World w;
    comm::detail::mpi::Channel control;
    control.open(MPI_COMM_WORLD, std::chrono::seconds(30), "test", comm::detail::kNcclStalled);
    const auto deadline = [] { return comm::detail::Clock::now() + std::chrono::seconds(30); };
    const Op op = make_op(Collective::all_reduce, DType::f32, 1024);
    auto outcome = verify(control, op, w.group(), comm::detail::verify_row(op, 0, 0, 0), 1, deadline());
    CHECK(outcome.kind == comm::detail::mpi::ControlOutcome::ok);
    if (w.size < 2) {
      MESSAGE("a mismatch needs 2 or more ranks (run under mpirun)");
    } else {
      const Op mine = make_op(Collective::all_reduce, DType::f32, w.rank == 1 ? 1000 : 1024);
      outcome = verify(control, mine, w.group(), comm::detail::verify_row(mine, 0, 0, 0), 2, deadline());
      CHECK(outcome.kind == comm::detail::mpi::ControlOutcome::mismatch);
      std::string values;
      for (int r = 0; r < w.size; ++r)
        values += comm::detail::concat(r ? ", " : "", "rank ", r, " has ", r == 1 ? 1000 : 1024);
      CHECK(comm::detail::verify_message(mine, w.group(), outcome.rows) ==
            comm::detail::concat("all_reduce on ", w.group().describe(),
                                 ": element count differs between ranks: ", values));
      // A host buffer on the last rank: every rank learns where.
      const Op last = make_op(Collective::broadcast, DType::i32, 8, ReduceOp::sum, 0);
      outcome = verify(control, last, w.group(),
                       comm::detail::verify_row(last, 0, w.rank == w.size - 1 ? comm::detail::kHostMemory : 0, 0), 3,
                       deadline());
      CHECK(outcome.kind == comm::detail::mpi::ControlOutcome::mismatch);
      CHECK(comm::detail::verify_message(last, w.group(), outcome.rows)
                .find(comm::detail::concat("on rank ", w.size - 1, " the recv buffer is host memory")) !=
            std::string::npos);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    control.close(true);
  }

  TEST_CASE("a collective that one rank does not join times out naming that rank, on the ranks that wait") {
    const World w;
    if (w.size < 2) {
      MESSAGE("needs 2 or more ranks (run under mpirun)");
      return;
    }
    comm::detail::mpi::Channel control;
    control.open(MPI_COMM_WORLD, std::chrono::milliseconds(300), "test", comm::detail::kNcclStalled);
    const Op op = make_op(Collective::all_reduce, DType::f32, 4);
    const auto row = comm::detail::verify_row(op, 0, 0, 0);
    const int late = w.size - 1;
    control.board().enter(op);
    CHECK(verify(control, op, w.group(), row, 1, comm::detail::Clock::now() + std::chrono::seconds(30)).kind ==
          comm::detail::mpi::ControlOutcome::ok);
    if (w.rank != late) {
      control.board().enter(op);
      const auto outcome =
          verify(control, op, w.group(), row, 2, comm::detail::Clock::now() + std::chrono::milliseconds(300));
      CHECK(outcome.kind == comm::detail::mpi::ControlOutcome::broken);
      CHECK(outcome.message ==
            comm::detail::concat(
                "all_reduce(f32, count 4, sum) on ", w.group().describe(), " timed out after 300 ms on rank ", w.rank,
                " in verify mode's check, waiting for rank ", late,
                ", which did not arrive (this is collective #2 on this communicator; rank ", late, " has issued 1)"));
      MPI_Barrier(MPI_COMM_WORLD);
    } else {
      MPI_Barrier(MPI_COMM_WORLD);  // the others have timed out: join late, so their abandoned call completes
      control.board().enter(op);
      CHECK(verify(control, op, w.group(), row, 2, comm::detail::Clock::now() + std::chrono::seconds(30)).kind ==
            comm::detail::mpi::ControlOutcome::ok);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    control.close(false);
  }

  TEST_CASE("a recv checks the type and count of its send, and names a sender that never sent") {
    const World w;
    if (w.size < 2) {
      MESSAGE("needs 2 or more ranks (run under mpirun)");
      return;
    }
    comm::detail::mpi::Channel control;
    control.open(MPI_COMM_WORLD, std::chrono::milliseconds(300), "test", comm::detail::kNcclStalled);
    const auto later = [] { return comm::detail::Clock::now() + std::chrono::seconds(30); };
    auto& board = control.board();
    const Op send = make_op(Collective::send, DType::f32, 8, ReduceOp::sum, 1);
    if (w.rank == 0) {
      board.enter(send);
      control.post_fingerprint(send);
      board.enter(send);
      control.post_fingerprint(send);
    } else if (w.rank == 1) {
      const Op recv = make_op(Collective::recv, DType::f32, 8, ReduceOp::sum, 0);
      CHECK(control.check_fingerprint(recv, w.group(), board.enter(recv), later()).kind ==
            comm::detail::mpi::ControlOutcome::ok);
      const Op shorter = make_op(Collective::recv, DType::f32, 4, ReduceOp::sum, 0);
      const auto outcome = control.check_fingerprint(shorter, w.group(), board.enter(shorter), later());
      CHECK(outcome.kind == comm::detail::mpi::ControlOutcome::broken);
      CHECK(outcome.message ==
            comm::detail::concat(
                "send(f32, count 8, to 1) by rank 0 does not match recv(f32, count 4, from 0) by rank 1 on ",
                w.group().describe(), ": the element counts differ"));
      // A third recv that rank 0 has not sent (yet): it names rank 0 and its count.
      const auto missing = control.check_fingerprint(recv, w.group(), board.enter(recv),
                                                     comm::detail::Clock::now() + std::chrono::milliseconds(300));
      CHECK(missing.kind == comm::detail::mpi::ControlOutcome::broken);
      CHECK(missing.message ==
            comm::detail::concat(
                "recv(f32, count 8, from 0) on ", w.group().describe(),
                " timed out after 300 ms on rank 1 in verify mode's check, waiting for rank 0, which has "
                "not posted the matching send (this is recv #3 from rank 0; rank 0 has posted 2 sends to "
                "rank 1)"));
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (w.rank == 0) {  // the late send completes rank 1's abandoned receive
      board.enter(send);
      control.post_fingerprint(send);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    control.close(false);
  }
}
