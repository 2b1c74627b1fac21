# FindNCCL — NVIDIA's collective communication library, for NcclComm.
#
# Looks next to the CUDA toolkit first (CUDAToolkit_INCLUDE_DIRS, CUDAToolkit_LIBRARY_DIR:
# call find_package(CUDAToolkit) before this), where NVIDIA's packages and some toolkit
# installs put it, then in NCCL_ROOT (a CMake or environment variable) and the system's
# default places (Debian's libnccl-dev).
#
# Result: NCCL_FOUND, NCCL_VERSION (from nccl.h), NCCL_INCLUDE_DIR, NCCL_LIBRARY, and the
# imported target NCCL::nccl. Installed with llmpar, whose package config uses it for the
# `cuda` component.
include(FindPackageHandleStandardArgs)

find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ${NCCL_ROOT} $ENV{NCCL_ROOT}
  PATH_SUFFIXES include)
find_library(NCCL_LIBRARY nccl
  HINTS ${CUDAToolkit_LIBRARY_DIR} ${NCCL_ROOT} $ENV{NCCL_ROOT}
  PATH_SUFFIXES lib64 lib)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" nccl_version_defines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(part IN ITEMS MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*#define NCCL_${part} +([0-9]+).*" "\\1" nccl_${part} "${nccl_version_defines}")
  endforeach()
  set(NCCL_VERSION "${nccl_MAJOR}.${nccl_MINOR}.${nccl_PATCH}")
  unset(nccl_version_defines)
endif()

find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
