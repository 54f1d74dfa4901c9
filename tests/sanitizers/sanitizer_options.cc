// Default runtime options of the sanitizers, compiled into every executable of a
// sanitizer build (tests, daemons, tools, benchmarks; see CKPT_SANITIZER_LINK in
// cmake/CkptSanitizers.cmake), so that a finding fails whatever runs the binary: a test
// under ctest, a daemon started by a test, a script.
//
// The runtimes call these hooks once, at start-up, before main(). Options set in the
// environment (ASAN_OPTIONS, UBSAN_OPTIONS, LSAN_OPTIONS, TSAN_OPTIONS) are parsed after
// them and win. (Tests run by an uninstrumented interpreter get ASAN_OPTIONS with
// detect_leaks=0 plus an include_if_exists of <build>/sanitizer/<program>.asan-options,
// which turns leak checks back on for our programs: cmake/CkptSanitizers.cmake.)
//
// The suppression files are the checked-in ones in this directory (their absolute path
// is compiled in as CKPT_LSAN_SUPPRESSIONS / CKPT_TSAN_SUPPRESSIONS); docs/building.md
// says what each entry suppresses and why.
//
// Thread safety: the runtimes call these before any thread of ours exists.

#ifndef CKPT_LSAN_SUPPRESSIONS
#error "CKPT_LSAN_SUPPRESSIONS must be defined (see tests/sanitizers/CMakeLists.txt)"
#endif
#ifndef CKPT_TSAN_SUPPRESSIONS
#error "CKPT_TSAN_SUPPRESSIONS must be defined (see tests/sanitizers/CMakeLists.txt)"
#endif

extern "C" {

// ASan: stop at the first error (the default) and report the bad access with the
// allocation and free stacks.
__attribute__((visibility("default"), used)) const char* __asan_default_options() {
  return "halt_on_error=1:detect_leaks=1:check_initialization_order=1:strict_init_order=1";
}

// LSan (part of ASan here): leaks fail the process at exit (exit code 23).
__attribute__((visibility("default"), used)) const char* __lsan_default_options() {
  return "detect_leaks=1:print_suppressions=0:suppressions=\"" CKPT_LSAN_SUPPRESSIONS "\"";
}

// UBSan: the build already passes -fno-sanitize-recover=undefined; this also halts for
// checks that a library built without it might recover from, and prints the stack.
__attribute__((visibility("default"), used)) const char* __ubsan_default_options() {
  return "halt_on_error=1:print_stacktrace=1";
}

// TSan: a report makes the process exit with 66 at the end (TSan's default exitcode),
// which fails the test; keep going after the first report so one run shows all of them.
__attribute__((visibility("default"), used)) const char* __tsan_default_options() {
  return "second_deadlock_stack=1:print_suppressions=0:suppressions=\"" CKPT_TSAN_SUPPRESSIONS
         "\"";
}

}  // extern "C"
