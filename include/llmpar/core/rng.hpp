// llmpar/core/rng.hpp — counter-based random numbers (Philox4x32-10).
//
// A counter-based generator has no state to carry: the value at (key, counter) is a
// pure function. llmpar keys a parameter's generator by (seed, parameter name) and
// counts by the element's index in the *unsplit* tensor, so a rank that holds any
// slice of a weight computes exactly the values the serial model has there. That is
// what makes every parallel layout start from the serial model's weights.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string_view>

#include "llmpar/config.hpp"

namespace llmpar::rng {

// 64-bit FNV-1a: stable across platforms and runs (std::hash is neither).
constexpr std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<std::uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// splitmix64 finaliser: spreads seeds that differ in few bits.
constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

using Counter = std::array<std::uint32_t, 4>;
using Key = std::array<std::uint32_t, 2>;

LLMPAR_HOST_DEVICE std::uint32_t mulhilo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi) {
  const std::uint64_t p = static_cast<std::uint64_t>(a) * b;
  hi = static_cast<std::uint32_t>(p >> 32);
  return static_cast<std::uint32_t>(p);
}

// Philox4x32 with 10 rounds (Salmon et al., SC'11).
LLMPAR_HOST_DEVICE Counter philox4x32(Counter c, Key k) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    std::uint32_t hi0, hi1;
    const std::uint32_t lo0 = mulhilo(kM0, c[0], hi0);
    const std::uint32_t lo1 = mulhilo(kM1, c[2], hi1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += kW0;
    k[1] += kW1;
  }
  return c;
}

// Uniform in the open interval (0, 1) from 24 random bits.
LLMPAR_HOST_DEVICE float uniform_open(std::uint32_t x) {
  return (static_cast<float>(x >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

// A stream of random numbers named by a 64-bit key; element i is independent of all
// others and of the order in which elements are drawn.
struct Stream {
  Key key{};

  constexpr Stream() = default;
  constexpr explicit Stream(std::uint64_t k)
      : key{static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(k >> 32)} {}
  // The stream of a named quantity (a parameter, a data order, dropout) under a seed.
  static constexpr Stream named(std::uint64_t seed, std::string_view name) {
    return Stream(mix64(seed ^ mix64(fnv1a(name))));
  }

  // Four raw 32-bit values at position (index, lane).
  LLMPAR_HOST_DEVICE Counter bits(std::uint64_t index, std::uint32_t lane = 0) const {
    return philox4x32({static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32), lane, 0u}, key);
  }
  LLMPAR_HOST_DEVICE float uniform(std::uint64_t index) const { return uniform_open(bits(index)[0]); }
  // Standard normal at index (Box-Muller on two of the four words; computed in double
  // on the host so every host rank gets bit-identical values).
  double normal(std::uint64_t index) const {
    const Counter r = bits(index);
    const double u1 = (static_cast<double>(r[0]) + 0.5) * 0x1p-32;
    const double u2 = (static_cast<double>(r[1]) + 0.5) * 0x1p-32;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

// A random permutation of [0, n) that is computed, not stored: at(i) is the image of i,
// for any n up to 2^62, in O(1) memory. A data order of a billion sequences costs
// nothing to keep, to checkpoint (its key and n) or to look up at any position.
//
// Built as a balanced Feistel network on the smallest domain of 2^(2h) >= n elements
// (four rounds whose round function is a keyed splitmix64, which makes it a bijection on
// that domain whatever the round function is), restricted to [0, n) by cycle walking:
// an image outside [0, n) is mapped again until it falls inside, which keeps it a
// bijection on [0, n) and takes fewer than 4 rounds on average (the domain is < 4 n).
class Permutation {
 public:
  Permutation(std::uint64_t n, std::uint64_t key) : n_(n), key_(key) {
    while ((std::uint64_t{1} << (2 * half_bits_)) < n_) ++half_bits_;
    mask_ = (std::uint64_t{1} << half_bits_) - 1;
  }
  std::uint64_t size() const { return n_; }
  std::uint64_t at(std::uint64_t i) const {
    do {
      i = round_trip(i);
    } while (i >= n_);
    return i;
  }

 private:
  std::uint64_t round_trip(std::uint64_t x) const {
    std::uint64_t left = x >> half_bits_, right = x & mask_;
    for (std::uint64_t round = 0; round < 4; ++round) {
      const std::uint64_t f = mix64(key_ ^ mix64(right ^ (round << 58))) & mask_;
      const std::uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    return (left << half_bits_) | right;
  }

  std::uint64_t n_ = 0, key_ = 0, mask_ = 0;
  int half_bits_ = 0;
};

}  // namespace llmpar::rng
