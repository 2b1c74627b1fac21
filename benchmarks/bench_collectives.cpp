// bench_collectives — nccl-tests' *_perf table for llmpar's communicators.
//
//   bench_collectives [-b 8] [-e 64M] [-f 2] [-n 20] [-w 5] [-c 1] [-d float|...|all]
//                     [-o sum|avg|max|min|all] [-r 0] [--collective all_reduce|...|all]
//                     [--engine thread|mpi|nccl] [--ranks 2]
//
// Flags carry nccl-tests' names and defaults; so does the table: per size, the time,
// algbw, busbw and #wrong of the out-of-place and the in-place operation, then the
// average busbw (see comm_bench.hpp for the size conventions and busbw factors). With
// no flags: all_reduce of floats from 8 B to 64 MiB on two thread ranks.
//
// Why the numbers can be trusted:
// * Time: after `-w` untimed operations and a barrier, every rank times `-n` operations
//   back to back; the slowest rank's time over `-n` is reported.
// * #wrong: every input element is a small integer drawn from (rank, index), few and
//   small enough that every partial sum an engine can form, in any order, is an integer
//   of at most 255, exact in float, bfloat16, half and uint8; avg inputs are multiples
//   of the rank count, so averages are exact too (as in nccl-tests' verifiable/). After
//   the timed operations, each rank refills its inputs, runs the operation once more,
//   compares its output bit for bit with the result it predicts, and the counts are
//   summed over ranks by the communicator under test. --debug_corrupt_one_element
//   flips a bit of one output element before that comparison, to prove it counts.
// * memcpy bandwidth (64 MiB, one thread and all threads) is measured at start and
//   printed so that busbw can be read against what this machine's memory does.
//
// Engines: thread (ranks are threads of this process; --ranks N), mpi (one rank per
// process under mpirun, in builds with MPI) and nccl (in CUDA builds with NCCL).
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <llmpar/comm/thread_comm.hpp>
#include <llmpar/core/dtype.hpp>
#include <llmpar/core/error.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "comm_bench.hpp"

#if defined(LLMPAR_WITH_MPI)
#include <llmpar/comm/mpi_comm.hpp>
#endif
#if defined(LLMPAR_WITH_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>

#include <llmpar/backend/cuda/check.hpp>
#include <llmpar/comm/nccl_comm.hpp>
#include <utility>
#endif

using namespace llmpar;
using bench::Test;
using comm::ReduceOp;

namespace {

// ---- flags --------------------------------------------------------------------------

struct TypeName {
  DType type;
  const char* name;  // nccl-tests' name
};
constexpr TypeName kTypes[] = {{DType::f32, "float"}, {DType::bf16, "bfloat16"}, {DType::f16, "half"},
                               {DType::i32, "int32"}, {DType::i64, "int64"},     {DType::u8, "uint8"}};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

const char* type_name(DType t) {
  for (const TypeName& n : kTypes)
    if (n.type == t) return n.name;
  return "?";
}

struct Options {
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{64} << 20;
  int step_factor = 2;
  int iters = 20;
  int warmup = 5;
  int check = 1;
  int root = 0;
  int ranks = 2;
  std::string engine = "thread";
  std::vector<Test> tests{Test::all_reduce};
  std::vector<DType> types{DType::f32};
  std::vector<ReduceOp> ops{ReduceOp::sum};
  bool corrupt = false;
};

// "64M" -> 67108864 (K, M, G are powers of 1024, as in nccl-tests).
std::optional<std::size_t> parse_bytes(const std::string& text) {
  std::size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0 || digits > 12) return std::nullopt;  // up to 1e12 of a unit: no overflow below
  const std::size_t value = std::stoull(text.substr(0, digits));
  const std::string suffix = text.substr(digits);
  if (suffix.empty()) return value;
  if (suffix.size() != 1) return std::nullopt;
  switch (suffix[0]) {
    case 'k':
    case 'K':
      return value << 10;
    case 'm':
    case 'M':
      return value << 20;
    case 'g':
    case 'G':
      return value << 30;
    default:
      return std::nullopt;
  }
}

[[noreturn]] void bad_flag(const char* flag, const std::string& message) { throw CLI::ValidationError(flag, message); }

struct FlagText {
  std::string min_bytes = "8", max_bytes = "64M", datatype = "float", op = "sum", collective = "all_reduce";
};

void parse_flags(const FlagText& f, bool ranks_given, Options& o) {
  const char* const size_hint = "expected a byte count such as 8, 512K, 64M or 1G";
  const auto min_bytes = parse_bytes(f.min_bytes), max_bytes = parse_bytes(f.max_bytes);
  if (!min_bytes || *min_bytes == 0) bad_flag("--minbytes", "'" + f.min_bytes + "': " + size_hint + " (at least 1)");
  if (!max_bytes) bad_flag("--maxbytes", "'" + f.max_bytes + "': " + size_hint);
  o.min_bytes = *min_bytes;
  o.max_bytes = *max_bytes;
  if (o.max_bytes < o.min_bytes)
    bad_flag("--maxbytes", detail::concat(o.max_bytes, " is below --minbytes ", o.min_bytes, "; raise -e or lower -b"));

  o.types.clear();
  for (const TypeName& t : kTypes)
    if (f.datatype == "all" || f.datatype == t.name) o.types.push_back(t.type);
  if (o.types.empty())
    bad_flag("--datatype",
             "'" + f.datatype + "' is not a data type; use float, bfloat16, half, int32, int64, uint8 or all");

  o.ops.clear();
  for (ReduceOp op : kOps)
    if (f.op == "all" || f.op == comm::name_of(op)) o.ops.push_back(op);
  if (o.ops.empty()) bad_flag("--op", "'" + f.op + "' is not a reduction; use sum, avg, max, min or all");

  o.tests.clear();
  if (f.collective == "all") {
    o.tests.assign(std::begin(bench::kTests), std::end(bench::kTests));
  } else if (const auto t = bench::parse_test(f.collective)) {
    o.tests.push_back(*t);
  } else {
    bad_flag("--collective", "'" + f.collective +
                                 "' is not a collective; use all_reduce, reduce_scatter, all_gather, broadcast, "
                                 "reduce, all_to_all, sendrecv or all");
  }

  if (o.step_factor < 2) bad_flag("--stepfactor", detail::concat(o.step_factor, ": sizes must grow; use 2 or more"));
  if (o.iters < 1) bad_flag("--iters", detail::concat(o.iters, ": time at least one operation; use 1 or more"));
  if (o.warmup < 0) bad_flag("--warmup_iters", detail::concat(o.warmup, " is negative; use 0 or more"));
  if (o.check != 0 && o.check != 1) bad_flag("--check", detail::concat(o.check, ": use 1 (check) or 0 (do not)"));
  if (o.root < 0) bad_flag("--root", detail::concat(o.root, " is negative; use a rank, 0 by default"));
  if (o.engine != "thread" && o.engine != "mpi" && o.engine != "nccl")
    bad_flag("--engine", "'" + o.engine + "' is not an engine; use thread, mpi or nccl");
#if !defined(LLMPAR_WITH_MPI)
  if (o.engine == "mpi")
    bad_flag("--engine",
             "mpi: this build has no MPI; install one (Debian: libopenmpi-dev openmpi-bin), reconfigure, "
             "and run under mpirun -np N");
#else
  if (o.engine == "mpi" && !comm::launched_by_mpi())
    bad_flag("--engine",
             "mpi runs one rank per process: start it under mpirun, e.g. mpirun -np 2 bench_collectives "
             "--engine mpi");
#endif
#if !defined(LLMPAR_WITH_NCCL)
  if (o.engine == "nccl")
    bad_flag("--engine",
             "nccl: this build has no NCCL; configure a CUDA build (-DLLMPAR_CUDA=ON) where NCCL 2.18+ "
             "and MPI are installed, then run one process per GPU under mpirun");
#endif
  if (o.engine != "thread" && ranks_given)
    bad_flag("--ranks",
             "sets the thread engine's rank count; with --engine " + o.engine + " the launch decides (mpirun -np N)");
  if (o.engine == "thread") {
    if (o.ranks < 1) bad_flag("--ranks", detail::concat(o.ranks, ": the thread engine needs 1 rank or more"));
    if (o.root >= o.ranks)
      bad_flag("--root",
               detail::concat(o.root, " is not a rank of the ", o.ranks, "-rank world; use 0..", o.ranks - 1));
    if (o.ranks == 1 && f.collective == "sendrecv")
      bad_flag("--collective", "sendrecv needs 2 ranks or more; use --ranks 2");
  }
}

// ---- what every rank puts in and expects back -------------------------------------

// The input of rank r at element i: a small integer such that every result an engine
// can compute, in any order, is exact in every type (see the note at the top).
class Pattern {
 public:
  Pattern(Test t, ReduceOp op, int ranks) : ranks_(ranks), op_(op) {
    if (!bench::has_reduction(t) || op == ReduceOp::max || op == ReduceOp::min) return;  // values 0..255
    // Sums: at most 8 ranks contribute to one element (the others hold 0), each at most
    // 255 / contributors; avg scales every value by the rank count.
    scale_ = op == ReduceOp::avg ? ranks : 1;
    active_ = std::min(ranks, 8);
    while (active_ > 1 && 255 / (scale_ * active_) == 0) --active_;
    limit_ = 255 / (scale_ * active_);
  }

  std::int64_t value(int rank, std::size_t i) const {
    if (active_ < ranks_ &&
        (i + static_cast<std::size_t>(rank)) % static_cast<std::size_t>(ranks_) >= static_cast<std::size_t>(active_))
      return 0;
    std::uint64_t h = (static_cast<std::uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull +
                      (static_cast<std::uint64_t>(rank) + 1) * 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    return scale_ * static_cast<std::int64_t>(h % static_cast<std::uint64_t>(limit_ + 1));
  }

  // The reduction over all ranks of element i.
  std::int64_t reduced(std::size_t i) const {
    std::int64_t acc = value(0, i);
    for (int r = 1; r < ranks_; ++r) {
      const std::int64_t v = value(r, i);
      acc = op_ == ReduceOp::max ? std::max(acc, v) : op_ == ReduceOp::min ? std::min(acc, v) : acc + v;
    }
    return op_ == ReduceOp::avg ? acc / ranks_ : acc;
  }

 private:
  int ranks_;
  ReduceOp op_;
  int active_ = std::numeric_limits<int>::max();  // no element is forced to 0
  int limit_ = 255;
  int scale_ = 1;
};

template <class T>
T from_integer(std::int64_t v) {
  if constexpr (kIsFloating<T>)
    return convert<T>(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

// What an output element holds before the operation: -1, which no result equals (in
// uint8 it is 255, which only a few results reach).
template <class T>
T poison() {
  return from_integer<T>(-1);
}

// ---- memory the engine works on -----------------------------------------------------

// Where an engine's buffers live and how its operations are issued: Runner's second
// policy. Host memory (thread and MPI engines) is filled, operated on and checked in
// place, and each operation runs to completion when issued.
struct HostMemory {
  template <class T>
  static std::vector<T> allocate(std::size_t n) {
    return std::vector<T>(n);
  }
  template <class T, class F>
  static void fill(std::span<T> dst, F&& value_at) {
    for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = value_at(i);
  }
  // A host view of `src` (staging is for memory the host cannot read).
  template <class T>
  static std::span<T> read(std::span<T> src, std::vector<T>& /*staging*/) {
    return src;
  }
  template <comm::Communicator Comm, class T>
  static void issue(Comm& comm, Test t, const bench::Views<T>& v, bool in_place, ReduceOp op, int root) {
    bench::issue(comm, t, v, in_place, op, root);
  }
  // Waits for the operations issued so far (host engines finish them inline).
  template <class Comm>
  static void synchronize(Comm& /*comm*/) {}
};

#if defined(LLMPAR_WITH_NCCL)
// cudaMalloc'ed elements, freed with the object.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : size_(n) {
    if (n) LLMPAR_CHECK_CUDA(cudaMalloc(&data_, n * sizeof(T)), "bench_collectives: ", n * sizeof(T), " bytes");
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  ~DeviceBuffer() {
    if (data_) static_cast<void>(cudaFree(data_));
  }
  T* data() const { return data_; }
  std::size_t size() const { return size_; }
  T* begin() const { return data_; }
  T* end() const { return data_ + size_; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

// Device memory (NCCL engine): inputs are built on the host and copied in, outputs are
// copied back to be checked, and operations are enqueued on the communicator's stream
// without waiting, so the timed ones run back to back and are waited for once, as
// nccl-tests does.
class DeviceMemory {
 public:
  template <class T>
  static DeviceBuffer<T> allocate(std::size_t n) {
    return DeviceBuffer<T>(n);
  }
  template <class T, class F>
  static void fill(std::span<T> dst, F&& value_at) {
    std::vector<T> host(dst.size());
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = value_at(i);
    if (!host.empty())  // synchronous, on the legacy stream, which NcclComm's operations wait for
      LLMPAR_CHECK_CUDA(cudaMemcpy(dst.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T>
  static std::span<T> read(std::span<T> src, std::vector<T>& staging) {
    staging.resize(src.size());
    if (!src.empty())
      LLMPAR_CHECK_CUDA(cudaMemcpy(staging.data(), src.data(), src.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return staging;
  }

  template <class T>
  void issue(comm::NcclComm& comm, Test t, const bench::Views<T>& v, bool in_place, ReduceOp op, int root) {
    switch (t) {
      case Test::all_reduce:
        last_.emplace(comm.all_reduce_async(v.send, v.recv, op));
        return;
      case Test::reduce_scatter:
        last_.emplace(comm.reduce_scatter_async(v.send, v.recv, op));
        return;
      case Test::all_gather:
        last_.emplace(comm.all_gather_async(v.send, v.recv));
        return;
      case Test::broadcast:
        last_.emplace(in_place ? comm.broadcast_async(v.recv, root)
                               : comm.start(bench::broadcast_out_of_place(comm.rank(), v, root)));
        return;
      case Test::reduce:
        last_.emplace(comm.reduce_async(v.send, v.recv, op, root));
        return;
      case Test::all_to_all:
        last_.emplace(comm.all_to_all_async(v.send, v.recv));
        return;
      case Test::sendrecv:
        return sendrecv(comm, v);
    }
  }

  void synchronize(comm::NcclComm& comm) {
    if (last_) {  // surfaces the operations' errors and timeouts
      last_->wait();
      last_.reset();
    }
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(comm.stream()));
  }

 private:
  // NcclComm's send and recv are separate operations on one stream, and a ring of them
  // would wait forever (every rank's send waits for a receive queued behind the next
  // rank's send). nccl-tests issues the pair as one NCCL group; so does this, on the
  // communicator's own handle and stream.
  template <class T>
  static void sendrecv(comm::NcclComm& comm, const bench::Views<T>& v) {
    if (v.send.empty()) return;
    const int n = comm.size(), r = comm.rank();
    const ncclDataType_t type = comm::detail::to_nccl(dtype_of<T>());
    ncclResult_t first = ncclSuccess;
    auto keep = [&](ncclResult_t result) {
      if (first == ncclSuccess && result != ncclSuccess && result != ncclInProgress) first = result;
    };
    keep(ncclGroupStart());
    keep(ncclSend(v.send.data(), v.send.size(), type, (r + 1) % n, comm.native(), comm.stream()));
    keep(ncclRecv(v.recv.data(), v.recv.size(), type, (r + n - 1) % n, comm.native(), comm.stream()));
    ncclResult_t state = ncclGroupEnd();
    while (state == ncclInProgress) LLMPAR_CHECK_NCCL(ncclCommGetAsyncError(comm.native(), &state));
    LLMPAR_CHECK_NCCL(first != ncclSuccess ? first : state, "sendrecv on ", comm.group().describe());
  }

  std::optional<comm::NcclComm::Request> last_;
};
#endif

// ---- memcpy bandwidth ---------------------------------------------------------------

struct MemcpyBandwidth {
  double one_thread = 0;  // GB/s: bytes copied per second
  double all_threads = 0;
  int threads = 1;
  double device = 0;  // cudaMemcpy device to device (NCCL engine)
};

MemcpyBandwidth measure_memcpy() {
  constexpr std::size_t kBytes = std::size_t{64} << 20;
  constexpr int kRepeats = 5;
  std::vector<std::byte> src(kBytes, std::byte{1}), dst(kBytes, std::byte{2});
  auto best_gbps = [&](int threads) {
    double best = std::numeric_limits<double>::infinity();
    for (int rep = 0; rep < kRepeats; ++rep) {
      const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
      {
        const std::size_t t = static_cast<std::size_t>(omp_get_thread_num()),
                          nt = static_cast<std::size_t>(omp_get_num_threads());
        const std::size_t begin = kBytes * t / nt, end = kBytes * (t + 1) / nt;
        std::memcpy(dst.data() + begin, src.data() + begin, end - begin);
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return static_cast<double>(kBytes) * 1e-9 / best;
  };
  MemcpyBandwidth bw;
  bw.threads = omp_get_max_threads();
  bw.one_thread = best_gbps(1);
  bw.all_threads = best_gbps(bw.threads);
  return bw;
}

// ---- the table ----------------------------------------------------------------------

struct Result {
  double seconds = 0;
  std::int64_t wrong = -1;  // -1: not checked
};

void print_table_header(Test t, int ranks) {
  std::printf("#\n# %.*s: busbw = algbw x %.4g\n", static_cast<int>(bench::name_of(t).size()), bench::name_of(t).data(),
              bench::bus_factor(t, ranks));
  std::printf("# %67s%35s\n", "out-of-place", "in-place");
  std::printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "size", "count", "type", "redop",
              "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
  std::printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "(B)", "(elements)", "", "", "",
              "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
}

// nccl-tests' time format: fewer decimals as the time grows.
std::string format_time(double us) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), us >= 10000.0 ? "%7.0f" : us >= 100.0 ? "%7.1f" : "%7.2f", us);
  return buffer;
}

struct TableTotals {
  double busbw_sum = 0;
  int busbw_count = 0;
  std::int64_t wrong = 0;
};

void print_result(Test t, int ranks, const bench::Shape& shape, const std::optional<Result>& r, TableTotals& totals) {
  if (!r) {
    std::printf("  %7s  %6s  %6s  %6s", "N/A", "N/A", "N/A", "N/A");
    return;
  }
  const double algbw = bench::algbw(shape, r->seconds), busbw = bench::busbw(t, ranks, shape, r->seconds);
  totals.busbw_sum += busbw;
  ++totals.busbw_count;
  char wrong[32] = "N/A";
  if (r->wrong >= 0) {
    std::snprintf(wrong, sizeof(wrong), "%lld", static_cast<long long>(r->wrong));
    totals.wrong += r->wrong;
  }
  std::printf("  %s  %6.2f  %6.2f  %6s", format_time(r->seconds * 1e6).c_str(), algbw, busbw, wrong);
}

void print_table_footer(const TableTotals& totals, bool checked) {
  if (checked)
    std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(totals.wrong),
                totals.wrong ? "FAILED" : "OK");
  std::printf("# Avg bus bandwidth    : %g\n", totals.busbw_count ? totals.busbw_sum / totals.busbw_count : 0.0);
  std::fflush(stdout);
}

// ---- one rank's part ----------------------------------------------------------------

// Runs every requested collective, type, reduction and size on one rank of `comm`;
// rank 0 prints. Generic over the engine (Comm) and where its buffers live (Memory).
template <comm::Communicator Comm, class Memory>
class Runner {
 public:
  Runner(Comm& comm, Memory& mem, const Options& o) : comm_(comm), mem_(mem), o_(o) {
    LLMPAR_CHECK(o.root < comm.size(), "--root ", o.root, " is not a rank of the ", comm.size(), "-rank world; use 0..",
                 comm.size() - 1);
  }

  // Prints the tables (rank 0); returns the wrong elements over all ranks and tables.
  std::int64_t run(const std::string& engine, const MemcpyBandwidth& bw) {
    const int n = comm_.size();
    if (printing()) {
      std::printf("# llmpar bench_collectives: %s\n", engine.c_str());
      std::printf("# minBytes %zu maxBytes %zu step: %d(factor) warmup iters: %d iters: %d validation: %d\n",
                  o_.min_bytes, o_.max_bytes, o_.step_factor, o_.warmup, o_.iters, o_.check);
      std::printf("# memcpy bandwidth: %.1f GB/s (1 thread), %.1f GB/s (%d threads); 64 MiB, bytes copied / time\n",
                  bw.one_thread, bw.all_threads, bw.threads);
      if (bw.device > 0) std::printf("# device memcpy bandwidth: %.1f GB/s (cudaMemcpy, 64 MiB)\n", bw.device);
      std::printf("# time: slowest rank, mean of %d operations; algbw = size / time; GB = 1e9 bytes\n", o_.iters);
    }
    std::int64_t wrong = 0;
    for (Test t : o_.tests) {
      if (t == Test::sendrecv && n < 2) {
        if (printing()) std::printf("#\n# sendrecv skipped: it needs 2 ranks or more\n");
        continue;
      }
      if (printing()) print_table_header(t, n);
      TableTotals totals;
      for (DType type : o_.types) {
        const std::vector<ReduceOp> ops = bench::has_reduction(t) ? o_.ops : std::vector<ReduceOp>{ReduceOp::sum};
        for (ReduceOp op : ops)
          comm::visit_dtype(type, [&](auto tag) { run_sizes<decltype(tag)>(t, type, op, totals); });
      }
      if (printing()) print_table_footer(totals, o_.check != 0);
      wrong += totals.wrong;
    }
    return wrong;
  }

 private:
  using Clock = std::chrono::steady_clock;
  template <class T>
  using MemBuffer = decltype(std::declval<Memory&>().template allocate<T>(0));

  bool printing() const { return comm_.rank() == 0; }

  // Every size from -b to -e for one collective, type and reduction.
  template <class T>
  void run_sizes(Test t, DType type, ReduceOp op, TableTotals& totals) {
    const int n = comm_.size();
    const bench::Shape largest = bench::shape_of(t, o_.max_bytes, sizeof(T), n);
    MemBuffer<T> send = mem_.template allocate<T>(largest.send);
    MemBuffer<T> recv = mem_.template allocate<T>(std::max(largest.send, largest.recv));
    const Pattern pattern(t, op, n);
    const int root = bench::has_root(t) ? o_.root : -1;
    const char* op_name = bench::has_reduction(t) ? comm::name_of(op).data() : "none";
    const std::size_t step = static_cast<std::size_t>(o_.step_factor);
    for (std::size_t bytes = o_.min_bytes; bytes <= o_.max_bytes; bytes *= step) {
      const bench::Shape shape = bench::shape_of(t, bytes, sizeof(T), n);
      const Result out_of_place = measure<T>(t, shape, pattern, op, false, send, recv);
      std::optional<Result> in_place;
      if (bench::has_in_place(t)) in_place = measure<T>(t, shape, pattern, op, true, send, recv);
      if (printing()) {
        std::printf("  %10zu  %12zu  %8s  %6s  %6d", shape.bytes, shape.count, type_name(type), op_name, root);
        print_result(t, n, shape, out_of_place, totals);
        print_result(t, n, shape, in_place, totals);
        std::printf("\n");
        std::fflush(stdout);
      } else {  // the other ranks keep the same count of wrong elements
        totals.wrong += out_of_place.wrong > 0 ? out_of_place.wrong : 0;
        if (in_place && in_place->wrong > 0) totals.wrong += in_place->wrong;
      }
      if (bytes > o_.max_bytes / step) break;
    }
  }

  template <class T>
  Result measure(Test t, const bench::Shape& shape, const Pattern& pattern, ReduceOp op, bool in_place,
                 MemBuffer<T>& send, MemBuffer<T>& recv) {
    const bench::Views<T> v =
        bench::views_of<T>(t, shape, comm_.rank(), in_place, std::span<T>(send), std::span<T>(recv));
    fill_inputs<T>(t, shape, pattern, in_place, send, recv);
    for (int i = 0; i < o_.warmup; ++i) mem_.issue(comm_, t, v, in_place, op, o_.root);
    mem_.synchronize(comm_);
    comm_.barrier();
    const auto start = Clock::now();
    for (int i = 0; i < o_.iters; ++i) mem_.issue(comm_, t, v, in_place, op, o_.root);
    mem_.synchronize(comm_);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();

    Result r;
    r.seconds = static_cast<double>(all_reduce_value<std::int64_t>(ns, ReduceOp::max)) * 1e-9 / o_.iters;
    if (o_.check) {
      fill_inputs<T>(t, shape, pattern, in_place, send, recv);
      mem_.issue(comm_, t, v, in_place, op, o_.root);
      mem_.synchronize(comm_);
      r.wrong = all_reduce_value<std::int64_t>(count_wrong<T>(t, shape, pattern, in_place, v.recv), ReduceOp::sum);
    }
    return r;
  }

  // Inputs from the pattern; everything the operation should overwrite is poisoned.
  template <class T>
  void fill_inputs(Test t, const bench::Shape& shape, const Pattern& pattern, bool in_place, MemBuffer<T>& send,
                   MemBuffer<T>& recv) {
    const int r = comm_.rank();
    const std::size_t block = shape.count;
    auto input = [&](std::size_t i) { return from_integer<T>(pattern.value(r, i)); };
    auto poisoned = [](std::size_t) { return poison<T>(); };
    if (!in_place) {
      mem_.fill(std::span<T>(send).first(shape.send), input);
      mem_.fill(std::span<T>(recv).first(shape.recv), poisoned);
      return;
    }
    const std::span<T> data = std::span<T>(recv).first(std::max(shape.send, shape.recv));
    if (t == Test::all_gather) {  // own block in place, the others to be gathered
      mem_.fill(data, [&](std::size_t i) {
        return i / block == static_cast<std::size_t>(r) ? from_integer<T>(pattern.value(r, i % block)) : poison<T>();
      });
    } else if (t == Test::broadcast && r != o_.root) {
      mem_.fill(data, poisoned);
    } else {
      mem_.fill(data, input);
    }
  }

  // Elements of this rank's output that differ, bit for bit, from the prediction.
  template <class T>
  std::int64_t count_wrong(Test t, const bench::Shape& shape, const Pattern& p, bool in_place, std::span<T> output) {
    const int r = comm_.rank(), n = comm_.size(), root = o_.root;
    const std::size_t block = shape.count, mine = block * static_cast<std::size_t>(r);
    if (t == Test::reduce && r != root && !in_place) return 0;  // nothing arrives off the root
    std::vector<T> staging;
    const std::span<T> out = mem_.read(output, staging);
    if (o_.corrupt && !out.empty() && r == (t == Test::reduce ? root : n - 1)) {
      unsigned char byte;  // flip the lowest bit of the first element
      std::memcpy(&byte, out.data(), 1);
      byte ^= 1u;
      std::memcpy(out.data(), &byte, 1);
    }
    auto count = [&](auto&& expected) {
      std::int64_t wrong = 0;
      for (std::size_t j = 0; j < out.size(); ++j) {
        const T want = from_integer<T>(expected(j));
        wrong += std::memcmp(&out[j], &want, sizeof(T)) != 0;
      }
      return wrong;
    };
    switch (t) {
      case Test::all_reduce:
        return count([&](std::size_t j) { return p.reduced(j); });
      case Test::reduce_scatter:
        return count([&](std::size_t j) { return p.reduced(mine + j); });
      case Test::all_gather:
        return count([&](std::size_t j) { return p.value(static_cast<int>(j / block), j % block); });
      case Test::broadcast:
        return count([&](std::size_t j) { return p.value(root, j); });
      case Test::reduce:  // off the root (in place), the buffer stays this rank's input
        return r == root ? count([&](std::size_t j) { return p.reduced(j); })
                         : count([&](std::size_t j) { return p.value(r, j); });
      case Test::all_to_all:
        return count([&](std::size_t j) { return p.value(static_cast<int>(j / block), mine + j % block); });
      case Test::sendrecv:
        return count([&](std::size_t j) { return p.value((r + n - 1) % n, j); });
    }
    return 0;
  }

  // op over the ranks of one value, through the communicator under test.
  template <class T>
  T all_reduce_value(T value, ReduceOp op) {
    MemBuffer<T> buffer = mem_.template allocate<T>(1);
    const std::span<T> s(buffer);
    mem_.fill(s, [&](std::size_t) { return value; });
    comm_.all_reduce(s, op);
    mem_.synchronize(comm_);
    std::vector<T> staging;
    return mem_.read(s, staging)[0];
  }

  Comm& comm_;
  Memory& mem_;
  const Options& o_;
};

// ---- engines ------------------------------------------------------------------------

// "1 OpenMP thread", "2 OpenMP threads"
std::string threads(int n) { return detail::concat(n, " OpenMP thread", n == 1 ? "" : "s"); }

std::int64_t run_thread_engine(const Options& o) {
  const MemcpyBandwidth bw = measure_memcpy();
  std::int64_t wrong = 0;
  comm::run_threads(o.ranks, [&](comm::ThreadComm& world) {
    HostMemory mem;
    Runner<comm::ThreadComm, HostMemory> runner(world, mem, o);
    const std::string engine = detail::concat("thread engine, ", world.size(), " ranks (threads of this process, ",
                                              threads(omp_get_max_threads()), " each)");
    const std::int64_t w = runner.run(engine, bw);
    if (world.rank() == 0) wrong = w;
  });
  return wrong;
}

std::int64_t run_mpi_engine(const Options& o, int& argc, char**& argv) {
#if defined(LLMPAR_WITH_MPI)
  comm::MpiEnvironment environment(argc, argv);
  std::int64_t wrong = 0;
  {
    comm::MpiComm world = comm::MpiComm::world();
    MemcpyBandwidth bw;
    if (world.rank() == 0) bw = measure_memcpy();
    world.barrier();
    HostMemory mem;
    Runner<comm::MpiComm, HostMemory> runner(world, mem, o);
    wrong = runner.run(detail::concat("mpi engine, ", world.size(), " ranks (one process each, ",
                                      threads(omp_get_max_threads()), " each)"),
                       bw);
  }
  return wrong;
#else
  static_cast<void>(o);
  static_cast<void>(argc);
  static_cast<void>(argv);
  LLMPAR_FAIL("unreachable: the flags reject --engine mpi in builds without MPI");
#endif
}

#if defined(LLMPAR_WITH_NCCL)
double measure_device_memcpy() {
  constexpr std::size_t kBytes = std::size_t{64} << 20;
  DeviceBuffer<std::byte> src(kBytes), dst(kBytes);
  LLMPAR_CHECK_CUDA(cudaMemset(src.data(), 1, kBytes));
  double best = std::numeric_limits<double>::infinity();
  for (int rep = 0; rep < 5; ++rep) {
    LLMPAR_CHECK_CUDA(cudaDeviceSynchronize());
    const auto start = std::chrono::steady_clock::now();
    LLMPAR_CHECK_CUDA(cudaMemcpy(dst.data(), src.data(), kBytes, cudaMemcpyDeviceToDevice));
    LLMPAR_CHECK_CUDA(cudaDeviceSynchronize());
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return static_cast<double>(kBytes) * 1e-9 / best;
}
#endif

std::int64_t run_nccl_engine(const Options& o, int& argc, char**& argv) {
#if defined(LLMPAR_WITH_NCCL)
  comm::MpiEnvironment environment(argc, argv);  // a process started without mpirun is a world of one
  std::int64_t wrong = 0;
  {
    const int device = comm::NcclComm::local_device(MPI_COMM_WORLD);
    LLMPAR_CHECK_CUDA(cudaSetDevice(device));
    comm::NcclComm world(MPI_COMM_WORLD, device);
    MemcpyBandwidth bw;
    if (world.rank() == 0) {
      bw = measure_memcpy();
      bw.device = measure_device_memcpy();
    }
    world.barrier();
    cudaDeviceProp properties{};
    LLMPAR_CHECK_CUDA(cudaGetDeviceProperties(&properties, device));
    DeviceMemory mem;
    Runner<comm::NcclComm, DeviceMemory> runner(world, mem, o);
    wrong = runner.run(detail::concat("nccl engine, ", world.size(), " ranks (one process and CUDA device each; ",
                                      "rank 0 on device ", device, ", ", properties.name, ")"),
                       bw);
  }
  return wrong;
#else
  static_cast<void>(o);
  static_cast<void>(argc);
  static_cast<void>(argv);
  LLMPAR_FAIL("unreachable: the flags reject --engine nccl in builds without NCCL");
#endif
}

int run(const Options& o, int& argc, char**& argv) {
  std::int64_t wrong = 0;
  if (o.engine == "thread")
    wrong = run_thread_engine(o);
  else if (o.engine == "mpi")
    wrong = run_mpi_engine(o, argc, argv);
  else
    wrong = run_nccl_engine(o, argc, argv);
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  FlagText text;
  CLI::App app{"bench_collectives: nccl-tests' busbw table for llmpar's communicators"};
  app.add_option("-b,--minbytes", text.min_bytes, "Smallest size in bytes (suffixes K, M, G)")->capture_default_str();
  app.add_option("-e,--maxbytes", text.max_bytes, "Largest size in bytes (suffixes K, M, G)")->capture_default_str();
  app.add_option("-f,--stepfactor", o.step_factor, "Multiply the size by this between rows")->capture_default_str();
  app.add_option("-n,--iters", o.iters, "Timed operations per size")->capture_default_str();
  app.add_option("-w,--warmup_iters", o.warmup, "Untimed operations before them")->capture_default_str();
  app.add_option("-c,--check", o.check, "Check every result bit for bit (1) or not (0)")->capture_default_str();
  app.add_option("-d,--datatype", text.datatype, "float, bfloat16, half, int32, int64, uint8 or all")
      ->capture_default_str();
  app.add_option("-o,--op", text.op, "Reduction: sum, avg, max, min or all")->capture_default_str();
  app.add_option("-r,--root", o.root, "Root of broadcast and reduce")->capture_default_str();
  app.add_option("--collective", text.collective,
                 "all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all, sendrecv or all")
      ->capture_default_str();
  app.add_option("--engine", o.engine, "thread, mpi (under mpirun) or nccl (CUDA builds)")->capture_default_str();
  app.add_option("--ranks", o.ranks, "Ranks of the thread engine")->capture_default_str();
  // A self-test of the checker: flips a bit of one output element before the check.
  app.add_flag("--debug_corrupt_one_element", o.corrupt)->group("");
  // `llmpar.sh bench ARGS` gives every benchmark program the same arguments: Google
  // Benchmark's own flags are meant for the others.
  app.allow_extras();
  try {
    app.parse(argc, argv);
    for (const std::string& extra : app.remaining()) {
      if (extra.rfind("--benchmark_", 0) == 0) {
        std::fprintf(stderr, "bench_collectives: ignoring %s (a Google Benchmark flag)\n", extra.c_str());
        continue;
      }
      throw CLI::ExtrasError({extra});
    }
    parse_flags(text, app.count("--ranks") > 0, o);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run(o, argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: error: %s\n", e.what());
    return 1;
  }
}
