// Hugging Face GPT-2 files (checkpoint/hf_gpt2.hpp): a hand-built HF-layout file lands in our
// layout (Conv1D weights transposed, wte padded with zero rows, wpe cut to max_seq), with
// or without the "transformer." prefix, buffers and a tied lm_head, from F32, F16 or
// BF16; what write_gpt2 stores is that file again (HF's names, order and metadata); a
// trained model exported and imported is the same model bit for bit (the same
// validation loss), and at tp 2 within 1e-5; every way a file can disagree with the
// model is an error naming the file, the tensor and the flag that fixes it, and a µP
// model above its base width (an output multiplier HF's GPT-2 lacks) is refused.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "data_parallel_test_util.hpp"
#include "llmpar/checkpoint/checkpoint.hpp"
#include "llmpar/checkpoint/hf_gpt2.hpp"
#include "llmpar/checkpoint/safetensors.hpp"
#include "llmpar/comm/grid.hpp"
#include "llmpar/comm/thread_comm.hpp"

using namespace llmpar;
namespace ck = checkpoint;
namespace hf = checkpoint::hf;

namespace {

// 1 layer, C = 4, 5 tokens padded to 8 rows, 3 positions.
const models::GPT2Config kTiny{.layers = 1, .heads = 2, .dim = 4, .max_seq = 3, .vocab = 5, .padded_vocab = 8};

// A tensor of an HF file: its shape and values (stored as `dtype`).
struct HfTensor {
  std::vector<std::int64_t> shape;
  std::vector<float> values;
};
using HfFile = std::map<std::string, HfTensor>;

std::int64_t numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

// The tensors of an HF GPT-2 of kTiny's size with 6 positions, each element holding
// 1000 * (the tensor's index) + (the element's index): every value says where it was.
// (Integers below 2^11, so F16 and BF16 hold them exactly for the small tensors; see
// write_file.)
HfFile tiny_file() {
  const std::int64_t C = 4;
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes = {
      {"wte.weight", {5, C}},
      {"wpe.weight", {6, C}},
      {"h.0.ln_1.weight", {C}},
      {"h.0.ln_1.bias", {C}},
      {"h.0.attn.c_attn.weight", {C, 3 * C}},
      {"h.0.attn.c_attn.bias", {3 * C}},
      {"h.0.attn.c_proj.weight", {C, C}},
      {"h.0.attn.c_proj.bias", {C}},
      {"h.0.ln_2.weight", {C}},
      {"h.0.ln_2.bias", {C}},
      {"h.0.mlp.c_fc.weight", {C, 4 * C}},
      {"h.0.mlp.c_fc.bias", {4 * C}},
      {"h.0.mlp.c_proj.weight", {4 * C, C}},
      {"h.0.mlp.c_proj.bias", {C}},
      {"ln_f.weight", {C}},
      {"ln_f.bias", {C}},
  };
  HfFile f;
  for (std::size_t k = 0; k < shapes.size(); ++k) {
    HfTensor t{shapes[k].second, {}};
    for (std::int64_t i = 0; i < numel(t.shape); ++i) t.values.push_back(static_cast<float>(1000 * (k + 1) + i));
    f[shapes[k].first] = t;
  }
  return f;
}

// Writes `f` as `path`, every tensor as `dtype`, names prefixed with `prefix`.
void write_file(const std::string& path, const HfFile& f, DType dtype = DType::f32, const std::string& prefix = "") {
  std::vector<std::vector<std::uint16_t>> halves;
  halves.reserve(f.size());
  std::vector<checkpoint::safetensors::TensorRef> refs;
  for (const auto& [name, t] : f) {
    const void* data = t.values.data();
    if (dtype != DType::f32) {
      halves.emplace_back();
      for (float v : t.values) halves.back().push_back(dtype == DType::bf16 ? bf16(v).bits : f16(v).bits);
      data = halves.back().data();
    }
    refs.push_back({prefix + name, dtype, t.shape, data});
  }
  checkpoint::safetensors::write(path, refs, {{"format", "pt"}});
}

// The whole tensor `name` of a source.
std::vector<float> whole(const ck::Source& s, const std::string& name, const Shape& shape) {
  std::vector<float> v(static_cast<std::size_t>(shape.numel()));
  s.fill(ck::Kind::param, name, shape, {}, 0, shape.numel(), v.data());
  return v;
}

// What the hand-built file must read as: its tensors, Conv1D weights transposed, wte
// padded with zero rows, wpe cut to 3 rows.
void check_tiny(const ck::Snapshot& snap, const HfFile& f) {
  REQUIRE(snap.pieces.size() == 16);
  for (const ck::Piece& p : snap.pieces) {
    CHECK(!p.split.is_split());
    CHECK(p.first == 0);
    CHECK(p.n == p.shape.numel());
  }
  // Weights only: no moments, and a Source of it says so when asked for them.
  for (int k = 1; k < 3; ++k) CHECK(snap.data[static_cast<std::size_t>(k)].empty());
  const ck::Source s = ck::Source::of(snap);
  std::vector<float> scratch(4);
  CHECK_THROWS_WITH_AS(s.fill(ck::Kind::exp_avg, "ln_f.weight", Shape{4}, {}, 0, 4, scratch.data()),
                       doctest::Contains("holds no exp_avg (weights only); load it with Trainer::load_weights"), Error);
  // c_attn: HF (in 4, out 12), element [1][7] -> ours (out 12, in 4) at [7][1].
  const std::vector<float> qkv = whole(s, "h.0.attn.c_attn.weight", Shape{12, 4});
  const HfTensor& hf_qkv = f.at("h.0.attn.c_attn.weight");
  CHECK(qkv[7 * 4 + 1] == hf_qkv.values[1 * 12 + 7]);
  CHECK(qkv[1 * 12 + 7] != hf_qkv.values[1 * 12 + 7]);  // not a plain copy
  // Every Conv1D weight, every element.
  for (const auto& [name, out, in] :
       std::vector<std::tuple<std::string, std::int64_t, std::int64_t>>{{"h.0.attn.c_attn.weight", 12, 4},
                                                                        {"h.0.attn.c_proj.weight", 4, 4},
                                                                        {"h.0.mlp.c_fc.weight", 16, 4},
                                                                        {"h.0.mlp.c_proj.weight", 4, 16}}) {
    INFO(name);
    const std::vector<float> w = whole(s, name, Shape{out, in});
    const HfTensor& t = f.at(name);
    REQUIRE(t.shape == std::vector<std::int64_t>{in, out});
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t i = 0; i < in; ++i)
        CHECK(w[static_cast<std::size_t>(o * in + i)] == t.values[static_cast<std::size_t>(i * out + o)]);
  }
  // wte: 5 rows of the file, then 3 zero rows.
  const std::vector<float> wte = whole(s, "wte", Shape{8, 4});
  for (std::size_t i = 0; i < 20; ++i) CHECK(wte[i] == f.at("wte.weight").values[i]);
  for (std::size_t i = 20; i < 32; ++i) CHECK(wte[i] == 0.0f);
  // wpe: the first 3 of the file's 6 rows.
  const std::vector<float> wpe = whole(s, "wpe", Shape{3, 4});
  const std::vector<float>& file_wpe = f.at("wpe.weight").values;
  CHECK(wpe == std::vector<float>(file_wpe.begin(), file_wpe.begin() + 12));
  // Vectors as they are.
  for (const char* name :
       {"h.0.ln_1.weight", "h.0.ln_2.bias", "h.0.attn.c_attn.bias", "h.0.mlp.c_fc.bias", "ln_f.bias"})
    CHECK(whole(s, name, Shape{numel(f.at(name).shape)}) == f.at(name).values);
}

// A tiny GPT-2 of the tests, its loaders and trainer, on one rank or a tp group.
using Serial = train::PolicyOf<models::GPT2<float>>;
using TensorParallel = Compose<backend::Cpu, precision::FP32, parallel::NoPipeline, parallel::Data<zero::Stage<0>>>;
const models::GPT2Config kModel = dp_test::config(2);

const data::TokenDataset& dataset() {
  static const data::TokenDataset d = data::TokenDataset::from_tokens(dp_test::tokens(), 50, "hf tokens");
  return d;
}

template <class Policy>
struct Run {
  backend::cpu::Context ctx;
  models::GPT2<float> model;
  data::DataLoader train;
  train::Trainer<models::GPT2<float>, Policy> trainer;
  explicit Run(std::uint64_t seed, nn::TensorParallelGroup tp = {}, parallel::Groups groups = {})
      : model(kModel, seed, tp),
        train(dataset(), {.batch_size = 4, .seq_len = 16}),
        trainer(ctx, model, {.lr = 1e-2f, .eps = 1e-2f, .weight_decay = 0.1f},
                {.peak_lr = 1e-2f, .warmup_steps = 0, .total_steps = 3}, train, {.steps = 3, .layout = layout(tp)},
                groups) {}
  // Micro-batches of 4 on one rank, or split over the tp group.
  static parallel::LayoutConfig layout(const nn::TensorParallelGroup& tp) {
    parallel::LayoutConfig l = parallel::layout_of<Policy>();
    l.tp = tp.size();
    l.micro_batch = 4;
    return l;
  }
  // The mean loss over the same 3 validation batches every time.
  double validation_loss() {
    data::DataLoader val(dataset(), {.batch_size = 2, .seq_len = 16, .shuffle = true, .seed = 17});
    return trainer.evaluate(val, 3);
  }
};

}  // namespace

TEST_CASE("hf gpt2: a hand-built HF file lands in our layout (transposed, wte padded, wpe cut)") {
  const HfFile f = tiny_file();
  write_file("hf_tiny.safetensors", f);
  check_tiny(hf::read_gpt2("hf_tiny.safetensors", kTiny), f);
}

TEST_CASE("hf gpt2: the transformer. prefix, the attention buffers and a tied lm_head are accepted") {
  HfFile f = tiny_file();
  HfFile with = f;
  with["h.0.attn.bias"] = {{1, 1, 6, 6}, std::vector<float>(36, 1.0f)};
  with["h.0.attn.masked_bias"] = {{}, {-1e4f}};
  write_file("hf_prefixed.safetensors", with, DType::f32, "transformer.");
  check_tiny(hf::read_gpt2("hf_prefixed.safetensors", kTiny), f);
  // GPT2LMHeadModel: the prefixed body and an unprefixed head equal to wte.
  std::vector<checkpoint::safetensors::TensorRef> refs;
  for (const auto& [name, t] : with) refs.push_back({"transformer." + name, DType::f32, t.shape, t.values.data()});
  refs.push_back({"lm_head.weight", DType::f32, {5, 4}, f.at("wte.weight").values.data()});
  checkpoint::safetensors::write("hf_lm_head.safetensors", refs, {{"format", "pt"}});
  check_tiny(hf::read_gpt2("hf_lm_head.safetensors", kTiny), f);
}

TEST_CASE("hf gpt2: F16 and BF16 files read as the values they hold") {
  // Values that both hold exactly: small integers.
  HfFile f = tiny_file();
  for (auto& [name, t] : f)
    for (std::size_t i = 0; i < t.values.size(); ++i) t.values[i] = static_cast<float>(static_cast<int>(i % 64) - 32);
  for (DType dtype : {DType::f16, DType::bf16}) {
    INFO(checkpoint::safetensors::format_name(dtype));
    write_file("hf_half.safetensors", f, dtype);
    const ck::Snapshot snap = hf::read_gpt2("hf_half.safetensors", kTiny);
    const ck::Source s = ck::Source::of(snap);
    const std::vector<float> w = whole(s, "h.0.mlp.c_fc.weight", Shape{16, 4});
    for (std::int64_t o = 0; o < 16; ++o)
      for (std::int64_t i = 0; i < 4; ++i)
        CHECK(w[static_cast<std::size_t>(o * 4 + i)] ==
              f.at("h.0.mlp.c_fc.weight").values[static_cast<std::size_t>(i * 16 + o)]);
    CHECK(whole(s, "ln_f.weight", Shape{4}) == f.at("ln_f.weight").values);
  }
}

TEST_CASE("hf gpt2: write_gpt2 stores the HF file again: names, shapes, order, F32, format pt") {
  HfFile f = tiny_file();
  write_file("hf_in.safetensors", f);
  const ck::Snapshot snap = hf::read_gpt2("hf_in.safetensors", kTiny);
  hf::write_gpt2("hf_out.safetensors", ck::Source::of(snap), kTiny);
  const auto out = checkpoint::safetensors::File::read("hf_out.safetensors");
  CHECK(out.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  // HF's order: the data of wte first, then wpe, the block, ln_f.
  std::vector<const checkpoint::safetensors::TensorInfo*> order;
  for (const auto& t : out.tensors()) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  std::vector<std::string> names;
  for (const auto* t : order) names.push_back(t->name);
  std::vector<std::string> want;
  for (const hf::Gpt2Tensor& e : hf::gpt2_tensors(kTiny)) want.push_back(e.theirs);
  CHECK(names == want);
  CHECK(names.front() == "wte.weight");
  CHECK(names.back() == "ln_f.bias");
  f.at("wpe.weight").shape = {3, 4};  // n_positions = max_seq
  f.at("wpe.weight").values.resize(12);
  REQUIRE(out.tensors().size() == f.size());
  for (const auto& [name, t] : f) {
    INFO(name);
    const checkpoint::safetensors::TensorInfo& info = out.get(name, DType::f32);
    CHECK(info.shape == t.shape);
    const auto bytes = out.bytes(info);
    REQUIRE(bytes.size() == t.values.size() * sizeof(float));
    CHECK(std::memcmp(bytes.data(), t.values.data(), bytes.size()) == 0);
  }
}

TEST_CASE("hf gpt2: a µP model wider than its base is neither read nor written; at its base width it is") {
  write_file("hf_mup.safetensors", tiny_file());
  models::GPT2Config mup = kTiny;
  mup.mup = true;
  mup.mup_base_dim = 2;  // width multiplier 2: logits x 1/2, which HF's GPT-2 cannot hold
  CHECK_THROWS_WITH_AS(hf::read_gpt2("hf_mup.safetensors", mup),
                       doctest::Contains("cannot be read into a µP model of width multiplier 2 (--mup, --dim 4 over "
                                         "--mup-base-dim 2)"),
                       Error);
  const ck::Snapshot snap = hf::read_gpt2("hf_mup.safetensors", kTiny);
  CHECK_THROWS_WITH_AS(hf::write_gpt2("hf_mup_out.safetensors", ck::Source::of(snap), mup),
                       doctest::Contains("cannot be written from a µP model of width multiplier 2"), Error);
  mup.mup_base_dim = kTiny.dim;  // µP at its base width is the standard model
  check_tiny(hf::read_gpt2("hf_mup.safetensors", mup), tiny_file());
  CHECK_NOTHROW(hf::write_gpt2("hf_mup_out.safetensors", ck::Source::of(snap), mup));
}

TEST_CASE("hf gpt2: a trained model exported and imported is the same model; at tp 2 within 1e-5") {
  Run<Serial> trained(99);
  for (int s = 0; s < 3; ++s) trained.trainer.step();
  hf::write_gpt2("hf_trained.safetensors", ck::Source::of(trained.trainer.snapshot(train::SnapshotScope::saved)),
                 kModel);
  const double loss = trained.validation_loss();
  REQUIRE(std::isfinite(loss));
  const ck::Snapshot imported = hf::read_gpt2("hf_trained.safetensors", kModel);

  SUBCASE("one rank: every parameter bit for bit, the same validation loss") {
    Run<Serial> fresh(7);
    const double before = fresh.validation_loss();
    fresh.trainer.load_weights(ck::Source::of(imported));
    const auto a = trained.model.parameter_store().parameters();
    const auto b = fresh.model.parameter_store().parameters();
    REQUIRE(a.size() == b.size());
    for (std::size_t k = 0; k < a.size(); ++k) {
      INFO(a[k]->name);
      REQUIRE(a[k]->name == b[k]->name);
      REQUIRE(a[k]->numel() == b[k]->numel());
      CHECK(std::memcmp(a[k]->value, b[k]->value, static_cast<std::size_t>(a[k]->numel()) * sizeof(float)) == 0);
    }
    CHECK(before != loss);
    CHECK(fresh.validation_loss() == loss);
  }
  SUBCASE("two thread ranks at tp 2") {
    std::vector<double> losses(2, 0.0);
    comm::run_threads(2, [&](comm::ThreadComm& t) {
      comm::Comm world(std::move(t));
      comm::Grid grid(world, {.tp = 2});
      Run<TensorParallel> split(7, nn::TensorParallelGroup(&grid.tp()), parallel::Groups::of(grid));
      split.trainer.load_weights(ck::Source::of(imported));
      losses[static_cast<std::size_t>(world.rank())] = split.validation_loss();
    });
    for (double l : losses) CHECK(std::abs(l - loss) <= 1e-5 * std::abs(loss));
  }
}

TEST_CASE("hf gpt2: every disagreement of a file and the model is an error naming the file, tensor and fix") {
  const auto fails = [](const HfFile& f, const std::vector<std::string>& parts, const models::GPT2Config& cfg = kTiny) {
    write_file("hf_bad.safetensors", f);
    for (const std::string& part : parts) {
      INFO(part);
      CHECK_THROWS_WITH_AS(hf::read_gpt2("hf_bad.safetensors", cfg), doctest::Contains(part.c_str()), Error);
    }
    CHECK_THROWS_WITH_AS(hf::read_gpt2("hf_bad.safetensors", cfg), doctest::Contains("hf_bad.safetensors"), Error);
  };
  SUBCASE("a missing tensor") {
    HfFile f = tiny_file();
    f.erase("h.0.mlp.c_fc.weight");
    fails(f, {"has no tensor 'h.0.mlp.c_fc.weight'"});
  }
  SUBCASE("a tensor in our layout, not HF's (untransposed)") {
    HfFile f = tiny_file();
    f.at("h.0.attn.c_attn.weight").shape = {12, 4};
    fails(f, {"tensor 'h.0.attn.c_attn.weight' has shape (12,4)", "needs (4,12)", "not GPT-2's layout of the tensor"});
  }
  SUBCASE("another vocabulary") {
    HfFile f = tiny_file();
    f.at("wte.weight") = {{6, 4}, std::vector<float>(24, 1.0f)};
    fails(f, {"tensor 'wte.weight' has shape (6,4)", "needs (5,4)", "use --vocab 6"});
  }
  SUBCASE("another width") {
    models::GPT2Config wide = kTiny;
    wide.dim = 8;
    wide.heads = 2;
    fails(tiny_file(), {"tensor 'wte.weight' has shape (5,4)", "needs (5,8)", "use --dim 4"}, wide);
  }
  SUBCASE("another depth") {
    models::GPT2Config deep = kTiny;
    deep.layers = 2;
    fails(tiny_file(), {"holds 1 block (tensors h.0.* to h.0.*)", "the model has 2 layers", "use --layers 1"}, deep);
  }
  SUBCASE("fewer positions than the model's sequence") {
    models::GPT2Config longer = kTiny;
    longer.max_seq = 8;
    fails(tiny_file(), {"tensor 'wpe.weight' has shape (6,4)", "needs (8,4) (or more rows)", "use --seq 6 or less"},
          longer);
  }
  SUBCASE("an unknown tensor") {
    HfFile f = tiny_file();
    f["h.0.attn.rotary.inv_freq"] = {{2}, {1.0f, 2.0f}};
    fails(f, {"holds the tensor 'h.0.attn.rotary.inv_freq', which is not part of GPT-2"});
  }
  SUBCASE("an untied lm_head") {
    HfFile f = tiny_file();
    f["lm_head.weight"] = f.at("wte.weight");
    f.at("lm_head.weight").values[3] += 1.0f;
    fails(f, {"lm_head.weight differs from 'wte.weight'", "untied head"});
    f.at("lm_head.weight") = {{5, 8}, std::vector<float>(40, 0.0f)};
    fails(f, {"lm_head.weight is F32 (5,8) but 'wte.weight' is F32 (5,4)"});
  }
  SUBCASE("a tensor twice, with and without the prefix") {
    HfFile f = tiny_file();
    f["transformer.ln_f.bias"] = f.at("ln_f.bias");
    fails(f, {"holds GPT-2's 'ln_f.bias' twice"});
  }
  SUBCASE("an integer tensor") {
    std::vector<checkpoint::safetensors::TensorRef> refs;
    const HfFile f = tiny_file();
    std::vector<std::int32_t> ints(4, 1);
    for (const auto& [name, t] : f)
      refs.push_back(name == "ln_f.bias"
                         ? checkpoint::safetensors::TensorRef{name, DType::i32, t.shape, ints.data()}
                         : checkpoint::safetensors::TensorRef{name, DType::f32, t.shape, t.values.data()});
    checkpoint::safetensors::write("hf_int.safetensors", refs);
    CHECK_THROWS_WITH_AS(hf::read_gpt2("hf_int.safetensors", kTiny),
                         doctest::Contains("hf_int.safetensors: tensor 'ln_f.bias' is I32"), Error);
  }
  SUBCASE("a source without a tensor cannot be exported") {
    write_file("hf_ok.safetensors", tiny_file());
    ck::Snapshot snap = hf::read_gpt2("hf_ok.safetensors", kTiny);
    snap.pieces.pop_back();  // ln_f.bias
    snap.data[0].resize(snap.data[0].size() - 4);
    CHECK_THROWS_WITH_AS(hf::write_gpt2("hf_never.safetensors", ck::Source::of(snap), kTiny),
                         doctest::Contains("has no tensor 'ln_f.bias'"), Error);
  }
}
