// llmpar/checkpoint/safetensors.hpp — reading and writing Hugging Face's safetensors format.
//
// A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then
// the tensors' bytes. The JSON maps each tensor's name to {"dtype", "shape",
// "data_offsets": [begin, end]} (offsets into the data that follows the header) and may
// hold a "__metadata__" object of string values. The writer pads the header with spaces
// to a multiple of 8 bytes (as the reference implementation does) and stores the
// tensors in the order given, back to back.
//
// Reading checks everything a file could get wrong before a byte of it is used: the
// header length against the file size, the JSON, every entry's dtype, shape and
// offsets (inside the data, the size its dtype and shape need, not overlapping another
// tensor, the data covered with no gap). A file that breaks any of these is an error
// naming the file and the problem — never a crash or a tensor read from the wrong bytes.
// Only the dtypes llmpar stores (F32, BF16, F16, I32, I64, U8) are accepted; another is
// named in the error.
//
// File::open reads and checks the header only; read_into then reads any byte range of a
// tensor (pread), so a rank loading a slice of a checkpoint reads that slice alone.
// File::read also loads all data. write() can fsync the file before it returns (what a
// checkpoint needs before it renames its directory into place).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "llmpar/core/dtype.hpp"
#include "llmpar/core/error.hpp"

namespace llmpar::checkpoint::safetensors {

// The format's name of a dtype, and back.
inline const char* format_name(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
  }
  return "?";
}
inline std::optional<DType> dtype_named(std::string_view name) {
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8})
    if (name == format_name(t)) return t;
  return std::nullopt;
}

// One tensor to write: its bytes are numel(shape) elements of dtype.
struct TensorRef {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  const void* data = nullptr;
};

// One tensor of a file that was read: where its bytes are.
struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  // offsets into the data section
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    return n;
  }
};

namespace detail {
inline std::int64_t checked_numel(const std::vector<std::int64_t>& shape, const std::string& what) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    LLMPAR_CHECK(d >= 0, what, ": dimension ", d, " is negative");
    LLMPAR_CHECK(d == 0 || n <= (std::int64_t{1} << 50) / d, what, ": the shape holds more than 2^50 elements");
    n *= d;
  }
  return n;
}

// A file descriptor closed when it goes out of scope.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

inline void write_all(int fd, const void* data, std::size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<std::size_t>(n, std::size_t{8} << 20));
    if (w < 0 && errno == EINTR) continue;
    LLMPAR_CHECK(w > 0, "safetensors: writing ", path, " failed (", std::strerror(errno), "; disk full?)");
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

// Reads n bytes at `offset` of fd; false at end of file.
inline bool read_all(int fd, void* data, std::size_t n, std::uint64_t offset) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, std::min<std::size_t>(n, std::size_t{1} << 30), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
    offset += static_cast<std::uint64_t>(r);
  }
  return true;
}
}  // namespace detail

// Writes `tensors` (and string metadata) to `path`. Names must be unique and not empty.
// Sync::yes: the bytes are on the disk (fsync) when it returns.
enum class Sync : bool { no, yes };
LLMPAR_INLINE void write(const std::string& path, std::span<const TensorRef> tensors,
                         const std::map<std::string, std::string>& metadata = {}, Sync sync = Sync::no);

// A file whose header was read and checked: its tensors by name, the metadata, and
// (after read(), or a range at a time with read_into) their bytes.
class File {
 public:
  // The header alone, checked against the file's size.
  static File open(const std::string& path);
  // The header and all the data.
  static File read(const std::string& path);

  // Bytes [offset, offset + n) of tensor t's data into dst.
  void read_into(const TensorInfo& t, std::uint64_t offset, std::uint64_t n, void* dst) const;

  const std::string& path() const { return path_; }
  std::span<const TensorInfo> tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(std::string_view name) const {
    for (const TensorInfo& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }
  // The tensor `name`, which must exist with that dtype; its bytes.
  const TensorInfo& get(std::string_view name, DType dtype) const {
    const TensorInfo* t = find(name);
    LLMPAR_CHECK(t != nullptr, "safetensors: ", path_, " has no tensor '", name, "'");
    LLMPAR_CHECK(t->dtype == dtype, "safetensors: ", path_, ": tensor '", name, "' is ", format_name(t->dtype),
                 ", not ", format_name(dtype));
    return *t;
  }
  // After read(): the bytes of tensor t.
  std::span<const std::byte> bytes(const TensorInfo& t) const {
    LLMPAR_CHECK(data_.size() == data_size_, "safetensors: ", path_,
                 " was opened for its header only; read it with File::read, or use read_into");
    return std::span<const std::byte>(data_.data() + t.begin, static_cast<std::size_t>(t.end - t.begin));
  }

 private:
  TensorInfo entry(const std::string& name, const nlohmann::json& e, std::uint64_t data_size) const;

  std::string path_;
  std::shared_ptr<detail::Fd> fd_;  // shared: a File is copyable
  std::uint64_t data_begin_ = 0, data_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::byte> data_;
};

}  // namespace llmpar::checkpoint::safetensors

// The bodies: compiled here (header-only), or once in a program that defines
// LLMPAR_COMPILED and links the compiled part of llmpar (config.hpp).
#if !defined(LLMPAR_COMPILED)
#include "llmpar/checkpoint/safetensors-inl.hpp"
#endif
