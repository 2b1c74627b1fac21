# ctest driver (cmake -P): install the build tree into WORK_DIR/prefix, configure and
# build this folder's consumer project against that install, and run it.
# Inputs: BUILD_DIR, CONSUMER_SOURCE_DIR, WORK_DIR, GENERATOR, CXX_COMPILER, EXPECT_CUDA.
cmake_minimum_required(VERSION 3.25)

foreach(var IN ITEMS BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run.cmake needs -D ${var}=...")
  endif()
endforeach()

set(prefix ${WORK_DIR}/prefix)
set(consumer_build ${WORK_DIR}/build)
file(REMOVE_RECURSE ${prefix} ${consumer_build})

function(run_step name)
  message(STATUS "package_consumer: ${name}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "package_consumer: ${name} failed (${rc})")
  endif()
endfunction()

run_step("install into ${prefix}" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
# The programs the install puts beside the package, and the shipped gradient checker.
foreach(installed IN ITEMS bin/train_gpt bin/prepare_data bin/llmpar-plan include/llmpar/testing/gradcheck.hpp)
  if(NOT EXISTS ${prefix}/${installed})
    message(FATAL_ERROR "package_consumer: the install lacks ${installed}")
  endif()
endforeach()
run_step("configure the consumer" ${CMAKE_COMMAND}
  -S ${CONSUMER_SOURCE_DIR} -B ${consumer_build} -G ${GENERATOR}
  -D CMAKE_BUILD_TYPE=Release
  -D CMAKE_CXX_COMPILER=${CXX_COMPILER}
  -D CMAKE_PREFIX_PATH=${prefix}
  -D CMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  -D EXPECT_CUDA=${EXPECT_CUDA})
run_step("build the consumer" ${CMAKE_COMMAND} --build ${consumer_build})
run_step("run the consumer" ${consumer_build}/app)
