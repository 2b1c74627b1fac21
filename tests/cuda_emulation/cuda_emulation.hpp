// tests/cuda_emulation/cuda_emulation.hpp — llmpar's CUDA kernels, run on the CPU.
//
// Why. Most of llmpar's development machines have no GPU, and the GPU ones are lent for
// minutes. A kernel header compiled by the host compiler against this file (through the
// stand-in <cuda_runtime.h> next to it, with LLMPAR_CUDA_EMULATION defined) runs its
// real launchers and kernels on the CPU: every CUDA thread executes the kernel's own
// code, barriers and warp collectives synchronise real threads of execution, and the
// tensor-core wrappers compute what the PTX ISA says the instructions compute. Indexing,
// masking, tiling, shared-memory layout and fragment-layout mistakes then show on any
// machine, in a ctest.
//
// How.
//  - CUDA's keywords become plain C++ (__global__, __device__, __launch_bounds__ vanish,
//    __forceinline__ is inline); threadIdx, blockIdx, blockDim and gridDim are
//    thread_local variables that the scheduler sets.
//  - launch() runs the grid's CTAs one after another on the calling thread, each CTA as
//    one fiber (ucontext, 256 KiB stack below a guard page) per CUDA thread. A fiber
//    runs until it reaches a barrier or a warp collective, where it parks until the
//    last participant arrives; the scheduler then runs another ready fiber. The
//    schedule is cooperative, so a thread runs as far as it can before anyone else
//    moves: a missing barrier shows as a read of shared memory nobody wrote yet. With
//    Device::schedule_seed != 0 the CTA order, the order parked fibers resume in, and
//    whether a barrier's last arriver yields are drawn from that seed: a kernel whose
//    results depend on the interleaving gives different bits under different seeds.
//  - Global memory is the host memory the pointers point to. The dynamic shared memory
//    is a buffer per CTA, 128-byte aligned, filled with 0xFF bytes (NaN in every float
//    type) at the start of each CTA and followed by 256 more 0xFF bytes, checked when the
//    CTA ends (a write past the launch's shared_bytes).
//  - Static __shared__ variables are static thread_local ones: one per CTA in flight
//    (not NaN-filled, unlike the dynamic shared memory).
//  - Warp collectives (__shfl_xor_sync, __shfl_down_sync, __shfl_sync, __syncwarp,
//    mma.m16n8k16, ldmatrix) exchange the
//    lanes' operands through a per-warp buffer; all 32 lanes must make the same call
//    (else: an error naming both calls). mma.m16n8k16 multiplies exactly (the products
//    of 16-bit operands are exact in float), sums the 16 products and C in double and
//    rounds once to float; the hardware's adder tree rounds differently, within float
//    rounding of the result. ldmatrix checks that each row address is 16-byte aligned
//    and inside the CTA's dynamic shared memory.
//  - The launch configuration is checked as the runtime does (block <= 1024 threads,
//    grid y, z <= 65535, dynamic shared memory above 48 KiB only after
//    cudaFuncSetAttribute) against an sm_80 CTA's 163 KiB, the smallest GPU llmpar
//    targets; a bad one sets the error cudaGetLastError returns (LLMPAR_CHECK_LAUNCH).
//  - A kernel error (a barrier some threads never reach, lanes disagreeing on a
//    collective, a bad ldmatrix address, a write past the shared memory) prints the
//    block, thread and reason, and aborts: a fiber cannot throw through a context switch.
// What it does not model: timing, occupancy, registers (nvcc -Xptxas -v tells those),
// memory coalescing and bank conflicts, the device's expf (math::exp takes its host
// branch, within 2 ulp of it), atomics, and data races a cooperative schedule cannot
// produce (two threads racing between the same two barriers with no read of the other's
// data).
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "llmpar/core/dtype.hpp"

// ---- CUDA's vocabulary ------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// A CTA's threads are fibers of one OS thread and CTAs run one after another on it, so
// a static thread_local variable is one per CTA in flight: CUDA's __shared__ variable
// (zero at first, then what the previous CTA left, where the hardware's is undefined).
#define __shared__ static thread_local

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

struct CUstream_st;
using cudaStream_t = CUstream_st*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

// The built-in variables of the CUDA thread running now (set by the scheduler).
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace llmpar::emulation {

inline constexpr std::size_t kDefaultSharedBytes = 48 * 1024;  // without cudaFuncSetAttribute
inline constexpr std::size_t kMaxSharedBytes = 163 * 1024;     // an sm_80 CTA's most
inline constexpr int kMaxThreads = 1024;

// The emulated GPU's state: what the CUDA runtime keeps per process.
struct Device {
  cudaError_t last_error = cudaSuccess;
  std::map<std::uintptr_t, std::size_t> max_dynamic_shared;  // per kernel, from cudaFuncSetAttribute
  std::uint64_t schedule_seed = 0;  // 0: CTAs and threads in order; else shuffled from this seed
  std::int64_t launches = 0;        // kernels run (a test can count what a launcher launched)
};
inline Device& device() {
  static Device d;
  return d;
}

namespace detail {

inline constexpr std::size_t kStackBytes = 256 * 1024;
inline constexpr std::size_t kGuardBytes = 256;
inline constexpr int kSlotBytes = 48;  // the largest operand one lane gives a collective

// Threads that wait for `expected` arrivals; the last one releases the others.
struct Barrier {
  int expected = 0;
  int arrived = 0;
  std::vector<int> waiting;  // parked fibers
};

// A warp's collective calls: lane l writes its operands into slot[c % 2][l] at its c-th
// call and reads everyone's after the barrier. Two slots suffice: no lane writes call
// c + 2's operands before every lane has arrived at call c + 1, after its reads of c.
struct Warp {
  Barrier barrier;
  std::array<unsigned, 32> calls{};
  alignas(16) unsigned char slot[2][32][kSlotBytes];
  const char* op[2][32];
};

struct Fiber {
  ucontext_t context;
  void* mapping = nullptr;  // guard page, then the stack
  bool done = false;
};

class Cta;
inline thread_local Cta* current_cta = nullptr;

// Runs CTAs, one fiber per thread; one per OS thread, reused from launch to launch.
class Cta {
 public:
  Cta() : shared_storage_(kMaxSharedBytes + kGuardBytes + 128) {
    const auto address = reinterpret_cast<std::uintptr_t>(shared_storage_.data());
    shared_ = shared_storage_.data() + (128 - address % 128) % 128;
  }
  Cta(const Cta&) = delete;
  Cta& operator=(const Cta&) = delete;
  ~Cta() {
    for (Fiber& f : fibers_)
      if (f.mapping != nullptr) munmap(f.mapping, kStackBytes + page());
  }

  // Runs body(context) once per thread of block `index` and returns when all have ended.
  void run(dim3 grid, dim3 block, uint3 index, std::size_t shared_bytes, void (*body)(void*), void* context,
           std::mt19937_64* rng) {
    const int threads = static_cast<int>(block.x * block.y * block.z);
    grid_ = grid;
    block_ = block;
    index_ = index;
    shared_bytes_ = shared_bytes;
    body_ = body;
    context_ = context;
    rng_ = rng;
    std::memset(shared_, 0xFF, shared_bytes + kGuardBytes);
    if (static_cast<int>(fibers_.size()) < threads) fibers_.resize(threads);
    for (int t = 0; t < threads; ++t) start_fiber(t);
    live_ = threads;
    cta_barrier_ = Barrier{threads, 0, {}};
    warps_.assign((threads + 31) / 32, Warp{});
    for (std::size_t w = 0; w < warps_.size(); ++w)
      warps_[w].barrier.expected = std::min(32, threads - static_cast<int>(w) * 32);
    ready_.clear();
    for (int t = 0; t < threads; ++t) ready_.push_back(t);
    if (rng_ != nullptr) std::shuffle(ready_.begin(), ready_.end(), *rng_);

    current_cta = this;
    blockIdx = index;
    blockDim = block;
    gridDim = grid;
    enter(pop_ready());
    swapcontext(&launcher_, &fibers_[current_].context);
    current_ = -1;
    current_cta = nullptr;
    if (live_ > 0) fail(deadlock());
    for (std::size_t i = 0; i < kGuardBytes; ++i)
      if (shared_[shared_bytes + i] != 0xFF)
        fail("a thread wrote " + std::to_string(i) + " bytes past the launch's " + std::to_string(shared_bytes) +
             " bytes of dynamic shared memory");
  }

  unsigned char* shared() const { return shared_; }
  std::size_t shared_bytes() const { return shared_bytes_; }
  int thread() const { return current_; }

  void sync_threads() { park(cta_barrier_); }

  // A warp collective: every lane gives `mine` and gets all 32 lanes' operands.
  template <class In>
  std::array<In, 32> exchange(const char* op, const In& mine) {
    static_assert(sizeof(In) <= kSlotBytes && std::is_trivially_copyable_v<In>, "a collective's operands fit a slot");
    Warp& w = warps_[current_ / 32];
    const int lane = current_ % 32;
    const int lanes = w.barrier.expected;
    if (lanes != 32) fail(std::string(op) + " in a warp of " + std::to_string(lanes) + " threads");
    const unsigned slot = w.calls[lane]++ % 2;
    std::memcpy(w.slot[slot][lane], &mine, sizeof(In));
    w.op[slot][lane] = op;
    park(w.barrier);
    std::array<In, 32> all;
    for (int l = 0; l < 32; ++l) {
      if (std::strcmp(w.op[slot][l], op) != 0)
        fail("lane " + std::to_string(lane) + " calls " + op + " while lane " + std::to_string(l) + " calls " +
             w.op[slot][l]);
      std::memcpy(&all[l], w.slot[slot][l], sizeof(In));
    }
    return all;
  }

  [[noreturn]] void fail(const std::string& what) const {
    if (current_ >= 0)
      std::fprintf(stderr, "cuda emulation: block (%u, %u, %u), thread %d (warp %d, lane %d): %s\n", index_.x, index_.y,
                   index_.z, current_, current_ / 32, current_ % 32, what.c_str());
    else
      std::fprintf(stderr, "cuda emulation: block (%u, %u, %u): %s\n", index_.x, index_.y, index_.z, what.c_str());
    std::abort();
  }

 private:
  static std::size_t page() { return 4096; }

  void start_fiber(int t) {
    Fiber& f = fibers_[t];
    if (f.mapping == nullptr) {
      f.mapping = mmap(nullptr, kStackBytes + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (f.mapping == MAP_FAILED) fail("cannot map a fiber stack");
      mprotect(f.mapping, page(), PROT_NONE);  // a stack overflow faults instead of corrupting
    }
    f.done = false;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = static_cast<char*>(f.mapping) + page();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &launcher_;
    makecontext(&f.context, &Cta::entry, 0);
  }

  static void entry() {
    Cta& c = *current_cta;
    c.body_(c.context_);
    Fiber& me = c.fibers_[c.current_];
    me.done = true;
    --c.live_;
    // An exited thread no longer holds back __syncthreads (as on the GPU).
    if (--c.cta_barrier_.expected == c.cta_barrier_.arrived && c.cta_barrier_.arrived > 0) c.release(c.cta_barrier_);
    c.switch_away();  // never resumes
  }

  // Makes fiber t the running CUDA thread.
  void enter(int t) {
    current_ = t;
    const unsigned u = static_cast<unsigned>(t);
    threadIdx = uint3{u % block_.x, u / block_.x % block_.y, u / (block_.x * block_.y)};
  }

  int pop_ready() {
    std::size_t i = 0;
    if (rng_ != nullptr) i = (*rng_)() % ready_.size();
    const int t = ready_[i];
    ready_.erase(ready_.begin() + static_cast<std::ptrdiff_t>(i));
    return t;
  }

  // Leaves the running fiber for the next ready one, or for the launcher when none is
  // ready (all done, or a deadlock the launcher reports); returns when resumed.
  void switch_away() {
    const int me = current_;
    if (ready_.empty()) {
      swapcontext(&fibers_[me].context, &launcher_);
      return;
    }
    const int next = pop_ready();
    if (next == me) return;
    enter(next);
    swapcontext(&fibers_[me].context, &fibers_[next].context);
  }

  void release(Barrier& b) {
    b.arrived = 0;
    if (rng_ != nullptr) std::shuffle(b.waiting.begin(), b.waiting.end(), *rng_);
    for (int t : b.waiting) ready_.push_back(t);
    b.waiting.clear();
  }

  // Arrives at b and returns once every participant has arrived.
  void park(Barrier& b) {
    if (++b.arrived == b.expected) {
      release(b);
      if (rng_ != nullptr && (*rng_)() % 2 == 0) {  // the last arriver does not always go first
        ready_.push_back(current_);
        switch_away();
      }
      return;
    }
    b.waiting.push_back(current_);
    switch_away();
  }

  std::string deadlock() const {
    std::string s = std::to_string(live_) + " threads never finished: " + std::to_string(cta_barrier_.arrived) +
                    " wait at __syncthreads";
    for (std::size_t w = 0; w < warps_.size(); ++w)
      if (warps_[w].barrier.arrived > 0)
        s += ", " + std::to_string(warps_[w].barrier.arrived) + " of warp " + std::to_string(w) +
             " at a warp collective";
    return s + " (a barrier or collective that not every thread reaches)";
  }

  std::vector<unsigned char> shared_storage_;
  unsigned char* shared_ = nullptr;
  std::vector<Fiber> fibers_;
  std::vector<Warp> warps_;
  std::deque<int> ready_;
  Barrier cta_barrier_;
  ucontext_t launcher_{};
  int current_ = -1;
  int live_ = 0;
  dim3 grid_, block_;
  uint3 index_;
  std::size_t shared_bytes_ = 0;
  void (*body_)(void*) = nullptr;
  void* context_ = nullptr;
  std::mt19937_64* rng_ = nullptr;
};

inline Cta& this_thread_cta() {
  thread_local Cta cta;
  return cta;
}

inline Cta& running_cta() {
  if (current_cta == nullptr) {
    std::fprintf(stderr, "cuda emulation: a device function was called outside a kernel\n");
    std::abort();
  }
  return *current_cta;
}

template <class F>
std::uintptr_t kernel_key(F* kernel) {
  return reinterpret_cast<std::uintptr_t>(kernel);
}

}  // namespace detail

// kernel<<<grid, block, shared_bytes>>>(args...), run to completion before it returns.
template <class... Params>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t,
            std::type_identity_t<Params>... args) {
  Device& dev = device();
  const std::uint64_t threads = std::uint64_t{block.x} * block.y * block.z;
  if (threads < 1 || threads > kMaxThreads || block.z > 64 || grid.x < 1 || grid.y < 1 || grid.z < 1 ||
      grid.y > 65535 || grid.z > 65535) {
    dev.last_error = cudaErrorInvalidConfiguration;
    return;
  }
  const auto opted = dev.max_dynamic_shared.find(detail::kernel_key(kernel));
  if (shared_bytes > (opted == dev.max_dynamic_shared.end() ? kDefaultSharedBytes : opted->second)) {
    dev.last_error = cudaErrorInvalidValue;
    return;
  }
  ++dev.launches;
  struct Call {
    void (*kernel)(Params...);
    std::tuple<Params...> arguments;
    static void run(void* self) {
      Call& c = *static_cast<Call*>(self);
      std::apply(c.kernel, c.arguments);  // each thread gets its own copies, as parameters
    }
  } call{kernel, std::tuple<Params...>(args...)};

  std::vector<uint3> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back(uint3{x, y, z});
  std::mt19937_64 rng(dev.schedule_seed);
  std::mt19937_64* shuffled = dev.schedule_seed != 0 ? &rng : nullptr;
  if (shuffled != nullptr) std::shuffle(blocks.begin(), blocks.end(), rng);
  detail::Cta& cta = detail::this_thread_cta();
  for (const uint3& b : blocks) cta.run(grid, block, b, shared_bytes, &Call::run, &call, shuffled);
}

// The running CTA's dynamic shared memory.
inline void* dynamic_shared_memory() { return detail::running_cta().shared(); }

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 d, a, {b0, b1}, d: one
// warp, fragments of lane (g, t) = (lane / 4, lane % 4) as in PTX ISA 9.7.14.5.8:
// A (16x16) element (r, k) is half k % 2 of a[r / 8 + 2 (k / 8)] of lane (r % 8, (k % 8) / 2);
// B (16x8) element (k, n) is half k % 2 of b[k / 8] of lane (n, (k % 8) / 2);
// d[i] is D(g + 8 (i / 2), 2t + i % 2).
template <class T>
void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  struct Operands {
    std::uint32_t a[4];
    std::uint32_t b[2];
  };
  detail::Cta& cta = detail::running_cta();
  const auto all = cta.exchange("mma.m16n8k16", Operands{{a[0], a[1], a[2], a[3]}, {b0, b1}});
  const int lane = cta.thread() % 32;
  const int g = lane / 4, t = lane % 4;
  const auto half = [](std::uint32_t reg, int k) {
    const auto bits = static_cast<std::uint16_t>(k % 2 == 0 ? reg & 0xFFFFu : reg >> 16);
    return static_cast<double>(llmpar::convert<float>(T::from_bits(bits)));
  };
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i / 2), n = 2 * t + i % 2;
    double acc = d[i];
    for (int k = 0; k < 16; ++k)
      acc +=
          half(all[4 * (r % 8) + (k % 8) / 2].a[r / 8 + 2 * (k / 8)], k) * half(all[4 * n + (k % 8) / 2].b[k / 8], k);
    d[i] = static_cast<float>(acc);
  }
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8j..8j+7 give the row addresses
// of 8x8 matrix j; r[j] of lane (g, t) receives elements (g, 2t), (g, 2t + 1) of matrix j,
// or with .trans (2t, g), (2t + 1, g) (PTX ISA 9.7.14.5.15), the lower one in the low half.
inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* row, bool transposed) {
  detail::Cta& cta = detail::running_cta();
  const auto* p = static_cast<const unsigned char*>(row);
  if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0 || p < cta.shared() || p + 16 > cta.shared() + cta.shared_bytes())
    cta.fail("ldmatrix row address " + std::to_string(p - cta.shared()) +
             " bytes from the shared memory's start is not a 16-byte aligned row inside its " +
             std::to_string(cta.shared_bytes()) + " bytes");
  const auto rows = cta.exchange(transposed ? "ldmatrix.x4.trans" : "ldmatrix.x4", row);
  const int lane = cta.thread() % 32;
  const int g = lane / 4, t = lane % 4;
  const auto element = [&](int matrix, int i, int j) {
    std::uint16_t e;
    std::memcpy(&e, static_cast<const unsigned char*>(rows[8 * matrix + i]) + 2 * j, 2);
    return static_cast<std::uint32_t>(e);
  };
  for (int j = 0; j < 4; ++j)
    r[j] = transposed ? element(j, 2 * t, g) | (element(j, 2 * t + 1, g) << 16)
                      : element(j, g, 2 * t) | (element(j, g, 2 * t + 1) << 16);
}

}  // namespace llmpar::emulation

// ---- CUDA's device functions --------------------------------------------------------------

inline void __syncthreads() { llmpar::emulation::detail::running_cta().sync_threads(); }

inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) {
  auto& cta = llmpar::emulation::detail::running_cta();
  if (mask != 0xFFFFFFFFu) cta.fail("__syncwarp with a partial mask is not emulated");
  cta.exchange("__syncwarp", char{0});
}

template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  auto& cta = llmpar::emulation::detail::running_cta();
  if (mask != 0xFFFFFFFFu || width != 32) cta.fail("__shfl_xor_sync with a partial mask or width is not emulated");
  const auto all = cta.exchange("__shfl_xor_sync", value);
  return all[((cta.thread() % 32) ^ lane_mask) & 31];
}

template <class T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  auto& cta = llmpar::emulation::detail::running_cta();
  if (mask != 0xFFFFFFFFu || width != 32) cta.fail("__shfl_down_sync with a partial mask or width is not emulated");
  const auto all = cta.exchange("__shfl_down_sync", value);
  const unsigned lane = static_cast<unsigned>(cta.thread() % 32);
  return lane + delta < 32 ? all[lane + delta] : value;  // lanes past the end keep their own value
}

template <class T>
T __shfl_sync(unsigned mask, T value, int src_lane, int width = 32) {
  auto& cta = llmpar::emulation::detail::running_cta();
  if (mask != 0xFFFFFFFFu || width != 32) cta.fail("__shfl_sync with a partial mask or width is not emulated");
  const auto all = cta.exchange("__shfl_sync", value);
  return all[src_lane & 31];
}

// a + b rounded once, never contracted into an FMA with a neighbouring product.
inline float __fadd_rn(float a, float b) {
  volatile float sum = a + b;
  return sum;
}

// ---- CUDA's runtime API, the calls llmpar's kernel headers make ---------------------------

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = llmpar::emulation::device().last_error;
  llmpar::emulation::device().last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return llmpar::emulation::device().last_error; }
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
  }
  return "unknown error";
}
template <class F>
cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attribute, int value) {
  auto& dev = llmpar::emulation::device();
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<std::size_t>(value) > llmpar::emulation::kMaxSharedBytes)
    return dev.last_error = cudaErrorInvalidValue;
  dev.max_dynamic_shared[llmpar::emulation::detail::kernel_key(kernel)] = static_cast<std::size_t>(value);
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  *value = attribute == cudaDevAttrMultiProcessorCount ? 108 : 0;  // an A100's SMs
  return cudaSuccess;
}
