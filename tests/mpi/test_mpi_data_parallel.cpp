// ZeRO stages 1 and 3 across MPI processes (run with 2 and 4) compute the serial run:
// the first step's reduced gradients, the losses and the parameters after five steps,
// within 1e-5 relative. Each process also runs the serial model itself (a thread world
// of one), and the processes add up the parts they own (disjoint under ZeRO 1 and 3) so
// every rank compares whole tensors.
#include <doctest/doctest.h>

#include <mutex>
#include <span>

#include "../data_parallel_test_util.hpp"
#include "llmpar/comm/mpi_comm.hpp"
#include "llmpar/comm/thread_comm.hpp"

using namespace llmpar;

namespace {

template <int kStage>
using Stage = Compose<backend::Cpu, parallel::Data<zero::Stage<kStage>>>;

template <int kStage>
void check_stage(const dp_test::Layout& layout) {
  comm::Comm world(comm::MpiComm::world());
  const int dp = world.size();
  std::mutex mutex;
  dp_test::Run serial;
  comm::run_threads(1, [&](comm::ThreadComm& thread_world) {
    comm::Comm one(std::move(thread_world));
    dp_test::Layout whole = layout;
    whole.micro_batch *= dp;
    dp_test::train<Stage<0>>(one, 1, whole, serial, mutex);
  });
  dp_test::Run run;
  dp_test::train<Stage<kStage>>(world, 1, layout, run, mutex);
  // Every element is owned by one rank: the sum over ranks is the whole tensor (a rank
  // that owns none of a parameter contributes zeros).
  run.grads.resize(serial.grads.size());
  run.params.resize(serial.params.size());
  for (std::size_t k = 0; k < serial.grads.size(); ++k) {
    run.grads[k].resize(serial.grads[k].size(), 0.0f);
    run.params[k].resize(serial.params[k].size(), 0.0f);
    world.all_reduce(std::span<float>(run.grads[k]), comm::ReduceOp::sum);
    world.all_reduce(std::span<float>(run.params[k]), comm::ReduceOp::sum);
  }
  run.names = serial.names;
  dp_test::share_series(world, run, serial.losses.size());
  const dp_test::Difference d = dp_test::compare(run, serial);
  INFO("stage " << kStage << " over " << dp << " processes, accumulation " << layout.accum << ": losses " << d.loss
                << ", gradients " << d.grad << " (" << d.worst_grad << "), parameters " << d.param << " ("
                << d.worst_param << ")");
  CHECK(d.loss <= 1e-5);
  CHECK(d.norm <= 1e-5);
  CHECK(d.grad <= 1e-5);
  CHECK(d.param <= 1e-5);
}

}  // namespace

TEST_CASE("ZeRO stage 3 over MPI processes equals the serial run, with and without accumulation") {
  check_stage<3>({.accum = 1});
  check_stage<3>({.accum = 2});
}

TEST_CASE("ZeRO stage 1 over MPI processes equals the serial run") { check_stage<1>({.accum = 2}); }
