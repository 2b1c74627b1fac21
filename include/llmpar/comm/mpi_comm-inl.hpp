// llmpar/comm/mpi_comm-inl.hpp — the bodies of MpiComm's operations and requests.
//
// mpi_comm.hpp includes this file unless LLMPAR_COMPILED is defined; a program that
// defines it compiles this file once, in the compiled part of llmpar (src/), where
// LLMPAR_INLINE is empty (config.hpp).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "llmpar/comm/mpi_comm.hpp"

namespace llmpar::comm {

LLMPAR_INLINE void MpiComm::run(const Op& op) {
  auto& s = state();
  s.check_usable();
  const std::uint64_t number = s.enter(op);
  detail::mpi::State::Watched watched(s, detail::mpi::pack(op), op.count, number);
  if (s.options().verify) s.verify(op, false, number);
  const detail::mpi::Call call = s.plan(op);
  MPI_Status status;  // written by MPI_Recv, read only for a recv
  s.issue<true>(op, call, nullptr, &status);
  s.complete(op, call, status);
}

LLMPAR_INLINE MpiComm MpiComm::split(int color, int key, std::string name) {
  auto& s = state();
  s.check_usable();
  LLMPAR_CHECK(color >= 0, "split of ", s.group().describe(), " into '", name, "': color ", color,
               " is negative; use colors >= 0 (members with the same color form one communicator)");
  const std::uint64_t number = s.enter(Op{});
  detail::mpi::State::Watched watched(
      s, detail::mpi::kSplit | static_cast<std::uint64_t>(static_cast<std::uint32_t>(color)) << 32,
      static_cast<std::uint64_t>(static_cast<std::int64_t>(key)), number);
  MPI_Comm child = MPI_COMM_NULL;
  LLMPAR_CHECK_MPI(MPI_Comm_split(s.comm(), color, key, &child), "split of ", s.group().describe(), " into '", name,
                   "'");
  LLMPAR_CHECK_MPI(MPI_Comm_set_errhandler(child, MPI_ERRORS_RETURN), "split into '", name, "'");
  int child_size = 0;
  LLMPAR_CHECK_MPI(MPI_Comm_size(child, &child_size), "split into '", name, "'");
  GroupInfo group;
  group.name = std::move(name);
  group.world_ranks.resize(static_cast<std::size_t>(child_size));
  int world_rank = s.world_rank();
  LLMPAR_CHECK_MPI(MPI_Allgather(&world_rank, 1, MPI_INT, group.world_ranks.data(), 1, MPI_INT, child), "split into '",
                   group.name, "'");
  return MpiComm(
      std::make_shared<detail::mpi::State>(child, std::move(group), s.options(), s.shared_types(), world_rank));
}

LLMPAR_INLINE void MpiComm::Request::wait() {
  if (!pending_) return;
  auto& s = *state_;
  if (poll()) return;
  if (!s.broken().empty()) {
    abandon({});
    s.check_usable();
  }
  const auto deadline = detail::mpi::Clock::now() + s.options().timeout;
  for (unsigned spin = 1;; ++spin) {
    if (poll()) return;
    if (spin % 64 == 0 && detail::mpi::Clock::now() >= deadline) break;
  }
  // The first operation still in flight is the one reported.
  const Part* late = nullptr;
  for (const Part& p : parts())
    if (late == nullptr && p.request != MPI_REQUEST_NULL) late = &p;
  const std::string what = batch_ && many_.size() > 1
                               ? detail::concat(late->op.describe(), " (in a batch of ", many_.size(), ")")
                               : late->op.describe();
  const std::string report = detail::mpi::timeout_message(what, s.group(), s.rank(), s.options().timeout, "",
                                                          s.arrivals(late->op.kind, late->op.root, late->number));
  abandon(report);
  throw TimeoutError(detail::concat(report, ". The communicator is broken: every later operation on it fails"),
                     __FILE__, __LINE__);
}

LLMPAR_INLINE bool MpiComm::Request::test() {
  if (!pending_) return true;
  if (poll()) return true;
  state_->check_usable();
  return false;
}

LLMPAR_INLINE bool MpiComm::Request::poll() {
  bool all = true;
  for (Part& p : parts()) {
    if (p.request == MPI_REQUEST_NULL) continue;
    int done = 0;
    MPI_Status status{};
    const int code = MPI_Test(&p.request, &done, &status);
    try {
      if (code != MPI_SUCCESS) {
        p.request = MPI_REQUEST_NULL;
        detail::mpi::throw_error(__FILE__, __LINE__, "MPI_Test", code, state_->context(p.op));
      }
      if (!done) {
        all = false;
        continue;
      }
      state_->complete(p.op, p.call, status);
    } catch (...) {
      if (!error_) error_ = std::current_exception();
    }
  }
  if (!all) return false;
  pending_ = false;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return true;
}

LLMPAR_INLINE void MpiComm::Request::abandon(const std::string& reason) {
  pending_ = false;
  for (Part& p : parts()) {
    if (p.request == MPI_REQUEST_NULL) continue;
    state_->break_with(reason, p.request);
    p.request = MPI_REQUEST_NULL;
  }
}

LLMPAR_INLINE void MpiComm::Request::take(Request& other) {
  state_ = std::move(other.state_);
  one_ = std::exchange(other.one_, {});
  many_ = std::exchange(other.many_, {});
  batch_ = other.batch_;
  error_ = std::exchange(other.error_, nullptr);
  pending_ = std::exchange(other.pending_, false);
}

LLMPAR_INLINE void MpiComm::Request::settle() noexcept {
  if (!pending_) return;
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llmpar: an MpiComm request destroyed before wait() failed: %s\n", e.what());
  }
}

LLMPAR_INLINE MpiComm::Request MpiComm::start(const Op& op) {
  auto& s = state();
  s.check_usable();
  Request r;
  r.state_ = state_;
  Request::Part& p = r.one_;
  p.op = op;
  p.number = s.enter(op);
  {
    detail::mpi::State::Watched watched(s, detail::mpi::pack(op), op.count, p.number);
    if (s.options().verify) s.verify(op, true, p.number);
    p.call = s.plan(op);
    s.issue<false>(op, p.call, &p.request, nullptr);
  }
  r.pending_ = true;
  return r;
}

LLMPAR_INLINE MpiComm::Request MpiComm::start_batch(std::span<const Op> ops) {
  auto& s = state();
  s.check_usable();
  Request r;
  r.state_ = state_;
  r.batch_ = true;
  r.many_.reserve(ops.size());
  for (const Op& op : ops) r.many_.push_back({op, s.plan(op)});  // every one checked before any is issued
  r.pending_ = !ops.empty();
  // If an issue fails, the Request waits for those issued before it (a part never issued
  // has a null request, which poll() skips).
  for (Request::Part& p : r.many_) {
    p.number = s.enter(p.op);
    detail::mpi::State::Watched watched(s, detail::mpi::pack(p.op), p.op.count, p.number);
    s.issue<false>(p.op, p.call, &p.request, nullptr);
  }
  return r;
}

LLMPAR_INLINE MpiComm MpiComm::world(MpiOptions options) {
  LLMPAR_CHECK(options.timeout.count() > 0, "MpiOptions::timeout is ", options.timeout.count(),
               " ms; use a positive duration (the default is 5 minutes)");
  detail::mpi::require_mpi("MpiComm::world");
  options.verify = detail::verify_from_environment(options.verify);
  auto types = std::make_shared<const detail::mpi::Types>();
  MPI_Comm comm = MPI_COMM_NULL;
  LLMPAR_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MpiComm::world");
  LLMPAR_CHECK_MPI(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MpiComm::world");
  int rank = 0, size = 0;
  LLMPAR_CHECK_MPI(MPI_Comm_rank(comm, &rank), "MpiComm::world");
  LLMPAR_CHECK_MPI(MPI_Comm_size(comm, &size), "MpiComm::world");
  // Verify mode is a protocol: one rank asking for it switches it on everywhere.
  int verify = options.verify ? 1 : 0;
  LLMPAR_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &verify, 1, MPI_INT, MPI_MAX, comm), "MpiComm::world");
  options.verify = verify != 0;
  GroupInfo group;
  group.name = "world";
  group.world_ranks.resize(static_cast<std::size_t>(size));
  std::iota(group.world_ranks.begin(), group.world_ranks.end(), 0);
  return MpiComm(std::make_shared<detail::mpi::State>(comm, std::move(group), options, std::move(types), rank));
}

}  // namespace llmpar::comm
