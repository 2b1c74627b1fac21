// llmpar/backend/cuda/memory.hpp — streams, events and stream-ordered device memory.
//
// Every device allocation in llmpar is stream-ordered (cudaMallocAsync from the
// device's memory pool): an allocation is usable by work queued after it on its stream
// and returns to the pool when the work queued before its free has run, without a
// device-wide synchronisation. The pool keeps freed memory (release threshold: all of
// it) so that a training step's activations are recycled step after step instead of
// going back to the driver, which is what makes per-step allocation cheap.
//
// A rank's CUDA resources are one `DeviceContext`: its device, a compute stream and a
// communication stream of higher priority (NCCL kernels should not wait behind a
// queue of compute kernels), and the pool. Types here are RAII owners, movable and not
// copyable; destructors never throw (a failure there is reported on stderr).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <utility>

#include "llmpar/backend/cuda/check.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::backend::cuda {

// Number of CUDA devices this process sees (0 where there is no driver or device).
inline int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return 0;
  }
  return count;
}

namespace detail {
inline void report(cudaError_t status, const char* what) {
  if (status != cudaSuccess) std::fprintf(stderr, "llmpar: %s failed: %s\n", what, cudaGetErrorString(status));
}
}  // namespace detail

class Stream {
 public:
  enum class Priority { normal, high };

  Stream() = default;
  explicit Stream(Priority priority) {
    int least = 0, greatest = 0;
    LLMPAR_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    LLMPAR_CHECK_CUDA(
        cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority == Priority::high ? greatest : least));
  }
  Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept {
    if (this != &other) {
      reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { reset(); }

  cudaStream_t get() const { return stream_; }
  void synchronize() const { LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream_)); }

 private:
  void reset() noexcept {
    if (stream_ != nullptr) detail::report(cudaStreamDestroy(stream_), "cudaStreamDestroy");
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  enum class Timing { off, on };

  Event() = default;
  explicit Event(Timing timing) {
    LLMPAR_CHECK_CUDA(
        cudaEventCreateWithFlags(&event_, timing == Timing::on ? cudaEventDefault : cudaEventDisableTiming));
  }
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  Event& operator=(Event&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { reset(); }

  cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream) { LLMPAR_CHECK_CUDA(cudaEventRecord(event_, stream)); }
  // Work queued on `stream` from now on waits for what this event recorded.
  void make_wait(cudaStream_t stream) const { LLMPAR_CHECK_CUDA(cudaStreamWaitEvent(stream, event_, 0)); }
  bool done() const {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    LLMPAR_CHECK_CUDA(status);
    return true;
  }
  void synchronize() const { LLMPAR_CHECK_CUDA(cudaEventSynchronize(event_)); }
  // Milliseconds from `start` to this event (both recorded with Timing::on).
  float ms_since(const Event& start) const {
    float ms = 0.f;
    LLMPAR_CHECK_CUDA(cudaEventElapsedTime(&ms, start.event_, event_));
    return ms;
  }

 private:
  void reset() noexcept {
    if (event_ != nullptr) detail::report(cudaEventDestroy(event_), "cudaEventDestroy");
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

// `count` elements of T on the device, allocated and freed in the order of `stream`.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(std::size_t count, cudaStream_t stream) : count_(count), stream_(stream) {
    LLMPAR_CHECK(count <= std::numeric_limits<std::size_t>::max() / sizeof(T), "a device buffer of ", count,
                 " elements of ", sizeof(T), " bytes overflows size_t");
    if (count > 0)
      LLMPAR_CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&data_), count * sizeof(T), stream), "allocating ",
                        count * sizeof(T), " bytes; lower the batch size or the sequence length");
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)), stream_(other.stream_) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
      stream_ = other.stream_;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return count_; }
  std::size_t bytes() const { return count_ * sizeof(T); }
  std::span<T> span() { return {data_, count_}; }
  cudaStream_t stream() const { return stream_; }

  // Copies from / to host memory, queued on the buffer's stream.
  void upload(std::span<const T> host) {
    LLMPAR_CHECK(host.size() == count_, "upload of ", host.size(), " elements into a device buffer of ", count_);
    if (count_) LLMPAR_CHECK_CUDA(cudaMemcpyAsync(data_, host.data(), bytes(), cudaMemcpyHostToDevice, stream_));
  }
  void download(std::span<T> host) const {
    LLMPAR_CHECK(host.size() == count_, "download of a device buffer of ", count_, " elements into ", host.size());
    if (count_) LLMPAR_CHECK_CUDA(cudaMemcpyAsync(host.data(), data_, bytes(), cudaMemcpyDeviceToHost, stream_));
  }

 private:
  void reset() noexcept {
    if (data_ != nullptr) detail::report(cudaFreeAsync(data_, stream_), "cudaFreeAsync");
    data_ = nullptr;
    count_ = 0;
  }
  T* data_ = nullptr;
  std::size_t count_ = 0;
  cudaStream_t stream_ = nullptr;
};

}  // namespace llmpar::backend::cuda

namespace llmpar::memory {
// Device memory of the current CUDA device, for llmpar::Buffer<T, memory::Device>: the
// long-lived buffers of a model (parameters, gradients, activations). cudaMalloc'd
// (256-byte aligned); the synchronous fills and copies serve set-up code, while a
// step's transfers go through the backend context's stream.
struct Device {
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    LLMPAR_CHECK_CUDA(cudaMalloc(&p, bytes == 0 ? 256 : bytes), "allocating ", bytes,
                      " bytes of device memory; lower the batch size, the sequence length or the model size");
    return p;
  }
  static void release(void* p) noexcept { backend::cuda::detail::report(cudaFree(p), "cudaFree"); }
  // Waits for all of the device's streams first: set-up code only.
  static void zero(void* p, std::size_t bytes) {
    LLMPAR_CHECK_CUDA(cudaDeviceSynchronize());
    LLMPAR_CHECK_CUDA(cudaMemset(p, 0, bytes));
    LLMPAR_CHECK_CUDA(cudaDeviceSynchronize());
  }
  // Set-up copies, fenced like zero(): cudaMemcpy runs on the legacy default stream,
  // which does not wait for the (non-blocking) compute streams, and a copy from pageable
  // host memory may return before its DMA has landed.
  static void copy_from_host(void* dst, const void* src, std::size_t bytes) {
    LLMPAR_CHECK_CUDA(cudaDeviceSynchronize());
    LLMPAR_CHECK_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    LLMPAR_CHECK_CUDA(cudaDeviceSynchronize());
  }
  static void copy_to_host(void* dst, const void* src, std::size_t bytes) {
    LLMPAR_CHECK_CUDA(cudaDeviceSynchronize());
    LLMPAR_CHECK_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }
  // n elements within device memory, fenced like the others.
  template <class T>
  static void copy(T* dst, const T* src, std::int64_t n) {
    if (n <= 0) return;
    LLMPAR_CHECK_CUDA(cudaDeviceSynchronize());
    LLMPAR_CHECK_CUDA(cudaMemcpy(dst, src, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToDevice));
    LLMPAR_CHECK_CUDA(cudaDeviceSynchronize());
  }
  static constexpr bool kHostAccessible = false;
};
}  // namespace llmpar::memory

namespace llmpar::backend::cuda {

// One rank's device, its streams and its memory pool. The communication stream is its
// own high-priority stream, or one owned elsewhere that it adopts: NcclComm's, so that
// collectives and the copies that feed them share one stream.
class DeviceContext {
 public:
  explicit DeviceContext(int device, cudaStream_t adopt_communication = nullptr)
      : device_(device), adopted_communication_(adopt_communication) {
    const int count = device_count();
    LLMPAR_CHECK(count > 0, "CUDA device ", device,
                 " was asked for, but this process sees no CUDA device; "
                 "check the driver and CUDA_VISIBLE_DEVICES, or train on the CPU backend");
    LLMPAR_CHECK(device >= 0 && device < count, "CUDA device ", device, " does not exist: this process sees ", count,
                 " device", count == 1 ? "" : "s", "; use one of 0..", count - 1);
    LLMPAR_CHECK_CUDA(cudaSetDevice(device));
    int pools = 0;
    LLMPAR_CHECK_CUDA(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
    LLMPAR_CHECK(pools != 0, "CUDA device ", device, " does not support stream-ordered memory pools");
    LLMPAR_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool_, device));
    std::uint64_t keep_everything = std::numeric_limits<std::uint64_t>::max();
    LLMPAR_CHECK_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep_everything));
    compute_ = Stream(Stream::Priority::normal);
    if (adopted_communication_ == nullptr) communication_ = Stream(Stream::Priority::high);
  }

  int device() const { return device_; }
  cudaStream_t compute() const { return compute_.get(); }
  cudaStream_t communication() const {
    return adopted_communication_ != nullptr ? adopted_communication_ : communication_.get();
  }
  cudaMemPool_t pool() const { return pool_; }

  // Bytes the pool holds from the driver, and bytes in use by live allocations.
  std::uint64_t pool_reserved_bytes() const { return pool_attribute(cudaMemPoolAttrReservedMemCurrent); }
  std::uint64_t pool_used_bytes() const { return pool_attribute(cudaMemPoolAttrUsedMemCurrent); }

  template <class T>
  DeviceBuffer<T> allocate(std::size_t count) const {
    return DeviceBuffer<T>(count, compute());
  }

 private:
  std::uint64_t pool_attribute(cudaMemPoolAttr attribute) const {
    std::uint64_t value = 0;
    LLMPAR_CHECK_CUDA(cudaMemPoolGetAttribute(pool_, attribute, &value));
    return value;
  }

  int device_;
  cudaStream_t adopted_communication_;
  cudaMemPool_t pool_ = nullptr;
  Stream compute_;
  Stream communication_;
};

}  // namespace llmpar::backend::cuda
