# Every dependency comes from the system's package manager (llmpar.sh installs them on
# Debian); nothing is downloaded at build time.
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(dnnl 2.6 CONFIG REQUIRED)          # libdnnl-dev: GEMMs on the CPU
find_package(nlohmann_json 3.10 CONFIG REQUIRED) # nlohmann-json3-dev: metrics, configs
if(LLMPAR_BUILD_EXAMPLES OR LLMPAR_BUILD_BENCHMARKS)
  find_package(CLI11 2.1 CONFIG REQUIRED)       # libcli11-dev: command lines
endif()
if(LLMPAR_BUILD_TESTS)
  find_package(doctest 2.4 CONFIG REQUIRED)     # doctest-dev
endif()
if(LLMPAR_BUILD_BENCHMARKS)
  find_package(benchmark 1.6 CONFIG REQUIRED)   # libbenchmark-dev
endif()
