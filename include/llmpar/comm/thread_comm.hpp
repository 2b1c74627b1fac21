// llmpar/comm/thread_comm.hpp — N ranks as threads of one process, over shared memory.
//
// This engine is what the test suite and `--ranks N` runs use, so it is built to be
// both fast and exactly reproducible:
//
// * Real algorithms, no rank-0 funnel. all_reduce is a reduce-scatter fused with an
//   all-gather: rank r reduces slice r of every rank's input (reading the other ranks'
//   buffers in place) and writes the result straight into every rank's output, so
//   each input is read once and each output written once, in one round; large
//   messages are written with non-temporal stores. reduce, reduce_scatter,
//   all_gather, broadcast and all_to_all likewise split the work so every rank moves
//   about 1/N of the data. Small messages (under kSmallMessageBytes) are staged and
//   reduced whole by every rank instead, which costs less when latency, not
//   bandwidth, is what matters.
// * A fixed reduction order: every element is reduced over ranks 0, 1, ..., N-1 in
//   that order, in float for bf16/f16 (rounded once), by exactly one rank (or, for
//   small messages, identically by every rank). Results are bitwise identical on every
//   rank and from run to run, whatever the thread timing.
// * Synchronisation is per-rank arrival epochs (one cache line each): a rank that
//   enters phase e stores e in its own line and waits until every member's line is
//   >= e. Waiters spin briefly, then yield, then sleep on a condition variable, so
//   oversubscribed runs (more ranks than cores) do not burn the cores they wait for.
//   Knowing *which* lines are behind is what lets a timeout name the missing ranks.
// * Checks are always on (they cost one comparison per rank): a collective whose kind,
//   type, count, reduction or root differs between ranks throws on every rank with the
//   field and each rank's value. A rank that does not arrive within the timeout makes
//   the others throw an error naming the collective, the group and the missing ranks;
//   the world is then aborted, so every rank's next operation fails with that message.
//   A rank whose thread throws aborts the world the same way (see run_threads).
// * Point to point uses per-pair mailboxes: whichever side of a send/recv pair arrives
//   second does the copy, so send_async/recv_async in any order never deadlock. A batch
//   (start_batch) posts each of its operations the same way, in order, before waiting
//   for any; its Request waits for them all.
// * Asynchronous collectives run on a per-communicator worker thread, in issue order;
//   a synchronous call runs inline when nothing is queued (the common case).
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "llmpar/comm/communicator.hpp"
#include "llmpar/comm/detail/verify.hpp"
#include "llmpar/comm/types.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace llmpar::comm {

struct ThreadOptions {
  // How long a rank waits for the others before it names the missing ones and fails.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // OpenMP threads each rank's kernels use; 0: the process's OpenMP threads divided
  // evenly between the ranks (at least 1), so N ranks do not oversubscribe the cores.
  int omp_threads_per_rank = 0;
};

class ThreadComm;

namespace detail {

inline constexpr std::size_t kSmallMessageBytes = 32 * 1024;
inline constexpr std::size_t kCacheLine = 64;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Shared by every rank (and every sub-communicator) of one thread world.
struct ThreadWorld {
  explicit ThreadWorld(ThreadOptions opts) : options(opts) {}

  ThreadOptions options;
  std::atomic<bool> aborted{false};
  std::mutex message_mutex;
  std::string abort_message;

  // Sleeping waiters park here; anyone who changes what they wait for calls wake().
  std::mutex sleep_mutex;
  std::condition_variable sleep_cv;
  std::atomic<int> sleepers{0};

  void wake() {
    if (sleepers.load() > 0) {
      { std::lock_guard lock(sleep_mutex); }
      sleep_cv.notify_all();
    }
  }

  // The first message wins; every waiter wakes and throws it.
  void abort(const std::string& message) {
    {
      std::lock_guard lock(message_mutex);
      if (!aborted.load()) abort_message = message;
      aborted.store(true);
    }
    { std::lock_guard lock(sleep_mutex); }
    sleep_cv.notify_all();
  }

  [[noreturn]] void throw_aborted() {
    std::string message;
    {
      std::lock_guard lock(message_mutex);
      message = abort_message;
    }
    LLMPAR_FAIL("the thread world was aborted: ", message);
  }

  // Waits until ready() holds. Returns false at the deadline; throws if the world is
  // aborted meanwhile.
  template <class Ready>
  bool wait_until(Ready&& ready, std::chrono::steady_clock::time_point deadline) {
    for (int i = 0; i < 4096; ++i) {
      if (ready()) return true;
      if (aborted.load(std::memory_order_relaxed)) throw_aborted();
      cpu_relax();
    }
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      if (aborted.load(std::memory_order_relaxed)) throw_aborted();
      std::this_thread::yield();
    }
    while (true) {
      if (ready()) return true;
      if (aborted.load()) throw_aborted();
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return ready();
      std::unique_lock lock(sleep_mutex);
      sleepers.fetch_add(1);
      if (!ready() && !aborted.load())
        sleep_cv.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(2)));
      sleepers.fetch_sub(1);
    }
  }
};

// What a member posts for one operation. Each member keeps two, used by the parity of
// the operation's arrival epoch: a rank that finished operation k may post k+1 while
// slower ranks still read what was posted for k, but it cannot post k+2 before every
// rank arrived at k+1, by which time nobody reads k's post any more.
struct ThreadPost {
  Op op;
  const void* send = nullptr;  // what the others read (a staged copy for small messages)
  bool splitting = false;      // in split() rather than an Op
};

// One member's line: its arrival epoch and its posts.
struct alignas(kCacheLine) ThreadSlot {
  std::atomic<std::uint64_t> epoch{0};
  ThreadPost posts[2];
  int color = 0, key = 0;
  std::shared_ptr<struct ThreadGroup> split_child;
  std::vector<std::byte> staging;
};

// A send or receive waiting in a mailbox, shared with the Request that waits on it.
struct P2pPost {
  Op op;
  int rank = 0;  // who posted it
  std::atomic<bool> done{false};
  std::string error;  // set before done when the pair did not match
};

struct Mailbox {
  std::mutex mutex;
  std::deque<std::shared_ptr<P2pPost>> sends, recvs;
};

struct ThreadGroup {
  ThreadGroup(std::shared_ptr<ThreadWorld> w, GroupInfo i)
      : world(std::move(w)),
        info(std::move(i)),
        size(static_cast<int>(info.world_ranks.size())),
        slots(static_cast<std::size_t>(size)),
        mailboxes(static_cast<std::size_t>(size) * static_cast<std::size_t>(size)) {}

  std::shared_ptr<ThreadWorld> world;
  GroupInfo info;
  int size;
  std::vector<ThreadSlot> slots;
  std::vector<Mailbox> mailboxes;  // [src * size + dst]

  Mailbox& mailbox(int src, int dst) { return mailboxes[static_cast<std::size_t>(src * size + dst)]; }
};

// The asynchronous queue of one communicator: a thread that runs tasks in order.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void push(std::function<void()> task) {
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(task));
      ++pending_;
    }
    cv_.notify_all();
  }
  bool idle() {
    std::lock_guard lock(mutex_);
    return pending_ == 0;
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();  // tasks catch their own exceptions into their Request
      lock.lock();
      --pending_;
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  int pending_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// What a Request waits on: a finished flag and the error, if any.
struct Completion {
  std::atomic<bool> done{false};
  std::exception_ptr error;

  // No deadline here: the operation itself times out and finishes with that error.
  void wait_done(ThreadWorld& world) const {
    world.wait_until([&] { return done.load(std::memory_order_acquire); },
                     std::chrono::steady_clock::time_point::max());
  }
};

}  // namespace detail

namespace detail {

// One rank's endpoint in one group. Lives on the heap so that the worker's queued
// tasks can keep pointing at it when the ThreadComm handle that owns it moves.
class ThreadMember {
 public:
  ThreadMember(std::shared_ptr<ThreadGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  ~ThreadMember() { worker_.reset(); }  // queued work finishes before the state goes
  ThreadMember(const ThreadMember&) = delete;
  ThreadMember& operator=(const ThreadMember&) = delete;

  int rank() const { return rank_; }
  int size() const { return group_->size; }
  const GroupInfo& group() const { return group_->info; }
  ThreadWorld& world() const { return *group_->world; }
  const std::shared_ptr<ThreadWorld>& world_ptr() const { return group_->world; }
  const std::shared_ptr<ThreadGroup>& group_ptr() const { return group_; }

  // Runs a collective inline when nothing is queued; otherwise behind the queue.
  void run(const Op& op);

  // Queues a collective on the worker; the Completion reports its end and error.
  std::shared_ptr<Completion> start(const Op& op);

  // Members with the same color form a group, ordered by (key, rank). Collective.
  std::shared_ptr<ThreadGroup> split(int color, int key, std::string name, int& child_rank);

  // Posts a send or receive in the pair's mailbox. Whoever arrives second checks that
  // the pair matches and copies; the returned post completes when that happened.
  std::shared_ptr<P2pPost> post(const Op& op);

 private:
  ThreadSlot& slot(int r) { return group_->slots[static_cast<std::size_t>(r)]; }

  // Post op, wait for every member to reach the same epoch, verify they all agree.
  void arrive(const Op& op, const void* send = nullptr, bool splitting = false);

  // What member r posted for the operation in progress.
  const ThreadPost& posted(int r) { return slot(r).posts[current_]; }

  // A barrier among the members: every member's epoch reaches ours, or the timeout
  // names the members that did not arrive.
  void sync(const Op& op, const char* label = nullptr);

  [[noreturn]] void throw_mismatch(const Op& op, bool splitting);

  void execute(const Op& op);

  // all_reduce and reduce. Rank r reduces slice r of every rank's input and writes it
  // straight into every output (all_reduce: every rank's; reduce: the root's), so each
  // input is read once and each output written once, in one round. In place is safe:
  // only rank r reads or writes slice r of anyone's buffer, and it reads a chunk
  // before it writes it.
  template <class T>
  void reduce_op(const Op& op, int n);

  template <class T>
  void reduce_scatter_op(const Op& op, int n);

  // all_gather, broadcast, all_to_all: each rank pulls what it needs.
  void copy_op(const Op& op, int n);

  std::shared_ptr<ThreadGroup> group_;
  int rank_ = 0;
  std::uint64_t epoch_ = 0;
  std::size_t current_ = 0;  // which of the two posts the operation in progress uses
  std::vector<std::byte> scratch_;
  std::unique_ptr<Worker> worker_;  // last: destroyed first
};

}  // namespace detail

// The handle of one rank in one group. Movable, not copyable; belongs to its rank.
class ThreadComm : public Collectives<ThreadComm> {
 public:
  class Request {
   public:
    Request() = default;
    Request(Request&& other) noexcept { *this = std::move(other); }
    Request& operator=(Request&& other) noexcept {
      if (this != &other) {
        finish_quietly();
        world_ = std::move(other.world_);
        group_ = std::move(other.group_);
        rank_ = other.rank_;
        completion_ = std::move(other.completion_);
        posts_ = std::exchange(other.posts_, {});
        deadline_ = other.deadline_;
      }
      return *this;
    }
    ~Request() { finish_quietly(); }

    // Blocks until the operation finished; throws its error.
    void wait() {
      if (completion_) {
        auto c = std::move(completion_);
        c->wait_done(*world_);
        if (c->error) std::rethrow_exception(c->error);
      }
      if (!posts_.empty()) {
        // Every post is waited for before a mismatch is thrown: a post left behind
        // would still be matched later, into a buffer the caller may have freed.
        const auto posts = std::exchange(posts_, {});
        std::string error;
        for (const auto& p : posts) {
          if (!world_->wait_until([&] { return p->done.load(std::memory_order_acquire); }, deadline_)) {
            const GroupInfo& info = group_->info;
            const std::string message =
                detail::concat(p->op.describe(), " on ", info.describe(), " by ", info.member(rank_),
                               posts.size() > 1 ? detail::concat(" (in a batch of ", posts.size(), ")") : std::string(),
                               " timed out after ", world_->options.timeout.count(), " ms: ", info.member(p->op.root),
                               " did not post the matching ", p->op.kind == Collective::send ? "recv" : "send");
            world_->abort(message);
            throw TimeoutError(message, __FILE__, __LINE__);
          }
          if (error.empty()) error = p->error;
        }
        if (!error.empty()) LLMPAR_FAIL(error);
      }
    }
    // True (after rethrowing any error) once the operation finished.
    bool test() {
      if (completion_ && !completion_->done.load(std::memory_order_acquire)) return false;
      for (const auto& p : posts_)
        if (!p->done.load(std::memory_order_acquire)) return false;
      wait();
      return true;
    }

   private:
    friend class ThreadComm;
    void finish_quietly() noexcept {
      if (!completion_ && posts_.empty()) return;
      try {
        wait();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "llmpar: an operation whose Request was never waited on failed: %s\n", e.what());
      }
    }

    std::shared_ptr<detail::ThreadWorld> world_;
    std::shared_ptr<detail::ThreadGroup> group_;  // for messages: the group and the poster's rank
    int rank_ = 0;
    std::shared_ptr<detail::Completion> completion_;       // a collective
    std::vector<std::shared_ptr<detail::P2pPost>> posts_;  // sends and receives, in posting order
    std::chrono::steady_clock::time_point deadline_{};
  };

  ThreadComm(std::shared_ptr<detail::ThreadGroup> group, int rank)
      : member_(std::make_unique<detail::ThreadMember>(std::move(group), rank)) {}

  int rank() const { return member_->rank(); }
  int size() const { return member_->size(); }
  const GroupInfo& group() const { return member_->group(); }
  const ThreadOptions& options() const { return member_->world().options; }

  void run(const Op& op) {
    if (op.kind == Collective::send || op.kind == Collective::recv)
      start(op).wait();
    else
      member_->run(op);
  }

  Request start(const Op& op) {
    if (op.kind == Collective::send || op.kind == Collective::recv) return start_batch(std::span(&op, 1));
    Request request;
    request.world_ = member_->world_ptr();
    request.completion_ = member_->start(op);
    return request;
  }

  // Posts every send and receive of `ops` in its pair's mailbox, in order, and returns
  // one Request for them all: nothing here waits, so no batch can deadlock on itself.
  Request start_batch(std::span<const Op> ops) {
    auto& world = member_->world();
    if (world.aborted.load()) world.throw_aborted();
    Request request;
    request.world_ = member_->world_ptr();
    request.group_ = member_->group_ptr();
    request.rank_ = rank();
    request.deadline_ = std::chrono::steady_clock::now() + world.options.timeout;
    request.posts_.reserve(ops.size());
    for (const Op& op : ops) request.posts_.push_back(member_->post(op));
    return request;
  }

  ThreadComm split(int color, int key, std::string name) {
    int child_rank = 0;
    auto child = member_->split(color, key, std::move(name), child_rank);
    return ThreadComm(std::move(child), child_rank);
  }

 private:
  std::unique_ptr<detail::ThreadMember> member_;
};

// Runs body(ThreadComm& world) on `ranks` threads and returns when all have finished.
// If a rank throws, the world is aborted (every other rank's pending or next operation
// throws, naming that rank and its message) and the first rank's exception is
// rethrown here, unchanged.
template <class Body>
void run_threads(int ranks, Body&& body, ThreadOptions options = {}) {
  LLMPAR_CHECK(ranks >= 1, "the thread world needs at least one rank, got ", ranks, "; use --ranks 1 or more");
  LLMPAR_CHECK(options.timeout.count() > 0, "the communication timeout must be positive, got ", options.timeout.count(),
               " ms");
  auto world = std::make_shared<detail::ThreadWorld>(options);
  GroupInfo info;
  info.name = "world";
  info.world_ranks.resize(static_cast<std::size_t>(ranks));
  std::iota(info.world_ranks.begin(), info.world_ranks.end(), 0);
  auto group = std::make_shared<detail::ThreadGroup>(world, std::move(info));
  const int caller_threads = omp_get_max_threads();
  const int omp_threads =
      options.omp_threads_per_rank > 0 ? options.omp_threads_per_rank : std::max(1, caller_threads / ranks);

  std::mutex error_mutex;
  std::exception_ptr first_error;
  // The first failure is the cause; the others' errors ("the thread world was
  // aborted: rank 3 failed: ...") are its consequences.
  auto rank_main = [&](int rank) {
    try {
      omp_set_num_threads(omp_threads);
      ThreadComm comm(group, rank);
      body(comm);
    } catch (...) {
      std::string what = "an exception that is not a std::exception";
      try {
        throw;
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      std::lock_guard lock(error_mutex);
      if (!first_error) {
        first_error = std::current_exception();
        world->abort(detail::concat("rank ", rank, " failed: ", what));
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks - 1));
  for (int r = 1; r < ranks; ++r) threads.emplace_back(rank_main, r);
  rank_main(0);
  // Rank 0 ran on the caller's thread: give it back its OpenMP thread count (GEMMs
  // partition by it, so a later run would otherwise round differently).
  omp_set_num_threads(caller_threads);
  for (auto& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace llmpar::comm

// The collectives' bodies: compiled here (header-only), or once in a program that
// defines LLMPAR_COMPILED and links the compiled part of llmpar (config.hpp).
#if !defined(LLMPAR_COMPILED)
#include "llmpar/comm/thread_comm-inl.hpp"
#endif
