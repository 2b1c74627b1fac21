// bench_pipeline — the bubble of each pipeline schedule as the executor measures it: a
// small GPT (L=8, H=4, C=256, T=64, micro-batch 2) on p = 2 and 4 thread ranks, one
// stage each, for GPipe, 1F1B, interleaved 1F1B (2 chunks per rank) and ZB-H1 at m = 4,
// 8 and 16 micro-batches per step.
//
// Counters, the mean over ranks of the timed steps' medians:
//   bubble        a rank's time waiting for another stage over its time computing
//                 (idle / busy): 1F1B and GPipe's (p - 1)/m, interleaved's (p - 1)/(v m)
//   predicted     the same from the checker's simulation with F = 1, B = 2 (W = 1)
//   theory        (p - 1)/m, or (p - 1)/(v m) interleaved
//   stash_MiB     rank 0's peak of stashed activations (GPipe m micro-batches, 1F1B p)
//   ms/step       the step
// Thread ranks share this machine's cores (each rank gets one OpenMP thread), so a
// rank's computing is slower than alone and a stage waits for its neighbour's core as
// well as for its data: the bubble here is the executor's measured idle time, not a
// wall-clock speed-up.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <llmpar/llmpar.hpp>
#include <mutex>
#include <string>
#include <vector>

using namespace llmpar;

namespace {

constexpr int kSteps = 3;  // timed steps, after one warm-up step

struct Measured {
  double bubble = 0.0, predicted = 0.0, ms = 0.0, stash_mib = 0.0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Measured run(int pp, int m, const std::string& schedule) {
  using Policy = Compose<backend::Cpu, parallel::Pipeline<schedule::Configured>, recompute::Configured>;
  using Model = models::GPT2<float>;
  const int chunks = schedule == "interleaved" ? 2 : 1;
  const models::GPT2Config cfg{.layers = 8, .heads = 4, .dim = 256, .max_seq = 64, .vocab = 256, .padded_vocab = 256};
  std::vector<std::uint16_t> tokens(1 << 16);
  const auto stream = rng::Stream::named(1, "bench tokens");
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint16_t>(stream.bits(i)[0] % cfg.vocab);
  const data::TokenDataset dataset = data::TokenDataset::from_tokens(tokens, 256, "bench tokens");
  Measured out;
  std::mutex mutex;
  comm::ThreadOptions options;
  options.omp_threads_per_rank = 1;
  comm::run_threads(
      pp,
      [&](comm::ThreadComm& thread_world) {
        comm::Comm world(std::move(thread_world));
        comm::Grid grid(world, {.pp = pp});
        backend::cpu::Context ctx;
        const pipeline::Placement placement{.stages = pp,
                                            .chunks = chunks,
                                            .rank = grid.coords().pp,
                                            .partition = pipeline::even_partition(cfg.layers, pp, chunks)};
        Model model(cfg, 1337, {}, placement);
        data::DataLoader loader(dataset, {.batch_size = 2, .seq_len = 64});
        parallel::LayoutConfig layout = parallel::layout_of<Policy>();
        layout.pp = pp;
        layout.fit_world(pp);
        layout.schedule = schedule;
        layout.virtual_stages = chunks;
        layout.micro_batch = 2;
        layout.grad_accum = m;
        train::Trainer<Model, Policy> trainer(ctx, model, {.lr = 1e-4f},
                                              {.peak_lr = 1e-4f, .warmup_steps = 0, .total_steps = kSteps + 1}, loader,
                                              {.steps = kSteps + 1, .layout = layout}, parallel::Groups::of(grid));
        trainer.step();
        std::vector<double> bubble, ms;
        for (int s = 0; s < kSteps; ++s) {
          const train::StepStats st = trainer.step();
          const double idle = trainer.executor().idle_seconds(), step = trainer.executor().step_seconds();
          bubble.push_back(idle / std::max(1e-12, step - idle));
          ms.push_back(st.ms);
        }
        const pipeline::RankReport& r =
            trainer.executor().predicted().ranks[static_cast<std::size_t>(grid.coords().pp)];
        const std::lock_guard<std::mutex> lock(mutex);
        out.bubble += median(bubble) / pp;
        out.predicted += r.idle / r.busy / pp;
        if (world.rank() == 0) {
          out.ms = median(ms);
          out.stash_mib = static_cast<double>(trainer.executor().peak_stash_bytes()) / (1 << 20);
        }
      },
      options);
  return out;
}

void register_all() {
  for (int pp : {2, 4})
    for (const std::string schedule : {"gpipe", "1f1b", "interleaved", "zb"})
      for (int m : {4, 8, 16}) {
        const std::string name = "pp:" + std::to_string(pp) + "/" + schedule + "/m:" + std::to_string(m);
        const int v = schedule == "interleaved" ? 2 : 1;
        benchmark::RegisterBenchmark(name.c_str(),
                                     [pp, m, schedule, v](benchmark::State& state) {
                                       Measured r;
                                       for (auto _ : state) {
                                         r = run(pp, m, schedule);
                                         state.SetIterationTime(r.ms * 1e-3);
                                       }
                                       state.counters["bubble"] = r.bubble;
                                       state.counters["predicted"] = r.predicted;
                                       state.counters["theory"] = (pp - 1.0) / (v * m);
                                       state.counters["stash_MiB"] = r.stash_mib;
                                       state.counters["ms/step"] = r.ms;
                                     })
            ->Iterations(1)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    benchmark::Initialize(&argc, argv);
    register_all();
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pipeline: %s\n", e.what());
    return 1;
  }
}
