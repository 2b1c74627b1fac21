# llmpar_cuda_toolkit_workaround(): call before find_package(CUDAToolkit) (the build's
# and the installed package config's).
#
# CMake 3.25.0 and 3.25.1 (Debian 12 ships 3.25.1) set a property on CUDA::nvToolsExt in
# FindCUDAToolkit without checking that the target exists, and CUDA 13 ships no
# nvToolsExt library, so the find stops with "set_property could not find TARGET
# CUDA::nvToolsExt" there (fixed in CMake 3.25.2). An empty imported target of that name
# lets it pass; llmpar does not link nvToolsExt.
macro(llmpar_cuda_toolkit_workaround)
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.25 AND CMAKE_VERSION VERSION_LESS 3.25.2 AND NOT TARGET CUDA::nvToolsExt)
    add_library(CUDA::nvToolsExt INTERFACE IMPORTED)
  endif()
endmacro()
