// llmpar/comm/nccl_comm.hpp — NcclComm: the Communicator engine for CUDA devices, over NCCL.
//
// One NcclComm is one rank of a group of processes, each driving one CUDA device; the
// buffers of its Ops are device pointers. Why it is built this way:
//
// * Two channels. NCCL moves the data; an MPI communicator (a duplicate of the one it is
//   built from) is the control channel: it carries NCCL's unique id at construction,
//   the checks of verify mode and the diagnosis of a hang. MPI is how multi-node jobs
//   are launched anyway (mpirun, srun), so it costs no extra setup; a process started
//   without a launcher is a world of one (MPI's singleton start). The channel is the
//   MPI machinery MpiComm is built on too (comm/detail/mpi.hpp), so both engines
//   diagnose and word a hang or a mismatch the same way.
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
//   rank keeps, on MpiComm's arrival board (comm/detail/mpi.hpp), how many collectives
//   it has issued on the communicator and how many sends and receives it has posted to
//   and from each peer: an atomic store per operation in a shared-memory window on one
//   node, an MPI_Accumulate to itself (about 0.1 us) otherwise. A rank that times out
//   reads the others' counters, which needs no help from them, and names the ranks
//   that are behind, in MpiComm's words. If the window cannot be made or read (Open
//   MPI 4 cannot give a split group across nodes its own window, open-mpi/ompi#9492),
//   the error says that it cannot tell.
// * Verify mode (NcclOptions::verify, or LLMPAR_COMM_VERIFY=1 on any rank) checks each
//   operation before it is enqueued: the ranks all-reduce its fingerprint (kind, type,
//   count, reduction, root) MIN and MAX over MPI, together with whether its buffers are
//   memory of their device; on a difference every rank throws the same error, naming
//   the field and each rank's value in every engine's words (comm/detail/verify.hpp),
//   and the communicator stays usable. A recv checks the type and count of its send
//   through one small MPI message. One MPI round trip per operation: a debugging aid.
// * Conventions are NCCL's (comm/types.hpp lists them), in place included. ReduceOp::avg
//   is ncclAvg: floating types multiply each input by 1/size() before summing, so for a
//   size that is not a power of two the result can differ from sum / size() in the
//   last bit; integer types divide the wrapped sum by size(), truncating toward zero
//   (signed) — what comm::detail::finish computes. An operation of 0 elements enqueues
//   nothing.
// * A batch of sends and receives (start_batch) is one NCCL group: ncclGroupStart,
//   ncclSend/ncclRecv for each, ncclGroupEnd, on the communicator's stream, with one
//   Request for the whole group. Without the group, two ranks that both send first
//   deadlock: an ncclSend holds the stream until its peer's ncclRecv is posted. NCCL
//   matches the sends and receives of a pair of ranks in posting order, within a group
//   and across groups. NCCL cannot tell which operation of a group a hang waits for,
//   so a batch's timeout reports the arrival counters of each of its operations.
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
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "llmpar/backend/cuda/check.hpp"
#include "llmpar/comm/communicator.hpp"
#include "llmpar/comm/detail/mpi.hpp"
#include "llmpar/comm/detail/verify.hpp"
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

using mpi::Clock;

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

// A buffer of one rank, and where it is.
struct BufferPlace {
  int rank;
  const char* buffer;  // "send" or "recv"
  std::int64_t place, device;
};

// The error for the buffers among `buffers` that their devices cannot use ("" when
// they all can).
inline std::string misplaced_message(const Op& op, const GroupInfo& group, std::span<const BufferPlace> buffers) {
  std::string places;
  for (const BufferPlace& b : buffers) {
    if (b.place == kUsable) continue;
    places += concat(places.empty() ? "" : "; ", "on ", group.member(b.rank), " the ", b.buffer, " buffer is ",
                     b.place == kHostMemory ? std::string("host memory the GPU cannot access")
                                            : concat("memory of device ", b.place - kOtherDevice,
                                                     ", not of the communicator's device ", b.device));
  }
  if (places.empty()) return {};
  return concat(op.describe(), " on ", group.describe(), ": NcclComm moves device memory, but ", places,
                " (allocate the buffers with cudaMalloc on the communicator's device)");
}

// One rank's row: Op::fingerprint(), where its send and recv buffers are, its device.
using VerifyRow = std::array<std::int64_t, 8>;
inline constexpr std::size_t kSendPlace = kFingerprintFields.size(), kRecvPlace = kSendPlace + 1,
                             kRowDevice = kRecvPlace + 1;
static_assert(kRowDevice + 1 == std::tuple_size_v<VerifyRow>);

inline VerifyRow verify_row(const Op& op, std::int64_t send_place, std::int64_t recv_place, int device) {
  const auto f = op.fingerprint();
  return {f[0], f[1], f[2], f[3], f[4], send_place, recv_place, device};
}

// The error every rank throws when the rows of one collective disagree ("" when they
// agree): the first field that differs, with each rank's value (in every engine's
// words), else the buffers that their devices cannot use. `table` holds every rank's
// VerifyRow, in rank order.
inline std::string verify_message(const Op& mine, const GroupInfo& group, std::span<const std::int64_t> table) {
  constexpr std::size_t kWidth = std::tuple_size_v<VerifyRow>;
  if (std::string fields = mismatch_message(name_of(mine.kind), group, table, kWidth, kFingerprintFields);
      !fields.empty())
    return fields;
  std::vector<BufferPlace> buffers;
  for (std::size_t r = 0; r < table.size() / kWidth; ++r) {
    const auto row = table.subspan(r * kWidth, kWidth);
    buffers.push_back({static_cast<int>(r), "send", row[kSendPlace], row[kRowDevice]});
    buffers.push_back({static_cast<int>(r), "recv", row[kRecvPlace], row[kRowDevice]});
  }
  return misplaced_message(mine, group, buffers);
}

// The end of a timeout's report when every rank has arrived and NCCL did not complete.
inline constexpr std::string_view kNcclStalled = " (NCCL_DEBUG=WARN may say why)";

// How many operations of a batch its messages list (pipeline batches hold two to four).
inline constexpr std::size_t kListedBatchOps = 8;

// "a batch of 2 sends and receives (send(f32, count 4, to 1), recv(f32, count 4, from 1))"
inline std::string describe_batch(std::span<const Op> ops) {
  std::string s = concat("a batch of ", ops.size(), ops.size() == 1 ? " send or receive (" : " sends and receives (");
  for (std::size_t i = 0; i < ops.size() && i < kListedBatchOps; ++i) s += concat(i ? ", " : "", ops[i].describe());
  if (ops.size() > kListedBatchOps) s += concat(", and ", ops.size() - kListedBatchOps, " more");
  return s + ")";
}

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
  mpi::Channel control;
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
    const bool healthy = comm != nullptr && complete_ && aborted.empty() && !unwinding && mpi::usable();
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
    mpi::Backoff backoff;
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
    const ncclResult_t r = grouped([&](auto keep) {
      for (int p = 0; p < size; ++p) {
        if (p == rank) continue;
        const std::size_t at = static_cast<std::size_t>(p) * block;
        keep(ncclSend(send + at, op.count, type, p, comm, stream));
        keep(ncclRecv(recv + at, op.count, type, p, comm, stream));
      }
    });
    complete(r, what, deadline);
  }

  // The sends and receives of a batch, in one NCCL group (those of 0 elements enqueue
  // nothing).
  void enqueue_batch(std::span<const Op> ops, Clock::time_point deadline) {
    const auto what = [&] { return concat(describe_batch(ops), " on ", group.describe()); };
    const ncclResult_t r = grouped([&](auto keep) {
      for (const Op& op : ops) {
        if (op.count == 0) continue;
        keep(op.kind == Collective::send ? ncclSend(op.send, op.count, to_nccl(op.type), op.root, comm, stream)
                                         : ncclRecv(op.recv, op.count, to_nccl(op.type), op.root, comm, stream));
      }
    });
    complete(r, what, deadline);
  }

  // Calls enqueue(keep) between ncclGroupStart and ncclGroupEnd, where keep(result)
  // records the first NCCL call that failed. The group is closed even after an error.
  // Returns that error, else what ncclGroupEnd returned (ncclInProgress on this
  // non-blocking communicator, for complete() to settle).
  template <class Enqueue>
  static ncclResult_t grouped(Enqueue&& enqueue) {
    ncclResult_t first_error = ncclSuccess;
    const auto keep = [&](ncclResult_t r) {
      if (first_error == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first_error = r;
    };
    keep(ncclGroupStart());
    enqueue(keep);
    const ncclResult_t end = ncclGroupEnd();
    return first_error != ncclSuccess ? first_error : end;
  }
};

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
      detail::mpi::Backoff backoff;
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
        LLMPAR_CHECK_CUDA(done, what(), " on ", s.group.describe(), ": waiting for it failed");
      ncclResult_t async = ncclSuccess;
      const ncclResult_t query = ncclCommGetAsyncError(s.comm, &async);
      if (query != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
        const ncclResult_t r = query != ncclSuccess ? query : async;
        s.fail(detail::concat(what(), " on ", s.group.describe(), " failed on ", s.group.member(s.rank),
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
        s.fail(detail::concat(what(), " on ", s.group.describe(), " did not start within ", s.options.timeout.count(),
                              " ms on ", s.group.member(s.rank),
                              ": earlier work on its compute stream or its communication stream has not finished "
                              "(a kernel that does not end, or an earlier operation that never completed)"));
      if (batch_.empty()) s.fail(s.control.timed_out(op_, s.group, number_, "").message);
      std::string report;  // who each operation of the batch waits for
      for (std::size_t i = 0; i < batch_.size() && i < detail::kListedBatchOps; ++i)
        report += detail::concat(i ? "; " : "", batch_[i].describe(), ": ",
                                 s.control.arrivals(batch_[i], s.group, batch_numbers_[i]));
      s.fail(detail::mpi::timeout_message(what(), s.group, s.rank, s.options.timeout, "", report));
    }

    // Makes `stream` wait, on the device and without blocking the host, for this
    // operation. Its errors and timeout surface at a wait() or test().
    void wait_on(cudaStream_t stream) const {
      LLMPAR_CHECK(state_ != nullptr, "this NcclComm::Request was moved from");
      if (!finished_) LLMPAR_CHECK_CUDA(cudaStreamWaitEvent(stream, done_, 0));
    }

   private:
    friend class NcclComm;
    Request(std::shared_ptr<detail::NcclState> state, const Op& op, std::uint64_t number)
        : state_(std::move(state)), op_(op), number_(number) {
      start_ = state_->take_event();
      try {
        done_ = state_->take_event();
      } catch (...) {
        release();
        throw;
      }
    }
    // A batch, and each operation's number in its arrival counter.
    Request(std::shared_ptr<detail::NcclState> state, std::vector<Op> batch, std::vector<std::uint64_t> numbers)
        : Request(std::move(state), Op{}, 0) {
      batch_ = std::move(batch);
      batch_numbers_ = std::move(numbers);
    }
    // Finished already: an empty batch.
    explicit Request(std::shared_ptr<detail::NcclState> state) : state_(std::move(state)), finished_(true) {}

    // What it is, for messages.
    std::string what() const { return batch_.empty() ? op_.describe() : detail::describe_batch(batch_); }

    void take(Request& other) noexcept {
      state_ = std::move(other.state_);
      op_ = other.op_;
      number_ = other.number_;
      batch_ = std::move(other.batch_);
      batch_numbers_ = std::move(other.batch_numbers_);
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
    std::uint64_t number_ = 0;  // its number in its arrival counter
    std::vector<Op> batch_;     // a batch's operations (then op_ is unused)
    std::vector<std::uint64_t> batch_numbers_;
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
    s.control.open(comm, options.timeout, what, detail::kNcclStalled);
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
    if (p2p && s.options.verify) check_p2p_buffer(op);
    const std::uint64_t number = s.control.board().enter(op);
    if (s.options.verify) verify(op, number, deadline);

    LLMPAR_CHECK_CUDA(cudaEventRecord(s.compute_ready, s.compute));
    LLMPAR_CHECK_CUDA(cudaStreamWaitEvent(s.stream, s.compute_ready, 0));
    Request request(state_, op, number);
    LLMPAR_CHECK_CUDA(cudaEventRecord(request.start_, s.stream));
    s.enqueue(op, deadline);
    LLMPAR_CHECK_CUDA(cudaEventRecord(request.done_, s.stream));
    return request;
  }

  // Enqueues the sends and receives of `ops` as one NCCL group on stream(), after the
  // compute stream's earlier work; one Request for them all. An empty batch is finished.
  Request start_batch(std::span<const Op> ops) {
    detail::NcclState& s = state();
    s.check_usable();
    if (ops.empty()) return Request(state_);
    detail::DeviceGuard guard(s.device);
    s.control.prune();
    const auto deadline = detail::Clock::now() + s.options.timeout;
    if (s.options.verify)
      for (const Op& op : ops) check_p2p_buffer(op);
    std::vector<std::uint64_t> numbers;
    numbers.reserve(ops.size());
    for (const Op& op : ops) numbers.push_back(s.control.board().enter(op));
    if (s.options.verify) {
      // Every send tells its receiver what comes before any receive waits to hear from
      // its sender, so two ranks that send to each other in one batch do not wait on
      // each other here either.
      for (std::size_t i = 0; i < ops.size(); ++i)
        if (ops[i].kind == Collective::send) verify(ops[i], numbers[i], deadline);
      for (std::size_t i = 0; i < ops.size(); ++i)
        if (ops[i].kind == Collective::recv) verify(ops[i], numbers[i], deadline);
    }

    LLMPAR_CHECK_CUDA(cudaEventRecord(s.compute_ready, s.compute));
    LLMPAR_CHECK_CUDA(cudaStreamWaitEvent(s.stream, s.compute_ready, 0));
    Request request(state_, std::vector<Op>(ops.begin(), ops.end()), std::move(numbers));
    LLMPAR_CHECK_CUDA(cudaEventRecord(request.start_, s.stream));
    s.enqueue_batch(ops, deadline);
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
    const std::uint64_t number = s.control.board().enter(Op{});

    // Who goes where; this also proves that every rank is here before the blocking calls.
    const std::array<std::int64_t, 2> mine{color, key};
    const auto all = s.control.all_gather(mine, deadline, "split");
    if (!all)
      s.fail(detail::mpi::timeout_message(detail::concat("split into '", name, "'"), s.group, s.rank, s.options.timeout,
                                          "", s.control.arrivals(Op{}, s.group, number)));
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
    c.control.adopt(sub, what, detail::kNcclStalled);
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

  // Verify mode for a send or recv: its buffer must be memory of this device (a local
  // check: the peer learns of a failure by timing out).
  void check_p2p_buffer(const Op& op) {
    const detail::NcclState& s = state();
    const bool sending = op.kind == Collective::send;
    const detail::BufferPlace mine{
        s.rank, sending ? "send" : "recv",
        op.count ? detail::buffer_place(sending ? op.send : op.recv, s.device) : detail::kUsable, s.device};
    if (std::string error = detail::misplaced_message(op, s.group, std::span(&mine, 1)); !error.empty())
      LLMPAR_FAIL(error);
  }

  // Verify mode: the ranks compare the operation before it is enqueued.
  void verify(const Op& op, std::uint64_t number, detail::Clock::time_point deadline) {
    detail::NcclState& s = state();
    detail::mpi::ControlOutcome outcome;
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
      const detail::VerifyRow row = detail::verify_row(op, send_place, recv_place, s.device);
      outcome = s.control.verify(op, s.group, row, detail::kFingerprintFields.size(), 2, number, deadline);
    }
    if (outcome.kind == detail::mpi::ControlOutcome::mismatch)
      LLMPAR_FAIL(detail::verify_message(op, s.group, outcome.rows));
    if (outcome.kind == detail::mpi::ControlOutcome::broken) s.fail(outcome.message);
  }

  std::shared_ptr<detail::NcclState> state_;
  int uncaught_ = 0;
};

static_assert(Communicator<NcclComm>);
static_assert(Request<NcclComm::Request>);

}  // namespace llmpar::comm
