// ThreadComm: every operation x element type x world size 1..8 x awkward counts, in
// place and out of place, synchronous and asynchronous; bitwise determinism against a
// serial reduction in rank order; sub-communicators; batched point to point (exchanges
// that would deadlock unbatched, a ring, message order); and every failure mode
// (mismatch, timeout, a rank that throws, bad buffers) against its message.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "llmpar/comm/init.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/core/rng.hpp"

using namespace llmpar;
using comm::Collective;
using comm::ReduceOp;
using comm::ThreadComm;

static_assert(comm::Communicator<ThreadComm>);
static_assert(comm::Request<ThreadComm::Request>);

namespace {

// Small integers, so that sums over up to 8 ranks are exact in every type (bf16 holds
// integers up to 256 exactly, u8 up to 255).
int pattern(int rank, std::size_t i) {
  return static_cast<int>((static_cast<std::size_t>(rank) * 7 + i * 3) % 5) + rank % 3;
}

template <class T>
T as(double v) {
  if constexpr (kIsFloating<T>)
    return convert<T>(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// The expected reduction of pattern(r, i) over ranks 0..n-1.
template <class T>
T expected(ReduceOp op, int n, std::size_t i) {
  double sum = 0, hi = -1e9, lo = 1e9;
  for (int r = 0; r < n; ++r) {
    const double v = pattern(r, i);
    sum += v;
    hi = std::max(hi, v);
    lo = std::min(lo, v);
  }
  switch (op) {
    case ReduceOp::sum:
      return as<T>(sum);
    case ReduceOp::max:
      return as<T>(hi);
    case ReduceOp::min:
      return as<T>(lo);
    case ReduceOp::avg:
      if constexpr (kIsFloating<T>)
        return convert<T>(static_cast<float>(sum) / static_cast<float>(n));
      else
        return static_cast<T>(static_cast<std::int64_t>(sum) / n);
  }
  return T{};
}

template <class T>
std::vector<T> filled(int rank, std::size_t count, std::size_t offset = 0) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = as<T>(pattern(rank, offset + i));
  return v;
}

// Counts elements that differ from the prediction (reported, not thrown, so a rank's
// failure does not abort the others mid-collective).
struct Wrong {
  std::atomic<long> count{0};
  std::mutex mutex;
  std::string first;
  template <class T>
  void check(bool ok, const char* what, int n, int rank, std::size_t count_, bool in_place) {
    if (ok) return;
    if (count.fetch_add(1) == 0) {
      std::lock_guard lock(mutex);
      first = detail::concat(what, " ", name_of(dtype_of<T>()), " n=", n, " rank=", rank, " count=", count_,
                             in_place ? " in place" : " out of place");
    }
  }
};

template <class T>
void exercise_all(ThreadComm& c, std::size_t count, Wrong& wrong, bool async) {
  const int n = c.size(), me = c.rank();
  const auto N = static_cast<std::size_t>(n);
  auto done = [&](auto request) {
    if (async) request.wait();
  };
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
    // all_reduce, out of place and in place.
    for (bool in_place : {false, true}) {
      auto send = filled<T>(me, count);
      std::vector<T> recv(count, as<T>(99));
      std::vector<T>& out = in_place ? send : recv;
      if (async)
        done(in_place ? c.all_reduce_async(send, op) : c.all_reduce_async(send, recv, op));
      else if (in_place)
        c.all_reduce(send, op);
      else
        c.all_reduce(send, recv, op);
      bool ok = true;
      for (std::size_t i = 0; i < count; ++i) ok = ok && same_bits(out[i], expected<T>(op, n, i));
      wrong.check<T>(ok, "all_reduce", n, me, count, in_place);
    }
    // reduce_scatter: block r of the reduction lands on rank r.
    for (bool in_place : {false, true}) {
      auto send = filled<T>(me, count * N);
      std::vector<T> recv(count, as<T>(99));
      const T* out = recv.data();
      if (in_place) {
        std::span<T> mine(send.data() + count * static_cast<std::size_t>(me), count);
        async ? done(c.reduce_scatter_async(send, mine, op)) : c.reduce_scatter(send, mine, op);
        out = mine.data();
      } else {
        async ? done(c.reduce_scatter_async(send, recv, op)) : c.reduce_scatter(send, recv, op);
      }
      bool ok = true;
      for (std::size_t i = 0; i < count; ++i)
        ok = ok && same_bits(out[i], expected<T>(op, n, count * static_cast<std::size_t>(me) + i));
      wrong.check<T>(ok, "reduce_scatter", n, me, count, in_place);
    }
    // reduce to every root in turn.
    for (int root = 0; root < n; ++root) {
      auto send = filled<T>(me, count);
      std::vector<T> recv(me == root ? count : 0, as<T>(99));
      async ? done(c.reduce_async(send, recv, op, root)) : c.reduce(send, recv, op, root);
      bool ok = true;
      for (std::size_t i = 0; i < recv.size(); ++i) ok = ok && same_bits(recv[i], expected<T>(op, n, i));
      wrong.check<T>(ok, "reduce", n, me, count, false);
    }
  }
  // all_gather, out of place and in place.
  for (bool in_place : {false, true}) {
    std::vector<T> recv(count * N, as<T>(99));
    auto send = filled<T>(me, count, 1000);
    if (in_place) {
      std::copy(send.begin(), send.end(),
                recv.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(me)));
      std::span<const T> mine(recv.data() + count * static_cast<std::size_t>(me), count);
      async ? done(c.all_gather_async(mine, recv)) : c.all_gather(mine, recv);
    } else {
      async ? done(c.all_gather_async(send, recv)) : c.all_gather(send, recv);
    }
    bool ok = true;
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i)
        ok = ok && same_bits(recv[static_cast<std::size_t>(r) * count + i], as<T>(pattern(r, 1000 + i)));
    wrong.check<T>(ok, "all_gather", n, me, count, in_place);
  }
  // broadcast from every root.
  for (int root = 0; root < n; ++root) {
    auto data = me == root ? filled<T>(root, count, 7) : std::vector<T>(count, as<T>(99));
    async ? done(c.broadcast_async(data, root)) : c.broadcast(data, root);
    bool ok = true;
    for (std::size_t i = 0; i < count; ++i) ok = ok && same_bits(data[i], as<T>(pattern(root, 7 + i)));
    wrong.check<T>(ok, "broadcast", n, me, count, true);
  }
  // all_to_all: block p of rank r's send holds pattern(r, p * count + i).
  for (bool in_place : {false, true}) {
    auto send = filled<T>(me, count * N);
    std::vector<T> recv(count * N, as<T>(99));
    std::vector<T>& out = in_place ? send : recv;
    async ? done(c.all_to_all_async(send, out)) : c.all_to_all(send, out);
    bool ok = true;
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i)
        ok = ok && same_bits(out[static_cast<std::size_t>(r) * count + i],
                             as<T>(pattern(r, static_cast<std::size_t>(me) * count + i)));
    wrong.check<T>(ok, "all_to_all", n, me, count, in_place);
  }
  // send/recv around a ring, both directions posted before either waits.
  if (n > 1) {
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    auto data = filled<T>(me, count, 3);
    std::vector<T> got(count, as<T>(99));
    auto r = c.recv_async(got, prev);
    auto s = c.send_async(data, next);
    s.wait();
    r.wait();
    bool ok = true;
    for (std::size_t i = 0; i < count; ++i) ok = ok && same_bits(got[i], as<T>(pattern(prev, 3 + i)));
    wrong.check<T>(ok, "send/recv", n, me, count, false);
  }
  c.barrier();
}

template <class T>
void exercise_type(ThreadComm& c, Wrong& wrong) {
  const auto n = static_cast<std::size_t>(c.size());
  // 0, 1, odd, not divisible by the world size, above the staging threshold, large.
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, 1000 * n + 1, std::size_t{40'009}})
    exercise_all<T>(c, count, wrong, /*async=*/false);
  exercise_all<T>(c, 9'001, wrong, /*async=*/true);
}

// The expected error text, caught on every rank.
struct Messages {
  std::mutex mutex;
  std::vector<std::string> all;
  void add(const std::string& m) {
    std::lock_guard lock(mutex);
    all.push_back(m);
  }
};

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("ThreadComm: every operation, type and world size 1..8 gives the predicted result") {
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    Wrong wrong;
    comm::run_threads(n, [&](ThreadComm& c) {
      exercise_type<float>(c, wrong);
      exercise_type<bf16>(c, wrong);
      exercise_type<f16>(c, wrong);
      exercise_type<std::int32_t>(c, wrong);
      exercise_type<std::int64_t>(c, wrong);
      exercise_type<std::uint8_t>(c, wrong);
    });
    CHECK_MESSAGE(wrong.count.load() == 0, wrong.first);
  }
}

TEST_CASE("run_threads gives each rank its share of OpenMP threads and the caller back its own count") {
  const int before = omp_get_max_threads();
  std::vector<int> seen(4, 0);
  comm::run_threads(4,
                    [&](ThreadComm& world) { seen[static_cast<std::size_t>(world.rank())] = omp_get_max_threads(); });
  for (int t : seen) CHECK(t == std::max(1, before / 4));
  // Rank 0 ran on this thread: a later serial run must see the count it had before (the
  // GEMMs partition their work by it, so a changed count changes the rounding).
  CHECK(omp_get_max_threads() == before);
}

TEST_CASE("ThreadComm: bytes (std::byte) move through every copy collective") {
  comm::run_threads(3, [](ThreadComm& c) {
    std::vector<std::byte> mine(5, std::byte(c.rank() + 1)), all(15);
    c.all_gather(mine, all);
    for (int r = 0; r < 3; ++r) CHECK(all[static_cast<std::size_t>(r) * 5 + 4] == std::byte(r + 1));
    std::vector<std::byte> b(4, std::byte(c.rank() == 2 ? 42 : 0));
    c.broadcast(b, 2);
    CHECK(b[3] == std::byte(42));
  });
}

TEST_CASE("ThreadComm: all_reduce is bitwise the serial sum in rank order, on every rank, every run") {
  for (int n : {2, 3, 5, 8}) {
    for (std::size_t count : {std::size_t{100}, std::size_t{65'537}}) {  // staged and sliced paths
      // Inputs with many significant bits, so any other order would round differently.
      std::vector<std::vector<float>> inputs(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) {
        auto stream = rng::Stream::named(7, detail::concat("input", r));
        inputs[static_cast<std::size_t>(r)].resize(count);
        for (std::size_t i = 0; i < count; ++i) inputs[static_cast<std::size_t>(r)][i] = stream.uniform(i) * 2.f - 1.f;
      }
      std::vector<float> serial(count, 0.f);
      std::vector<bf16> serial_bf16(count);
      for (std::size_t i = 0; i < count; ++i) {
        float acc = inputs[0][i], acc16 = static_cast<float>(bf16(inputs[0][i]));
        for (int r = 1; r < n; ++r) {
          acc += inputs[static_cast<std::size_t>(r)][i];
          acc16 += static_cast<float>(bf16(inputs[static_cast<std::size_t>(r)][i]));
        }
        serial[i] = acc;
        serial_bf16[i] = bf16(acc16);
      }
      for (int run = 0; run < 2; ++run) {
        std::atomic<int> mismatches{0};
        comm::run_threads(n, [&](ThreadComm& c) {
          auto data = inputs[static_cast<std::size_t>(c.rank())];
          c.all_reduce(data);
          std::vector<bf16> half(count);
          for (std::size_t i = 0; i < count; ++i) half[i] = bf16(inputs[static_cast<std::size_t>(c.rank())][i]);
          c.all_reduce(half);
          for (std::size_t i = 0; i < count; ++i)
            if (!same_bits(data[i], serial[i]) || !same_bits(half[i], serial_bf16[i])) ++mismatches;
        });
        CHECK(mismatches.load() == 0);
      }
    }
  }
}

TEST_CASE("ThreadComm: split makes sub-communicators ordered by key, with their own collectives") {
  comm::run_threads(6, [](ThreadComm& c) {
    // Two groups by parity; keys reverse the order inside each.
    auto sub = c.split(c.rank() % 2, -c.rank(), c.rank() % 2 ? "odd" : "even");
    CHECK(sub.size() == 3);
    CHECK(sub.group().name == (c.rank() % 2 ? "odd" : "even"));
    const std::vector<int> expect_even{4, 2, 0}, expect_odd{5, 3, 1};
    CHECK(sub.group().world_ranks == (c.rank() % 2 ? expect_odd : expect_even));
    CHECK(sub.group().world_ranks[static_cast<std::size_t>(sub.rank())] == c.rank());
    std::vector<std::int32_t> mine{c.rank()}, all(3);
    sub.all_gather(mine, all);
    CHECK(all == (c.rank() % 2 ? std::vector<std::int32_t>{5, 3, 1} : std::vector<std::int32_t>{4, 2, 0}));
    // Sub-groups of sub-groups; the parent stays usable in between.
    auto single = sub.split(sub.rank(), 0, "single");
    CHECK(single.size() == 1);
    std::vector<float> x{1.5f};
    single.all_reduce(x);
    CHECK(x[0] == 1.5f);
    std::vector<float> total{1.f};
    c.all_reduce(total);
    CHECK(total[0] == 6.f);
  });
}

TEST_CASE("ThreadComm: asynchronous operations overlap with work and complete in issue order") {
  comm::run_threads(4, [](ThreadComm& c) {
    std::vector<float> a(50'000, 1.f), b(10, 2.f);
    auto ra = c.all_reduce_async(a);
    auto rb = c.all_reduce_async(b, ReduceOp::max);
    std::vector<float> x{static_cast<float>(c.rank())};
    c.all_reduce(x);  // a synchronous call queues behind the two above
    CHECK(x[0] == 6.f);
    rb.wait();
    ra.wait();
    CHECK(a[49'999] == 4.f);
    CHECK(b[0] == 2.f);
    auto barrier = c.barrier_async();
    while (!barrier.test()) std::this_thread::yield();
  });
}

TEST_CASE("ThreadComm: a count that differs between ranks fails on every rank with each rank's count") {
  Messages messages;
  comm::run_threads(2, [&](ThreadComm& c) {
    std::vector<float> v(c.rank() == 0 ? 1024 : 1000, 1.f);
    try {
      c.all_reduce(v);
    } catch (const Error& e) {
      messages.add(e.what());
    }
    std::vector<float> ok(3, 1.f);  // the group is still usable for a matching call
    c.all_reduce(ok);
    CHECK(ok[0] == 2.f);
  });
  REQUIRE(messages.all.size() == 2);
  for (const auto& m : messages.all)
    CHECK_MESSAGE(contains(m,
                           "all_reduce on group 'world' (world ranks 0, 1): element count differs between ranks: "
                           "rank 0 has 1024, rank 1 has 1000"),
                  m);
}

TEST_CASE("ThreadComm: a different collective, type or root fails on every rank naming it") {
  Messages messages;
  comm::run_threads(3, [&](ThreadComm& c) {
    std::vector<float> f(4, 1.f);
    std::vector<std::int32_t> i(4, 1);
    try {
      if (c.rank() == 1)
        c.broadcast(f, 0);
      else
        c.all_reduce(f);
    } catch (const Error& e) {
      messages.add(e.what());
    }
    try {
      if (c.rank() == 2)
        c.all_reduce(i);
      else
        c.all_reduce(f);
    } catch (const Error& e) {
      messages.add(e.what());
    }
    try {
      c.broadcast(f, c.rank() == 0 ? 1 : 0);
    } catch (const Error& e) {
      messages.add(e.what());
    }
  });
  REQUIRE(messages.all.size() == 9);
  int kinds = 0, types = 0, roots = 0;
  for (const auto& m : messages.all) {
    kinds += contains(
        m, "collective differs between ranks: rank 0 has all_reduce, rank 1 has broadcast, rank 2 has all_reduce");
    types += contains(m, "element type differs between ranks: rank 0 has f32, rank 1 has f32, rank 2 has i32");
    roots += contains(m, "root differs between ranks: rank 0 has 1, rank 1 has 0, rank 2 has 0");
  }
  CHECK(kinds == 3);
  CHECK(types == 3);
  CHECK(roots == 3);
}

TEST_CASE("ThreadComm: split on one rank against a barrier on another fails on both, naming split as the collective") {
  Messages messages;
  comm::run_threads(2, [&](ThreadComm& c) {
    try {
      if (c.rank() == 0)
        static_cast<void>(c.split(0, 0, "sub"));
      else
        c.barrier();
    } catch (const Error& e) {
      messages.add(e.what());
    }
    c.barrier();  // the group is still usable
  });
  REQUIRE(messages.all.size() == 2);
  for (const auto& m : messages.all)
    CHECK_MESSAGE(contains(m,
                           " on group 'world' (world ranks 0, 1): collective differs between ranks: rank 0 has "
                           "split, rank 1 has barrier"),
                  m);
}

TEST_CASE("ThreadComm: a rank that never arrives makes the others time out naming it") {
  comm::ThreadOptions options;
  options.timeout = std::chrono::milliseconds(200);
  std::string message;
  try {
    comm::run_threads(
        3,
        [&](ThreadComm& c) {
          auto sub = c.split(c.rank() == 0 ? 0 : 1, 0, "pair");  // world ranks 1 and 2
          if (c.rank() == 2) return;                             // never joins the all_reduce
          std::vector<float> v(4, 1.f);
          if (c.rank() == 1) sub.all_reduce(v);
        },
        options);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK_MESSAGE(contains(message,
                         "all_reduce(f32, count 4, sum) on group 'pair' (world ranks 1, 2) timed out after "
                         "200 ms waiting for rank 1 (world rank 2), which did not arrive"),
                message);
}

TEST_CASE("ThreadComm: after a timeout the world is aborted and every later operation says why") {
  comm::ThreadOptions options;
  options.timeout = std::chrono::milliseconds(100);
  Messages messages;
  CHECK_THROWS(comm::run_threads(
      2,
      [&](ThreadComm& c) {
        std::vector<float> v(4, 1.f);
        if (c.rank() == 0) {
          try {
            c.all_reduce(v);
          } catch (const Error& e) {
            messages.add(e.what());
            throw;
          }
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(400));
          try {
            c.all_reduce(v);
          } catch (const Error& e) {
            messages.add(e.what());
          }
        }
      },
      options));
  REQUIRE(messages.all.size() == 2);
  for (const auto& m : messages.all) CHECK_MESSAGE(contains(m, "waiting for rank 1, which did not arrive"), m);
}

TEST_CASE("ThreadComm: a rank that throws brings the whole world down with its message") {
  Messages messages;
  std::string rethrown;
  try {
    comm::run_threads(4, [&](ThreadComm& c) {
      if (c.rank() == 2) throw std::runtime_error("out of memory on rank 2");
      std::vector<float> v(1 << 16, 1.f);
      try {
        c.all_reduce(v);
      } catch (const Error& e) {
        messages.add(e.what());
        throw;
      }
    });
  } catch (const std::runtime_error& e) {
    rethrown = e.what();
  }
  CHECK(rethrown == "out of memory on rank 2");  // the cause, unchanged
  REQUIRE(messages.all.size() == 3);
  for (const auto& m : messages.all) CHECK_MESSAGE(contains(m, "aborted: rank 2 failed: out of memory on rank 2"), m);
}

TEST_CASE("ThreadComm: point to point pairs in order, checks counts, and times out naming the peer") {
  Messages messages;
  comm::run_threads(2, [&](ThreadComm& c) {
    // Several messages in flight between the same pair arrive in order.
    if (c.rank() == 0) {
      for (int k = 0; k < 3; ++k) c.send(std::vector<std::int64_t>(2, k), 1);
    } else {
      for (int k = 0; k < 3; ++k) {
        std::vector<std::int64_t> got(2, -1);
        c.recv(got, 0);
        CHECK(got[1] == k);
      }
    }
    std::vector<float> v(c.rank() == 0 ? 5 : 6);
    try {
      c.rank() == 0 ? c.send(v, 1) : c.recv(v, 0);
    } catch (const Error& e) {
      messages.add(e.what());
    }
  });
  REQUIRE(messages.all.size() == 2);
  for (const auto& m : messages.all)
    CHECK_MESSAGE(contains(m, "send(f32, count 5, to 1) by rank 0 does not match recv(f32, count 6, from 0) by rank 1"),
                  m);

  comm::ThreadOptions options;
  options.timeout = std::chrono::milliseconds(150);
  std::string message;
  try {
    comm::run_threads(
        2,
        [&](ThreadComm& c) {
          std::vector<float> v(3);
          if (c.rank() == 1) c.recv(v, 0);
        },
        options);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK_MESSAGE(contains(message,
                         "recv(f32, count 3, from 0) on group 'world' (world ranks 0, 1) by rank 1 timed out "
                         "after 150 ms: rank 0 did not post the matching send"),
                message);
}

TEST_CASE("Collectives front end: wrong buffer sizes, roots and peers fail with the rule") {
  Messages messages;
  comm::run_threads(3, [&](ThreadComm& c) {
    auto expect_error = [&](auto&& call) {
      try {
        call();
        messages.add("no error");
      } catch (const Error& e) {
        messages.add(e.what());
      }
    };
    std::vector<float> a(4), b(10);
    if (c.rank() != 0) return;
    expect_error([&] { c.all_gather(a, b); });
    expect_error([&] { c.reduce_scatter(b, a); });
    expect_error([&] { c.all_reduce(a, b); });
    expect_error([&] { c.broadcast(a, 3); });
    expect_error([&] { c.send(a, 0); });
    expect_error([&] { c.all_to_all(b, b); });
  });
  REQUIRE(messages.all.size() == 6);
  CHECK(contains(messages.all[0],
                 "all_gather on group 'world' (world ranks 0, 1, 2): the recv buffer holds 10 "
                 "elements but needs 12 (size() x the send count)"));
  CHECK(contains(messages.all[1],
                 "reduce_scatter on group 'world' (world ranks 0, 1, 2): the send buffer holds 10 "
                 "elements but needs 12 (size() x the recv count)"));
  CHECK(contains(messages.all[2], "the recv buffer holds 10 elements but needs 4 (the send count)"));
  CHECK(contains(messages.all[3],
                 "broadcast on group 'world' (world ranks 0, 1, 2): root 3 is not a rank of this "
                 "group of size 3; use 0..2"));
  CHECK(contains(messages.all[4], "rank 0 cannot send to itself"));
  CHECK(contains(messages.all[5], "does not split into size() = 3 equal blocks"));
  CHECK_THROWS_WITH_AS(comm::run_threads(0, [](ThreadComm&) {}),
                       doctest::Contains("the thread world needs at least one rank, got 0"), Error);
}

TEST_CASE("ThreadComm: a batch in which two ranks both send first exchanges their data") {
  comm::run_threads(2, [](ThreadComm& c) {
    const int peer = 1 - c.rank();
    // Above the staging threshold, so a blocking send that waited for its receiver would hang.
    const auto mine = filled<float>(c.rank(), 100'003);
    std::vector<float> got(mine.size(), -1.f);
    c.p2p({c.send_op(mine, peer), c.recv_op(got, peer)});
    CHECK(got == filled<float>(peer, mine.size()));
  });
}

TEST_CASE("ThreadComm: a batch around a ring of 4 (send to r+1, recv from r-1) moves every rank's data") {
  comm::run_threads(4, [](ThreadComm& c) {
    const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
    const auto mine = filled<std::int32_t>(c.rank(), 1000);
    std::vector<std::int32_t> got(mine.size(), -1);
    const std::array ops{c.send_op(mine, next), c.recv_op(got, prev)};
    auto request = c.p2p_async(ops);
    request.wait();
    CHECK(got == filled<std::int32_t>(prev, mine.size()));
  });
}

TEST_CASE("ThreadComm: messages keep their order within a batch and across batches, whatever the grouping") {
  comm::run_threads(2, [](ThreadComm& c) {
    // Rank 0 posts 5 messages to rank 1 as batches of 2, 1 and 2 (none waited on until
    // the end); rank 1 receives them in one batch of 3 and one of 2.
    std::vector<std::vector<std::int64_t>> messages;
    for (std::int64_t k = 0; k < 5; ++k) messages.push_back(std::vector<std::int64_t>(3, 10 * k));
    if (c.rank() == 0) {
      auto a = c.p2p_async({c.send_op(messages[0], 1), c.send_op(messages[1], 1)});
      auto b = c.p2p_async({c.send_op(messages[2], 1)});
      auto d = c.p2p_async({c.send_op(messages[3], 1), c.send_op(messages[4], 1)});
      d.wait();
      a.wait();
      b.wait();
    } else {
      std::vector<std::vector<std::int64_t>> got(5, std::vector<std::int64_t>(3, -1));
      auto first = c.p2p_async({c.recv_op(got[0], 0), c.recv_op(got[1], 0), c.recv_op(got[2], 0)});
      c.p2p({c.recv_op(got[3], 0), c.recv_op(got[4], 0)});
      first.wait();
      CHECK(got == messages);
    }
    // Batches and single sends and receives share one order too.
    std::vector<float> x{1.f}, y{2.f}, got_x{0.f}, got_y{0.f};
    if (c.rank() == 0) {
      c.send(x, 1);
      c.p2p({c.send_op(y, 1)});
    } else {
      c.p2p({c.recv_op(got_x, 0)});
      c.recv(got_y, 0);
      CHECK(got_x[0] == 1.f);
      CHECK(got_y[0] == 2.f);
    }
  });
}

TEST_CASE("ThreadComm: an empty batch completes at once, and a batch of one is a send or a recv") {
  comm::run_threads(2, [](ThreadComm& c) {
    c.p2p({});
    auto empty = c.p2p_async(std::span<const comm::Op>());
    CHECK(empty.test());
    empty.wait();
    std::vector<float> v{static_cast<float>(c.rank())};
    if (c.rank() == 0)
      c.p2p({c.send_op(v, 1)});
    else
      c.p2p({c.recv_op(v, 0)});
    CHECK(v[0] == 0.f);
  });
}

TEST_CASE("ThreadComm: a batch's count mismatch fails after the rest of the batch has completed") {
  Messages messages;
  comm::run_threads(2, [&](ThreadComm& c) {
    const int peer = 1 - c.rank();
    std::vector<float> small(c.rank() == 0 ? 4 : 5), ok(8, static_cast<float>(c.rank())), got(8, -1.f);
    try {
      // Rank 0 sends 4 elements where rank 1 expects 5; the 8-element exchange after it
      // in the same batch still completes on both ranks.
      if (c.rank() == 0)
        c.p2p({c.send_op(small, peer), c.send_op(ok, peer), c.recv_op(got, peer)});
      else
        c.p2p({c.recv_op(small, peer), c.recv_op(got, peer), c.send_op(ok, peer)});
    } catch (const Error& e) {
      messages.add(e.what());
    }
    CHECK(got == std::vector<float>(8, static_cast<float>(peer)));
  });
  REQUIRE(messages.all.size() == 2);
  for (const auto& m : messages.all)
    CHECK_MESSAGE(contains(m, "send(f32, count 4, to 1) by rank 0 does not match recv(f32, count 5, from 0) by rank 1"),
                  m);
}

TEST_CASE("ThreadComm: a batch whose peer never posts times out naming the operation and the batch") {
  comm::ThreadOptions options;
  options.timeout = std::chrono::milliseconds(150);
  std::string message;
  try {
    comm::run_threads(
        2,
        [&](ThreadComm& c) {
          std::vector<float> out(3, 1.f), in(3);
          if (c.rank() == 0) c.p2p({c.send_op(out, 1), c.recv_op(in, 1)});  // rank 1 posts nothing
        },
        options);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK_MESSAGE(contains(message,
                         "send(f32, count 3, to 1) on group 'world' (world ranks 0, 1) by rank 0 (in a batch "
                         "of 2) timed out after 150 ms: rank 1 did not post the matching recv"),
                message);
}

TEST_CASE("Collectives front end: a batch's peers are checked like send's and recv's, and only sends and recvs batch") {
  comm::run_threads(3, [](ThreadComm& c) {
    if (c.rank() != 1) return;
    std::vector<float> a(4);
    CHECK_THROWS_WITH_AS(static_cast<void>(c.send_op(a, 3)),
                         doctest::Contains("send on group 'world' (world ranks 0, 1, 2): peer 3 is not a rank of this "
                                           "group of size 3; use 0..2"),
                         Error);
    CHECK_THROWS_WITH_AS(static_cast<void>(c.recv_op(a, -1)),
                         doctest::Contains("recv on group 'world' (world ranks 0, 1, 2): peer -1 is not a rank of this "
                                           "group of size 3; use 0..2"),
                         Error);
    CHECK_THROWS_WITH_AS(static_cast<void>(c.send_op(a, 1)),
                         doctest::Contains("send on group 'world' (world ranks 0, 1, 2): rank 1 cannot send to itself; "
                                           "copy the data instead"),
                         Error);
    CHECK_THROWS_WITH_AS(static_cast<void>(c.recv_op(a, 1)), doctest::Contains("rank 1 cannot recv from itself"),
                         Error);
    // Ops filled in by hand are checked when the batch is issued, before anything is posted.
    comm::Op self = c.send_op(a, 0);
    self.root = 1;
    CHECK_THROWS_WITH_AS(c.p2p({self}), doctest::Contains("rank 1 cannot send to itself"), Error);
    comm::Op far = c.recv_op(a, 0);
    far.root = 7;
    CHECK_THROWS_WITH_AS(c.p2p({far}), doctest::Contains("peer 7 is not a rank of this group of size 3"), Error);
    comm::Op reduce;
    reduce.kind = Collective::all_reduce;
    reduce.type = DType::f32;
    reduce.count = 4;
    CHECK_THROWS_WITH_AS(c.p2p({c.send_op(a, 0), reduce}),
                         doctest::Contains("p2p on group 'world' (world ranks 0, 1, 2): operation 1 of the batch of 2 "
                                           "is all_reduce(f32, count 4, sum), not a send or a recv; build a batch's "
                                           "operations with send_op() and recv_op()"),
                         Error);
  });
}

TEST_CASE("comm::Comm forwards a batch to the engine underneath") {
  comm::run_threads(2, [](ThreadComm& thread) {
    comm::Comm c(std::move(thread));
    const int peer = 1 - c.rank();
    std::vector<std::int64_t> mine{c.rank() + 40}, got{-1};
    auto request = c.p2p_async({c.send_op(mine, peer), c.recv_op(got, peer)});
    request.wait();
    CHECK(got[0] == peer + 40);
  });
}
