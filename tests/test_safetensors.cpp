// safetensors (checkpoint/safetensors.hpp): a round trip keeps every tensor's name, dtype,
// shape and bytes and the metadata; the header is padded to 8 bytes; every way a file
// can be wrong (truncated, a header length beyond the file, bad JSON, an unknown dtype,
// offsets outside the data or not matching the shape, overlapping tensors, a gap, a
// wrong dtype asked for) is an error naming the file and the problem; and a fuzz of
// byte flips and truncations of a valid file either reads or throws that error, never
// crashes.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "llmpar/checkpoint/safetensors.hpp"
#include "llmpar/core/rng.hpp"

using namespace llmpar;

namespace {

std::vector<char> slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void dump(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
// A file of a raw header (padded or not) and `data` bytes.
void raw(const std::string& path, const std::string& header, std::size_t data) {
  std::vector<char> bytes(8 + header.size() + data, 0);
  for (int i = 0; i < 8; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  dump(path, bytes);
}

}  // namespace

TEST_CASE("safetensors: a round trip keeps names, dtypes, shapes, bytes and metadata") {
  const std::vector<float> w = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -0.5f};
  const std::vector<bf16> b = {bf16(1.0f), bf16(-3.0f)};
  const std::vector<std::int64_t> ids = {5, -9, 1ll << 40};
  const std::vector<checkpoint::safetensors::TensorRef> tensors = {
      {"h.0.attn.c_attn.weight", DType::f32, {2, 3}, w.data()},
      {"ln.bias", DType::bf16, {2}, b.data()},
      {"ids", DType::i64, {3}, ids.data()},
      {"empty", DType::f32, {0, 4}, nullptr}};
  checkpoint::safetensors::write("rt.safetensors", tensors, {{"format", "pt"}, {"step", "12"}});
  const auto bytes = slurp("rt.safetensors");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  CHECK(n % 8 == 0);
  CHECK(bytes.size() == 8 + n + w.size() * 4 + b.size() * 2 + ids.size() * 8);
  const auto f = checkpoint::safetensors::File::read("rt.safetensors");
  CHECK(f.tensors().size() == 4);
  CHECK(f.metadata().at("format") == "pt");
  CHECK(f.metadata().at("step") == "12");
  const auto& t = f.get("h.0.attn.c_attn.weight", DType::f32);
  CHECK(t.shape == std::vector<std::int64_t>{2, 3});
  CHECK(std::memcmp(f.bytes(t).data(), w.data(), w.size() * 4) == 0);
  CHECK(std::memcmp(f.bytes(f.get("ln.bias", DType::bf16)).data(), b.data(), 4) == 0);
  CHECK(std::memcmp(f.bytes(f.get("ids", DType::i64)).data(), ids.data(), 24) == 0);
  CHECK(f.get("empty", DType::f32).numel() == 0);
  CHECK_THROWS_WITH_AS(f.get("ln.bias", DType::f32), doctest::Contains("tensor 'ln.bias' is BF16, not F32"), Error);
  CHECK_THROWS_WITH_AS(f.get("wpe.weight", DType::f32), doctest::Contains("has no tensor 'wpe.weight'"), Error);
  const std::vector<checkpoint::safetensors::TensorRef> twice = {{"a", DType::f32, {1}, w.data()},
                                                                 {"a", DType::f32, {1}, w.data()}};
  CHECK_THROWS_WITH_AS(checkpoint::safetensors::write("twice.safetensors", twice),
                       doctest::Contains("two tensors named 'a'"), Error);
}

TEST_CASE("safetensors: every malformed file is an error naming the file and the problem") {
  auto fails = [](const std::string& path, const char* message) {
    CHECK_THROWS_WITH_AS(checkpoint::safetensors::File::read(path), doctest::Contains(message), Error);
    CHECK_THROWS_WITH_AS(checkpoint::safetensors::File::read(path), doctest::Contains(path.c_str()), Error);
  };
  dump("short.safetensors", {'\1', '\0', '\0'});
  fails("short.safetensors", "fewer than the 8 of the header length");
  raw("long_header.safetensors", "{}", 0);
  {
    auto bytes = slurp("long_header.safetensors");
    bytes[0] = 100;  // claims 100 header bytes, has 2
    dump("long_header.safetensors", bytes);
  }
  fails("long_header.safetensors", "says its header holds 100 bytes, but the file has 2");
  raw("not_json.safetensors", "{\"a\": [", 0);
  fails("not_json.safetensors", "is not a JSON object");
  raw("dtype.safetensors", R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", 2);
  fails("dtype.safetensors", "has dtype F8_E4M3; llmpar reads F32, BF16, F16, I32, I64 and U8");
  raw("size.safetensors", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8);
  fails("size.safetensors", "holds 8 bytes, but shape [3] of F32 needs 12");
  raw("outside.safetensors", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", 8);
  fails("outside.safetensors", "are outside the 8 bytes of data");
  raw("overlap.safetensors",
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
      8);
  fails("overlap.safetensors", "(overlapping or with a gap)");
  raw("gap.safetensors", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8);
  fails("gap.safetensors", "the tensors cover 4 bytes of data but the file holds 8");
  raw("negative.safetensors", R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4);
  fails("negative.safetensors", "has an entry that is not a non-negative integer");
  raw("fields.safetensors", R"({"a":{"dtype":"F32","shape":[1]}})", 4);
  fails("fields.safetensors", "needs dtype, shape and data_offsets");
  raw("meta.safetensors", R"({"__metadata__":{"step":12}})", 0);
  fails("meta.safetensors", "metadata 'step' is not a string");
  CHECK_THROWS_WITH_AS(checkpoint::safetensors::File::read("no_such.safetensors"),
                       doctest::Contains("cannot open no_such"), Error);
}

TEST_CASE("safetensors: flipped bytes and truncations read or fail with a named error, never crash") {
  std::vector<float> w(64);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.5f;
  const std::vector<checkpoint::safetensors::TensorRef> tensors = {{"wte.weight", DType::f32, {8, 8}, w.data()},
                                                                   {"wpe.weight", DType::f32, {0}, nullptr}};
  checkpoint::safetensors::write("fuzz_base.safetensors", tensors, {{"k", "v"}});
  const auto base = slurp("fuzz_base.safetensors");
  const auto stream = rng::Stream::named(9, "safetensors fuzz");
  int read = 0, refused = 0;
  for (std::uint64_t trial = 0; trial < 400; ++trial) {
    auto bytes = base;
    const auto r = stream.bits(trial);
    if (trial % 4 == 0) {
      bytes.resize(r[0] % bytes.size());  // truncated anywhere
    } else {
      for (int k = 0; k < 1 + static_cast<int>(r[1] % 3); ++k)  // 1-3 bytes of the header or its length
        bytes[(r[2] + 977u * static_cast<unsigned>(k)) % std::min<std::size_t>(bytes.size(), 160)] =
            static_cast<char>(r[3] >> (8 * k));
    }
    dump("fuzz.safetensors", bytes);
    try {
      const auto f = checkpoint::safetensors::File::read("fuzz.safetensors");
      for (const auto& t : f.tensors()) CHECK(f.bytes(t).size() == t.end - t.begin);
      ++read;
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("fuzz.safetensors") != std::string::npos);
      ++refused;
    }
  }
  INFO(read << " read, " << refused << " refused");
  CHECK(refused > 100);
  CHECK(read + refused == 400);
}
