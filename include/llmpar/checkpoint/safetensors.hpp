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
inline void write(const std::string& path, std::span<const TensorRef> tensors,
                  const std::map<std::string, std::string>& metadata = {}, Sync sync = Sync::no) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const TensorRef& t : tensors) {
    LLMPAR_CHECK(!t.name.empty() && t.name != "__metadata__", "safetensors: cannot write a tensor named '", t.name,
                 "' to ", path);
    LLMPAR_CHECK(!header.contains(t.name), "safetensors: two tensors named '", t.name, "' for ", path);
    const auto bytes =
        static_cast<std::uint64_t>(detail::checked_numel(t.shape, "safetensors: tensor " + t.name)) * size_of(t.dtype);
    LLMPAR_CHECK(bytes == 0 || t.data != nullptr, "safetensors: tensor '", t.name, "' has no data");
    header[t.name] = {{"dtype", format_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LLMPAR_CHECK(fd >= 0, "safetensors: cannot open ", path, " for writing (", std::strerror(errno),
               "); check the directory exists and is writable");
  const detail::Fd closer{fd};
  const std::uint64_t n = text.size();
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xff);
  detail::write_all(fd, length, 8, path);
  detail::write_all(fd, text.data(), text.size(), path);
  for (const TensorRef& t : tensors) {
    const std::int64_t bytes = detail::checked_numel(t.shape, t.name) * static_cast<std::int64_t>(size_of(t.dtype));
    if (bytes > 0) detail::write_all(fd, t.data, static_cast<std::size_t>(bytes), path);
  }
  if (sync == Sync::yes)
    LLMPAR_CHECK(::fsync(fd) == 0, "safetensors: fsync of ", path, " failed (", std::strerror(errno), ")");
}

// A file whose header was read and checked: its tensors by name, the metadata, and
// (after read(), or a range at a time with read_into) their bytes.
class File {
 public:
  // The header alone, checked against the file's size.
  static File open(const std::string& path) {
    File f;
    f.path_ = path;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    LLMPAR_CHECK(fd >= 0, "safetensors: cannot open ", path, " (", std::strerror(errno), ")");
    f.fd_ = std::make_shared<detail::Fd>(fd);
    struct stat st {};
    LLMPAR_CHECK(::fstat(fd, &st) == 0 && S_ISREG(st.st_mode), "safetensors: ", path, " is not a regular file");
    const auto size = static_cast<std::uint64_t>(st.st_size);
    LLMPAR_CHECK(size >= 8, "safetensors: ", path, " holds ", size,
                 " bytes, fewer than the 8 of the header length: not a safetensors file (or truncated)");
    unsigned char length[8];
    LLMPAR_CHECK(detail::read_all(fd, length, 8, 0), "safetensors: reading ", path, " failed");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
    LLMPAR_CHECK(n <= size - 8 && n <= (std::uint64_t{100} << 20), "safetensors: ", path, " says its header holds ", n,
                 " bytes, but the file has ", size - 8,
                 " after the length (and headers stop at 100 MiB): truncated or not a safetensors file");
    std::string text(static_cast<std::size_t>(n), '\0');
    LLMPAR_CHECK(detail::read_all(fd, text.data(), text.size(), 8), "safetensors: reading the header of ", path,
                 " failed");
    const nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    LLMPAR_CHECK(header.is_object(), "safetensors: the header of ", path, " is not a JSON object");
    f.data_begin_ = 8 + n;
    const std::uint64_t data_size = size - 8 - n;
    f.data_size_ = data_size;
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        LLMPAR_CHECK(entry.is_object(), "safetensors: ", path, ": __metadata__ is not an object");
        for (const auto& [key, value] : entry.items()) {
          LLMPAR_CHECK(value.is_string(), "safetensors: ", path, ": metadata '", key, "' is not a string");
          f.metadata_[key] = value.get<std::string>();
        }
        continue;
      }
      f.tensors_.push_back(f.entry(name, entry, data_size));
    }
    // The tensors tile the data section: sorted by offset, no overlap and no gap.
    std::vector<const TensorInfo*> order;
    for (const TensorInfo& t : f.tensors_) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
    std::uint64_t at = 0;
    for (const TensorInfo* t : order) {
      LLMPAR_CHECK(t->begin == at, "safetensors: ", path, ": tensor '", t->name, "' starts at byte ", t->begin,
                   " of the data, but the tensors before it end at ", at, " (overlapping or with a gap)");
      at = t->end;
    }
    LLMPAR_CHECK(at == data_size, "safetensors: ", path, ": the tensors cover ", at,
                 " bytes of data but the file holds ", data_size, " (truncated, or bytes no tensor owns)");
    return f;
  }
  // The header and all the data.
  static File read(const std::string& path) {
    File f = open(path);
    f.data_.resize(static_cast<std::size_t>(f.data_size_));
    LLMPAR_CHECK(detail::read_all(f.fd_->fd, f.data_.data(), f.data_.size(), f.data_begin_) || f.data_.empty(),
                 "safetensors: reading the data of ", path, " failed");
    return f;
  }

  // Bytes [offset, offset + n) of tensor t's data into dst.
  void read_into(const TensorInfo& t, std::uint64_t offset, std::uint64_t n, void* dst) const {
    LLMPAR_CHECK(offset <= t.end - t.begin && n <= t.end - t.begin - offset, "safetensors: ", path_, ": bytes [",
                 offset, ", ", offset + n, ") are outside tensor '", t.name, "' (", t.end - t.begin, " bytes)");
    if (!data_.empty()) {
      std::memcpy(dst, data_.data() + t.begin + offset, static_cast<std::size_t>(n));
      return;
    }
    LLMPAR_CHECK(detail::read_all(fd_->fd, dst, static_cast<std::size_t>(n), data_begin_ + t.begin + offset),
                 "safetensors: ", path_, ": reading tensor '", t.name, "' failed (the file shrank?)");
  }

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
  TensorInfo entry(const std::string& name, const nlohmann::json& e, std::uint64_t data_size) const {
    const std::string what = llmpar::detail::concat("safetensors: ", path_, ": tensor '", name, "'");
    LLMPAR_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"), what,
                 " needs dtype, shape and data_offsets");
    LLMPAR_CHECK(e["dtype"].is_string(), what, ": dtype is not a string");
    const auto dtype = dtype_named(e["dtype"].get<std::string>());
    LLMPAR_CHECK(dtype.has_value(), what, " has dtype ", e["dtype"].get<std::string>(),
                 "; llmpar reads F32, BF16, F16, I32, I64 and U8");
    TensorInfo t;
    t.name = name;
    t.dtype = *dtype;
    LLMPAR_CHECK(e["shape"].is_array(), what, ": shape is not a list");
    for (const auto& d : e["shape"]) {
      LLMPAR_CHECK(d.is_number_integer() && d.get<std::int64_t>() >= 0, what, ": shape ", e["shape"].dump(),
                   " has an entry that is not a non-negative integer");
      t.shape.push_back(d.get<std::int64_t>());
    }
    const auto& off = e["data_offsets"];
    LLMPAR_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(), what,
                 ": data_offsets ", off.dump(), " is not two non-negative integers");
    t.begin = off[0].get<std::uint64_t>();
    t.end = off[1].get<std::uint64_t>();
    LLMPAR_CHECK(t.begin <= t.end && t.end <= data_size, what, ": data_offsets [", t.begin, ", ", t.end,
                 "] are outside the ", data_size, " bytes of data (truncated file?)");
    const auto want = static_cast<std::uint64_t>(detail::checked_numel(t.shape, what)) * size_of(t.dtype);
    LLMPAR_CHECK(t.end - t.begin == want, what, " holds ", t.end - t.begin, " bytes, but shape ", e["shape"].dump(),
                 " of ", format_name(t.dtype), " needs ", want);
    return t;
  }

  std::string path_;
  std::shared_ptr<detail::Fd> fd_;  // shared: a File is copyable
  std::uint64_t data_begin_ = 0, data_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::byte> data_;
};

}  // namespace llmpar::checkpoint::safetensors
