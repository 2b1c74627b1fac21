// Hugging Face Llama folders (checkpoint/hf_llama.hpp), and GPT-2 folders (hf_gpt2.hpp):
//  - the query heads' order: our head j·kv_heads + k is HF's k·group + j, so each reads
//    the same kv head in both, and a hand-made q_proj / o_proj land in our qkv_proj rows
//    and o_proj columns in that order (heads 4, kv 2: HF's 0, 2, 1, 3);
//  - a Llama with grouped-query attention, tied and untied (and with Llama 3's rope
//    scaling), written by write_llama and read back by read_llama_config and read_llama,
//    is the same model bit for bit; the folder holds what from_pretrained needs (HF's
//    names and shapes, q/k/v and gate/up unfused, the real vocabulary's rows, F32,
//    format pt, a config.json with every key); a sharded folder (an index and its
//    shards) reads as the single file does, and so do a LlamaModel's names, old rotary
//    buffers, a tied head stored, and BF16;
//  - a trained Llama exported and imported is the same model, at tp 2 within 1e-5;
//  - a GPT-2 folder (write_gpt2_folder, read_gpt2_config, read_gpt2 of a folder) round
//    trips, and family_of_folder tells the two apart;
//  - every disagreement of a folder and the model is an error naming the file, the
//    tensor or key, and the flag that fixes it;
//  - with LLMPAR_HF_REFERENCE set (tests/tools/test_hf_transformers.sh): the loss and
//    every gradient of models transformers built, and the export of ours, against
//    transformers' own numbers.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data_parallel_test_util.hpp"
#include "llmpar/checkpoint/checkpoint.hpp"
#include "llmpar/checkpoint/hf_gpt2.hpp"
#include "llmpar/checkpoint/hf_llama.hpp"
#include "llmpar/checkpoint/safetensors.hpp"
#include "llmpar/comm/grid.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "temp_dir.hpp"

using namespace llmpar;
namespace ck = checkpoint;
namespace hf = checkpoint::hf;
namespace st = checkpoint::safetensors;
namespace fs = std::filesystem;

namespace {

// 2 layers, 4 query heads reading 2 kv heads of 4 channels, 50 tokens in 128 rows.
models::LlamaConfig tiny(bool tied = false) {
  return {.layers = 2,
          .heads = 4,
          .kv_heads = 2,
          .dim = 16,
          .ffn_dim = 24,
          .max_seq = 32,
          .vocab = 50,
          .padded_vocab = 128,
          .init_std = 0.3f,
          .norm_eps = 1e-5f,
          .rope = tied ? math::RopeConfig{.theta = 500000.0f,
                                          .factor = 8.0f,
                                          .low_freq_factor = 1.0f,
                                          .high_freq_factor = 4.0f,
                                          .original_max_position = 16}
                       : math::RopeConfig{.theta = 10000.0f},
          .tie_embeddings = tied};
}

// Moves parameters that start as ones or zeros (norm gains, biases) off those values, so
// a round trip or a comparison sees every element distinct.
template <class Model>
void move_constant_inits(Model& model) {
  for (auto* p : model.parameter_store().parameters())
    if (p->init.kind != nn::Init::Kind::normal) {
      const auto stream = rng::Stream::named(41, p->name);
      for (std::int64_t i = 0; i < p->numel(); ++i)
        p->value[i] += static_cast<typename Model::value_type>(0.1 * stream.normal(static_cast<std::uint64_t>(i)));
    }
}

// A one-rank model's parameters as a weights-only snapshot of whole tensors.
template <class Model>
ck::Snapshot snapshot_of(Model& model) {
  ck::Snapshot s;
  for (const auto* p : model.parameter_store().parameters()) {
    s.pieces.push_back({p->name, p->shape, nn::Split{}, 0, p->numel()});
    for (std::int64_t i = 0; i < p->numel(); ++i) s.data[0].push_back(static_cast<float>(p->value[i]));
  }
  return s;
}

// Fills a one-rank model (of any element type) from whole tensors.
template <class Model>
void load(Model& model, const ck::Source& source) {
  std::vector<float> v;
  for (auto* p : model.parameter_store().parameters()) {
    v.resize(static_cast<std::size_t>(p->numel()));
    source.fill(ck::Kind::param, p->name, p->shape, {}, 0, p->numel(), v.data());
    for (std::int64_t i = 0; i < p->numel(); ++i)
      p->value[i] = static_cast<typename Model::value_type>(v[static_cast<std::size_t>(i)]);
  }
}

// The whole tensor `name` of a snapshot.
std::vector<float> whole(const ck::Snapshot& s, const std::string& name) {
  std::int64_t at = 0;
  for (const ck::Piece& p : s.pieces) {
    if (p.name == name) return {s.data[0].begin() + at, s.data[0].begin() + at + p.n};
    at += p.n;
  }
  FAIL("no tensor ", name);
  return {};
}

// Two snapshots hold the same tensors, in the same order, bit for bit.
void check_same(const ck::Snapshot& a, const ck::Snapshot& b) {
  REQUIRE(a.pieces.size() == b.pieces.size());
  for (std::size_t k = 0; k < a.pieces.size(); ++k) {
    INFO(a.pieces[k].name);
    CHECK(a.pieces[k].name == b.pieces[k].name);
    CHECK(a.pieces[k].shape == b.pieces[k].shape);
  }
  REQUIRE(a.data[0].size() == b.data[0].size());
  CHECK(std::memcmp(a.data[0].data(), b.data[0].data(), a.data[0].size() * sizeof(float)) == 0);
}

// An HF file's tensors by name: shapes and f32 values.
struct HfTensor {
  std::vector<std::int64_t> shape;
  std::vector<float> values;
};
using HfFile = std::map<std::string, HfTensor>;

HfFile read_file(const fs::path& path) {
  const st::File f = st::File::read(path.string());
  HfFile out;
  for (const st::TensorInfo& t : f.tensors()) {
    REQUIRE(t.dtype == DType::f32);
    HfTensor& h = out[t.name];
    h.shape = t.shape;
    h.values.resize(static_cast<std::size_t>(t.numel()));
    std::memcpy(h.values.data(), f.bytes(t).data(), h.values.size() * sizeof(float));
  }
  return out;
}

// Writes `f` as `path`, every tensor as `dtype`.
void write_file(const fs::path& path, const HfFile& f, DType dtype = DType::f32) {
  std::vector<std::vector<std::uint16_t>> halves;
  halves.reserve(f.size());
  std::vector<st::TensorRef> refs;
  for (const auto& [name, t] : f) {
    const void* data = t.values.data();
    if (dtype != DType::f32) {
      halves.emplace_back();
      for (float v : t.values) halves.back().push_back(dtype == DType::bf16 ? bf16(v).bits : f16(v).bits);
      data = halves.back().data();
    }
    refs.push_back({name, dtype, t.shape, data});
  }
  st::write(path.string(), refs, {{"format", "pt"}});
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}
void write_json(const fs::path& path, const nlohmann::json& j) { std::ofstream(path) << j.dump(2); }

// The tiny Llama (random, norms moved off one) written to dir/name; its snapshot.
ck::Snapshot write_tiny(const fs::path& dir, const models::LlamaConfig& cfg) {
  models::Llama<float> model(cfg, 3);
  move_constant_inits(model);
  ck::Snapshot snap = snapshot_of(model);
  hf::write_llama(dir.string(), ck::Source::of(snap), cfg);
  return snap;
}

void check_config(const models::LlamaConfig& a, const models::LlamaConfig& b) {
  CHECK(a.layers == b.layers);
  CHECK(a.heads == b.heads);
  CHECK(a.kv_heads == b.kv_heads);
  CHECK(a.dim == b.dim);
  CHECK(a.ffn_dim == b.ffn_dim);
  CHECK(a.max_seq == b.max_seq);
  CHECK(a.vocab == b.vocab);
  CHECK(a.padded_vocab == b.padded_vocab);
  CHECK(a.init_std == b.init_std);
  CHECK(a.norm_eps == b.norm_eps);
  CHECK(a.rope == b.rope);
  CHECK(a.tie_embeddings == b.tie_embeddings);
}

}  // namespace

// ---- the query heads' order ------------------------------------------------------------------

TEST_CASE("hf llama: our query head j*kv_heads + k is HF's k*group + j, and reads the same kv head in both") {
  const auto order = [](std::int64_t heads, std::int64_t kv) {
    models::LlamaConfig cfg;
    cfg.heads = heads;
    cfg.kv_heads = kv;
    std::vector<std::int64_t> out;
    for (std::int64_t h = 0; h < heads; ++h) out.push_back(hf::hf_query_head(h, cfg));
    return out;
  };
  CHECK(order(4, 2) == std::vector<std::int64_t>{0, 2, 1, 3});
  CHECK(order(8, 2) == std::vector<std::int64_t>{0, 4, 1, 5, 2, 6, 3, 7});
  CHECK(order(6, 3) == std::vector<std::int64_t>{0, 2, 4, 1, 3, 5});
  CHECK(order(4, 4) == std::vector<std::int64_t>{0, 1, 2, 3});  // multi-head attention: no permutation
  CHECK(order(4, 1) == std::vector<std::int64_t>{0, 1, 2, 3});  // multi-query attention: none either
  for (const auto& [heads, kv] : std::vector<std::pair<std::int64_t, std::int64_t>>{{4, 2}, {8, 2}, {6, 3}, {32, 8}}) {
    const AttentionShape ours{1, 1, heads, kv, 2};
    const std::int64_t group = heads / kv;
    std::vector<std::int64_t> o = order(heads, kv), sorted = o;
    std::sort(sorted.begin(), sorted.end());
    for (std::int64_t h = 0; h < heads; ++h) {
      CHECK(sorted[static_cast<std::size_t>(h)] == h);                      // a permutation
      CHECK(o[static_cast<std::size_t>(h)] / group == ours.kv_head_of(h));  // HF's kv head h / group is ours
    }
  }
}

TEST_CASE(
    "hf llama: a hand-made q_proj and o_proj land in our qkv_proj rows and o_proj columns as HF's heads 0,2,1,3") {
  const test_util::TempDir dir("hf_llama");
  const models::LlamaConfig cfg = tiny();
  write_tiny(dir.path, cfg);
  HfFile f = read_file(dir / "model.safetensors");
  const std::int64_t C = 16, hd = 4;
  // Every element of q_proj and o_proj says where it is in HF's layout.
  HfTensor& q = f.at("model.layers.1.self_attn.q_proj.weight");
  HfTensor& o = f.at("model.layers.1.self_attn.o_proj.weight");
  REQUIRE(q.shape == std::vector<std::int64_t>{C, C});
  for (std::int64_t r = 0; r < C; ++r)
    for (std::int64_t c = 0; c < C; ++c) {
      q.values[static_cast<std::size_t>(r * C + c)] = static_cast<float>(1000 * r + c);
      o.values[static_cast<std::size_t>(r * C + c)] = static_cast<float>(1000 * r + c);
    }
  write_file(dir / "model.safetensors", f);
  const ck::Snapshot s = hf::read_llama(dir.path.string(), cfg);
  const std::vector<float> qkv = whole(s, "layers.1.self_attn.qkv_proj.weight");
  const std::vector<float> out = whole(s, "layers.1.self_attn.o_proj.weight");
  REQUIRE(qkv.size() == static_cast<std::size_t>((C + 2 * 2 * hd) * C));
  const std::int64_t hf_head[] = {0, 2, 1, 3};
  for (std::int64_t h = 0; h < 4; ++h)
    for (std::int64_t i = 0; i < hd; ++i)
      for (std::int64_t c = 0; c < C; ++c) {
        // q: our row h*hd + i is HF's row hf_head[h]*hd + i; o_proj: columns likewise.
        CHECK(qkv[static_cast<std::size_t>((h * hd + i) * C + c)] ==
              static_cast<float>(1000 * (hf_head[h] * hd + i) + c));
        CHECK(out[static_cast<std::size_t>(c * C + h * hd + i)] == static_cast<float>(1000 * c + hf_head[h] * hd + i));
      }
  // k and v follow q unpermuted.
  const HfTensor& k = f.at("model.layers.1.self_attn.k_proj.weight");
  const HfTensor& v = f.at("model.layers.1.self_attn.v_proj.weight");
  CHECK(std::vector<float>(qkv.begin() + C * C, qkv.begin() + C * C + 2 * hd * C) == k.values);
  CHECK(std::vector<float>(qkv.begin() + C * C + 2 * hd * C, qkv.end()) == v.values);
}

// ---- round trips -------------------------------------------------------------------------------

TEST_CASE(
    "hf llama: write_llama then read_llama_config and read_llama is the same model bit for bit (GQA, tied and "
    "untied, rope scaling)") {
  for (bool tied : {false, true}) {
    INFO("tied ", tied);
    const test_util::TempDir dir("hf_llama");
    const models::LlamaConfig cfg = tiny(tied);
    const ck::Snapshot snap = write_tiny(dir.path, cfg);
    const models::LlamaConfig read_cfg = hf::read_llama_config(dir.path.string());
    check_config(read_cfg, cfg);
    check_same(hf::read_llama(dir.path.string(), read_cfg), snap);
    CHECK(!fs::exists(dir / "model.safetensors.partial"));
    CHECK(!fs::exists(dir / "config.json.partial"));

    // The folder: HF's names and shapes, unfused and unpermuted as HF holds them.
    const st::File file = st::File::read((dir / "model.safetensors").string());
    CHECK(file.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
    std::map<std::string, std::vector<std::int64_t>> shapes;
    for (const st::TensorInfo& t : file.tensors()) {
      CHECK(t.dtype == DType::f32);
      shapes[t.name] = t.shape;
    }
    std::map<std::string, std::vector<std::int64_t>> want{{"model.embed_tokens.weight", {50, 16}},
                                                          {"model.norm.weight", {16}}};
    if (!tied) want["lm_head.weight"] = {50, 16};
    for (int i = 0; i < 2; ++i) {
      const std::string l = "model.layers." + std::to_string(i) + ".";
      want[l + "input_layernorm.weight"] = {16};
      want[l + "post_attention_layernorm.weight"] = {16};
      want[l + "self_attn.q_proj.weight"] = {16, 16};
      want[l + "self_attn.k_proj.weight"] = {8, 16};
      want[l + "self_attn.v_proj.weight"] = {8, 16};
      want[l + "self_attn.o_proj.weight"] = {16, 16};
      want[l + "mlp.gate_proj.weight"] = {24, 16};
      want[l + "mlp.up_proj.weight"] = {24, 16};
      want[l + "mlp.down_proj.weight"] = {16, 24};
    }
    CHECK(shapes == want);
    const HfFile f = read_file(dir / "model.safetensors");
    const std::vector<float> gate_up = whole(snap, "layers.0.mlp.gate_up_proj.weight");
    CHECK(std::vector<float>(gate_up.begin(), gate_up.begin() + 24 * 16) ==
          f.at("model.layers.0.mlp.gate_proj.weight").values);
    CHECK(std::vector<float>(gate_up.begin() + 24 * 16, gate_up.end()) ==
          f.at("model.layers.0.mlp.up_proj.weight").values);
    const std::vector<float> embed = whole(snap, "embed_tokens");
    CHECK(std::vector<float>(embed.begin(), embed.begin() + 50 * 16) == f.at("model.embed_tokens.weight").values);
    CHECK(std::all_of(embed.begin() + 50 * 16, embed.end(), [](float x) { return x == 0.0f; }));  // padding

    // config.json: what LlamaForCausalLM.from_pretrained needs.
    const nlohmann::json c = read_json(dir / "config.json");
    CHECK(c["architectures"] == nlohmann::json::array({"LlamaForCausalLM"}));
    CHECK(c["model_type"] == "llama");
    CHECK(c["hidden_size"] == 16);
    CHECK(c["intermediate_size"] == 24);
    CHECK(c["num_hidden_layers"] == 2);
    CHECK(c["num_attention_heads"] == 4);
    CHECK(c["num_key_value_heads"] == 2);
    CHECK(c["head_dim"] == 4);
    CHECK(c["max_position_embeddings"] == 32);
    CHECK(c["vocab_size"] == 50);
    CHECK(c["rms_norm_eps"].get<double>() == 1e-5);  // the float's shortest decimal, not 9.99999974e-06
    CHECK(c["initializer_range"].get<double>() == 0.3);
    CHECK(c["hidden_act"] == "silu");
    CHECK(c["attention_bias"] == false);
    CHECK(c["mlp_bias"] == false);
    CHECK(c["tie_word_embeddings"] == tied);
    CHECK(c["torch_dtype"] == "float32");
    if (tied) {
      CHECK(c["rope_theta"].get<double>() == 500000.0);
      CHECK(c["rope_scaling"] == nlohmann::json{{"rope_type", "llama3"},
                                                {"factor", 8.0},
                                                {"low_freq_factor", 1.0},
                                                {"high_freq_factor", 4.0},
                                                {"original_max_position_embeddings", 16}});
    } else {
      CHECK(c["rope_theta"].get<double>() == 10000.0);
      CHECK(c["rope_scaling"].is_null());
    }
    CHECK(hf::family_of_folder(dir.path.string()) == hf::Family::llama);
  }
}

TEST_CASE(
    "hf llama: a sharded folder (index and shards), a LlamaModel's names, rotary buffers, a stored tied head "
    "and BF16 read as the single F32 file does") {
  const test_util::TempDir dir("hf_llama");
  const models::LlamaConfig cfg = tiny(true);
  const ck::Snapshot snap = write_tiny(dir.path, cfg);
  const HfFile f = read_file(dir / "model.safetensors");
  const std::string folder = dir.path.string();

  SUBCASE("two shards and model.safetensors.index.json") {
    HfFile first, second;
    nlohmann::json map = nlohmann::json::object();
    for (const auto& [name, t] : f) {
      const bool early = name.find("layers.1.") == std::string::npos && name != "model.norm.weight";
      (early ? first : second)[name] = t;
      map[name] = early ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    }
    write_file(dir / "model-00001-of-00002.safetensors", first);
    write_file(dir / "model-00002-of-00002.safetensors", second);
    write_json(dir / "model.safetensors.index.json", {{"metadata", {{"total_size", 0}}}, {"weight_map", map}});
    fs::remove(dir / "model.safetensors");
    check_same(hf::read_llama(folder, cfg), snap);
    // A shard without a tensor the index puts there.
    HfFile broken = second;
    broken.erase("model.norm.weight");
    write_file(dir / "model-00002-of-00002.safetensors", broken);
    CHECK_THROWS_WITH_AS(hf::read_llama(folder, cfg),
                         doctest::Contains("model.safetensors.index.json puts tensor 'model.norm.weight' in"), Error);
  }
  SUBCASE("without the model. prefix, with rotary buffers and the tied head") {
    HfFile g;
    for (const auto& [name, t] : f) g[name.starts_with("model.") ? name.substr(6) : name] = t;
    g["layers.0.self_attn.rotary_emb.inv_freq"] = {{2}, {1.0f, 0.01f}};
    g["lm_head.weight"] = f.at("model.embed_tokens.weight");
    write_file(dir / "model.safetensors", g);
    check_same(hf::read_llama(folder, cfg), snap);
  }
  SUBCASE("BF16: each value rounded once") {
    write_file(dir / "model.safetensors", f, DType::bf16);
    const ck::Snapshot s = hf::read_llama(folder, cfg);
    const std::vector<float> ours = whole(snap, "layers.0.mlp.down_proj.weight"),
                             got = whole(s, "layers.0.mlp.down_proj.weight");
    for (std::size_t i = 0; i < ours.size(); ++i) CHECK(got[i] == static_cast<float>(bf16(ours[i])));
  }
}

namespace {

// A Llama of dp_test's size, its loader and trainer, on one rank or a tp group.
using Serial = train::PolicyOf<models::Llama<float>>;
using TensorParallel = Compose<backend::Cpu, precision::FP32, parallel::NoPipeline, parallel::Data<zero::Stage<0>>>;

const data::TokenDataset& dataset() {
  static const data::TokenDataset d = data::TokenDataset::from_tokens(dp_test::tokens(), 50, "hf tokens");
  return d;
}

template <class Policy>
struct Run {
  backend::cpu::Context ctx;
  models::Llama<float> model;
  data::DataLoader train;
  train::Trainer<models::Llama<float>, Policy> trainer;
  explicit Run(std::uint64_t seed, nn::TensorParallelGroup tp = {}, parallel::Groups groups = {})
      : model(dp_test::llama_config(2), seed, tp),
        train(dataset(), {.batch_size = 4, .seq_len = 16}),
        trainer(ctx, model, {.lr = 1e-2f, .eps = 1e-2f, .weight_decay = 0.1f},
                {.peak_lr = 1e-2f, .warmup_steps = 0, .total_steps = 3}, train, {.steps = 3, .layout = layout(tp)},
                groups) {}
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

TEST_CASE("hf llama: a trained Llama exported and imported is the same model; at tp 2 within 1e-5") {
  const models::LlamaConfig cfg = dp_test::llama_config(2);
  const test_util::TempDir dir("hf_llama");
  Run<Serial> trained(99);
  for (int s = 0; s < 3; ++s) trained.trainer.step();
  hf::write_llama(dir.path.string(), ck::Source::of(trained.trainer.snapshot(train::SnapshotScope::saved)), cfg);
  const double loss = trained.validation_loss();
  REQUIRE(std::isfinite(loss));
  models::LlamaConfig read_cfg = hf::read_llama_config(dir.path.string());
  CHECK(read_cfg.padded_vocab == 128);  // vocab 50 rounded up; the model's 64 is ours to choose
  read_cfg.padded_vocab = cfg.padded_vocab;
  check_config(read_cfg, cfg);
  const ck::Snapshot imported = hf::read_llama(dir.path.string(), cfg);

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
      CHECK(std::memcmp(a[k]->value, b[k]->value, static_cast<std::size_t>(a[k]->numel()) * sizeof(float)) == 0);
    }
    CHECK(before != loss);
    CHECK(fresh.validation_loss() == loss);
  }
  SUBCASE("two thread ranks at tp 2 (kv heads split with their query heads)") {
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

// ---- GPT-2 folders and the family -------------------------------------------------------------

TEST_CASE("hf gpt2 folders: write_gpt2_folder, read_gpt2_config and read_gpt2 of the folder round trip") {
  const test_util::TempDir dir("hf_llama");
  const models::GPT2Config cfg{
      .layers = 2, .heads = 2, .dim = 8, .max_seq = 12, .vocab = 40, .padded_vocab = 128, .init_std = 0.1f};
  models::GPT2<float> model(cfg, 5);
  move_constant_inits(model);
  const ck::Snapshot snap = snapshot_of(model);
  hf::write_gpt2_folder(dir.path.string(), ck::Source::of(snap), cfg);
  const models::GPT2Config read_cfg = hf::read_gpt2_config(dir.path.string());
  CHECK(read_cfg.layers == 2);
  CHECK(read_cfg.heads == 2);
  CHECK(read_cfg.dim == 8);
  CHECK(read_cfg.max_seq == 12);
  CHECK(read_cfg.vocab == 40);
  CHECK(read_cfg.padded_vocab == 128);
  CHECK(read_cfg.init_std == 0.1f);
  check_same(hf::read_gpt2(dir.path.string(), read_cfg), snap);
  check_same(hf::read_gpt2((dir / "model.safetensors").string(), read_cfg), snap);  // the file alone, as before
  const nlohmann::json c = read_json(dir / "config.json");
  CHECK(c["architectures"] == nlohmann::json::array({"GPT2LMHeadModel"}));
  CHECK(c["model_type"] == "gpt2");
  CHECK(c["n_layer"] == 2);
  CHECK(c["n_head"] == 2);
  CHECK(c["n_embd"] == 8);
  CHECK(c["n_positions"] == 12);
  CHECK(c["vocab_size"] == 40);
  CHECK(c["activation_function"] == "gelu_new");
  CHECK(c["tie_word_embeddings"] == true);
  CHECK(hf::family_of_folder(dir.path.string()) == hf::Family::gpt2);

  // What llmpar's GPT-2 would compute differently is refused, by key.
  const auto refuses = [&](const char* key, const nlohmann::json& value, const char* part) {
    nlohmann::json bad = c;
    bad[key] = value;
    write_json(dir / "config.json", bad);
    CHECK_THROWS_WITH_AS(hf::read_gpt2_config(dir.path.string()), doctest::Contains(part), Error);
  };
  refuses("activation_function", "relu", "activation_function is \"relu\"");
  refuses("n_inner", 64, "n_inner is 64; llmpar's GPT-2 has an MLP of 4 n_embd = 32 units");
  refuses("layer_norm_epsilon", 1e-6, "layer_norm_epsilon is 1e-06");
  refuses("scale_attn_by_inverse_layer_idx", true, "scale_attn_by_inverse_layer_idx is true");
  refuses("n_layer", "two", "\"n_layer\" is \"two\", not an integer");
  refuses("model_type", "llama", "not GPT-2 (model_type \"gpt2\"); read it with read_llama_config");
}

TEST_CASE("hf: family_of_folder reads model_type, or else the architectures, and names another family") {
  const test_util::TempDir dir("hf_llama");
  const auto family = [&](const nlohmann::json& config) {
    write_json(dir / "config.json", config);
    return hf::family_of_folder(dir.path.string());
  };
  CHECK(family({{"model_type", "gpt2"}}) == hf::Family::gpt2);
  CHECK(family({{"model_type", "llama"}}) == hf::Family::llama);
  CHECK(family({{"architectures", {"LlamaForCausalLM"}}}) == hf::Family::llama);
  CHECK(family({{"architectures", {"GPT2LMHeadModel"}}}) == hf::Family::gpt2);
  CHECK_THROWS_WITH_AS(family({{"model_type", "mistral"}}),
                       doctest::Contains("config.json is the config of a 'mistral' model; llmpar reads Hugging Face "
                                         "GPT-2 (model_type \"gpt2\") and Llama (\"llama\") models"),
                       Error);
  CHECK_THROWS_WITH_AS(family(nlohmann::json::object()), doctest::Contains("has neither model_type nor architectures"),
                       Error);
  fs::remove(dir / "config.json");
  CHECK_THROWS_WITH_AS(hf::family_of_folder(dir.path.string()), doctest::Contains("has no config.json"), Error);
}

// ---- errors ---------------------------------------------------------------------------------------

TEST_CASE("hf llama: the hub's config.json of Llama 3.2 1B and Llama 3 8B read as the presets") {
  const test_util::TempDir dir("hf_llama");
  // The keys that matter of meta-llama/Llama-3.2-1B's and Meta-Llama-3-8B's config.json.
  const nlohmann::json common = {{"architectures", {"LlamaForCausalLM"}},
                                 {"attention_bias", false},
                                 {"attention_dropout", 0.0},
                                 {"bos_token_id", 128000},
                                 {"eos_token_id", 128001},
                                 {"hidden_act", "silu"},
                                 {"initializer_range", 0.02},
                                 {"mlp_bias", false},
                                 {"model_type", "llama"},
                                 {"num_key_value_heads", 8},
                                 {"pretraining_tp", 1},
                                 {"rms_norm_eps", 1e-05},
                                 {"rope_theta", 500000.0},
                                 {"torch_dtype", "bfloat16"},
                                 {"vocab_size", 128256}};
  nlohmann::json small = common, big = common;
  small.update({{"head_dim", 64},
                {"hidden_size", 2048},
                {"intermediate_size", 8192},
                {"max_position_embeddings", 131072},
                {"num_attention_heads", 32},
                {"num_hidden_layers", 16},
                {"rope_scaling",
                 {{"factor", 32.0},
                  {"high_freq_factor", 4.0},
                  {"low_freq_factor", 1.0},
                  {"original_max_position_embeddings", 8192},
                  {"rope_type", "llama3"}}},
                {"tie_word_embeddings", true}});
  big.update({{"hidden_size", 4096},
              {"intermediate_size", 14336},
              {"max_position_embeddings", 8192},
              {"num_attention_heads", 32},
              {"num_hidden_layers", 32},
              {"rope_scaling", nullptr},
              {"tie_word_embeddings", false}});
  write_json(dir / "config.json", small);
  check_config(hf::read_llama_config(dir.path.string()), models::LlamaConfig::preset("llama3.2-1b"));
  write_json(dir / "config.json", big);
  check_config(hf::read_llama_config(dir.path.string()), models::LlamaConfig::preset("llama3-8b"));
}

TEST_CASE("hf llama: a config.json llmpar's Llama cannot compute is an error naming the key") {
  const test_util::TempDir dir("hf_llama");
  write_tiny(dir.path, tiny(true));
  const nlohmann::json good = read_json(dir / "config.json");
  const auto refuses = [&](const nlohmann::json& bad, const std::string& part) {
    INFO(part);
    write_json(dir / "config.json", bad);
    CHECK_THROWS_WITH_AS(hf::read_llama_config(dir.path.string()), doctest::Contains(part.c_str()), Error);
    CHECK_THROWS_WITH_AS(hf::read_llama_config(dir.path.string()), doctest::Contains("config.json"), Error);
  };
  const auto with = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json c = good;
    c[key] = value;
    return c;
  };
  refuses(with("model_type", "mistral"), "is the config of a 'mistral' model, not Llama (model_type \"llama\"");
  refuses(with("model_type", "gpt2"), "; read it with read_gpt2_config");
  refuses(with("head_dim", 8), "head_dim is 8 but hidden_size 16 / num_attention_heads 4 = 4");
  refuses(with("attention_bias", true), "attention_bias is true; llmpar's Llama has no biases");
  refuses(with("mlp_bias", true), "mlp_bias is true; llmpar's Llama has no biases");
  refuses(with("hidden_act", "gelu"), "hidden_act is \"gelu\"; llmpar's Llama's MLP is SwiGLU");
  refuses(with("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}), "has rope_type \"yarn\"");
  refuses(with("rope_scaling", {{"rope_type", "llama3"}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}}),
          "\"rope_scaling\" has no \"factor\", which rope_type \"llama3\" needs");
  refuses(with("num_key_value_heads", 3), "kv_heads (--kv-heads) is 3; it must divide heads 4");
  nlohmann::json no_width = good;
  no_width.erase("hidden_size");
  refuses(no_width, "has no \"hidden_size\"");

  // transformers 5's rope_parameters (rope_theta inside, no rope_scaling) reads as the older keys.
  nlohmann::json v5 = good;
  v5.erase("rope_theta");
  v5.erase("rope_scaling");
  v5["rope_parameters"] = {{"rope_type", "llama3"},   {"rope_theta", 500000.0},
                           {"factor", 8.0},           {"low_freq_factor", 1.0},
                           {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 16}};
  write_json(dir / "config.json", v5);
  check_config(hf::read_llama_config(dir.path.string()), tiny(true));
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  write_json(dir / "config.json", v5);
  CHECK(hf::read_llama_config(dir.path.string()).rope == math::RopeConfig{.theta = 10000.0f});
  // Absent keys take transformers' defaults: kv heads = heads, no tie, theta 10^4, eps 1e-6.
  nlohmann::json minimal = {{"model_type", "llama"},  {"hidden_size", 16},        {"intermediate_size", 24},
                            {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"vocab_size", 50}};
  write_json(dir / "config.json", minimal);
  const models::LlamaConfig m = hf::read_llama_config(dir.path.string());
  CHECK(m.kv_heads == 4);
  CHECK(!m.tie_embeddings);
  CHECK(m.rope == math::RopeConfig{.theta = 10000.0f});
  CHECK(m.norm_eps == 1e-6f);
  CHECK(m.max_seq == 2048);
}

TEST_CASE("hf llama: every disagreement of a folder and the model is an error naming the file, tensor and fix") {
  const test_util::TempDir dir("hf_llama");
  const models::LlamaConfig cfg = tiny();
  write_tiny(dir.path, cfg);
  const HfFile good = read_file(dir / "model.safetensors");
  const std::string folder = dir.path.string();
  const auto fails = [&](const HfFile& f, const std::vector<std::string>& parts, const models::LlamaConfig& c) {
    write_file(dir / "model.safetensors", f);
    for (const std::string& part : parts) {
      INFO(part);
      CHECK_THROWS_WITH_AS(hf::read_llama(folder, c), doctest::Contains(part.c_str()), Error);
    }
    CHECK_THROWS_WITH_AS(hf::read_llama(folder, c), doctest::Contains(folder.c_str()), Error);
  };
  SUBCASE("a missing tensor") {
    HfFile f = good;
    f.erase("model.layers.1.mlp.up_proj.weight");
    fails(f, {"has no tensor 'model.layers.1.mlp.up_proj.weight'", "the checkpoint is incomplete"}, cfg);
  }
  SUBCASE("another number of kv heads") {
    models::LlamaConfig mha = cfg;
    mha.kv_heads = 4;
    fails(good,
          {"tensor 'model.layers.0.self_attn.k_proj.weight' has shape (8,16)", "needs (16,16)",
           "use --kv-heads 2 (at --heads 4"},
          mha);
  }
  SUBCASE("another MLP width") {
    models::LlamaConfig wide = cfg;
    wide.ffn_dim = 32;
    fails(good, {"tensor 'model.layers.0.mlp.gate_proj.weight' has shape (24,16)", "needs (32,16)", "use --ffn-dim 24"},
          wide);
  }
  SUBCASE("another vocabulary") {
    models::LlamaConfig other = cfg;
    other.vocab = 60;
    fails(good, {"tensor 'model.embed_tokens.weight' has shape (50,16)", "needs (60,16)", "use --vocab 50"}, other);
  }
  SUBCASE("another width") {
    models::LlamaConfig other = cfg;
    other.dim = 32;
    other.heads = 8;
    other.kv_heads = 4;
    fails(good, {"tensor 'model.embed_tokens.weight' has shape (50,16)", "use --dim 16"}, other);
  }
  SUBCASE("another depth") {
    models::LlamaConfig deep = cfg;
    deep.layers = 3;
    fails(good,
          {"holds 2 blocks (tensors model.layers.0.* to model.layers.1.*)", "the model has 3 layers", "use --layers 2"},
          deep);
  }
  SUBCASE("a q_proj whose heads are not hidden_size / heads wide") {
    HfFile f = good;
    f.at("model.layers.0.self_attn.q_proj.weight") = {{32, 16}, std::vector<float>(512, 0.0f)};
    fails(f, {"has shape (32,16)", "this q_proj has 32 rows for hidden_size 16"}, cfg);
  }
  SUBCASE("biases") {
    HfFile f = good;
    f["model.layers.0.self_attn.q_proj.bias"] = {{16}, std::vector<float>(16, 0.0f)};
    fails(f, {"holds the bias 'model.layers.0.self_attn.q_proj.bias'; llmpar's Llama has no biases"}, cfg);
  }
  SUBCASE("an unknown tensor") {
    HfFile f = good;
    f["model.layers.0.mlp.experts.0.weight"] = {{2}, {1.0f, 2.0f}};
    fails(f, {"holds the tensor 'model.layers.0.mlp.experts.0.weight', which is not part of Llama"}, cfg);
  }
  SUBCASE("a tensor twice, with and without the prefix") {
    HfFile f = good;
    f["norm.weight"] = f.at("model.norm.weight");
    fails(f, {"holds Llama's 'model.norm.weight' twice"}, cfg);
  }
  SUBCASE("an untied model from a tied checkpoint, and a tied model from an untied one") {
    HfFile f = good;
    f.erase("lm_head.weight");
    fails(f,
          {"has no tensor 'lm_head.weight', which the model's untied head needs",
           "load it into a model with "
           "tie_embeddings"},
          cfg);
    models::LlamaConfig tied = cfg;
    tied.tie_embeddings = true;
    fails(good, {"'lm_head.weight' differs from 'model.embed_tokens.weight', but the model ties its head"}, tied);
    f["lm_head.weight"] = {{50, 8}, std::vector<float>(400, 0.0f)};
    fails(f, {"'lm_head.weight' is F32 (50,8) but 'model.embed_tokens.weight' is F32 (50,16)"}, tied);
  }
  SUBCASE("an integer tensor") {
    std::vector<std::int32_t> ints(16, 1);
    std::vector<st::TensorRef> refs;
    for (const auto& [name, t] : good)
      refs.push_back(name == "model.norm.weight" ? st::TensorRef{name, DType::i32, t.shape, ints.data()}
                                                 : st::TensorRef{name, DType::f32, t.shape, t.values.data()});
    st::write((dir / "model.safetensors").string(), refs);
    CHECK_THROWS_WITH_AS(hf::read_llama(folder, cfg),
                         doctest::Contains("model.safetensors: tensor 'model.norm.weight' is I32; weights are read "
                                           "from F32, F16 or BF16"),
                         Error);
  }
  SUBCASE("no weights in the folder") {
    fs::remove(dir / "model.safetensors");
    CHECK_THROWS_WITH_AS(hf::read_llama(folder, cfg),
                         doctest::Contains("holds neither model.safetensors nor model.safetensors.index.json"), Error);
  }
  SUBCASE("a source without a tensor cannot be exported") {
    models::Llama<float> model(cfg, 3);
    ck::Snapshot snap = snapshot_of(model);
    snap.data[0].resize(snap.data[0].size() - static_cast<std::size_t>(snap.pieces.back().n));
    snap.pieces.pop_back();  // lm_head
    CHECK_THROWS_WITH_AS(hf::write_llama((dir / "never").string(), ck::Source::of(snap), cfg),
                         doctest::Contains("has no tensor 'lm_head'"), Error);
    CHECK(!fs::exists(dir / "never" / "config.json"));
  }
}

// ---- against transformers (tests/tools/test_hf_transformers.sh) -----------------------------------

namespace {

// One case of the reference: DIR/hf (save_pretrained), DIR/grads (every parameter's
// gradient under its HF name), DIR/reference.safetensors ("tokens", (B, T + 1)) and
// DIR/reference.json ({"loss"}); the check writes DIR/export (our model's folder),
// DIR/export.json ({"loss"}) and DIR/export_logits.safetensors ("logits", (B, T, vocab)).
template <template <class...> class Model, class Config, class Read, class Write>
void check_reference(const fs::path& dir, const Config& cfg, Read read, Write write) {
  backend::cpu::Context ctx;
  const st::File ref = st::File::read((dir / "reference.safetensors").string());
  const st::TensorInfo& tok = ref.get("tokens", DType::i32);
  REQUIRE(tok.shape.size() == 2);
  const std::int64_t B = tok.shape[0], T = tok.shape[1] - 1;
  std::vector<std::int32_t> all(static_cast<std::size_t>(tok.numel())), inputs, targets;
  std::memcpy(all.data(), ref.bytes(tok).data(), all.size() * sizeof(std::int32_t));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t) {
      inputs.push_back(all[static_cast<std::size_t>(b * (T + 1) + t)]);
      targets.push_back(all[static_cast<std::size_t>(b * (T + 1) + t + 1)]);
    }
  const double want_loss = read_json(dir / "reference.json")["loss"].get<double>();

  // Import: transformers' weights, our forward and backward in double.
  Model<double> model(cfg, 1);
  const ck::Snapshot weights = read((dir / "hf").string(), cfg);
  load(model, ck::Source::of(weights));
  model.zero_grad(ctx);
  const double loss = model.forward(ctx, inputs.data(), targets.data(), B, T);
  model.backward(ctx);
  const double loss_error = std::abs(loss - want_loss) / std::abs(want_loss);
  MESSAGE(dir.filename().string(), ": loss ", loss, ", transformers ", want_loss, ", relative difference ", loss_error);
  CHECK(loss_error <= 1e-5);
  // The gradients through the same table as the weights (a permuted weight's gradient is
  // permuted alike): transformers' in our layout.
  const ck::Snapshot grads = read((dir / "grads").string(), cfg);
  const ck::Source want_grads = ck::Source::of(grads);
  double worst = 0.0;
  std::string worst_name;
  for (const nn::Parameter<double>* p : model.parameter_store().parameters()) {
    std::vector<float> want(static_cast<std::size_t>(p->numel()));
    want_grads.fill(ck::Kind::param, p->name, p->shape, {}, 0, p->numel(), want.data());
    double diff = 0.0, scale = 0.0;
    for (std::int64_t i = 0; i < p->numel(); ++i) {
      diff = std::max(diff, std::abs(p->grad[i] - static_cast<double>(want[static_cast<std::size_t>(i)])));
      scale = std::max(scale, std::abs(static_cast<double>(want[static_cast<std::size_t>(i)])));
    }
    const double error = diff / scale;  // the largest difference over the largest gradient
    INFO(p->name, ": max |difference| ", diff, ", max |gradient| ", scale);
    CHECK(scale > 0.0);
    CHECK(error <= 1e-4);
    if (error >= worst) worst = error, worst_name = p->name;
  }
  MESSAGE(dir.filename().string(), ": ", model.parameter_store().parameters().size(),
          " gradients, the worst relative difference ", worst, " (", worst_name, ")");

  // Export: a model of ours (random, norms and biases moved off their constants) for
  // transformers to load; its loss and logits in double, to compare there.
  Model<float> ours(cfg, 5);
  move_constant_inits(ours);
  const ck::Snapshot snap = snapshot_of(ours);
  write((dir / "export").string(), ck::Source::of(snap), cfg);
  Model<double> exact(cfg, 1);
  load(exact, ck::Source::of(snap));
  const double export_loss = exact.evaluate(ctx, inputs.data(), targets.data(), B, T);
  write_json(dir / "export.json", {{"loss", export_loss}});
  const double* logits = exact.logits(ctx, inputs.data(), B, T);
  std::vector<float> real;  // (B, T, vocab) of (B, T, padded_vocab)
  for (std::int64_t r = 0; r < B * T; ++r)
    for (std::int64_t v = 0; v < cfg.vocab; ++v) real.push_back(static_cast<float>(logits[r * cfg.padded_vocab + v]));
  const st::TensorRef out{"logits", DType::f32, {B, T, cfg.vocab}, real.data()};
  st::write((dir / "export_logits.safetensors").string(), std::span<const st::TensorRef>(&out, 1));
}

}  // namespace

TEST_CASE(
    "hf against transformers: the loss and every gradient of its models, and our export (skipped without "
    "LLMPAR_HF_REFERENCE)") {
  const char* root = std::getenv("LLMPAR_HF_REFERENCE");
  if (root == nullptr || *root == '\0') {
    MESSAGE("skipped: LLMPAR_HF_REFERENCE is not set (tests/tools/test_hf_transformers.sh sets it)");
    return;
  }
  std::vector<fs::path> cases;
  for (const fs::directory_entry& e : fs::directory_iterator(root))
    if (fs::exists(e.path() / "reference.json")) cases.push_back(e.path());
  std::sort(cases.begin(), cases.end());
  REQUIRE(!cases.empty());
  for (const fs::path& dir : cases) {
    INFO(dir.string());
    const std::string hf_dir = (dir / "hf").string();
    if (hf::family_of_folder(hf_dir) == hf::Family::llama) {
      const models::LlamaConfig cfg = hf::read_llama_config(hf_dir);
      check_reference<models::Llama>(dir, cfg, hf::read_llama, hf::write_llama);
    } else {
      const models::GPT2Config cfg = hf::read_gpt2_config(hf_dir);
      check_reference<models::GPT2>(dir, cfg, hf::read_gpt2, hf::write_gpt2_folder);
    }
  }
}
