// The data-parallel step never waits for the device on the thread that queues the
// kernels: the bucket reducer and the parameter gatherer order their collectives after
// the kernels that feed them with fences (Backend::Fence; a CUDA event on a GPU), not
// with Backend::synchronize.
//
// The CPU backend's kernels are done when they return, so on the CPU the order cannot go
// wrong either way; what can be checked here is what the library asks of a backend. A
// backend that is backend::Cpu in every operation but counts its synchronize() calls per
// thread and its fences shows, for dp 2 at every ZeRO stage with several buckets: no
// synchronize() on the compute thread during a step, one fence per bucket reduction (and
// per ZeRO-3 gather, and per update at stages 1 and 2), every fence waited once -- by the
// communication thread, except the update fences of stages 1 and 2, which the compute
// thread waits before it sends the updated shard -- and the training run of backend::Cpu
// bit for bit.
#include <doctest/doctest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "data_parallel_test_util.hpp"
#include "llmpar/comm/thread_comm.hpp"

using namespace llmpar;

namespace {

// backend::Cpu, counting.
struct CountingCpu : backend::Cpu {
  static constexpr const char* kName = "cpu (counting)";
  static inline thread_local int syncs = 0;  // synchronize() on this thread
  static inline std::atomic<int> recorded{0}, waited{0}, waited_on_recorder{0};
  static void synchronize(Context&) { ++syncs; }
  struct Fence {
    std::thread::id recorder{};
    void record(Context&) {
      recorder = std::this_thread::get_id();
      ++recorded;
    }
    void wait() const {
      ++waited;
      if (std::this_thread::get_id() == recorder) ++waited_on_recorder;
    }
  };
};

}  // namespace

template <>
struct llmpar::parallel::PolicyTraits<CountingCpu> {
  static constexpr bool kIsPolicy = true;
  using Kind = policy_kind::Backend;
  static constexpr const char* kName = CountingCpu::kName;
};

namespace {

struct Counts {
  std::vector<double> losses;
  std::vector<float> params;  // the values rank 0 owns after the last step
  int syncs = 0;              // on rank 0's compute thread, during the steps
  int buckets = 0;
};

template <class Backend, int kStage>
Counts run_counted(bool overlap) {
  using Policy = Compose<Backend, precision::FP32, parallel::Data<zero::Stage<kStage>>>;
  using Model = models::GPT2<Policy>;
  constexpr int kSteps = 3;
  Counts counts;
  comm::run_threads(2, [&](comm::ThreadComm& thread_world) {
    comm::Comm world(std::move(thread_world));
    comm::Grid grid(world, {});
    backend::cpu::Context ctx;
    Model model(dp_test::config(), 99);
    static const std::vector<std::uint16_t> stream = dp_test::tokens();
    const data::TokenDataset dataset = data::TokenDataset::from_tokens(stream, 50, "dp tokens");
    data::DataLoader loader(dataset, {.batch_size = 2, .seq_len = 16, .rank = world.rank(), .world = 2});
    parallel::LayoutConfig layout = parallel::layout_of<Policy>();
    layout.fit_world(2);
    layout.micro_batch = 2;
    layout.grad_accum = 2;
    layout.data = {.bucket_bytes = 4096, .overlap = overlap};
    train::Trainer<Model> trainer(ctx, model, {}, {.peak_lr = 1e-3f, .total_steps = kSteps}, loader,
                                  {.steps = kSteps, .layout = layout}, parallel::Groups::of(grid));
    std::vector<double> losses;
    const int before = CountingCpu::syncs;
    for (int s = 0; s < kSteps; ++s) losses.push_back(trainer.step().loss);
    const int syncs = CountingCpu::syncs - before;
    if (world.rank() == 0) {
      counts.losses = losses;
      counts.syncs = syncs;
      counts.buckets = trainer.sync().num_buckets();
      trainer.sync().for_each_owned(
          [&](const nn::Parameter<float>&, std::int64_t, const float*, const float* value, std::int64_t n) {
            counts.params.insert(counts.params.end(), value, value + n);
          });
    }
  });
  return counts;
}

template <int kStage>
void check_stage() {
  INFO("ZeRO stage " << kStage);
  CountingCpu::recorded = 0;
  CountingCpu::waited = 0;
  CountingCpu::waited_on_recorder = 0;
  const Counts counted = run_counted<CountingCpu, kStage>(true);
  REQUIRE(counted.buckets >= 3);
  CHECK(counted.syncs == 0);
  // Per rank and step at least one fence per bucket (stages 2, 3 reduce each of the two
  // micro-batches), every one waited on, by the communication thread.
  CHECK(CountingCpu::recorded >= 2 * 3 * counted.buckets);
  CHECK(CountingCpu::waited == CountingCpu::recorded);
  // Stages 1 and 2 wait for the update on the compute thread, once per step (the
  // all-gather of the updated blocks runs there, after the optimizer).
  CHECK(CountingCpu::waited_on_recorder == (kStage == 1 || kStage == 2 ? 2 * 3 : 0));
  const Counts plain = run_counted<backend::Cpu, kStage>(true);
  CHECK(counted.losses == plain.losses);
  CHECK(counted.params == plain.params);
}

}  // namespace

TEST_CASE("a data-parallel step at ZeRO 0-3 orders its collectives by fences, never synchronising the compute thread") {
  check_stage<0>();
  check_stage<1>();
  check_stage<2>();
  check_stage<3>();
}

TEST_CASE("without overlap the reductions run on the compute thread, after waiting on their fences there") {
  CountingCpu::recorded = 0;
  CountingCpu::waited = 0;
  CountingCpu::waited_on_recorder = 0;
  const Counts counted = run_counted<CountingCpu, 0>(false);
  CHECK(counted.syncs == 0);
  CHECK(CountingCpu::recorded == 2 * 3 * counted.buckets);
  CHECK(CountingCpu::waited_on_recorder == CountingCpu::recorded);
}
