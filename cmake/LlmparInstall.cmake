# Install rules and the package config: a user's project does
#   find_package(llmpar) and target_link_libraries(app PRIVATE llmpar::llmpar)
# and, for the CUDA backend where it was built,
#   find_package(llmpar COMPONENTS cuda) and target_link_libraries(app PRIVATE llmpar::cuda).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(LLMPAR_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/llmpar)

install(TARGETS llmpar EXPORT llmparTargets)
install(DIRECTORY include/llmpar DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(EXISTS ${PROJECT_SOURCE_DIR}/kernels)
  install(DIRECTORY kernels/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/llmpar/kernels)
endif()
install(EXPORT llmparTargets NAMESPACE llmpar:: DESTINATION ${LLMPAR_INSTALL_CMAKEDIR})

# The CUDA target goes in its own export set, so that a CPU-only user of an install
# made with CUDA needs no CUDA toolkit: the config loads it only where CUDA is found.
if(TARGET llmpar_cuda)
  install(TARGETS llmpar_cuda EXPORT llmparCudaTargets)
  install(EXPORT llmparCudaTargets NAMESPACE llmpar:: DESTINATION ${LLMPAR_INSTALL_CMAKEDIR})
  # The config finds the CUDA toolkit through the same workaround as the build.
  install(FILES cmake/LlmparCudaToolkit.cmake DESTINATION ${LLMPAR_INSTALL_CMAKEDIR})
  # llmpar::cuda links NCCL::nccl, which the config makes with this module.
  if(LLMPAR_NCCL)
    install(FILES cmake/FindNCCL.cmake DESTINATION ${LLMPAR_INSTALL_CMAKEDIR})
  endif()
endif()

configure_package_config_file(cmake/llmparConfig.cmake.in
  ${PROJECT_BINARY_DIR}/llmparConfig.cmake
  INSTALL_DESTINATION ${LLMPAR_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/llmparConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/llmparConfig.cmake ${PROJECT_BINARY_DIR}/llmparConfigVersion.cmake
  DESTINATION ${LLMPAR_INSTALL_CMAKEDIR})
