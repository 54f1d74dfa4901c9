# ckpt_cc_library() / ckpt_cc_test() / ckpt_cc_binary(): one library per folder,
# explicit source lists, a ckpt:: alias, the project's warning set. In a sanitizer
# build every executable links ${CKPT_SANITIZER_LINK} first (tests/sanitizers/).
#
#   ckpt_cc_library(NAME common
#     HDRS status_macros.h ...   SRCS crc32c.cc ...
#     DEPS absl::status          # PUBLIC: part of the headers' contract
#     PRIVATE_DEPS PkgConfig::ISAL)  # adapters keep third-party headers private
#   -> target ckpt_common, alias ckpt::common; includes resolve from src/.
#
#   ckpt_cc_test(NAME crc32c_test SRCS crc32c_test.cc DEPS ckpt::common LABELS unit)
#   -> GoogleTest binary, each TEST registered with ctest under the given labels.

# ASan builds: <build>/sanitizer/<exe>.asan-options keeps leak checks on for one of our
# programs when a foreign parent turned them off (see CkptSanitizers.cmake).
function(ckpt_write_asan_options exe)
  if(CKPT_SANITIZE_ADDRESS)
    file(WRITE ${CKPT_SANITIZER_OPTIONS_DIR}/${exe}.asan-options "detect_leaks=1\n")
  endif()
endfunction()

function(ckpt_set_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  if(CKPT_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
  if(CKPT_SANITIZER_WARNING_OPTIONS)  # see CkptSanitizers.cmake
    target_compile_options(${target} PRIVATE ${CKPT_SANITIZER_WARNING_OPTIONS})
  endif()
endfunction()

function(ckpt_cc_library)
  cmake_parse_arguments(ARG "" "NAME" "SRCS;HDRS;DEPS;PRIVATE_DEPS;INCLUDES" ${ARGN})
  set(target ckpt_${ARG_NAME})
  if(ARG_SRCS)
    add_library(${target} STATIC ${ARG_SRCS} ${ARG_HDRS})
    target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR}/src ${ARG_INCLUDES})
    target_link_libraries(${target} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
    ckpt_set_warnings(${target})
  else()
    add_library(${target} INTERFACE ${ARG_HDRS})
    target_include_directories(${target} INTERFACE ${PROJECT_SOURCE_DIR}/src ${ARG_INCLUDES})
    target_link_libraries(${target} INTERFACE ${ARG_DEPS})
  endif()
  add_library(ckpt::${ARG_NAME} ALIAS ${target})
endfunction()

function(ckpt_cc_binary)
  cmake_parse_arguments(ARG "" "NAME;OUTPUT_NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SRCS})
  target_link_libraries(${ARG_NAME} PRIVATE ${CKPT_SANITIZER_LINK} ${ARG_DEPS})
  if(ARG_OUTPUT_NAME)
    set_target_properties(${ARG_NAME} PROPERTIES OUTPUT_NAME ${ARG_OUTPUT_NAME})
  endif()
  set_target_properties(${ARG_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
  ckpt_set_warnings(${ARG_NAME})
  if(ARG_OUTPUT_NAME)
    ckpt_write_asan_options(${ARG_OUTPUT_NAME})
  else()
    ckpt_write_asan_options(${ARG_NAME})
  endif()
endfunction()

# LABELS: unit | integration | fault | hw. TIMEOUT: seconds per test (default 120).
# With CKPT_BUILD_GTESTS=OFF the binary is still defined (buildable by name) but left out of
# `all` and of ctest: scripts/test.sh's plain half runs only the script tests (label nosan).
function(ckpt_cc_test)
  cmake_parse_arguments(ARG "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  if(CKPT_BUILD_GTESTS)
    add_executable(${ARG_NAME} ${ARG_SRCS})
  else()
    add_executable(${ARG_NAME} EXCLUDE_FROM_ALL ${ARG_SRCS})
  endif()
  target_link_libraries(${ARG_NAME} PRIVATE ${CKPT_SANITIZER_LINK}
    ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_definitions(${ARG_NAME} PRIVATE
    CKPT_BINARY_DIR="${PROJECT_BINARY_DIR}" CKPT_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  set_target_properties(${ARG_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  ckpt_set_warnings(${ARG_NAME})
  ckpt_write_asan_options(${ARG_NAME})
  if(NOT CKPT_BUILD_GTESTS)
    return()
  endif()
  gtest_discover_tests(${ARG_NAME}
    DISCOVERY_MODE PRE_TEST
    PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT})
endfunction()

function(ckpt_cc_benchmark)
  cmake_parse_arguments(ARG "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SRCS})
  target_link_libraries(${ARG_NAME} PRIVATE ${CKPT_SANITIZER_LINK} ${ARG_DEPS} benchmark::benchmark)
  target_include_directories(${ARG_NAME} PRIVATE ${PROJECT_SOURCE_DIR})  # "bench/bench_support.h"
  set_target_properties(${ARG_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bench)
  ckpt_set_warnings(${ARG_NAME})
endfunction()
