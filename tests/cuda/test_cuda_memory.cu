// Streams, events and stream-ordered memory (backend/cuda/memory.hpp): allocation,
// upload, a kernel and download in one stream's order; a second stream ordered after
// the first by an event; the pool recycling freed memory instead of growing; event
// timing; and the errors for devices that do not exist. Exit codes: 0 pass, 1 failure,
// 77 no CUDA device (ctest reports that as skipped).
//
// The bytes it measures are its own: the pool's counters (cudaMemPoolAttrReservedMemCurrent,
// _UsedMemCurrent) count this process's pool only, never cudaMemGetInfo's device-wide
// free memory, so other programs on the GPU, or this one's own cudaMalloc (cuBLASLt's
// workspace, a Buffer<T, memory::Device>), cannot move them; the test proves that last
// part with a 64 MiB cudaMalloc between two reads. So it runs beside other tests (no
// RUN_SERIAL), as the first H200 run could have.
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "llmpar/backend/cuda/memory.hpp"

namespace {

constexpr int kSkip = 77;
int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    ++failures;
  }
}

// (n) x -> (n) 2x + 1
__global__ void affine(const float* x, float* y, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = 2.f * x[i] + 1.f;
}

}  // namespace

int main() {
  using namespace llmpar::backend::cuda;
  // Lines in the order they happen, stdout and stderr alike, when both go to one log.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (device_count() == 0) {
    std::printf("skipped: no CUDA device\n");
    try {
      DeviceContext context(0);
      expect(false, "DeviceContext(0) without a device should throw");
    } catch (const llmpar::Error& e) {
      expect(std::strstr(e.what(), "this process sees no CUDA device") != nullptr, "no-device message");
    }
    return failures ? 1 : kSkip;
  }
  try {
    DeviceContext context(0);
    const int n = 1 << 20;
    std::vector<float> host(n), back(n);
    std::iota(host.begin(), host.end(), 0.f);

    // Allocate, upload, compute and download in the compute stream's order.
    auto x = context.allocate<float>(n);
    auto y = context.allocate<float>(n);
    x.upload(host);
    affine<<<256, 256, 0, context.compute()>>>(x.data(), y.data(), n);
    LLMPAR_CHECK_CUDA(cudaGetLastError());
    y.download(back);
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(context.compute()));
    bool ok = true;
    for (int i = 0; i < n; ++i) ok = ok && back[i] == 2.f * host[i] + 1.f;
    expect(ok, "upload, kernel, download in stream order");

    // The communication stream, ordered after the compute stream by an event, sees the
    // compute stream's result.
    Event computed(Event::Timing::off);
    affine<<<256, 256, 0, context.compute()>>>(y.data(), x.data(), n);  // x = 2y + 1
    computed.record(context.compute());
    computed.make_wait(context.communication());
    std::vector<float> seen(n);
    LLMPAR_CHECK_CUDA(
        cudaMemcpyAsync(seen.data(), x.data(), x.bytes(), cudaMemcpyDeviceToHost, context.communication()));
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(context.communication()));
    ok = true;
    for (int i = 0; i < n; ++i) ok = ok && seen[i] == 2.f * (2.f * host[i] + 1.f) + 1.f;
    expect(ok, "communication stream waits for the compute stream's event");

    // Freed memory returns to the pool and is reused: many allocate/free rounds of the
    // same size do not grow what the pool holds.
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(context.compute()));
    { auto warm = context.allocate<float>(4 * n); }
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(context.compute()));
    const auto reserved = context.pool_reserved_bytes();
    for (int round = 0; round < 100; ++round) {
      auto scratch = context.allocate<float>(4 * n);
      affine<<<64, 256, 0, context.compute()>>>(x.data(), scratch.data(), n);
    }
    LLMPAR_CHECK_CUDA(cudaStreamSynchronize(context.compute()));
    expect(context.pool_reserved_bytes() == reserved, "the pool recycles freed allocations");
    expect(context.pool_used_bytes() >= 2 * x.bytes(), "live allocations count as used");

    // Memory from outside the pool (what another program, or cudaMalloc here, takes)
    // does not show in its counters.
    const auto used = context.pool_used_bytes();
    void* outside = nullptr;
    LLMPAR_CHECK_CUDA(cudaMalloc(&outside, std::size_t{64} << 20));
    const bool unmoved = context.pool_reserved_bytes() == reserved && context.pool_used_bytes() == used;
    LLMPAR_CHECK_CUDA(cudaFree(outside));
    expect(unmoved, "the pool's counters ignore memory allocated outside the pool");

    // Event timing brackets work.
    Event start(Event::Timing::on), stop(Event::Timing::on);
    start.record(context.compute());
    for (int r = 0; r < 10; ++r) affine<<<256, 256, 0, context.compute()>>>(x.data(), y.data(), n);
    stop.record(context.compute());
    stop.synchronize();
    expect(stop.done() && stop.ms_since(start) > 0.f, "timed events");

    // Errors name the device and what exists.
    try {
      DeviceContext missing(device_count() + 3);
      expect(false, "a device that does not exist should throw");
    } catch (const llmpar::Error& e) {
      expect(std::strstr(e.what(), "does not exist: this process sees") != nullptr, "missing-device message");
    }
    try {
      std::vector<float> wrong(3);
      x.upload(wrong);
      expect(false, "an upload of the wrong size should throw");
    } catch (const llmpar::Error& e) {
      expect(std::strstr(e.what(), "upload of 3 elements into a device buffer of") != nullptr, "upload size message");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    return 1;
  }
  if (failures) return 1;
  std::printf("passed\n");
  return 0;
}
