// MpiComm's operations (include/llmpar/comm/mpi_comm-inl.hpp), compiled once for a
// program built with LLMPAR_COMPILED and LLMPAR_WITH_MPI.
#if defined(LLMPAR_WITH_MPI)
#include "llmpar/comm/mpi_comm-inl.hpp"
#endif
