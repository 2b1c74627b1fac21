// llmpar/parallel/comm_thread.hpp — the data-parallel communication thread, and the
// record of what it did.
//
// Gradient buckets are reduced, and ZeRO-3 units gathered, on one thread that issues the
// blocking collectives on the data-parallel communicator in the order they were submitted,
// so communication overlaps the rest of backward on every engine (MPI progresses a
// blocking call; a non-blocking one would need polling). One thread for both keeps the
// order of collectives on the dp communicator the same on every rank: the bucket reducer
// and the parameter gatherer (bucket_reducer.hpp, param_gatherer.hpp) submit to the same
// CommThread. The dp communicator belongs to that thread during a step and to the caller
// between steps.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

namespace llmpar::parallel {

// One entry of the event trace (DataConfig::trace).
struct TraceEvent {
  enum class Kind : std::uint8_t { backward_done, issued, reduced, gathered };
  Kind kind;
  int index;  // the unit (backward_done) or the bucket
};

// A thread that runs tasks in the order they were submitted, created on first use.
// wait(ticket) returns when the task has run, rethrowing its exception. It also keeps
// what a step's communication cost the compute thread (exposed seconds: what overlap did
// not hide) and, when asked, the trace of events.
class CommThread {
 public:
  using Ticket = std::uint64_t;
  CommThread() = default;
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;
  ~CommThread() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  Ticket submit(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    tasks_.push_back(std::move(task));
    wake_.notify_all();
    return ++submitted_;
  }
  // Waits for ticket t (0: nothing), adding the wait to the exposed time.
  void wait(Ticket t) {
    if (t == 0) return;
    const auto t0 = std::chrono::steady_clock::now();
    {
      std::unique_lock<std::mutex> lock(mutex_);
      done_cv_.wait(lock, [&] { return finished_ >= t || error_; });
      if (error_) std::rethrow_exception(error_);
    }
    expose(t0);
  }
  bool done(Ticket t) {
    std::lock_guard<std::mutex> lock(mutex_);
    return finished_ >= t;
  }
  // Every task submitted so far has run.
  void drain() {
    Ticket last = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      last = submitted_;
    }
    wait(last);
  }

  // Runs `task` on the calling thread (no overlap: all of it is exposed).
  template <class Task>
  void run_here(Task&& task) {
    const auto t0 = std::chrono::steady_clock::now();
    task();
    expose(t0);
  }

  // Seconds the compute thread waited for communication since reset_exposed().
  double exposed_seconds() const { return exposed_; }
  void reset_exposed() { exposed_ = 0.0; }
  void expose(std::chrono::steady_clock::time_point t0) {
    exposed_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // The event trace (when the data-parallel config asks for one); either thread records.
  void record(TraceEvent e) {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    events_.push_back(e);
  }
  std::span<const TraceEvent> trace() const { return events_; }
  void clear_trace() { events_.clear(); }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      std::exception_ptr error;
      if (!error_) {
        try {
          task();
        } catch (...) {
          error = std::current_exception();
        }
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++finished_;
        if (error && !error_) error_ = error;
      }
      done_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, done_cv_;
  std::deque<std::function<void()>> tasks_;
  Ticket submitted_ = 0, finished_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  double exposed_ = 0.0;
  std::mutex trace_mutex_;
  std::vector<TraceEvent> events_;
  std::thread thread_;  // last: started on the first submit, joined before the rest goes
};

}  // namespace llmpar::parallel
