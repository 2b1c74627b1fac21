// llmpar/kernels/common.cuh — what every CUDA kernel template shares.
//
// Storage types are float, bf16 and f16 (core/dtype.hpp); every kernel computes in
// float, whatever it stores. Conversions go through llmpar::convert, the same
// host/device functions the CPU kernels use, so a value rounded on the GPU is bit-for-bit
// the value the CPU backend rounds.
//
// Launchers (the host functions each kernel header exports) follow one convention:
//   - the first argument is the cudaStream_t the work is ordered on; nothing synchronises;
//   - shapes are std::int64_t and are checked on the host with a message that names the
//     value and the rule (LLMPAR_CHECK), before anything is launched;
//   - no hidden allocation: a launcher that needs scratch takes a caller-owned workspace
//     and its header exports `<op>_workspace(shape...)`, the size it needs (CUB's
//     two-phase convention; backend::Cuda lends one growing scratch buffer to all);
//   - every launch is followed by LLMPAR_CHECK_LAUNCH(), which turns a launch-configuration
//     error into an llmpar::Error naming the kernel.
//
// Device code is compiled by nvcc or, in the host emulation of tests/cuda_emulation, by the
// host compiler: that build defines LLMPAR_CUDA_EMULATION and finds its own <cuda_runtime.h>
// (the runtime calls, the built-in variables, barriers and shuffles, one CUDA thread per
// fiber). LLMPAR_DEVICE_CODE marks what either compiles; the few places where the
// emulation must differ from nvcc (a launch, the dynamic shared memory, inline PTX) name
// LLMPAR_CUDA_EMULATION themselves, and nvcc never sees the emulation's side of them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstddef>
#include <type_traits>

#include "llmpar/backend/cuda/check.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::kernels {

// The element types a CUDA kernel stores.
template <class T>
concept Storage = std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// Loads one stored element as float / stores a float as T (round to nearest even).
template <Storage T>
LLMPAR_HOST_DEVICE float load(const T& x) {
  return llmpar::convert<float>(x);
}
template <Storage T>
LLMPAR_HOST_DEVICE T store(float x) {
  return llmpar::convert<T>(x);
}

constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// kVec elements of T moved by one aligned load or store; the default is 16 bytes, the
// widest single access (uint4).
template <class T, int kVec = static_cast<int>(16 / sizeof(T))>
struct alignas(sizeof(T) * kVec) Pack {
  static constexpr int kSize = kVec;
  T v[kVec];
};

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

inline constexpr int kWarp = 32;

#if defined(__CUDACC__) || defined(LLMPAR_CUDA_EMULATION)
#define LLMPAR_DEVICE_CODE 1
#endif

#if defined(LLMPAR_DEVICE_CODE)
// kernel<<<grid, block, shared_bytes, stream>>>(args...), the arguments converted to the
// kernel's parameter types; in the host emulation, the same launch run on the CPU.
template <class... Params>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
                   std::type_identity_t<Params>... args) {
#if defined(LLMPAR_CUDA_EMULATION)
  ::llmpar::emulation::launch(kernel, grid, block, shared_bytes, stream, args...);
#else
  kernel<<<grid, block, shared_bytes, stream>>>(args...);
#endif
}

// The CTA's dynamic shared memory (the launch's shared_bytes), 16-byte aligned.
template <class T>
__device__ __forceinline__ T* dynamic_shared_memory() {
#if defined(LLMPAR_CUDA_EMULATION)
  return reinterpret_cast<T*>(::llmpar::emulation::dynamic_shared_memory());
#else
  extern __shared__ float4 llmpar_dynamic_shared_memory[];
  return reinterpret_cast<T*>(llmpar_dynamic_shared_memory);
#endif
}

// Sum / max over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

// Loads chunk [c0, c0 + kSize) of a row of n elements; elements at or past n read as 0.
// `vectorized` promises a 16-byte aligned chunk lying wholly inside the allocation
// (elements past n are then loaded, and must be ignored).
template <Storage T>
__device__ __forceinline__ Pack<T> load_pack(const T* p, int c0, int n, bool vectorized) {
  Pack<T> pk;
  if (vectorized) {
    *reinterpret_cast<uint4*>(&pk) = *reinterpret_cast<const uint4*>(p + c0);
  } else {
#pragma unroll
    for (int i = 0; i < Pack<T>::kSize; ++i) pk.v[i] = c0 + i < n ? p[c0 + i] : store<T>(0.0f);
  }
  return pk;
}

// Stores the elements of chunk [c0, c0 + kSize) that lie below n.
template <Storage T>
__device__ __forceinline__ void store_pack(T* p, int c0, int n, bool vectorized, const Pack<T>& pk) {
  if (vectorized) {
    *reinterpret_cast<uint4*>(p + c0) = *reinterpret_cast<const uint4*>(&pk);
  } else {
#pragma unroll
    for (int i = 0; i < Pack<T>::kSize; ++i)
      if (c0 + i < n) p[c0 + i] = pk.v[i];
  }
}
#endif

// The number of SMs of the current device (cached per device by the caller if hot).
inline int sm_count() {
  int device = 0;
  LLMPAR_CHECK_CUDA(cudaGetDevice(&device));
  int sms = 0;
  LLMPAR_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

}  // namespace llmpar::kernels

// After a <<<...>>> launch: a bad configuration (too many threads, too much shared
// memory) becomes an llmpar::Error naming the kernel.
#define LLMPAR_CHECK_LAUNCH(kernel_name) LLMPAR_CHECK_CUDA(cudaGetLastError(), "launching ", kernel_name)
