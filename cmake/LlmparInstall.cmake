# Install rules and the package config: a user's project does
#   find_package(llmpar) and target_link_libraries(app PRIVATE llmpar::llmpar).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS llmpar EXPORT llmparTargets)
install(DIRECTORY include/llmpar DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT llmparTargets NAMESPACE llmpar:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/llmpar)
configure_package_config_file(cmake/llmparConfig.cmake.in
  ${PROJECT_BINARY_DIR}/llmparConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/llmpar)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/llmparConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/llmparConfig.cmake ${PROJECT_BINARY_DIR}/llmparConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/llmpar)
