// llmpar/comm/detail/mpi.hpp — the MPI machinery that MpiComm and NcclComm share.
//
// Both engines keep an MPI communicator of their own (MpiComm moves its data over it,
// NcclComm uses it as its control channel), and both must name the ranks that did not
// arrive when an operation times out. What they have in common lives here, once:
//
// * Errors. Every communicator and window returns its errors (MPI_ERRORS_RETURN), and
//   LLMPAR_CHECK_MPI turns a code into llmpar::Error with MPI's text, the call and the
//   world rank.
// * The arrival board. Every rank keeps, in an MPI window, how many collectives it has
//   entered on the communicator and how many sends and receives it has posted to and
//   from each peer. In a unified window (shared memory, RDMA) a rank updates its own
//   counters with a plain atomic store, so counting costs the blocking path nothing;
//   otherwise with an MPI_Accumulate to itself. A rank that times out reads the
//   others' counters with passive-target MPI_Rget_accumulate (no cooperation from them
//   needed), polled for a grace period; ranks whose counter is behind did not arrive,
//   ranks that do not answer are reported as not responding. A communicator on one node
//   gets its window from MPI_Win_allocate_shared, others from MPI_Win_allocate: Open MPI
//   4's osc/rdma gives the windows of disjoint groups from one split the same shared
//   segment on a node (open-mpi/ompi#9492), so there, a split group spanning nodes
//   keeps no counters and its timeouts say that they cannot name the missing ranks.
// * Abandoned operations. A non-blocking operation given up at a deadline may never
//   complete, and MPI may still write the memory it was given: that memory stays
//   allocated, and the operation is recorded process-wide (MPI's own state is), so that
//   MpiEnvironment aborts the job at exit instead of hanging in MPI_Finalize.
// * The channel: the communicator, its arrival board, and exchanges that are
//   non-blocking MPI calls polled against a deadline, among them verify mode's check
//   (every rank's fingerprint compared in one all-reduce of the values and their
//   negations, MAX: each field's greatest and least value at once; on a difference the
//   ranks gather every fingerprint, so that each throws the same error).
#pragma once

#if !__has_include(<mpi.h>)
#error "llmpar's MPI communicators need mpi.h: install MPI (Debian: libopenmpi-dev) and build with LLMPAR_MPI=ON"
#endif

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "llmpar/comm/communicator.hpp"
#include "llmpar/comm/detail/verify.hpp"
#include "llmpar/comm/types.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::comm::detail::mpi {

// The world rank for error messages, or -1 outside MPI_Init .. MPI_Finalize.
inline int world_rank() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return -1;
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

inline std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return concat("MPI error code ", code);
  return std::string(text, static_cast<std::size_t>(length));
}

template <class... Args>
[[noreturn]] void throw_error(const char* file, int line, const char* call, int code, Args&&... context) {
  const int rank = world_rank();
  const std::string who = rank >= 0 ? concat("world rank ", rank) : std::string("a process outside MPI");
  if constexpr (sizeof...(Args) == 0) {
    llmpar::detail::throw_error(file, line, nullptr, "MPI call failed on ", who, ": ", call, " returned '",
                                error_string(code), "'");
  } else {
    llmpar::detail::throw_error(file, line, nullptr, concat(std::forward<Args>(context)...), ": MPI call failed on ",
                                who, ": ", call, " returned '", error_string(code), "'");
  }
}

}  // namespace llmpar::comm::detail::mpi

// LLMPAR_CHECK_MPI(call, context parts...): throws llmpar::Error when `call` does not
// return MPI_SUCCESS, with MPI's description of the code, the call and the world rank.
// The context parts are evaluated only on failure.
#define LLMPAR_CHECK_MPI(call, ...)                                                          \
  do {                                                                                       \
    const int llmpar_mpi_code_ = (call);                                                     \
    if (llmpar_mpi_code_ != MPI_SUCCESS) [[unlikely]]                                        \
      ::llmpar::comm::detail::mpi::throw_error(__FILE__, __LINE__, #call,                    \
                                               llmpar_mpi_code_ __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)

namespace llmpar::comm::detail::mpi {

using Clock = std::chrono::steady_clock;

// How long a rank that timed out waits for the others' arrival counters, and a
// communicator being released for the operations it abandoned.
inline constexpr std::chrono::milliseconds kGrace{1000};

// Whether MPI can be called (between MPI_Init and MPI_Finalize).
inline bool usable() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

// Throws, for `what`, unless MPI can be called.
inline void require_mpi(std::string_view what) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  LLMPAR_CHECK(usable(), what, ": MPI is ", finalized ? "already finalized" : "not initialised",
               "; create a comm::MpiEnvironment first (it calls MPI_Init_thread) and keep it alive while "
               "communicators exist");
}

// MPI operations that timed out and could not be completed later: they keep
// MPI_Finalize from returning, so MpiEnvironment aborts the job instead. Process-wide
// because MPI's own state is.
struct Abandoned {
  std::mutex mutex;
  int operations = 0;
  std::string reason;
};

inline Abandoned& abandoned() {
  static Abandoned record;
  return record;
}

// Spin, then yield, then sleep a little longer each time (up to 1 ms): a poll loop that
// answers quickly when the result comes soon and costs little when it does not.
class Backoff {
 public:
  void pause() {
    if (step_ < 64) {
      ++step_;
    } else if (step_ < 256) {
      ++step_;
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(sleep_);
      sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
    }
  }

 private:
  int step_ = 0;
  std::chrono::microseconds sleep_{20};
};

// Non-blocking MPI operations given up at a deadline, with the memory they may still
// use. A later drain() completes those that finished meanwhile (a late rank joined).
class AbandonedOps {
 public:
  void add(MPI_Request request, std::shared_ptr<void> storage = nullptr) {
    ops_.push_back({request, std::move(storage)});
  }
  bool empty() const { return ops_.empty(); }

  // Tests them until `deadline`; true when all completed.
  bool drain(Clock::time_point deadline) {
    Backoff backoff;
    while (true) {
      std::erase_if(ops_, [](Entry& e) {
        int flag = 0;
        return MPI_Test(&e.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag;
      });
      if (ops_.empty()) return true;
      if (Clock::now() >= deadline) return false;
      backoff.pause();
    }
  }

  // Gives up on the rest for good: their memory stays allocated, and they are recorded
  // where MpiEnvironment looks.
  void leak(const std::string& reason) {
    if (ops_.empty()) return;
    {
      auto& record = abandoned();
      std::lock_guard lock(record.mutex);
      record.operations += static_cast<int>(ops_.size());
      if (record.reason.empty()) record.reason = reason;
    }
    for (auto& e : ops_) static_cast<void>(new std::shared_ptr<void>(std::move(e.storage)));  // MPI may still use it
    ops_.clear();
  }

 private:
  struct Entry {
    MPI_Request request;
    std::shared_ptr<void> storage;
  };
  std::vector<Entry> ops_;
};

// ---- who has entered what: the arrival board -----------------------------------------

// "<what> on <group> timed out after N ms on <rank><where>, <who did not arrive>".
inline std::string timeout_message(std::string_view what, const GroupInfo& group, int rank,
                                   std::chrono::milliseconds timeout, std::string_view where, std::string_view report) {
  return concat(what, " on ", group.describe(), " timed out after ", timeout.count(), " ms on ", group.member(rank),
                where, ", ", report);
}

// Which ranks have not entered operation #number of `kind` on `rank` (a send or recv:
// with `peer`), from the counters read from `ranks` (nullopt: no answer within kGrace).
// `unknown` says why no counters could be read at all; `hint` ends the sentence when
// everyone has arrived and the operation still did not complete.
inline std::string arrival_report(const GroupInfo& group, int rank, Collective kind, int peer,
                                  std::span<const int> ranks, std::span<const std::optional<std::uint64_t>> counts,
                                  std::uint64_t number, std::string_view unknown, std::string_view hint) {
  if (!unknown.empty()) return concat("which ranks did not arrive is unknown: ", unknown);
  const bool sending = kind == Collective::send, receiving = kind == Collective::recv;
  std::string missing, numbers, silent;
  int n_missing = 0, n_silent = 0;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const std::string who = group.member(ranks[i]);
    if (!counts[i]) {
      silent += concat(n_silent++ ? ", " : "", who);
    } else if (*counts[i] < number) {
      missing += concat(n_missing ? ", " : "", who);
      numbers +=
          concat(n_missing++ ? ", " : "", who, " has ", sending || receiving ? "posted " : "issued ", *counts[i]);
    }
  }
  std::string report;
  if (n_missing > 0) {
    if (sending || receiving) {
      report = concat("waiting for ", missing, ", which has not posted the matching ", sending ? "recv" : "send",
                      " (this is ", sending ? "send" : "recv", " #", number, sending ? " to " : " from ", missing, "; ",
                      numbers, sending ? " recvs from " : " sends to ", group.member(rank), ")");
    } else {
      report = concat("waiting for ", missing, ", which did not arrive (this is collective #", number,
                      " on this communicator; ", numbers, ")");
    }
  }
  if (n_silent > 0)
    report += concat(report.empty() ? "" : "; ", silent, n_silent > 1 ? " do" : " does",
                     " not answer the arrival check within ", kGrace.count(), " ms");
  if (report.empty())
    report = sending || receiving ? concat(group.member(peer), " has posted the matching ", sending ? "recv" : "send",
                                           "; the transfer did not complete", hint)
                                  : concat("every rank has arrived, yet the collective did not complete", hint);
  return report;
}

// Each rank's counters (see the design note): [0] collectives entered, [1 + p] sends
// posted to rank p, [1 + size + p] receives posted from rank p. A rank writes only its
// own counters; reads that get no answer within kGrace are abandoned, and so is the
// window then (freeing it is collective, and the job is failing anyway).
class ArrivalBoard {
 public:
  static constexpr std::size_t kCollectives = 0;

  ArrivalBoard() = default;
  ArrivalBoard(const ArrivalBoard&) = delete;
  ArrivalBoard& operator=(const ArrivalBoard&) = delete;

  // Collective over `comm` (whose errors return). If any rank cannot make the window,
  // the board is off on every rank and unknown() says why.
  void open(MPI_Comm comm, int rank, int size) {
    rank_ = rank;
    size_ = size;
    const std::size_t n = 1 + 2 * static_cast<std::size_t>(size);
    local_.assign(n, 0);
    counters_ = local_.data();
    unknown_.clear();
    // How many members share a node: on one node the window is a shared-memory one.
    MPI_Comm node = MPI_COMM_NULL;
    int on_node = 1;
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
      MPI_Comm_size(node, &on_node);
      MPI_Comm_free(&node);
    }
    std::array<int, 2> extremes{on_node, -on_node};  // the most and (negated) the fewest members on a node
    if (MPI_Allreduce(MPI_IN_PLACE, extremes.data(), 2, MPI_INT, MPI_MAX, comm) != MPI_SUCCESS) {
      unknown_ = "the members could not agree on where they run";
      return;
    }
    const bool one_node = -extremes[1] == size;
#if defined(OPEN_MPI) && OMPI_MAJOR_VERSION < 5
    // Open MPI 4's osc/rdma names a window's node-shared segment after the communicator's
    // id, which disjoint groups from one split share: their windows would share memory
    // (open-mpi/ompi#9492, fixed in Open MPI 5). Only a window over every process is safe.
    int same = MPI_UNEQUAL;
    MPI_Comm_compare(comm, MPI_COMM_WORLD, &same);
    if (!one_node && extremes[0] > 1 && same != MPI_IDENT && same != MPI_CONGRUENT) {
      unknown_ =
          "Open MPI 4 cannot give a group split across nodes its own one-sided window (open-mpi/ompi#9492), so this "
          "communicator keeps no arrival counters";
      return;
    }
#endif
    void* base = nullptr;
    MPI_Win window = MPI_WIN_NULL;
    MPI_Info info = MPI_INFO_NULL;
    MPI_Info_create(&info);
    MPI_Info_set(info, "same_size", "true");
    MPI_Info_set(info, "alloc_shared_noncontig", "true");
    // Whole cache lines, so that ranks on one node never write to the same line.
    const auto bytes = static_cast<MPI_Aint>((n * sizeof(std::uint64_t) + 63) / 64 * 64);
    const int code = one_node ? MPI_Win_allocate_shared(bytes, sizeof(std::uint64_t), info, comm, &base, &window)
                              : MPI_Win_allocate(bytes, sizeof(std::uint64_t), info, comm, &base, &window);
    MPI_Info_free(&info);
    int ok = code == MPI_SUCCESS;
    bool unified = false;
    if (ok) {
      std::fill_n(static_cast<std::uint64_t*>(base), n, std::uint64_t{0});
      int* model = nullptr;
      int found = 0;
      ok = MPI_Win_set_errhandler(window, MPI_ERRORS_RETURN) == MPI_SUCCESS &&
           MPI_Win_get_attr(window, MPI_WIN_MODEL, &model, &found) == MPI_SUCCESS &&
           MPI_Win_lock_all(MPI_MODE_NOCHECK, window) == MPI_SUCCESS;
      unified = ok && found && *model == MPI_WIN_UNIFIED;
    }
    int all_ok = 0;
    if (MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm) != MPI_SUCCESS) all_ok = 0;
    if (all_ok) {
      window_ = window;
      unified_ = unified;
      if (unified_) counters_ = static_cast<std::uint64_t*>(base);
    } else {
      // Some rank may hold a window the others lack: it is never freed (freeing is collective).
      unknown_ = code == MPI_SUCCESS ? std::string("this MPI could not set up the one-sided window of counters")
                                     : concat(one_node ? "MPI_Win_allocate_shared" : "MPI_Win_allocate",
                                              " failed: ", error_string(code));
    }
  }

  std::size_t send_slot(int peer) const { return 1 + static_cast<std::size_t>(peer); }
  std::size_t recv_slot(int peer) const { return 1 + static_cast<std::size_t>(size_ + peer); }

  // Counts `op` as entered (split() counts as a collective: enter(Op{})) and returns its
  // number in its counter (1, 2, ...): the collective's number on this communicator, or
  // the send's (recv's) number to (from) its peer.
  std::uint64_t enter(const Op& op) {
    const std::size_t slot = op.kind == Collective::send   ? send_slot(op.root)
                             : op.kind == Collective::recv ? recv_slot(op.root)
                                                           : kCollectives;
    std::atomic_ref<std::uint64_t> counter(counters_[slot]);
    const std::uint64_t value = counter.load(std::memory_order_relaxed) + 1;
    counter.store(value, std::memory_order_release);
    if (window_ != MPI_WIN_NULL && !unified_ && unknown_.empty()) {
      // A separate-model window: publish through MPI (a local, completed operation).
      if (MPI_Accumulate(&counters_[slot], 1, MPI_UINT64_T, rank_, static_cast<MPI_Aint>(slot), 1, MPI_UINT64_T,
                         MPI_REPLACE, window_) != MPI_SUCCESS ||
          MPI_Win_flush(rank_, window_) != MPI_SUCCESS)
        unknown_ = "publishing this rank's arrival counter failed";
    }
    return value;
  }

  // Why the counters cannot be read ("" when they can).
  const std::string& unknown() const { return unknown_; }

  // Counter `slot` of each of `ranks`; nullopt for those that do not answer within kGrace.
  std::vector<std::optional<std::uint64_t>> read(std::size_t slot, std::span<const int> ranks) {
    std::vector<std::optional<std::uint64_t>> out(ranks.size());
    if (!unknown_.empty() || ranks.empty()) return out;
    // On the heap: reads that do not finish are abandoned, and MPI may still write them.
    auto values = std::make_unique<std::vector<std::uint64_t>>(ranks.size());
    std::vector<MPI_Request> requests(ranks.size(), MPI_REQUEST_NULL);
    std::vector<bool> done(ranks.size(), false);
    for (std::size_t i = 0; i < ranks.size(); ++i)
      done[i] = MPI_Rget_accumulate(nullptr, 0, MPI_UINT64_T, &(*values)[i], 1, MPI_UINT64_T, ranks[i],
                                    static_cast<MPI_Aint>(slot), 1, MPI_UINT64_T, MPI_NO_OP, window_,
                                    &requests[i]) != MPI_SUCCESS;
    const auto deadline = Clock::now() + kGrace;
    Backoff backoff;
    for (bool pending = true; pending;) {
      pending = false;
      for (std::size_t i = 0; i < ranks.size(); ++i) {
        if (done[i]) continue;
        int flag = 0;
        if (MPI_Test(&requests[i], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
          done[i] = true;
          if (flag) out[i] = (*values)[i];
        } else {
          pending = true;
        }
      }
      if (pending && Clock::now() >= deadline) {
        keep_window_ = true;
        unknown_ = "an earlier arrival check never finished";
        std::shared_ptr<void> shared(std::move(values));
        for (std::size_t i = 0; i < ranks.size(); ++i)
          if (!done[i]) abandoned_.add(requests[i], shared);
        break;
      }
      if (pending) backoff.pause();
    }
    return out;
  }

  // Who operation #number of `kind` (a send or recv: with `peer`) on this rank waits
  // for, read from the others' counters (see arrival_report).
  std::string report(const GroupInfo& group, Collective kind, int peer, std::uint64_t number, std::string_view hint) {
    const bool sending = kind == Collective::send, receiving = kind == Collective::recv;
    std::vector<int> ranks;
    if (sending || receiving) {
      ranks.push_back(peer);
    } else {
      for (int r = 0; r < size_; ++r)
        if (r != rank_) ranks.push_back(r);
    }
    // The peer's receives from this rank, its sends to this rank, or its collectives.
    const std::size_t slot = sending ? recv_slot(rank_) : receiving ? send_slot(rank_) : kCollectives;
    const std::string unknown = unknown_;  // a read that gets no answer sets it for the next time
    const auto counts = read(slot, ranks);
    return arrival_report(group, rank_, kind, peer, ranks, counts, number, unknown, hint);
  }

  // Unlocks and frees the window, collectively, when `together` and no read was
  // abandoned; otherwise leaves it to the end of the process.
  void close(bool together) noexcept {
    if (window_ != MPI_WIN_NULL && together && !keep_window_ && abandoned_.empty()) {
      MPI_Win_unlock_all(window_);
      MPI_Win_free(&window_);
    } else if (!abandoned_.empty() && !abandoned_.drain(Clock::now() + kGrace)) {
      try {
        abandoned_.leak("an arrival check that got no answer");
      } catch (...) {
      }
    }
    window_ = MPI_WIN_NULL;
    counters_ = local_.data();
  }

 private:
  MPI_Win window_ = MPI_WIN_NULL;
  bool unified_ = false;      // counters_ points into the window
  bool keep_window_ = false;  // a read never finished: never free the window
  std::uint64_t* counters_ = nullptr;
  std::vector<std::uint64_t> local_;
  int rank_ = 0, size_ = 1;
  std::string unknown_ = "the counters were never set up";
  AbandonedOps abandoned_;
};

// ---- the channel ------------------------------------------------------------------------

// What an exchange over the channel found: agreement; a difference every rank saw alike
// (`rows` holds every rank's row; the communicator stays usable); or a failure after
// which the ranks are out of step (the communicator must be given up).
struct ControlOutcome {
  enum Kind { ok, mismatch, broken } kind = ok;
  std::string message;
  std::vector<std::int64_t> rows;
};

// One rank's end of an MPI communicator that an engine owns (see the design note). Every
// exchange is a non-blocking MPI call polled against a deadline; one that passes its
// deadline is abandoned (see AbandonedOps) and the caller fails.
class Channel {
 public:
  static constexpr int kFingerprintTag = 7;

  Channel() = default;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
  ~Channel() { close(false); }

  // Duplicates `comm` (collective over it) and adopts the duplicate. Throws if not every
  // rank arrives in time. `hint` ends a timeout's report when every rank has arrived.
  void open(MPI_Comm comm, std::chrono::milliseconds timeout, const std::string& what, std::string_view hint) {
    timeout_ = timeout;
    require_mpi(what);
    LLMPAR_CHECK(comm != MPI_COMM_NULL, what, ": the MPI communicator is MPI_COMM_NULL");
    auto storage = std::make_unique<Storage>();
    MPI_Request request = MPI_REQUEST_NULL;
    LLMPAR_CHECK_MPI(MPI_Comm_idup(comm, &storage->comm, &request), what);
    const MPI_Comm* dup = &storage->comm;
    if (!wait(request, Clock::now() + timeout_, storage))
      LLMPAR_FAIL(what, " timed out after ", timeout_.count(),
                  " ms: every rank of the MPI communicator must construct it together, and at least one did not");
    adopt(*dup, what, hint);
  }

  // Takes a new communicator (this rank's own, e.g. from MPI_Comm_split), makes its
  // errors return and opens its arrival board. Collective.
  void adopt(MPI_Comm comm, const std::string& what, std::string_view hint) {
    comm_ = comm;
    hint_ = hint;
    LLMPAR_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), what);
    LLMPAR_CHECK_MPI(MPI_Comm_rank(comm_, &rank_), what);
    LLMPAR_CHECK_MPI(MPI_Comm_size(comm_, &size_), what);
    board_.open(comm_, rank_, size_);
  }

  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }
  MPI_Comm comm() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  ArrivalBoard& board() { return board_; }

  // Every rank's `values` (as many on each), in rank order; nullopt if not every rank
  // arrived by `deadline`.
  std::optional<std::vector<std::int64_t>> all_gather(std::span<const std::int64_t> values, Clock::time_point deadline,
                                                      const char* what) {
    auto storage = std::make_unique<Storage>();
    storage->in.assign(values.begin(), values.end());
    storage->out.resize(values.size() * static_cast<std::size_t>(size_));
    std::vector<std::int64_t>* out = &storage->out;
    MPI_Request request = MPI_REQUEST_NULL;
    LLMPAR_CHECK_MPI(MPI_Iallgather(storage->in.data(), static_cast<int>(values.size()), MPI_INT64_T, out->data(),
                                    static_cast<int>(values.size()), MPI_INT64_T, comm_, &request),
                     what);
    if (!wait(request, deadline, storage)) return std::nullopt;
    return std::move(*out);
  }

  // Broadcasts `data` from `root` into every rank's `data`; false if not every rank
  // arrived by `deadline`.
  bool broadcast(std::span<std::byte> data, int root, Clock::time_point deadline, const char* what) {
    auto storage = std::make_unique<Storage>();
    storage->bytes.assign(data.begin(), data.end());
    const std::vector<std::byte>* bytes = &storage->bytes;
    MPI_Request request = MPI_REQUEST_NULL;
    LLMPAR_CHECK_MPI(MPI_Ibcast(storage->bytes.data(), static_cast<int>(data.size()), MPI_BYTE, root, comm_, &request),
                     what);
    if (!wait(request, deadline, storage)) return false;
    std::copy(bytes->begin(), bytes->end(), data.begin());
    return true;
  }

  // Every rank at once; false if not every rank arrived by `deadline` (or MPI failed).
  bool barrier(Clock::time_point deadline) noexcept {
    try {
      auto storage = std::make_unique<Storage>();
      MPI_Request request = MPI_REQUEST_NULL;
      if (MPI_Ibarrier(comm_, &request) != MPI_SUCCESS) return false;
      return wait(request, deadline, storage);
    } catch (...) {
      return false;
    }
  }

  // Verify mode for a collective (#number on this communicator). `row` starts with
  // `agree` values that must be equal on every rank, then `zero` values that must be 0
  // on every rank; anything after them only informs the message. A mismatch carries
  // every rank's row, for the engine to word (see comm/detail/verify.hpp).
  ControlOutcome verify(const Op& op, const GroupInfo& group, std::span<const std::int64_t> row, std::size_t agree,
                        std::size_t zero, std::uint64_t number, Clock::time_point deadline) {
    const std::size_t n = agree + zero;
    auto storage = std::make_unique<Storage>();
    storage->in.resize(2 * n);
    storage->out.resize(2 * n);
    for (std::size_t i = 0; i < n; ++i) {  // MAX over the values and their negations: greatest and least
      storage->in[i] = row[i];
      storage->in[n + i] = -row[i];
    }
    const std::vector<std::int64_t>* out = &storage->out;
    MPI_Request request = MPI_REQUEST_NULL;
    if (const int code = MPI_Iallreduce(storage->in.data(), storage->out.data(), static_cast<int>(2 * n), MPI_INT64_T,
                                        MPI_MAX, comm_, &request);
        code != MPI_SUCCESS)
      return {ControlOutcome::broken,
              concat(op.describe(), " on ", group.describe(),
                     ": verify mode's MPI_Iallreduce failed: ", error_string(code)),
              {}};
    if (!wait(request, deadline, storage)) return timed_out(op, group, number, " in verify mode's check");
    bool same = true;
    for (std::size_t i = 0; i < n; ++i) {
      const std::int64_t greatest = (*out)[i], least = -(*out)[n + i];
      same = same && greatest == least && (i < agree || greatest == 0);
    }
    if (same) return {};
    auto rows = all_gather(row, deadline, "verify mode's check");
    if (!rows) return timed_out(op, group, number, " in verify mode's check");
    return {ControlOutcome::mismatch, {}, std::move(*rows)};
  }

  // Verify mode for a send: tells the receiver what comes (it checks).
  void post_fingerprint(const Op& op) {
    auto storage = std::make_unique<Storage>();
    storage->in = {static_cast<std::int64_t>(op.type), static_cast<std::int64_t>(op.count)};
    MPI_Request request = MPI_REQUEST_NULL;
    LLMPAR_CHECK_MPI(MPI_Isend(storage->in.data(), 2, MPI_INT64_T, op.root, kFingerprintTag, comm_, &request),
                     op.describe(), ": verify mode's message to ", op.root);
    sends_.push_back({request, std::move(storage)});
  }

  // Verify mode for a recv (#number from its peer): its send's type and count must match.
  ControlOutcome check_fingerprint(const Op& op, const GroupInfo& group, std::uint64_t number,
                                   Clock::time_point deadline) {
    auto storage = std::make_unique<Storage>();
    storage->out.resize(2);
    const std::vector<std::int64_t>* message = &storage->out;
    MPI_Request request = MPI_REQUEST_NULL;
    if (const int code = MPI_Irecv(storage->out.data(), 2, MPI_INT64_T, op.root, kFingerprintTag, comm_, &request);
        code != MPI_SUCCESS)
      return {ControlOutcome::broken,
              concat(op.describe(), " on ", group.describe(), ": verify mode's MPI_Irecv failed: ", error_string(code)),
              {}};
    if (!wait(request, deadline, storage)) return timed_out(op, group, number, " in verify mode's check");
    Op send = op;
    send.kind = Collective::send;
    send.type = static_cast<DType>((*message)[0]);
    send.count = static_cast<std::size_t>((*message)[1]);
    send.root = rank_;
    std::string error = p2p_mismatch_message(send, op.root, op, rank_, group);
    if (error.empty()) return {};
    return {ControlOutcome::broken, std::move(error), {}};
  }

  // A timeout of `op` (#number in its counter), naming who did not arrive.
  ControlOutcome timed_out(const Op& op, const GroupInfo& group, std::uint64_t number, const char* where) {
    return {ControlOutcome::broken,
            timeout_message(op.describe(), group, rank_, timeout_, where, arrivals(op, group, number)),
            {}};
  }

  // Who operation #number (in its counter) waits for, from the others' counters.
  std::string arrivals(const Op& op, const GroupInfo& group, std::uint64_t number) {
    return board_.report(group, op.kind, op.root, number, hint_);
  }

  // Forgets the verify-mode messages that their receivers have taken.
  void prune() {
    std::erase_if(sends_, [](Pending& p) {
      int flag = 0;
      return MPI_Test(&p.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag;
    });
  }

  // Frees the channel; collective when `together` (the board's window is then freed).
  // What never completed stays allocated and is recorded (see AbandonedOps).
  void close(bool together) noexcept {
    if (comm_ == MPI_COMM_NULL && abandoned_.empty()) return;
    if (usable()) {
      try {
        for (auto& p : sends_) abandoned_.add(p.request, std::move(p.storage));
        sends_.clear();
        if (!abandoned_.drain(Clock::now() + kGrace)) abandoned_.leak("an MPI exchange that timed out");
      } catch (...) {
      }
      board_.close(together);
      if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    }
    comm_ = MPI_COMM_NULL;
  }

 private:
  // What a non-blocking call reads and writes, on the heap so that it can outlive an
  // abandoned call.
  struct Storage {
    std::vector<std::int64_t> in, out;
    std::vector<std::byte> bytes;
    MPI_Comm comm = MPI_COMM_NULL;
  };
  struct Pending {
    MPI_Request request;
    std::unique_ptr<Storage> storage;
  };

  // Polls `request` until done (true) or `deadline` (false: it is abandoned with `storage`).
  bool wait(MPI_Request& request, Clock::time_point deadline, std::unique_ptr<Storage>& storage) {
    Backoff backoff;
    while (true) {
      int flag = 0;
      LLMPAR_CHECK_MPI(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), "an exchange over a communicator's MPI channel");
      if (flag) return true;
      if (Clock::now() >= deadline) {
        abandoned_.add(request, std::move(storage));
        return false;
      }
      backoff.pause();
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::chrono::milliseconds timeout_{std::chrono::minutes(5)};
  std::string hint_;
  ArrivalBoard board_;
  std::vector<Pending> sends_;
  AbandonedOps abandoned_;
};

}  // namespace llmpar::comm::detail::mpi
