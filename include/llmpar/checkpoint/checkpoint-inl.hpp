// llmpar/checkpoint/checkpoint-inl.hpp — the bodies of checkpoint.hpp's reading and
// writing: the pieces' index (Source), the shard and metadata files, the commit.
//
// checkpoint.hpp includes this file unless LLMPAR_COMPILED is defined; a program that
// defines it compiles this file once, in the compiled part of llmpar (src/), where
// LLMPAR_INLINE is empty (config.hpp).
#pragma once

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "llmpar/checkpoint/checkpoint.hpp"

namespace llmpar::checkpoint::detail {

LLMPAR_INLINE Local local_of(const Shape& full, const nn::Split& s, std::int64_t f) {
  if (!s.is_split()) return {0, f};
  std::int64_t inner = 1;
  for (int d = s.dim + 1; d < full.rank; ++d) inner *= full[d];
  const std::int64_t dim = full[s.dim], local_dim = dim / s.parts;
  const std::int64_t c = (f / inner) % dim, outer = f / (inner * dim);
  const std::int64_t per_group_full = dim / s.groups, per_group_local = per_group_full / s.parts;
  const std::int64_t group = c / per_group_full, w = c % per_group_full;
  const std::int64_t local_c = group * per_group_local + w % per_group_local;
  return {static_cast<int>(w / per_group_local), (outer * local_dim + local_c) * inner + f % inner};
}

LLMPAR_INLINE std::int64_t run_from(const Shape& full, const nn::Split& s, std::int64_t i) {
  if (!s.is_split()) return full.numel() - i;
  std::int64_t inner = 1;
  for (int d = s.dim + 1; d < full.rank; ++d) inner *= full[d];
  const std::int64_t run = full[s.dim] / s.groups / s.parts * inner;
  return run - i % run;
}

LLMPAR_INLINE std::string hex(std::uint32_t v) {
  char text[16];
  std::snprintf(text, sizeof text, "%08x", v);
  return text;
}

LLMPAR_INLINE std::string shape_text(const Shape& s) {
  std::ostringstream out;
  out << s;
  return out.str();
}

LLMPAR_INLINE void write_synced(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LLMPAR_CHECK(fd >= 0, "checkpoint: cannot create ", path, " (", std::strerror(errno), ")");
  const safetensors::detail::Fd closer{fd};
  safetensors::detail::write_all(fd, text.data(), text.size(), path);
  LLMPAR_CHECK(::fsync(fd) == 0, "checkpoint: fsync of ", path, " failed (", std::strerror(errno), ")");
}

// fsync of a directory: its entries (a rename, a new file) are on the disk.
LLMPAR_INLINE void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  LLMPAR_CHECK(fd >= 0, "checkpoint: cannot open directory ", dir, " (", std::strerror(errno), ")");
  const safetensors::detail::Fd closer{fd};
  LLMPAR_CHECK(::fsync(fd) == 0, "checkpoint: fsync of directory ", dir, " failed (", std::strerror(errno), ")");
}

// Moves `from` to `to` in one step; an existing `to` (a directory of an earlier run) is
// exchanged atomically and then removed, so `to` never stops existing in between.
LLMPAR_INLINE void replace(const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  if (::rename(from.c_str(), to.c_str()) == 0) return;
  const int first = errno;
  LLMPAR_CHECK((first == ENOTEMPTY || first == EEXIST) && fs::is_directory(to), "checkpoint: renaming ", from, " to ",
               to, " failed (", std::strerror(first), ")");
  LLMPAR_CHECK(::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0,
               "checkpoint: exchanging ", from, " with the existing ", to, " failed (", std::strerror(errno), ")");
  std::error_code ec;
  fs::remove_all(from, ec);
}

LLMPAR_INLINE std::string step_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

LLMPAR_INLINE std::string shard_name(int rank) {
  char name[40];
  std::snprintf(name, sizeof name, "rank_%05d.safetensors", rank);
  return name;
}

// step_N -> N (or -1 for any other name).
LLMPAR_INLINE std::int64_t step_of(const std::string& name) {
  if (name.size() != 13 || name.rfind("step_", 0) != 0) return -1;
  std::int64_t v = 0;
  for (char c : name.substr(5)) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

LLMPAR_INLINE nlohmann::json piece_json(const Piece& p, const std::array<std::uint32_t, 3>& crc) {
  std::vector<std::int64_t> shape(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.rank);
  return {{"shape", shape},
          {"split", {p.split.dim, p.split.parts, p.split.index, p.split.groups}},
          {"first", p.first},
          {"crc32c", crc}};
}

}  // namespace llmpar::checkpoint::detail

namespace llmpar::checkpoint {

LLMPAR_INLINE Source::Source(std::string what, std::vector<Piece> pieces, Fetch fetch)
    : what_(std::move(what)), pieces_(std::move(pieces)), fetch_(std::move(fetch)) {
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    Tensor& t = tensors_[p.name];
    if (t.slices.empty()) {
      t.shape = p.shape;
      t.split = p.split;
      t.slices.resize(static_cast<std::size_t>(p.split.is_split() ? p.split.parts : 1));
    }
    LLMPAR_CHECK(t.shape == p.shape && t.split.dim == p.split.dim && t.split.parts == p.split.parts &&
                     t.split.groups == p.split.groups,
                 what_, ": tensor '", p.name, "' is stored with two different shapes or splits (",
                 detail::shape_text(t.shape), " and ", detail::shape_text(p.shape),
                 "); the checkpoint mixes files of different runs");
    const int slice = p.split.is_split() ? p.split.index : 0;
    LLMPAR_CHECK(slice >= 0 && slice < static_cast<int>(t.slices.size()) && p.first >= 0 && p.n >= 0 &&
                     p.first + p.n <= nn::local_shape(p.shape, p.split, p.name).numel(),
                 what_, ": tensor '", p.name, "' has a piece [", p.first, ", ", p.first + p.n, ") of slice ", slice,
                 " that is outside its local tensor");
    t.slices[static_cast<std::size_t>(slice)].push_back(k);
  }
  for (auto& [name, t] : tensors_)
    for (auto& list : t.slices) {
      std::sort(list.begin(), list.end(),
                [&](std::size_t a, std::size_t b) { return pieces_[a].first < pieces_[b].first; });
      for (std::size_t i = 1; i < list.size(); ++i)
        LLMPAR_CHECK(pieces_[list[i - 1]].first + pieces_[list[i - 1]].n <= pieces_[list[i]].first, what_, ": tensor '",
                     name, "' has overlapping pieces; the checkpoint mixes files of different runs");
    }
}

LLMPAR_INLINE void Source::fill(Kind kind, const std::string& name, const Shape& shape, const nn::Split& split,
                                std::int64_t first, std::int64_t n, float* out) const {
  const auto it = tensors_.find(name);
  LLMPAR_CHECK(it != tensors_.end(), what_, " has no tensor '", name,
               "'; the model has a parameter the checkpoint does not (another model configuration?)");
  const Tensor& t = it->second;
  LLMPAR_CHECK(t.shape == shape, what_, ": tensor '", name, "' has shape ", detail::shape_text(t.shape),
               " in the checkpoint but ", detail::shape_text(shape),
               " in the model; load it into the model it was "
               "saved from (same layers, dim, vocab, seq)");
  std::int64_t i = first;
  const std::int64_t end = first + n;
  while (i < end) {
    const std::int64_t f = nn::full_index(shape, split, i);
    const detail::Local at = detail::local_of(shape, t.split, f);
    const auto& list = t.slices[static_cast<std::size_t>(at.slice)];
    // The stored piece of that slice holding element at.index.
    auto pos = std::upper_bound(list.begin(), list.end(), at.index,
                                [&](std::int64_t v, std::size_t k) { return v < pieces_[k].first; });
    LLMPAR_CHECK(pos != list.begin(), what_, ": no stored piece holds element ", at.index, " of slice ", at.slice,
                 " of tensor '", name, "' (a shard is missing, or holds another run's pieces)");
    const std::size_t k = *(pos - 1);
    const Piece& p = pieces_[k];
    LLMPAR_CHECK(at.index < p.first + p.n, what_, ": no stored piece holds element ", at.index, " of slice ", at.slice,
                 " of tensor '", name, "' (a shard is missing, or holds another run's pieces)");
    const std::int64_t len = std::min({end - i, detail::run_from(shape, split, i),
                                       detail::run_from(shape, t.split, at.index), p.first + p.n - at.index});
    fetch_(kind, k, at.index - p.first, len, out + (i - first));
    i += len;
  }
}

LLMPAR_INLINE Source Source::of(const Snapshot& s) {
  std::vector<std::int64_t> offsets;
  std::int64_t at = 0;
  for (const Piece& p : s.pieces) {
    offsets.push_back(at);
    at += p.n;
  }
  return Source("the in-memory snapshot", s.pieces,
                [&s, offsets](Kind kind, std::size_t k, std::int64_t first, std::int64_t n, float* out) {
                  const auto& data = s.data[static_cast<std::size_t>(kind)];
                  LLMPAR_CHECK(data.size() == s.data[0].size(), "the in-memory snapshot holds no ", kind_name(kind),
                               " (weights only); load it with Trainer::load_weights");
                  const float* src = data.data() + offsets[k] + first;
                  std::copy(src, src + n, out);
                });
}

LLMPAR_INLINE void write_shard(const std::string& path, const Snapshot& s, int rank, std::int64_t step,
                               const std::string& run) {
  std::vector<safetensors::TensorRef> refs;
  std::map<std::string, std::string> meta{{"format", std::string(kFormat) + "-shard"},
                                          {"rank", std::to_string(rank)},
                                          {"step", std::to_string(step)},
                                          {"run", run}};
  std::vector<std::array<std::uint32_t, 3>> crc(s.pieces.size());
  for (Kind kind : kKinds) {
    std::int64_t at = 0;
    for (std::size_t k = 0; k < s.pieces.size(); ++k) {
      const Piece& p = s.pieces[k];
      const float* values = s.data[static_cast<std::size_t>(kind)].data() + at;
      refs.push_back({std::string(kind_name(kind)) + "/" + p.name, DType::f32, {p.n}, values});
      crc[k][static_cast<std::size_t>(kind)] = crc32c(values, static_cast<std::size_t>(p.n) * sizeof(float));
      at += p.n;
    }
  }
  for (std::size_t k = 0; k < s.pieces.size(); ++k)
    meta[s.pieces[k].name] = detail::piece_json(s.pieces[k], crc[k]).dump();
  safetensors::write(path, refs, meta, safetensors::Sync::yes);
}

LLMPAR_INLINE Checkpoint Checkpoint::open(const std::string& path) {
  namespace fs = std::filesystem;
  Checkpoint c;
  c.dir_ = resolve(path);
  const std::string meta_path = (fs::path(c.dir_) / "metadata.json").string();
  std::ifstream in(meta_path);
  LLMPAR_CHECK(in.good(), "checkpoint ", c.dir_,
               " has no metadata.json: it is not a complete llmpar checkpoint (a save that did not finish "
               "leaves a step_N.tmp directory, which is never loaded)");
  const nlohmann::json meta = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  LLMPAR_CHECK(meta.is_object(), meta_path, " is not a JSON object (corrupt or truncated)");
  const auto field = [&](const char* key, auto check, const char* what) -> const nlohmann::json& {
    LLMPAR_CHECK(meta.contains(key) && check(meta[key]), meta_path, ": '", key, "' is missing or not ", what);
    return meta[key];
  };
  const auto is_string = [](const nlohmann::json& j) { return j.is_string(); };
  const auto is_count = [](const nlohmann::json& j) { return j.is_number_integer() && j.get<std::int64_t>() >= 0; };
  const auto is_object = [](const nlohmann::json& j) { return j.is_object(); };
  LLMPAR_CHECK(field("format", is_string, "a string") == kFormat, meta_path, " is not an llmpar checkpoint (format '",
               meta["format"].get<std::string>(), "')");
  const std::int64_t version = field("version", is_count, "a version number").get<std::int64_t>();
  LLMPAR_CHECK(version >= kFirstReadableVersion && version <= kFormatVersion, meta_path,
               " has checkpoint format version ", version, "; this llmpar ", kVersion, " reads versions ",
               kFirstReadableVersion, " to ", kFormatVersion);
  c.step_ = field("step", is_count, "a step number").get<std::int64_t>();
  c.run_ = field("run", is_string, "a string").get<std::string>();
  field("state", is_object, "an object");
  field("model", is_object, "an object");
  field("layout", is_object, "an object");
  const auto& shards = field(
      "shards", [](const nlohmann::json& j) { return j.is_array() && !j.empty(); }, "a list of shards");
  c.meta_ = meta;
  std::vector<Piece> pieces;
  std::vector<Where> where;
  c.files_.reserve(shards.size());  // where[] points into them
  for (std::size_t r = 0; r < shards.size(); ++r) {
    const auto& e = shards[r];
    LLMPAR_CHECK(
        e.is_object() && e.contains("file") && e["file"].is_string() && e.contains("bytes") && is_count(e["bytes"]),
        meta_path, ": shard entry ", r, " is not {\"file\", \"bytes\"}");
    const std::string file = e["file"].get<std::string>();
    LLMPAR_CHECK(file == detail::shard_name(static_cast<int>(r)), meta_path, ": shard ", r, " is named '", file,
                 "', not ", detail::shard_name(static_cast<int>(r)));
    const std::string shard_path = (fs::path(c.dir_) / file).string();
    std::error_code ec;
    const auto size = fs::file_size(shard_path, ec);
    LLMPAR_CHECK(!ec, "checkpoint ", c.dir_, ": shard ", file, " is missing (", ec.message(), ")");
    LLMPAR_CHECK(size == e["bytes"].get<std::uint64_t>(), "checkpoint ", c.dir_, ": shard ", file, " holds ", size,
                 " bytes but metadata.json says ", e["bytes"].get<std::uint64_t>(), ": truncated or replaced");
    c.files_.push_back(safetensors::File::open(shard_path));
    const safetensors::File& f = c.files_.back();
    const auto& m = f.metadata();
    const auto value = [&](const char* key) {
      const auto it = m.find(key);
      return it == m.end() ? std::string("(none)") : it->second;
    };
    LLMPAR_CHECK(value("format") == std::string(kFormat) + "-shard", shard_path, " is not an llmpar checkpoint shard");
    LLMPAR_CHECK(
        value("run") == c.run_ && value("step") == std::to_string(c.step_) && value("rank") == std::to_string(r),
        shard_path, " was written by run ", value("run"), " at step ", value("step"), " as rank ", value("rank"),
        ", but metadata.json is run ", c.run_, " step ", c.step_, ": the directory mixes files of two saves");
    std::size_t described = 0;
    for (const auto& [key, text] : m) {
      if (key == "format" || key == "rank" || key == "step" || key == "run") continue;
      std::optional<std::array<std::uint32_t, 3>> crc;
      pieces.push_back(parse_piece(shard_path, key, text, version >= 2, crc));
      ++described;
      {
        const safetensors::TensorInfo* t = f.find(std::string("param/") + key);
        LLMPAR_CHECK(t != nullptr && t->shape.size() == 1, shard_path, " has no 1-D tensor 'param/", key, "'");
        pieces.back().n = t->shape[0];
      }
      Where w{c.files_.size() - 1, {}, crc.value_or(std::array<std::uint32_t, 3>{}), crc.has_value()};
      for (Kind kind : kKinds) {
        const std::string tname = std::string(kind_name(kind)) + "/" + key;
        const safetensors::TensorInfo* t = f.find(tname);
        LLMPAR_CHECK(t != nullptr, shard_path, " has no tensor '", tname, "'");
        LLMPAR_CHECK(t->dtype == DType::f32 && t->shape == std::vector<std::int64_t>{pieces.back().n}, shard_path,
                     ": tensor '", tname, "' is not ", pieces.back().n, " F32 values");
        w.info[static_cast<std::size_t>(kind)] = t;
      }
      where.push_back(w);
    }
    LLMPAR_CHECK(f.tensors().size() == 3 * described, shard_path, " holds ", f.tensors().size(),
                 " tensors but its metadata describes ", described, " pieces of 3 each");
  }
  c.where_ = where;
  c.pieces_ = pieces;
  c.verified_.assign(where.size(), {false, false, false});
  return c;
}

LLMPAR_INLINE std::string Checkpoint::resolve(const std::string& path) {
  namespace fs = std::filesystem;
  LLMPAR_CHECK(fs::is_directory(path), "checkpoint ", path, " does not exist (or is not a directory)");
  if (fs::exists(fs::path(path) / "metadata.json")) return path;
  LLMPAR_CHECK(detail::step_of(fs::path(path).filename().string()) < 0, "checkpoint ", path,
               " has no metadata.json: it is not a complete llmpar checkpoint (its save did not finish)");
  std::ifstream latest(fs::path(path) / "latest");
  LLMPAR_CHECK(latest.good(), path,
               " holds neither a checkpoint (metadata.json) nor a 'latest' file naming one; give a step_N "
               "directory or the --save directory of a run");
  std::string name;
  std::getline(latest, name);
  LLMPAR_CHECK(detail::step_of(name) >= 0, path, "/latest says '", name, "', which is not a step_N directory");
  return (fs::path(path) / name).string();
}

LLMPAR_INLINE Source Checkpoint::source() const {
  return Source("checkpoint " + dir_, pieces_,
                [this](Kind kind, std::size_t k, std::int64_t first, std::int64_t n, float* out) {
                  verify(k, kind);
                  const Where& w = where_[k];
                  files_[w.file].read_into(*w.info[static_cast<std::size_t>(kind)],
                                           static_cast<std::uint64_t>(first) * sizeof(float),
                                           static_cast<std::uint64_t>(n) * sizeof(float), out);
                });
}

LLMPAR_INLINE void Checkpoint::verify(std::size_t k, Kind kind) const {
  const Where& w = where_[k];
  bool& done = verified_[k][static_cast<std::size_t>(kind)];
  if (done || !w.checked) return;
  const safetensors::TensorInfo& t = *w.info[static_cast<std::size_t>(kind)];
  const std::uint64_t total = t.end - t.begin;
  std::vector<unsigned char> chunk(std::min<std::uint64_t>(total, 1u << 20));
  std::uint32_t crc = 0;
  for (std::uint64_t at = 0; at < total; at += chunk.size()) {
    const std::uint64_t n = std::min<std::uint64_t>(chunk.size(), total - at);
    files_[w.file].read_into(t, at, n, chunk.data());
    crc = crc32c(chunk.data(), n, crc);
  }
  const std::uint32_t want = w.crc[static_cast<std::size_t>(kind)];
  LLMPAR_CHECK(crc == want, "checkpoint ", dir_, ": tensor '", t.name, "' in ",
               std::filesystem::path(files_[w.file].path()).filename().string(),
               " does not match its checksum (CRC-32C ", detail::hex(crc), ", stored ", detail::hex(want),
               "): the file is corrupted; resume from another checkpoint (or a copy of this one)");
  done = true;
}

LLMPAR_INLINE Piece Checkpoint::parse_piece(const std::string& file, const std::string& name, const std::string& text,
                                            bool needs_crc, std::optional<std::array<std::uint32_t, 3>>& crc) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const auto bad = [&](const char* what) {
    LLMPAR_FAIL(file, ": the description of tensor '", name, "' ", what, " (", text.substr(0, 120), ")");
  };
  if (!j.is_object() || !j.contains("shape") || !j.contains("split") || !j.contains("first")) bad("is not valid");
  Piece p;
  p.name = name;
  if (!j["shape"].is_array() || j["shape"].empty() || j["shape"].size() > 4) bad("has no shape of 1 to 4 dims");
  std::vector<std::int64_t> dims;
  for (const auto& d : j["shape"]) {
    if (!d.is_number_integer() || d.get<std::int64_t>() <= 0 || d.get<std::int64_t>() > (std::int64_t{1} << 40))
      bad("has a dimension that is not a positive integer");
    dims.push_back(d.get<std::int64_t>());
  }
  for (std::int64_t d : dims) p.shape.dims[static_cast<std::size_t>(p.shape.rank++)] = d;
  if (p.shape.numel() > (std::int64_t{1} << 40)) bad("is too large");
  const auto& s = j["split"];
  if (!s.is_array() || s.size() != 4) bad("has no split [dim, parts, index, groups]");
  for (const auto& v : s)
    if (!v.is_number_integer() || std::abs(v.get<std::int64_t>()) > 65536) bad("has a split that is not 4 integers");
  p.split = {s[0].get<int>(), s[1].get<int>(), s[2].get<int>(), s[3].get<int>()};
  if (p.split.dim >= p.shape.rank || p.split.dim < -1 || p.split.parts < 1 || p.split.groups < 1)
    bad("has a split that does not fit its shape");
  try {
    static_cast<void>(nn::local_shape(p.shape, p.split, p.name));
  } catch (const Error& e) {
    bad(e.what());
  }
  if (!j["first"].is_number_integer() || j["first"].get<std::int64_t>() < 0) bad("has no valid first element");
  p.first = j["first"].get<std::int64_t>();
  if (needs_crc) {
    const auto it = j.find("crc32c");
    if (it == j.end() || !it->is_array() || it->size() != 3) bad("has no crc32c [param, exp_avg, exp_avg_sq]");
    std::array<std::uint32_t, 3> c{};
    for (std::size_t i = 0; i < 3; ++i) {
      const auto& v = (*it)[i];
      if (!v.is_number_unsigned() || v.get<std::uint64_t>() > 0xffffffffull) bad("has a crc32c that is not 32 bits");
      c[i] = static_cast<std::uint32_t>(v.get<std::uint64_t>());
    }
    crc = c;
  }
  return p;
}

LLMPAR_INLINE std::vector<std::int64_t> saved_steps(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::int64_t> steps;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::int64_t s = detail::step_of(it->path().filename().string());
    if (s >= 0 && fs::exists(it->path() / "metadata.json")) steps.push_back(s);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

LLMPAR_INLINE void Checkpointer::save(std::int64_t step, Snapshot snap, nlohmann::json meta) {
  wait();
  auto job = [this, step, snap = std::move(snap), meta = std::move(meta)]() mutable {
    try {
      write(step, snap, std::move(meta));
    } catch (...) {
      error_ = std::current_exception();
    }
    spare_ = std::move(snap);
  };
  if (cfg_.background)
    writer_ = std::thread(std::move(job));
  else
    job();
  if (!cfg_.background) rethrow();
}

LLMPAR_INLINE void Checkpointer::rethrow() {
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

LLMPAR_INLINE void Checkpointer::write(std::int64_t step, const Snapshot& snap, nlohmann::json meta) {
  namespace fs = std::filesystem;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string name = detail::step_name(step);
  const fs::path tmp = fs::path(cfg_.dir) / (name + ".tmp." + run_);
  std::error_code ec;
  fs::create_directories(tmp, ec);
  LLMPAR_CHECK(fs::is_directory(tmp), "checkpoint: cannot create ", tmp.string(), " (", ec.message(), ")");
  const fs::path shard = tmp / detail::shard_name(rank_);
  write_shard(shard.string() + ".partial", snap, rank_, step, run_);
  fs::rename(shard.string() + ".partial", shard);
  last_bytes_ = fs::file_size(shard);
  if (rank_ == 0) commit(step, tmp, std::move(meta), snap.state);
  last_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

LLMPAR_INLINE void Checkpointer::commit(std::int64_t step, const std::filesystem::path& tmp, nlohmann::json meta,
                                        const nlohmann::json& state) {
  namespace fs = std::filesystem;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(cfg_.timeout_s);
  nlohmann::json shards = nlohmann::json::array();
  for (int r = 0; r < world_size_; ++r) {
    const fs::path p = tmp / detail::shard_name(r);
    while (!fs::exists(p)) {
      LLMPAR_CHECK(std::chrono::steady_clock::now() < deadline, "checkpoint step ", step, ": rank ", r,
                   "'s shard did not appear in ", tmp.string(), " within ", cfg_.timeout_s,
                   " s; the checkpoint was not committed (is the directory shared by every rank?)");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    shards.push_back({{"file", detail::shard_name(r)}, {"bytes", fs::file_size(p)}});
  }
  meta["format"] = kFormat;
  meta["version"] = kFormatVersion;
  meta["llmpar_version"] = kVersion;
  meta["step"] = step;
  meta["run"] = run_;
  meta["world"] = world_size_;
  meta["shards"] = shards;
  meta["state"] = state;
  detail::write_synced((tmp / "metadata.json").string(), meta.dump(1));
  detail::sync_directory(tmp.string());
  const std::string name = detail::step_name(step);
  detail::replace(tmp.string(), (fs::path(cfg_.dir) / name).string());
  detail::sync_directory(cfg_.dir);
  const std::string latest = (fs::path(cfg_.dir) / "latest").string();
  detail::write_synced(latest + ".tmp", name + "\n");
  fs::rename(latest + ".tmp", latest);
  detail::sync_directory(cfg_.dir);
  if (cfg_.keep > 0) {
    const std::vector<std::int64_t> steps = saved_steps(cfg_.dir);
    for (std::size_t i = 0; i + static_cast<std::size_t>(cfg_.keep) < steps.size(); ++i) {
      if (steps[i] == step) continue;
      // Out of sight first (a rename is atomic; a crash leaves a temporary directory,
      // removed at the next start), then deleted.
      const fs::path old = fs::path(cfg_.dir) / detail::step_name(steps[i]);
      const fs::path doomed = fs::path(cfg_.dir) / (detail::step_name(steps[i]) + ".tmp.removed");
      std::error_code ec;
      fs::rename(old, doomed, ec);
      if (!ec) fs::remove_all(doomed, ec);
    }
  }
}

}  // namespace llmpar::checkpoint
