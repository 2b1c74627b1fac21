// llmpar::init: the launch picks the engine; flags it reads leave argv; bad values say
// what would work; comm::Comm carries any engine behind the Communicator interface.
#include <doctest/doctest.h>

#include <atomic>
#include <string>
#include <vector>

#include "llmpar/comm/grid.hpp"
#include "llmpar/comm/init.hpp"

using namespace llmpar;

namespace {

// A mutable argv built from strings, as main() receives it.
struct Args {
  explicit Args(std::vector<std::string> a) : storage(std::move(a)) {
    for (auto& s : storage) pointers.push_back(s.data());
    pointers.push_back(nullptr);
    argc = static_cast<int>(storage.size());
  }
  std::vector<std::string> left() const { return {pointers.begin(), pointers.begin() + argc}; }
  std::vector<std::string> storage;
  std::vector<char*> pointers;
  int argc = 0;
};

}  // namespace

TEST_CASE("init: --ranks N runs the body on N thread ranks and leaves the other flags to the trainer") {
  Args args({"train", "--steps", "5", "--ranks", "3", "--comm-timeout=30", "--lr", "1e-3"});
  auto launch = init(args.argc, args.pointers.data());
  CHECK(launch.engine() == Engine::thread);
  CHECK(launch.world_size() == 3);
  CHECK(launch.options().timeout == std::chrono::seconds(30));
  CHECK(args.left() == std::vector<std::string>{"train", "--steps", "5", "--lr", "1e-3"});
  std::atomic<int> total{0};
  launch.run([&](comm::Comm& world) {
    CHECK(world.size() == 3);
    CHECK(world.engine_name() == "thread");
    std::vector<std::int32_t> v{world.rank() + 1};
    world.all_reduce(v);
    CHECK(v[0] == 6);
    comm::Grid grid(world, {.tp = 3});
    std::vector<float> x(5, 1.f);
    auto request = grid.tp().all_reduce_async(x);
    request.wait();
    CHECK(x[4] == 3.f);
    total += world.rank();
  });
  CHECK(total.load() == 3);
}

TEST_CASE("init: without flags there is one rank") {
  Args args({"train", "--ranks=1"});
  auto launch = init(args.argc, args.pointers.data());
  CHECK(launch.world_size() == 1);
  CHECK(args.left() == std::vector<std::string>{"train"});
  Args none({"train"});
  CHECK(init(none.argc, none.pointers.data()).world_size() == 1);
}

TEST_CASE("init: bad --ranks and --comm-timeout values name the value and an example") {
  Args zero({"train", "--ranks", "0"});
  CHECK_THROWS_WITH_AS(init(zero.argc, zero.pointers.data()),
                       doctest::Contains("--ranks 0 is not a positive whole number; e.g. --ranks 4"), Error);
  Args word({"train", "--ranks", "four"});
  CHECK_THROWS_WITH_AS(init(word.argc, word.pointers.data()), doctest::Contains("--ranks four is not a positive"),
                       Error);
  Args missing({"train", "--ranks"});
  CHECK_THROWS_WITH_AS(init(missing.argc, missing.pointers.data()),
                       doctest::Contains("--ranks needs a value, e.g. --ranks 4"), Error);
  Args timeout({"train", "--comm-timeout", "-5"});
  CHECK_THROWS_WITH_AS(init(timeout.argc, timeout.pointers.data()),
                       doctest::Contains("--comm-timeout -5 is not a positive whole number"), Error);
  Args cuda({"train", "--ranks", "2"});
  InitOptions options;
  options.device = Device::cuda;
  CHECK_THROWS_WITH_AS(init(cuda.argc, cuda.pointers.data(), options),
                       doctest::Contains("the CUDA backend runs one process per GPU: start it with mpirun -np 2"),
                       Error);
}

TEST_CASE("init: a rank that throws inside run() is rethrown by run()") {
  Args args({"train", "--ranks", "2"});
  auto launch = init(args.argc, args.pointers.data());
  CHECK_THROWS_WITH_AS(launch.run([](comm::Comm& world) {
    if (world.rank() == 1) throw Error("bad shard on rank 1", __FILE__, __LINE__);
    world.barrier();
  }),
                       "bad shard on rank 1", Error);
}
