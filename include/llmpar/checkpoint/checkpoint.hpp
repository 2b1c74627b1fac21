// llmpar/checkpoint/checkpoint.hpp — checkpoints that are atomic, load at any layout and
// resume a run exactly.
//
// What is stored. Every parameter's f32 master value and its two AdamW moments, under
// the parameter's name, as pieces: elements [first, first + n) of the local tensor that
// a Split (tensor-parallel slice) cuts from the full tensor, whose shape is recorded.
// Each rank writes the pieces it saves (parallel::GradSync::saved_state(): its ZeRO
// block of every bucket, tensor-split parameters from every tp rank and replicated ones
// from tp rank 0, each pipeline stage its own layers), so the world writes every element
// once, and no rank gathers anything. One JSON file says the rest: model, layout,
// precision, step, data position, loss scaler, llmpar version.
//
//   DIR/latest                           "step_00000200": the newest complete checkpoint
//   DIR/step_00000200/metadata.json      written last, by rank 0
//   DIR/step_00000200/rank_00003.safetensors
//     tensors  param/h.0.attn.c_attn.weight, exp_avg/..., exp_avg_sq/... (1-D F32, n each)
//     metadata h.0.attn.c_attn.weight -> {"shape":[384,128],"split":[0,2,1,3],"first":0,
//                                         "crc32c":[param's, exp_avg's, exp_avg_sq's]}
//
// Checksummed. Every stored tensor carries the CRC-32C of its bytes (core/crc32c.hpp),
// and a load checks each tensor it reads from, in full, before it uses any of it: a
// flipped bit is an error naming the tensor and its file, never a different model.
// (Format version 1, before checksums, still loads, unchecked.)
//
// Atomic. Every rank writes its shard into DIR/step_N.tmp.<run>/ (the run id is rank
// 0's, shared once) as rank_R.safetensors.partial, fsyncs it and renames it to its final
// name. Rank 0, when every shard is there, writes metadata.json (fsynced), fsyncs the
// directory, renames it to step_N (exchanging it with an older step_N atomically),
// fsyncs DIR, and replaces `latest` the same way. A crash or kill -9 at any moment
// leaves `latest` naming a complete checkpoint, and a temporary directory is never
// read: loading goes through metadata.json, which a partial directory does not have.
//
// Resharding. Loading maps every element a rank needs (GradSync::held_state(), at the
// new layout) to its position in the full tensor and from there to the stored piece
// that holds it, and reads (pread) just those bytes: contiguous runs of a slice, so a
// rank reads only what it keeps. Any (tp, sp, pp, v, dp, ZeRO, precision) loads any
// other; what cannot match (a shape, a missing element) is an error naming the tensor.
//
// Background saving. Trainer::snapshot copies the state to host memory (the only part
// that stops training); Checkpointer writes it on a thread while training continues,
// one save in flight at a time.
#pragma once

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "llmpar/checkpoint/safetensors.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/config.hpp"
#include "llmpar/core/crc32c.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/nn/parameter.hpp"

namespace llmpar::checkpoint {

inline constexpr const char* kFormat = "llmpar-checkpoint";
inline constexpr int kFormatVersion = 2;  // 2: a CRC-32C per stored tensor
inline constexpr int kFirstReadableVersion = 1;

// What is stored for each element: the f32 master value and AdamW's two moments.
enum class Kind : int { param, exp_avg, exp_avg_sq };
inline constexpr std::array<Kind, 3> kKinds = {Kind::param, Kind::exp_avg, Kind::exp_avg_sq};
inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::param:
      return "param";
    case Kind::exp_avg:
      return "exp_avg";
    case Kind::exp_avg_sq:
      return "exp_avg_sq";
  }
  return "?";
}

// Elements [first, first + n) of the local tensor that `split` cuts from the full tensor
// `name` of shape `shape`.
struct Piece {
  std::string name;
  Shape shape;
  nn::Split split;
  std::int64_t first = 0, n = 0;
};

// One rank's state in host memory: its pieces and, per kind, their f32 values piece
// after piece (a weights-only snapshot leaves the moments empty); plus the trainer's
// state (step, data position, loss scaler, ...).
struct Snapshot {
  std::vector<Piece> pieces;
  std::array<std::vector<float>, 3> data;
  nlohmann::json state;

  std::int64_t elements() const { return static_cast<std::int64_t>(data[0].size()); }
  std::size_t bytes() const { return 3 * data[0].size() * sizeof(float); }
};

namespace detail {

// Where full-tensor element f sits under split s: the slice that holds it and its index
// in that slice (the inverse of nn::full_index).
struct Local {
  int slice = 0;
  std::int64_t index = 0;
};
LLMPAR_INLINE Local local_of(const Shape& full, const nn::Split& s, std::int64_t f);
// How many elements from local index i on are contiguous in the full tensor too.
LLMPAR_INLINE std::int64_t run_from(const Shape& full, const nn::Split& s, std::int64_t i);

// Writes `text` to `path` and fsyncs it.
LLMPAR_INLINE void write_synced(const std::string& path, const std::string& text);
// The directory name of step N's checkpoint: step_N, N in 8 digits.
LLMPAR_INLINE std::string step_name(std::int64_t step);
// A shard's file name: rank_R.safetensors, R in 5 digits.
LLMPAR_INLINE std::string shard_name(int rank);

}  // namespace detail

// Where restored values come from: stored pieces of tensors, each readable a range at a
// time (from a file, or from a Snapshot in memory).
class Source {
 public:
  // fetch(kind, stored piece index, first element within the piece, count, out)
  using Fetch = std::function<void(Kind, std::size_t, std::int64_t, std::int64_t, float*)>;

  Source(std::string what, std::vector<Piece> pieces, Fetch fetch);

  const std::string& what() const { return what_; }
  bool has(const std::string& name) const { return tensors_.count(name) > 0; }
  // Names of every stored tensor.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, t] : tensors_) out.push_back(name);
    return out;
  }

  // out (n) = elements [first, first + n) of the local tensor that `split` cuts from
  // tensor `name` (full shape `shape`): the stored values of `kind`.
  void fill(Kind kind, const std::string& name, const Shape& shape, const nn::Split& split, std::int64_t first,
            std::int64_t n, float* out) const;

  // A source reading this rank's own snapshot (a rollback at the same layout).
  static Source of(const Snapshot& s);

 private:
  struct Tensor {
    Shape shape;
    nn::Split split;
    std::vector<std::vector<std::size_t>> slices;  // per slice index: its pieces, by first
  };
  std::string what_;
  std::vector<Piece> pieces_;
  Fetch fetch_;
  std::map<std::string, Tensor> tensors_;
};

// Writes rank `rank`'s snapshot as `path` (safetensors, fsynced).
LLMPAR_INLINE void write_shard(const std::string& path, const Snapshot& s, int rank, std::int64_t step,
                               const std::string& run);

// A complete checkpoint on disk: its metadata and its shards' pieces.
class Checkpoint {
 public:
  // `path`: a checkpoint directory (step_N), or a directory holding `latest`.
  static Checkpoint open(const std::string& path);

  // The directory a path names: itself if it holds metadata.json, else the one its
  // `latest` file names.
  static std::string resolve(const std::string& path);

  const std::string& dir() const { return dir_; }
  std::int64_t step() const { return step_; }
  const nlohmann::json& metadata() const { return meta_; }
  const nlohmann::json& state() const { return meta_["state"]; }
  // The stored pieces, read on demand; each stored tensor is checked against its
  // checksum, in full, the first time any of it is read.
  Source source() const;

 private:
  struct Where {
    std::size_t file;
    std::array<const safetensors::TensorInfo*, 3> info;
    std::array<std::uint32_t, 3> crc;  // of each kind's bytes
    bool checked;                      // format 2 and later: the crc is the writer's
  };

  // Stored piece k's tensor of `kind` matches its checksum (read once, a MiB at a time).
  void verify(std::size_t k, Kind kind) const;

  static Piece parse_piece(const std::string& file, const std::string& name, const std::string& text, bool needs_crc,
                           std::optional<std::array<std::uint32_t, 3>>& crc);

  std::string dir_;
  std::int64_t step_ = 0;
  std::string run_;
  nlohmann::json meta_;
  std::vector<safetensors::File> files_;
  std::vector<Piece> pieces_;
  std::vector<Where> where_;
  mutable std::vector<std::array<bool, 3>> verified_;  // per stored piece and kind: its checksum matched
};

// The complete checkpoints of a --save directory, oldest first.
LLMPAR_INLINE std::vector<std::int64_t> saved_steps(const std::string& dir);

struct CheckpointerConfig {
  std::string dir;          // where step_N directories and `latest` go
  int keep = 0;             // complete checkpoints to keep (the newest); 0: all
  bool background = true;   // write on a thread while training continues
  double timeout_s = 600.;  // rank 0 waits this long for the other ranks' shards
};

// Saves checkpoints: every rank its shard, rank 0 the metadata and the commit.
class Checkpointer {
 public:
  // Every rank of `world` (a comm::Comm, or one engine's communicator) constructs one
  // together: they agree on a run id.
  template <class World>
  Checkpointer(World& world, CheckpointerConfig cfg) : cfg_(std::move(cfg)), rank_(world.rank()) {
    namespace fs = std::filesystem;
    LLMPAR_CHECK(!cfg_.dir.empty(), "checkpoint: no directory to save into");
    LLMPAR_CHECK(cfg_.keep >= 0, "--keep ", cfg_.keep, "; keep at least 1 checkpoint, or 0 for all");
    std::array<std::int64_t, 1> id{0};
    if (rank_ == 0) {
      std::error_code ec;
      fs::create_directories(cfg_.dir, ec);
      LLMPAR_CHECK(fs::is_directory(cfg_.dir), "--save ", cfg_.dir, ": cannot create the directory (", ec.message(),
                   ")");
      const std::string probe = (fs::path(cfg_.dir) / ".llmpar-write-test").string();
      detail::write_synced(probe, "");
      fs::remove(probe, ec);
      // Temporary directories of saves that never finished (a crash).
      for (auto it = fs::directory_iterator(cfg_.dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
        if (it->path().filename().string().find(".tmp.") != std::string::npos) fs::remove_all(it->path(), ec);
      std::random_device rd;
      id[0] = static_cast<std::int64_t>((static_cast<std::uint64_t>(rd()) << 20 ^ rd()) & 0xffffffffffll);
    }
    world.broadcast(std::span<std::int64_t>(id), 0);
    run_ = std::to_string(id[0]);
    world_size_ = world.size();
  }
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;
  ~Checkpointer() {
    if (writer_.joinable()) writer_.join();
  }

  // Saves `snap` (this rank's) as part of step_N; rank 0 adds `meta` (model, layout, ...)
  // and commits. Waits for the previous save first.
  void save(std::int64_t step, Snapshot snap, nlohmann::json meta);
  // The memory of the last snapshot written, for the next one (Trainer::snapshot into
  // it: no page faults); waits for the save in flight.
  Snapshot reuse() {
    wait();
    return std::move(spare_);
  }
  // The save in flight is done (and, on rank 0, committed); its error, if any, is thrown.
  void wait() {
    if (writer_.joinable()) writer_.join();
    rethrow();
  }
  const std::string& run_id() const { return run_; }
  // Seconds and bytes of the last save this rank wrote (its shard; rank 0: and the commit).
  double last_seconds() const { return last_seconds_; }
  std::uint64_t last_bytes() const { return last_bytes_; }

 private:
  void rethrow();

  void write(std::int64_t step, const Snapshot& snap, nlohmann::json meta);

  // Rank 0: waits for every shard, writes the metadata, renames the directory into
  // place and points `latest` at it; then removes checkpoints beyond --keep.
  void commit(std::int64_t step, const std::filesystem::path& tmp, nlohmann::json meta, const nlohmann::json& state);

  CheckpointerConfig cfg_;
  int rank_ = 0, world_size_ = 1;
  std::string run_;
  std::thread writer_;
  std::exception_ptr error_;
  Snapshot spare_;  // the last snapshot written (reuse())
  double last_seconds_ = 0.0;
  std::uint64_t last_bytes_ = 0;
};

}  // namespace llmpar::checkpoint

// The reading and writing: compiled here (header-only), or once in a program that
// defines LLMPAR_COMPILED and links the compiled part of llmpar (config.hpp).
#if !defined(LLMPAR_COMPILED)
#include "llmpar/checkpoint/checkpoint-inl.hpp"
#endif
