// Checked locks: "no lock is held across crc, file or network I/O"
// (docs/style.md "Locks and threads"), enforced at run time wherever
// assertions are on (tests, the sanitizer builds, CKPT_KEEP_ASSERTS).
//
// A component locks with ckpt::CheckedLock, an absl::MutexLock that also
// counts, per thread, how many such locks the thread holds. The code that does
// the I/O (the crc of a large buffer, every file system call, every data-plane
// send and connect, every RPC to meta from the agent) calls
// AssertNoCheckedLock(what): with a checked lock held it prints what was done
// under it and aborts, so any test that drives the path fails. Under NDEBUG
// the count and the check compile to nothing.
//
// A thread waiting on a condition of its mutex (Mutex::Await) still counts
// the lock: it does no I/O while it waits.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ckpt {

namespace lock_check {
#ifndef NDEBUG
int& HeldByThisThread();
[[noreturn]] void Fail(const char* what);
#endif
}  // namespace lock_check

class ABSL_SCOPED_LOCKABLE CheckedLock {
 public:
  explicit CheckedLock(absl::Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : lock_(mu) {
#ifndef NDEBUG
    ++lock_check::HeldByThisThread();
#endif
  }
  ~CheckedLock() ABSL_UNLOCK_FUNCTION() {
#ifndef NDEBUG
    --lock_check::HeldByThisThread();
#endif
  }
  CheckedLock(const CheckedLock&) = delete;
  CheckedLock& operator=(const CheckedLock&) = delete;

 private:
  absl::MutexLock lock_;
};

// Aborts (with `what` in the message) if this thread holds a CheckedLock.
inline void AssertNoCheckedLock([[maybe_unused]] const char* what) {
#ifndef NDEBUG
  if (lock_check::HeldByThisThread() != 0) lock_check::Fail(what);
#endif
}

}  // namespace ckpt
