// Pipeline parallelism and recomputation on the CUDA backend:
//   - one GPU: GPT-2 (fp32, bf16) trained for 3 steps with recompute::Configured set to
//     none, selective and full gives bitwise the same losses and parameters (the same
//     kernels on the same inputs, rerun in backward);
//   - two GPUs (mpirun -np 2, NCCL): a 2-stage pipeline under 1F1B, GPipe, ZB-H1 and
//     interleaved 1F1B (2 chunks per rank) trains as the whole model does on one GPU:
//     the same losses to 1e-5 relative and every stage's parameters (the last stage's
//     copy of the tied token table too) to 1e-5 of the whole model's. The activations
//     and gradients travel as batched NCCL sends and receives between the GPUs.
// Exit codes: 0 pass, 1 failure, 77 skipped (no CUDA device; the 2-GPU part is skipped
// on one GPU, and needs NCCL).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "gpu_test.hpp"
#include "llmpar/backend/cuda/backend.hpp"
#include "llmpar/comm/grid.hpp"
#include "llmpar/comm/init.hpp"
#include "llmpar/data/dataset.hpp"
#include "llmpar/models/gpt2.hpp"
#include "llmpar/parallel/compose.hpp"
#include "llmpar/pipeline/partition.hpp"
#include "llmpar/train/trainer.hpp"

using namespace llmpar;
using gpu_test::failures;

namespace {

template <class T>
using PolicyFor =
    Compose<backend::Cuda, std::conditional_t<std::is_same_v<T, bf16>, precision::BF16Mixed, precision::FP32>,
            parallel::Pipeline<schedule::Configured>, recompute::Configured>;

struct Result {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> params;  // by name; the head's copy as "wte (head)"
};

models::GPT2Config config() {
  return {.layers = 4, .heads = 4, .dim = 64, .max_seq = 32, .vocab = 96, .padded_vocab = 128, .init_std = 0.05f};
}

// 3 steps of 4 micro-batches of 2; `layout` says the schedule, chunks and
// recomputation, `groups` and `placement` the pipeline (empty: the whole model on this GPU).
template <class T>
Result train(backend::cuda::Context& ctx, const parallel::LayoutConfig& extra, pipeline::Placement placement = {},
             parallel::Groups groups = {}) {
  using Model = models::GPT2<T, backend::Cuda>;
  Model model(config(), 7, {}, placement);
  std::vector<std::uint16_t> tokens(8192);
  const auto stream = rng::Stream::named(3, "gpu pipeline tokens");
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint16_t>(stream.bits(i)[0] % 96);
  const data::TokenDataset dataset = data::TokenDataset::from_tokens(tokens, 96, "tokens");
  data::DataLoader loader(dataset, {.batch_size = 2, .seq_len = 32});
  train::TrainerConfig cfg{.steps = 3, .layout = extra};
  cfg.layout.zero = PolicyFor<T>::kZeroStage;
  cfg.layout.precision = dtype_of<T>();
  cfg.layout.pp = placement.stages;
  cfg.layout.virtual_stages = placement.chunks;
  cfg.layout.micro_batch = 2;
  cfg.layout.grad_accum = 4;
  train::Trainer<Model, PolicyFor<T>> trainer(ctx, model, {.lr = 1e-2f, .eps = 1e-2f, .grad_clip = 0.5f},
                                              {.peak_lr = 1e-2f, .warmup_steps = 0, .total_steps = 3}, loader, cfg,
                                              groups);
  Result r;
  for (int s = 0; s < 3; ++s) r.losses.push_back(trainer.step().loss);
  ctx.synchronize();
  const nn::Parameter<T>* copy = model.tied_copy();
  for (const nn::Parameter<T>* p : model.parameter_store().parameters()) {
    std::vector<T> host(static_cast<std::size_t>(p->numel()));
    LLMPAR_CHECK_CUDA(cudaMemcpy(host.data(), p->value, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
    auto& out = r.params[p == copy ? p->name + " (head)" : p->name];
    for (const T& v : host) out.push_back(static_cast<float>(v));
  }
  return r;
}

template <class T>
void check_recompute(backend::cuda::Context& ctx, const char* precision) {
  const Result none = train<T>(ctx, {.recompute = recompute::Mode::none});
  for (const auto mode : {recompute::Mode::selective, recompute::Mode::full}) {
    const Result r = train<T>(ctx, {.recompute = mode});
    bool same = r.losses == none.losses && r.params.size() == none.params.size();
    for (const auto& [name, values] : none.params)
      same = same && r.params.count(name) &&
             std::memcmp(values.data(), r.params.at(name).data(), values.size() * sizeof(float)) == 0;
    gpu_test::report(same, std::string(precision) + " recompute " +
                               (mode == recompute::Mode::full ? "full" : "selective") +
                               ": losses and parameters bitwise those of no recomputation");
  }
}

#if defined(LLMPAR_WITH_NCCL)
// Rank r of a 2-GPU world: each schedule's 2-stage run against the whole model on this GPU.
void check_pipeline(comm::Comm& world) {
  comm::NcclComm* nccl = world.get<comm::NcclComm>();
  backend::cuda::Context ctx(comm::NcclComm::local_device(MPI_COMM_WORLD), backend::cuda::Fp32Math::strict,
                             nccl->stream());
  nccl->set_compute_stream(ctx.stream());
  const Result whole = train<float>(ctx, {});
  comm::Grid grid(world, {.pp = 2});
  for (const char* schedule : {"1f1b", "gpipe", "zb", "interleaved"}) {
    const int chunks = std::string(schedule) == "interleaved" ? 2 : 1;
    const pipeline::Placement placement{.stages = 2,
                                        .chunks = chunks,
                                        .rank = grid.coords().pp,
                                        .partition = pipeline::even_partition(config().layers, 2, chunks)};
    const Result r = train<float>(ctx, {.schedule = schedule}, placement, parallel::Groups::of(grid));
    double loss = 0.0, param = 0.0;
    for (std::size_t s = 0; s < whole.losses.size(); ++s)
      loss = std::max(loss, std::abs(r.losses[s] - whole.losses[s]) / std::abs(whole.losses[s]));
    bool found = true;
    for (const auto& [name, values] : r.params) {
      const std::string serial = name == "wte (head)" ? "wte" : name;
      found = found && whole.params.count(serial) && whole.params.at(serial).size() == values.size();
      if (!found) break;
      for (std::size_t i = 0; i < values.size(); ++i)
        param = std::max(param, static_cast<double>(std::abs(values[i] - whole.params.at(serial)[i])));
    }
    gpu_test::report(found && loss <= 1e-5 && param <= 1e-5,
                     "rank " + std::to_string(world.rank()) + ": 2-stage " + schedule + " vs the whole model: losses " +
                         std::to_string(loss) + ", parameters " + std::to_string(param));
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  try {
    if (backend::cuda::device_count() == 0) {
      std::printf("skipped: no CUDA device\n");
      return gpu_test::skip_exit_code();
    }
    const int processes = llmpar::detail::launcher_world_size();
    if (processes > 1 && backend::cuda::device_count() < processes) {
      std::printf("skipped: %d processes need as many GPUs, this machine has %d\n", processes,
                  backend::cuda::device_count());
      return gpu_test::skip_exit_code();
    }
    auto launch = init(argc, argv, {.device = Device::cuda});
    launch.run([&](comm::Comm& world) {
      if (world.size() == 1) {
        backend::cuda::Context ctx(0);
        check_recompute<float>(ctx, "fp32");
        check_recompute<bf16>(ctx, "bf16");
        return;
      }
#if defined(LLMPAR_WITH_NCCL)
      if (world.size() == 2) check_pipeline(world);
#endif
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    ++failures;
  }
  std::printf("%s\n", gpu_test::verdict());
  return failures ? 1 : 0;
}
