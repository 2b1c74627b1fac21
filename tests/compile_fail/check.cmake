# cmake -D CXX=<c++ compiler> -D INCLUDE_DIR=<llmpar include dir> -D SOURCE=<snippet.cpp> -P check.cmake
#
# Passes when SOURCE does not compile and the compiler's output contains the sentence
# given in the snippet's `// expect: <sentence>` line (matched literally).
foreach(var IN ITEMS CXX INCLUDE_DIR SOURCE)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check.cmake needs -D ${var}=...")
  endif()
endforeach()

# file(READ) and a regex rather than file(STRINGS): a sentence may hold ';', which a
# CMake list would split.
file(READ "${SOURCE}" text)
string(REGEX MATCH "// expect: [^\n]*" expect_line "${text}")
if(expect_line STREQUAL "")
  message(FATAL_ERROR "${SOURCE} has no '// expect: <sentence>' line")
endif()
string(REGEX REPLACE "^// expect: " "" expected "${expect_line}")
string(STRIP "${expected}" expected)

execute_process(
  COMMAND "${CXX}" -std=c++20 -fsyntax-only "-I${INCLUDE_DIR}" "${SOURCE}"
  RESULT_VARIABLE result
  OUTPUT_VARIABLE output
  ERROR_VARIABLE output)

if(result EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but llmpar must reject it with:\n  ${expected}")
endif()
string(FIND "${output}" "${expected}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${SOURCE} failed to compile, but not with the expected sentence\n"
                      "expected:\n  ${expected}\ncompiler output:\n${output}")
endif()
message(STATUS "rejected as expected: ${expected}")
