// MpiComm under mpirun (ctest runs this with 2 and with 4 processes). Every operation
// on every element type, at counts 0, 1, 7, 1003 and 1 << 20, in place and not,
// blocking and asynchronous, on the world, on split groups and on groups of one rank,
// against results each rank predicts exactly: inputs are small integers, so sums over
// a few ranks are exact in bf16 and f16 and every result can be compared bit for bit.
// Batched send/recv (p2p) on the same cases: pairs that both send first (at 1 << 20
// elements, past any eager limit), a ring, message order across batches, a Grid's
// embedding group. Then the error paths: verify mode, timeouts, MPI's int counts,
// overlapping buffers, mismatched send/recv counts (alone and in a batch).
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <llmpar/comm/grid.hpp>
#include <llmpar/comm/mpi_comm.hpp>
#include <map>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using namespace llmpar;
using namespace llmpar::comm;

namespace {

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

// Tests of what happens between ranks need two (the program also runs without mpirun).
bool alone() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size == 1) MESSAGE("skipped: needs 2 ranks or more (run under mpirun)");
  return size == 1;
}

template <class T>
T value(long v) {
  if constexpr (kIsFloating<T>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

// The inputs: 0..8, so that a sum over 4 ranks is at most 32 (exact in every type).
long input(int rank, std::size_t i) { return static_cast<long>((3 * rank + 5 * i + 1) % 9); }
// Block `to` of rank `from`'s all_to_all input.
long block_input(int from, int to, std::size_t j) { return static_cast<long>((7 * from + 3 * to + j) % 9); }
constexpr long kUntouched = 77;  // what a buffer holds where a result must not land

template <class T>
bool same(T a, T b) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return a.bits == b.bits;
  else
    return a == b;
}

template <class T>
double shown(T v) {
  if constexpr (kIsFloating<T>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}

// op over every rank's input(r, i), the way comm::detail reduces (exact for these inputs).
template <class T>
T reduced(ReduceOp op, int size, const std::function<long(int)>& at) {
  using A = typename comm::detail::Accumulator<T>::type;
  A acc = static_cast<A>(value<T>(at(0)));
  for (int r = 1; r < size; ++r) acc = comm::detail::combine<A>(op, acc, static_cast<A>(value<T>(at(r))));
  return static_cast<T>(comm::detail::finish<A>(op, acc, size));
}

enum class Place { separate, in_place };
enum class Mode { blocking, async };

struct Case {
  std::size_t count;
  Place place;
  Mode mode;
  ReduceOp op;
  int root;
};

template <class Sync, class Async>
void go(Mode mode, Sync&& sync, Async&& async) {
  if (mode == Mode::blocking) {
    sync();
  } else {
    auto request = async();
    request.wait();
  }
}

// Every operation on one communicator, for one element type.
template <class T>
class Suite {
 public:
  explicit Suite(MpiComm& comm) : comm_(comm), rank_(comm.rank()), size_(comm.size()) {}

  void run(const Case& c) {
    all_reduce(c);
    reduce_scatter(c);
    reduce(c);
    if (c.op != ReduceOp::sum) return;  // the rest have no reduction: once per count is enough
    all_gather(c);
    broadcast(c);
    all_to_all(c);
    send_recv(c);
    batch(c);
    go(
        c.mode, [&] { comm_.barrier(); }, [&] { return comm_.barrier_async(); });
  }

 private:
  template <class F>
  void expect(const std::vector<T>& got, F&& want, const char* what, const Case& c) {
    std::size_t wrong = 0, first = 0;
    for (std::size_t i = 0; i < got.size(); ++i)
      if (!same(got[i], want(i)) && wrong++ == 0) first = i;
    INFO(what << " of " << name_of(dtype_of<T>()) << " on " << comm_.group().describe() << ", count " << c.count << ", "
              << name_of(c.op) << ", root " << c.root << (c.place == Place::in_place ? ", in place" : "")
              << (c.mode == Mode::async ? ", async" : "") << ": " << wrong << " wrong elements, the first at " << first
              << " (" << (wrong ? shown(got[first]) : 0.0) << " instead of " << (wrong ? shown(want(first)) : 0.0)
              << ")");
    CHECK(wrong == 0);
  }

  std::vector<T> inputs(std::size_t n) const {
    std::vector<T> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = value<T>(input(rank_, i));
    return v;
  }

  void all_reduce(const Case& c) {
    const std::vector<T> send = inputs(c.count);
    std::vector<T> recv(c.count, value<T>(kUntouched));
    if (c.place == Place::in_place) {
      recv = send;
      go(
          c.mode, [&] { comm_.all_reduce(recv, c.op); }, [&] { return comm_.all_reduce_async(recv, c.op); });
    } else {
      go(
          c.mode, [&] { comm_.all_reduce(send, recv, c.op); },
          [&] { return comm_.all_reduce_async(send, recv, c.op); });
    }
    expect(
        recv, [&](std::size_t i) { return reduced<T>(c.op, size_, [&](int r) { return input(r, i); }); }, "all_reduce",
        c);
  }

  void reduce_scatter(const Case& c) {
    const std::size_t n = c.count;
    std::vector<T> send = inputs(n * size_);
    std::vector<T> recv;
    if (c.place == Place::in_place) {
      std::span<T> block = std::span<T>(send).subspan(rank_ * n, n);
      go(
          c.mode, [&] { comm_.reduce_scatter(send, block, c.op); },
          [&] { return comm_.reduce_scatter_async(send, block, c.op); });
      recv.assign(block.begin(), block.end());
    } else {
      recv.assign(n, value<T>(kUntouched));
      go(
          c.mode, [&] { comm_.reduce_scatter(send, recv, c.op); },
          [&] { return comm_.reduce_scatter_async(send, recv, c.op); });
    }
    expect(
        recv, [&](std::size_t j) { return reduced<T>(c.op, size_, [&](int r) { return input(r, rank_ * n + j); }); },
        "reduce_scatter", c);
  }

  void reduce(const Case& c) {
    const bool root = rank_ == c.root;
    std::vector<T> send = inputs(c.count);
    std::vector<T> recv(root ? c.count : 0, value<T>(kUntouched));
    if (c.place == Place::in_place) {
      go(
          c.mode, [&] { comm_.reduce(send, send, c.op, c.root); },
          [&] { return comm_.reduce_async(send, send, c.op, c.root); });
      recv = send;
    } else {
      go(
          c.mode, [&] { comm_.reduce(send, recv, c.op, c.root); },
          [&] { return comm_.reduce_async(send, recv, c.op, c.root); });
    }
    if (root)
      expect(
          recv, [&](std::size_t i) { return reduced<T>(c.op, size_, [&](int r) { return input(r, i); }); }, "reduce",
          c);
    else
      expect(
          send, [&](std::size_t i) { return value<T>(input(rank_, i)); }, "reduce (a non-root's input)", c);
  }

  void all_gather(const Case& c) {
    const std::size_t n = c.count;
    std::vector<T> recv(n * size_, value<T>(kUntouched));
    if (c.place == Place::in_place) {
      for (std::size_t j = 0; j < n; ++j) recv[rank_ * n + j] = value<T>(input(rank_, j));
      std::span<const T> mine = std::span<const T>(recv).subspan(rank_ * n, n);
      go(
          c.mode, [&] { comm_.all_gather(mine, recv); }, [&] { return comm_.all_gather_async(mine, recv); });
    } else {
      const std::vector<T> send = inputs(n);
      go(
          c.mode, [&] { comm_.all_gather(send, recv); }, [&] { return comm_.all_gather_async(send, recv); });
    }
    expect(
        recv, [&](std::size_t i) { return value<T>(input(static_cast<int>(i / (n ? n : 1)), i % (n ? n : 1))); },
        "all_gather", c);
  }

  // In place through the typed front end; out of place (the root's send is not its
  // recv) through an Op, which the engine must also accept.
  void broadcast(const Case& c) {
    const bool root = rank_ == c.root;
    std::vector<T> data(c.count, value<T>(kUntouched));
    const std::vector<T> source = inputs(c.count);
    if (c.place == Place::in_place) {
      if (root) data = source;
      go(
          c.mode, [&] { comm_.broadcast(data, c.root); }, [&] { return comm_.broadcast_async(data, c.root); });
    } else {
      Op op;
      op.kind = Collective::broadcast;
      op.type = dtype_of<T>();
      op.count = c.count;
      op.root = c.root;
      op.send = root ? source.data() : nullptr;
      op.recv = data.data();
      go(
          c.mode, [&] { comm_.run(op); }, [&] { return comm_.start(op); });
    }
    expect(
        data, [&](std::size_t i) { return value<T>(input(c.root, i)); }, "broadcast", c);
  }

  void all_to_all(const Case& c) {
    const std::size_t n = c.count;
    std::vector<T> send(n * size_);
    for (int to = 0; to < size_; ++to)
      for (std::size_t j = 0; j < n; ++j) send[to * n + j] = value<T>(block_input(rank_, to, j));
    std::vector<T> recv(n * size_, value<T>(kUntouched));
    if (c.place == Place::in_place) {
      recv = send;
      go(
          c.mode, [&] { comm_.all_to_all(recv, recv); }, [&] { return comm_.all_to_all_async(recv, recv); });
    } else {
      go(
          c.mode, [&] { comm_.all_to_all(send, recv); }, [&] { return comm_.all_to_all_async(send, recv); });
    }
    expect(
        recv,
        [&](std::size_t i) { return value<T>(block_input(static_cast<int>(i / (n ? n : 1)), rank_, i % (n ? n : 1))); },
        "all_to_all", c);
  }

  // Ranks 2k and 2k+1 swap their inputs (a last odd rank out sits this one out).
  void send_recv(const Case& c) {
    const int partner = rank_ ^ 1;
    if (partner >= size_) return;
    const std::vector<T> send = inputs(c.count);
    std::vector<T> recv(c.count, value<T>(kUntouched));
    if (c.mode == Mode::blocking) {
      if (rank_ % 2 == 0) {
        comm_.send(send, partner);
        comm_.recv(recv, partner);
      } else {
        comm_.recv(recv, partner);
        comm_.send(send, partner);
      }
    } else {
      auto received = comm_.recv_async(recv, partner);
      auto sent = comm_.send_async(send, partner);
      received.wait();
      sent.wait();
    }
    expect(
        recv, [&](std::size_t i) { return value<T>(input(partner, i)); }, "send/recv", c);
  }

  // One batch in which ranks 2k and 2k+1 both send first, then one around the ring
  // (send to rank + 1, recv from rank - 1); p2p, or p2p_async and wait.
  void batch(const Case& c) {
    const auto issue = [&](std::initializer_list<Op> ops) {
      go(
          c.mode, [&] { comm_.p2p(ops); }, [&] { return comm_.p2p_async(ops); });
    };
    const std::vector<T> send = inputs(c.count);
    if (const int partner = rank_ ^ 1; partner < size_) {
      std::vector<T> recv(c.count, value<T>(kUntouched));
      issue({comm_.send_op(send, partner), comm_.recv_op(recv, partner)});
      expect(
          recv, [&](std::size_t i) { return value<T>(input(partner, i)); }, "p2p exchange", c);
    }
    if (size_ > 1) {
      const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
      std::vector<T> recv(c.count, value<T>(kUntouched));
      issue({comm_.send_op(send, next), comm_.recv_op(recv, prev)});
      expect(
          recv, [&](std::size_t i) { return value<T>(input(prev, i)); }, "p2p ring", c);
    }
  }

  MpiComm& comm_;
  int rank_;
  int size_;
};

template <class T>
void run_suite(MpiComm& comm, std::span<const std::size_t> counts) {
  Suite<T> suite(comm);
  for (const std::size_t count : counts)
    for (const Place place : {Place::separate, Place::in_place})
      for (const Mode mode : {Mode::blocking, Mode::async})
        for (const ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
          if (count > 1003 && op != ReduceOp::sum) continue;  // the other reductions at small counts
          const int root = count % 2 ? comm.size() - 1 : 0;
          suite.run(Case{count, place, mode, op, root});
        }
}

constexpr std::array<std::size_t, 5> kWorldCounts{0, 1, 7, 1003, std::size_t{1} << 20};
constexpr std::array<std::size_t, 4> kGroupCounts{0, 1, 7, 1003};

std::string member_list(const MpiComm& comm, const std::function<std::string(int)>& value) {
  std::string s;
  for (int r = 0; r < comm.size(); ++r) s += (r ? ", " : "") + comm.group().member(r) + " has " + value(r);
  return s;
}

}  // namespace

TEST_CASE_TEMPLATE(
    "every operation gives the predicted result on the world: counts 0 to 1<<20, in place or not, "
    "blocking or async, sum/avg/max/min",
    T, float, bf16, f16, std::int32_t, std::int64_t, std::uint8_t) {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  run_suite<T>(world, kWorldCounts);
}

TEST_CASE_TEMPLATE("every operation gives the predicted result on split groups (even/odd ranks) and on groups of one",
                   T, float, bf16, f16, std::int32_t, std::int64_t, std::uint8_t) {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  auto half = world.split(world.rank() % 2, world.rank(), world.rank() % 2 ? "odd" : "even");
  run_suite<T>(half, kGroupCounts);
  auto self = world.split(world.rank(), 0, "self");
  REQUIRE(self.size() == 1);
  run_suite<T>(self, kGroupCounts);
}

TEST_CASE("bytes (std::byte) travel as u8") {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  const int n = world.size();
  std::vector<std::byte> mine(3, static_cast<std::byte>(world.rank() + 1));
  std::vector<std::byte> all(3 * n);
  world.all_gather(mine, all);
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < 3; ++j) CHECK(all[3 * r + j] == static_cast<std::byte>(r + 1));
  world.all_reduce(mine, ReduceOp::max);
  CHECK(mine[0] == static_cast<std::byte>(n));
}

TEST_CASE("integer sums wrap around the way comm::detail::combine does") {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  const int n = world.size();
  std::vector<std::int32_t> i32(5, INT32_MAX - world.rank());
  std::vector<std::int64_t> i64(5, INT64_MAX - world.rank());
  std::vector<std::uint8_t> u8(5, static_cast<std::uint8_t>(200 + world.rank()));
  world.all_reduce(i32);
  world.all_reduce(i64);
  world.all_reduce(u8);
  std::int32_t want32 = INT32_MAX;
  std::int64_t want64 = INT64_MAX;
  std::uint8_t want8 = 200;
  for (int r = 1; r < n; ++r) {
    want32 = comm::detail::combine<std::int32_t>(ReduceOp::sum, want32, INT32_MAX - r);
    want64 = comm::detail::combine<std::int64_t>(ReduceOp::sum, want64, INT64_MAX - r);
    want8 = comm::detail::combine<std::uint8_t>(ReduceOp::sum, want8, static_cast<std::uint8_t>(200 + r));
  }
  CHECK(i32[4] == want32);
  CHECK(i64[4] == want64);
  CHECK(u8[4] == want8);
}

TEST_CASE("split gives each group its name, its members' world ranks in key order, and the parent's options") {
  INFO("world rank " << world_rank());
  MpiOptions options;
  options.timeout = std::chrono::milliseconds(12345);
  options.verify = true;
  auto world = MpiComm::world(options);
  const int rank = world.rank(), n = world.size();

  auto half = world.split(rank % 2, rank, rank % 2 ? "odd" : "even");
  CHECK(half.group().name == (rank % 2 ? "odd" : "even"));
  std::vector<int> members;
  for (int r = rank % 2; r < n; r += 2) members.push_back(r);
  CHECK(half.group().world_ranks == members);
  CHECK(half.rank() == rank / 2);
  CHECK(half.options().timeout == std::chrono::milliseconds(12345));
  CHECK(half.options().verify);

  auto reversed = world.split(0, n - rank, "reversed");
  CHECK(reversed.rank() == n - 1 - rank);
  for (int r = 0; r < n; ++r) CHECK(reversed.group().world_ranks[r] == n - 1 - r);

  auto again = half.split(0, 0, "again");  // world ranks survive a second split
  CHECK(again.group().world_ranks == members);
  std::vector<int> ranks(1, rank), gathered(again.size());
  again.all_gather(ranks, gathered);
  CHECK(gathered == members);

  CHECK_THROWS_WITH_AS(world.split(-1, 0, "bad"), doctest::Contains("color -1 is negative"), Error);
}

TEST_CASE(
    "verify mode: a collective that differs between ranks throws on every rank, naming the field and each "
    "rank's value; the communicator stays usable") {
  INFO("world rank " << world_rank());
  if (alone()) return;
  MpiOptions options;
  options.verify = true;
  auto world = MpiComm::world(options);
  const int rank = world.rank();
  const std::string on = "on " + world.group().describe() + ": ";

  SUBCASE("element count") {
    std::vector<float> data(rank == 1 ? 1000 : 1024, 1.0f);
    const std::string want = "all_reduce " + on + "element count differs between ranks: " +
                             member_list(world, [](int r) { return r == 1 ? "1000" : "1024"; });
    CHECK_THROWS_WITH_AS(world.all_reduce(data), doctest::Contains(want.c_str()), Error);
    CHECK_THROWS_WITH_AS(world.all_reduce_async(data), doctest::Contains(want.c_str()), Error);
  }
  SUBCASE("element type") {
    std::vector<float> f(8, 1.0f);
    std::vector<bf16> b(8, bf16(1.0f));
    const std::string want = "all_reduce " + on + "element type differs between ranks: " +
                             member_list(world, [](int r) { return r == 1 ? "bf16" : "f32"; });
    if (rank == 1)
      CHECK_THROWS_WITH_AS(world.all_reduce(b), doctest::Contains(want.c_str()), Error);
    else
      CHECK_THROWS_WITH_AS(world.all_reduce(f), doctest::Contains(want.c_str()), Error);
  }
  SUBCASE("collective") {
    std::vector<float> data(8, 1.0f);
    const std::string want = "collective differs between ranks: " +
                             member_list(world, [](int r) { return r == 1 ? "broadcast" : "all_reduce"; });
    if (rank == 1)
      CHECK_THROWS_WITH_AS(world.broadcast(data, 0), doctest::Contains(want.c_str()), Error);
    else
      CHECK_THROWS_WITH_AS(world.all_reduce(data), doctest::Contains(want.c_str()), Error);
  }
  SUBCASE("reduction") {
    std::vector<float> data(8, 1.0f);
    const std::string want = "all_reduce " + on + "reduction differs between ranks: " + member_list(world, [](int r) {
                               return r == 1 ? "max" : "sum";
                             });
    CHECK_THROWS_WITH_AS(world.all_reduce(data, rank == 1 ? ReduceOp::max : ReduceOp::sum),
                         doctest::Contains(want.c_str()), Error);
  }
  SUBCASE("root") {
    std::vector<float> data(8, 1.0f);
    const std::string want = "broadcast " + on + "root differs between ranks: " + member_list(world, [](int r) {
                               return r == 1 ? "1" : "0";
                             });
    CHECK_THROWS_WITH_AS(world.broadcast(data, rank == 1 ? 1 : 0), doctest::Contains(want.c_str()), Error);
  }
  SUBCASE("blocking or async (MPI does not match one with the other)") {
    std::vector<float> data(8, 1.0f);
    const std::string want = "all_reduce " + on + "blocking or async differs between ranks: " +
                             member_list(world, [](int r) { return r == 1 ? "async" : "blocking"; });
    if (rank == 1)
      CHECK_THROWS_WITH_AS(world.all_reduce_async(data), doctest::Contains(want.c_str()), Error);
    else
      CHECK_THROWS_WITH_AS(world.all_reduce(data), doctest::Contains(want.c_str()), Error);
  }
  SUBCASE("on a split group, ranks are named with their world ranks") {
    auto half = world.split(rank % 2, rank, rank % 2 ? "odd" : "even");
    std::vector<float> data(half.rank() == 1 ? 5 : 6, 1.0f);
    if (half.size() > 1) {
      const std::string want = "all_reduce on " + half.group().describe() + ": element count differs between ranks: " +
                               member_list(half, [](int r) { return r == 1 ? "5" : "6"; });
      CHECK(want.find("(world rank ") != std::string::npos);
      CHECK_THROWS_WITH_AS(half.all_reduce(data), doctest::Contains(want.c_str()), Error);
    }
  }

  std::vector<float> ok(4, 1.0f);
  world.all_reduce(ok);
  CHECK(ok[3] == static_cast<float>(world.size()));
}

TEST_CASE("LLMPAR_COMM_VERIFY=1 on any rank switches verify mode on for every rank; other values are refused") {
  INFO("world rank " << world_rank());
  if (world_rank() == 0) setenv("LLMPAR_COMM_VERIFY", "1", 1);
  {
    auto world = MpiComm::world();
    CHECK(world.options().verify);
  }
  unsetenv("LLMPAR_COMM_VERIFY");
  CHECK_FALSE(MpiComm::world().options().verify);
  setenv("LLMPAR_COMM_VERIFY", "yes", 1);
  CHECK_THROWS_WITH_AS(MpiComm::world(), doctest::Contains("LLMPAR_COMM_VERIFY=yes is not 0 or 1"), Error);
  unsetenv("LLMPAR_COMM_VERIFY");
}

TEST_CASE(
    "an async all_reduce that a rank joins late times out on the others, naming the collective, the group "
    "and that rank; the communicator is then broken") {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  const int late = world.size() - 1;
  {
    MpiOptions options;
    options.timeout = world.rank() == late ? std::chrono::milliseconds(60000) : std::chrono::milliseconds(300);
    auto comm = MpiComm::world(options);
    std::vector<float> data(16, 1.0f);
    if (world.rank() != late) {
      auto request = comm.all_reduce_async(data);
      std::string message;
      try {
        request.wait();
      } catch (const Error& e) {
        message = e.what();
      }
      const std::string late_rank = "rank " + std::to_string(late);
      CHECK(message.find("all_reduce(f32, count 16, sum) on " + comm.group().describe() +
                         " timed out after 300 ms on " + comm.group().member(comm.rank()) + ", waiting for " +
                         late_rank + ", which did not arrive (this is collective #1 on this communicator; " +
                         late_rank + " has issued 0)") != std::string::npos);
      CHECK_THROWS_WITH_AS(comm.barrier(), doctest::Contains("is broken and runs no more operations"), Error);
      CHECK_THROWS_WITH_AS(comm.all_reduce_async(data), doctest::Contains("is broken"), Error);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      comm.all_reduce_async(data).wait();  // completes as the others' abandoned request progresses
      CHECK(data[0] == static_cast<float>(world.size()));
    }
    world.barrier();
  }  // the abandoned request has completed: every rank frees the communicator
  world.barrier();
}

TEST_CASE("a recv whose send comes late times out, naming the peer that has not posted it") {
  INFO("world rank " << world_rank());
  if (alone()) return;
  auto world = MpiComm::world();
  {
    MpiOptions options;
    options.timeout = std::chrono::milliseconds(world.rank() == 0 ? 300 : 60000);
    auto comm = MpiComm::world(options);
    std::vector<float> data(8, 2.0f);
    if (world.rank() == 0) {
      std::string message;
      try {
        comm.recv_async(data, 1).wait();
      } catch (const Error& e) {
        message = e.what();
      }
      CHECK(message.find("recv(f32, count 8, from 1) on " + comm.group().describe() +
                         " timed out after 300 ms on rank 0, waiting for rank 1, which has not posted the matching "
                         "send (this is recv #1 from rank 1; rank 1 has posted 0 sends to rank 0)") !=
            std::string::npos);
    } else if (world.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      comm.send(data, 0);
    }
    world.barrier();
  }
  world.barrier();
}

TEST_CASE("an operation of more than INT_MAX elements fails before any MPI call, naming the count") {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  Op op;
  op.kind = Collective::all_reduce;
  op.type = DType::f32;
  op.count = std::size_t{INT_MAX} + 1;
  CHECK_THROWS_WITH_AS(world.run(op),
                       doctest::Contains("count 2147483648 is more than the 2147483647 elements one MPI call can "
                                         "take (MPI counts are int); split the buffer into calls of at most "
                                         "2147483647 elements"),
                       Error);
  CHECK_THROWS_WITH_AS(world.start(op), doctest::Contains("count 2147483648 is more than"), Error);
  op.kind = Collective::all_gather;
  CHECK_THROWS_WITH_AS(world.run(op), doctest::Contains("(MPI counts are int, per rank's block)"), Error);
  world.barrier();  // still usable
}

TEST_CASE("buffers that overlap without being in place are refused") {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  std::vector<float> buffer(16, 1.0f);
  Op op;
  op.kind = Collective::all_reduce;
  op.type = DType::f32;
  op.count = 8;
  op.send = buffer.data();
  op.recv = buffer.data() + 4;
  CHECK_THROWS_WITH_AS(world.run(op), doctest::Contains("overlap without being in place (in place is recv == send)"),
                       Error);
  world.barrier();
}

TEST_CASE("a recv checks that its send carried the count it expects") {
  INFO("world rank " << world_rank());
  if (alone()) return;
  auto world = MpiComm::world();
  if (world.rank() == 0) {
    std::vector<float> seven(7, 1.0f), nine(9, 1.0f);
    world.send(seven, 1);
    world.send(nine, 1);
  } else if (world.rank() == 1) {
    std::vector<float> eight(8);
    CHECK_THROWS_WITH_AS(world.recv(eight, 0), doctest::Contains("carried 7 elements, not 8"), Error);
    CHECK_THROWS_WITH_AS(world.recv_async(eight, 0).wait(), doctest::Contains("MPI_ERR_TRUNCATE"), Error);
  }
  world.barrier();
}

TEST_CASE("batches keep the order of the messages between two ranks, within and across batches") {
  INFO("world rank " << world_rank());
  if (alone()) return;
  auto world = MpiComm::world();
  std::vector<std::vector<std::int64_t>> messages;
  for (std::int64_t k = 0; k < 5; ++k) messages.push_back(std::vector<std::int64_t>(1000, 10 * k));
  if (world.rank() == 0) {
    // Five messages to rank 1 in batches of 2, 1 and 2, none waited on before the last.
    auto a = world.p2p_async({world.send_op(messages[0], 1), world.send_op(messages[1], 1)});
    auto b = world.p2p_async({world.send_op(messages[2], 1)});
    world.p2p({world.send_op(messages[3], 1), world.send_op(messages[4], 1)});
    b.wait();
    a.wait();
    world.send(messages[0], 1);  // and a single send after them
  } else if (world.rank() == 1) {
    std::vector<std::vector<std::int64_t>> got(6, std::vector<std::int64_t>(1000, -1));
    auto first = world.p2p_async({world.recv_op(got[0], 0), world.recv_op(got[1], 0), world.recv_op(got[2], 0)});
    world.p2p({world.recv_op(got[3], 0), world.recv_op(got[4], 0), world.recv_op(got[5], 0)});
    first.wait();
    got.pop_back();
    CHECK(got == messages);
  }
  world.barrier();
}

TEST_CASE("an empty batch completes at once; a batch's requests move and test like any other") {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  world.p2p({});
  auto empty = world.p2p_async(std::span<const Op>());
  CHECK(empty.test());
  empty.wait();
  if (world.size() > 1 && world.rank() < 2) {
    const int peer = 1 - world.rank();
    std::vector<float> mine(64, static_cast<float>(world.rank())), got(64, -1.0f);
    auto request = world.p2p_async({world.send_op(mine, peer), world.recv_op(got, peer)});
    MpiComm::Request moved = std::move(request);
    request.wait();  // moved from: nothing to wait for
    while (!moved.test()) {
    }
    CHECK(got[63] == static_cast<float>(peer));
  }
  world.barrier();
}

TEST_CASE("a recv in a batch checks that its send carried the count it expects, once the whole batch is done") {
  INFO("world rank " << world_rank());
  if (alone()) return;
  auto world = MpiComm::world();
  std::vector<float> ok(16, static_cast<float>(world.rank()));
  if (world.rank() == 0) {
    std::vector<float> seven(7, 1.0f);
    world.p2p({world.send_op(seven, 1), world.send_op(ok, 1)});
  } else if (world.rank() == 1) {
    std::vector<float> eight(8), got(16, -1.0f);
    CHECK_THROWS_WITH_AS(world.p2p({world.recv_op(eight, 0), world.recv_op(got, 0)}),
                         doctest::Contains("the matching send from rank 0 carried 7 elements, not 8"), Error);
    CHECK(got[15] == 0.0f);  // the batch's other recv completed before the error was thrown
  }
  world.barrier();
}

TEST_CASE("a batch whose peer posts late times out, naming the operation that waits and the batch") {
  INFO("world rank " << world_rank());
  if (alone()) return;
  auto world = MpiComm::world();
  {
    MpiOptions options;
    options.timeout = std::chrono::milliseconds(world.rank() == 0 ? 300 : 60000);
    auto comm = MpiComm::world(options);
    std::vector<float> out(8, 2.0f), in(8);
    if (world.rank() == 0) {
      std::string message;
      try {
        comm.p2p({comm.send_op(out, 1), comm.recv_op(in, 1)});  // the small send completes eagerly
      } catch (const Error& e) {
        message = e.what();
      }
      CHECK_MESSAGE(message.find("recv(f32, count 8, from 1) (in a batch of 2) on " + comm.group().describe() +
                                 " timed out after 300 ms on rank 0, waiting for rank 1, which has not posted the "
                                 "matching send (this is recv #1 from rank 1; rank 1 has posted 0 sends to rank 0)") !=
                        std::string::npos,
                    message);
      CHECK_THROWS_WITH_AS(comm.barrier(), doctest::Contains("is broken"), Error);
    } else if (world.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      comm.p2p({comm.recv_op(in, 0), comm.send_op(out, 0)});
    }
    world.barrier();
  }
  world.barrier();
}

TEST_CASE("a Grid over MPI: the embedding group joins the first and last stage, pp_grad mirrors pp") {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  const int n = world.size(), r = world.rank();
  Grid grid(world, {.pp = n});  // one rank per stage
  CHECK(grid.embedding().group().name == "embedding");
  CHECK(grid.pp_grad().group().world_ranks == grid.pp().group().world_ranks);
  if (n == 1 || (r != 0 && r != n - 1)) {
    CHECK(grid.embedding().group().world_ranks == std::vector<int>{r});
  } else {
    CHECK(grid.embedding().group().world_ranks == std::vector<int>{0, n - 1});
    std::vector<float> tied{1.0f + static_cast<float>(r)};
    grid.embedding().all_reduce(tied);
    CHECK(tied[0] == static_cast<float>(1 + n));  // 1 + (n - 1 + 1)
  }
  // Pipeline neighbours swap activations forward and gradients back, in batches on
  // their two channels.
  if (n > 1) {
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    std::vector<std::int32_t> act{r}, grad{100 + r}, got_act{-1}, got_grad{-1};
    auto grads = grid.pp_grad().p2p_async({grid.pp_grad().send_op(grad, prev), grid.pp_grad().recv_op(got_grad, next)});
    grid.pp().p2p({grid.pp().send_op(act, next), grid.pp().recv_op(got_act, prev)});
    grads.wait();
    CHECK(got_act[0] == prev);
    CHECK(got_grad[0] == 100 + next);
  }
}

TEST_CASE("requests: waited in any order, moved, tested, and waited for by their destructor") {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  const int n = world.size();
  std::vector<std::int32_t> a(64, 1), b(64, 2), c(64, 3), d(64, 4), e(64, 5), f(64, 6);
  auto ra = world.all_reduce_async(a);
  auto rb = world.all_reduce_async(b);
  rb.wait();
  ra.wait();
  CHECK(a[63] == n);
  CHECK(b[63] == 2 * n);

  auto rc = world.all_reduce_async(c);
  MpiComm::Request moved = std::move(rc);
  rc.wait();  // moved from: nothing to wait for
  moved.wait();
  CHECK(c[0] == 3 * n);

  { auto rd = world.all_reduce_async(d); }
  CHECK(d[0] == 4 * n);

  auto re = world.all_reduce_async(e);
  re = world.all_reduce_async(f);  // the first is completed before it is replaced
  CHECK(e[0] == 5 * n);
  while (!re.test()) {
  }
  CHECK(f[0] == 6 * n);
  CHECK(re.test());

  MpiComm::Request none;
  none.wait();
  CHECK(none.test());
}

TEST_CASE("LLMPAR_CHECK_MPI throws with the call, MPI's message and the world rank") {
  INFO("world rank " << world_rank());
  auto world = MpiComm::world();
  std::string message;
  try {
    LLMPAR_CHECK_MPI(MPI_Send(nullptr, 0, MPI_INT, world.size() + 5, 0, world.native()), "sending to no one");
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(message.find("sending to no one: MPI call failed on world rank " + std::to_string(world_rank()) +
                     ": MPI_Send(nullptr, 0, MPI_INT, world.size() + 5, 0, world.native()) returned '") !=
        std::string::npos);
  CHECK(message.find("MPI_ERR_RANK") != std::string::npos);
}

TEST_CASE("construction: options are checked, a moved-from communicator says so, MPI is already initialised") {
  INFO("world rank " << world_rank());
  MpiOptions options;
  options.timeout = std::chrono::milliseconds(0);
  CHECK_THROWS_WITH_AS(MpiComm::world(options), doctest::Contains("MpiOptions::timeout is 0 ms"), Error);

  auto world = MpiComm::world();
  CHECK(world.group().name == "world");
  CHECK(static_cast<int>(world.group().world_ranks.size()) == world.size());
  CHECK(world.rank() == world_rank());
  auto moved = std::move(world);
  CHECK_THROWS_WITH_AS(world.barrier(), doctest::Contains("was moved from"), Error);
  moved.barrier();

  MpiEnvironment again;  // MPI is up: this one neither initialises nor finalizes it
  CHECK_FALSE(again.owner());
  CHECK(again.thread_level() == MPI_THREAD_MULTIPLE);
}

TEST_CASE("launched_by_mpi reads the launchers' environment variables") {
  CHECK(launched_by_mpi());  // this test runs under mpirun
  auto launched = [](std::map<std::string, std::string> env) {
    return comm::detail::mpi::launched_by_mpi([&](const char* name) -> const char* {
      const auto it = env.find(name);
      return it == env.end() ? nullptr : it->second.c_str();
    });
  };
  CHECK_FALSE(launched({}));
  CHECK_FALSE(launched({{"HOME", "/root"}}));
  CHECK(launched({{"OMPI_COMM_WORLD_SIZE", "4"}}));
  CHECK(launched({{"PMIX_RANK", "0"}}));
  CHECK(launched({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}}));
  CHECK(launched({{"MPI_LOCALNRANKS", "2"}}));
  CHECK_FALSE(launched({{"SLURM_PROCID", "0"}}));  // any srun task, or a batch script
  CHECK_FALSE(launched({{"SLURM_PROCID", "0"}, {"SLURM_MPI_TYPE", "none"}}));
  CHECK(launched({{"SLURM_PROCID", "0"}, {"SLURM_MPI_TYPE", "pmi2"}}));
  CHECK_FALSE(launched({{"PMI_RANK", ""}}));
}
