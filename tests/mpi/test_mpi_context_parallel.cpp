// Context parallelism across MPI processes (run with 2 and 4) computes the serial run:
// ring attention with its K/V blocks and their gradients passed between processes, and
// the all-to-all over the heads, for GPT-2 (learned positions) and Llama (rotary
// positions, grouped-query attention), at cp = the number of processes, cp 2 x dp 2
// with ZeRO 1 (both ways), and cp 2 x tp 2 with sequence parallelism (4 processes): the
// first step's reduced gradients, the losses and norms of five steps and the parameters
// after them, within 1e-5 relative (fp32).
// Each process also runs the serial model itself (dp_test::serial_run: a thread world of
// one). Without tp or ZeRO every process holds every reduced gradient and parameter and
// compares its own; otherwise the processes put the whole tensors together from their
// parts (assemble).
#include <doctest/doctest.h>

#include <cstddef>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "../data_parallel_test_util.hpp"
#include "llmpar/comm/mpi_comm.hpp"
#include "llmpar/comm/thread_comm.hpp"

using namespace llmpar;

namespace {

using Replicated = Compose<backend::Cpu, parallel::Data<zero::Stage<0>>>;
using Sharded = Compose<backend::Cpu, parallel::Data<zero::Stage<1>>>;

// The whole tensor from every process's part of it (zeros where a process holds none):
// each element is the mean over the processes holding a non-zero value there. A split
// parameter's element is held by one tp rank, a replicated one (a norm's weight under
// tp) by every tp rank, a ZeRO 1 block by one dp x cp rank; an element zero in the
// serial run (the padded vocabulary's rows) is zero everywhere.
void assemble(comm::Comm& world, std::vector<float>& full, std::size_t size) {
  full.resize(size, 0.0f);
  std::vector<float> holders(size);
  for (std::size_t i = 0; i < size; ++i) holders[i] = full[i] != 0.0f ? 1.0f : 0.0f;
  world.all_reduce(std::span<float>(full), comm::ReduceOp::sum);
  world.all_reduce(std::span<float>(holders), comm::ReduceOp::sum);
  for (std::size_t i = 0; i < size; ++i)
    if (holders[i] > 0.0f) full[i] /= holders[i];
}

// Every process gets rank 0's losses and norms, then checks.
void check_on_every_process(comm::Comm& world, dp_test::Run& run, const dp_test::Run& reference,
                            const std::string& what) {
  dp_test::share_series(world, run, reference.losses.size());
  dp_test::check_close(
      run, reference,
      what + " over " + std::to_string(world.size()) + " processes, rank " + std::to_string(world.rank()));
}

// The run of Policy on the MPI world split as tp x cp x dp, its tensors put together
// from the processes' parts, against the serial run.
template <class Policy, class Spec>
void check_layout(const dp_test::Layout& layout, int tp, const std::string& what) {
  comm::Comm world(comm::MpiComm::world());
  const int dp = world.size() / (tp * layout.cp);
  const dp_test::Run reference = dp_test::serial_run<Replicated, Spec>(layout, dp);
  dp_test::Run run;
  std::mutex mutex;
  dp_test::train<Policy, Spec>(world, tp, layout, run, mutex);
  for (std::size_t k = 0; k < reference.grads.size(); ++k) {
    assemble(world, run.grads[k], reference.grads[k].size());
    assemble(world, run.params[k], reference.params[k].size());
  }
  check_on_every_process(world, run, reference, what);
}

dp_test::Layout cp_layout(int cp) {
  dp_test::Layout layout;
  layout.micro_batch = 1;
  layout.accum = 2;
  layout.cp = cp;
  return layout;
}

int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

}  // namespace

TEST_CASE_TEMPLATE("context parallelism over every MPI process (cp 2 on 2, cp 4 on 4) computes the serial run", Spec,
                   models::GPT2Spec, models::LlamaSpec) {
  comm::Comm world(comm::MpiComm::world());
  if (world.size() == 1) {
    MESSAGE("skipped: needs 2 ranks or more (run under mpirun)");
    return;
  }
  dp_test::Layout layout = cp_layout(world.size());
  layout.micro_batch = 2;
  const dp_test::Run reference = dp_test::serial_run<Replicated, Spec>(layout);
  dp_test::Run run;
  std::mutex mutex;
  dp_test::train<Replicated, Spec>(world, 1, layout, run, mutex);  // every process holds every tensor: its own check
  check_on_every_process(world, run, reference, "cp " + std::to_string(world.size()));
}

TEST_CASE_TEMPLATE("cp 2 x dp 2 (ZeRO 1; cp 2 alone on 2 processes) over MPI processes computes the serial run", Spec,
                   models::GPT2Spec, models::LlamaSpec) {
  if (world_size() % 2 != 0) {
    MESSAGE("skipped: needs an even number of ranks (run under mpirun)");
    return;
  }
  check_layout<Sharded, Spec>(cp_layout(2), 1, "cp 2 x dp " + std::to_string(world_size() / 2) + ", ZeRO 1");
}

TEST_CASE_TEMPLATE("the all-to-all over the heads, cp 2 x dp (ZeRO 1) over MPI processes, computes the serial run",
                   Spec, models::GPT2Spec, models::LlamaSpec) {
  if (world_size() % 2 != 0) {
    MESSAGE("skipped: needs an even number of ranks (run under mpirun)");
    return;
  }
  dp_test::Layout layout = cp_layout(2);
  layout.cp_comm = nn::CpComm::all_to_all;
  check_layout<Sharded, Spec>(layout, 1, "cp 2 a2a x dp " + std::to_string(world_size() / 2) + ", ZeRO 1");
}

TEST_CASE_TEMPLATE("cp 2 x tp 2 with sequence parallelism over 4 MPI processes computes the serial run", Spec,
                   models::GPT2Spec, models::LlamaSpec) {
  if (world_size() != 4) {
    MESSAGE("skipped: needs 4 ranks");
    return;
  }
  dp_test::Layout layout = cp_layout(2);
  layout.sp = true;
  check_layout<Replicated, Spec>(layout, 2, "cp 2 x tp 2 sp");
}
