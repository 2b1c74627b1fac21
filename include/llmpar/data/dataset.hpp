// llmpar/data/dataset.hpp — token datasets, the sequential data loader, and the
// embedded text corpus.
//
// TokenDataset is a list of token shards (memory-mapped files matched by a glob, or one
// in-memory vector) whose every token has been checked against the model's vocabulary
// once, up front: an id >= vocab would otherwise index past the embedding table, which
// is a crash on a GPU and silent garbage on a CPU. Shards keep their stored width (uint16
// or uint32, and one dataset may mix them); the loader hands out int32 ids either way,
// which the check makes safe (every id is below a vocabulary that is an int).
//
// DataLoader draws global batches of whole sequences (T+1 tokens each), in order or in a
// seeded permutation per epoch, and splits each among the data-parallel ranks and the
// micro-batches of a step, as Megatron's sampler does: a training run is a pure function
// of (data, T, global batch, seed), whatever the layout, and its position is two
// numbers (an epoch, the sequences read of it). In order and one micro-batch per step it
// reads llm.c's consecutive B*T+1 token windows, so N ranks with batch B see exactly the
// rows one rank with batch N*B sees.
//
// The embedded corpus is the Debian `fortunes` package: a few MB of varied English that
// is on most Debian machines already, so the example trainer runs with no download.
#pragma once

#include <glob.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "llmpar/config.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/core/rng.hpp"
#include "llmpar/core/tensor.hpp"
#include "llmpar/data/shard.hpp"
#include "llmpar/data/tokenizer.hpp"

namespace llmpar::data {

namespace detail {

// Index of the first token >= vocab_size, or -1. A max-reduction runs first because it
// vectorises, so checking a large shard costs about one pass over its pages. Compared as
// unsigned 64-bit: a uint32 id above INT32_MAX is out of every vocabulary, not negative.
template <class Token>
std::int64_t first_out_of_vocab(std::span<const Token> tokens, int vocab_size) {
  static_assert(std::is_unsigned_v<Token>, "shard tokens are unsigned ids");
  const auto vocab = static_cast<std::uint64_t>(vocab_size);
  Token max_id = 0;
  for (const Token t : tokens) max_id = std::max(max_id, t);
  if (static_cast<std::uint64_t>(max_id) < vocab) return -1;
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (static_cast<std::uint64_t>(tokens[i]) >= vocab) return static_cast<std::int64_t>(i);
  return -1;
}

inline std::int64_t first_out_of_vocab(TokenView tokens, int vocab_size) {
  return tokens.visit([vocab_size](auto t) { return first_out_of_vocab(t, vocab_size); });
}

// "data/fineweb_train_*.bin" -> "data/fineweb", so the hint names the right prepare_data.
inline std::string prefix_of_pattern(std::string_view pattern) {
  for (std::string_view split : {"_train", "_val"}) {
    const std::size_t at = pattern.rfind(split);
    if (at != std::string_view::npos && pattern.find('/', at) == std::string_view::npos)
      return std::string(pattern.substr(0, at));
  }
  return "PREFIX";
}

// Matches in byte order: glob(3)'s own sort follows the locale's collation, and the
// shard order must not depend on the user's LANG.
inline std::vector<std::string> glob_sorted(const std::string& pattern) {
  glob_t matches{};
  const int rc = ::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &matches);
  std::vector<std::string> paths;
  if (rc == 0)
    for (std::size_t i = 0; i < matches.gl_pathc; ++i) paths.emplace_back(matches.gl_pathv[i]);
  ::globfree(&matches);
  LLMPAR_CHECK(rc == 0 || rc == GLOB_NOMATCH, "cannot expand shard pattern '", pattern, "' (glob error ", rc, ")");
  std::sort(paths.begin(), paths.end());
  return paths;
}

}  // namespace detail

// An ordered list of token shards, every token checked to be < vocab_size. Move-only;
// the token views it hands out stay valid for its lifetime.
class TokenDataset {
 public:
  // Every file matching the glob `pattern`, in byte order of their paths.
  static TokenDataset from_shards(const std::string& pattern, int vocab_size) {
    TokenDataset ds(vocab_size);
    const std::vector<std::string> paths = detail::glob_sorted(pattern);
    const std::string prefix = detail::prefix_of_pattern(pattern);
    LLMPAR_CHECK(!paths.empty(), "no shard matches '", pattern, "'; run `prepare_data --out ", prefix,
                 " FILE...` (or `prepare_data --out ", prefix, " --fortunes`) to create shards");
    for (const std::string& path : paths) {
      TokenShard shard(path);
      const TokenView tokens = shard.view();  // stable across the move below
      ds.mapped_.push_back(std::move(shard));
      ds.add_part(path, tokens);
    }
    return ds;
  }

  // One in-memory shard (the embedded corpus, tests); `name` appears in error messages.
  static TokenDataset from_tokens(std::vector<std::uint16_t> tokens, int vocab_size,
                                  std::string name = "in-memory tokens") {
    TokenDataset ds(vocab_size);
    ds.owned_ = std::move(tokens);
    ds.add_part(std::move(name), std::span<const std::uint16_t>(ds.owned_));
    return ds;
  }

  TokenDataset(TokenDataset&&) noexcept = default;
  TokenDataset& operator=(TokenDataset&&) noexcept = default;
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  int vocab_size() const { return vocab_size_; }
  std::size_t num_shards() const { return parts_.size(); }
  TokenView shard(std::size_t i) const { return parts_.at(i); }
  const std::string& shard_name(std::size_t i) const { return names_.at(i); }
  std::int64_t num_tokens() const {
    std::int64_t n = 0;
    for (const auto& p : parts_) n += static_cast<std::int64_t>(p.size());
    return n;
  }

 private:
  explicit TokenDataset(int vocab_size) : vocab_size_(vocab_size) {
    LLMPAR_CHECK(vocab_size >= 1, "vocab_size ", vocab_size, " is out of range; it must be at least 1");
  }

  void add_part(std::string name, TokenView tokens) {
    const std::int64_t bad = detail::first_out_of_vocab(tokens, vocab_size_);
    LLMPAR_CHECK(bad < 0, "'", name, "' holds token id ", tokens[static_cast<std::size_t>(bad)], " at position ", bad,
                 ", but the vocab size is ", vocab_size_,
                 "; the data was tokenized with a different tokenizer — regenerate it with the model's tokenizer, "
                 "or set the model's vocab size to at least the tokenizer's");
    names_.push_back(std::move(name));
    parts_.push_back(tokens);
  }

  int vocab_size_ = 0;
  std::vector<TokenShard> mapped_;
  std::vector<std::uint16_t> owned_;  // moving a vector keeps its buffer, so parts_ stay valid
  std::vector<std::string> names_;
  std::vector<TokenView> parts_;
};

struct LoaderConfig {
  int batch_size = 0;             // B: rows per micro-batch on this rank
  int seq_len = 0;                // T: tokens per row
  int rank = 0;                   // this rank's index among the data-parallel ranks
  int world = 1;                  // number of data-parallel ranks reading the dataset together
  std::int64_t global_batch = 0;  // G: sequences per optimizer step over every rank (0: B * world)
  bool shuffle = false;           // visit the sequences in a permuted order, new every epoch
  std::uint64_t seed = 0;         // of that order (the same on every rank)
};

// Where the loader will read next: enough to resume a run exactly from a checkpoint, at
// this layout or any other with the same T (and a global batch that divides `consumed`).
struct LoaderState {
  std::int64_t epoch = 0;     // completed passes over the dataset
  std::int64_t consumed = 0;  // sequences of this epoch's order the world has read
  std::int64_t seq_len = 0;   // T of the loader that saved it (0: not checked)
  friend bool operator==(const LoaderState&, const LoaderState&) = default;
};

struct Batch {
  View<const std::int32_t> inputs;   // (B,T)
  View<const std::int32_t> targets;  // (B,T): targets[b][t] = the token after inputs[b][t]
};

// Batches of one rank's rows, in an order that is a function of the data, the seed and
// T alone (Megatron's sampler: draw global batches, then split them), so that every
// layout, micro-batch size and accumulation of one global batch trains on the same
// sequences in the same order, and a checkpoint resumes exactly at any layout.
//
// The dataset is a list of sequences: shard s holds floor((n_s - 1) / T) of them, the
// k-th being tokens [k T, k T + T] (T inputs, and the token after each as its target),
// and the list runs shard after shard. An epoch visits them in order, or with shuffle in
// a permutation drawn from (seed, epoch) (rng::Permutation: computed, never stored);
// step g of the epoch reads positions [g G, g G + G) of that order, and micro-batch m of
// it gives rank r the B positions starting at g G + m (world B) + r B. The sequences
// after the epoch's last whole global batch are not read that epoch. In order and with
// one micro-batch per step this is llm.c's loader: consecutive B*T+1 token windows.
class DataLoader {
 public:
  DataLoader(const TokenDataset& data, LoaderConfig config) : data_(&data), config_(config) {
    LLMPAR_CHECK(config.batch_size >= 1, "LoaderConfig.batch_size is ", config.batch_size,
                 "; it must be >= 1 (rows per batch on each rank)");
    LLMPAR_CHECK(config.seq_len >= 1, "LoaderConfig.seq_len is ", config.seq_len, "; it must be >= 1 (tokens per row)");
    LLMPAR_CHECK(config.world >= 1, "LoaderConfig.world is ", config.world,
                 "; it must be >= 1 (the number of data-parallel ranks)");
    LLMPAR_CHECK(config.rank >= 0 && config.rank < config.world, "LoaderConfig.rank is ", config.rank,
                 "; it must be in [0, world) = [0, ", config.world, ")");
    LLMPAR_CHECK(config.global_batch >= 0, "LoaderConfig.global_batch is ", config.global_batch,
                 "; give a number of sequences, or 0 for batch_size x world");
    LLMPAR_CHECK(data.num_shards() >= 1, "the dataset has no shards");
    rows_ = static_cast<std::int64_t>(config.batch_size) * config.world;
    const std::int64_t T = config.seq_len;
    std::int64_t total = 0;
    for (std::size_t i = 0; i < data.num_shards(); ++i) {
      first_.push_back(total);
      total += (static_cast<std::int64_t>(data.shard(i).size()) - 1) / T;
    }
    sequences_ = total;
    set_global_batch(config.global_batch > 0 ? config.global_batch : rows_);
    inputs_.resize(static_cast<std::int64_t>(config.batch_size) * T);
    targets_.resize(static_cast<std::int64_t>(config.batch_size) * T);
    draw_order();
  }
  // The loader keeps a pointer to the dataset, so a temporary one would dangle.
  DataLoader(TokenDataset&&, LoaderConfig) = delete;

  // The next micro-batch. The views point into the loader's buffers and are valid until
  // the next call to next().
  Batch next() {
    const std::int64_t T = config_.seq_len;
    const std::int64_t first = state_.consumed + static_cast<std::int64_t>(config_.rank) * config_.batch_size;
    std::int32_t* LLMPAR_RESTRICT in = inputs_.data();
    std::int32_t* LLMPAR_RESTRICT tgt = targets_.data();
    for (std::int64_t b = 0; b < config_.batch_size; ++b) {
      const std::pair<std::size_t, std::int64_t> at = sequence(first + b);
      data_->shard(at.first).visit([&](auto tokens) {
        const auto* src = tokens.data() + at.second;  // uint16 or uint32, each < vocab_size
        for (std::int64_t t = 0; t < T; ++t) {
          in[b * T + t] = static_cast<std::int32_t>(src[t]);
          tgt[b * T + t] = static_cast<std::int32_t>(src[t + 1]);
        }
      });
    }
    state_.consumed += rows_;
    if (state_.consumed == epoch_length_) {
      state_.consumed = 0;
      ++state_.epoch;
      draw_order();
    }
    const Shape shape{config_.batch_size, config_.seq_len};
    return {inputs_.view(shape), targets_.view(shape)};
  }

  // The sequences of one optimizer step over every rank: LoaderConfig::global_batch, or
  // (where that is 0) batch_size x world until the trainer sets it to micro-batch x dp x
  // accumulation. It decides where an epoch ends (after its last whole global batch).
  std::int64_t global_batch() const { return step_; }
  void set_global_batch(std::int64_t sequences) {
    LLMPAR_CHECK(config_.global_batch == 0 || config_.global_batch == sequences, "the loader draws global batches of ",
                 config_.global_batch, " sequences (LoaderConfig::global_batch) but a step reads ", sequences,
                 "; leave LoaderConfig::global_batch 0 (the trainer sets it) or set it to ", sequences);
    LLMPAR_CHECK(sequences >= 1 && sequences % rows_ == 0, "LoaderConfig.global_batch is ", sequences,
                 " sequences, not a multiple of batch_size ", config_.batch_size, " x world ", config_.world, " = ",
                 rows_, " (the sequences one micro-batch reads over the data-parallel ranks)");
    LLMPAR_CHECK(state_.consumed % sequences == 0, "the loader is ", state_.consumed,
                 " sequences into an epoch, not at the start of a global batch of ", sequences);
    const std::int64_t length = sequences_ / sequences * sequences;
    LLMPAR_CHECK(length > 0, "the dataset holds ", sequences_, " sequences of T=", config_.seq_len,
                 " tokens (plus the one after), too few for one global batch of ", sequences,
                 " sequences (batch size B=", config_.batch_size, " x world ", config_.world, " x ", sequences / rows_,
                 " micro-batches); use a smaller batch or sequence length, or more data (",
                 (sequences * config_.seq_len + 1), " tokens are needed)");
    step_ = sequences;
    epoch_length_ = length;
  }

  // Back to the first batch, epoch 0.
  void reset() { restore({}); }
  std::int64_t epoch() const { return state_.epoch; }
  const LoaderConfig& config() const { return config_; }
  // Micro-batches in one pass over the dataset (every rank gets the same number).
  std::int64_t batches_per_epoch() const { return epoch_length_ / rows_; }

  LoaderState state() const {
    LoaderState s = state_;
    s.seq_len = config_.seq_len;
    return s;
  }
  // Resumes at a state from state(): of a loader with the same data and T, at any layout
  // whose global batch divides the sequences the saved run had read of its epoch.
  void restore(LoaderState s) {
    LLMPAR_CHECK(s.seq_len == 0 || s.seq_len == config_.seq_len,
                 "loader state was saved with sequences of T=", s.seq_len,
                 " tokens but this loader reads T=", config_.seq_len,
                 "; resume with the checkpoint's sequence length (--seq ", s.seq_len, ")");
    LLMPAR_CHECK(s.epoch >= 0, "loader state epoch ", s.epoch, " is negative");
    LLMPAR_CHECK(s.consumed >= 0 && s.consumed < epoch_length_, "loader state is ", s.consumed,
                 " sequences into an epoch, but this loader's epoch is ", epoch_length_,
                 " sequences; resume with the data and sequence length of the checkpoint");
    LLMPAR_CHECK(s.consumed % step_ == 0, "loader state is ", s.consumed,
                 " sequences into an epoch, which is not a whole number of this run's global batches of ", step_,
                 "; resume with a global batch that divides ", s.consumed, " (the checkpoint's, for one)");
    state_ = {.epoch = s.epoch, .consumed = s.consumed};
    draw_order();
  }

  // The state of a checkpoint written before the data order was a function of T and the
  // seed alone (LoaderState was a shard, a window of `window_tokens` = world*B*T tokens
  // in it, and an epoch). In order, its position is a sequence of the new order; a
  // shuffled one permuted windows of world*B*T, an order no longer drawn.
  LoaderState from_windows(std::int64_t shard, std::int64_t window, std::int64_t epoch, std::int64_t window_tokens,
                           bool shuffled) const {
    const std::int64_t T = config_.seq_len;
    LLMPAR_CHECK(!shuffled,
                 "the checkpoint's data order shuffled windows of world x B x T tokens, an order llmpar "
                 "no longer draws (the order is now a function of the seed and T alone, the same at every "
                 "layout), so it cannot resume exactly; start a new run");
    LLMPAR_CHECK(shard >= 0 && static_cast<std::size_t>(shard) < data_->num_shards() && window >= 0 &&
                     window_tokens > 0 && window_tokens % T == 0,
                 "the checkpoint's loader position (shard ", shard, ", window ", window, " of ", window_tokens,
                 " tokens) does not fit this data and T=", T, "; resume with the checkpoint's data and --seq");
    return {.epoch = epoch,
            .consumed = first_[static_cast<std::size_t>(shard)] + window * (window_tokens / T),
            .seq_len = T};
  }

 private:
  // The shard and the offset in it of the first token of the sequence at `position` of
  // this epoch's order.
  std::pair<std::size_t, std::int64_t> sequence(std::int64_t position) const {
    const std::int64_t q =
        order_ ? static_cast<std::int64_t>(order_->at(static_cast<std::uint64_t>(position))) : position;
    const auto shard = static_cast<std::size_t>(std::upper_bound(first_.begin(), first_.end(), q) - first_.begin() - 1);
    return {shard, (q - first_[shard]) * config_.seq_len};
  }

  // This epoch's order: a permutation of every sequence keyed by (seed, epoch), the same
  // on every rank (no communication) and whatever the batch sizes.
  void draw_order() {
    order_.reset();
    if (!config_.shuffle) return;
    order_.emplace(static_cast<std::uint64_t>(sequences_),
                   rng::mix64(config_.seed ^ rng::mix64(static_cast<std::uint64_t>(state_.epoch) + 0x5eed)));
  }

  const TokenDataset* data_;
  LoaderConfig config_;
  std::int64_t rows_ = 0;                  // world * B: the sequences one micro-batch reads over the ranks
  std::int64_t step_ = 0;                  // G: the sequences one optimizer step reads
  std::int64_t epoch_length_ = 0;          // the whole global batches of an epoch, in sequences
  std::int64_t sequences_ = 0;             // in the dataset
  std::vector<std::int64_t> first_;        // index of each shard's first sequence
  LoaderState state_;                      // (its seq_len is filled by state())
  std::optional<rng::Permutation> order_;  // this epoch's order; empty: in order
  Buffer<std::int32_t> inputs_;            // (B,T)
  Buffer<std::int32_t> targets_;           // (B,T)
};

// ---------------------------------------------------------------------------------------
// The embedded text corpus.

inline constexpr const char* kDefaultFortunesDir = "/usr/share/games/fortunes";

// Token streams for training and validation, and what they were made from.
struct TextCorpus {
  std::vector<std::uint16_t> train;
  std::vector<std::uint16_t> val;
  int vocab_size = 0;                        // of the tokenizer that made train and val
  std::vector<std::filesystem::path> files;  // the files read, in order
  std::int64_t documents = 0;                // fortunes (or files) read
  std::int64_t val_documents = 0;            // of which went to validation
};

namespace detail {

inline void check_val_fraction(double val_fraction) {
  LLMPAR_CHECK(val_fraction >= 0.0 && val_fraction < 1.0, "val_fraction ", val_fraction,
               " is out of range; it must be in [0, 1) (0.1 keeps a tenth of the text for validation)");
}

inline std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  LLMPAR_CHECK(in.is_open(), "cannot open text file '", path.string(), "'; check that it exists and is readable");
  std::string text;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) text.append(chunk, static_cast<std::size_t>(in.gcount()));
  LLMPAR_CHECK(in.eof(), "error reading text file '", path.string(), "'");
  return text;
}

template <class Tok>
void append_tokens(std::vector<std::uint16_t>& out, const Tok& tokenizer, std::string_view text) {
  const std::vector<std::uint16_t> ids = tokenizer.encode(text);
  out.insert(out.end(), ids.begin(), ids.end());
}

// Plain-text fortune files of a directory: regular files without an extension (the
// *.dat files are strfile's binary indexes, *.u8 are links to the same text), sorted.
inline std::vector<std::filesystem::path> fortune_files(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const std::string hint =
      "; install the default corpus with `apt-get install fortunes`, or pass --data with your own token shards";
  std::error_code ec;
  LLMPAR_CHECK(fs::is_directory(dir, ec), "fortune directory '", dir.string(), "' does not exist", hint);
  std::vector<fs::path> files;
  fs::directory_iterator it(dir, ec);
  LLMPAR_CHECK(!ec, "cannot list fortune directory '", dir.string(), "': ", ec.message());
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    LLMPAR_CHECK(!ec, "cannot list fortune directory '", dir.string(), "': ", ec.message());
    const fs::path& p = it->path();
    const std::string name = p.filename().string();
    if (name.empty() || name.front() == '.' || p.has_extension()) continue;
    const fs::file_status st = it->symlink_status(ec);
    if (ec || !fs::is_regular_file(st)) continue;  // links, directories (e.g. off/), devices
    files.push_back(p);
  }
  std::sort(files.begin(), files.end());
  LLMPAR_CHECK(!files.empty(), "fortune directory '", dir.string(),
               "' has no fortune files (plain-text files without an extension)", hint);
  return files;
}

// Whether document i of a stream goes to validation: floor((i+1)f) > floor(if) picks
// floor(n*f) of n documents, spread evenly (f = 0.1: documents 9, 19, 29, ...).
inline bool is_val_document(std::int64_t i, double val_fraction) {
  return std::floor(static_cast<double>(i + 1) * val_fraction) > std::floor(static_cast<double>(i) * val_fraction);
}

}  // namespace detail

// The fortunes in `dir`, tokenized. Files are read in name order; each fortune (the text
// between "%" lines) is followed by a blank line, so the "%" separators become blank
// lines. The split is by whole fortunes, interleaved: fortune i (counted across all
// files) goes to validation when floor((i+1)*val_fraction) > floor(i*val_fraction),
// i.e. every 10th fortune for 0.1. Whole fortunes keep a joke from being half in train
// and half in validation; interleaving gives validation the same mix of topics as
// training, where a tail split would validate only on the alphabetically last files.
template <Tokenizer Tok = ByteTokenizer>
TextCorpus load_text_corpus(const std::filesystem::path& dir = kDefaultFortunesDir, double val_fraction = 0.1,
                            const Tok& tokenizer = Tok{}) {
  detail::check_val_fraction(val_fraction);
  TextCorpus corpus;
  corpus.vocab_size = tokenizer.vocab_size();
  corpus.files = detail::fortune_files(dir);
  std::string doc;
  for (const auto& file : corpus.files) {
    const std::string text = detail::read_text_file(file);
    const std::string_view s = text;
    std::size_t start = 0;  // of the current fortune
    std::size_t pos = 0;    // of the current line
    while (start < s.size()) {
      const std::size_t eol = s.find('\n', pos);
      const std::size_t line_end = eol == std::string_view::npos ? s.size() : eol;
      const std::size_t next = eol == std::string_view::npos ? s.size() : eol + 1;
      const std::string_view line = s.substr(pos, line_end - pos);
      const bool separator = line == "%" || line == "%\r";
      if (!separator && next < s.size()) {
        pos = next;
        continue;
      }
      // A fortune ends at a separator line or at the end of the file.
      const std::string_view body = s.substr(start, (separator ? pos : s.size()) - start);
      start = pos = next;
      if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) continue;  // empty
      doc.assign(body);
      if (doc.back() != '\n') doc += '\n';
      doc += '\n';
      const bool val = detail::is_val_document(corpus.documents++, val_fraction);
      corpus.val_documents += val ? 1 : 0;
      detail::append_tokens(val ? corpus.val : corpus.train, tokenizer, doc);
    }
  }
  LLMPAR_CHECK(val_fraction == 0.0 || !corpus.val.empty(), "val_fraction ", val_fraction, " of the ", corpus.documents,
               " fortunes in '", dir.string(),
               "' leaves the validation split empty; raise val_fraction or add fortune files");
  return corpus;
}

// Text files for prepare_data, tokenized. Each file is split on its own: its last
// val_fraction of bytes, from the line start nearest that cut, goes to validation (a tail
// split, as nanoGPT's shakespeare_char does), so every file is represented in both.
// Bytes are kept as they are; files are concatenated in the order given.
template <Tokenizer Tok = ByteTokenizer>
TextCorpus load_text_files(std::span<const std::filesystem::path> files, double val_fraction = 0.1,
                           const Tok& tokenizer = Tok{}) {
  detail::check_val_fraction(val_fraction);
  TextCorpus corpus;
  corpus.vocab_size = tokenizer.vocab_size();
  for (const auto& file : files) {
    const std::string text = detail::read_text_file(file);
    const std::size_t val_bytes = static_cast<std::size_t>(static_cast<double>(text.size()) * val_fraction);
    const std::size_t exact = text.size() - val_bytes;
    std::size_t cut = exact;
    if (val_bytes > 0 && exact > 0) {
      // The line start nearest the exact cut that leaves both splits non-empty.
      const std::size_t before = text.rfind('\n', exact - 1);
      const std::size_t after = text.find('\n', exact - 1);
      const bool has_before = before != std::string::npos;
      const bool has_after = after != std::string::npos && after + 1 < text.size();
      if (has_before && (!has_after || exact - (before + 1) <= after + 1 - exact)) {
        cut = before + 1;
      } else if (has_after) {
        cut = after + 1;
      }
    }
    const std::string_view s = text;
    detail::append_tokens(corpus.train, tokenizer, s.substr(0, cut));
    detail::append_tokens(corpus.val, tokenizer, s.substr(cut));
    corpus.files.push_back(file);
    ++corpus.documents;
    corpus.val_documents += cut < text.size() ? 1 : 0;
  }
  return corpus;
}

// The validation pattern llm.c uses: the train pattern with its last "train" replaced by "val".
inline std::string val_pattern_of(const std::string& train) {
  const auto pos = train.rfind("train");
  LLMPAR_CHECK(pos != std::string::npos, "cannot derive validation shards from --data '", train,
               "' (it does not contain 'train'); name the training shards PREFIX_train*.bin (train_gpt also ",
               "takes --val-data)");
  return train.substr(0, pos) + "val" + train.substr(pos + 5);
}

// Entropy in nats of the tokens' unigram (for bytes: byte) frequencies; 0 for no tokens.
// It is the loss of the best model that ignores context, so a trainer prints it next to
// the loss: a loss below it shows the model is using context.
inline double unigram_entropy(std::span<const std::uint16_t> tokens) {
  if (tokens.empty()) return 0.0;
  std::vector<std::uint64_t> counts(65536, 0);
  for (const std::uint16_t t : tokens) ++counts[t];
  const double n = static_cast<double>(tokens.size());
  double h = 0.0;
  for (const std::uint64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / n;
    h -= p * std::log(p);
  }
  return h;
}

// Loss in nats on `val` of the bigram table of `train`: p(b | a) = (count(a, b) + p(b)) /
// (count(a) + 1), the unigram frequency p(b) of train standing in for pairs train never
// had. It is what a model knowing only the previous token can reach, so a model whose
// loss is not below it has learned no longer context yet. 0 for fewer than 2 val tokens.
inline double bigram_cross_entropy(std::span<const std::uint16_t> train, std::span<const std::uint16_t> val) {
  if (val.size() < 2) return 0.0;
  LLMPAR_CHECK(!train.empty(), "bigram cross-entropy: no training tokens to count");
  std::vector<std::uint64_t> unigram(65536, 0);
  std::unordered_map<std::uint32_t, std::uint64_t> pairs;
  std::vector<std::uint64_t> context(65536, 0);
  for (const std::uint16_t t : train) ++unigram[t];
  for (std::size_t i = 0; i + 1 < train.size(); ++i) {
    ++pairs[(static_cast<std::uint32_t>(train[i]) << 16) | train[i + 1]];
    ++context[train[i]];
  }
  const double n = static_cast<double>(train.size());
  double loss = 0.0;
  for (std::size_t i = 0; i + 1 < val.size(); ++i) {
    const auto it = pairs.find((static_cast<std::uint32_t>(val[i]) << 16) | val[i + 1]);
    const double pair = it == pairs.end() ? 0.0 : static_cast<double>(it->second);
    // A token train never had gets half a count, so the loss stays finite.
    const double prior = std::max(0.5, static_cast<double>(unigram[val[i + 1]])) / n;
    loss -= std::log((pair + prior) / (static_cast<double>(context[val[i]]) + 1.0));
  }
  return loss / static_cast<double>(val.size() - 1);
}

}  // namespace llmpar::data
