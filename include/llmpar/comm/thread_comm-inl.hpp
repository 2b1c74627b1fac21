// llmpar/comm/thread_comm-inl.hpp — the bodies of ThreadComm's collectives: the
// host reductions and ThreadMember's operations (comm/thread_comm.hpp).
//
// thread_comm.hpp includes this file unless LLMPAR_COMPILED is defined; a program that
// defines it compiles this file once, in the compiled part of llmpar (src/), where
// LLMPAR_INLINE is empty (config.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "llmpar/comm/thread_comm.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace llmpar::comm::detail {

// ---- element-wise work on the host -------------------------------------------------

template <class T>
using acc_t = typename Accumulator<T>::type;

template <class T>
inline acc_t<T> load(const T& x) {
  if constexpr (kIsFloating<T>)
    return static_cast<float>(x);
  else
    return x;
}

template <class T>
inline T store(acc_t<T> x) {
  if constexpr (kIsFloating<T>)
    return convert<T>(x);
  else
    return x;
}

// Messages at least this large are written with non-temporal stores: they will not
// fit in cache anyway, and streaming saves the read-for-ownership of every line.
inline constexpr std::size_t kStreamingBytes = 4u << 20;

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// For i in [begin, end): out[j][i] = op over ranks k = 0..n-1 of in[k][i], in that
// order, for each of the n_out outputs. One pass: 64-byte blocks of every input are
// read side by side (streams the hardware prefetchers follow) and reduced in
// registers; a short run of results then goes to every output.
template <class T, class Reduce>
void reduce_range(T* const* out, int n_out, const T* const* in, int n, std::size_t begin, std::size_t end,
                  Reduce reduce, ReduceOp op, bool streaming) {
  using A = acc_t<T>;
  constexpr std::size_t kBlock = 64 / sizeof(T);
  const bool avg = op == ReduceOp::avg;
  // Reduces [i, i + len) (len <= kBlock) into result. Whole blocks pass len as a
  // compile-time constant, so their loops are unrolled and vectorised.
  auto reduce_block = [&](std::size_t i, auto len, T* result) {
    A acc[kBlock];
    for (std::size_t j = 0; j < len; ++j) acc[j] = load(in[0][i + j]);
    for (int k = 1; k < n; ++k)
      for (std::size_t j = 0; j < len; ++j) acc[j] = reduce(acc[j], load(in[k][i + j]));
    for (std::size_t j = 0; j < len; ++j) result[j] = store<T>(avg ? finish(op, acc[j], n) : acc[j]);
  };
  auto tail = [&](std::size_t i, std::size_t len) {
    alignas(kCacheLine) T result[kBlock];
    reduce_block(i, len, result);
    for (int o = 0; o < n_out; ++o) std::memcpy(out[o] + i, result, len * sizeof(T));
  };
  std::size_t i = begin;
  // Non-temporal stores need 16-byte aligned destinations: start where out[0] is, and
  // stream only if every output is aligned the same way (buffers from one allocator are).
  const auto misalignment = [&](const T* p) { return reinterpret_cast<std::uintptr_t>(p) % 16; };
  if (streaming) {
    while (i < end && misalignment(out[0] + i) != 0) {
      tail(i, 1);
      ++i;
    }
    for (int o = 1; o < n_out; ++o) streaming = streaming && misalignment(out[o] + i) == 0;
  }
  // An output that is also an input (in place) was just read into the cache: plain
  // stores suit it better than non-temporal ones, which would evict those lines.
  auto stream_to = [&](const T* output) {
    if (!streaming) return false;
    for (int k = 0; k < n; ++k)
      if (output == in[k]) return false;
    return true;
  };
  // Results gather in a 1 KiB run before they go out, so each output receives long
  // runs of whole lines: interleaving every output 64 bytes at a time defeats the
  // write-combining buffers once there are more than two outputs.
  constexpr std::size_t kRun = 1024 / sizeof(T);
  for (; i + kBlock <= end;) {
    alignas(kCacheLine) T result[kRun];
    const std::size_t run = std::min(kRun, (end - i) / kBlock * kBlock);
    for (std::size_t b = 0; b < run; b += kBlock)
      reduce_block(i + b, std::integral_constant<std::size_t, kBlock>{}, result + b);
    for (int o = 0; o < n_out; ++o) {
#if defined(__SSE2__)
      if (stream_to(out[o])) {
        auto* d = reinterpret_cast<__m128i*>(out[o] + i);
        const auto* r = reinterpret_cast<const __m128i*>(result);
        for (std::size_t q = 0; q < run * sizeof(T) / 16; ++q) _mm_stream_si128(d + q, _mm_load_si128(r + q));
        continue;
      }
#endif
      std::memcpy(out[o] + i, result, run * sizeof(T));
    }
    i += run;
  }
  if (i < end) tail(i, end - i);
  if (streaming) stream_fence();
}

template <class T>
void reduce_range(T* const* out, int n_out, const T* const* in, int n, std::size_t begin, std::size_t end,
                  ReduceOp op) {
  using A = acc_t<T>;
  const bool streaming = (end - begin) * sizeof(T) * static_cast<std::size_t>(n) >= kStreamingBytes;
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return reduce_range(
          out, n_out, in, n, begin, end, [](A a, A b) { return combine(ReduceOp::sum, a, b); }, op, streaming);
    case ReduceOp::max:
      return reduce_range(
          out, n_out, in, n, begin, end, [](A a, A b) { return b > a ? b : a; }, op, streaming);
    case ReduceOp::min:
      return reduce_range(
          out, n_out, in, n, begin, end, [](A a, A b) { return b < a ? b : a; }, op, streaming);
  }
}

// [begin, end) of part `part` when `count` is split into `parts` nearly equal pieces.
inline std::pair<std::size_t, std::size_t> split_range(std::size_t count, int parts, int part) {
  const std::size_t p = static_cast<std::size_t>(parts), i = static_cast<std::size_t>(part);
  return {count * i / p, count * (i + 1) / p};
}

LLMPAR_INLINE void ThreadMember::run(const Op& op) {
  if (!worker_ || worker_->idle()) {
    execute(op);
  } else {
    auto done = start(op);
    done->wait_done(world());
    if (done->error) std::rethrow_exception(done->error);
  }
}

LLMPAR_INLINE std::shared_ptr<Completion> ThreadMember::start(const Op& op) {
  if (!worker_) worker_ = std::make_unique<Worker>();
  auto completion = std::make_shared<Completion>();
  worker_->push([this, op, completion] {
    try {
      execute(op);
    } catch (...) {
      completion->error = std::current_exception();
    }
    completion->done.store(true, std::memory_order_release);
    group_->world->wake();
  });
  return completion;
}

LLMPAR_INLINE std::shared_ptr<ThreadGroup> ThreadMember::split(int color, int key, std::string name, int& child_rank) {
  LLMPAR_CHECK(color >= 0, "split on ", group().describe(), ": color ", color, " is negative; use colors >= 0");
  if (worker_ && !worker_->idle()) {  // whatever is queued goes first
    auto done = start(Op{});
    done->wait_done(world());
  }
  auto& me = slot(rank_);
  me.color = color;
  me.key = key;
  me.split_child.reset();
  Op op;  // checked like a barrier, plus the `splitting` flag
  arrive(op, nullptr, true);
  std::vector<int> members;
  for (int r = 0; r < size(); ++r)
    if (slot(r).color == color) members.push_back(r);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return slot(a).key < slot(b).key; });
  const int leader = members.front();
  child_rank = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
  if (leader == rank_) {
    GroupInfo info;
    info.name = std::move(name);
    for (int r : members) info.world_ranks.push_back(group_->info.world_ranks[static_cast<std::size_t>(r)]);
    me.split_child = std::make_shared<ThreadGroup>(group_->world, std::move(info));
  }
  sync(op, "split");
  auto child = slot(leader).split_child;
  sync(op, "split");
  return child;
}

LLMPAR_INLINE std::shared_ptr<P2pPost> ThreadMember::post(const Op& op) {
  auto& w = world();
  if (w.aborted.load()) w.throw_aborted();
  const bool sending = op.kind == Collective::send;
  const int peer = op.root;
  auto mine = std::make_shared<P2pPost>();
  mine->op = op;
  mine->rank = rank_;
  auto& box = sending ? group_->mailbox(rank_, peer) : group_->mailbox(peer, rank_);
  std::shared_ptr<P2pPost> match;
  {
    std::lock_guard lock(box.mutex);
    auto& theirs = sending ? box.recvs : box.sends;
    if (theirs.empty()) {
      (sending ? box.sends : box.recvs).push_back(mine);
      return mine;
    }
    match = std::move(theirs.front());
    theirs.pop_front();
  }
  const Op& s = sending ? op : match->op;
  const Op& r = sending ? match->op : op;
  const std::string error = p2p_mismatch_message(s, sending ? rank_ : peer, r, sending ? peer : rank_, group());
  if (error.empty() && s.count) std::memcpy(r.recv, s.send, s.count * size_of(s.type));
  match->error = error;
  mine->error = error;
  match->done.store(true, std::memory_order_release);
  mine->done.store(true, std::memory_order_release);
  w.wake();
  return mine;
}

LLMPAR_INLINE void ThreadMember::arrive(const Op& op, const void* send, bool splitting) {
  current_ = (epoch_ + 1) % 2;
  slot(rank_).posts[current_] = ThreadPost{op, send, splitting};
  sync(op, splitting ? "split" : nullptr);
  const auto mine = op.fingerprint();
  for (int r = 0; r < size(); ++r)
    if (posted(r).op.fingerprint() != mine || posted(r).splitting != splitting) throw_mismatch(op, splitting);
}

LLMPAR_INLINE void ThreadMember::sync(const Op& op, const char* label) {
  auto& w = world();
  if (w.aborted.load()) w.throw_aborted();
  const std::uint64_t epoch = ++epoch_;
  slot(rank_).epoch.store(epoch, std::memory_order_release);
  w.wake();
  const auto deadline = std::chrono::steady_clock::now() + w.options.timeout;
  auto all_here = [&] {
    for (int r = 0; r < size(); ++r)
      if (slot(r).epoch.load(std::memory_order_acquire) < epoch) return false;
    return true;
  };
  if (w.wait_until(all_here, deadline)) return;
  std::string missing;
  int count = 0;
  for (int r = 0; r < size(); ++r)
    if (slot(r).epoch.load() < epoch) missing += concat(count++ ? ", " : "", group().member(r));
  const std::string message =
      concat(label ? std::string(label) : op.describe(), " on ", group().describe(), " timed out after ",
             w.options.timeout.count(), " ms waiting for ", missing, ", which did not arrive");
  w.abort(message);
  throw TimeoutError(message, __FILE__, __LINE__);
}

LLMPAR_INLINE void ThreadMember::throw_mismatch(const Op& op, bool splitting) {
  std::vector<std::int64_t> table;  // every member's fingerprint, in rank order
  for (int r = 0; r < size(); ++r) {
    auto f = posted(r).op.fingerprint();
    if (posted(r).splitting) f[0] = kSplitKind;  // split is its own kind of collective
    table.insert(table.end(), f.begin(), f.end());
  }
  const std::string message = mismatch_message(splitting ? std::string_view("split") : name_of(op.kind), group(), table,
                                               kFingerprintFields.size(), kFingerprintFields);
  // Everyone has read the slots before anyone reuses them; the group stays usable
  // for the next, matching, operation.
  sync(op);
  LLMPAR_FAIL(message);
}

LLMPAR_INLINE void ThreadMember::execute(const Op& op) {
  const int n = size();
  switch (op.kind) {
    case Collective::barrier:
      arrive(op);
      return;
    case Collective::all_reduce:
    case Collective::reduce:
      return visit_dtype(op.type, [&](auto tag) { reduce_op<decltype(tag)>(op, n); });
    case Collective::reduce_scatter:
      return visit_dtype(op.type, [&](auto tag) { reduce_scatter_op<decltype(tag)>(op, n); });
    case Collective::all_gather:
    case Collective::broadcast:
    case Collective::all_to_all:
      return copy_op(op, n);
    case Collective::send:
    case Collective::recv:
      break;
  }
  LLMPAR_FAIL("unreachable: ", op.describe(), " is not a collective");
}

template <class T>
void ThreadMember::reduce_op(const Op& op, int n) {
  const bool all = op.kind == Collective::all_reduce;
  const std::size_t bytes = op.count * sizeof(T);
  auto& me = slot(rank_);
  const void* send = op.send;
  const bool small = all && bytes <= kSmallMessageBytes;
  if (small) {  // staged: every rank reduces the whole message itself, into its own output
    if (me.staging.size() < kSmallMessageBytes) me.staging.resize(kSmallMessageBytes);
    if (bytes) std::memcpy(me.staging.data(), op.send, bytes);
    send = me.staging.data();
  }
  arrive(op, send);
  std::vector<const T*> in(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) in[static_cast<std::size_t>(r)] = static_cast<const T*>(posted(r).send);
  std::vector<T*> out;
  if (small || !all) {
    out.push_back(static_cast<T*>(small ? op.recv : posted(op.root).op.recv));
  } else {
    for (int i = 0; i < n; ++i) out.push_back(static_cast<T*>(posted((rank_ + i) % n).op.recv));
  }
  const auto [begin, end] = small ? std::pair<std::size_t, std::size_t>{0, op.count} : split_range(op.count, n, rank_);
  reduce_range(out.data(), static_cast<int>(out.size()), in.data(), n, begin, end, op.reduce);
  sync(op);
}

template <class T>
void ThreadMember::reduce_scatter_op(const Op& op, int n) {
  arrive(op, op.send);
  std::vector<const T*> in(static_cast<std::size_t>(n));
  const std::size_t offset = op.count * static_cast<std::size_t>(rank_);
  for (int r = 0; r < n; ++r) in[static_cast<std::size_t>(r)] = static_cast<const T*>(posted(r).send) + offset;
  T* out = static_cast<T*>(op.recv);
  reduce_range(&out, 1, in.data(), n, 0, op.count, op.reduce);
  sync(op);
}

LLMPAR_INLINE void ThreadMember::copy_op(const Op& op, int n) {
  const std::size_t block = op.count * size_of(op.type);
  const void* send = op.send;
  if (op.kind == Collective::all_to_all && op.send == op.recv && block) {  // in place: others read our input
    const std::size_t total = block * static_cast<std::size_t>(n);
    if (scratch_.size() < total) scratch_.resize(total);
    std::memcpy(scratch_.data(), op.send, total);
    send = scratch_.data();
  }
  arrive(op, send);
  auto* recv = static_cast<std::byte*>(op.recv);
  if (block) {
    switch (op.kind) {
      case Collective::all_gather:
        for (int i = 0; i < n; ++i) {
          const int r = (rank_ + i) % n;
          const auto* src = static_cast<const std::byte*>(posted(r).send);
          std::byte* dst = recv + block * static_cast<std::size_t>(r);
          if (src != dst) std::memcpy(dst, src, block);
        }
        break;
      case Collective::broadcast:
        if (rank_ != op.root)
          std::memcpy(recv, posted(op.root).send, block);
        else if (op.send != op.recv)  // the root's own out-of-place copy
          std::memcpy(recv, op.send, block);
        break;
      case Collective::all_to_all:
        for (int i = 0; i < n; ++i) {
          const int r = (rank_ + i) % n;
          const auto* src = static_cast<const std::byte*>(posted(r).send) + block * static_cast<std::size_t>(rank_);
          std::memcpy(recv + block * static_cast<std::size_t>(r), src, block);
        }
        break;
      default:
        break;
    }
  }
  sync(op);
}

}  // namespace llmpar::comm::detail
