// llmpar/core/crc32c.hpp — CRC-32C (Castagnoli), the checksum of stored tensors.
//
// A checkpoint stores every tensor with its CRC-32C, and a load refuses a tensor whose
// bytes no longer match, naming it and its file: a flipped bit on disk must be an error,
// not a silently different model. CRC-32C because it catches every burst of up to 32
// flipped bits and every odd number of flipped bits, it is what storage systems use for
// the same job, and x86-64 computes it in hardware (SSE4.2's crc32 instruction, 8 bytes
// per instruction); elsewhere a table, one byte per step, about 1 GB/s: a checkpoint is
// read from disk slower than that.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace llmpar {

namespace detail {

inline constexpr std::array<std::uint32_t, 256> kCrc32cTable = [] {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // the reflected polynomial
    table[i] = c;
  }
  return table;
}();

}  // namespace detail

// The CRC-32C of `bytes` bytes at `data`, continuing from `crc` (the value for the bytes
// before them; 0 for none), so a long tensor can be checked a chunk at a time:
// crc32c(b, m, crc32c(a, n)) == crc32c(a ++ b, n + m).
inline std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
#if defined(__SSE4_2__)
  std::uint64_t c64 = c;
  for (; bytes >= 8; bytes -= 8, p += 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c64 = _mm_crc32_u64(c64, word);
  }
  c = static_cast<std::uint32_t>(c64);
#endif
  for (; bytes > 0; --bytes, ++p) c = detail::kCrc32cTable[(c ^ *p) & 0xffu] ^ (c >> 8);
  return ~c;
}

}  // namespace llmpar
