# Sanitizer builds: CKPT_SANITIZE = address | undefined | address,undefined | thread.
#
# Sets the compile and link flags for the whole tree and, for ckpt_cc_*() targets,
# links the runtime defaults of tests/sanitizers/ first (CKPT_SANITIZER_LINK).
# docs/building.md explains each choice; in short:
#   - -O1 -g1 (see below).
#   - UBSan halts on the first finding (-fno-sanitize-recover), so a finding fails the test.
#   - GCC 12 under ASan warns inside fmt/core.h (-Wstringop-overflow, a false positive in
#     a header we do not own); that one warning is off in ASan builds only.
#   - TSan: -U__SANITIZE_THREAD__, because protobuf's map_field.h changes its layout when
#     that macro is defined and would no longer match Debian's (uninstrumented) libprotobuf.
#
# Outputs: CKPT_SANITIZE_ADDRESS, CKPT_SANITIZE_UNDEFINED, CKPT_SANITIZE_THREAD (ON/OFF),
# CKPT_SANITIZER_WARNING_OPTIONS (for ckpt_set_warnings()) and CKPT_SANITIZER_LINK (what
# every executable links first; targets defined in tests/sanitizers/).

set(CKPT_SANITIZE_ADDRESS OFF)
set(CKPT_SANITIZE_UNDEFINED OFF)
set(CKPT_SANITIZE_THREAD OFF)
set(CKPT_SANITIZER_WARNING_OPTIONS)
set(CKPT_SANITIZER_LINK)
set(CKPT_SANITIZER_OPTIONS_DIR ${PROJECT_BINARY_DIR}/sanitizer)
set(CKPT_FOREIGN_TEST_ENVIRONMENT)
set(CKPT_FOREIGN_TEST_ENVIRONMENT_MODIFICATION)

# For a test whose command is not one of our binaries (python3, a shell script) but which
# loads our Python module or starts our daemons: sets the environment described at the end
# of this file. No-op unless CKPT_SANITIZE contains address.
function(ckpt_sanitize_foreign_test)
  if(NOT CKPT_SANITIZE_ADDRESS)
    return()
  endif()
  set_property(TEST ${ARGN} APPEND PROPERTY ENVIRONMENT ${CKPT_FOREIGN_TEST_ENVIRONMENT})
  set_property(TEST ${ARGN} APPEND PROPERTY ENVIRONMENT_MODIFICATION
    ${CKPT_FOREIGN_TEST_ENVIRONMENT_MODIFICATION})
endfunction()

if(NOT CKPT_SANITIZE)
  return()  # everything below is for sanitizer builds
endif()

string(REPLACE "," ";" _ckpt_sanitizers "${CKPT_SANITIZE}")
foreach(s IN LISTS _ckpt_sanitizers)
  if(s STREQUAL "address")
    set(CKPT_SANITIZE_ADDRESS ON)
  elseif(s STREQUAL "undefined")
    set(CKPT_SANITIZE_UNDEFINED ON)
  elseif(s STREQUAL "thread")
    set(CKPT_SANITIZE_THREAD ON)
  else()
    message(FATAL_ERROR "CKPT_SANITIZE: unknown sanitizer '${s}' in '${CKPT_SANITIZE}' "
                        "(use address, undefined, address,undefined or thread)")
  endif()
endforeach()
if(CKPT_SANITIZE_THREAD AND (CKPT_SANITIZE_ADDRESS OR CKPT_SANITIZE_UNDEFINED))
  message(FATAL_ERROR "CKPT_SANITIZE: thread cannot be combined with address or undefined")
endif()
list(JOIN _ckpt_sanitizers "," _ckpt_sanitize_flag)

# -O1: the sanitizers' recommended level; it halves the compile time of -O3 under ASan
# (peer.cc: 38 s -> 21 s), which keeps the cold CI run short. Appended after
# CMAKE_CXX_FLAGS_RELEASE's -O3, so it wins. -g1: line tables for the reports' stacks.
add_compile_options(-fsanitize=${_ckpt_sanitize_flag} -fno-omit-frame-pointer -O1 -g1)
add_link_options(-fsanitize=${_ckpt_sanitize_flag})
if(CKPT_SANITIZE_UNDEFINED)
  add_compile_options(-fno-sanitize-recover=undefined)
  add_link_options(-fno-sanitize-recover=undefined)
endif()
if(CKPT_SANITIZE_ADDRESS)
  # GCC 12 + -fsanitize=address: a -Wstringop-overflow false positive inside fmt/core.h
  # (fmt 9, fill_t::operator=, "writing 1 byte into a region of size 0"), reached from
  # src/common/log.cc. Silenced in ASan builds only; every other warning still fails the
  # build. ckpt_set_warnings() appends these after -Werror.
  set(CKPT_SANITIZER_WARNING_OPTIONS -Wno-stringop-overflow)
endif()
if(CKPT_SANITIZE_THREAD)
  add_compile_options(-U__SANITIZE_THREAD__)
  # What code of ours may test instead (memory bounds in tests that TSan's shadow inflates).
  add_compile_definitions(CKPT_UNDER_TSAN=1)
endif()

# Runtime defaults in every executable; for TSan also the absl::Mutex annotations, linked
# before Abseil so that they interpose on it.
set(CKPT_SANITIZER_LINK ckpt_sanitizer_options)
if(CKPT_SANITIZE_THREAD)
  list(PREPEND CKPT_SANITIZER_LINK ckpt_tsan_absl)
endif()

# Programs we do not build (the Python interpreter, and the shell and tools a test script
# runs) that load a module of ours need the ASan runtime preloaded (libstdc++ too:
# libasan alone aborts in its __cxa_throw hook) and must not check their own leaks
# (Python frees little at exit). Our own binaries started from them must still check:
# their ASAN_OPTIONS is extended with include_if_exists=<build>/sanitizer/%b.asan-options
# (%b: the program's name), a file that ckpt_write_asan_options() writes for each of ours
# (daemons, tools, tests) and that turns leak checks back on. Tests apply both with
# ckpt_sanitize_foreign_test().
if(CKPT_SANITIZE_ADDRESS)
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libasan.so
    OUTPUT_VARIABLE _ckpt_libasan OUTPUT_STRIP_TRAILING_WHITESPACE)
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so
    OUTPUT_VARIABLE _ckpt_libstdcxx OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT IS_ABSOLUTE "${_ckpt_libasan}" OR NOT EXISTS "${_ckpt_libasan}")
    message(FATAL_ERROR "CKPT_SANITIZE=address: ${CMAKE_CXX_COMPILER} has no libasan.so")
  endif()
  list(APPEND CKPT_FOREIGN_TEST_ENVIRONMENT "LD_PRELOAD=${_ckpt_libasan} ${_ckpt_libstdcxx}")
  list(APPEND CKPT_FOREIGN_TEST_ENVIRONMENT_MODIFICATION
    "ASAN_OPTIONS=string_append::detect_leaks=0:include_if_exists=${CKPT_SANITIZER_OPTIONS_DIR}/%b.asan-options")
endif()
