// llmpar/data/shard.hpp — token shards in the llm.c / nanoGPT `.bin` format.
//
// A shard is a 1024-byte header of 256 little-endian int32 (magic 20240520, version,
// token count) followed by that many little-endian tokens: uint16 in version 1, uint32 in
// version 2 (llm.c's numbering; version 2 holds vocabularies above 65536, Llama 3's
// 128256). Using llm.c's format as-is means shards made by its Python scripts
// (tinyshakespeare, fineweb) train here and ours train there.
//
// Shards are read through a read-only mmap rather than read into memory: a dataset of
// many GB costs no RAM up front, pages come in as the loader walks forward, and ranks on
// one node share the page cache. The format is checked completely before any token is
// handed out (magic, version, and the token count against the file's size), because a
// truncated or mistaken file would otherwise train silently on garbage. Both widths are
// mapped as they are, not widened: a TokenView carries the width, and its visit() is the
// one place where the runtime width becomes a type.
//
// The writer picks the narrowest version that holds the tokens (version 1 unless an id
// exceeds 65535), so byte-level and GPT-2 shards stay byte-identical to llm.c's, or
// version 2 on request. It goes through a temporary file in the same directory that is
// fsync'ed and then renamed over the target: rename is atomic within a file system, so a
// crash or a kill leaves either the old shard or the new one, never a half-written one.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::data {

static_assert(std::endian::native == std::endian::little,
              "llmpar token shards are little-endian and memory-mapped as they are; a big-endian "
              "host would need a byte-swapping reader, which llmpar does not have");

inline constexpr std::int32_t kShardMagic = 20240520;
inline constexpr std::int32_t kShardVersion16 = 1;  // llm.c: version 1 = uint16 tokens
inline constexpr std::int32_t kShardVersion32 = 2;  // llm.c: version 2 = uint32 tokens
inline constexpr int kShardHeaderInts = 256;
inline constexpr std::size_t kShardHeaderBytes = kShardHeaderInts * sizeof(std::int32_t);
// The header stores the count as int32.
inline constexpr std::int64_t kMaxShardTokens = std::numeric_limits<std::int32_t>::max();

// Tokens of either width, not owned: a shard's, or a vector's. Ids are unsigned in the
// file; a dataset checks them against its vocabulary (an int) before they become int32.
class TokenView {
 public:
  TokenView() = default;
  TokenView(std::span<const std::uint16_t> tokens)  // NOLINT(google-explicit-constructor): a view of either width
      : data_(tokens.data()), size_(tokens.size()), bytes_(sizeof(std::uint16_t)) {}
  TokenView(std::span<const std::uint32_t> tokens)  // NOLINT(google-explicit-constructor)
      : data_(tokens.data()), size_(tokens.size()), bytes_(sizeof(std::uint32_t)) {}

  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int token_bytes() const { return bytes_; }  // 2 or 4
  std::uint32_t operator[](std::size_t i) const {
    return bytes_ == sizeof(std::uint32_t) ? static_cast<const std::uint32_t*>(data_)[i]
                                           : static_cast<const std::uint16_t*>(data_)[i];
  }

  // f(std::span<const std::uint16_t>) or f(std::span<const std::uint32_t>), as stored: loops
  // over tokens go inside f, so they run on the stored type with no branch per token.
  template <class F>
  decltype(auto) visit(F&& f) const {
    if (bytes_ == sizeof(std::uint32_t))
      return f(std::span<const std::uint32_t>(static_cast<const std::uint32_t*>(data_), size_));
    return f(std::span<const std::uint16_t>(static_cast<const std::uint16_t*>(data_), size_));
  }

 private:
  const void* data_ = nullptr;
  std::size_t size_ = 0;
  int bytes_ = sizeof(std::uint16_t);
};

// Which version write_shard writes.
enum class ShardWidth {
  narrowest,  // version 1 (uint16) when every id is below 65536, else version 2 (uint32)
  uint32,     // version 2 whatever the ids: the shards of one large-vocabulary dataset alike
};

namespace detail {

inline std::string errno_message(int err) { return std::error_code(err, std::generic_category()).message(); }

inline constexpr const char* kPrepareDataHint =
    "create shards from text with `prepare_data --out PREFIX FILE...` (or `prepare_data --out PREFIX --fortunes`)";

// " (its first bytes read 'Firs', which looks like text)" when the first bytes of a file
// are printable text, since a raw text file passed as a shard is the usual mistake.
inline std::string text_note(std::string first) {
  bool printable = !first.empty();
  for (char& c : first) {
    printable = printable && ((c >= 0x20 && c < 0x7f) || c == '\n' || c == '\t' || c == '\r');
    if (c == '\n' || c == '\t' || c == '\r') c = ' ';
  }
  return printable ? ::llmpar::detail::concat(" (its first bytes read '", first, "', which looks like text)")
                   : std::string();
}

inline std::string raw_text_hint(const std::string& name) {
  return ::llmpar::detail::concat("if it is a raw text file, tokenize it first with `prepare_data --out PREFIX ", name,
                                  "` and train on PREFIX_train.bin");
}

// Writes all of [data, data+bytes) to fd, retrying short writes and EINTR.
inline void write_all(int fd, const void* data, std::size_t bytes, const std::filesystem::path& path) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      LLMPAR_FAIL("cannot write token shard '", path.string(), "': ", errno_message(errno),
                  "; check free disk space and permissions");
    }
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

// Removes the temporary file unless released (after a successful rename).
struct TempFileGuard {
  std::filesystem::path path;
  int fd = -1;
  bool armed = true;
  ~TempFileGuard() {
    if (fd >= 0) ::close(fd);
    if (armed) ::unlink(path.c_str());
  }
};

// Writes `tokens` as `Out` (the shard's width), converting through a bounded buffer when
// that is not their own type, so a large shard is never held twice.
template <class Out, class In>
void write_tokens_as(int fd, std::span<const In> tokens, const std::filesystem::path& path) {
  if constexpr (std::is_same_v<Out, In>) {
    write_all(fd, tokens.data(), tokens.size_bytes(), path);
  } else {
    constexpr std::size_t kChunk = std::size_t{1} << 16;
    std::vector<Out> chunk(std::min(kChunk, tokens.size()));
    for (std::size_t at = 0; at < tokens.size(); at += kChunk) {
      const std::size_t n = std::min(kChunk, tokens.size() - at);
      for (std::size_t i = 0; i < n; ++i) chunk[i] = static_cast<Out>(tokens[at + i]);
      write_all(fd, chunk.data(), n * sizeof(Out), path);
    }
  }
}

template <class In>
void write_shard_as(const std::filesystem::path& path, std::span<const In> tokens, ShardWidth width) {
  LLMPAR_CHECK(static_cast<std::int64_t>(tokens.size()) <= kMaxShardTokens, "cannot write ", tokens.size(),
               " tokens to one shard '", path.string(), "': the header holds at most ", kMaxShardTokens,
               " tokens; split the data over several shards (e.g. PREFIX_train_000.bin, PREFIX_train_001.bin)");
  LLMPAR_CHECK(!path.filename().empty(), "shard path '", path.string(), "' names a directory, not a file");
  bool wide = width == ShardWidth::uint32;
  if constexpr (sizeof(In) > sizeof(std::uint16_t)) {
    for (const In t : tokens) wide = wide || t > std::numeric_limits<std::uint16_t>::max();
  }

  // A unique name in the target's own directory: rename(2) is only atomic within one
  // file system, and O_EXCL keeps two writers from sharing a temporary.
  static std::atomic<unsigned> counter{0};
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  TempFileGuard tmp;
  // (Built with concat: GCC 12 warns falsely on `"literal" + std::string&&`.)
  tmp.path =
      dir / ::llmpar::detail::concat(".", path.filename().string(), ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  tmp.fd = ::open(tmp.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (tmp.fd < 0) {
    tmp.armed = false;  // nothing was created
    LLMPAR_FAIL("cannot create a temporary file for token shard '", path.string(), "' in directory '", dir.string(),
                "': ", errno_message(errno), "; check that the directory exists and is writable");
  }

  std::array<std::int32_t, kShardHeaderInts> header{};
  header[0] = kShardMagic;
  header[1] = wide ? kShardVersion32 : kShardVersion16;
  header[2] = static_cast<std::int32_t>(tokens.size());
  write_all(tmp.fd, header.data(), kShardHeaderBytes, path);
  if (wide)
    write_tokens_as<std::uint32_t>(tmp.fd, tokens, path);
  else
    write_tokens_as<std::uint16_t>(tmp.fd, tokens, path);
  // Data must be on disk before the rename makes it visible under the final name;
  // otherwise a crash right after the rename could expose an empty file.
  LLMPAR_CHECK(::fsync(tmp.fd) == 0, "cannot flush token shard '", path.string(), "' to disk: ", errno_message(errno));
  const int fd = std::exchange(tmp.fd, -1);
  LLMPAR_CHECK(::close(fd) == 0, "cannot close token shard '", path.string(), "': ", errno_message(errno));
  LLMPAR_CHECK(::rename(tmp.path.c_str(), path.c_str()) == 0, "cannot move the finished token shard into place at '",
               path.string(), "': ", errno_message(errno), "; check that it is not a directory and is writable");
  tmp.armed = false;
}

}  // namespace detail

// Writes `tokens` as a shard at `path`, atomically replacing any file there: version 1
// (uint16), or version 2 (uint32) with ShardWidth::uint32.
inline void write_shard(const std::filesystem::path& path, std::span<const std::uint16_t> tokens,
                        ShardWidth width = ShardWidth::narrowest) {
  detail::write_shard_as(path, tokens, width);
}

// Writes `tokens` as a shard at `path`, atomically replacing any file there: version 2
// (uint32) when an id exceeds 65535 or with ShardWidth::uint32, else version 1 (uint16).
inline void write_shard(const std::filesystem::path& path, std::span<const std::uint32_t> tokens,
                        ShardWidth width = ShardWidth::narrowest) {
  detail::write_shard_as(path, tokens, width);
}

// A read-only, memory-mapped view of one shard. Move-only; the tokens stay valid (and at
// the same address) for the lifetime of the object, also across moves.
class TokenShard {
 public:
  TokenShard() = default;
  explicit TokenShard(std::filesystem::path path) : path_(std::move(path)) { open(); }
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  TokenShard(TokenShard&& o) noexcept
      : path_(std::move(o.path_)),
        map_(std::exchange(o.map_, nullptr)),
        map_bytes_(std::exchange(o.map_bytes_, 0)),
        size_(std::exchange(o.size_, 0)),
        version_(std::exchange(o.version_, 0)) {}
  TokenShard& operator=(TokenShard&& o) noexcept {
    if (this != &o) {
      unmap();
      path_ = std::move(o.path_);
      map_ = std::exchange(o.map_, nullptr);
      map_bytes_ = std::exchange(o.map_bytes_, 0);
      size_ = std::exchange(o.size_, 0);
      version_ = std::exchange(o.version_, 0);
    }
    return *this;
  }
  ~TokenShard() { unmap(); }

  std::size_t size() const { return size_; }
  int version() const { return version_; }  // 1 (uint16 tokens) or 2 (uint32); 0 when empty-constructed
  int token_bytes() const { return version_ == kShardVersion32 ? 4 : 2; }
  std::uint32_t operator[](std::size_t i) const { return view()[i]; }
  // The tokens at their stored width.
  TokenView view() const {
    if (version_ == kShardVersion32) return std::span<const std::uint32_t>(tokens_begin<std::uint32_t>(), size_);
    return std::span<const std::uint16_t>(tokens_begin<std::uint16_t>(), size_);
  }
  // The tokens of a version-1 shard (of any, when it holds no tokens).
  std::span<const std::uint16_t> tokens() const {
    LLMPAR_CHECK(version_ != kShardVersion32 || size_ == 0, "token shard '", path_.string(),
                 "' holds uint32 tokens (version 2), not uint16; read it through view() or tokens32()");
    return {tokens_begin<std::uint16_t>(), size_};
  }
  // The tokens of a version-2 shard (of any, when it holds no tokens).
  std::span<const std::uint32_t> tokens32() const {
    LLMPAR_CHECK(version_ == kShardVersion32 || size_ == 0, "token shard '", path_.string(),
                 "' holds uint16 tokens (version 1), not uint32; read it through view() or tokens()");
    return {tokens_begin<std::uint32_t>(), size_};
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  template <class Token>
  const Token* tokens_begin() const {
    // The header is 1024 bytes into a page-aligned mapping, so tokens of either width are aligned.
    return map_ == nullptr
               ? nullptr
               : reinterpret_cast<const Token*>(static_cast<const unsigned char*>(map_) + kShardHeaderBytes);
  }

  void open() {
    const std::string name = path_.string();
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      LLMPAR_FAIL("cannot open token shard '", name, "': ", detail::errno_message(err),
                  err == ENOENT ? "; check the path, or " : "; check its permissions, or ", detail::kPrepareDataHint);
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      LLMPAR_FAIL("cannot stat token shard '", name, "': ", detail::errno_message(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      LLMPAR_FAIL("token shard '", name, "' is ", S_ISDIR(st.st_mode) ? "a directory" : "not a regular file",
                  "; give the path of a .bin shard file (or a glob such as 'data/PREFIX_train*.bin')");
    }
    const auto file_bytes = static_cast<std::uint64_t>(st.st_size);
    if (file_bytes < kShardHeaderBytes) {
      char first[4] = {};
      const ssize_t got = ::pread(fd, first, sizeof first, 0);
      ::close(fd);
      const std::string note = detail::text_note(std::string(first, got > 0 ? static_cast<std::size_t>(got) : 0));
      LLMPAR_FAIL("token shard '", name, "' is ", file_bytes, " bytes, shorter than the ", kShardHeaderBytes,
                  "-byte shard header", note, "; it is truncated or not a shard; ",
                  note.empty() ? detail::kPrepareDataHint : detail::raw_text_hint(name));
    }
    void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_err = errno;
    ::close(fd);  // the mapping keeps the file alive
    LLMPAR_CHECK(map != MAP_FAILED, "cannot memory-map token shard '", name, "' (", file_bytes,
                 " bytes): ", detail::errno_message(map_err));
    map_ = map;
    map_bytes_ = file_bytes;
    // From here on, a failed check must unmap: the constructor does not complete, so the
    // destructor will not run.
    try {
      validate(file_bytes);
    } catch (...) {
      unmap();
      throw;
    }
    // The loader walks forward; tell the kernel to read ahead.
    ::madvise(map_, map_bytes_, MADV_SEQUENTIAL);
  }

  void validate(std::uint64_t file_bytes) {
    const std::string name = path_.string();
    std::array<std::int32_t, kShardHeaderInts> header{};
    std::memcpy(header.data(), map_, kShardHeaderBytes);
    if (header[0] != kShardMagic) {
      LLMPAR_FAIL("token shard '", name, "' has magic ", header[0],
                  detail::text_note(std::string(static_cast<const char*>(map_), 4)), ", expected ", kShardMagic,
                  "; it is not an llm.c token shard — ", detail::raw_text_hint(name));
    }
    const std::int32_t version = header[1];
    LLMPAR_CHECK(version == kShardVersion16 || version == kShardVersion32, "token shard '", name, "' has version ",
                 version, "; this reader supports versions ", kShardVersion16, " (uint16 tokens) and ", kShardVersion32,
                 " (uint32 tokens); regenerate it with prepare_data");
    const std::int64_t count = header[2];
    LLMPAR_CHECK(count >= 0, "token shard '", name, "' header says it holds ", count,
                 " tokens, which is negative; the file is corrupt; regenerate it with prepare_data");
    const bool wide = version == kShardVersion32;
    const std::uint64_t width = wide ? sizeof(std::uint32_t) : sizeof(std::uint16_t);
    const std::uint64_t other_width = wide ? sizeof(std::uint16_t) : sizeof(std::uint32_t);
    const std::uint64_t expected = kShardHeaderBytes + static_cast<std::uint64_t>(count) * width;
    // A file of the other version's size points at the version field, not at the copy.
    const bool other_size =
        count > 0 && file_bytes == kShardHeaderBytes + static_cast<std::uint64_t>(count) * other_width;
    LLMPAR_CHECK(expected == file_bytes, "token shard '", name, "' header says ", count, " tokens, so expected ",
                 expected, " bytes, but the file is ", file_bytes, " bytes",
                 file_bytes < expected ? " (truncated: an interrupted copy or download?)" : " (trailing bytes)",
                 other_size ? ::llmpar::detail::concat("; that is the size of ", count, " tokens of ", other_width,
                                                       " bytes, not the ", width, " of a version-", version,
                                                       " shard: is the header's version wrong?")
                            : std::string(),
                 "; copy it again or regenerate it with prepare_data");
    size_ = static_cast<std::size_t>(count);
    version_ = version;
  }

  void unmap() noexcept {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    map_ = nullptr;
    map_bytes_ = 0;
    size_ = 0;
    version_ = 0;
  }

  std::filesystem::path path_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  std::size_t size_ = 0;
  int version_ = 0;
};

}  // namespace llmpar::data
