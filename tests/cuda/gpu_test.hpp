// The harness of the GPU test programs (tests/cuda/test_cuda_*.cu): what every one of
// them needs besides its own checks.
//
// Those programs are plain executables, not doctest: each runs its host-side checks
// (argument errors that throw before any CUDA call) everywhere, then its device checks
// where there is a CUDA device, and exits with
//   0   every check passed (most print "passed" last);
//   1   a check failed: each failure is printed to stderr as "FAILED: ...", and
//       failures counts them; an exception escaping the checks is a failure too;
//   77  no CUDA device and the host-side checks passed (kSkip; tests/CMakeLists.txt
//       sets SKIP_RETURN_CODE 77, so ctest reports the program as skipped).
//
// Here: the failure counter and expect(), expect_error() for an llmpar::Error with a
// given message, the exit code logic, host vectors from llmpar::rng, device buffer
// upload/download (copy_out's errors name the call site and what the pointer points
// into), the bit-level helpers for float/bf16/f16 and a tolerance check. The
// programs' printed lines are theirs: where two of them word a line differently, the
// wording is a parameter here (ErrorWording), not unified.
#pragma once

#include <cuda.h>  // the driver API's types only: describe_pointer looks its one call up at run time
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <source_location>
#include <string>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cuda/memory.hpp"
#include "llmpar/core/bits.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"

namespace llmpar::gpu_test {

using llmpar::backend::cuda::DeviceBuffer;

// ---------------------------------------------------------------------------------------
// Failures and exit codes.

// The exit code of a program that skipped its device checks for want of a device.
inline constexpr int kSkip = 77;

// The number of failed checks so far (the program exits 1 if it is not 0).
inline int failures = 0;

inline void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    ++failures;
  }
}

// Prints "ok     <line>" or "FAIL   <line>" to stdout, and counts a failure.
inline void report(bool ok, const std::string& line) {
  std::printf("%-6s %s\n", ok ? "ok" : "FAIL", line.c_str());
  expect(ok, line);
}

// How expect_error words a failure on stderr; each program keeps the wording it had.
enum class ErrorWording {
  // FAILED: <what>: no error was thrown
  // FAILED: <what>: message "<message>" lacks "<needle>"
  lacks,
  // FAILED: <what>: no error was thrown
  // FAILED: <what>: message lacks "<needle>": <message>
  lacks_message_last,
  // FAILED: <what>: should throw
  //   message was: <message>
  // FAILED: <what>: message names "<needle>"
  names,
};

// expect_error(fn, needle, what): fn() must throw llmpar::Error whose message contains
// `needle`; other exceptions propagate. A program declares its one instance,
//   constexpr ExpectError expect_error{ErrorWording::...};
struct ExpectError {
  ErrorWording wording;

  template <class Fn>
  void operator()(Fn&& fn, const char* needle, const std::string& what) const {
    try {
      fn();
      expect(false, what + (wording == ErrorWording::names ? ": should throw" : ": no error was thrown"));
    } catch (const llmpar::Error& e) {
      const bool found = std::strstr(e.what(), needle) != nullptr;
      switch (wording) {
        case ErrorWording::lacks:
          if (!found) {
            std::fprintf(stderr, "FAILED: %s: message \"%s\" lacks \"%s\"\n", what.c_str(), e.what(), needle);
            ++failures;
          }
          break;
        case ErrorWording::lacks_message_last:
          expect(found, what + ": message lacks \"" + needle + "\": " + e.what());
          break;
        case ErrorWording::names:
          if (!found) std::fprintf(stderr, "  message was: %s\n", e.what());
          expect(found, what + ": message names \"" + needle + "\"");
          break;
      }
    }
  }
};

// "passed" or "FAILED": the verdict of the checks so far, for the skip line.
inline const char* verdict() { return failures ? "FAILED" : "passed"; }

// The exit code where there is no device: 1 if a host-side check failed, else kSkip.
inline int skip_exit_code() { return failures ? 1 : kSkip; }

// Runs the host-side checks; an exception escaping them is printed as
// "FAILED: <label>: <what>" and gives false (the program then exits 1).
template <class Fn>
bool run_host_checks(Fn&& host_checks, const char* label) {
  try {
    host_checks();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s: %s\n", label, e.what());
    return false;
  }
  return true;
}

// Runs the device checks and returns the exit code: 1 after an exception ("FAILED:
// <what>") or failed checks ("<n> check(s) failed"), else 0 after printing "passed".
template <class Fn>
int run_device_checks(Fn&& device_checks) {
  try {
    device_checks();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    return 1;
  }
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("passed\n");
  return 0;
}

// ---------------------------------------------------------------------------------------
// Storage types: float, bf16, f16.

// "float", "bf16" or "f16".
template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>)
    return "float";
  else if constexpr (std::is_same_v<T, bf16>)
    return "bf16";
  else
    return "f16";
}

// The library's name of T's dtype: "f32", "bf16" or "f16" (llmpar::name_of).
template <class T>
const char* dtype_name() {
  return llmpar::name_of(llmpar::dtype_of<T>()).data();  // a string literal
}

template <class T>
float to_f(T x) {
  return llmpar::convert<float>(x);
}

// Position of x on the number line in ulps of T (adjacent values differ by 1).
template <class T>
std::int64_t ordered(T x) {
  if constexpr (std::is_same_v<T, float>) {
    const std::uint32_t u = llmpar::bits::of(x);
    const std::int64_t magnitude = u & 0x7FFFFFFFu;
    return (u >> 31) ? -magnitude : magnitude;
  } else {
    const std::int64_t magnitude = x.bits & 0x7FFFu;
    return (x.bits >> 15) ? -magnitude : magnitude;
  }
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// ---------------------------------------------------------------------------------------
// Host data and device buffers.

// Elements 0 .. n-1 of `stream` as scale * N(0, 1) (in double), rounded to float, then
// to T.
template <class T>
std::vector<T> random_vector(const llmpar::rng::Stream& stream, std::int64_t n, double scale = 1.0) {
  std::vector<T> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    v[static_cast<std::size_t>(i)] =
        llmpar::convert<T>(static_cast<float>(scale * stream.normal(static_cast<std::uint64_t>(i))));
  return v;
}

// A device copy of `host`, allocated and filled in the order of `stream`.
template <class T>
DeviceBuffer<T> upload(const std::vector<T>& host, cudaStream_t stream) {
  DeviceBuffer<T> buffer(host.size(), stream);
  buffer.upload(host);
  return buffer;
}

// The buffer's contents, once its stream has reached this point.
template <class T>
std::vector<T> download(const DeviceBuffer<T>& buffer) {
  std::vector<T> host(buffer.size());
  buffer.download(host);
  LLMPAR_CHECK_CUDA(cudaStreamSynchronize(buffer.stream()));
  return host;
}

// What `p` points into, for an error about a copy of `bytes` bytes from it: the kind of
// memory (cudaPointerGetAttributes) and, for device memory, the allocation that holds
// it and where the copy ends relative to that allocation's end (the driver's
// cuMemGetAddressRange, looked up at run time so the tests need not link libcuda).
// Leaves the runtime's error state clear.
inline std::string describe_pointer(const void* p, std::size_t bytes) {
  char text[256];
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    std::snprintf(text, sizeof(text), "%p is not a pointer the CUDA runtime knows", p);
    return text;
  }
  switch (attributes.type) {
    case cudaMemoryTypeUnregistered:
      std::snprintf(text, sizeof(text), "%p is host memory not registered with CUDA (or freed device memory)", p);
      return text;
    case cudaMemoryTypeHost:
      std::snprintf(text, sizeof(text), "%p is page-locked host memory", p);
      return text;
    case cudaMemoryTypeManaged:
      std::snprintf(text, sizeof(text), "%p is managed memory", p);
      return text;
    case cudaMemoryTypeDevice:
      break;
  }
  using AddressRange = CUresult (*)(CUdeviceptr*, std::size_t*, CUdeviceptr);
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found{};
  CUdeviceptr base = 0;
  std::size_t size = 0;
  const auto address = reinterpret_cast<CUdeviceptr>(p);
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &entry, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess ||
      reinterpret_cast<AddressRange>(entry)(&base, &size, address) != CUDA_SUCCESS) {
    static_cast<void>(cudaGetLastError());
    std::snprintf(text, sizeof(text), "%p is device memory of device %d (its allocation's size unknown)", p,
                  attributes.device);
    return text;
  }
  const std::size_t offset = static_cast<std::size_t>(address - base);
  const std::size_t end = offset + bytes;
  std::snprintf(text, sizeof(text),
                "%p is device memory of device %d, %zu bytes into an allocation of %zu bytes; the copy ends %zu "
                "bytes %s its end",
                p, attributes.device, offset, size, end > size ? end - size : size - end,
                end > size ? "PAST" : "before");
  return text;
}

// n elements from device memory, once `stream` has reached this point. A failed copy
// names its caller (file:line, function), the size asked for and what `device` points
// into, so the error says which call site passed what.
template <class T>
std::vector<T> copy_out(const T* device, std::int64_t n, cudaStream_t stream,
                        std::source_location caller = std::source_location::current()) {
  std::vector<T> host(static_cast<std::size_t>(n));
  const std::size_t bytes = host.size() * sizeof(T);
  if (n > 0)
    LLMPAR_CHECK_CUDA(cudaMemcpyAsync(host.data(), device, bytes, cudaMemcpyDeviceToHost, stream), "copy_out of ", n,
                      " elements (", bytes, " bytes) called from ", caller.file_name(), ":", caller.line(), " in ",
                      caller.function_name(), ": ", describe_pointer(device, bytes));
  LLMPAR_CHECK_CUDA(cudaStreamSynchronize(stream), "after copy_out called from ", caller.file_name(), ":",
                    caller.line());
  return host;
}

// ---------------------------------------------------------------------------------------
// Tolerances.

// |got - want| <= rtol |want| + atol max|want|. A GPU and a CPU float computation of the
// same formula differ in their last float bits (summation order, FMA contraction, expf);
// rounded to bf16/f16 that is at most an ulp or two of the storage type, which rtol
// allows (bf16 ulp = 2^-7 relative at most, f16 2^-10).
struct Tolerance {
  double rtol, atol;
};

// Per storage type: float {1e-5, f32_atol} (each program states its float atol),
// bf16 {2^-7, 1e-5}, f16 {2^-10, 1e-5}.
template <class T>
Tolerance tolerance(double f32_atol) {
  if constexpr (std::is_same_v<T, float>)
    return {1e-5, f32_atol};
  else if constexpr (std::is_same_v<T, bf16>)
    return {1.0 / 128.0, 1e-5};
  else
    return {1.0 / 1024.0, 1e-5};
}

// Checks got against want within `tol` over the elements keep(i) selects (max|want| is
// taken over those too), printing the first three misses and expecting none; returns the
// largest error relative to max|want|.
template <class A, class B, class Keep>
double compare(const std::vector<A>& got, const std::vector<B>& want, Tolerance tol, const std::string& what,
               Keep keep) {
  if (got.size() != want.size()) {
    expect(false, what + ": sizes differ");
    return 1.0;
  }
  double scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i)
    if (keep(i)) scale = std::max(scale, std::fabs(static_cast<double>(llmpar::convert<float>(want[i]))));
  double worst = 0.0;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!keep(i)) continue;
    const double g = llmpar::convert<float>(got[i]);
    const double w = llmpar::convert<float>(want[i]);
    const double err = std::fabs(g - w);
    worst = std::max(worst, scale > 0 ? err / scale : err);
    if (!(err <= tol.rtol * std::fabs(w) + tol.atol * scale)) {
      if (++bad <= 3) std::fprintf(stderr, "  %s[%zu]: got %.9g, want %.9g\n", what.c_str(), i, g, w);
    }
  }
  expect(bad == 0, what + " within tolerance (" + std::to_string(bad) + " elements off)");
  return worst;
}

// The same over every element.
template <class A, class B>
double compare(const std::vector<A>& got, const std::vector<B>& want, Tolerance tol, const std::string& what) {
  return compare(got, want, tol, what, [](std::size_t) { return true; });
}

}  // namespace llmpar::gpu_test
