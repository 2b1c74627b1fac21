# Every dependency comes from the system's package manager (llmpar.sh installs them on
# Debian); nothing is downloaded at build time.
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(dnnl 2.6 CONFIG REQUIRED)          # libdnnl-dev: GEMMs on the CPU
find_package(nlohmann_json 3.10 CONFIG REQUIRED) # nlohmann-json3-dev: metrics, configs
# MPI (libopenmpi-dev, openmpi-bin): the MpiComm engine, on by default where found. llmpar
# calls MPI's C API from C++; FindMPI's C component needs the C language enabled, which
# this project and its users need not have, so MPI is found through the CXX component
# with the MPI-2 C++ bindings skipped (the target then links the C library alone).
if(NOT DEFINED LLMPAR_MPI OR LLMPAR_MPI)
  set(MPI_CXX_SKIP_MPICXX ON CACHE BOOL "llmpar uses MPI's C API: skip the MPI-2 C++ bindings")
  find_package(MPI COMPONENTS CXX)
endif()
option(LLMPAR_MPI "Build the MPI communicator (MpiComm) and its tests (default: ON when MPI is found)" ${MPI_CXX_FOUND})
if(LLMPAR_MPI AND NOT MPI_CXX_FOUND)
  message(FATAL_ERROR "LLMPAR_MPI is ON but no MPI was found. Install one (Debian: libopenmpi-dev openmpi-bin) "
    "or configure with -DLLMPAR_MPI=OFF.")
endif()
if(LLMPAR_BUILD_EXAMPLES OR LLMPAR_BUILD_BENCHMARKS)
  find_package(CLI11 2.1 CONFIG REQUIRED)       # libcli11-dev: command lines
endif()
if(LLMPAR_BUILD_TESTS)
  find_package(doctest 2.4 CONFIG REQUIRED)     # doctest-dev
endif()
if(LLMPAR_BUILD_BENCHMARKS)
  find_package(benchmark 1.6 CONFIG REQUIRED)   # libbenchmark-dev
endif()
