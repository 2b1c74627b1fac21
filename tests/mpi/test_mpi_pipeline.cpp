// A pipeline across MPI processes (run with 2 and 4) computes the serial run: 2 stages
// (x dp 2 on 4 processes, ZeRO 1) under 1F1B, ZB-H1 and interleaved 1F1B, the first
// step's gradients, the losses and the parameters after five steps within 1e-5
// relative, and the last stage's copy of the tied token table equal to the first
// stage's. Each process also runs the serial model itself (a thread world of one); the
// processes add up the parts they own (disjoint: a stage's parameters, ZeRO 1's blocks)
// so every rank compares whole tensors.
#include <doctest/doctest.h>

#include <algorithm>
#include <mutex>
#include <span>
#include <string>

#include "../data_parallel_test_util.hpp"
#include "llmpar/comm/mpi_comm.hpp"
#include "llmpar/comm/thread_comm.hpp"

using namespace llmpar;

namespace {

using Pipelined = Compose<backend::Cpu, parallel::Pipeline<schedule::Configured>, parallel::Data<zero::Stage<1>>,
                          recompute::Configured>;
using Serial = Compose<backend::Cpu>;

// The sum over every process of a full tensor each holds part of (zeros elsewhere).
void sum_over(comm::Comm& world, std::vector<float>& full, std::size_t size) {
  full.resize(size, 0.0f);
  world.all_reduce(std::span<float>(full), comm::ReduceOp::sum);
}

void check_schedule(const std::string& schedule, int chunks) {
  comm::Comm world(comm::MpiComm::world());
  const int dp = world.size() / 2;
  const dp_test::Layout layout{
      .micro_batch = 1, .accum = 4, .layers = 4, .pp = 2, .chunks = chunks, .schedule = schedule};
  std::mutex mutex;
  dp_test::Run serial;
  comm::run_threads(1, [&](comm::ThreadComm& thread_world) {
    comm::Comm one(std::move(thread_world));
    dp_test::Layout whole{.micro_batch = layout.micro_batch * dp, .accum = layout.accum, .layers = layout.layers};
    dp_test::train<Serial>(one, 1, whole, serial, mutex);
  });
  dp_test::Run run;
  dp_test::train<Pipelined>(world, 1, layout, run, mutex);
  for (std::size_t k = 0; k < serial.grads.size(); ++k) {
    sum_over(world, run.grads[k], serial.grads[k].size());
    sum_over(world, run.params[k], serial.params[k].size());
  }
  const auto wte =
      static_cast<std::size_t>(std::find(serial.names.begin(), serial.names.end(), "wte") - serial.names.begin());
  sum_over(world, run.head_copy_grad, serial.grads[wte].size());
  sum_over(world, run.head_copy_param, serial.params[wte].size());
  dp_test::share_series(world, run, serial.losses.size());
  const dp_test::Difference d = dp_test::compare(run, serial);
  INFO(schedule << " (" << chunks << " chunks) over " << world.size() << " processes: losses " << d.loss
                << ", gradients " << d.grad << " (" << d.worst_grad << "), parameters " << d.param << " ("
                << d.worst_param << ")");
  CHECK(d.loss <= 1e-5);
  CHECK(d.norm <= 1e-5);
  CHECK(d.grad <= 1e-5);
  CHECK(d.param <= 1e-5);
  CHECK(run.head_copy_grad == run.grads[wte]);
  CHECK(run.head_copy_param == run.params[wte]);
}

}  // namespace

TEST_CASE("a 2-stage pipeline over MPI processes equals the serial run") {
  check_schedule("1f1b", 1);
  check_schedule("zb", 1);
  check_schedule("interleaved", 2);
}
