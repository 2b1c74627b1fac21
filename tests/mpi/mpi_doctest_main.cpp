// The main of the MPI doctest programs: MPI is initialised before doctest runs and
// finalized after it. Every rank runs every test (collectives need them all); ranks
// other than 0 print only failures, and the job fails when any rank failed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <exception>
#include <llmpar/comm/mpi_comm.hpp>

int main(int argc, char** argv) {
  try {
    llmpar::comm::MpiEnvironment mpi(argc, argv);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    doctest::Context context;
    context.applyCommandLine(argc, argv);
    if (rank != 0) {
      context.setOption("minimal", true);
      context.setOption("no-colors", true);
    }
    int failed = context.run() != 0 ? 1 : 0;
    if (context.shouldExit()) return failed;
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return failed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
