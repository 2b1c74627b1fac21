// llmpar/comm/mpi_comm.hpp — MpiComm: the Communicator engine across processes, over MPI.
//
// One MpiComm is one rank of a group of processes started by mpirun, srun or hydra
// (launched_by_mpi() tells). MpiEnvironment initialises MPI; MpiComm::world() wraps a
// duplicate of MPI_COMM_WORLD and split() makes sub-communicators. Errors come back as
// codes (MPI_ERRORS_RETURN on every communicator and window) and LLMPAR_CHECK_MPI
// turns them into llmpar::Error with MPI's text, the call and the world rank. The MPI
// machinery NcclComm needs too (errors, arrival counters, verify mode's exchange) is in
// comm/detail/mpi.hpp.
//
// Why it is built this way:
//
// * The synchronous path is MPI's blocking call. Measured on this project's 2-core
//   development machine (Open MPI 4.1.4, shared memory, f32 sum, best of 3):
//   MPI_Iallreduce + MPI_Test polling took 2.0 us against 0.95 us for MPI_Allreduce at
//   8 B, 3.7 against 2.2 us at 1 KiB, and 488 against 391 us at 1 MiB. (Open MPI runs
//   non-blocking collectives as libnbc schedules and blocking ones with its tuned
//   algorithms; the non-blocking call was faster only from a few MiB up, 46 against
//   63 ms at 64 MiB on 2 ranks, which is Open MPI's algorithm choice and its coll_tuned
//   parameters' business.) run() must stay within 5% of the raw call, so it makes the
//   raw call. start() uses the non-blocking call (MPI_Iallreduce, MPI_Isend, ...). MPI
//   does not match a blocking collective with a non-blocking one, so every rank must
//   issue a given collective the same way, both blocking or both async (verify mode
//   checks it; point to point mixes freely). A batch of sends and receives
//   (start_batch) is an MPI_Isend or MPI_Irecv each, all issued before its Request
//   polls them (MPI_Test on each, until every one has completed: MPI_Waitall with a
//   deadline). MPI keeps the messages between two ranks in posting order, since they
//   share the communicator and the tag.
// * Timeouts without slowing the blocking path. A blocking MPI call cannot be
//   interrupted, so each communicator has a watchdog thread. Before a blocking call the
//   caller publishes what it is about to do in a few relaxed atomics (no clock read, no
//   system call); the watchdog wakes every timeout/10 (1 ms to 200 ms) and, when the
//   same call has been in progress for the whole timeout, prints an error naming the
//   collective, the group and the ranks that did not arrive, then calls MPI_Abort:
//   the job ends instead of hanging (the way NCCL-based trainers' watchdogs do).
//   Request::wait() instead polls MPI_Test until the deadline and throws llmpar::Error,
//   which a caller can catch; the communicator is then broken and every later call on
//   it throws at once, saying why.
// * Naming the ranks that did not arrive. Every rank keeps, in an MPI window made at
//   construction (the arrival board of comm/detail/mpi.hpp), how many collectives it
//   has entered on this communicator and how many sends and receives it has posted to
//   and from each peer. In a unified window (shared memory, RDMA) a rank updates its own
//   counters with a plain atomic store; otherwise with an MPI_Accumulate to itself. A
//   rank that times out reads the others' counters with passive-target
//   MPI_Rget_accumulate (no cooperation from them needed), polled for a grace period;
//   ranks whose counter is behind did not arrive, ranks that do not answer are reported
//   as not responding. A communicator on one node gets its window from
//   MPI_Win_allocate_shared, others from MPI_Win_allocate: Open MPI 4's osc/rdma gives
//   the windows of disjoint groups from one split the same shared segment on a node
//   (open-mpi/ompi#9492), so there, a split group spanning nodes keeps no counters and
//   its timeouts say that they cannot name the missing ranks.
// * Conventions are NCCL's (comm/types.hpp). In place maps to MPI_IN_PLACE: all_gather's
//   convention (send == recv + rank * count) is MPI's, reduce_scatter's is not — MPI
//   reads the input from the receive buffer and leaves the result in its first block,
//   so an in-place reduce_scatter runs MPI's in place on the whole buffer and moves the
//   result to block `rank` afterwards (the other blocks are left unspecified, as MPI
//   leaves them). Buffers that overlap any other way are an error.
// * bf16 and f16 travel as a 2-byte MPI datatype with user-defined MPI_Ops that call
//   comm::detail::combine, the reduction every engine shares (each pairwise step
//   rounds to the 16-bit type). avg is a sum followed by comm::detail::finish on the
//   ranks that receive a result (integers truncate toward zero). Integer sums use
//   MPI_SUM: Open MPI and MPICH add with the machine's wrapping add, which is what
//   combine's unsigned arithmetic computes; u8 is unsigned and wraps by definition.
// * MPI counts are int: an Op of more than INT_MAX elements (per rank block for
//   reduce_scatter, all_gather, all_to_all) fails before any MPI call with an error
//   that names the count and says to split the buffer.
// * Verify mode (MpiOptions::verify, or LLMPAR_COMM_VERIFY=1 on any rank) all-reduces
//   each collective's fingerprint (kind, type, count, reduction, root) and whether it
//   is blocking, MAX and MIN in one non-blocking all-reduce of the values and their
//   negations (every rank issues it the same way, so it matches; the watchdog covers
//   it); on a difference the ranks gather every fingerprint and each throws the same
//   error, in every engine's words (comm/detail/verify.hpp), naming the field and every
//   rank's value. The communicator stays usable. A recv always checks that the matching
//   send carried as many elements as it expected.
// * Lifetime. Construction, split() and destruction are collective, like MPI's (destroy
//   communicators in the same order on every rank, before MPI_Finalize). A broken
//   communicator frees its window (collectively) only if its abandoned operations
//   complete within a grace period (e.g. the missing rank joined late); otherwise it
//   leaves it, records them, and MpiEnvironment then calls MPI_Abort instead of
//   MPI_Finalize, which would wait for them forever.
#pragma once

#if !__has_include(<mpi.h>)
// Without mpi.h (an llmpar built with LLMPAR_MPI=OFF), say what to install.
#error "llmpar/comm/mpi_comm.hpp needs mpi.h: install MPI (Debian: libopenmpi-dev) and build with LLMPAR_MPI=ON"
#endif

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <numeric>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "llmpar/comm/communicator.hpp"
#include "llmpar/comm/detail/mpi.hpp"
#include "llmpar/comm/detail/verify.hpp"
#include "llmpar/comm/types.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::comm {

struct MpiOptions {
  // How long an operation may wait for the other ranks. A blocking call that takes
  // longer aborts the job after naming the missing ranks; Request::wait() throws.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Check before every collective that all ranks issue the same one (one extra small
  // MPI_Allreduce each: a debugging aid). Also switched on by LLMPAR_COMM_VERIFY=1.
  bool verify = false;
};

namespace detail::mpi {

// Launchers and the variables they set in every rank's environment: Open MPI's mpirun
// (OMPI_COMM_WORLD_*), PMIx launchers (Open MPI 5's prterun, srun --mpi=pmix),
// MPICH/Intel MPI's hydra and PMI-2 (PMI_*, MPI_LOCALNRANKS), MVAPICH, Cray PALS.
// Slurm sets SLURM_PROCID in every task of every step, MPI or not (and 0 in batch
// scripts), so it counts only together with an MPI plugin.
template <class Getenv>
bool launched_by_mpi(Getenv&& lookup) {
  auto has = [&](const char* name) {
    const char* value = lookup(name);
    return value != nullptr && *value != '\0';
  };
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                           "PMI_FD", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_RANK", "PALS_RANKID"})
    if (has(name)) return true;
  return has("SLURM_PROCID") && has("SLURM_MPI_TYPE") && std::string_view(lookup("SLURM_MPI_TYPE")) != "none";
}

inline const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown thread level";
}

}  // namespace detail::mpi

// Whether this process was started by an MPI launcher (mpirun, srun with an MPI plugin,
// hydra, ...), read from the environment it sets; MPI need not be initialised.
inline bool launched_by_mpi() {
  return detail::mpi::launched_by_mpi([](const char* name) { return std::getenv(name); });
}

// Initialises MPI for the lifetime of this object: MPI_Init_thread asking for
// MPI_THREAD_MULTIPLE (the watchdog reads the arrival counters while the caller's
// thread is inside a blocking call), unless MPI is already initialised; MPI_Finalize in
// the destructor when this object initialised it. Destroy every MpiComm first.
class MpiEnvironment {
 public:
  MpiEnvironment() : MpiEnvironment(nullptr, nullptr) {}
  MpiEnvironment(int& argc, char**& argv) : MpiEnvironment(&argc, &argv) {}
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

  ~MpiEnvironment() {
    if (!owner_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    auto& abandoned = detail::mpi::abandoned();
    std::unique_lock lock(abandoned.mutex);
    if (abandoned.operations > 0) {
      std::fprintf(stderr,
                   "llmpar: world rank %d: %d MPI operation(s) that timed out are still pending (%s); MPI_Finalize "
                   "would wait for them forever, so the job is aborted instead\n",
                   detail::mpi::world_rank(), abandoned.operations, abandoned.reason.c_str());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, kLostRankExit);
    }
    lock.unlock();
    MPI_Finalize();
  }

  // The thread level MPI provides (MPI_THREAD_MULTIPLE where the library supports it).
  int thread_level() const { return thread_level_; }
  // Whether this object initialised MPI (and so finalizes it).
  bool owner() const { return owner_; }

 private:
  MpiEnvironment(int* argc, char*** argv) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    LLMPAR_CHECK(!finalized,
                 "MpiEnvironment: MPI has already been finalized in this process and cannot be "
                 "initialised again; keep one MpiEnvironment alive for the whole program");
    if (initialized) {
      LLMPAR_CHECK_MPI(MPI_Query_thread(&thread_level_), "MpiEnvironment");
      return;
    }
    LLMPAR_CHECK_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &thread_level_), "MpiEnvironment");
    owner_ = true;
  }

  bool owner_ = false;
  int thread_level_ = MPI_THREAD_SINGLE;
};

namespace detail::mpi {

// The tag of send/recv (each communicator is its own message space).
inline constexpr int kTag = 0;
// What the watchdog knows about split(), which is not an Op.
inline constexpr std::uint64_t kSplit = 0xFF;
// The end of a timeout's report when every rank has arrived at a collective.
inline constexpr std::string_view kStalled =
    " (MPI does not match a blocking collective with an async one: issue it the same way on every rank; verify mode "
    "checks this)";
// Verify mode's fingerprint: Op::fingerprint(), then whether the call is async.
inline constexpr auto kVerifyFields = fingerprint_fields_and(std::array<FingerprintField, 1>{
    {{"blocking or async", [](std::int64_t v) { return std::string(v ? "async" : "blocking"); }}}});

// bf16/f16 reduction as an MPI user function: inout[i] = combine(in[i], inout[i]).
template <class T, ReduceOp kOp>
void reduce_16bit(void* in, void* inout, int* length, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *length; ++i) b[i] = T(combine<float>(kOp, static_cast<float>(a[i]), static_cast<float>(b[i])));
}

// The MPI datatype and reduction operators for each DType, created once per world and
// shared by its sub-communicators; looked up in tables on the hot path.
class Types {
 public:
  static constexpr std::array kTypes{DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8};
  static constexpr std::array kReductions{ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

  Types() {
    LLMPAR_CHECK_MPI(MPI_Query_thread(&thread_level_), "MpiComm");
    LLMPAR_CHECK_MPI(MPI_Type_contiguous(2, MPI_BYTE, &half_), "MpiComm: the 16-bit float datatype");
    LLMPAR_CHECK_MPI(MPI_Type_commit(&half_), "MpiComm: the 16-bit float datatype");
    for (auto& row : ops_) row.fill(MPI_OP_NULL);
    for (const DType t : kTypes) {
      const auto i = static_cast<std::size_t>(t);
      visit_dtype(t, [&](auto element) {
        using T = decltype(element);
        if constexpr (std::is_same_v<T, float>)
          types_[i] = MPI_FLOAT;
        else if constexpr (std::is_same_v<T, std::int32_t>)
          types_[i] = MPI_INT32_T;
        else if constexpr (std::is_same_v<T, std::int64_t>)
          types_[i] = MPI_INT64_T;
        else if constexpr (std::is_same_v<T, std::uint8_t>)
          types_[i] = MPI_UINT8_T;
        else
          types_[i] = half_;
        for (const ReduceOp r : kReductions) {
          MPI_Op& op = ops_[i][static_cast<std::size_t>(r)];
          if constexpr (kIsFloating<T> && !std::is_same_v<T, float>) {
            if (r == ReduceOp::avg) continue;  // the sum's operator, below
            LLMPAR_CHECK_MPI(MPI_Op_create(user_function<T>(r), 1, &op), "MpiComm: ", name_of(t), " ", name_of(r));
          } else {
            op = r == ReduceOp::max ? MPI_MAX : r == ReduceOp::min ? MPI_MIN : MPI_SUM;  // avg: a sum, then finish
          }
        }
        ops_[i][static_cast<std::size_t>(ReduceOp::avg)] = ops_[i][static_cast<std::size_t>(ReduceOp::sum)];
      });
    }
  }
  Types(const Types&) = delete;
  Types& operator=(const Types&) = delete;
  ~Types() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (const DType t : {DType::bf16, DType::f16})
      for (const ReduceOp r : {ReduceOp::sum, ReduceOp::max, ReduceOp::min})
        if (MPI_Op& op = ops_[static_cast<std::size_t>(t)][static_cast<std::size_t>(r)]; op != MPI_OP_NULL)
          MPI_Op_free(&op);
    if (half_ != MPI_DATATYPE_NULL) MPI_Type_free(&half_);
  }

  int thread_level() const { return thread_level_; }
  MPI_Datatype datatype(DType t) const { return types_[static_cast<std::size_t>(t)]; }
  MPI_Op op(DType t, ReduceOp r) const { return ops_[static_cast<std::size_t>(t)][static_cast<std::size_t>(r)]; }

 private:
  template <class T>
  static MPI_User_function* user_function(ReduceOp r) {
    return r == ReduceOp::max   ? &reduce_16bit<T, ReduceOp::max>
           : r == ReduceOp::min ? &reduce_16bit<T, ReduceOp::min>
                                : &reduce_16bit<T, ReduceOp::sum>;
  }

  int thread_level_ = MPI_THREAD_SINGLE;
  MPI_Datatype half_ = MPI_DATATYPE_NULL;
  std::array<MPI_Datatype, kTypes.size()> types_{};
  std::array<std::array<MPI_Op, kReductions.size()>, kTypes.size()> ops_{};
};

// One operation translated to MPI arguments.
struct Call {
  const void* send = nullptr;
  void* recv = nullptr;
  int count = 0;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  bool scatter_in_place = false;  // reduce_scatter in place: move block 0 to block `rank` when done
};

// "all_reduce(f32, count 16, sum)" from what the watchdog was told (split is not an Op).
inline std::string describe(std::uint64_t what, std::uint64_t count) {
  const int root = static_cast<int>(static_cast<std::uint32_t>(what >> 32));
  if ((what & 0xFF) == kSplit) return concat("split(color ", root, ", key ", static_cast<std::int64_t>(count), ")");
  Op op;
  op.kind = static_cast<Collective>(what & 0xFF);
  op.type = static_cast<DType>((what >> 8) & 0xFF);
  op.reduce = static_cast<ReduceOp>((what >> 16) & 0xFF);
  op.root = root;
  op.count = count;
  return op.describe();
}

inline std::uint64_t pack(const Op& op) {
  return static_cast<std::uint64_t>(op.kind) | static_cast<std::uint64_t>(op.type) << 8 |
         static_cast<std::uint64_t>(op.reduce) << 16 |
         static_cast<std::uint64_t>(static_cast<std::uint32_t>(op.root)) << 32;
}

// Everything an MpiComm is; shared with its Requests, so that a request outlives a
// moved or destroyed communicator object safely.
class State {
 public:
  // Takes `comm` (collective: it opens the arrival board).
  State(MPI_Comm comm, GroupInfo group, MpiOptions options, std::shared_ptr<const Types> types, int world_rank)
      : group_(std::move(group)), options_(options), types_(std::move(types)), world_rank_(world_rank) {
    channel_.set_timeout(options_.timeout);
    channel_.adopt(comm, group_.describe(), kStalled);
    watchdog_ = std::thread([this] { watch(); });
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  ~State() {
    {
      std::lock_guard lock(watchdog_mutex_);
      watchdog_stop_ = true;
    }
    watchdog_wake_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (!usable()) return;  // too late to free anything
    // Freeing the window is collective, and these operations may never finish: then leave it.
    const bool drained = abandoned_.empty() || abandoned_.drain(Clock::now() + kGrace);
    if (!drained) abandoned_.leak(broken_);
    channel_.close(drained);
  }

  MPI_Comm comm() const { return channel_.comm(); }
  int rank() const { return channel_.rank(); }
  int size() const { return channel_.size(); }
  int world_rank() const { return world_rank_; }
  const GroupInfo& group() const { return group_; }
  const MpiOptions& options() const { return options_; }
  const Types& types() const { return *types_; }
  const std::shared_ptr<const Types>& shared_types() const { return types_; }

  // "all_reduce(f32, count 16, sum) on group 'world' (world ranks 0, 1)"
  std::string context(const Op& op) const { return concat(op.describe(), " on ", group_.describe()); }
  // The same, written only when an error message is built (keeps string code off the hot path).
  struct Context {
    const State* state;
    const Op* op;
    friend std::ostream& operator<<(std::ostream& os, const Context& c) { return os << c.state->context(*c.op); }
  };
  Context where(const Op& op) const { return {this, &op}; }

  void check_usable() const {
    if (!broken_.empty()) [[unlikely]]
      LLMPAR_FAIL(group_.describe(), " is broken and runs no more operations, since an earlier one failed: ", broken_);
  }

  // Counts the operation as entered (see the design note) and returns its number in
  // its counter: the collective's number on this communicator, or the send's (recv's)
  // number to (from) its peer. split() counts as a collective.
  std::uint64_t enter(const Op& op) { return channel_.board().enter(op); }

  // The blocking part of an operation, watched by the watchdog (RAII).
  class Watched {
   public:
    Watched(State& s, std::uint64_t what, std::uint64_t count, std::uint64_t number) : s_(s) {
      s.what_.store(what, std::memory_order_relaxed);
      s.count_.store(count, std::memory_order_relaxed);
      s.number_.store(number, std::memory_order_relaxed);
      s.active_.store(++s.started_, std::memory_order_release);
    }
    Watched(const Watched&) = delete;
    Watched& operator=(const Watched&) = delete;
    ~Watched() { s_.active_.store(0, std::memory_order_release); }

   private:
    State& s_;
  };

  // Verify mode: every rank issues the same collective, the same way (MPI does not
  // match a blocking collective with a non-blocking one), or every rank throws the
  // same error.
  void verify(const Op& op, bool async, std::uint64_t number) {
    if (op.kind == Collective::send || op.kind == Collective::recv) return;
    const auto f = op.fingerprint();
    const std::array<std::int64_t, kVerifyFields.size()> row{f[0], f[1], f[2], f[3], f[4], async ? 1 : 0};
    const auto outcome = channel_.verify(op, group_, row, row.size(), 0, number, Clock::time_point::max());
    if (outcome.kind == ControlOutcome::mismatch)
      LLMPAR_FAIL(mismatch_message(name_of(op.kind), group_, outcome.rows, row.size(), kVerifyFields));
    if (outcome.kind == ControlOutcome::broken) LLMPAR_FAIL(outcome.message);
  }

  // Checks `op` against MPI's limits and its buffers against each other, and maps it to
  // MPI's arguments (in place included). For an out-of-place broadcast, copies the
  // root's data into its receive buffer.
  Call plan(const Op& op) const {
    if (op.count > static_cast<std::size_t>(INT_MAX)) [[unlikely]]
      LLMPAR_FAIL(where(op), ": count ", op.count, " is more than the ", INT_MAX,
                  " elements one MPI call can take (MPI counts are int",
                  op.kind == Collective::reduce_scatter || op.kind == Collective::all_gather ||
                          op.kind == Collective::all_to_all
                      ? ", per rank's block"
                      : "",
                  "); split the buffer into calls of at most ", INT_MAX, " elements");
    Call c;
    c.send = op.send;
    c.recv = op.recv;
    c.count = static_cast<int>(op.count);
    c.type = types_->datatype(op.type);
    if (has_reduction(op.kind)) c.op = types_->op(op.type, op.reduce);
    // Where both buffers are in use and not in place, they must not overlap.
    const std::size_t block = op.count * size_of(op.type);
    const auto send = reinterpret_cast<std::uintptr_t>(op.send);
    const auto recv = reinterpret_cast<std::uintptr_t>(op.recv);
    const std::size_t all = block * static_cast<std::size_t>(size()), mine = block * static_cast<std::size_t>(rank());
    std::size_t send_bytes = 0, recv_bytes = 0;
    const char* rule = "";
    switch (op.kind) {
      case Collective::all_reduce:
      case Collective::all_to_all:
        if (send == recv) {
          c.send = MPI_IN_PLACE;
        } else {
          send_bytes = recv_bytes = op.kind == Collective::all_reduce ? block : all;
          rule = "recv == send";
        }
        break;
      case Collective::reduce_scatter:
        if (recv == send + mine) {  // NCCL's in place; MPI's leaves the result in block 0
          c.send = MPI_IN_PLACE;
          c.recv = const_cast<void*>(op.send);
          c.scatter_in_place = true;
        } else {
          send_bytes = all;
          recv_bytes = block;
          rule = "recv == send + rank * count";
        }
        break;
      case Collective::all_gather:
        if (send == recv + mine) {  // NCCL's in place is MPI's
          c.send = MPI_IN_PLACE;
        } else {
          send_bytes = block;
          recv_bytes = all;
          rule = "send == recv + rank * count";
        }
        break;
      case Collective::broadcast:
      case Collective::reduce:
        if (rank() != op.root) break;
        if (send == recv) {
          if (op.kind == Collective::reduce) c.send = MPI_IN_PLACE;
        } else {
          send_bytes = recv_bytes = block;
          rule = "recv == send at the root";
        }
        break;
      default:  // send, recv, barrier: one buffer or none
        break;
    }
    if (send_bytes > 0 && recv_bytes > 0 && send < recv + recv_bytes && recv < send + send_bytes) [[unlikely]]
      LLMPAR_FAIL(where(op), " on ", group_.member(rank()),
                  ": the send and recv buffers overlap without being in place (in place is ", rule,
                  "); use separate buffers or the in-place layout");
    if (op.kind == Collective::broadcast && send_bytes > 0) std::memcpy(op.recv, op.send, block);
    return c;
  }

  // Issues `c`: the blocking MPI call, or the non-blocking one into `request`.
  template <bool kBlocking>
  void issue(const Op& op, const Call& c, MPI_Request* request, MPI_Status* status) {
    switch (op.kind) {
      case Collective::all_reduce:
        if constexpr (kBlocking)
          LLMPAR_CHECK_MPI(MPI_Allreduce(c.send, c.recv, c.count, c.type, c.op, comm()), where(op));
        else
          LLMPAR_CHECK_MPI(MPI_Iallreduce(c.send, c.recv, c.count, c.type, c.op, comm(), request), where(op));
        break;
      case Collective::reduce_scatter:
        if constexpr (kBlocking)
          LLMPAR_CHECK_MPI(MPI_Reduce_scatter_block(c.send, c.recv, c.count, c.type, c.op, comm()), where(op));
        else
          LLMPAR_CHECK_MPI(MPI_Ireduce_scatter_block(c.send, c.recv, c.count, c.type, c.op, comm(), request),
                           where(op));
        break;
      case Collective::all_gather:
        if constexpr (kBlocking)
          LLMPAR_CHECK_MPI(MPI_Allgather(c.send, c.count, c.type, c.recv, c.count, c.type, comm()), where(op));
        else
          LLMPAR_CHECK_MPI(MPI_Iallgather(c.send, c.count, c.type, c.recv, c.count, c.type, comm(), request),
                           where(op));
        break;
      case Collective::broadcast:
        if constexpr (kBlocking)
          LLMPAR_CHECK_MPI(MPI_Bcast(c.recv, c.count, c.type, op.root, comm()), where(op));
        else
          LLMPAR_CHECK_MPI(MPI_Ibcast(c.recv, c.count, c.type, op.root, comm(), request), where(op));
        break;
      case Collective::reduce:
        if constexpr (kBlocking)
          LLMPAR_CHECK_MPI(MPI_Reduce(c.send, c.recv, c.count, c.type, c.op, op.root, comm()), where(op));
        else
          LLMPAR_CHECK_MPI(MPI_Ireduce(c.send, c.recv, c.count, c.type, c.op, op.root, comm(), request), where(op));
        break;
      case Collective::all_to_all:
        if constexpr (kBlocking)
          LLMPAR_CHECK_MPI(MPI_Alltoall(c.send, c.count, c.type, c.recv, c.count, c.type, comm()), where(op));
        else
          LLMPAR_CHECK_MPI(MPI_Ialltoall(c.send, c.count, c.type, c.recv, c.count, c.type, comm(), request), where(op));
        break;
      case Collective::send:
        if constexpr (kBlocking)
          LLMPAR_CHECK_MPI(MPI_Send(c.send, c.count, c.type, op.root, kTag, comm()), where(op));
        else
          LLMPAR_CHECK_MPI(MPI_Isend(c.send, c.count, c.type, op.root, kTag, comm(), request), where(op));
        break;
      case Collective::recv:
        if constexpr (kBlocking)
          LLMPAR_CHECK_MPI(MPI_Recv(c.recv, c.count, c.type, op.root, kTag, comm(), status), where(op));
        else
          LLMPAR_CHECK_MPI(MPI_Irecv(c.recv, c.count, c.type, op.root, kTag, comm(), request), where(op));
        break;
      case Collective::barrier:
        if constexpr (kBlocking)
          LLMPAR_CHECK_MPI(MPI_Barrier(comm()), where(op));
        else
          LLMPAR_CHECK_MPI(MPI_Ibarrier(comm(), request), where(op));
        break;
    }
  }

  // What remains once MPI is done: the in-place reduce_scatter's move, avg's division,
  // and a recv's check of the count that arrived.
  void complete(const Op& op, const Call& c, const MPI_Status& status) const {
    if (c.scatter_in_place && rank() != 0 && op.count > 0) std::memmove(op.recv, op.send, op.count * size_of(op.type));
    if (op.reduce == ReduceOp::avg && has_reduction(op.kind) && (op.kind != Collective::reduce || rank() == op.root))
      finish_avg(op);
    if (op.kind == Collective::recv) {
      int arrived = 0;
      LLMPAR_CHECK_MPI(MPI_Get_count(&status, c.type, &arrived), where(op));
      LLMPAR_CHECK(arrived == c.count, where(op), " on ", group_.member(rank()), ": the matching send from ",
                   group_.member(op.root), " carried ", arrived, " elements, not ", c.count,
                   "; a send and its recv must have the same count");
    }
  }

  // Why the communicator is broken ("" while it is not), and the requests it abandoned.
  void break_with(std::string reason, MPI_Request request) {
    if (broken_.empty()) broken_ = std::move(reason);
    if (request != MPI_REQUEST_NULL) abandoned_.add(request);
  }
  const std::string& broken() const { return broken_; }

  // Which ranks have not entered the operation numbered `number` of kind `kind` (peer:
  // the other side of a send/recv), from their arrival counters.
  std::string arrivals(Collective kind, int peer, std::uint64_t number) {
    const bool p2p = kind == Collective::send || kind == Collective::recv;
    return channel_.board().report(group_, kind, peer, number, p2p ? std::string_view() : kStalled);
  }

 private:
  // ---- the watchdog of blocking calls
  void watch() {
    const auto period = std::clamp(options_.timeout / 10, std::chrono::milliseconds(1), std::chrono::milliseconds(200));
    std::uint64_t seen = 0;
    Clock::time_point since;
    std::unique_lock lock(watchdog_mutex_);
    while (!watchdog_wake_.wait_for(lock, period, [&] { return watchdog_stop_; })) {
      const std::uint64_t active = active_.load(std::memory_order_acquire);
      if (active == 0) {
        seen = 0;
      } else if (active != seen) {
        seen = active;
        since = Clock::now();
      } else if (Clock::now() - since >= options_.timeout) {
        lock.unlock();
        fire(active);
        lock.lock();
        seen = 0;
      }
    }
  }

  // A blocking call has not returned within the timeout: say who is missing, end the job.
  void fire(std::uint64_t active) {
    const std::uint64_t what = what_.load(std::memory_order_relaxed);
    const std::uint64_t count = count_.load(std::memory_order_relaxed);
    const std::uint64_t number = number_.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (active_.load(std::memory_order_relaxed) != active) return;  // it returned meanwhile
    const Collective kind = (what & 0xFF) == kSplit ? Collective::barrier : static_cast<Collective>(what & 0xFF);
    const std::string report =
        types_->thread_level() == MPI_THREAD_MULTIPLE
            ? arrivals(kind, static_cast<int>(static_cast<std::uint32_t>(what >> 32)), number)
            : concat("which ranks did not arrive is unknown: MPI provides ", thread_level_name(types_->thread_level()),
                     ", and reading the others' counters while this rank is blocked in MPI needs "
                     "MPI_THREAD_MULTIPLE");
    std::fprintf(stderr,
                 "llmpar: %s. A blocking MPI call cannot be cancelled, so the job is aborted (the _async operations "
                 "throw llmpar::Error instead)\n",
                 timeout_message(describe(what, count), group_, rank(), options_.timeout, "", report).c_str());
    std::fflush(stderr);
    MPI_Abort(channel_.comm(), kLostRankExit);
  }

  void finish_avg(const Op& op) const {
    visit_dtype(op.type, [&](auto element) {
      using T = decltype(element);
      using A = typename Accumulator<T>::type;
      T* data = static_cast<T*>(op.recv);
      for (std::size_t i = 0; i < op.count; ++i)
        data[i] = static_cast<T>(finish<A>(ReduceOp::avg, static_cast<A>(data[i]), size()));
    });
  }

  Channel channel_;  // the communicator and its arrival board
  GroupInfo group_;
  MpiOptions options_;
  std::shared_ptr<const Types> types_;
  int world_rank_ = 0;

  std::string broken_;
  AbandonedOps abandoned_;

  // The blocking call in progress: written by the caller's thread, read by the watchdog.
  std::uint64_t started_ = 0;
  std::atomic<std::uint64_t> active_{0};  // started_ of the call in progress, 0 when none
  std::atomic<std::uint64_t> what_{0};    // pack(op), or kSplit
  std::atomic<std::uint64_t> count_{0};
  std::atomic<std::uint64_t> number_{0};  // what enter() returned
  std::mutex watchdog_mutex_;
  std::condition_variable watchdog_wake_;
  bool watchdog_stop_ = false;
  std::thread watchdog_;
};

}  // namespace detail::mpi

// One rank's handle on an MPI communicator (see the design note at the top). Movable,
// not copyable; its Requests share its state, so they may outlive the object.
class MpiComm : public Collectives<MpiComm> {
 public:
  class Request;

  // A duplicate of MPI_COMM_WORLD, named "world". Collective; MPI must be initialised
  // (MpiEnvironment).
  static MpiComm world(MpiOptions options = {});

  MpiComm(MpiComm&&) noexcept = default;
  MpiComm& operator=(MpiComm&&) noexcept = default;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;
  ~MpiComm() = default;

  int rank() const { return state().rank(); }
  int size() const { return state().size(); }
  const GroupInfo& group() const { return state().group(); }
  const MpiOptions& options() const { return state().options(); }
  MPI_Comm native() const { return state().comm(); }

  // Runs `op` with MPI's blocking call (see the design note).
  void run(const Op& op);

  // Issues `op` with MPI's non-blocking call; Request::wait() completes it.
  Request start(const Op& op);

  // Issues every send and receive of `ops` (MPI_Isend, MPI_Irecv), after checking them
  // all; the one Request completes when every one has (see the design note).
  Request start_batch(std::span<const Op> ops);

  // Members with the same color form one new communicator, ordered by key (then by
  // rank here); its GroupInfo holds `name` and the members' world ranks. Collective.
  MpiComm split(int color, int key, std::string name);

 private:
  explicit MpiComm(std::shared_ptr<detail::mpi::State> state) : state_(std::move(state)) {}

  detail::mpi::State& state() const {
    LLMPAR_CHECK(state_ != nullptr, "this MpiComm was moved from; use the communicator it was moved to");
    return *state_;
  }

  std::shared_ptr<detail::mpi::State> state_;
};

// An operation in flight, or a batch of them. wait() completes it (or throws on
// timeout), test() says whether it is done without waiting; the destructor waits (and
// reports a failure on stderr, since it cannot throw).
class MpiComm::Request {
 public:
  Request() = default;
  Request(Request&& other) noexcept { take(other); }
  Request& operator=(Request&& other) noexcept {
    if (this != &other) {
      settle();
      take(other);
    }
    return *this;
  }
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() { settle(); }

  void wait();

  bool test();

 private:
  friend class MpiComm;

  // One operation: what MPI was asked, and what remains to do once it has completed.
  struct Part {
    Op op;
    detail::mpi::Call call;
    std::uint64_t number = 0;                // its number in its arrival counter
    MPI_Request request = MPI_REQUEST_NULL;  // null once completed (or never issued)
  };

  // start() keeps its operation inline; start_batch() keeps the batch on the heap.
  std::span<Part> parts() { return batch_ ? std::span<Part>(many_) : std::span<Part>(&one_, 1); }

  // One MPI_Test of each operation still in flight, and the finishing steps of each that
  // completed. True once all have; then the first error, if any, is thrown (an operation
  // that failed does not stop the others from being completed).
  bool poll();

  // Gives up on the operations still in flight: the communicator is broken (`reason`)
  // and they are recorded as abandoned.
  void abandon(const std::string& reason);

  void take(Request& other);

  void settle() noexcept;

  std::shared_ptr<detail::mpi::State> state_;
  Part one_;
  std::vector<Part> many_;
  bool batch_ = false;
  std::exception_ptr error_;  // the first failure of a batch, thrown once all are done
  bool pending_ = false;
};

static_assert(Communicator<MpiComm>);

}  // namespace llmpar::comm

// The bodies: compiled here (header-only), or once in a program that defines
// LLMPAR_COMPILED and links the compiled part of llmpar (config.hpp).
#if !defined(LLMPAR_COMPILED)
#include "llmpar/comm/mpi_comm-inl.hpp"
#endif
