// llmpar/checkpoint/safetensors-inl.hpp — the bodies of safetensors.hpp's reader and writer.
//
// safetensors.hpp includes this file unless LLMPAR_COMPILED is defined; a program that
// defines it compiles this file once, in the compiled part of llmpar (src/), where
// LLMPAR_INLINE is empty (config.hpp).
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
#include <span>
#include <string>
#include <vector>

#include "llmpar/checkpoint/safetensors.hpp"

namespace llmpar::checkpoint::safetensors {

LLMPAR_INLINE void write(const std::string& path, std::span<const TensorRef> tensors,
                         const std::map<std::string, std::string>& metadata, Sync sync) {
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

LLMPAR_INLINE File File::open(const std::string& path) {
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
  LLMPAR_CHECK(at == data_size, "safetensors: ", path, ": the tensors cover ", at, " bytes of data but the file holds ",
               data_size, " (truncated, or bytes no tensor owns)");
  return f;
}

LLMPAR_INLINE File File::read(const std::string& path) {
  File f = open(path);
  f.data_.resize(static_cast<std::size_t>(f.data_size_));
  LLMPAR_CHECK(detail::read_all(f.fd_->fd, f.data_.data(), f.data_.size(), f.data_begin_) || f.data_.empty(),
               "safetensors: reading the data of ", path, " failed");
  return f;
}

LLMPAR_INLINE void File::read_into(const TensorInfo& t, std::uint64_t offset, std::uint64_t n, void* dst) const {
  LLMPAR_CHECK(offset <= t.end - t.begin && n <= t.end - t.begin - offset, "safetensors: ", path_, ": bytes [", offset,
               ", ", offset + n, ") are outside tensor '", t.name, "' (", t.end - t.begin, " bytes)");
  if (!data_.empty()) {
    std::memcpy(dst, data_.data() + t.begin + offset, static_cast<std::size_t>(n));
    return;
  }
  LLMPAR_CHECK(detail::read_all(fd_->fd, dst, static_cast<std::size_t>(n), data_begin_ + t.begin + offset),
               "safetensors: ", path_, ": reading tensor '", t.name, "' failed (the file shrank?)");
}

LLMPAR_INLINE TensorInfo File::entry(const std::string& name, const nlohmann::json& e, std::uint64_t data_size) const {
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

}  // namespace llmpar::checkpoint::safetensors
