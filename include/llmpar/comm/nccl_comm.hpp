// llmpar/comm/nccl_comm.hpp — NcclComm: the Communicator engine for CUDA devices, over NCCL.
//
// One NcclComm is one rank of a group of processes, each driving one CUDA device; the
// buffers of its Ops are device pointers. Why it is built this way:
//
// * Two channels. NCCL moves the data; an MPI communicator (a duplicate of the one it is
//   built from) is the control channel: it carries NCCL's unique id at construction,
//   the checks of verify mode and the diagnosis of a hang. MPI is how multi-node jobs
//   are launched anyway (mpirun, srun), so it costs no extra setup; a process started
//   without a launcher is a world of one (MPI's singleton start).
// * Its own stream. Operations run in issue order on a non-blocking stream of the
//   highest priority, owned by the communicator, so that communication overlaps the
//   compute streams instead of queueing behind them. Before each operation that stream
//   waits, on the device, for the work already issued to the *compute stream*, which
//   produces the inputs: by default the legacy default stream, which covers the work
//   on every blocking stream; set_compute_stream() names a non-blocking one. A Request
//   records an event after its operation: wait() blocks the host, wait_on(stream)
//   makes a stream wait on the device, which is how a trainer overlaps a gradient
//   all-reduce with the rest of the backward pass.
// * Nothing waits forever. The NCCL communicator is non-blocking (config.blocking = 0),
//   and every MPI step is a non-blocking call, so construction, split, destruction and
//   each wait poll against NcclOptions::timeout. When it passes, the communicator is
//   aborted (ncclCommAbort also frees the GPU from a stuck kernel) and the error names
//   the operation, the group and what it waited for. An operation's clock starts when
//   it has started on this rank's device: one queued behind a long kernel is not a hang
//   of the group, and if it never starts, the error says that instead.
// * Naming the ranks that did not arrive. NCCL cannot tell whom it waits for, so every
//   rank keeps in an MPI one-sided window how many collectives it has issued on the
//   communicator and how many sends and receives it has posted to and from each peer
//   (an MPI_Accumulate to itself per operation, about 0.1 us), as MpiComm does. A rank
//   that times out reads the others' counters, which needs no help from them, and
//   names the ranks that are behind, in MpiComm's words. If the window cannot be made
//   or read, the error says that it cannot tell.
// * Verify mode (NcclOptions::verify, or LLMPAR_COMM_VERIFY=1 on any rank) checks each
//   operation before it is enqueued: the ranks all-reduce its fingerprint (kind, type,
//   count, reduction, root) MIN and MAX over MPI, together with whether its buffers are
//   memory of their device; on a difference every rank throws the same error, naming
//   the field and each rank's value, and the communicator stays usable. A recv checks
//   the type and count of its send through one small MPI message. One MPI round trip
//   per operation: a debugging aid.
// * Conventions are NCCL's (comm/types.hpp lists them), in place included. ReduceOp::avg
//   is ncclAvg: floating types multiply each input by 1/size() before summing, so for a
//   size that is not a power of two the result can differ from sum / size() in the
//   last bit; integer types divide the wrapped sum by size(), truncating toward zero
//   (signed) — what comm::detail::finish computes. An operation of 0 elements enqueues
//   nothing.
// * Lifetime. Construction, split() and destruction are collective over the group, like
//   MPI's and NCCL's: destroy communicators in the same order on every rank, and before
//   MPI_Finalize (comm::MpiEnvironment). A communicator released while an exception
//   propagates, or after it failed, is aborted instead of finalised, so that an error
//   on one rank does not make it wait for ranks that will not come (they time out and
//   name it). MPI operations abandoned at a timeout are recorded where MpiEnvironment
//   looks, so that the job is aborted rather than hanging in MPI_Finalize.
//
// If several threads use communicators at once, MPI must provide MPI_THREAD_MULTIPLE
// (MpiEnvironment asks for it).
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "llmpar/backend/cuda/check.hpp"
#include "llmpar/comm/communicator.hpp"
#include "llmpar/comm/mpi_comm.hpp"
#include "llmpar/comm/types.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "llmpar's NcclComm needs NCCL 2.18 or newer (non-blocking communicators and ncclCommSplit)"
#endif

namespace llmpar::detail {

// " (NCCL's last error message)", or "" when it has none.
inline std::string nccl_last_error(ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return last != nullptr && *last != '\0' ? concat(" (", last, ")") : std::string();
}

template <class... Args>
[[noreturn]] void throw_nccl_error(const char* file, int line, const char* expr, ncclResult_t status, Args&&... args) {
  if constexpr (sizeof...(Args) == 0) {
    throw_error(file, line, expr, "NCCL error ", static_cast<int>(status), ": ", ncclGetErrorString(status),
                nccl_last_error(nullptr));
  } else {
    throw_error(file, line, expr, "NCCL error ", static_cast<int>(status), ": ", ncclGetErrorString(status),
                nccl_last_error(nullptr), "; ", std::forward<Args>(args)...);
  }
}

}  // namespace llmpar::detail

// LLMPAR_CHECK_NCCL(call, message parts...): throws llmpar::Error when `call` does not
// return ncclSuccess, with NCCL's description of the code and its last error message.
// (A non-blocking communicator also returns ncclInProgress, which is not an error: the
// code that uses one handles that result itself.)
#define LLMPAR_CHECK_NCCL(call, ...)                                                                                 \
  do {                                                                                                               \
    const ncclResult_t llmpar_nccl_status_ = (call);                                                                 \
    if (llmpar_nccl_status_ != ncclSuccess) [[unlikely]]                                                             \
      ::llmpar::detail::throw_nccl_error(__FILE__, __LINE__, #call, llmpar_nccl_status_ __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)

namespace llmpar::comm {

struct NcclOptions {
  // How long construction, split, destruction and each operation may wait for the other
  // ranks before the communicator is aborted and the wait throws, naming the missing ones.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Check every operation against the other ranks' before enqueueing it (kind, type,
  // count, reduction, root; a recv: its send's type and count), and that its buffers are
  // memory of the ranks' devices. One MPI round trip per operation. Also switched on by
  // LLMPAR_COMM_VERIFY=1; one rank asking for it switches it on for the whole group.
  bool verify = false;
};

namespace detail {

using Clock = std::chrono::steady_clock;

// ---- the runtime-to-NCCL boundary -----------------------------------------------------

constexpr ncclDataType_t to_nccl(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  return ncclUint8;
}

constexpr ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  return ncclSum;
}

// ---- verify mode: what each rank contributes, and the message when they differ ----------

// Where a buffer lives, for verify mode: 0 memory its device can use (its own, managed,
// or mapped pinned host memory); 1 ordinary host memory; 2 + d memory of device d.
inline constexpr std::int64_t kUsable = 0, kHostMemory = 1, kOtherDevice = 2;

inline std::string describe_place(std::int64_t place, std::int64_t device) {
  if (place == kHostMemory) return "host memory the GPU cannot access";
  return concat("memory of device ", place - kOtherDevice, ", not of the communicator's device ", device);
}

// One rank's row: Op::fingerprint(), where its send and recv buffers are, its device.
using VerifyRow = std::array<std::int64_t, 8>;
inline constexpr std::size_t kFingerprintFields = 5, kSendPlace = 5, kRecvPlace = 6, kRowDevice = 7;

inline VerifyRow verify_row(const Op& op, std::int64_t send_place, std::int64_t recv_place, int device) {
  const auto f = op.fingerprint();
  return {f[0], f[1], f[2], f[3], f[4], send_place, recv_place, device};
}

// "rank 0 has 1024, rank 1 has 1000" (ThreadComm's and MpiComm's words); beyond 16 ranks,
// ranks with equal values are grouped ("ranks 0-511, 513-1023 have 1024, rank 512 has 1000").
inline std::string list_rank_values(const GroupInfo& group, const std::vector<std::string>& values) {
  const std::size_t n = values.size();
  std::string out;
  if (n <= 16) {
    for (std::size_t r = 0; r < n; ++r)
      out += concat(r ? ", " : "", group.member(static_cast<int>(r)), " has ", values[r]);
    return out;
  }
  std::vector<bool> listed(n, false);
  for (std::size_t first = 0; first < n; ++first) {
    if (listed[first]) continue;
    std::vector<std::size_t> ranks;
    for (std::size_t r = first; r < n; ++r)
      if (!listed[r] && values[r] == values[first]) {
        listed[r] = true;
        ranks.push_back(r);
      }
    std::string spans;
    for (std::size_t i = 0; i < ranks.size();) {
      std::size_t j = i;
      while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
      spans += concat(i ? ", " : "", ranks[i]);
      if (j > i) spans += concat("-", ranks[j]);
      i = j + 1;
    }
    out += concat(out.empty() ? "" : ", ", ranks.size() > 1 ? "ranks " : "rank ", spans,
                  ranks.size() > 1 ? " have " : " has ", values[first]);
  }
  return out;
}

// The error every rank throws when the rows of one collective disagree ("" when they
// agree): the first field that differs, with each rank's value (as ThreadComm and
// MpiComm word it), else the buffers that their devices cannot use.
inline std::string verify_message(const Op& mine, const GroupInfo& group, std::span<const VerifyRow> rows) {
  static constexpr const char* kField[] = {"collective", "element type", "element count", "reduction", "root"};
  for (std::size_t field = 0; field < kFingerprintFields; ++field) {
    bool differs = false;
    for (const auto& row : rows) differs = differs || row[field] != rows[0][field];
    if (!differs) continue;
    std::vector<std::string> values;
    for (const auto& row : rows) {
      const std::int64_t v = row[field];
      switch (field) {
        case 0:
          values.emplace_back(name_of(static_cast<Collective>(v)));
          break;
        case 1:
          values.emplace_back(name_of(static_cast<DType>(v)));
          break;
        case 2:
          values.push_back(std::to_string(v));
          break;
        case 3:
          values.push_back(v < 0 ? std::string("no reduction") : std::string(name_of(static_cast<ReduceOp>(v))));
          break;
        default:
          values.push_back(v < 0 ? std::string("no root") : std::to_string(v));
      }
    }
    return concat(name_of(mine.kind), " on ", group.describe(), ": ", kField[field],
                  " differs between ranks: ", list_rank_values(group, values));
  }
  std::string places;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (const auto& [index, name] : {std::pair{kSendPlace, "send"}, std::pair{kRecvPlace, "recv"}}) {
      if (rows[r][index] == kUsable) continue;
      places += concat(places.empty() ? "" : "; ", "on ", group.member(static_cast<int>(r)), " the ", name,
                       " buffer is ", describe_place(rows[r][index], rows[r][kRowDevice]));
    }
  }
  if (places.empty()) return {};
  return concat(mine.describe(), " on ", group.describe(), ": NcclComm moves device memory, but ", places,
                " (allocate the buffers with cudaMalloc on the communicator's device)");
}

// The receiver's check of a send/recv pair ("" when type and count match), in
// ThreadComm's words.
inline std::string p2p_mismatch_message(const Op& send, int sender, const Op& recv, int receiver,
                                        const GroupInfo& group) {
  if (send.type == recv.type && send.count == recv.count) return {};
  return concat(send.describe(), " by ", group.member(sender), " does not match ", recv.describe(), " by ",
                group.member(receiver), " on ", group.describe(), ": the element ",
                send.type != recv.type ? "types" : "counts", " differ");
}

// ---- the diagnosis of a timeout ---------------------------------------------------------

// Which ranks have not issued operation #number of `kind` on `rank` (a send or recv: with
// `peer`), from the counters read from `ranks` (nullopt: no answer within `grace`), in
// MpiComm's words. `unknown` says why no counters could be read at all.
inline std::string arrival_report(const GroupInfo& group, int rank, Collective kind, int peer,
                                  std::span<const int> ranks, std::span<const std::optional<std::int64_t>> counts,
                                  std::int64_t number, const std::string& unknown, std::chrono::milliseconds grace) {
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
                     " not answer the arrival check within ", grace.count(), " ms");
  if (report.empty())
    report = sending || receiving
                 ? concat(group.member(peer), " has posted the matching ", sending ? "recv" : "send",
                          "; the transfer did not complete (NCCL_DEBUG=WARN may say why)")
                 : std::string("every rank has arrived; the collective did not complete (NCCL_DEBUG=WARN may say why)");
  return report;
}

// ---- waiting ------------------------------------------------------------------------------

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

inline bool mpi_usable() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

// Records MPI operations that will never complete where MpiEnvironment looks: it then
// aborts the job at exit instead of hanging in MPI_Finalize.
inline void record_abandoned(int operations, const std::string& reason) {
  if (operations <= 0) return;
  auto& record = mpi::abandoned();
  std::lock_guard lock(record.mutex);
  record.operations += operations;
  if (record.reason.empty()) record.reason = reason;
}

// Non-blocking MPI operations given up at a deadline, with the memory they may still
// use. A later drain() completes those that finished meanwhile (a late rank joined).
class AbandonedOps {
 public:
  template <class Storage>
  void add(MPI_Request request, std::unique_ptr<Storage> storage) {
    ops_.push_back({request, std::shared_ptr<void>(std::move(storage))});
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

  // Gives up on the rest for good: their memory stays allocated, and they are recorded.
  void leak(const std::string& reason) {
    record_abandoned(static_cast<int>(ops_.size()), reason);
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

// ---- who has issued what: the arrival board ---------------------------------------------

// Each rank's counters in an MPI window: [0] collectives issued, [1 + p] sends posted to
// rank p, [1 + size + p] receives posted from rank p. A rank writes only its own counters
// (MPI_Accumulate to itself, completed at once); a rank that timed out reads the others'
// with MPI_Rget_accumulate, which completes without their participation on shared memory
// and RDMA networks. Reads that get no answer within the grace period are abandoned, and
// so is the window then (freeing it is collective, and the job is failing anyway).
class ArrivalBoard {
 public:
  static constexpr int kCollectives = 0;
  static constexpr std::chrono::milliseconds kGrace{1000};

  ArrivalBoard() = default;
  ArrivalBoard(const ArrivalBoard&) = delete;
  ArrivalBoard& operator=(const ArrivalBoard&) = delete;

  // Collective over `comm` (whose errors return). If any rank cannot make the window,
  // the board is off on every rank and says so.
  void open(MPI_Comm comm, int rank, int size) {
    rank_ = rank;
    size_ = size;
    counts_.assign(static_cast<std::size_t>(1 + 2 * size), 0);
    const auto bytes = static_cast<MPI_Aint>(counts_.size() * sizeof(std::int64_t));
    std::int64_t* base = nullptr;
    const int code = MPI_Win_allocate(bytes, sizeof(std::int64_t), MPI_INFO_NULL, comm, &base, &window_);
    int ok = code == MPI_SUCCESS;
    if (ok) {
      std::fill_n(base, counts_.size(), std::int64_t{0});
      ok = MPI_Win_set_errhandler(window_, MPI_ERRORS_RETURN) == MPI_SUCCESS &&
           MPI_Win_lock_all(MPI_MODE_NOCHECK, window_) == MPI_SUCCESS;
      locked_ = ok;
    }
    int all_ok = 0;
    if (MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm) != MPI_SUCCESS) all_ok = 0;
    if (all_ok) {
      unknown_.clear();
    } else {
      unknown_ = code == MPI_SUCCESS ? std::string("this MPI could not set up the one-sided window of counters")
                                     : concat("MPI_Win_allocate failed: ", mpi::error_string(code));
      keep_window_ = true;  // some rank may hold a window the others lack: never free it
    }
  }

  int send_slot(int peer) const { return 1 + peer; }
  int recv_slot(int peer) const { return 1 + size_ + peer; }

  // Counts one more operation in `slot`, publishes the count, and returns it (1, 2, ...).
  std::int64_t issue(int slot) {
    std::int64_t& count = counts_[static_cast<std::size_t>(slot)];
    ++count;
    if (unknown_.empty() &&
        (MPI_Accumulate(&count, 1, MPI_INT64_T, rank_, slot, 1, MPI_INT64_T, MPI_REPLACE, window_) != MPI_SUCCESS ||
         MPI_Win_flush(rank_, window_) != MPI_SUCCESS))
      unknown_ = "publishing this rank's arrival counter failed";
    return count;
  }

  // Why the counters cannot be read ("" when they can).
  const std::string& unknown() const { return unknown_; }

  // Counter `slot` of each of `ranks`; nullopt for those that do not answer within kGrace.
  std::vector<std::optional<std::int64_t>> read(int slot, std::span<const int> ranks) {
    std::vector<std::optional<std::int64_t>> out(ranks.size());
    if (!unknown_.empty() || ranks.empty()) return out;
    auto values = std::make_unique<std::vector<std::int64_t>>(ranks.size());
    std::vector<MPI_Request> requests(ranks.size(), MPI_REQUEST_NULL);
    std::vector<bool> done(ranks.size(), false);
    for (std::size_t i = 0; i < ranks.size(); ++i)
      done[i] = MPI_Rget_accumulate(nullptr, 0, MPI_INT64_T, &(*values)[i], 1, MPI_INT64_T, ranks[i], slot, 1,
                                    MPI_INT64_T, MPI_NO_OP, window_, &requests[i]) != MPI_SUCCESS;
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
        auto shared = std::shared_ptr<std::vector<std::int64_t>>(std::move(values));
        for (std::size_t i = 0; i < ranks.size(); ++i)
          if (!done[i]) abandoned_.add(requests[i], std::make_unique<std::shared_ptr<void>>(shared));
        break;
      }
      if (pending) backoff.pause();
    }
    return out;
  }

  // Unlocks and frees the window, collectively, when `together` and nothing was
  // abandoned; otherwise leaves it to the end of the process.
  void close(bool together) noexcept {
    if (window_ == MPI_WIN_NULL) return;
    if (together && !keep_window_ && abandoned_.empty()) {
      if (locked_) MPI_Win_unlock_all(window_);
      MPI_Win_free(&window_);
    } else if (!abandoned_.empty() && !abandoned_.drain(Clock::now() + kGrace)) {
      abandoned_.leak("an NcclComm arrival check that got no answer");
    }
    window_ = MPI_WIN_NULL;
  }

 private:
  MPI_Win window_ = MPI_WIN_NULL;
  std::vector<std::int64_t> counts_;
  int rank_ = 0, size_ = 0;
  bool locked_ = false, keep_window_ = false;
  std::string unknown_ = "the counters were never set up";
  AbandonedOps abandoned_;
};

// ---- the control channel ----------------------------------------------------------------

// What a check over the control channel found: agreement; a difference every rank saw
// alike (the communicator stays usable); or a failure after which the ranks are out of
// step (the communicator must be aborted).
struct ControlOutcome {
  enum Kind { ok, mismatch, broken } kind = ok;
  std::string message;
};

// The MPI side of an NcclComm, without CUDA or NCCL: a private duplicate of the user's
// communicator, the arrival board, and the exchanges of verify mode. Every step is a
// non-blocking MPI call polled against a deadline; one that passes its deadline is
// abandoned (see AbandonedOps) and the caller fails.
class Control {
 public:
  static constexpr int kFingerprintTag = 7;

  Control() = default;
  Control(const Control&) = delete;
  Control& operator=(const Control&) = delete;
  ~Control() { close(false); }

  // Duplicates `comm` (collective over it). Throws if not every rank arrives in time.
  void open(MPI_Comm comm, std::chrono::milliseconds timeout, const std::string& what) {
    timeout_ = timeout;
    LLMPAR_CHECK(mpi_usable(), what, ": MPI is ", mpi_finalized() ? "already finalized" : "not initialised",
                 "; create a comm::MpiEnvironment first (it calls MPI_Init_thread) and keep it alive while "
                 "communicators exist");
    LLMPAR_CHECK(comm != MPI_COMM_NULL, what, ": the MPI communicator is MPI_COMM_NULL");
    auto storage = std::make_unique<Storage>();
    MPI_Request request = MPI_REQUEST_NULL;
    LLMPAR_CHECK_MPI(MPI_Comm_idup(comm, &storage->comm, &request), what);
    const MPI_Comm* dup = &storage->comm;
    if (!wait(request, Clock::now() + timeout_, storage))
      LLMPAR_FAIL(what, " timed out after ", timeout_.count(),
                  " ms: every rank of the MPI communicator must construct it together, and at least one did not");
    adopt(*dup, what);
  }

  // Takes a new communicator (from MPI_Comm_split) and opens its board. Collective.
  void adopt(MPI_Comm comm, const std::string& what) {
    comm_ = comm;
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

  // Verify mode for a collective (#number on this communicator): every rank agrees on
  // `row`, or every rank gets the same message.
  ControlOutcome verify_collective(const Op& op, const GroupInfo& group, const VerifyRow& row, std::int64_t number,
                                   Clock::time_point deadline) {
    // MIN over (fingerprint, -fingerprint, -places) gives each field's minimum and maximum.
    constexpr std::size_t kF = kFingerprintFields;
    auto storage = std::make_unique<Storage>();
    storage->in.resize(2 * kF + 2);
    storage->out.resize(2 * kF + 2);
    for (std::size_t i = 0; i < kF; ++i) {
      storage->in[i] = row[i];
      storage->in[kF + i] = -row[i];
    }
    storage->in[2 * kF] = -row[kSendPlace];
    storage->in[2 * kF + 1] = -row[kRecvPlace];
    const std::vector<std::int64_t>* out = &storage->out;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Iallreduce(storage->in.data(), storage->out.data(), static_cast<int>(2 * kF + 2), MPI_INT64_T, MPI_MIN,
                       comm_, &request) != MPI_SUCCESS)
      return {ControlOutcome::broken,
              concat(op.describe(), " on ", group.describe(), ": verify mode's MPI_Iallreduce failed")};
    if (!wait(request, deadline, storage)) return timed_out(op, group, number, " in verify mode's check");
    bool agree = (*out)[2 * kF] == 0 && (*out)[2 * kF + 1] == 0;
    for (std::size_t i = 0; i < kF; ++i) agree = agree && (*out)[i] == -(*out)[kF + i];
    if (agree) return {};
    const auto rows = all_gather(row, deadline, "verify mode's check");
    if (!rows) return timed_out(op, group, number, " in verify mode's check");
    std::vector<VerifyRow> table(static_cast<std::size_t>(size_));
    for (std::size_t r = 0; r < table.size(); ++r)
      std::copy_n(rows->begin() + static_cast<std::ptrdiff_t>(r * row.size()), row.size(), table[r].begin());
    return {ControlOutcome::mismatch, verify_message(op, group, table)};
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
  ControlOutcome check_fingerprint(const Op& op, const GroupInfo& group, std::int64_t number,
                                   Clock::time_point deadline) {
    auto storage = std::make_unique<Storage>();
    storage->out.resize(2);
    const std::vector<std::int64_t>* message = &storage->out;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Irecv(storage->out.data(), 2, MPI_INT64_T, op.root, kFingerprintTag, comm_, &request) != MPI_SUCCESS)
      return {ControlOutcome::broken,
              concat(op.describe(), " on ", group.describe(), ": verify mode's MPI_Irecv failed")};
    if (!wait(request, deadline, storage)) return timed_out(op, group, number, " in verify mode's check");
    Op send = op;
    send.kind = Collective::send;
    send.type = static_cast<DType>((*message)[0]);
    send.count = static_cast<std::size_t>((*message)[1]);
    send.root = rank_;
    std::string error = p2p_mismatch_message(send, op.root, op, rank_, group);
    if (error.empty()) return {};
    return {ControlOutcome::broken, std::move(error)};
  }

  // "<op> on <group> timed out after N ms on rank R<where>, <who did not arrive>".
  ControlOutcome timed_out(const Op& op, const GroupInfo& group, std::int64_t number, const char* where) {
    return {ControlOutcome::broken,
            concat(op.describe(), " on ", group.describe(), " timed out after ", timeout_.count(), " ms on ",
                   group.member(rank_), where, ", ", arrivals(op, group, number))};
  }

  // Who operation #number (in its counter) waits for, from the others' counters.
  std::string arrivals(const Op& op, const GroupInfo& group, std::int64_t number) {
    const bool sending = op.kind == Collective::send, receiving = op.kind == Collective::recv;
    std::vector<int> ranks;
    if (sending || receiving) {
      ranks.push_back(op.root);
    } else {
      for (int r = 0; r < size_; ++r)
        if (r != rank_) ranks.push_back(r);
    }
    // The peer's receives from this rank, its sends to this rank, or its collectives.
    const int slot = sending     ? board_.recv_slot(rank_)
                     : receiving ? board_.send_slot(rank_)
                                 : ArrivalBoard::kCollectives;
    const std::string unknown = board_.unknown();
    const auto counts = board_.read(slot, ranks);
    return arrival_report(group, rank_, op.kind, op.root, ranks, counts, number, unknown, ArrivalBoard::kGrace);
  }

  // Forgets the verify-mode messages that their receivers have taken.
  void prune() {
    std::erase_if(sends_, [](Pending& p) {
      int flag = 0;
      return MPI_Test(&p.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag;
    });
  }

  // Frees the channel; collective when `together` (the board's window is then freed).
  // What never completed stays allocated and is recorded (see record_abandoned).
  void close(bool together) noexcept {
    if (comm_ == MPI_COMM_NULL && abandoned_.empty()) return;
    if (mpi_usable()) {
      try {
        for (auto& p : sends_) abandoned_.add(p.request, std::move(p.storage));
        sends_.clear();
        if (!abandoned_.drain(Clock::now() + ArrivalBoard::kGrace))
          abandoned_.leak("an NcclComm's MPI exchange that timed out");
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

  static bool mpi_finalized() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    return finalized != 0;
  }

  // Polls `request` until done (true) or `deadline` (false: it is abandoned with `storage`).
  bool wait(MPI_Request& request, Clock::time_point deadline, std::unique_ptr<Storage>& storage) {
    Backoff backoff;
    while (true) {
      int flag = 0;
      LLMPAR_CHECK_MPI(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), "an NcclComm's control channel");
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
  ArrivalBoard board_;
  std::vector<Pending> sends_;
  AbandonedOps abandoned_;
};

// ---- the CUDA side ------------------------------------------------------------------------

// Makes `device` current for a scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    int current = -1;
    LLMPAR_CHECK_CUDA(cudaGetDevice(&current));
    if (current != device) {
      LLMPAR_CHECK_CUDA(cudaSetDevice(device));
      previous_ = current;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) static_cast<void>(cudaSetDevice(previous_));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Where a buffer lives, for verify mode (kUsable, kHostMemory or kOtherDevice + d).
inline std::int64_t buffer_place(const void* pointer, int device) {
  if (pointer == nullptr) return kUsable;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return kHostMemory;
  }
  switch (attributes.type) {
    case cudaMemoryTypeUnregistered:
      return kHostMemory;
    case cudaMemoryTypeDevice:
      return attributes.device == device ? kUsable : kOtherDevice + attributes.device;
    default:  // managed memory, or pinned host memory the device maps
      return kUsable;
  }
}

// Everything one rank of one NCCL group owns, shared by the NcclComm handle and its
// outstanding Requests so that neither outlives what it uses.
struct NcclState {
  NcclOptions options;
  GroupInfo group;
  int rank = 0, size = 1, device = 0;
  Control control;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaStream_t compute = cudaStreamLegacy;  // whose earlier work each operation waits for
  cudaEvent_t compute_ready = nullptr;
  int* barrier_word = nullptr;  // the device int that barrier() all-reduces
  void* scratch = nullptr;      // a copy of the input of an in-place all_to_all
  std::size_t scratch_bytes = 0;
  std::vector<cudaEvent_t> spare_events;
  std::string aborted;     // why, once the communicator was aborted
  bool complete_ = false;  // built completely: destruction may finalise
  bool unwinding = false;  // released while an exception propagated

  NcclState() = default;
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;

  ~NcclState() {
    int current = -1;
    const bool restore = cudaGetDevice(&current) == cudaSuccess && current != device;
    if (restore) static_cast<void>(cudaSetDevice(device));
    // Every rank here, destroying it normally: then all finalise, and free the window.
    const bool healthy = comm != nullptr && complete_ && aborted.empty() && !unwinding && mpi_usable();
    const bool together = healthy && control.barrier(Clock::now() + options.timeout);
    if (healthy && !together)
      std::fprintf(stderr, "llmpar: NcclComm on %s: not every rank destroyed it within %lld ms; aborting it\n",
                   group.describe().c_str(), static_cast<long long>(options.timeout.count()));
    if (comm != nullptr && !(together && finalize())) static_cast<void>(ncclCommAbort(comm));
    comm = nullptr;
    for (cudaEvent_t e : spare_events) static_cast<void>(cudaEventDestroy(e));
    if (compute_ready != nullptr) static_cast<void>(cudaEventDestroy(compute_ready));
    if (stream != nullptr) static_cast<void>(cudaStreamDestroy(stream));
    if (barrier_word != nullptr) static_cast<void>(cudaFree(barrier_word));
    if (scratch != nullptr) static_cast<void>(cudaFree(scratch));
    control.close(together);
    if (restore) static_cast<void>(cudaSetDevice(current));
  }

  // ncclCommFinalize, polled until it completes, then ncclCommDestroy; false on failure.
  bool finalize() noexcept {
    if (const ncclResult_t r = ncclCommFinalize(comm); r != ncclSuccess && r != ncclInProgress) return false;
    if (settle(comm, Clock::now() + options.timeout) != ncclSuccess) return false;
    return ncclCommDestroy(comm) == ncclSuccess;
  }

  // Polls a non-blocking communicator until it leaves ncclInProgress, or the deadline.
  static ncclResult_t settle(ncclComm_t c, Clock::time_point deadline) noexcept {
    Backoff backoff;
    while (true) {
      ncclResult_t state = ncclSuccess;
      if (const ncclResult_t r = ncclCommGetAsyncError(c, &state); r != ncclSuccess) return r;
      if (state != ncclInProgress) return state;
      if (Clock::now() >= deadline) return ncclInProgress;
      backoff.pause();
    }
  }

  // Aborts the communicator and throws `reason`; every later use throws it too.
  [[noreturn]] void fail(const std::string& reason) {
    if (comm != nullptr) {
      static_cast<void>(ncclCommAbort(comm));
      comm = nullptr;
    }
    if (aborted.empty()) aborted = reason;
    LLMPAR_FAIL(reason, ". The communicator is aborted: every later operation on it fails");
  }

  // Handles what an NCCL call on the non-blocking communicator `c` (default: this one)
  // returned: success, or in progress until it settles; otherwise aborts and throws.
  // `what` is a callable, so that the message costs nothing when all goes well.
  template <class What>
  void complete(ncclResult_t r, const What& what, Clock::time_point deadline, ncclComm_t c = nullptr) {
    if (c == nullptr) c = comm;
    if (r == ncclInProgress) r = settle(c, deadline);
    if (r == ncclSuccess) [[likely]]
      return;
    if (r == ncclInProgress)
      fail(concat(what(), " timed out after ", options.timeout.count(), " ms on ", group.member(rank),
                  " inside NCCL (NCCL_DEBUG=WARN says what it waits for)"));
    fail(concat(what(), ": NCCL error ", static_cast<int>(r), ": ", ncclGetErrorString(r),
                llmpar::detail::nccl_last_error(c)));
  }

  void check_usable() const {
    if (!aborted.empty()) [[unlikely]]
      LLMPAR_FAIL(group.describe(), " was aborted and runs no more operations: ", aborted);
  }

  cudaEvent_t take_event() {
    if (!spare_events.empty()) {
      cudaEvent_t e = spare_events.back();
      spare_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    LLMPAR_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void give_event(cudaEvent_t e) noexcept {
    if (e == nullptr) return;
    try {
      spare_events.push_back(e);
    } catch (...) {
      static_cast<void>(cudaEventDestroy(e));
    }
  }

  // The stream, the event and the barrier word (once the NCCL communicator exists).
  void create_device_resources() {
    int least = 0, greatest = 0;
    LLMPAR_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    LLMPAR_CHECK_CUDA(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
    LLMPAR_CHECK_CUDA(cudaEventCreateWithFlags(&compute_ready, cudaEventDisableTiming));
    LLMPAR_CHECK_CUDA(cudaMalloc(&barrier_word, sizeof(int)));
    LLMPAR_CHECK_CUDA(cudaMemsetAsync(barrier_word, 0, sizeof(int), stream));
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream));
  }

  // Enqueues `op` on `stream` (nothing for 0 elements, except a barrier).
  void enqueue(const Op& op, Clock::time_point deadline) {
    const auto what = [&] { return concat(op.describe(), " on ", group.describe()); };
    if (op.kind == Collective::barrier) {
      complete(ncclAllReduce(barrier_word, barrier_word, 1, ncclInt32, ncclSum, comm, stream), what, deadline);
      return;
    }
    if (op.count == 0) return;
    const ncclDataType_t type = to_nccl(op.type);
    const ncclRedOp_t reduce = to_nccl(op.reduce);
    switch (op.kind) {
      case Collective::all_reduce:
        return complete(ncclAllReduce(op.send, op.recv, op.count, type, reduce, comm, stream), what, deadline);
      case Collective::reduce_scatter:
        return complete(ncclReduceScatter(op.send, op.recv, op.count, type, reduce, comm, stream), what, deadline);
      case Collective::all_gather:
        return complete(ncclAllGather(op.send, op.recv, op.count, type, comm, stream), what, deadline);
      case Collective::broadcast:
        return complete(ncclBroadcast(op.send, op.recv, op.count, type, op.root, comm, stream), what, deadline);
      case Collective::reduce:
        return complete(ncclReduce(op.send, op.recv, op.count, type, reduce, op.root, comm, stream), what, deadline);
      case Collective::all_to_all:
        return all_to_all(op, what, deadline);
      case Collective::send:
        return complete(ncclSend(op.send, op.count, type, op.root, comm, stream), what, deadline);
      case Collective::recv:
        return complete(ncclRecv(op.recv, op.count, type, op.root, comm, stream), what, deadline);
      case Collective::barrier:
        break;
    }
  }

  // One send and one receive per peer, in one NCCL group; this rank's own block is a
  // copy. In place, the input is copied aside first: a block may arrive before its
  // place was sent.
  template <class What>
  void all_to_all(const Op& op, const What& what, Clock::time_point deadline) {
    const std::size_t block = op.count * size_of(op.type);
    const auto* send = static_cast<const std::byte*>(op.send);
    auto* recv = static_cast<std::byte*>(op.recv);
    if (op.send == op.recv) {
      const std::size_t total = block * static_cast<std::size_t>(size);
      if (scratch_bytes < total) {
        if (scratch != nullptr) LLMPAR_CHECK_CUDA(cudaFree(scratch));
        scratch = nullptr;
        scratch_bytes = 0;
        LLMPAR_CHECK_CUDA(cudaMalloc(&scratch, total), what(), " in place needs ", total, " bytes of scratch");
        scratch_bytes = total;
      }
      LLMPAR_CHECK_CUDA(cudaMemcpyAsync(scratch, send, total, cudaMemcpyDeviceToDevice, stream));
      send = static_cast<const std::byte*>(scratch);
    }
    const auto me = static_cast<std::size_t>(rank) * block;
    LLMPAR_CHECK_CUDA(cudaMemcpyAsync(recv + me, send + me, block, cudaMemcpyDeviceToDevice, stream));
    if (size == 1) return;
    const ncclDataType_t type = to_nccl(op.type);
    ncclResult_t first_error = ncclSuccess;
    const auto keep = [&](ncclResult_t r) {
      if (first_error == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first_error = r;
    };
    keep(ncclGroupStart());
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      const std::size_t at = static_cast<std::size_t>(p) * block;
      keep(ncclSend(send + at, op.count, type, p, comm, stream));
      keep(ncclRecv(recv + at, op.count, type, p, comm, stream));
    }
    const ncclResult_t end = ncclGroupEnd();  // always closes the group, even after an error
    complete(first_error != ncclSuccess ? first_error : end, what, deadline);
  }
};

// Whether LLMPAR_COMM_VERIFY asks for verify mode (as MpiComm reads it).
inline bool verify_from_environment(bool verify) {
  const char* value = std::getenv("LLMPAR_COMM_VERIFY");
  if (value == nullptr || *value == '\0') return verify;
  const std::string_view v(value);
  LLMPAR_CHECK(v == "0" || v == "1", "LLMPAR_COMM_VERIFY=", v,
               " is not 0 or 1; set LLMPAR_COMM_VERIFY=1 to check every collective across ranks, 0 not to");
  return verify || v == "1";
}

}  // namespace detail

// One rank of a group of CUDA devices. Movable, not copyable; belongs to its rank.
class NcclComm : public Collectives<NcclComm> {
 public:
  // An issued operation. wait() blocks the host until it has finished (or throws its
  // error or its timeout); test() asks without blocking; wait_on(stream) makes `stream`
  // wait for it on the device. Dropping a Request does not wait: the operation completes
  // all the same, and a failure surfaces at the next wait on this communicator.
  class Request {
   public:
    Request(Request&& other) noexcept { take(other); }
    Request& operator=(Request&& other) noexcept {
      if (this != &other) {
        release();
        take(other);
      }
      return *this;
    }
    ~Request() { release(); }

    void wait() {
      detail::Backoff backoff;
      while (!test()) backoff.pause();
    }

    // True once the operation has finished; throws if it failed or ran out of time.
    bool test() {
      if (finished_) return true;
      LLMPAR_CHECK(state_ != nullptr, "this NcclComm::Request was moved from");
      detail::NcclState& s = *state_;
      s.check_usable();
      const cudaError_t done = cudaEventQuery(done_);
      if (done == cudaSuccess) {
        finished_ = true;
        return true;
      }
      if (done != cudaErrorNotReady)
        LLMPAR_CHECK_CUDA(done, op_.describe(), " on ", s.group.describe(), ": waiting for it failed");
      ncclResult_t async = ncclSuccess;
      const ncclResult_t query = ncclCommGetAsyncError(s.comm, &async);
      if (query != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
        const ncclResult_t r = query != ncclSuccess ? query : async;
        s.fail(detail::concat(op_.describe(), " on ", s.group.describe(), " failed on ", s.group.member(s.rank),
                              ": NCCL reported error ", static_cast<int>(r), ": ", ncclGetErrorString(r),
                              llmpar::detail::nccl_last_error(s.comm)));
      }
      const auto now = detail::Clock::now();
      if (!started_ && cudaEventQuery(start_) == cudaSuccess) {
        started_ = true;
        since_ = now;  // the clock restarts when the operation is seen running
      } else if (!polled_) {
        since_ = now;
      }
      polled_ = true;
      if (now - since_ < s.options.timeout) return false;
      if (!started_)
        s.fail(detail::concat(op_.describe(), " on ", s.group.describe(), " did not start within ",
                              s.options.timeout.count(), " ms on ", s.group.member(s.rank),
                              ": earlier work on its compute stream or its communication stream has not finished "
                              "(a kernel that does not end, or an earlier operation that never completed)"));
      s.fail(s.control.timed_out(op_, s.group, number_, "").message);
    }

    // Makes `stream` wait, on the device and without blocking the host, for this
    // operation. Its errors and timeout surface at a wait() or test().
    void wait_on(cudaStream_t stream) const {
      LLMPAR_CHECK(state_ != nullptr, "this NcclComm::Request was moved from");
      if (!finished_) LLMPAR_CHECK_CUDA(cudaStreamWaitEvent(stream, done_, 0));
    }

   private:
    friend class NcclComm;
    Request(std::shared_ptr<detail::NcclState> state, const Op& op, std::int64_t number)
        : state_(std::move(state)), op_(op), number_(number) {
      start_ = state_->take_event();
      try {
        done_ = state_->take_event();
      } catch (...) {
        release();
        throw;
      }
    }

    void take(Request& other) noexcept {
      state_ = std::move(other.state_);
      op_ = other.op_;
      number_ = other.number_;
      start_ = std::exchange(other.start_, nullptr);
      done_ = std::exchange(other.done_, nullptr);
      since_ = other.since_;
      started_ = other.started_;
      polled_ = other.polled_;
      finished_ = other.finished_;
    }
    void release() noexcept {
      if (state_) {
        state_->give_event(start_);
        state_->give_event(done_);
      }
      start_ = done_ = nullptr;
      state_.reset();
    }

    std::shared_ptr<detail::NcclState> state_;
    Op op_;
    std::int64_t number_ = 0;  // its number in its arrival counter
    cudaEvent_t start_ = nullptr, done_ = nullptr;
    detail::Clock::time_point since_{};  // when it was first seen running (or first polled)
    bool started_ = false, polled_ = false, finished_ = false;
  };

  // Collective over `comm`: every rank builds its NcclComm from the same `comm`, each on
  // its own `device` (local_device() gives the usual choice). `name` names the group in
  // messages and in NCCL's logs.
  NcclComm(MPI_Comm comm, int device, NcclOptions options = {}, std::string name = "world")
      : state_(std::make_shared<detail::NcclState>()), uncaught_(std::uncaught_exceptions()) {
    detail::NcclState& s = *state_;
    s.options = options;
    s.group.name = std::move(name);
    const std::string what = detail::concat("NcclComm '", s.group.name, "'");
    LLMPAR_CHECK(options.timeout.count() > 0, what, ": NcclOptions::timeout is ", options.timeout.count(),
                 " ms; use a positive duration (the default is 5 minutes)");
    int devices = 0;
    LLMPAR_CHECK_CUDA(cudaGetDeviceCount(&devices), what, " needs a CUDA device");
    LLMPAR_CHECK(device >= 0 && device < devices, what, ": device ", device, " does not exist; this process sees ",
                 devices, " CUDA device(s): 0..", devices - 1);
    s.device = device;
    s.control.open(comm, options.timeout, what);
    s.rank = s.control.rank();
    s.size = s.control.size();
    const auto deadline = detail::Clock::now() + options.timeout;

    // Every rank's world rank (for messages), and verify mode if any rank asks for it.
    int world_rank = 0;
    LLMPAR_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), what);
    const std::array<std::int64_t, 2> mine{world_rank, detail::verify_from_environment(options.verify) ? 1 : 0};
    const auto all = s.control.all_gather(mine, deadline, "construction");
    LLMPAR_CHECK(all.has_value(), what, " timed out after ", options.timeout.count(),
                 " ms: every rank of the MPI communicator must construct it together, and at least one did not");
    s.options.verify = false;
    for (int r = 0; r < s.size; ++r) {
      s.group.world_ranks.push_back(static_cast<int>((*all)[static_cast<std::size_t>(2 * r)]));
      s.options.verify = s.options.verify || (*all)[static_cast<std::size_t>(2 * r + 1)] != 0;
    }

    detail::DeviceGuard guard(device);
    struct UniqueId {
      std::int32_t status = ncclSuccess;
      ncclUniqueId id;
    } unique{};
    if (s.rank == 0) unique.status = static_cast<std::int32_t>(ncclGetUniqueId(&unique.id));
    LLMPAR_CHECK(s.control.broadcast(std::as_writable_bytes(std::span(&unique, 1)), 0, deadline, "construction"), what,
                 " on ", s.group.describe(), " timed out after ", options.timeout.count(),
                 " ms waiting for NCCL's unique id from rank 0");
    LLMPAR_CHECK(
        unique.status == ncclSuccess, what, " on ", s.group.describe(),
        ": rank 0 could not create NCCL's unique id: ", ncclGetErrorString(static_cast<ncclResult_t>(unique.status)));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    config.commName = s.group.name.c_str();
    s.complete(
        ncclCommInitRankConfig(&s.comm, s.size, unique.id, s.rank, &config),
        [&] { return detail::concat(what, " on ", s.group.describe(), ": ncclCommInitRankConfig"); }, deadline);
    s.create_device_resources();
    s.complete_ = true;
  }

  // The device for this process: its rank among the processes on its node, which must
  // not outnumber the node's devices (NCCL needs one device per rank).
  static int local_device(MPI_Comm comm) {
    MPI_Comm node = MPI_COMM_NULL;
    LLMPAR_CHECK_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
                     "NcclComm::local_device");
    int local = 0, local_size = 1;
    MPI_Comm_rank(node, &local);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    int devices = 0;
    LLMPAR_CHECK_CUDA(cudaGetDeviceCount(&devices), "NcclComm::local_device needs a CUDA device");
    LLMPAR_CHECK(local_size <= devices, "NcclComm::local_device: ", local_size, " ranks run on this node but it has ",
                 devices, " CUDA device(s), and NCCL needs one device per rank: start at most ", devices,
                 " ranks per node");
    return local;
  }

  NcclComm(NcclComm&&) noexcept = default;
  NcclComm& operator=(NcclComm&& other) noexcept {
    if (this != &other) {
      mark_unwinding();
      state_ = std::move(other.state_);
      uncaught_ = other.uncaught_;
    }
    return *this;
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() { mark_unwinding(); }

  int rank() const { return state().rank; }
  int size() const { return state().size; }
  const GroupInfo& group() const { return state().group; }
  const NcclOptions& options() const { return state().options; }
  int device() const { return state().device; }
  // The stream the operations run on, in issue order.
  cudaStream_t stream() const { return state().stream; }
  // The stream whose earlier work every operation waits for (default cudaStreamLegacy).
  cudaStream_t compute_stream() const { return state().compute; }
  void set_compute_stream(cudaStream_t stream) { state().compute = stream; }
  // The NCCL communicator, for calls this class does not make (null once aborted).
  ncclComm_t native() const { return state().comm; }

  // Runs `op` and waits for it on the host.
  void run(const Op& op) { start(op).wait(); }

  // Enqueues `op` on stream(), after the compute stream's earlier work.
  Request start(const Op& op) {
    detail::NcclState& s = state();
    s.check_usable();
    detail::DeviceGuard guard(s.device);
    s.control.prune();
    const auto deadline = detail::Clock::now() + s.options.timeout;
    const bool p2p = op.kind == Collective::send || op.kind == Collective::recv;
    if (p2p && s.options.verify) {  // a local check: the peer learns of a failure by timing out
      const std::int64_t place = detail::buffer_place(op.kind == Collective::send ? op.send : op.recv, s.device);
      LLMPAR_CHECK(op.count == 0 || place == detail::kUsable, op.describe(), " on ", s.group.describe(),
                   ": NcclComm moves device memory, but on ", s.group.member(s.rank), " the ",
                   op.kind == Collective::send ? "send" : "recv", " buffer is ",
                   detail::describe_place(place, s.device),
                   " (allocate the buffers with cudaMalloc on the communicator's device)");
    }
    auto& board = s.control.board();
    const std::int64_t number = board.issue(!p2p                          ? detail::ArrivalBoard::kCollectives
                                            : op.kind == Collective::send ? board.send_slot(op.root)
                                                                          : board.recv_slot(op.root));
    if (s.options.verify) verify(op, number, deadline);

    LLMPAR_CHECK_CUDA(cudaEventRecord(s.compute_ready, s.compute));
    LLMPAR_CHECK_CUDA(cudaStreamWaitEvent(s.stream, s.compute_ready, 0));
    Request request(state_, op, number);
    LLMPAR_CHECK_CUDA(cudaEventRecord(request.start_, s.stream));
    s.enqueue(op, deadline);
    LLMPAR_CHECK_CUDA(cudaEventRecord(request.done_, s.stream));
    return request;
  }

  // Members with the same color form one new communicator, ordered by key (then by rank
  // here); its GroupInfo holds `name` and the members' world ranks. Collective; colors
  // must be >= 0 (every rank joins some group).
  NcclComm split(int color, int key, std::string name) {
    detail::NcclState& s = state();
    s.check_usable();
    const std::string what = detail::concat("split of ", s.group.describe(), " into '", name, "'");
    LLMPAR_CHECK(color >= 0, what, ": color ", color,
                 " is negative; use colors >= 0 (members with the same color form one communicator)");
    detail::DeviceGuard guard(s.device);
    const auto deadline = detail::Clock::now() + s.options.timeout;
    const std::int64_t number = s.control.board().issue(detail::ArrivalBoard::kCollectives);

    // Who goes where; this also proves that every rank is here before the blocking calls.
    const std::array<std::int64_t, 2> mine{color, key};
    const auto all = s.control.all_gather(mine, deadline, "split");
    if (!all)
      s.fail(detail::concat(what, " timed out after ", s.options.timeout.count(), " ms on ", s.group.member(s.rank),
                            ", ", s.control.arrivals(Op{}, s.group, number)));
    const auto color_of = [&](int r) { return (*all)[static_cast<std::size_t>(2 * r)]; };
    const auto key_of = [&](int r) { return (*all)[static_cast<std::size_t>(2 * r + 1)]; };
    std::vector<int> members;
    for (int r = 0; r < s.size; ++r)
      if (color_of(r) == color) members.push_back(r);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return key_of(a) < key_of(b); });
    const int child_rank = static_cast<int>(std::find(members.begin(), members.end(), s.rank) - members.begin());

    NcclComm child(std::make_shared<detail::NcclState>());
    detail::NcclState& c = *child.state_;
    c.options = s.options;
    c.group.name = std::move(name);
    for (int r : members) c.group.world_ranks.push_back(s.group.world_ranks[static_cast<std::size_t>(r)]);
    c.device = s.device;
    c.compute = s.compute;
    c.rank = child_rank;
    c.size = static_cast<int>(members.size());

    MPI_Comm sub = MPI_COMM_NULL;
    if (const int code = MPI_Comm_split(s.control.comm(), color, key, &sub); code != MPI_SUCCESS)
      s.fail(detail::concat(what, ": MPI_Comm_split failed: ", detail::mpi::error_string(code)));
    c.control.set_timeout(c.options.timeout);
    c.control.adopt(sub, what);
    LLMPAR_CHECK(c.control.rank() == child_rank && c.control.size() == c.size, what,
                 ": MPI ordered the ranks differently (rank ", c.control.rank(), " of ", c.control.size(),
                 ", expected ", child_rank, " of ", c.size, ")");

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    config.commName = c.group.name.c_str();
    const auto where = [&] { return what; };
    const ncclResult_t r = ncclCommSplit(s.comm, color, key, &c.comm, &config);
    if (r != ncclInProgress) s.complete(r, where, deadline);
    s.complete(ncclInProgress, where, deadline);  // both settle: the parent and the child
    c.complete(ncclInProgress, where, deadline);
    int nccl_rank = -1;
    c.complete(ncclCommUserRank(c.comm, &nccl_rank), where, deadline);
    LLMPAR_CHECK(nccl_rank == child_rank, what, ": NCCL ordered the ranks differently (rank ", nccl_rank, ", expected ",
                 child_rank, ")");
    c.create_device_resources();
    c.complete_ = true;
    return child;
  }

 private:
  explicit NcclComm(std::shared_ptr<detail::NcclState> state)
      : state_(std::move(state)), uncaught_(std::uncaught_exceptions()) {}

  detail::NcclState& state() const {
    LLMPAR_CHECK(state_ != nullptr, "this NcclComm was moved from; use the communicator it was moved to");
    return *state_;
  }

  // A communicator released while an exception propagates is aborted, not finalised.
  void mark_unwinding() noexcept {
    if (state_ && std::uncaught_exceptions() > uncaught_) state_->unwinding = true;
  }

  // Verify mode: the ranks compare the operation before it is enqueued.
  void verify(const Op& op, std::int64_t number, detail::Clock::time_point deadline) {
    detail::NcclState& s = state();
    detail::ControlOutcome outcome;
    if (op.kind == Collective::send) {
      s.control.post_fingerprint(op);
      return;
    }
    if (op.kind == Collective::recv) {
      outcome = s.control.check_fingerprint(op, s.group, number, deadline);
    } else {
      const BufferCounts counts = buffer_counts(op, s.size, s.rank);
      const std::int64_t send_place = counts.send ? detail::buffer_place(op.send, s.device) : detail::kUsable;
      const std::int64_t recv_place = counts.recv ? detail::buffer_place(op.recv, s.device) : detail::kUsable;
      outcome = s.control.verify_collective(op, s.group, detail::verify_row(op, send_place, recv_place, s.device),
                                            number, deadline);
    }
    if (outcome.kind == detail::ControlOutcome::mismatch) LLMPAR_FAIL(outcome.message);
    if (outcome.kind == detail::ControlOutcome::broken) s.fail(outcome.message);
  }

  std::shared_ptr<detail::NcclState> state_;
  int uncaught_ = 0;
};

static_assert(Communicator<NcclComm>);
static_assert(Request<NcclComm::Request>);

}  // namespace llmpar::comm
