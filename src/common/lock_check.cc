#include "common/lock_check.h"

#include <execinfo.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace ckpt::lock_check {
#ifndef NDEBUG

int& HeldByThisThread() {
  thread_local int held = 0;
  return held;
}

void Fail(const char* what) {
  std::fprintf(stderr, "FATAL: %s while holding %d checked lock(s): no lock may be held across crc, file or network I/O\n",
               what, HeldByThisThread());
  void* frames[32];
  const int n = backtrace(frames, 32);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);  // addr2line -e BINARY +OFFSET names them
  std::fflush(stderr);
  std::abort();
}

#endif
}  // namespace ckpt::lock_check
