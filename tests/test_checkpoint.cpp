// Checkpoints (checkpoint/checkpoint.hpp): a run stopped after step k and resumed continues
// bit for bit at the same layout and within 1e-5 at any other (thread ranks; tp, pp, v,
// dp, ZeRO 0-3 and precision all changed); the commit is atomic (a kill -9 at random
// points of 20 saves always leaves `latest` naming a complete checkpoint); every bad
// file is an error naming it and the problem, and a fuzz of the metadata and the shard
// headers never crashes. The loss spike guard, which restores through the same path, is
// test_spike_guard.cpp.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "data_parallel_test_util.hpp"
#include "llmpar/checkpoint/checkpoint.hpp"
#include "llmpar/checkpoint/trainer_state.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/core/rng.hpp"

using namespace llmpar;
namespace fs = std::filesystem;
namespace ck = checkpoint;

namespace {

template <int kStage = 0, class Precision = precision::FP32>
using Layout = Compose<backend::Cpu, Precision, parallel::Pipeline<schedule::Configured>,
                       parallel::Data<zero::Stage<kStage>>, recompute::Configured>;
template <int kStage, class Precision = precision::FP32>
using NoPipe = Compose<backend::Cpu, Precision, parallel::NoPipeline, parallel::Data<zero::Stage<kStage>>>;

// A fresh directory under the test's working directory.
std::string fresh(const std::string& name) {
  fs::remove_all(name);
  fs::create_directories(name);
  return name;
}

// What a resumed run must match: the uninterrupted run's losses after the checkpoint.
void check_continues(const dp_test::Run& resumed, const dp_test::Run& whole, int saved_at, double tolerance) {
  REQUIRE(resumed.losses.size() + static_cast<std::size_t>(saved_at) == whole.losses.size());
  double loss = 0.0, param = 0.0;
  for (std::size_t s = 0; s < resumed.losses.size(); ++s) {
    const double want = whole.losses[s + static_cast<std::size_t>(saved_at)];
    loss = std::max(loss, std::abs(resumed.losses[s] - want) / std::abs(want));
  }
  REQUIRE(resumed.params.size() == whole.params.size());
  for (std::size_t k = 0; k < whole.params.size(); ++k) {
    INFO(whole.names[k]);
    const double d = dp_test::relative_difference(resumed.params[k], whole.params[k]);
    param = std::max(param, d);
    CHECK(d <= tolerance);
  }
  MESSAGE("largest relative differences: losses ", loss, ", parameters ", param);
  CHECK(loss <= tolerance);
}

// The layouts below share one global batch (dp x micro-batch x accum = 8 sequences)
// and one model of 4 layers.
dp_test::Layout base() {
  dp_test::Layout l;
  l.layers = 4;
  l.steps = 6;
  return l;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void dump(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// A snapshot of one tensor (shape 64 x 32) whose values say which step wrote them.
ck::Snapshot pattern(std::int64_t step) {
  ck::Snapshot s;
  s.pieces.push_back({"w", Shape{64, 32}, {}, 0, 64 * 32});
  for (int k = 0; k < 3; ++k)
    for (int i = 0; i < 64 * 32; ++i) s.data[static_cast<std::size_t>(k)].push_back(static_cast<float>(step * 10 + k));
  s.state = {{"step", step}};
  return s;
}
const nlohmann::json kMeta = {{"model", nlohmann::json::object()}, {"layout", nlohmann::json::object()}};

// Saves `pattern` checkpoints on one rank.
void save_patterns(const ck::CheckpointerConfig& cfg, std::int64_t first, std::int64_t last) {
  comm::run_threads(1, [&](comm::ThreadComm& t) {
    comm::Comm world(std::move(t));
    ck::Checkpointer saver(world, cfg);
    for (std::int64_t s = first; s <= last; ++s) saver.save(s, pattern(s), kMeta);
    saver.wait();
  });
}

// The step a pattern checkpoint holds, checked element by element.
std::int64_t read_pattern(const std::string& path) {
  const auto c = ck::Checkpoint::open(path);
  std::vector<float> v(64 * 32);
  for (ck::Kind kind : ck::kKinds) {
    c.source().fill(kind, "w", Shape{64, 32}, {}, 0, 64 * 32, v.data());
    for (float x : v) REQUIRE(x == static_cast<float>(c.step() * 10 + static_cast<int>(kind)));
  }
  return c.step();
}

}  // namespace

TEST_CASE("checkpoint: an element's place in its slice and in the full tensor are inverse") {
  const Shape shapes[] = {{12, 8}, {6, 12}, {3, 4, 6}, {24}};
  for (const Shape& shape : shapes)
    for (int dim = -1; dim < shape.rank; ++dim)
      for (int parts : {1, 2, 3})
        for (int groups : {1, 2, 3}) {
          if (dim >= 0 && shape[dim] % (parts * groups) != 0) continue;
          if (dim < 0 && (parts > 1 || groups > 1)) continue;
          for (int index = 0; index < parts; ++index) {
            const nn::Split split{dim, parts, index, groups};
            const std::int64_t n = nn::local_shape(shape, split).numel();
            for (std::int64_t i = 0; i < n; ++i) {
              const std::int64_t f = nn::full_index(shape, split, i);
              const ck::detail::Local at = ck::detail::local_of(shape, split, f);
              CHECK(at.slice == (split.is_split() ? index : 0));
              CHECK(at.index == i);
              // A run is contiguous in the full tensor.
              const std::int64_t run = ck::detail::run_from(shape, split, i);
              CHECK(run >= 1);
              CHECK(i + run <= n);
              CHECK(nn::full_index(shape, split, i + run - 1) == f + run - 1);
            }
          }
        }
}

TEST_CASE("checkpoint: a run resumed at the same layout continues bit for bit") {
  SUBCASE("one rank") {
    const std::string dir = fresh("ck_serial");
    dp_test::Layout whole = base();
    whole.micro_batch = 8;
    whole.save_dir = dir;
    whole.save_step = 3;
    const auto a = dp_test::run_threads<NoPipe<0>>(1, 1, whole);
    dp_test::Layout resumed = base();
    resumed.micro_batch = 8;
    resumed.resume_from = dir;  // its `latest`
    const auto b = dp_test::run_threads<NoPipe<0>>(1, 1, resumed);
    REQUIRE(b.losses.size() == 3);
    for (std::size_t s = 0; s < 3; ++s) CHECK(b.losses[s] == a.losses[s + 3]);
    for (std::size_t k = 0; k < a.params.size(); ++k) CHECK(b.params[k] == a.params[k]);
  }
  SUBCASE("tp 2 x pp 2 x dp 2, ZeRO 1, saved in the background") {
    const std::string dir = fresh("ck_same8");
    dp_test::Layout whole = base();
    whole.pp = 2;
    whole.accum = 2;
    whole.save_dir = dir;
    whole.save_step = 3;
    whole.background_save = true;
    const auto a = dp_test::run_threads<Layout<1>>(8, 2, whole);
    dp_test::Layout resumed = whole;
    resumed.save_dir.clear();
    resumed.resume_from = dir + "/step_00000003";
    const auto b = dp_test::run_threads<Layout<1>>(8, 2, resumed);
    REQUIRE(b.losses.size() == 3);
    for (std::size_t s = 0; s < 3; ++s) CHECK(b.losses[s] == a.losses[s + 3]);
    for (std::size_t k = 0; k < a.params.size(); ++k) CHECK(b.params[k] == a.params[k]);
    CHECK(b.head_copy_param == a.head_copy_param);
  }
}

TEST_CASE("checkpoint: saved at tp 2 x pp 2 x dp 2 (ZeRO 1), it resumes at other layouts within 1e-5") {
  const std::string dir = fresh("ck_reshard");
  dp_test::Layout saved = base();
  saved.pp = 2;
  saved.accum = 2;
  saved.save_dir = dir;
  saved.save_step = 3;
  const auto whole = dp_test::run_threads<Layout<1>>(8, 2, saved);
  // Every file of the save: 8 shards, the metadata, `latest`.
  CHECK(slurp(dir + "/latest") == "step_00000003\n");
  for (int r = 0; r < 8; ++r) CHECK(fs::exists(dir + "/step_00000003/" + ck::detail::shard_name(r)));
  const auto meta = nlohmann::json::parse(slurp(dir + "/step_00000003/metadata.json"));
  CHECK(meta["layout"]["tp"] == 2);
  CHECK(meta["layout"]["pp"] == 2);
  CHECK(meta["layout"]["dp"] == 2);
  CHECK(meta["layout"]["zero"] == 1);
  CHECK(meta["state"]["step"] == 3);
  CHECK(meta["llmpar_version"] == kVersion);

  dp_test::Layout resume = base();
  resume.resume_from = dir;
  SUBCASE("tp 1 x pp 2 (interleaved, v = 2) x dp 2, ZeRO 1") {
    dp_test::Layout l = resume;
    l.pp = 2;
    l.chunks = 2;
    l.schedule = "interleaved";
    l.accum = 2;
    check_continues(dp_test::run_threads<Layout<1>>(4, 1, l), whole, 3, 1e-5);
  }
  SUBCASE("dp 4, ZeRO 2, one micro-batch of 2 per rank and step") {
    dp_test::Layout l = resume;
    check_continues(dp_test::run_threads<NoPipe<2>>(4, 1, l), whole, 3, 1e-5);
  }
  SUBCASE("tp 2 with sequence parallelism x dp 2, ZeRO 3") {
    dp_test::Layout l = resume;
    l.micro_batch = 4;
    l.sp = true;
    check_continues(dp_test::run_threads<NoPipe<3>>(4, 2, l), whole, 3, 1e-5);
  }
  SUBCASE("one rank, micro-batch 4 x 2") {
    dp_test::Layout l = resume;
    l.micro_batch = 4;
    l.accum = 2;
    check_continues(dp_test::run_threads<NoPipe<0>>(1, 1, l), whole, 3, 1e-5);
  }
}

TEST_CASE("checkpoint: bf16 saved at tp 2 x pp 2 x dp 2 resumes on one rank, and in fp32") {
  const std::string dir = fresh("ck_bf16");
  dp_test::Layout saved = base();
  saved.pp = 2;
  saved.accum = 2;
  saved.save_dir = dir;
  saved.save_step = 3;
  const auto whole = dp_test::run_threads<Layout<1, precision::BF16Mixed>>(8, 2, saved);
  dp_test::Layout l = base();
  l.resume_from = dir;
  l.micro_batch = 8;
  // bf16 activations at another layout round differently: 2e-2 on the losses and
  // parameters.
  check_continues(dp_test::run_threads<NoPipe<0, precision::BF16Mixed>>(1, 1, l), whole, 3, 2e-2);
  // The f32 master weights continue in fp32 just as well.
  check_continues(dp_test::run_threads<NoPipe<0>>(1, 1, l), whole, 3, 2e-2);
}

TEST_CASE("checkpoint: saving is atomic, keeps the newest K, and replaces a step saved before") {
  const std::string dir = fresh("ck_atomic");
  fs::create_directories(dir + "/step_00000009.tmp.12345");  // a save that crashed
  save_patterns({.dir = dir, .keep = 2}, 1, 5);
  CHECK(!fs::exists(dir + "/step_00000009.tmp.12345"));
  CHECK(ck::saved_steps(dir) == std::vector<std::int64_t>{4, 5});
  CHECK(slurp(dir + "/latest") == "step_00000005\n");
  CHECK(read_pattern(dir) == 5);
  CHECK(read_pattern(dir + "/step_00000004") == 4);
  // Saving step 5 again (a run resumed from step 4) replaces it; in the background too.
  save_patterns({.dir = dir, .keep = 0, .background = true}, 5, 6);
  CHECK(ck::saved_steps(dir) == std::vector<std::int64_t>{4, 5, 6});
  CHECK(read_pattern(dir) == 6);
  // A directory without metadata is never a checkpoint.
  fs::create_directories(dir + "/step_00000007");
  CHECK(ck::saved_steps(dir) == std::vector<std::int64_t>{4, 5, 6});
  CHECK_THROWS_WITH_AS(ck::Checkpoint::open(dir + "/step_00000007"), doctest::Contains("has no metadata.json"), Error);
}

TEST_CASE("checkpoint: kill -9 at random points of saving always leaves `latest` complete") {
  const std::string dir = fresh("ck_kill");
  save_patterns({.dir = dir}, 1, 1);
  const rng::Stream stream(2024);
  std::int64_t newest = 1;
  for (int trial = 0; trial < 20; ++trial) {
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      // Saves steps newest+1, newest+2, ... as fast as it can until killed.
      try {
        save_patterns({.dir = dir, .keep = 3}, newest + 1, newest + 100000);
      } catch (...) {
      }
      _exit(0);
    }
    const auto delay = std::chrono::microseconds(stream.bits(static_cast<std::uint64_t>(trial))[0] % 200000);
    std::this_thread::sleep_for(delay);
    kill(child, SIGKILL);
    int status = 0;
    waitpid(child, &status, 0);
    // `latest` names a complete checkpoint, at least as new as the last one seen.
    const std::int64_t step = read_pattern(dir);
    CHECK(step >= newest);
    newest = step;
    for (std::int64_t s : ck::saved_steps(dir)) CHECK(read_pattern(dir + "/" + ck::detail::step_name(s)) == s);
  }
  MESSAGE("20 kills; the last complete checkpoint was step ", newest);
  CHECK(newest > 1);
}

TEST_CASE("checkpoint: every bad file is an error naming the file and the problem") {
  const std::string good = fresh("ck_bad_src");
  save_patterns({.dir = good}, 1, 1);
  const std::string step = good + "/step_00000001";
  auto variant = [&](const std::string& name) {
    const std::string d = fresh(name);
    fs::copy(step, d, fs::copy_options::recursive);
    return d;
  };
  auto fails = [](const std::string& path, const char* message) {
    CHECK_THROWS_WITH_AS(
        {
          const auto c = ck::Checkpoint::open(path);
          std::vector<float> v(64 * 32);
          c.source().fill(ck::Kind::param, "w", Shape{64, 32}, {}, 0, 64 * 32, v.data());
        },
        doctest::Contains(message), Error);
  };
  CHECK(read_pattern(step) == 1);
  {
    const std::string d = variant("ck_bad_missing");
    fs::remove(d + "/rank_00000.safetensors");
    fails(d, "shard rank_00000.safetensors is missing");
  }
  {
    const std::string d = variant("ck_bad_truncated");
    fs::resize_file(d + "/rank_00000.safetensors", 1000);
    fails(d, "holds 1000 bytes but metadata.json says");
  }
  {
    const std::string d = variant("ck_bad_json");
    dump(d + "/metadata.json", "{\"format\": \"llmpar-checkpoint\", \"vers");
    fails(d, "ck_bad_json/metadata.json is not a JSON object");
  }
  {
    const std::string d = variant("ck_bad_foreign");
    dump(d + "/metadata.json", "{\"format\": \"megatron\", \"version\": 1}");
    fails(d, "is not an llmpar checkpoint (format 'megatron')");
  }
  {
    const std::string d = variant("ck_bad_version");
    auto m = nlohmann::json::parse(slurp(d + "/metadata.json"));
    m["version"] = 99;
    dump(d + "/metadata.json", m.dump());
    fails(d, "has checkpoint format version 99");
  }
  {
    const std::string d = variant("ck_bad_fields");
    auto m = nlohmann::json::parse(slurp(d + "/metadata.json"));
    m.erase("state");
    dump(d + "/metadata.json", m.dump());
    fails(d, "'state' is missing or not an object");
  }
  {
    // A shard of another save (same step, another run).
    const std::string other = fresh("ck_bad_other_src");
    save_patterns({.dir = other}, 1, 1);
    const std::string d = variant("ck_bad_mixed");
    fs::copy_file(other + "/step_00000001/rank_00000.safetensors", d + "/rank_00000.safetensors",
                  fs::copy_options::overwrite_existing);
    fails(d, "mixes files of two saves");
  }
  {
    const std::string d = fresh("ck_bad_latest");
    dump(d + "/latest", "../../etc\n");
    fails(d, "which is not a step_N directory");
  }
  fails("ck_no_such_dir", "ck_no_such_dir does not exist");
  // The model asks for what the checkpoint cannot give.
  const auto c = ck::Checkpoint::open(step);
  std::vector<float> v(64 * 64);
  CHECK_THROWS_WITH_AS(c.source().fill(ck::Kind::param, "w", Shape{64, 64}, {}, 0, 64 * 64, v.data()),
                       doctest::Contains("'w' has shape (64,32) in the checkpoint but (64,64) in the model"), Error);
  CHECK_THROWS_WITH_AS(c.source().fill(ck::Kind::param, "h.0.ln_1.weight", Shape{32}, {}, 0, 32, v.data()),
                       doctest::Contains("has no tensor 'h.0.ln_1.weight'"), Error);
  // A piece missing: half of a tensor's slice stored.
  ck::Snapshot half;
  half.pieces.push_back({"w", Shape{8, 4}, {0, 2, 0, 1}, 0, 8});
  for (auto& d : half.data) d.assign(8, 1.0f);
  const ck::Source source = ck::Source::of(half);
  CHECK_THROWS_WITH_AS(source.fill(ck::Kind::param, "w", Shape{8, 4}, {}, 0, 32, v.data()),
                       doctest::Contains("no stored piece holds element 8 of slice 0 of tensor 'w'"), Error);
  CHECK_NOTHROW(source.fill(ck::Kind::param, "w", Shape{8, 4}, {}, 0, 8, v.data()));
}

TEST_CASE("checkpoint: flipped bytes and truncations of the metadata and shard headers never crash") {
  const std::string good = fresh("ck_fuzz_src");
  save_patterns({.dir = good}, 1, 1);
  const std::string step = good + "/step_00000001";
  const std::string meta = slurp(step + "/metadata.json");
  const std::string shard = slurp(step + "/rank_00000.safetensors");
  std::uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | static_cast<unsigned char>(shard[static_cast<std::size_t>(i)]);
  const std::string d = fresh("ck_fuzz");
  const rng::Stream stream(77);
  int loaded = 0, refused = 0;
  for (std::uint64_t trial = 0; trial < 400; ++trial) {
    const rng::Counter r = stream.bits(trial);
    std::string m = meta, s = shard;
    std::string& target = r[0] % 2 == 0 ? m : s;
    const std::size_t span = &target == &m ? m.size() : static_cast<std::size_t>(8 + header);
    if (r[1] % 5 == 0) {
      target.resize(r[2] % span);
    } else {
      for (int k = 0; k < 1 + static_cast<int>(r[1] % 4); ++k)
        target[(r[2] + 7919u * static_cast<unsigned>(k)) % span] ^= static_cast<char>(1u << (r[3] % 8));
    }
    dump(d + "/metadata.json", m);
    dump(d + "/rank_00000.safetensors", s);
    try {
      const auto c = ck::Checkpoint::open(d);
      std::vector<float> v(64 * 32);
      for (ck::Kind kind : ck::kKinds) c.source().fill(kind, "w", Shape{64, 32}, {}, 0, 64 * 32, v.data());
      ++loaded;
    } catch (const Error& e) {
      ++refused;
      CHECK(std::string(e.what()).find("ck_fuzz") != std::string::npos);
    }
  }
  MESSAGE(loaded, " variants loaded (a flip in JSON whitespace), ", refused, " refused by name");
  CHECK(refused > 200);
}

TEST_CASE("checkpoint: a flipped bit in any stored tensor is refused, naming the tensor and the file") {
  // Three tensors of different shapes, each stored as its three kinds: nine tensors.
  ck::Snapshot snap;
  snap.pieces = {{"a", Shape{16, 8}, {}, 0, 128}, {"b", Shape{40}, {}, 0, 40}, {"c", Shape{4, 4, 4}, {}, 0, 64}};
  for (int k = 0; k < 3; ++k)
    for (int i = 0; i < 128 + 40 + 64; ++i) snap.data[static_cast<std::size_t>(k)].push_back(0.25f * i + k);
  snap.state = {{"step", 3}};
  const std::string good = fresh("ck_crc_src");
  comm::run_threads(1, [&](comm::ThreadComm& t) {
    comm::Comm world(std::move(t));
    ck::Checkpointer saver(world, {.dir = good, .background = false});
    saver.save(3, snap, kMeta);
  });
  const std::string step = good + "/step_00000003";
  const std::string shard = slurp(step + "/rank_00000.safetensors");
  std::uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | static_cast<unsigned char>(shard[static_cast<std::size_t>(i)]);
  const auto file = ck::safetensors::File::open(step + "/rank_00000.safetensors");
  const std::vector<std::pair<std::string, Shape>> tensors = {
      {"a", Shape{16, 8}}, {"b", Shape{40}}, {"c", Shape{4, 4, 4}}};
  auto read_all = [&](const std::string& dir) {
    const auto c = ck::Checkpoint::open(dir);
    for (ck::Kind kind : ck::kKinds)
      for (const auto& [name, shape] : tensors) {
        std::vector<float> v(static_cast<std::size_t>(shape.numel()));
        c.source().fill(kind, name, shape, {}, 0, shape.numel(), v.data());
      }
  };
  CHECK_NOTHROW(read_all(step));
  REQUIRE(file.tensors().size() == 9);
  const rng::Stream stream(5);
  int refused = 0;
  for (const ck::safetensors::TensorInfo& t : file.tensors()) {
    INFO(t.name);
    const std::string d = fresh("ck_crc_flip");
    fs::copy(step, d, fs::copy_options::recursive);
    std::string bytes = shard;
    const rng::Counter r = stream.bits(static_cast<std::uint64_t>(refused));
    const std::size_t at = 8 + header + t.begin + r[0] % (t.end - t.begin);
    bytes[at] = static_cast<char>(bytes[at] ^ (1u << (r[1] % 8)));
    dump(d + "/rank_00000.safetensors", bytes);
    const std::string want = "tensor '" + t.name + "' in rank_00000.safetensors does not match its checksum";
    CHECK_THROWS_WITH_AS(read_all(d), doctest::Contains(want.c_str()), Error);
    ++refused;
  }
  CHECK(refused == 9);
}

TEST_CASE("the trainer state round-trips through JSON, and every missing or wrong field is named") {
  const ck::TrainerState t{
      .step = 12,
      .optimizer_steps = 11,
      .loader = {.epoch = 1, .consumed = 40, .seq_len = 64},
      .window_position = std::nullopt,
      .shuffle = true,
      .seed = 7,
      .loss_scaler =
          {.scale = 1024.0f, .good_steps = 3, .hysteresis_left = 1, .skipped = 1, .growths = 2, .backoffs = 4},
      .spike_history = {{10, 2.5}, {11, 2.25}},
      .rollbacks = {9},
      .has_spike_guard = true};
  const nlohmann::json j = t.to_json();
  const ck::TrainerState back = ck::TrainerState::from_json(j, "ck/step_12");
  CHECK(back.step == 12);
  CHECK(back.optimizer_steps == 11);
  CHECK(back.loader == t.loader);
  CHECK_FALSE(back.window_position.has_value());
  CHECK(back.shuffle);
  CHECK(back.seed == 7);
  CHECK(back.loss_scaler.scale == 1024.0f);
  CHECK(back.loss_scaler.good_steps == 3);
  CHECK(back.loss_scaler.hysteresis_left == 1);
  CHECK(back.loss_scaler.skipped == 1);
  CHECK(back.loss_scaler.growths == 2);
  CHECK(back.loss_scaler.backoffs == 4);
  CHECK(back.spike_history == t.spike_history);
  CHECK(back.rollbacks == t.rollbacks);
  CHECK(back.has_spike_guard);
  CHECK(back.to_json() == j);

  // An older checkpoint's window position is kept for the loader to translate.
  nlohmann::json old = j;
  old["loader"] = {{"shard", 2}, {"window", 5}, {"epoch", 0}, {"window_tokens", 65}};
  const ck::TrainerState w = ck::TrainerState::from_json(old, "ck/step_12");
  REQUIRE(w.window_position.has_value());
  CHECK(w.window_position->shard == 2);
  CHECK(w.window_position->window == 5);
  CHECK(w.window_position->window_tokens == 65);
  CHECK_FALSE(w.shuffle);

  const auto refused = [&](const nlohmann::json& bad, const std::string& message) {
    CAPTURE(bad.dump());
    CHECK_THROWS_WITH_AS(ck::TrainerState::from_json(bad, "ck/step_12"), doctest::Contains(message.c_str()), Error);
  };
  nlohmann::json bad = j;
  bad.erase("step");
  refused(bad, "ck/step_12: the trainer state has no count 'step'");
  bad = j;
  bad["optimizer_steps"] = 13;
  refused(bad, "ck/step_12: 13 optimizer updates in 12 steps");
  bad = j;
  bad["loader"]["consumed"] = -1;
  refused(bad, "ck/step_12: the trainer state has no count 'consumed'");
  bad = j;
  bad.erase("loss_scaler");
  refused(bad, "ck/step_12: the trainer state has no 'loader' or 'loss_scaler'");
  bad = j;
  bad["loss_scaler"].erase("scale");
  refused(bad, "ck/step_12: the loss scaler state has no scale");
  bad = j;
  bad["loss_scaler"]["backoffs"] = "four";
  refused(bad, "ck/step_12: the trainer state has no count 'backoffs'");
  bad = j;
  bad["spike_guard"]["history"] = {1, 2};
  refused(bad, "ck/step_12: the spike guard's state is not {history: [[step, loss], ...], rollbacks: [step, ...]}");
  // A state without a spike guard's record resumes a run that has none.
  bad = j;
  bad.erase("spike_guard");
  CHECK_FALSE(ck::TrainerState::from_json(bad, "ck/step_12").has_spike_guard);
}
