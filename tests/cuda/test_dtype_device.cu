// bf16/f16 conversions on the device are bit-identical to the host's.
//
// The contract of core/dtype.hpp is that a value rounded by a CUDA kernel equals the
// one rounded by a CPU kernel, bit for bit, because both call the same host/device
// functions. This program converts float bit patterns on the GPU with those functions
// and compares every result with the host conversion: a spread of 2^26 patterns that
// visits every exponent (a multiplicative walk over all 2^32), the hand-picked edges
// (zeros, subnormals, f16's overflow threshold, rounding ties, inf, NaN), and all
// 65536 16-bit patterns back to float. Exit codes: 0 pass, 1 mismatch or CUDA error,
// 77 no CUDA device (ctest reports that as skipped).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llmpar/core/dtype.hpp"

namespace {

constexpr int kSkip = 77;

// Pattern i of the sweep: i times an odd constant modulo 2^32 visits distinct bit
// patterns spread over every sign and exponent.
__host__ __device__ std::uint32_t sweep_pattern(std::uint32_t i) { return i * 2654435761u; }

// (n) float bit patterns -> (n) bf16 bits and (n) f16 bits.
__global__ void to_half_kernel(const std::uint32_t* patterns, std::uint32_t n, std::uint16_t* bf16_out,
                               std::uint16_t* f16_out) {
  for (std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float x = llmpar::bits::to_float(patterns != nullptr ? patterns[i] : sweep_pattern(i));
    bf16_out[i] = llmpar::bf16(x).bits;
    f16_out[i] = llmpar::f16(x).bits;
  }
}

// All 65536 16-bit patterns -> (65536) float bits, from bf16 and from f16.
__global__ void to_float_kernel(std::uint32_t* from_bf16, std::uint32_t* from_f16) {
  const std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536u) return;
  const auto h = static_cast<std::uint16_t>(i);
  from_bf16[i] = llmpar::bits::of(static_cast<float>(llmpar::bf16::from_bits(h)));
  from_f16[i] = llmpar::bits::of(static_cast<float>(llmpar::f16::from_bits(h)));
}

bool check_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "FAIL: %s: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
  return false;
}
#define CHECK_CUDA(expr)                      \
  do {                                        \
    if (!check_cuda((expr), #expr)) return 1; \
  } while (0)

template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  explicit DeviceArray(std::size_t n) {
    if (cudaMalloc(&ptr, n * sizeof(T)) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

// Compares device results with the host conversion; prints the first few mismatches.
int count_mismatches(const char* what, const std::vector<std::uint32_t>& patterns,
                     const std::vector<std::uint16_t>& device_bits, std::uint16_t (*host_convert)(float)) {
  int mismatches = 0;
  for (std::size_t i = 0; i < patterns.size(); ++i) {
    const std::uint16_t host_bits = host_convert(llmpar::bits::to_float(patterns[i]));
    if (host_bits != device_bits[i] && ++mismatches <= 5) {
      std::fprintf(stderr, "FAIL: %s of float 0x%08x: device 0x%04x, host 0x%04x\n", what,
                   static_cast<unsigned>(patterns[i]), static_cast<unsigned>(device_bits[i]),
                   static_cast<unsigned>(host_bits));
    }
  }
  return mismatches;
}

std::uint16_t host_bf16(float x) { return llmpar::bf16(x).bits; }
std::uint16_t host_f16(float x) { return llmpar::f16(x).bits; }

// Converts `patterns` (or, when `generate`, the sweep of patterns.size()) on the device.
int run_to_half(const char* name, std::vector<std::uint32_t>& patterns, bool generate, int& mismatches) {
  const auto n = static_cast<std::uint32_t>(patterns.size());
  if (generate) {
    for (std::uint32_t i = 0; i < n; ++i) patterns[i] = sweep_pattern(i);
  }
  DeviceArray<std::uint32_t> d_patterns(generate ? 1 : n);
  DeviceArray<std::uint16_t> d_bf16(n), d_f16(n);
  if (d_patterns.ptr == nullptr || d_bf16.ptr == nullptr || d_f16.ptr == nullptr) {
    std::fprintf(stderr, "FAIL: cudaMalloc for %u elements\n", n);
    return 1;
  }
  if (!generate) {
    CHECK_CUDA(cudaMemcpy(d_patterns.ptr, patterns.data(), n * sizeof(std::uint32_t), cudaMemcpyHostToDevice));
  }
  to_half_kernel<<<1024, 256>>>(generate ? nullptr : d_patterns.ptr, n, d_bf16.ptr, d_f16.ptr);
  CHECK_CUDA(cudaGetLastError());
  std::vector<std::uint16_t> bf16_bits(n), f16_bits(n);
  CHECK_CUDA(cudaMemcpy(bf16_bits.data(), d_bf16.ptr, n * sizeof(std::uint16_t), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(f16_bits.data(), d_f16.ptr, n * sizeof(std::uint16_t), cudaMemcpyDeviceToHost));
  const int bad =
      count_mismatches("bf16", patterns, bf16_bits, host_bf16) + count_mismatches("f16", patterns, f16_bits, host_f16);
  std::printf("%-40s %10u patterns, %d mismatches\n", name, n, bad);
  mismatches += bad;
  return 0;
}

std::vector<std::uint32_t> edge_patterns() {
  std::vector<std::uint32_t> edges = {
      0x00000000u, 0x80000000u,                            // +-0
      0x00000001u, 0x80000001u, 0x007FFFFFu, 0x00800000u,  // float subnormals, min normal
      0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F800000u, 0xFF800000u,  // max, +-inf
      0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFBFFFFFu,  // quiet and signalling NaNs
      0x3F800000u, 0x3F808000u, 0x3F818000u, 0x3F807FFFu,  // bf16 ties to even, below tie
      0x477FE000u, 0x477FEFFFu, 0x477FF000u, 0x477FF001u,  // f16: 65504 .. 65520 (-> inf)
      0x38800000u, 0x387FFFFFu, 0x33800000u, 0x33000000u,  // f16 min normal, 2^-24, 2^-25
      0x33000001u, 0x33C00000u, 0x32FFFFFFu, 0x337FFFFFu,  // around f16's smallest subnormal
  };
  for (std::uint32_t b = 0; b < 256; ++b) edges.push_back(b << 23 | 0x00001000u);  // f16 ties per exponent
  for (std::uint32_t b = 0; b < 256; ++b) edges.push_back(b << 23 | 0x00008000u);  // bf16 ties per exponent
  const std::size_t n = edges.size();
  for (std::size_t i = 0; i < n; ++i) edges.push_back(edges[i] ^ 0x80000000u);  // both signs
  return edges;
}

}  // namespace

int main() {
  int device_count = 0;
  const cudaError_t e = cudaGetDeviceCount(&device_count);
  if (e != cudaSuccess || device_count == 0) {
    std::printf("skipped: no CUDA device (cudaGetDeviceCount: %s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return kSkip;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device 0: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);

  int mismatches = 0;
  std::vector<std::uint32_t> edges = edge_patterns();
  if (run_to_half("float -> bf16/f16, edge values", edges, false, mismatches) != 0) return 1;
  std::vector<std::uint32_t> sweep(std::size_t{1} << 26);
  if (run_to_half("float -> bf16/f16, sweep over all exponents", sweep, true, mismatches) != 0) return 1;

  DeviceArray<std::uint32_t> d_from_bf16(65536), d_from_f16(65536);
  if (d_from_bf16.ptr == nullptr || d_from_f16.ptr == nullptr) {
    std::fprintf(stderr, "FAIL: cudaMalloc\n");
    return 1;
  }
  to_float_kernel<<<65536 / 256, 256>>>(d_from_bf16.ptr, d_from_f16.ptr);
  CHECK_CUDA(cudaGetLastError());
  std::vector<std::uint32_t> from_bf16(65536), from_f16(65536);
  CHECK_CUDA(cudaMemcpy(from_bf16.data(), d_from_bf16.ptr, 65536 * sizeof(std::uint32_t), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(from_f16.data(), d_from_f16.ptr, 65536 * sizeof(std::uint32_t), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (std::uint32_t i = 0; i < 65536u; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const std::uint32_t host_bf16 = llmpar::bits::of(static_cast<float>(llmpar::bf16::from_bits(h)));
    const std::uint32_t host_f16 = llmpar::bits::of(static_cast<float>(llmpar::f16::from_bits(h)));
    if (host_bf16 != from_bf16[i] && ++bad <= 5)
      std::fprintf(stderr, "FAIL: bf16 0x%04x to float: device 0x%08x, host 0x%08x\n", i, from_bf16[i], host_bf16);
    if (host_f16 != from_f16[i] && ++bad <= 5)
      std::fprintf(stderr, "FAIL: f16 0x%04x to float: device 0x%08x, host 0x%08x\n", i, from_f16[i], host_f16);
  }
  std::printf("%-40s %10u patterns, %d mismatches\n", "bf16/f16 -> float, every 16-bit pattern", 65536u, bad);
  mismatches += bad;

  if (mismatches != 0) {
    std::printf("FAILED: %d device conversions differ from the host's\n", mismatches);
    return 1;
  }
  std::printf("passed: device conversions are bit-identical to the host's\n");
  return 0;
}
