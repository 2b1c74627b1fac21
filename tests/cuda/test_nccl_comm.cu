// NcclComm runs every operation like the host reference, on any number of ranks.
//
// One process per CUDA device: without mpirun the program is an MPI singleton, a world
// of one rank (the only group NCCL can form on one GPU); under `mpirun -n N` it needs N
// devices (ctest's test_nccl_comm_mpi runs it on 2). Every rank's input is a function of
// (rank, index) that any rank can compute, in small integers whose sums are exact in
// every type, so each rank checks its results against a host reduction element by
// element (comm::detail::combine/finish, the reference ThreadComm uses too): every
// collective x every element type x counts 0, 1, 7, 1000, 2^20, out of place and in
// place; send/recv between pairs; barrier; batches of sends and receives (p2p: pairs
// that both send first, a ring, order across batches, one NCCL group to itself on a
// single device, verify mode). Then what only a GPU engine has: the compute
// stream ordering and wait_on(), test(), split(), verify mode's buffer check, and a
// timeout that aborts the communicator. Exit codes: 0 pass, 1 failure, 77 skipped (no
// CUDA device, fewer devices than ranks, or llmpar built without NCCL).
#if !defined(LLMPAR_WITH_NCCL)
#include <cstdio>

int main() {
  std::printf("skipped: llmpar was built without NCCL (configure with -DLLMPAR_NCCL=ON)\n");
  return 77;
}
#else
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cuda/check.hpp"
#include "llmpar/comm/nccl_comm.hpp"
#include "llmpar/core/dtype.hpp"

namespace {

using llmpar::bf16;
using llmpar::f16;
using llmpar::comm::Collective;
using llmpar::comm::NcclComm;
using llmpar::comm::NcclOptions;
using llmpar::comm::Op;
using llmpar::comm::ReduceOp;

constexpr int kSkip = 77;
constexpr std::size_t kCounts[] = {0, 1, 7, 1000, std::size_t{1} << 20};
constexpr ReduceOp kReductions[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

// Rank r's element i: small integers (|x| <= 8 for floating types) so that every sum is
// exact whatever order NCCL reduces in; u8 wraps identically on both sides.
template <class T>
T input(int rank, std::size_t i) {
  const long long base = static_cast<long long>((i * 7 + static_cast<std::size_t>(rank) * 13) % 17) - 8;
  if constexpr (llmpar::kIsFloating<T>) {
    return llmpar::convert<T>(static_cast<float>(base));
  } else if constexpr (std::is_same_v<T, std::uint8_t>) {
    return static_cast<T>((i * 7 + static_cast<std::size_t>(rank) * 13) % 256);
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    return base * 1000 + static_cast<long long>(i % 3) * (1LL << 40);  // beyond 32 bits
  } else {
    return static_cast<T>(base * 1000);
  }
}

template <class T>
double to_double(T x) {
  if constexpr (llmpar::kIsFloating<T>)
    return static_cast<double>(static_cast<float>(x));
  else
    return static_cast<double>(x);
}

// The host reference for element i of op over `ranks` inputs, in T.
template <class T>
T expected(ReduceOp op, int ranks, std::size_t i) {
  using A = typename llmpar::comm::detail::Accumulator<T>::type;
  auto load = [&](int r) {
    if constexpr (llmpar::kIsFloating<T>)
      return static_cast<float>(input<T>(r, i));
    else
      return input<T>(r, i);
  };
  A acc = load(0);
  for (int r = 1; r < ranks; ++r) acc = llmpar::comm::detail::combine<A>(op, acc, load(r));
  acc = llmpar::comm::detail::finish<A>(op, acc, ranks);
  if constexpr (llmpar::kIsFloating<T>)
    return llmpar::convert<T>(acc);
  else
    return acc;
}

// Exact, except a floating avg: NCCL multiplies each input by 1/ranks before summing.
template <class T>
bool matches(T got, T want, ReduceOp op, int ranks) {
  if constexpr (llmpar::kIsFloating<T>) {
    const double g = to_double(got), w = to_double(want);
    if (op != ReduceOp::avg) return g == w;
    const double eps = std::is_same_v<T, float> ? 1e-6 : std::is_same_v<T, bf16> ? 1.0 / 128 : 1.0 / 1024;
    return std::abs(g - w) <= eps * (ranks + 1) * std::max(1.0, std::abs(w));
  } else {
    static_cast<void>(op);
    static_cast<void>(ranks);
    return got == want;
  }
}

template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n_ != 0) LLMPAR_CHECK_CUDA(cudaMalloc(&ptr_, n_ * sizeof(T)));
  }
  ~DeviceBuffer() { static_cast<void>(cudaFree(ptr_)); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  std::span<T> span() { return {ptr_, n_}; }
  T* data() { return ptr_; }
  void upload(const std::vector<T>& host) {
    if (n_ != 0) LLMPAR_CHECK_CUDA(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_ != 0) LLMPAR_CHECK_CUDA(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  std::size_t n_ = 0;
};

// Counts and reports (the first few) elements that differ from the reference.
class Checker {
 public:
  explicit Checker(int rank) : rank_(rank) {}

  template <class T, class Want>
  void check(const std::string& what, const std::vector<T>& got, Want&& want, ReduceOp op, int ranks) {
    int bad = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const T w = want(i);
      if (!matches(got[i], w, op, ranks) && ++bad <= 3)
        std::fprintf(stderr, "FAIL (rank %d): %s: element %zu is %g, expected %g\n", rank_, what.c_str(), i,
                     to_double(got[i]), to_double(w));
    }
    ++cases_;
    if (bad != 0) {
      ++failures_;
      std::fprintf(stderr, "FAIL (rank %d): %s: %d of %zu elements differ\n", rank_, what.c_str(), bad, got.size());
    }
  }
  void fail(const std::string& what) {
    ++cases_;
    ++failures_;
    std::fprintf(stderr, "FAIL (rank %d): %s\n", rank_, what.c_str());
  }
  void pass() { ++cases_; }
  int failures() const { return failures_; }
  int cases() const { return cases_; }

 private:
  int rank_;
  int failures_ = 0, cases_ = 0;
};

template <class T>
std::vector<T> inputs(int rank, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = input<T>(rank, i);
  return v;
}

// Every collective (and send/recv between rank pairs) for element type T.
template <class T>
void check_type(NcclComm& comm, Checker& checker) {
  const int n = comm.size(), me = comm.rank();
  const auto un = static_cast<std::size_t>(n), ume = static_cast<std::size_t>(me);
  const std::string type(llmpar::name_of(llmpar::dtype_of<T>()));
  for (const std::size_t count : kCounts) {
    const std::string suffix = " " + type + " count " + std::to_string(count);
    const std::vector<T> mine = inputs<T>(me, count);
    // all_reduce: out of place and in place.
    for (const ReduceOp op : kReductions) {
      const std::string name(llmpar::comm::name_of(op));
      DeviceBuffer<T> send(count), recv(count);
      send.upload(mine);
      comm.all_reduce(std::span<const T>(send.span()), recv.span(), op);
      checker.check(
          "all_reduce " + name + suffix, recv.download(), [&](std::size_t i) { return expected<T>(op, n, i); }, op, n);
      comm.all_reduce(send.span(), op);
      checker.check(
          "all_reduce in place " + name + suffix, send.download(), [&](std::size_t i) { return expected<T>(op, n, i); },
          op, n);
    }
    // reduce_scatter: rank r gets block r of the reduction of every rank's n blocks.
    for (const ReduceOp op : kReductions) {
      const std::string name(llmpar::comm::name_of(op));
      const std::vector<T> all = inputs<T>(me, un * count);
      auto want = [&](std::size_t i) { return expected<T>(op, n, ume * count + i); };
      DeviceBuffer<T> send(un * count), recv(count);
      send.upload(all);
      comm.reduce_scatter(std::span<const T>(send.span()), recv.span(), op);
      checker.check("reduce_scatter " + name + suffix, recv.download(), want, op, n);
      comm.reduce_scatter(std::span<const T>(send.span()), send.span().subspan(ume * count, count), op);
      const auto in_place = send.download();
      checker.check("reduce_scatter in place " + name + suffix,
                    std::vector<T>(in_place.begin() + static_cast<std::ptrdiff_t>(ume * count),
                                   in_place.begin() + static_cast<std::ptrdiff_t>((ume + 1) * count)),
                    want, op, n);
    }
    // all_gather: block r of the result is rank r's input.
    {
      auto want = [&](std::size_t i) {
        return input<T>(static_cast<int>(i / std::max<std::size_t>(count, 1)), i % std::max<std::size_t>(count, 1));
      };
      DeviceBuffer<T> send(count), recv(un * count);
      send.upload(mine);
      comm.all_gather(std::span<const T>(send.span()), recv.span());
      checker.check("all_gather" + suffix, recv.download(), want, ReduceOp::sum, n);
      DeviceBuffer<T> both(un * count);
      std::vector<T> staged(un * count);
      std::copy(mine.begin(), mine.end(), staged.begin() + static_cast<std::ptrdiff_t>(ume * count));
      both.upload(staged);
      comm.all_gather(std::span<const T>(both.span().subspan(ume * count, count)), both.span());
      checker.check("all_gather in place" + suffix, both.download(), want, ReduceOp::sum, n);
    }
    // broadcast from every root.
    for (int root = 0; root < n; ++root) {
      DeviceBuffer<T> data(count);
      data.upload(mine);
      comm.broadcast(data.span(), root);
      checker.check(
          "broadcast from " + std::to_string(root) + suffix, data.download(),
          [&](std::size_t i) { return input<T>(root, i); }, ReduceOp::sum, n);
    }
    // reduce to a root that varies with the count.
    for (const ReduceOp op : kReductions) {
      const int root = static_cast<int>(count % un);
      DeviceBuffer<T> send(count), recv(me == root ? count : 0);
      send.upload(mine);
      comm.reduce(std::span<const T>(send.span()), recv.span(), op, root);
      if (me == root)
        checker.check(
            "reduce " + std::string(llmpar::comm::name_of(op)) + " to " + std::to_string(root) + suffix,
            recv.download(), [&](std::size_t i) { return expected<T>(op, n, i); }, op, n);
    }
    // all_to_all: block p of the result is block `me` of rank p's input.
    {
      const std::vector<T> all = inputs<T>(me, un * count);
      auto want = [&](std::size_t i) {
        const std::size_t block = i / std::max<std::size_t>(count, 1), offset = i % std::max<std::size_t>(count, 1);
        return input<T>(static_cast<int>(block), ume * count + offset);
      };
      DeviceBuffer<T> send(un * count), recv(un * count);
      send.upload(all);
      comm.all_to_all(std::span<const T>(send.span()), recv.span());
      checker.check("all_to_all" + suffix, recv.download(), want, ReduceOp::sum, n);
      comm.all_to_all(std::span<const T>(send.span()), send.span());
      checker.check("all_to_all in place" + suffix, send.download(), want, ReduceOp::sum, n);
    }
    // send/recv between pairs (0, 1), (2, 3), ...: even ranks send first.
    const int peer = me ^ 1;
    if (peer < n) {
      DeviceBuffer<T> send(count), recv(count);
      send.upload(mine);
      if (me % 2 == 0) {
        comm.send(std::span<const T>(send.span()), peer);
        comm.recv(recv.span(), peer);
      } else {
        comm.recv(recv.span(), peer);
        comm.send(std::span<const T>(send.span()), peer);
      }
      checker.check(
          "send/recv with " + std::to_string(peer) + suffix, recv.download(),
          [&](std::size_t i) { return input<T>(peer, i); }, ReduceOp::sum, n);
    }
  }
  comm.barrier();
  checker.pass();
  if (me == 0) std::printf("%-5s every collective, counts 0..2^20, out of place and in place: checked\n", type.c_str());
}

// A send and a receive of `count` elements to and from `peer` as raw Ops (the front end
// refuses a peer that is this rank; the engine core does not, and NCCL runs it).
template <class T>
std::array<Op, 2> self_exchange(DeviceBuffer<T>& send, DeviceBuffer<T>& recv, std::size_t count, int peer) {
  std::array<Op, 2> ops{};
  for (Op& op : ops) {
    op.type = llmpar::dtype_of<T>();
    op.count = count;
    op.root = peer;
  }
  ops[0].kind = Collective::send;
  ops[0].send = send.data();
  ops[1].kind = Collective::recv;
  ops[1].recv = recv.data();
  return ops;
}

// Batches: every rank sends first in each (unbatched, that deadlocks on NCCL), to its
// pair partner and around the ring; two batches in flight at once keep their order; on
// one rank, a batch to itself (one NCCL group on a single device).
template <class T>
void check_batch(NcclComm& comm, Checker& checker) {
  const int n = comm.size(), me = comm.rank();
  const std::string type(llmpar::name_of(llmpar::dtype_of<T>()));
  for (const std::size_t count : {std::size_t{0}, std::size_t{7}, std::size_t{1} << 20}) {
    const std::string suffix = " " + type + " count " + std::to_string(count);
    DeviceBuffer<T> send(count), recv(count), second(count);
    send.upload(inputs<T>(me, count));
    if (n == 1) {
      const auto ops = self_exchange(send, recv, count, 0);
      comm.start_batch(ops).wait();
      checker.check(
          "batch to itself" + suffix, recv.download(), [&](std::size_t i) { return input<T>(0, i); }, ReduceOp::sum, n);
      continue;
    }
    if (const int peer = me ^ 1; peer < n) {
      comm.p2p({comm.send_op(std::span<const T>(send.span()), peer), comm.recv_op(recv.span(), peer)});
      checker.check(
          "batch exchange with " + std::to_string(peer) + suffix, recv.download(),
          [&](std::size_t i) { return input<T>(peer, i); }, ReduceOp::sum, n);
    }
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    // Two batches in flight: the first message from prev lands in recv, the second in `second`.
    DeviceBuffer<T> other(count);
    other.upload(inputs<T>(me + n, count));
    auto first = comm.p2p_async({comm.send_op(std::span<const T>(send.span()), next), comm.recv_op(recv.span(), prev)});
    auto then =
        comm.p2p_async({comm.send_op(std::span<const T>(other.span()), next), comm.recv_op(second.span(), prev)});
    then.wait();
    first.wait();
    checker.check(
        "batch ring, first" + suffix, recv.download(), [&](std::size_t i) { return input<T>(prev, i); }, ReduceOp::sum,
        n);
    checker.check(
        "batch ring, second" + suffix, second.download(), [&](std::size_t i) { return input<T>(prev + n, i); },
        ReduceOp::sum, n);
  }
  comm.p2p({});
  auto empty = comm.p2p_async(std::span<const Op>());
  if (!empty.test()) checker.fail("an empty batch was not finished at once");
  empty.wait_on(comm.stream());
  checker.pass();
  if (me == 0) std::printf("%-5s batches of sends and receives: checked\n", type.c_str());
}

// A batch in verify mode: every rank's sends announce themselves before its receives
// check, so a batch that sends first on every rank passes the check too.
void check_batch_verify(NcclComm& world, Checker& checker) {
  NcclComm comm(MPI_COMM_WORLD, world.device(), NcclOptions{.timeout = std::chrono::seconds(60), .verify = true},
                "verified batch");
  const int n = comm.size(), me = comm.rank();
  const std::size_t count = 4096;
  DeviceBuffer<float> send(count), recv(count);
  send.upload(inputs<float>(me, count));
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  if (n == 1)
    comm.start_batch(self_exchange(send, recv, count, 0)).wait();
  else
    comm.p2p({comm.send_op(std::span<const float>(send.span()), next), comm.recv_op(recv.span(), prev)});
  checker.check(
      "verify mode: batch", recv.download(), [&](std::size_t i) { return input<float>(prev, i); }, ReduceOp::sum, n);
  if (me == 0) std::printf("verify mode: batch checked\n");
}

__global__ void fill_kernel(float* out, std::size_t n, float value) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    out[i] = value;
}

__global__ void scale_kernel(float* data, std::size_t n, float factor) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    data[i] *= factor;
}

// Spins for `ns` nanoseconds of the GPU's global timer.
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// Inputs written by a kernel on a user compute stream, an asynchronous all_reduce, and a
// kernel on that stream after wait_on(): no host synchronisation in between, so a missing
// dependency shows up as a wrong value.
void check_streams(NcclComm& comm, Checker& checker) {
  const std::size_t count = std::size_t{1} << 24;
  const int n = comm.size();
  cudaStream_t compute = nullptr;
  LLMPAR_CHECK_CUDA(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  const cudaStream_t previous = comm.compute_stream();
  comm.set_compute_stream(compute);
  DeviceBuffer<float> data(count);
  for (int round = 0; round < 3; ++round) {
    fill_kernel<<<1024, 256, 0, compute>>>(data.data(), count, static_cast<float>(comm.rank() + 1 + round));
    LLMPAR_CHECK_CUDA(cudaGetLastError());
    auto request = comm.all_reduce_async(data.span(), ReduceOp::sum);
    request.wait_on(compute);
    scale_kernel<<<1024, 256, 0, compute>>>(data.data(), count, 2.0f);
    LLMPAR_CHECK_CUDA(cudaGetLastError());
    std::vector<float> host(count);
    LLMPAR_CHECK_CUDA(
        cudaMemcpyAsync(host.data(), data.data(), count * sizeof(float), cudaMemcpyDeviceToHost, compute));
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(compute));
    while (!request.test()) {
    }
    request.wait();  // a finished request waits no more
    float sum = 0;
    for (int r = 0; r < n; ++r) sum += static_cast<float>(r + 1 + round);
    checker.check(
        "compute stream -> all_reduce_async -> wait_on, round " + std::to_string(round), host,
        [&](std::size_t) { return 2.0f * sum; }, ReduceOp::sum, n);
  }
  comm.set_compute_stream(previous);
  LLMPAR_CHECK_CUDA(cudaStreamDestroy(compute));
  if (comm.rank() == 0) std::printf("compute stream ordering, all_reduce_async, wait_on, test: checked\n");
}

// Kernels on the legacy default stream are ordered before an operation by default.
void check_default_stream(NcclComm& comm, Checker& checker) {
  const std::size_t count = std::size_t{1} << 22;
  DeviceBuffer<float> data(count);
  fill_kernel<<<1024, 256>>>(data.data(), count, 1.0f);
  LLMPAR_CHECK_CUDA(cudaGetLastError());
  comm.all_reduce(data.span());
  checker.check(
      "default stream -> all_reduce", data.download(), [&](std::size_t) { return static_cast<float>(comm.size()); },
      ReduceOp::sum, comm.size());
}

// Ranks split by parity, ordered by descending world rank.
void check_split(NcclComm& world, Checker& checker) {
  const int me = world.rank(), n = world.size();
  NcclComm half = world.split(me % 2, -me, "parity");
  std::vector<int> members;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) members.push_back(r);
  const int want_rank = static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
  if (half.size() != static_cast<int>(members.size()) || half.rank() != want_rank ||
      half.group().world_ranks != members || half.group().name != "parity")
    checker.fail("split: got rank " + std::to_string(half.rank()) + " of " + std::to_string(half.size()) + " in " +
                 half.group().describe());
  DeviceBuffer<std::int32_t> data(1000);
  data.upload(std::vector<std::int32_t>(1000, me));
  half.all_reduce(data.span());
  std::int32_t sum = 0;
  for (int r : members) sum += r;
  checker.check(
      "all_reduce on the split group", data.download(), [&](std::size_t) { return sum; }, ReduceOp::sum, half.size());
  if (me == 0) std::printf("split into '%s': checked\n", half.group().name.c_str());
}

// Verify mode passes matching operations and names a host buffer on every rank; the
// communicator stays usable after that error.
void check_verify(NcclComm& world, Checker& checker) {
  NcclComm comm(MPI_COMM_WORLD, world.device(), NcclOptions{.timeout = std::chrono::seconds(60), .verify = true},
                "verified");
  const int n = comm.size();
  DeviceBuffer<float> data(4096);
  data.upload(std::vector<float>(4096, 1.0f));
  comm.all_reduce(data.span());
  comm.broadcast(data.span(), 0);
  comm.barrier();
  checker.check(
      "verify mode: all_reduce", data.download(), [&](std::size_t) { return static_cast<float>(n); }, ReduceOp::sum, n);
  std::vector<float> host(4096, 1.0f);
  try {
    comm.all_reduce(host);
    checker.fail("verify mode accepted a host buffer");
  } catch (const llmpar::Error& e) {
    const std::string what = e.what();
    if (what.find("host memory the GPU cannot access") == std::string::npos ||
        what.find("group 'verified'") == std::string::npos)
      checker.fail("verify mode's message for a host buffer: " + what);
    else
      checker.pass();
    if (comm.rank() == 0) std::printf("verify mode's error: %s\n", what.c_str());
  }
  comm.all_reduce(data.span());
  checker.check(
      "verify mode: usable after a mismatch", data.download(),
      [&](std::size_t) { return static_cast<float>(n) * static_cast<float>(n); }, ReduceOp::sum, n);
}

// An operation queued behind a kernel that outlasts the timeout: the wait says it did not
// start, the communicator is aborted, and the next operation says so.
void check_timeout(NcclComm& world, Checker& checker) {
  cudaStream_t compute = nullptr;
  LLMPAR_CHECK_CUDA(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  {
    NcclComm comm(MPI_COMM_WORLD, world.device(), NcclOptions{.timeout = std::chrono::milliseconds(500)}, "short");
    comm.set_compute_stream(compute);
    DeviceBuffer<float> data(1024);
    spin_kernel<<<1, 1, 0, compute>>>(3'000'000'000ull);
    LLMPAR_CHECK_CUDA(cudaGetLastError());
    try {
      comm.all_reduce(data.span());
      checker.fail("an operation behind a 3 s kernel did not time out after 500 ms");
    } catch (const llmpar::Error& e) {
      const std::string what = e.what();
      if (what.find("did not start within 500 ms") == std::string::npos) checker.fail("timeout message: " + what);
      if (comm.rank() == 0) std::printf("timeout error: %s\n", what.c_str());
    }
    try {
      comm.barrier();
      checker.fail("an aborted communicator accepted another operation");
    } catch (const llmpar::Error& e) {
      if (std::string(e.what()).find("was aborted and runs no more operations") == std::string::npos)
        checker.fail(std::string("aborted communicator's message: ") + e.what());
      else
        checker.pass();
    }
  }
  LLMPAR_CHECK_CUDA(cudaStreamSynchronize(compute));
  LLMPAR_CHECK_CUDA(cudaStreamDestroy(compute));
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device (cudaGetDeviceCount: %s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return kSkip;
  }
  int failures = 0, cases = 0, rank = 0;
  try {
    llmpar::comm::MpiEnvironment mpi(argc, argv);  // a singleton world of one without mpirun
    int size = 1, local_size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    if (local_size > devices) {
      if (rank == 0) std::printf("skipped: %d ranks on this node but %d CUDA device(s)\n", local_size, devices);
      return kSkip;
    }
    Checker checker(rank);
    try {
      NcclComm world(MPI_COMM_WORLD, NcclComm::local_device(MPI_COMM_WORLD),
                     NcclOptions{.timeout = std::chrono::seconds(120)});
      if (rank == 0) {
        cudaDeviceProp prop{};
        LLMPAR_CHECK_CUDA(cudaGetDeviceProperties(&prop, world.device()));
        std::printf("%d rank(s); rank 0 on device %d: %s (sm_%d%d)\n", size, world.device(), prop.name, prop.major,
                    prop.minor);
      }
      check_type<float>(world, checker);
      check_type<bf16>(world, checker);
      check_type<f16>(world, checker);
      check_type<std::int32_t>(world, checker);
      check_type<std::int64_t>(world, checker);
      check_type<std::uint8_t>(world, checker);
      check_batch<float>(world, checker);
      check_batch<bf16>(world, checker);
      check_batch<std::int64_t>(world, checker);
      check_batch_verify(world, checker);
      check_streams(world, checker);
      check_default_stream(world, checker);
      check_split(world, checker);
      check_verify(world, checker);
      check_timeout(world, checker);
    } catch (const std::exception& ex) {
      checker.fail(std::string("unexpected error: ") + ex.what());
    }
    failures = checker.failures();
    cases = checker.cases();
    MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &cases, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
      if (failures != 0)
        std::printf("FAILED: %d of %d checks (over all ranks)\n", failures, cases);
      else
        std::printf("passed: %d checks on %d rank(s)\n", cases, size);
    }
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "FAIL (rank %d): %s\n", rank, ex.what());
    return 1;
  }
  return failures != 0 ? 1 : 0;
}
#endif
