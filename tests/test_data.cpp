// Data layer: shard format (versions 1 and 2) and its errors, the byte tokenizer, datasets, the loader
// (sequences, global batches split over ranks and micro-batches, the seeded order,
// resume at any layout) and the fortunes corpus.
#include <doctest/doctest.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "llmpar/core/error.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/data/shard.hpp"
#include "llmpar/data/tokenizer.hpp"
#include "temp_dir.hpp"

using namespace llmpar;
using namespace llmpar::data;
namespace fs = std::filesystem;

namespace {

// A fresh directory under the system temp dir, removed with everything in it.
struct TempDir : test_util::TempDir {
  TempDir() : test_util::TempDir("data") {}
};

void write_bytes(const fs::path& p, const void* data, std::size_t n) {
  std::ofstream out(p, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  REQUIRE(out.good());
}

void write_text(const fs::path& p, const std::string& s) { write_bytes(p, s.data(), s.size()); }

// A shard written by hand, so the reader is tested against the format, not the writer.
void write_raw_shard(const fs::path& p, std::int32_t magic, std::int32_t version, std::int32_t count,
                     const std::vector<std::uint16_t>& tokens) {
  std::vector<unsigned char> bytes(1024 + tokens.size() * 2, 0);
  const std::int32_t h[3] = {magic, version, count};
  for (int i = 0; i < 3; ++i)
    for (int b = 0; b < 4; ++b)
      bytes[i * 4 + b] = static_cast<unsigned char>(static_cast<std::uint32_t>(h[i]) >> (8 * b));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    bytes[1024 + 2 * i] = static_cast<unsigned char>(tokens[i] & 0xff);
    bytes[1024 + 2 * i + 1] = static_cast<unsigned char>(tokens[i] >> 8);
  }
  write_bytes(p, bytes.data(), bytes.size());
}

// A version-2 (uint32 tokens) shard written by hand.
void write_raw_shard32(const fs::path& p, std::int32_t count, const std::vector<std::uint32_t>& tokens,
                       std::int32_t version = 2) {
  std::vector<unsigned char> bytes(1024 + tokens.size() * 4, 0);
  const std::int32_t h[3] = {20240520, version, count};
  for (int i = 0; i < 3; ++i)
    for (int b = 0; b < 4; ++b)
      bytes[i * 4 + b] = static_cast<unsigned char>(static_cast<std::uint32_t>(h[i]) >> (8 * b));
  for (std::size_t i = 0; i < tokens.size(); ++i)
    for (std::size_t b = 0; b < 4; ++b) bytes[1024 + 4 * i + b] = static_cast<unsigned char>(tokens[i] >> (8 * b));
  write_bytes(p, bytes.data(), bytes.size());
}

std::vector<unsigned char> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::uint16_t> iota_tokens(std::size_t n, int modulo = 65536) {
  std::vector<std::uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::uint16_t>(i % static_cast<std::size_t>(modulo));
  return t;
}

std::vector<std::int32_t> to_vector(View<const std::int32_t> v) { return {v.begin(), v.end()}; }

std::vector<std::int32_t> range(std::int32_t first, std::int32_t count) {
  std::vector<std::int32_t> r(static_cast<std::size_t>(count));
  std::iota(r.begin(), r.end(), first);
  return r;
}

// Builds expected messages (GCC 12 warns falsely on `"literal" + std::string&&`).
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace

TEST_CASE("write_shard and TokenShard round-trip tokens in the llm.c byte layout") {
  TempDir dir;
  const auto tokens = iota_tokens(70000);  // spans all uint16 values and then wraps
  write_shard(dir / "a.bin", tokens);

  CHECK(fs::file_size(dir / "a.bin") == 1024 + 2 * tokens.size());
  std::ifstream raw(dir / "a.bin", std::ios::binary);
  std::array<unsigned char, 1030> head{};
  raw.read(reinterpret_cast<char*>(head.data()), head.size());
  CHECK(head[0] + (head[1] << 8) + (head[2] << 16) + (head[3] << 24) == 20240520);
  CHECK(head[4] == 1);
  CHECK(head[8] + (head[9] << 8) + (head[10] << 16) == 70000);
  CHECK(head[1024 + 2] == 1);  // token 1, little-endian
  CHECK(head[1024 + 3] == 0);

  TokenShard shard(dir / "a.bin");
  REQUIRE(shard.size() == tokens.size());
  CHECK(shard[0] == 0);
  CHECK(shard[65535] == 65535);
  CHECK(shard[65536] == 0);
  CHECK(std::equal(tokens.begin(), tokens.end(), shard.tokens().begin()));

  TokenShard moved = std::move(shard);
  CHECK(moved.size() == tokens.size());
  CHECK(shard.size() == 0);

  // An empty shard is valid; rewriting replaces the file and leaves no temporary behind.
  write_shard(dir / "a.bin", std::vector<std::uint16_t>{});
  CHECK(TokenShard(dir / "a.bin").size() == 0);
  write_shard(dir / "a.bin", std::vector<std::uint16_t>{7, 8, 9});
  CHECK(TokenShard(dir / "a.bin")[2] == 9);
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path)) ++entries;
  CHECK(entries == 1);
}

TEST_CASE("write_shard into a missing directory names the directory") {
  TempDir dir;
  const std::vector<std::uint16_t> t{1, 2};
  CHECK(error_of([&] {
          write_shard(dir / "nope/a.bin", t);
        }).find(cat("in directory '", (dir / "nope").string(), "'")) != std::string::npos);
}

TEST_CASE("each corrupt shard gets an error naming the file, the problem and the fix") {
  TempDir dir;
  SUBCASE("missing file") {
    const std::string e = error_of([&] { TokenShard s(dir / "missing.bin"); });
    CHECK(e.find(cat("cannot open token shard '", (dir / "missing.bin").string(), "'")) != std::string::npos);
    CHECK(e.find("No such file or directory") != std::string::npos);
    CHECK(e.find("prepare_data --out PREFIX") != std::string::npos);
  }
  SUBCASE("shorter than the header") {
    write_text(dir / "short.bin", std::string(100, '\0'));
    const std::string e = error_of([&] { TokenShard s(dir / "short.bin"); });
    CHECK(e.find("short.bin' is 100 bytes, shorter than the 1024-byte shard header; it is truncated") !=
          std::string::npos);
    // A short text file is recognised as text.
    write_text(dir / "short.txt", "to be\n");
    const std::string t = error_of([&] { TokenShard s(dir / "short.txt"); });
    CHECK(t.find("is 6 bytes, shorter than the 1024-byte shard header (its first bytes read 'to b'") !=
          std::string::npos);
    CHECK(t.find(cat("prepare_data --out PREFIX ", (dir / "short.txt").string())) != std::string::npos);
  }
  SUBCASE("wrong magic: a raw text file") {
    std::string text;
    while (text.size() < 3000) text += "First Citizen:\nBefore we proceed any further, hear me speak.\n";
    write_text(dir / "input.txt", text);
    const std::string e = error_of([&] { TokenShard s(dir / "input.txt"); });
    CHECK(e.find("has magic 1936877894") != std::string::npos);  // "Firs" as little-endian int32
    CHECK(e.find("'Firs'") != std::string::npos);
    CHECK(e.find("expected 20240520") != std::string::npos);
    CHECK(e.find("raw text file") != std::string::npos);
    CHECK(e.find(cat("prepare_data --out PREFIX ", (dir / "input.txt").string())) != std::string::npos);
  }
  SUBCASE("unsupported version") {
    write_raw_shard(dir / "v3.bin", 20240520, 3, 3, {1, 2, 3});
    const std::string e = error_of([&] { TokenShard s(dir / "v3.bin"); });
    CHECK(e.find("v3.bin' has version 3; this reader supports versions 1 (uint16 tokens) and 2 (uint32 tokens)") !=
          std::string::npos);
  }
  SUBCASE("truncated body") {
    write_raw_shard(dir / "cut.bin", 20240520, 1, 100, iota_tokens(50));
    const std::string e = error_of([&] { TokenShard s(dir / "cut.bin"); });
    CHECK(e.find("cut.bin' header says 100 tokens, so expected 1224 bytes, but the file is 1124 bytes (truncated") !=
          std::string::npos);
  }
  SUBCASE("trailing bytes") {
    write_raw_shard(dir / "long.bin", 20240520, 1, 2, iota_tokens(3));
    CHECK(error_of([&] { TokenShard s(dir / "long.bin"); }).find("trailing bytes") != std::string::npos);
  }
  SUBCASE("a directory") {
    fs::create_directory(dir / "d.bin");
    CHECK(error_of([&] { TokenShard s(dir / "d.bin"); }).find("d.bin' is a directory") != std::string::npos);
  }
}

TEST_CASE("a hand-written shard reads back exactly") {
  TempDir dir;
  write_raw_shard(dir / "h.bin", 20240520, 1, 4, {0x0102, 0xfffe, 0, 258});
  TokenShard s(dir / "h.bin");
  REQUIRE(s.size() == 4);
  CHECK(s[0] == 0x0102);
  CHECK(s[1] == 0xfffe);
  CHECK(s[3] == 258);
}

TEST_CASE("version-2 shards round-trip uint32 tokens; version 1 is written while every id fits uint16") {
  TempDir dir;
  std::vector<std::uint32_t> wide(1000);
  for (std::size_t i = 0; i < wide.size(); ++i) wide[i] = static_cast<std::uint32_t>(i * 131);  // up to 130869
  write_shard(dir / "w.bin", wide);
  CHECK(fs::file_size(dir / "w.bin") == 1024 + 4 * wide.size());
  const auto bytes = file_bytes(dir / "w.bin");
  CHECK(bytes[4] == 2);  // version 2
  CHECK(bytes[8] + (bytes[9] << 8) == 1000);
  // Token 999 = 130869 = 0x0001ff35, little-endian.
  CHECK(std::vector<unsigned char>(bytes.end() - 4, bytes.end()) == std::vector<unsigned char>{0x35, 0xff, 0x01, 0});

  TokenShard shard(dir / "w.bin");
  CHECK(shard.version() == 2);
  CHECK(shard.token_bytes() == 4);
  REQUIRE(shard.size() == wide.size());
  CHECK(shard[999] == 130869);
  CHECK(std::equal(wide.begin(), wide.end(), shard.tokens32().begin()));
  CHECK(shard.view().token_bytes() == 4);
  CHECK(shard.view()[500] == 500 * 131);
  CHECK(error_of([&] { (void)shard.tokens(); }).find("w.bin' holds uint32 tokens (version 2), not uint16") !=
        std::string::npos);
  TokenShard moved = std::move(shard);
  CHECK(moved.version() == 2);
  CHECK(moved[1] == 131);

  // uint32 ids that all fit are written as version 1, byte for byte what uint16 ids give;
  // ShardWidth::uint32 writes version 2 from either.
  const std::vector<std::uint32_t> small32{1, 65535, 0, 7};
  const std::vector<std::uint16_t> small16{1, 65535, 0, 7};
  write_shard(dir / "a32.bin", small32);
  write_shard(dir / "a16.bin", small16);
  CHECK(file_bytes(dir / "a32.bin") == file_bytes(dir / "a16.bin"));
  CHECK(TokenShard(dir / "a32.bin").version() == 1);
  write_shard(dir / "b16.bin", small16, ShardWidth::uint32);
  write_shard(dir / "b32.bin", small32, ShardWidth::uint32);
  CHECK(file_bytes(dir / "b16.bin") == file_bytes(dir / "b32.bin"));
  const TokenShard b(dir / "b16.bin");
  CHECK(b.version() == 2);
  CHECK(std::equal(small32.begin(), small32.end(), b.tokens32().begin()));
  CHECK(error_of([&] {
          (void)TokenShard(dir / "a16.bin").tokens32();
        }).find("a16.bin' holds uint16 tokens (version 1), not uint32") != std::string::npos);

  // More than one conversion chunk (65536 tokens) narrows and widens exactly.
  std::vector<std::uint32_t> many(200000);
  for (std::size_t i = 0; i < many.size(); ++i) many[i] = static_cast<std::uint32_t>((i * 7919) % 65536);
  write_shard(dir / "m.bin", many);
  const TokenShard m(dir / "m.bin");
  CHECK(m.version() == 1);
  CHECK(std::equal(many.begin(), many.end(), m.tokens().begin()));
  write_shard(dir / "m2.bin", m.tokens(), ShardWidth::uint32);
  CHECK(std::equal(many.begin(), many.end(), TokenShard(dir / "m2.bin").tokens32().begin()));
}

TEST_CASE("a hand-written version-2 shard reads back exactly, ids above 65535 and INT32_MAX included") {
  TempDir dir;
  write_raw_shard32(dir / "h2.bin", 5, {0x01020304, 65536, 0, 128255, 0xffffffffu});
  const TokenShard s(dir / "h2.bin");
  REQUIRE(s.size() == 5);
  CHECK(s.version() == 2);
  CHECK(s[0] == 0x01020304);
  CHECK(s[1] == 65536);
  CHECK(s[3] == 128255);
  CHECK(s[4] == 0xffffffffu);
}

TEST_CASE("each corrupt version-2 shard gets an error naming the file and the problem") {
  TempDir dir;
  SUBCASE("truncated body") {
    write_raw_shard32(dir / "cut2.bin", 100, std::vector<std::uint32_t>(30, 70000));
    const std::string e = error_of([&] { TokenShard s(dir / "cut2.bin"); });
    CHECK(e.find("cut2.bin' header says 100 tokens, so expected 1424 bytes, but the file is 1144 bytes (truncated") !=
          std::string::npos);
  }
  SUBCASE("trailing bytes") {
    write_raw_shard32(dir / "long2.bin", 2, {1, 2, 3});
    CHECK(error_of([&] { TokenShard s(dir / "long2.bin"); })
              .find("long2.bin' header says 2 tokens, so expected 1032 "
                    "bytes, but the file is 1036 bytes (trailing") != std::string::npos);
  }
  SUBCASE("uint32 tokens under a version-1 header") {
    write_raw_shard32(dir / "mixed.bin", 4, {1, 2, 3, 4}, /*version=*/1);
    const std::string e = error_of([&] { TokenShard s(dir / "mixed.bin"); });
    CHECK(e.find("mixed.bin' header says 4 tokens, so expected 1032 bytes, but the file is 1040 bytes") !=
          std::string::npos);
    CHECK(e.find("that is the size of 4 tokens of 4 bytes, not the 2 of a version-1 shard: is the header's version "
                 "wrong?") != std::string::npos);
  }
}

TEST_CASE("the loader reads the same batches from tokens stored as version 1 and as version 2") {
  TempDir dir;
  const auto tokens = iota_tokens(500, 300);
  write_shard(dir / "v1_train_0.bin", tokens);
  write_shard(dir / "v2_train_0.bin", tokens, ShardWidth::uint32);
  // Mixed widths in one dataset: shard 0 of version 1, shard 1 of version 2.
  write_shard(dir / "mix_train_0.bin", std::span<const std::uint16_t>(tokens).first(250));
  write_shard(dir / "mix_train_1.bin", std::span<const std::uint16_t>(tokens).last(250), ShardWidth::uint32);
  write_shard(dir / "split_train_0.bin", std::span<const std::uint16_t>(tokens).first(250));
  write_shard(dir / "split_train_1.bin", std::span<const std::uint16_t>(tokens).last(250));
  const auto v1 = TokenDataset::from_shards((dir / "v1_train_*.bin").string(), 300);
  const auto v2 = TokenDataset::from_shards((dir / "v2_train_*.bin").string(), 300);
  const auto mix = TokenDataset::from_shards((dir / "mix_train_*.bin").string(), 300);
  const auto split = TokenDataset::from_shards((dir / "split_train_*.bin").string(), 300);
  CHECK(v1.shard(0).token_bytes() == 2);
  CHECK(v2.shard(0).token_bytes() == 4);
  CHECK(mix.shard(1).token_bytes() == 4);
  for (const bool shuffle : {false, true}) {
    CAPTURE(shuffle);
    const LoaderConfig config{.batch_size = 3, .seq_len = 7, .shuffle = shuffle, .seed = 5};
    DataLoader a(v1, config), b(v2, config), c(mix, config), d(split, config);
    for (int step = 0; step < 40; ++step) {  // across the end of an epoch
      const Batch x = a.next(), y = b.next(), m = c.next(), s = d.next();
      CHECK(to_vector(y.inputs) == to_vector(x.inputs));
      CHECK(to_vector(y.targets) == to_vector(x.targets));
      CHECK(to_vector(m.inputs) == to_vector(s.inputs));
      CHECK(to_vector(m.targets) == to_vector(s.targets));
    }
  }
}

TEST_CASE("ids of a version-2 shard are checked against vocabularies above 65536") {
  TempDir dir;
  std::vector<std::uint32_t> tokens(20);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>(128000 + i);
  write_shard(dir / "l_train_000.bin", tokens);
  tokens[13] = 128256;
  write_shard(dir / "l_train_001.bin", tokens);
  const std::string e = error_of([&] { TokenDataset::from_shards((dir / "l_train_*.bin").string(), 128256); });
  CHECK(e.find(cat("'", (dir / "l_train_001.bin").string(),
                   "' holds token id 128256 at position 13, but the vocab size is 128256")) != std::string::npos);
  const auto ds = TokenDataset::from_shards((dir / "l_train_*.bin").string(), 128257);
  CHECK(ds.num_tokens() == 40);
  DataLoader loader(ds, {.batch_size = 1, .seq_len = 4});
  CHECK(to_vector(loader.next().inputs) == range(128000, 4));

  // An id above INT32_MAX is out of every vocabulary (not a negative id that passes).
  write_raw_shard32(dir / "big_train.bin", 3, {5, 0x80000000u, 6});
  const std::string big = error_of([&] { TokenDataset::from_shards((dir / "big_train.bin").string(), 1 << 30); });
  CHECK(big.find("holds token id 2147483648 at position 1, but the vocab size is 1073741824") != std::string::npos);

  // uint16 shards train a vocabulary above 65536 too (Llama 3 on byte-level data).
  write_shard(dir / "b_train.bin", iota_tokens(10));
  CHECK(TokenDataset::from_shards((dir / "b_train.bin").string(), 128256).num_tokens() == 10);
  CHECK(error_of([] { TokenDataset::from_tokens({1}, 0); }).find("vocab_size 0 is out of range") != std::string::npos);
}

TEST_CASE("a token id at or above the vocab size is an error naming file, position, id and vocab") {
  TempDir dir;
  auto tokens = iota_tokens(20, 10);
  tokens[7] = 300;
  write_shard(dir / "x_train_000.bin", iota_tokens(20, 10));
  write_shard(dir / "x_train_001.bin", tokens);
  const std::string e = error_of([&] { TokenDataset::from_shards((dir / "x_train_*.bin").string(), 256); });
  CHECK(e.find(cat("'", (dir / "x_train_001.bin").string(),
                   "' holds token id 300 at position 7, but the vocab size is 256")) != std::string::npos);
  // A vocab exactly one above the largest id is fine.
  CHECK(TokenDataset::from_shards((dir / "x_train_*.bin").string(), 301).num_tokens() == 40);

  const std::string m = error_of([] { TokenDataset::from_tokens({1, 2, 256}, 256, "corpus"); });
  CHECK(m.find("'corpus' holds token id 256 at position 2, but the vocab size is 256") != std::string::npos);
}

TEST_CASE("a glob that matches nothing says how to create the shards") {
  TempDir dir;
  const std::string pattern = (dir / "x_train*.bin").string();
  const std::string e = error_of([&] { TokenDataset::from_shards(pattern, 256); });
  CHECK(e.find(cat("no shard matches '", pattern, "'; run `prepare_data --out ", (dir / "x").string(), " FILE...`")) !=
        std::string::npos);
}

TEST_CASE("shards are opened in byte order of their names") {
  TempDir dir;
  write_shard(dir / "d_train_B.bin", std::vector<std::uint16_t>{2});
  write_shard(dir / "d_train_a.bin", std::vector<std::uint16_t>{3});
  write_shard(dir / "d_train_A.bin", std::vector<std::uint16_t>{1});
  const auto ds = TokenDataset::from_shards((dir / "d_train_*.bin").string(), 256);
  REQUIRE(ds.num_shards() == 3);
  CHECK(ds.shard(0)[0] == 1);
  CHECK(ds.shard(1)[0] == 2);
  CHECK(ds.shard(2)[0] == 3);
  CHECK(ds.shard_name(2) == (dir / "d_train_a.bin").string());
}

TEST_CASE("DataLoader batches are consecutive B*T+1 slices with targets shifted by one") {
  const auto ds = TokenDataset::from_tokens(iota_tokens(100), 65536);
  DataLoader loader(ds, {.batch_size = 2, .seq_len = 3});
  CHECK(loader.batches_per_epoch() == 16);  // (100 - 1) / 6
  Batch b = loader.next();
  CHECK(b.inputs.shape == Shape{2, 3});
  CHECK(b.targets.shape == Shape{2, 3});
  CHECK(to_vector(b.inputs) == range(0, 6));
  CHECK(to_vector(b.targets) == range(1, 6));
  b = loader.next();
  CHECK(to_vector(b.inputs) == range(6, 6));
  CHECK(to_vector(b.targets) == range(7, 6));
  CHECK(b.inputs[3] == 9);  // row 1, column 0
}

TEST_CASE("DataLoader wraps to the start after the last full batch and counts epochs") {
  // 25 tokens, B*T = 6: windows at 0, 6, 12, 18 (18 + 6 + 1 = 25 fits exactly).
  const auto ds = TokenDataset::from_tokens(iota_tokens(25), 256);
  DataLoader loader(ds, {.batch_size = 2, .seq_len = 3});
  CHECK(loader.batches_per_epoch() == 4);
  for (int i = 0; i < 4; ++i) {
    CHECK(loader.epoch() == 0);
    const Batch b = loader.next();
    CHECK(b.inputs[0] == 6 * i);
    CHECK(b.targets[5] == 6 * i + 6);
  }
  CHECK(loader.epoch() == 1);
  CHECK(loader.next().inputs[0] == 0);
  loader.next();
  loader.reset();
  CHECK(loader.epoch() == 0);
  CHECK(loader.next().inputs[0] == 0);
}

TEST_CASE("a sequence never spans two shards, and a global batch runs on into the next shard") {
  TempDir dir;
  std::vector<std::uint16_t> a(20), b(14);
  std::iota(a.begin(), a.end(), 0);
  std::iota(b.begin(), b.end(), 100);
  write_shard(dir / "s_train_0.bin", a);
  write_shard(dir / "s_train_1.bin", b);
  const auto ds = TokenDataset::from_shards((dir / "s_train_*.bin").string(), 256);
  // T = 3: shard 0 holds (20 - 1) / 3 = 6 sequences (0, 3, ... 15), shard 1 holds 4
  // (100, 103, 106, 109); 10 in all.
  DataLoader loader(ds, {.batch_size = 2, .seq_len = 3});
  CHECK(loader.batches_per_epoch() == 5);
  const std::vector<int> starts{0, 6, 12, 100, 106, 0};
  for (std::size_t i = 0; i < starts.size(); ++i) {
    const Batch batch = loader.next();
    CHECK(batch.inputs[0] == starts[i]);
    CHECK(batch.inputs[3] == starts[i] + 3);
    CHECK(batch.targets[5] == starts[i] + 6);
  }
  CHECK(loader.epoch() == 1);
  // Global batches of 4 as one rank's 4 rows: 2 per epoch, the second across the shards.
  DataLoader four(ds, {.batch_size = 4, .seq_len = 3});
  CHECK(four.batches_per_epoch() == 2);
  four.next();
  const auto rows = to_vector(four.next().inputs);
  CHECK(rows[0] == 12);
  CHECK(rows[3] == 15);
  CHECK(rows[6] == 100);
  CHECK(rows[9] == 103);
  CHECK(four.epoch() == 1);
}

TEST_CASE("rank r of w reads the r-th of w consecutive chunks; together they read what one rank reads") {
  const int B = 2, T = 4, world = 3;
  const auto ds = TokenDataset::from_tokens(iota_tokens(200), 256);
  DataLoader serial(ds, {.batch_size = B * world, .seq_len = T});
  std::vector<DataLoader> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back(ds, LoaderConfig{.batch_size = B, .seq_len = T, .rank = r, .world = world});
  CHECK(serial.batches_per_epoch() == 8);  // (200 - 1) / 24
  for (int step = 0; step < 10; ++step) {  // across the wrap-around
    const Batch whole = serial.next();
    std::vector<std::int32_t> inputs, targets;
    for (int r = 0; r < world; ++r) {
      CHECK(ranks[static_cast<std::size_t>(r)].batches_per_epoch() == serial.batches_per_epoch());
      const Batch part = ranks[static_cast<std::size_t>(r)].next();
      CHECK(part.inputs.shape == Shape{B, T});
      // Consecutive, disjoint chunks of the window: rank r starts r*B*T after rank 0.
      CHECK(part.inputs[0] == whole.inputs[0] + r * B * T);
      const auto in = to_vector(part.inputs), tg = to_vector(part.targets);
      inputs.insert(inputs.end(), in.begin(), in.end());
      targets.insert(targets.end(), tg.begin(), tg.end());
    }
    CHECK(inputs == to_vector(whole.inputs));
    CHECK(targets == to_vector(whole.targets));
  }
  CHECK(ranks[1].epoch() == serial.epoch());
}

TEST_CASE("DataLoader rejects data too small for one global batch and bad configs") {
  const auto ds = TokenDataset::from_tokens(iota_tokens(24), 256, "tiny");
  const std::string e = error_of([&] { DataLoader l(ds, {.batch_size = 2, .seq_len = 4, .rank = 0, .world = 3}); });
  CHECK(e.find("the dataset holds 5 sequences of T=4 tokens (plus the one after), too few for one global batch of 6 "
               "sequences (batch size B=2 x world 3 x 1 micro-batches)") != std::string::npos);
  CHECK(e.find("25 tokens are needed") != std::string::npos);
  CHECK(error_of([&] { DataLoader l(ds, {.batch_size = 23, .seq_len = 1}); }) == "<no error>");
  CHECK(error_of([&] { DataLoader l(ds, {.batch_size = 0, .seq_len = 4}); }).find("LoaderConfig.batch_size is 0") !=
        std::string::npos);
  CHECK(error_of([&] {
          DataLoader l(ds, {.batch_size = 1, .seq_len = 2, .rank = 2, .world = 2});
        }).find("LoaderConfig.rank is 2; it must be in [0, world) = [0, 2)") != std::string::npos);
  CHECK(error_of([&] {
          DataLoader l(ds, {.batch_size = 2, .seq_len = 2, .world = 2, .global_batch = 6});
        }).find("LoaderConfig.global_batch is 6 sequences, not a multiple of batch_size 2 x world 2 = 4") !=
        std::string::npos);
}

TEST_CASE("a restored loader state resumes exactly where it was saved") {
  const auto ds = TokenDataset::from_tokens(iota_tokens(100), 256);
  DataLoader a(ds, {.batch_size = 2, .seq_len = 3});
  for (int i = 0; i < 20; ++i) a.next();
  const LoaderState saved = a.state();
  CHECK(saved == LoaderState{.epoch = 1, .consumed = 8, .seq_len = 3});
  DataLoader b(ds, {.batch_size = 2, .seq_len = 3});
  b.restore(saved);
  CHECK(b.state() == saved);
  CHECK(to_vector(b.next().inputs) == to_vector(a.next().inputs));
  CHECK(error_of([&] { b.restore({.consumed = 32}); }).find("but this loader's epoch is 32 sequences") !=
        std::string::npos);
  CHECK(error_of([&] { b.restore({.consumed = 2, .seq_len = 4}); })
            .find("saved with sequences of T=4 tokens but this loader reads T=3; resume with the checkpoint's "
                  "sequence length (--seq 4)") != std::string::npos);
  // Another global batch resumes where it divides the sequences read.
  DataLoader four(ds, {.batch_size = 4, .seq_len = 3});
  four.restore(saved);
  CHECK(to_vector(four.next().inputs)[0] == 24);  // sequence 8
  DataLoader three(ds, {.batch_size = 3, .seq_len = 3});
  CHECK(error_of([&] { three.restore(saved); })
            .find("8 sequences into an epoch, which is not a whole number of this run's global batches of 3; resume "
                  "with a global batch that divides 8") != std::string::npos);
}

TEST_CASE("a checkpoint's window position of the earlier loader converts in order, and is refused shuffled") {
  TempDir dir;
  std::vector<std::uint16_t> a(50), b(40);
  std::iota(a.begin(), a.end(), 0);
  std::iota(b.begin(), b.end(), 100);
  write_shard(dir / "w_train_0.bin", a);
  write_shard(dir / "w_train_1.bin", b);
  const auto ds = TokenDataset::from_shards((dir / "w_train_*.bin").string(), 256);
  DataLoader loader(ds, {.batch_size = 2, .seq_len = 4});
  // Shard 0 holds 12 sequences; window 2 of 8 tokens in shard 1 is its token 16, sequence 4.
  const LoaderState s = loader.from_windows(1, 2, 3, 8, /*shuffled=*/false);
  CHECK(s == LoaderState{.epoch = 3, .consumed = 12 + 4, .seq_len = 4});
  loader.restore(s);
  CHECK(loader.next().inputs[0] == 100 + 16);
  CHECK(error_of([&] {
          static_cast<void>(loader.from_windows(0, 1, 0, 8, true));
        }).find("shuffled windows of world x B x T tokens, an order llmpar no longer draws") != std::string::npos);
  CHECK(error_of([&] {
          static_cast<void>(loader.from_windows(0, 1, 0, 6, false));
        }).find("does not fit this data and T=4") != std::string::npos);
}

TEST_CASE("a shuffled epoch visits every sequence once, in an order fixed by (seed, epoch)") {
  const int B = 2, T = 3;
  const auto ds = TokenDataset::from_tokens(iota_tokens(200), 256);
  DataLoader a(ds, {.batch_size = B, .seq_len = T, .shuffle = true, .seed = 7});
  DataLoader same(ds, {.batch_size = B, .seq_len = T, .shuffle = true, .seed = 7});
  DataLoader other(ds, {.batch_size = B, .seq_len = T, .shuffle = true, .seed = 8});
  const std::int64_t n = a.batches_per_epoch();
  REQUIRE(n == 33);  // (200 - 1) / 3 = 66 sequences
  std::vector<std::int32_t> epoch0, epoch1, other0;
  for (std::int64_t i = 0; i < n; ++i) {
    const Batch b = a.next();
    const Batch s = same.next();
    const Batch o = other.next();
    for (int row = 0; row < B; ++row) {
      CHECK(b.targets[row * T] == b.inputs[row * T] + 1);
      CHECK(b.inputs[row * T + T - 1] == b.inputs[row * T] + T - 1);  // a whole sequence
      CHECK(b.inputs[row * T] % T == 0);
      epoch0.push_back(b.inputs[row * T]);
      CHECK(s.inputs[row * T] == epoch0.back());
      other0.push_back(o.inputs[row * T]);
    }
  }
  CHECK(a.epoch() == 1);
  for (std::int64_t i = 0; i < n; ++i) {
    const Batch b = a.next();
    for (int row = 0; row < B; ++row) epoch1.push_back(b.inputs[row * T]);
  }
  std::vector<std::int32_t> sorted = epoch0;
  std::sort(sorted.begin(), sorted.end());
  for (std::int64_t i = 0; i < 2 * n; ++i) CHECK(sorted[static_cast<std::size_t>(i)] == i * T);
  CHECK(epoch0 != sorted);  // actually shuffled
  CHECK(epoch1 != epoch0);  // a new order each epoch
  CHECK(other0 != epoch0);  // the seed matters
  // A restored state continues the same permutation.
  DataLoader c(ds, {.batch_size = B, .seq_len = T, .shuffle = true, .seed = 7});
  for (int i = 0; i < 5; ++i) c.next();
  DataLoader d(ds, {.batch_size = B, .seq_len = T, .shuffle = true, .seed = 7});
  d.restore(c.state());
  for (int i = 0; i < 40; ++i) CHECK(to_vector(d.next().inputs) == to_vector(c.next().inputs));
}

TEST_CASE("shuffled ranks together read what one shuffled rank reads") {
  const int B = 2, T = 4, world = 2;
  const auto ds = TokenDataset::from_tokens(iota_tokens(250), 256);
  DataLoader serial(ds, {.batch_size = B * world, .seq_len = T, .shuffle = true, .seed = 3});
  DataLoader r0(ds, {.batch_size = B, .seq_len = T, .rank = 0, .world = world, .shuffle = true, .seed = 3});
  DataLoader r1(ds, {.batch_size = B, .seq_len = T, .rank = 1, .world = world, .shuffle = true, .seed = 3});
  for (int step = 0; step < 20; ++step) {
    auto whole = to_vector(serial.next().inputs);
    auto a = to_vector(r0.next().inputs), b = to_vector(r1.next().inputs);
    a.insert(a.end(), b.begin(), b.end());
    CHECK(a == whole);
  }
}

namespace {

// One step's rows as a layout reads them: for each micro-batch, rank 0's rows, then rank 1's...
std::vector<std::int32_t> step_rows(std::vector<DataLoader>& ranks, int micro_batches, bool targets = false) {
  std::vector<std::int32_t> rows;
  for (int m = 0; m < micro_batches; ++m)
    for (DataLoader& l : ranks) {
      const Batch b = l.next();
      const auto v = to_vector(targets ? b.targets : b.inputs);
      rows.insert(rows.end(), v.begin(), v.end());
    }
  return rows;
}

std::vector<DataLoader> layout(const TokenDataset& ds, int batch, int world, std::int64_t global, bool shuffle) {
  std::vector<DataLoader> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back(ds, LoaderConfig{.batch_size = batch,
                                        .seq_len = 5,
                                        .rank = r,
                                        .world = world,
                                        .global_batch = global,
                                        .shuffle = shuffle,
                                        .seed = 11});
  return ranks;
}

}  // namespace

TEST_CASE("every layout and accumulation of a global batch reads the same sequences in the same order") {
  const auto ds = TokenDataset::from_tokens(iota_tokens(1000), 1000);
  for (const bool shuffle : {false, true}) {
    CAPTURE(shuffle);
    // Global batch 8: one rank x 8, one rank 2 x 4 micro-batches, dp 2 x 2 micro-batches
    // of 2, dp 4 x 1 micro-batch of 2, dp 2 x 1 of 4.
    auto serial = layout(ds, 8, 1, 8, shuffle);
    auto accum = layout(ds, 2, 1, 8, shuffle);
    auto dp2 = layout(ds, 2, 2, 8, shuffle);
    auto dp4 = layout(ds, 2, 4, 8, shuffle);
    auto dp2b4 = layout(ds, 4, 2, 8, shuffle);
    for (int step = 0; step < 30; ++step) {  // 24 global batches an epoch: across its end
      const auto want = step_rows(serial, 1);
      CHECK(step_rows(accum, 4) == want);
      CHECK(step_rows(dp2, 2) == want);
      CHECK(step_rows(dp4, 1) == want);
      CHECK(step_rows(dp2b4, 1) == want);
    }
    // A checkpoint of the serial run resumes exactly at another layout.
    auto resumed = layout(ds, 2, 2, 8, shuffle);
    for (DataLoader& l : resumed) l.restore(serial[0].state());
    for (int step = 0; step < 5; ++step) CHECK(step_rows(resumed, 2, true) == step_rows(serial, 1, true));
  }
}

TEST_CASE("rng::Permutation is a bijection of [0, n), a function of its key") {
  for (const std::uint64_t n : {1ull, 2ull, 3ull, 5ull, 17ull, 64ull, 1000ull, 4097ull}) {
    CAPTURE(n);
    const rng::Permutation p(n, 42), same(n, 42), other(n, 43);
    std::vector<std::uint64_t> image, other_image;
    for (std::uint64_t i = 0; i < n; ++i) {
      image.push_back(p.at(i));
      CHECK(same.at(i) == image.back());
      other_image.push_back(other.at(i));
    }
    std::vector<std::uint64_t> sorted = image;
    std::sort(sorted.begin(), sorted.end());
    for (std::uint64_t i = 0; i < n; ++i) CHECK(sorted[i] == i);
    if (n >= 17) {
      CHECK(image != sorted);       // not the identity
      CHECK(other_image != image);  // the key matters
    }
  }
}

TEST_CASE("the byte tokenizer round-trips any bytes and rejects ids it cannot decode") {
  const ByteTokenizer tok;
  CHECK(tok.vocab_size() == 256);
  std::string all(256, '\0');
  for (int i = 0; i < 256; ++i) all[static_cast<std::size_t>(i)] = static_cast<char>(i);
  const std::string text = cat("héllo, wörld \n\t", all);
  const auto ids = tok.encode(text);
  REQUIRE(ids.size() == text.size());
  CHECK(ids[0] == 'h');
  CHECK(ids[1] == 0xC3);  // first byte of UTF-8 'é', as an unsigned byte
  CHECK(tok.decode(ids) == text);
  const std::vector<std::uint16_t> bad{65, 256};
  CHECK(error_of([&] { (void)tok.decode(bad); }).find("cannot decode token id 256 at position 1") != std::string::npos);
}

TEST_CASE("unigram entropy is in nats") {
  const std::vector<std::uint16_t> uniform{0, 1, 2, 3, 0, 1, 2, 3};
  CHECK(unigram_entropy(uniform) == doctest::Approx(std::log(4.0)));
  CHECK(unigram_entropy(std::vector<std::uint16_t>(10, 7)) == 0.0);
  CHECK(unigram_entropy({}) == 0.0);
}

TEST_CASE("bigram cross-entropy: the train table's loss on val, unseen pairs from the unigram") {
  // train 0 1 0 1 0 1: p(1) = 1/2; pairs (0,1) x3, (1,0) x2; contexts 0 x3, 1 x2.
  const std::vector<std::uint16_t> train{0, 1, 0, 1, 0, 1};
  CHECK(bigram_cross_entropy(train, std::vector<std::uint16_t>{0, 1}) ==
        doctest::Approx(-std::log((3.0 + 0.5) / (3.0 + 1.0))));  // 0.1335
  CHECK(bigram_cross_entropy(train, std::vector<std::uint16_t>{1, 1}) ==
        doctest::Approx(-std::log(0.5 / (2.0 + 1.0))));  // a pair train never had: its unigram share
  // An unseen token after a seen one gets half a count; an unseen context only the prior.
  CHECK(bigram_cross_entropy(train, std::vector<std::uint16_t>{0, 2}) == doctest::Approx(-std::log((0.5 / 6.0) / 4.0)));
  CHECK(bigram_cross_entropy(train, std::vector<std::uint16_t>{2, 0}) == doctest::Approx(-std::log(0.5)));
  // The mean over val's pairs.
  CHECK(bigram_cross_entropy(train, std::vector<std::uint16_t>{0, 1, 1}) ==
        doctest::Approx(0.5 * (-std::log(3.5 / 4.0) - std::log(0.5 / 3.0))));
  CHECK(bigram_cross_entropy(train, std::vector<std::uint16_t>{5}) == 0.0);
  CHECK_THROWS_WITH_AS(bigram_cross_entropy({}, std::vector<std::uint16_t>{0, 1}),
                       doctest::Contains("no training tokens"), Error);
  CHECK(val_pattern_of("data/docs_train.bin") == "data/docs_val.bin");
  CHECK_THROWS_WITH_AS(val_pattern_of("data/docs.bin"), doctest::Contains("does not contain 'train'"), Error);
}

TEST_CASE("the fortunes loader reads plain-text files in name order and splits by whole fortunes") {
  TempDir dir;
  // b holds fortunes 1..4 ('%' lines separate; the file ends with one, like Debian's);
  // a holds fortune 0 with no trailing newline. a.dat, a.u8, .hidden and off/ are skipped.
  write_text(dir / "b", "one\n%\ntwo\nlines\n%\n%\nthree\n%\nfour\n%\n");
  write_text(dir / "a", "zero");
  write_text(dir / "a.dat", std::string("\x00\x00\x00\x02"
                                        "binary index",
                                        16));
  fs::create_symlink("a", dir / "a.u8");
  write_text(dir / ".hidden", "secret\n");
  fs::create_directory(dir / "off");
  write_text(dir / "off" / "x", "offensive\n");

  const ByteTokenizer tok;
  const TextCorpus all = load_text_corpus(dir.path, 0.0);
  CHECK(all.files == std::vector<fs::path>{dir / "a", dir / "b"});
  CHECK(all.documents == 5);
  CHECK(all.vocab_size == 256);
  CHECK(tok.decode(all.train) == "zero\n\none\n\ntwo\nlines\n\nthree\n\nfour\n\n");
  CHECK(all.val.empty());

  // 0.4 of 5 fortunes: floor((i+1)*0.4) > floor(i*0.4) for i = 2 and 4.
  const TextCorpus split = load_text_corpus(dir.path, 0.4);
  CHECK(split.val_documents == 2);
  CHECK(tok.decode(split.train) == "zero\n\none\n\nthree\n\n");
  CHECK(tok.decode(split.val) == "two\nlines\n\nfour\n\n");

  CHECK(error_of([&] { load_text_corpus(dir.path, 0.1); }).find("leaves the validation split empty") !=
        std::string::npos);
  CHECK(error_of([&] { load_text_corpus(dir.path, 1.0); }).find("val_fraction 1 is out of range") != std::string::npos);
}

TEST_CASE("a missing or empty fortunes directory says to install the fortunes package") {
  TempDir dir;
  const std::string missing = error_of([&] { load_text_corpus(dir / "nowhere"); });
  CHECK(missing.find("nowhere' does not exist") != std::string::npos);
  CHECK(missing.find("apt-get install fortunes") != std::string::npos);
  CHECK(missing.find("--data") != std::string::npos);
  write_text(dir / "only.dat", "x");
  const std::string empty = error_of([&] { load_text_corpus(dir.path); });
  CHECK(empty.find("has no fortune files") != std::string::npos);
  CHECK(empty.find("apt-get install fortunes") != std::string::npos);
}

TEST_CASE("text files are split per file at a line start near the validation fraction") {
  TempDir dir;
  write_text(dir / "t1.txt", "aaaa\nbbbb\ncccc\ndddd\n");  // 20 bytes: 0.2 cuts at 16, the nearest line start is 15
  write_text(dir / "t2.txt", "xy");                        // too short to give validation bytes
  const std::vector<fs::path> files{dir / "t1.txt", dir / "t2.txt"};
  const TextCorpus c = load_text_files(files, 0.2);
  const ByteTokenizer tok;
  CHECK(tok.decode(c.train) == "aaaa\nbbbb\ncccc\nxy");
  CHECK(tok.decode(c.val) == "dddd\n");
  CHECK(c.documents == 2);
  CHECK(c.val_documents == 1);
  CHECK(error_of([&] { load_text_files(std::vector<fs::path>{dir / "none.txt"}); }).find("none.txt'") !=
        std::string::npos);
}

TEST_CASE("the installed fortunes corpus loads (skipped without the fortunes package)") {
  if (!fs::is_directory(kDefaultFortunesDir)) {
    MESSAGE("skipped: ", kDefaultFortunesDir, " is absent (apt-get install fortunes)");
    return;
  }
  const TextCorpus c = load_text_corpus();
  MESSAGE("fortunes: ", c.files.size(), " files, ", c.documents, " fortunes, ", c.train.size(), " train + ",
          c.val.size(), " val bytes, unigram entropy ", unigram_entropy(c.train), " nats");
  CHECK(c.files.size() > 0);
  CHECK(c.documents > 100);
  const double val_share = static_cast<double>(c.val.size()) / static_cast<double>(c.train.size() + c.val.size());
  CHECK(val_share > 0.05);
  CHECK(val_share < 0.15);
  // English text in bytes: well below uniform (ln 256 = 5.55) and above ln 26.
  const double h = unigram_entropy(c.train);
  CHECK(h > 2.5);
  CHECK(h < 4.0);
  const auto ds = TokenDataset::from_tokens(c.train, c.vocab_size, "fortunes train");
  DataLoader loader(ds, {.batch_size = 4, .seq_len = 64});
  CHECK(loader.next().inputs.numel() == 256);
}
