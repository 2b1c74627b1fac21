// Core types: dtype conversions against exact values, the counter-based RNG, buffers,
// CRC-32C.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>

#include "llmpar/config.hpp"
#include "llmpar/core/crc32c.hpp"
#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/core/tensor.hpp"

using namespace llmpar;

namespace {
std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

TEST_CASE("bf16 rounds to nearest even on exact values") {
  CHECK(bf16(1.0f).bits == 0x3F80);
  CHECK(bf16(-2.0f).bits == 0xC000);
  CHECK(bf16(0.0f).bits == 0x0000);
  CHECK(bf16(-0.0f).bits == 0x8000);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to the even (1.0).
  CHECK(bf16(float_of(0x3F808000)).bits == 0x3F80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
  CHECK(bf16(float_of(0x3F818000)).bits == 0x3F82);
  // Just above halfway rounds up.
  CHECK(bf16(float_of(0x3F808001)).bits == 0x3F81);
  CHECK(bf16(std::numeric_limits<float>::infinity()).bits == 0x7F80);
  CHECK(std::isnan(static_cast<float>(bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low bits must not round to infinity.
  CHECK(std::isnan(static_cast<float>(bf16(float_of(0x7F800001)))));
  // The largest finite float rounds to infinity in bf16.
  CHECK(bf16(std::numeric_limits<float>::max()).bits == 0x7F80);
  for (std::uint32_t b = 0; b < 0x7F80; b += 7) CHECK(bf16(static_cast<float>(bf16::from_bits(b))).bits == b);
}

TEST_CASE("f16 rounds to nearest even with subnormals, overflow and NaN") {
  CHECK(f16(1.0f).bits == 0x3C00);
  CHECK(f16(-2.0f).bits == 0xC000);
  CHECK(f16(65504.0f).bits == 0x7BFF);
  CHECK(f16(65519.0f).bits == 0x7BFF);
  CHECK(f16(65520.0f).bits == 0x7C00);               // halfway to 65536 ties to infinity (odd mantissa)
  CHECK(f16(std::ldexp(1.0f, -14)).bits == 0x0400);  // smallest normal
  CHECK(f16(std::ldexp(1.0f, -24)).bits == 0x0001);  // smallest subnormal
  CHECK(f16(std::ldexp(1.0f, -25)).bits == 0x0000);  // halfway to zero: ties to even
  CHECK(f16(std::ldexp(1.5f, -25)).bits == 0x0001);
  CHECK(f16(std::ldexp(3.0f, -25)).bits == 0x0002);             // 1.5 units: ties to even (2)
  CHECK(f16(std::ldexp(5.0f, -25)).bits == 0x0002);             // 2.5 units: ties to even (2)
  CHECK(f16(1.0f + std::ldexp(1.0f, -11)).bits == 0x3C00);      // halfway: even
  CHECK(f16(1.0f + 3 * std::ldexp(1.0f, -11)).bits == 0x3C02);  // halfway: even (up)
  CHECK(f16(-std::numeric_limits<float>::infinity()).bits == 0xFC00);
  CHECK(std::isnan(static_cast<float>(f16(std::numeric_limits<float>::quiet_NaN()))));
  // Every finite f16 converts to float and back to itself.
  for (std::uint32_t b = 0; b < 0x7C00; ++b) {
    const f16 h = f16::from_bits(static_cast<std::uint16_t>(b));
    REQUIRE(f16(static_cast<float>(h)).bits == b);
    REQUIRE(f16(-static_cast<float>(h)).bits == (b | 0x8000));
  }
  CHECK(static_cast<float>(f16::from_bits(0x0001)) == std::ldexp(1.0f, -24));
  CHECK(bits_of(static_cast<float>(f16::from_bits(0x8000))) == 0x80000000u);
}

TEST_CASE("convert goes through float between any two floating types") {
  CHECK(convert<float>(bf16(3.0f)) == 3.0f);
  CHECK(convert<f16>(bf16(0.5f)).bits == f16(0.5f).bits);
  CHECK(size_of(dtype_of<bf16>()) == 2);
  CHECK(name_of(dtype_of<float>()) == "f32");
}

TEST_CASE("Philox matches the Random123 known-answer vectors") {
  // Known-answer test for philox4x32-10 from Random123 (kat_vectors).
  const rng::Counter zero = rng::philox4x32({0, 0, 0, 0}, {0, 0});
  CHECK(zero[0] == 0x6627e8d5u);
  CHECK(zero[1] == 0xe169c58du);
  CHECK(zero[2] == 0xbc57ac4cu);
  CHECK(zero[3] == 0x9b00dbd8u);
  const rng::Counter ones =
      rng::philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  CHECK(ones[0] == 0x408f276du);
  CHECK(ones[1] == 0x41c83b0eu);
  CHECK(ones[2] == 0xa20bc7c6u);
  CHECK(ones[3] == 0x6d5451fdu);
}

TEST_CASE("a named stream's value depends only on seed, name and index") {
  const auto a = rng::Stream::named(1337, "h.0.attn.qkv.weight");
  const auto b = rng::Stream::named(1337, "h.0.attn.qkv.weight");
  const auto other_name = rng::Stream::named(1337, "h.0.attn.proj.weight");
  const auto other_seed = rng::Stream::named(1338, "h.0.attn.qkv.weight");
  CHECK(a.normal(12345) == b.normal(12345));
  CHECK(a.normal(12345) != other_name.normal(12345));
  CHECK(a.normal(12345) != other_seed.normal(12345));
  // Moments of the normal draw over many indices.
  double sum = 0, sum2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = a.normal(i);
    sum += x;
    sum2 += x * x;
  }
  CHECK(std::abs(sum / n) < 0.01);
  CHECK(std::abs(sum2 / n - 1.0) < 0.02);
  for (int i = 0; i < 1000; ++i) {
    const float u = a.uniform(i);
    REQUIRE(u > 0.0f);
    REQUIRE(u < 1.0f);
  }
}

TEST_CASE("buffers are aligned, movable and checked") {
  Buffer<float> buf(1000);
  CHECK(reinterpret_cast<std::uintptr_t>(buf.data()) % kHostAlignment == 0);
  buf.zero();
  CHECK(buf[999] == 0.0f);
  Buffer<float> moved = std::move(buf);
  CHECK(moved.size() == 1000);
  CHECK(buf.size() == 0);
  CHECK(moved.view({10, 100}).numel() == 1000);
  CHECK_THROWS_WITH_AS(moved.view({10, 101}), doctest::Contains("needs 1010 elements; buffer holds 1000"), Error);
  CHECK_THROWS_WITH_AS(Shape({3, -1}), doctest::Contains("shape dimension 1 is -1"), Error);
}

TEST_CASE("LLMPAR_CHECK names file, line, values and the failed expression") {
  const int heads = 12, dim = 100;
  try {
    LLMPAR_CHECK(dim % heads == 0, "--dim ", dim, " is not divisible by --heads ", heads);
    FAIL("no throw");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK(what.find("test_core.cpp:") != std::string::npos);
    CHECK(what.find("--dim 100 is not divisible by --heads 12") != std::string::npos);
    CHECK(what.find("dim % heads == 0") != std::string::npos);
    CHECK(e.line() > 0);
  }
}

namespace {
struct Streamed {
  int v;
};
std::ostream& operator<<(std::ostream& os, const Streamed& s) { return os << "Streamed(" << s.v << ")"; }
}  // namespace

TEST_CASE("detail::concat prints every kind of message part as an ostream would") {
  const std::string text = "str";
  const std::string_view view = "view";
  const char* no_text = nullptr;
  std::ostringstream os;
  os << "lit" << text << view << 'c' << true << false << static_cast<signed char>('s')
     << static_cast<unsigned char>('u') << short{-3} << -42 << std::numeric_limits<std::int64_t>::min()
     << std::numeric_limits<std::uint64_t>::max() << std::size_t{7} << 0.1f << -2.5e-7 << Streamed{9};
  CHECK(detail::concat("lit", text, view, 'c', true, false, static_cast<signed char>('s'),
                       static_cast<unsigned char>('u'), short{-3}, -42, std::numeric_limits<std::int64_t>::min(),
                       std::numeric_limits<std::uint64_t>::max(), std::size_t{7}, 0.1f, -2.5e-7,
                       Streamed{9}) == os.str());
  CHECK(detail::concat("a", no_text, "b") == "ab");
  // Literals of other lengths and integers of other widths give the same message shape.
  CHECK(detail::concat("rank ", 3u, " of ", std::int16_t{4}) == "rank 3 of 4");
  CHECK_THROWS_WITH_AS(LLMPAR_FAIL("width ", std::uint16_t{65535}, ", scale ", 0.5f),
                       doctest::Contains("width 65535, scale 0.5"), Error);
}

TEST_CASE("llmpar::kVersion is the project VERSION of CMakeLists.txt (checkpoints record it)") {
  std::ifstream in(std::filesystem::path(LLMPAR_SOURCE_DIR) / "CMakeLists.txt");
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  std::string line = "project(llmpar VERSION ";
  line.append(kVersion).append(" ");
  CHECK(text.find(line) != std::string::npos);
}

TEST_CASE("crc32c: the standard check value, chunked the same as whole, and every single-bit flip detected") {
  const std::string check = "123456789";
  CHECK(crc32c(check.data(), check.size()) == 0xE3069283u);  // CRC-32C's published check value
  CHECK(crc32c(nullptr, 0) == 0u);
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>('a' + (i * 7) % 26);
  const std::uint32_t whole = crc32c(text.data(), text.size());
  for (std::size_t cut : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{500}}) {
    CAPTURE(cut);
    CHECK(crc32c(text.data() + cut, text.size() - cut, crc32c(text.data(), cut)) == whole);
  }
  int detected = 0;
  for (std::size_t i = 0; i < 64; ++i)
    for (int b = 0; b < 8; ++b) {
      std::string flipped = text;
      flipped[i * 13] = static_cast<char>(flipped[i * 13] ^ (1 << b));
      detected += crc32c(flipped.data(), flipped.size()) != whole ? 1 : 0;
    }
  CHECK(detected == 64 * 8);
}
