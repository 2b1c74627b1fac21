// Helpers shared by the doctest programs of the CPU kernels (tests/test_kernels_*.cpp):
// named random inputs, rounding to and from a storage type, relative errors, central
// finite differences in double, and running under a given OpenMP thread count.
#pragma once

#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "llmpar/core/dtype.hpp"
#include "llmpar/core/rng.hpp"

namespace llmpar::kernel_test {

inline constexpr std::uint64_t kSeed = 20240611;
// Central differences in double: truncation ~h^2, rounding ~1e-16 |loss| / h.
inline constexpr double kFdStep = 1e-6;
inline constexpr double kFdTolerance = 1e-6;

// mean + stddev * N(0, 1), element i of the stream `name` under kSeed.
inline std::vector<double> random_normal(std::int64_t n, const std::string& name, double stddev = 1.0,
                                         double mean = 0.0) {
  const auto stream = rng::Stream::named(kSeed, name);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[i] = mean + stddev * stream.normal(static_cast<std::uint64_t>(i));
  return v;
}

// Rounds to T (through float for float, bf16 and f16).
template <class T>
std::vector<T> cast_to(const std::vector<double>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<T, double>)
      out[i] = v[i];
    else
      out[i] = static_cast<T>(static_cast<float>(v[i]));
  }
  return out;
}

template <class T>
std::vector<double> to_double(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<T, double>)
      out[i] = v[i];
    else
      out[i] = static_cast<double>(static_cast<float>(v[i]));
  }
  return out;
}

// max |a - b| / max |b|: an error relative to the scale of the expected values.
template <class A, class B>
double relative_error(const std::vector<A>& a, const std::vector<B>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0.0 ? diff / scale : diff;
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
std::vector<T> minus(const std::vector<T>& a, const std::vector<T>& b) {
  std::vector<T> out(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) out[i] = a[i] - b[i];
  return out;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// d loss / d p for every element of p, by central differences (p is restored).
inline std::vector<double> finite_difference(std::vector<double>& p, const std::function<double()>& loss) {
  std::vector<double> grad(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double saved = p[i];
    p[i] = saved + kFdStep;
    const double up = loss();
    p[i] = saved - kFdStep;
    const double down = loss();
    p[i] = saved;
    grad[i] = (up - down) / (2.0 * kFdStep);
  }
  return grad;
}

// Runs f with n OpenMP threads, restoring the previous count afterwards.
template <class F>
void with_threads(int n, F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(n);
  f();
  omp_set_num_threads(saved);
}

}  // namespace llmpar::kernel_test
