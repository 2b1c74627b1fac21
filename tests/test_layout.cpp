// The layout of a run (parallel/layout.hpp): every rule of LayoutConfig::validate and
// fit_world names the flag and what would work; dispatch turns a layout's precision and
// ZeRO stage into the one policy they name; layout_of<Policy> starts a layout from a
// policy; a GPT-2's partition follows the layout's rule; and the trainer refuses a layout
// that disagrees with its model, groups, loader or policy, before the first step.
#include <doctest/doctest.h>

#include <string>
#include <type_traits>
#include <vector>

#include "llmpar/backend/cpu/backend.hpp"
#include "llmpar/comm/grid.hpp"
#include "llmpar/comm/thread_comm.hpp"
#include "llmpar/core/error.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/nn/model.hpp"
#include "llmpar/parallel/layout.hpp"
#include "llmpar/train/trainer.hpp"

using namespace llmpar;
using parallel::LayoutConfig;

namespace {

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// validate()'s message for a layout changed by `edit`.
template <class Edit>
std::string refusal(Edit edit) {
  LayoutConfig l;
  edit(l);
  return error_of([&] { l.validate(); });
}

}  // namespace

TEST_CASE("layout: the default is one rank, fp32, ZeRO 0, 1f1b, and validates") {
  const LayoutConfig l;
  CHECK_NOTHROW(l.validate());
  CHECK(l.world() == 1);
  CHECK(l.global_batch() == 1);
  LayoutConfig m{.tp = 2, .pp = 2, .micro_batch = 4, .grad_accum = 3};
  m.fit_world(8);
  CHECK(m.dp == 2);
  CHECK(m.world() == 8);
  CHECK(m.global_batch() == 4 * 2 * 3);
}

TEST_CASE("layout: every rule names the flag, its value and what would work") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {refusal([](LayoutConfig& l) { l.sp = true; }), "--sp splits the sequence over the tensor-parallel group"},
      {refusal([](LayoutConfig& l) { l.schedule = "pipedream"; }), "--schedule pipedream is not a pipeline schedule"},
      {refusal([](LayoutConfig& l) { l.virtual_stages = 0; }),
       "--virtual-stages 0; each pipeline rank holds at least 1"},
      {refusal([](LayoutConfig& l) { l.virtual_stages = 2; }), "--virtual-stages 2 needs --schedule interleaved"},
      {refusal([](LayoutConfig& l) { l.schedule = "gpipe"; }), "--schedule gpipe needs --pp 2 or more"},
      {refusal([](LayoutConfig& l) {
         l.pp = 2;
         l.schedule = "interleaved";
       }),
       "--schedule interleaved needs --pp 2 or more and --virtual-stages 2 or more; got --pp 2 --virtual-stages 1"},
      {refusal([](LayoutConfig& l) { l.zero = 4; }), "--zero 4 is not a ZeRO stage"},
      {refusal([](LayoutConfig& l) {
         l.pp = 2;
         l.zero = 2;
       }),
       "--zero 2 with --pp 2: ZeRO stages 2 and 3 reduce and gather per micro-batch"},
      {refusal([](LayoutConfig& l) {
         l.pp = 2;
         l.schedule = "zb";
         l.recompute = recompute::Mode::full;
       }),
       "--schedule zb keeps each block's activations for its deferred weight pass"},
      {refusal([](LayoutConfig& l) { l.precision = DType::i32; }), "is not one of fp32, bf16, fp16"},
      {refusal([](LayoutConfig& l) { l.micro_batch = 0; }), "--micro-batch 0; use at least 1 sequence"},
      {refusal([](LayoutConfig& l) { l.grad_accum = 0; }), "--grad-accum 0; use at least 1 micro-batch"},
      {refusal([](LayoutConfig& l) { l.data.bucket_bytes = 0; }), "the gradient bucket size is 0 bytes"},
      {refusal([](LayoutConfig& l) { l.partition = "3,x"; }), "--partition '3,x' is not even, parameters or a"},
      {refusal([](LayoutConfig& l) { l.dp = 0; }), "the layout's degrees are tp 1, cp 1, pp 1, dp 0"},
  };
  for (const auto& [message, want] : cases) {
    CAPTURE(message);
    CHECK(message.find(want) != std::string::npos);
  }
  LayoutConfig l{.tp = 3};
  CHECK(error_of([&] { l.fit_world(4); }).find("--tp 3 does not divide the 4 ranks") != std::string::npos);
  LayoutConfig p{.tp = 2, .pp = 3};
  CHECK(error_of([&] { p.fit_world(8); }).find("--tp 2 x --pp 3 does not divide the 8 ranks") != std::string::npos);
}

TEST_CASE("layout: dispatch calls the policy of the layout's precision and ZeRO stage") {
  auto name_of_policy = [](const LayoutConfig& l) {
    return parallel::dispatch<backend::Cpu>(l, []<class Policy>() { return std::string(Policy::kName); });
  };
  CHECK(name_of_policy({}) == std::string(parallel::ConfiguredPolicy<backend::Cpu, precision::FP32, 0>::kName));
  CHECK(name_of_policy({.zero = 2, .precision = DType::bf16}) ==
        std::string(parallel::ConfiguredPolicy<backend::Cpu, precision::BF16Mixed, 2>::kName));
  CHECK(name_of_policy({.zero = 3, .precision = DType::f16}) ==
        std::string(
            parallel::ConfiguredPolicy<backend::Cpu, precision::FP16Mixed<precision::DynamicLossScale>, 3>::kName));
  // ZeRO 2 and 3 name no pipeline (the layout refuses a pipeline with them); 0 and 1 the
  // configured schedule and recomputation.
  static_assert(
      std::is_same_v<parallel::ConfiguredPolicy<backend::Cpu, precision::FP32, 2>::pipeline, parallel::NoPipeline>);
  static_assert(std::is_same_v<parallel::ConfiguredPolicy<backend::Cpu, precision::FP32, 1>::pipeline,
                               parallel::Pipeline<schedule::Configured>>);
  static_assert(
      std::is_same_v<parallel::ConfiguredPolicy<backend::Cpu, precision::FP32, 1>::recompute, recompute::Configured>);
  CHECK(error_of([&] { name_of_policy({.zero = 7}); }).find("--zero 7 is not a ZeRO stage") != std::string::npos);
}

TEST_CASE("layout: layout_of<Policy> takes what the policy fixes") {
  using Fixed = Compose<precision::BF16Mixed, parallel::Pipeline<schedule::Interleaved1F1B<3>>,
                        parallel::Data<zero::Stage<1>>, recompute::Selective>;
  const LayoutConfig l = parallel::layout_of<Fixed>();
  CHECK(l.precision == DType::bf16);
  CHECK(l.zero == 1);
  CHECK(l.schedule == "interleaved");
  CHECK(l.virtual_stages == 3);
  CHECK(l.recompute == recompute::Mode::selective);
  const LayoutConfig configured = parallel::layout_of<parallel::ConfiguredPolicy<backend::Cpu, precision::FP32, 0>>();
  CHECK(configured.schedule == "1f1b");
  CHECK(configured.recompute == recompute::Mode::none);
}

TEST_CASE("layout: a GPT-2's partition follows the layout's rule") {
  // The token table weighs about 2 blocks, on the first stage (the embedding) and the
  // last (the tied head).
  models::GPT2Config cfg{.layers = 8, .heads = 4, .dim = 64, .max_seq = 32, .vocab = 1536, .padded_vocab = 1536};
  LayoutConfig l{.pp = 4, .schedule = "gpipe"};
  CHECK(models::partition_of(cfg, l).describe() == "2,2,2,2");
  l.partition = "parameters";  // the fewest blocks at the ends
  CHECK(models::partition_of(cfg, l).describe() == "1,3,3,1");
  l.partition = "1,2,3,2";
  CHECK(models::partition_of(cfg, l).describe() == "1,2,3,2");
  l.partition = "1,2,3,3";
  CHECK(error_of([&] { static_cast<void>(models::partition_of(cfg, l)); }).find("8") != std::string::npos);
  CHECK(cfg.num_parameters() == cfg.embedding_parameters() + cfg.layers * cfg.block_parameters() + 2 * cfg.dim);
}

// A model of a composed policy: its storage type and backend are the policy's, and the
// Trainer runs that policy without naming it again.
using Bf16Zero1 = Compose<precision::BF16Mixed, parallel::Data<zero::Stage<1>>>;
static_assert(std::is_same_v<models::GPT2<Bf16Zero1>::value_type, bf16> &&
              std::is_same_v<models::GPT2<Bf16Zero1>::BackendTag, backend::Cpu> &&
              std::is_same_v<train::PolicyOf<models::GPT2<Bf16Zero1>>, Bf16Zero1> &&
              std::is_same_v<train::PolicyOf<models::GPT2<bf16>>, Compose<precision::BF16Mixed>>);

TEST_CASE("layout: a model built from the grid and the layout holds this rank's split and stage") {
  using Policy = Compose<parallel::Pipeline<schedule::Configured>>;
  const models::GPT2Config cfg{.layers = 6, .heads = 2, .dim = 16, .max_seq = 8, .vocab = 32, .padded_vocab = 32};
  std::vector<std::string> seen(8);
  std::vector<std::string> refused(8);
  comm::run_threads(8, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    LayoutConfig layout = parallel::layout_of<Policy>();
    layout.tp = 2;
    layout.sp = true;
    layout.pp = 2;
    layout.virtual_stages = 3;
    layout.schedule = "interleaved";
    layout.fit_world(8).validate();
    comm::Grid grid(world, {.tp = layout.tp, .pp = layout.pp});
    models::GPT2<Policy> model(cfg, 1, grid, layout);
    // The same model from values: the tp group and the placement written out.
    models::GPT2<float> by_values(
        cfg, 1, nn::TensorParallelGroup(&grid.tp(), true),
        {.stages = 2, .chunks = 3, .rank = grid.coords().pp, .partition = models::partition_of(cfg, layout)});
    const auto& pl = model.placement();
    std::string s = std::to_string(model.tensor_parallel().size()) +
                    (model.tensor_parallel().sequence_parallel() ? " sp" : "") + " stage " + std::to_string(pl.rank) +
                    " of " + std::to_string(pl.stages) + " x " + std::to_string(pl.chunks) + " partition " +
                    pl.partition.describe();
    CHECK(model.parameter_store().flat_size() == by_values.parameter_store().flat_size());
    for (std::int64_t i = 0; i < model.parameter_store().flat_size(); ++i)
      REQUIRE(model.parameter_store().values()[i] == by_values.parameter_store().values()[i]);
    // Without a layout: the grid's sizes, no sequence parallelism, an even partition.
    const models::GPT2<Policy> from_grid(cfg, 1, grid);
    s += from_grid.tensor_parallel().sequence_parallel() ? " / sp" : " / no sp";
    s += " " + from_grid.placement().partition.describe();
    seen[static_cast<std::size_t>(world.rank())] = s;
    LayoutConfig other = layout;
    other.tp = 1;
    other.dp = 4;
    refused[static_cast<std::size_t>(world.rank())] =
        error_of([&] { const models::GPT2<Policy> wrong(cfg, 1, grid, other); });
  });
  // Ranks are tp-fastest: world rank r is tp r % 2, stage r / 4.
  CHECK(seen[0] == "2 sp stage 0 of 2 x 3 partition 1,1,1,1,1,1 / no sp 3,3");
  CHECK(seen[5] == "2 sp stage 1 of 2 x 3 partition 1,1,1,1,1,1 / no sp 3,3");
  CHECK(refused[0].find("the layout is tp 1 x pp 2 but the grid's groups are tp 2 x pp 2") != std::string::npos);
}

// The models the trainer takes are pipeline::Models, nn::Models with a placement (a model
// missing a member is tests/compile_fail/model_missing_{token_table,placement}.cpp).
static_assert(pipeline::Model<models::GPT2<float>> && pipeline::check_model<models::GPT2<bf16>>());

TEST_CASE("layout: the trainer refuses a layout that is not its model's, groups', loader's or policy's") {
  using Model = models::GPT2<float>;
  using Policy = Compose<parallel::Data<zero::Stage<1>>>;
  const models::GPT2Config cfg{.layers = 2, .heads = 2, .dim = 16, .max_seq = 8, .vocab = 32, .padded_vocab = 32};
  std::vector<std::uint16_t> tokens(4000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint16_t>(i * 7 % 32);
  const data::TokenDataset dataset = data::TokenDataset::from_tokens(tokens, 32, "tokens");
  std::vector<std::string> messages(2);
  comm::run_threads(2, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    comm::Grid grid(world, {});
    backend::cpu::Context ctx;
    Model model(cfg, 1);
    data::DataLoader loader(dataset, {.batch_size = 2, .seq_len = 8, .rank = grid.dp().rank(), .world = 2});
    LayoutConfig good = parallel::layout_of<Policy>();
    good.fit_world(2);
    good.micro_batch = 2;
    auto make = [&](const LayoutConfig& l) {
      train::Trainer<Model, Policy> trainer(ctx, model, {}, {.peak_lr = 1e-3f, .total_steps = 1}, loader,
                                            {.steps = 1, .layout = l}, parallel::Groups::of(grid));
    };
    make(good);
    std::string all;
    for (auto edit : std::vector<void (*)(LayoutConfig&)>{
             [](LayoutConfig& l) { l.zero = 0; },
             [](LayoutConfig& l) { l.precision = DType::bf16; },
             [](LayoutConfig& l) { l.dp = 1; },
             [](LayoutConfig& l) { l.micro_batch = 4; },
             [](LayoutConfig& l) {
               l.tp = 2;
               l.dp = 1;
             },
             [](LayoutConfig& l) { l.recompute = recompute::Mode::full; },
         }) {
      LayoutConfig l = good;
      edit(l);
      all += error_of([&] { make(l); }) + "\n";
    }
    messages[static_cast<std::size_t>(world.rank())] = all;
  });
  const std::string& m = messages[0];
  CAPTURE(m);
  CHECK(m.find("the layout's ZeRO stage is 0 but the policy's is parallel::Data<zero::Stage<1>>") != std::string::npos);
  CHECK(m.find("the layout's precision is bf16 but the policy's is precision::FP32") != std::string::npos);
  CHECK(m.find("the layout is dp 1 but the data-parallel group has 2 ranks") != std::string::npos);
  CHECK(m.find("the layout's micro-batch is 4 sequences but the loader reads 2") != std::string::npos);
  CHECK(m.find("the layout is tp 2 without sequence parallelism but the model is split over 1 ranks") !=
        std::string::npos);
  CHECK(m.find("the layout's recomputation disagrees with the policy's recompute::None") != std::string::npos);
  CHECK(messages[1] == messages[0]);
}

TEST_CASE("layout: a fixed schedule or recomputation tag and a layout that says otherwise are refused") {
  using Model = models::GPT2<float>;
  const models::GPT2Config cfg{.layers = 2, .heads = 2, .dim = 16, .max_seq = 8, .vocab = 32, .padded_vocab = 32};
  std::vector<std::uint16_t> tokens(4000, 3);
  const data::TokenDataset dataset = data::TokenDataset::from_tokens(tokens, 32, "tokens");
  backend::cpu::Context ctx;
  Model model(cfg, 1);
  data::DataLoader loader(dataset, {.batch_size = 1, .seq_len = 8});
  using Full = Compose<recompute::Full>;
  LayoutConfig l = parallel::layout_of<Full>();
  CHECK(l.recompute == recompute::Mode::full);
  l.recompute = recompute::Mode::none;
  CHECK(error_of([&] {
          train::Trainer<Model, Full> t(ctx, model, {}, {.peak_lr = 1e-3f, .total_steps = 1}, loader,
                                        {.steps = 1, .layout = l});
        }).find("the layout's recomputation disagrees with the policy's recompute::Full") != std::string::npos);
}
