// A blocking all_reduce that the last rank never joins: the others' watchdog must print
// an error naming the collective, the group and the missing rank, then abort the job
// (ctest matches the message; see CMakeLists.txt). The last rank sleeps until then.
#include <chrono>
#include <cstdio>
#include <exception>
#include <llmpar/comm/mpi_comm.hpp>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  try {
    llmpar::comm::MpiEnvironment mpi(argc, argv);
    llmpar::comm::MpiOptions options;
    options.timeout = std::chrono::milliseconds(300);
    auto world = llmpar::comm::MpiComm::world(options);
    if (world.rank() == world.size() - 1) {
      std::this_thread::sleep_for(std::chrono::seconds(100));
      return 1;
    }
    std::vector<float> data(16, 1.0f);
    world.all_reduce(data);
    std::printf("the all_reduce completed without the last rank\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
