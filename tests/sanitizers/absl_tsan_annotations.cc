// Tells ThreadSanitizer about absl::Mutex, absl::CondVar and absl::Notification.
//
// Debian's Abseil (20220623) is built without TSan, so its locks are invisible to TSan:
// without this file every absl::Mutex looks unsynchronized (thousands of false races).
// This shared library is linked first into every executable of the TSan build
// (CKPT_SANITIZER_LINK in cmake/CkptSanitizers.cmake), so its definitions of the
// out-of-line member functions below come before libabsl_synchronization.so in symbol
// lookup and interpose on every call made through the PLT: ours, gRPC's (grpc_core::Mutex
// is an absl::Mutex) and Abseil's own. Each wrapper calls the real function, found with
// dlsym(RTLD_NEXT), between the __tsan_mutex_* annotations that Abseil itself makes when
// it is built with TSan:
//   - Lock-type calls:   pre_lock, real call, post_lock (an acquire).
//   - Unlock-type calls: pre_unlock (a release), real call, post_unlock.
//   - Await and CondVar::Wait release the mutex inside and hold it again on return:
//     annotated as an unlock before the real call and a lock after it.
// Between pre_* and post_* TSan ignores the thread's memory accesses and synchronization,
// exactly as inside an instrumented mutex implementation. Abseil evaluates a waiter's
// Condition only inside such a call (Lock/LockWhen, Unlock, Await, CondVar::Wait), so those
// evaluations never show up as races; they are also not checked (TSan cannot see the
// mutex held there).
// ~Mutex is not wrapped: a destroy annotation is a write to the mutex, and gRPC frees its
// mutexes on whichever thread drops the last reference (an atomic TSan cannot see), which
// TSan would report. Freeing the memory clears TSan's state for it anyway.
// Notification: Notify releases, the waits acquire on return, and Notify also releases
// the address of the inline-read `notified_yet_` flag, so HasBeenNotified() (an inline
// acquire load in our instrumented code) synchronizes with it.
// absl::Status: copies share a reference-counted rep, and the last Unref frees it inside
// libabsl_status after an atomic decrement TSan cannot see, so TSan pairs that free with
// earlier reads of the rep by other holders. UnrefNonInlined releases the rep's address
// before dropping a reference, and acquires it before dropping the last one, as the
// acq_rel decrement does.
//
// At load time every wrapped function is checked to resolve to this library and to have
// a real definition behind it; if not (an Abseil with other symbols), the process aborts
// with a message instead of running with silently missing annotations.
//
// Thread safety: the wrappers are as thread-safe as the functions they wrap. The table of
// real functions is filled once by a constructor, before main().

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

#define CKPT_STR2(x) #x
#define CKPT_STR(x) CKPT_STR2(x)

// Mangled names are "_ZN4absl" <len><inline namespace> <rest>; the rest never depends on
// the inline namespace's name (substitutions are by position).
std::string Mangle(const char* prefix, const char* rest) {
  const std::string ns = CKPT_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  return std::string(prefix) + "4absl" + std::to_string(ns.size()) + ns + rest;
}

enum Fn {
  kLock,
  kUnlock,
  kTryLock,
  kReaderLock,
  kReaderUnlock,
  kReaderTryLock,
  kLockWhen,
  kReaderLockWhen,
  kLockWhenWithTimeout,
  kReaderLockWhenWithTimeout,
  kLockWhenWithDeadline,
  kReaderLockWhenWithDeadline,
  kAwait,
  kAwaitWithTimeout,
  kAwaitWithDeadline,
  kCondVarWait,
  kCondVarWaitWithTimeout,
  kCondVarWaitWithDeadline,
  kNotify,
  kWaitForNotification,
  kWaitForNotificationWithTimeout,
  kWaitForNotificationWithDeadline,
  kStatusUnrefNonInlined,
  kFnCount
};

struct Entry {
  const char* prefix;  // "_ZN" (member) or "_ZNK" (const member)
  const char* rest;
};

constexpr Entry kEntries[kFnCount] = {
    {"_ZN", "5Mutex4LockEv"},
    {"_ZN", "5Mutex6UnlockEv"},
    {"_ZN", "5Mutex7TryLockEv"},
    {"_ZN", "5Mutex10ReaderLockEv"},
    {"_ZN", "5Mutex12ReaderUnlockEv"},
    {"_ZN", "5Mutex13ReaderTryLockEv"},
    {"_ZN", "5Mutex8LockWhenERKNS0_9ConditionE"},
    {"_ZN", "5Mutex14ReaderLockWhenERKNS0_9ConditionE"},
    {"_ZN", "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"},
    {"_ZN", "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"},
    {"_ZN", "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"},
    {"_ZN", "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"},
    {"_ZN", "5Mutex5AwaitERKNS0_9ConditionE"},
    {"_ZN", "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE"},
    {"_ZN", "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE"},
    {"_ZN", "7CondVar4WaitEPNS0_5MutexE"},
    {"_ZN", "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE"},
    {"_ZN", "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE"},
    {"_ZN", "12Notification6NotifyEv"},
    {"_ZNK", "12Notification19WaitForNotificationEv"},
    {"_ZNK", "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE"},
    {"_ZNK", "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE"},
    {"_ZN", "6Status15UnrefNonInlinedEm"},
};

void* g_real[kFnCount];

// Fills g_real. Runs before main() and before any constructor of the executable (this
// library is a dependency of it). Also callable lazily: a constructor of another shared
// library may lock a mutex before ours ran.
void ResolveAll() {
  Dl_info here;
  if (dladdr(reinterpret_cast<void*>(&ResolveAll), &here) == 0) here.dli_fbase = nullptr;
  for (int i = 0; i < kFnCount; ++i) {
    const std::string name = Mangle(kEntries[i].prefix, kEntries[i].rest);
    void* real = dlsym(RTLD_NEXT, name.c_str());
    void* ours = dlsym(RTLD_DEFAULT, name.c_str());
    Dl_info info;
    const bool interposed =
        ours != nullptr && dladdr(ours, &info) != 0 && info.dli_fbase == here.dli_fbase;
    if (real == nullptr || !interposed) {
      std::fprintf(stderr,
                   "ckpt absl TSan annotations: %s %s; this Abseil does not match "
                   "tests/sanitizers/absl_tsan_annotations.cc\n",
                   name.c_str(),
                   real == nullptr ? "has no definition in Abseil"
                                   : "does not resolve to the annotating wrapper");
      std::abort();
    }
    g_real[i] = real;
  }
}

__attribute__((constructor(101))) void Init() {
  if (g_real[kFnCount - 1] == nullptr) ResolveAll();
}

template <typename F>
F Real(Fn fn) {
  if (__builtin_expect(g_real[fn] == nullptr, 0)) ResolveAll();
  return reinterpret_cast<F>(g_real[fn]);
}

constexpr unsigned kRead = __tsan_mutex_read_lock;
constexpr unsigned kTry = __tsan_mutex_try_lock;
constexpr unsigned kTryFailed = __tsan_mutex_try_lock_failed;

using absl::CondVar;
using absl::Condition;
using absl::Duration;
using absl::Mutex;
using absl::Notification;
using absl::Time;

// > 0 while this thread is inside a real Abseil call made by a wrapper. Abseil calls its
// own exported functions through the PLT too (AwaitWithTimeout calls AwaitWithDeadline,
// Notify locks its mutex), which lands in the wrappers again: those nested calls are
// forwarded without annotations, so each user-level call is annotated exactly once.
thread_local int t_inside_abseil = 0;

template <typename Call>
auto Forward(Call call) {
  ++t_inside_abseil;
  auto r = call();
  --t_inside_abseil;
  return r;
}

// Lock-type call: the mutex is held (shared if `flags` has kRead) when `call` returns.
template <typename Call>
auto AnnotatedLock(Mutex* mu, unsigned flags, Call call) {
  if (t_inside_abseil > 0) return call();
  __tsan_mutex_pre_lock(mu, flags);
  auto r = Forward(call);
  __tsan_mutex_post_lock(mu, flags, 0);
  return r;
}

// TryLock-type call: `call` returns whether it got the mutex.
template <typename Call>
bool AnnotatedTryLock(Mutex* mu, unsigned flags, Call call) {
  if (t_inside_abseil > 0) return call();
  __tsan_mutex_pre_lock(mu, flags | kTry);
  const bool ok = Forward(call);
  __tsan_mutex_post_lock(mu, flags | kTry | (ok ? 0 : kTryFailed), 0);
  return ok;
}

// Unlock-type call.
template <typename Call>
void AnnotatedUnlock(Mutex* mu, unsigned flags, Call call) {
  if (t_inside_abseil > 0) {
    call();
    return;
  }
  __tsan_mutex_pre_unlock(mu, flags);
  Forward([&] {
    call();
    return 0;
  });
  __tsan_mutex_post_unlock(mu, flags);
}

// The mutex (held on entry) is released inside `call` and held again on return.
template <typename Call>
auto AnnotatedRelock(Mutex* mu, unsigned flags, Call call) {
  if (t_inside_abseil > 0) return call();
  __tsan_mutex_pre_unlock(mu, flags);
  auto r = Forward(call);
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
  return r;
}

// The layout of absl::Notification (private members), to find its flag's address.
struct NotificationLayout {
  Mutex mutex;
  std::atomic<bool> notified_yet;
};
static_assert(sizeof(NotificationLayout) == sizeof(Notification));
static_assert(alignof(NotificationLayout) == alignof(Notification));

void* NotifiedFlag(const Notification* n) {
  return const_cast<char*>(reinterpret_cast<const char*>(n)) +
         offsetof(NotificationLayout, notified_yet);
}

}  // namespace

// --- absl::Mutex ----------------------------------------------------------------------
// Lambdas return a value (0 for void calls) so that one helper fits every signature.

void Mutex::Lock() {
  AnnotatedLock(this, 0, [&] {
    Real<void (*)(Mutex*)>(kLock)(this);
    return 0;
  });
}

void Mutex::Unlock() {
  AnnotatedUnlock(this, 0, [&] { Real<void (*)(Mutex*)>(kUnlock)(this); });
}

bool Mutex::TryLock() {
  return AnnotatedTryLock(this, 0, [&] { return Real<bool (*)(Mutex*)>(kTryLock)(this); });
}

void Mutex::ReaderLock() {
  AnnotatedLock(this, kRead, [&] {
    Real<void (*)(Mutex*)>(kReaderLock)(this);
    return 0;
  });
}

void Mutex::ReaderUnlock() {
  AnnotatedUnlock(this, kRead, [&] { Real<void (*)(Mutex*)>(kReaderUnlock)(this); });
}

bool Mutex::ReaderTryLock() {
  return AnnotatedTryLock(this, kRead,
                          [&] { return Real<bool (*)(Mutex*)>(kReaderTryLock)(this); });
}

void Mutex::LockWhen(const Condition& cond) {
  AnnotatedLock(this, 0, [&] {
    Real<void (*)(Mutex*, const Condition&)>(kLockWhen)(this, cond);
    return 0;
  });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  AnnotatedLock(this, kRead, [&] {
    Real<void (*)(Mutex*, const Condition&)>(kReaderLockWhen)(this, cond);
    return 0;
  });
}

// The *WithTimeout / *WithDeadline variants hold the mutex on return whatever they return.
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  return AnnotatedLock(this, 0, [&] {
    return Real<bool (*)(Mutex*, const Condition&, Duration)>(kLockWhenWithTimeout)(
        this, cond, timeout);
  });
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  return AnnotatedLock(this, kRead, [&] {
    return Real<bool (*)(Mutex*, const Condition&, Duration)>(kReaderLockWhenWithTimeout)(
        this, cond, timeout);
  });
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  return AnnotatedLock(this, 0, [&] {
    return Real<bool (*)(Mutex*, const Condition&, Time)>(kLockWhenWithDeadline)(this, cond,
                                                                                 deadline);
  });
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  return AnnotatedLock(this, kRead, [&] {
    return Real<bool (*)(Mutex*, const Condition&, Time)>(kReaderLockWhenWithDeadline)(
        this, cond, deadline);
  });
}

// Await* may be called with the mutex held shared; TSan's read/write flags must match how
// it was locked, which Abseil does not say. Annotating as exclusive is right for a writer
// and, for a reader, only makes TSan see a stronger release/acquire than happened (it may
// miss a race, never invent one); no caller in this repository awaits under a reader lock.
void Mutex::Await(const Condition& cond) {
  AnnotatedRelock(this, 0, [&] {
    Real<void (*)(Mutex*, const Condition&)>(kAwait)(this, cond);
    return 0;
  });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  return AnnotatedRelock(this, 0, [&] {
    return Real<bool (*)(Mutex*, const Condition&, Duration)>(kAwaitWithTimeout)(this, cond,
                                                                                 timeout);
  });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  return AnnotatedRelock(this, 0, [&] {
    return Real<bool (*)(Mutex*, const Condition&, Time)>(kAwaitWithDeadline)(this, cond,
                                                                              deadline);
  });
}

// --- absl::CondVar --------------------------------------------------------------------

void CondVar::Wait(Mutex* mu) {
  AnnotatedRelock(mu, 0, [&] {
    Real<void (*)(CondVar*, Mutex*)>(kCondVarWait)(this, mu);
    return 0;
  });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  return AnnotatedRelock(mu, 0, [&] {
    return Real<bool (*)(CondVar*, Mutex*, Duration)>(kCondVarWaitWithTimeout)(this, mu,
                                                                               timeout);
  });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  return AnnotatedRelock(mu, 0, [&] {
    return Real<bool (*)(CondVar*, Mutex*, Time)>(kCondVarWaitWithDeadline)(this, mu,
                                                                            deadline);
  });
}

// --- absl::Notification ---------------------------------------------------------------

void Notification::Notify() {
  if (t_inside_abseil == 0) {
    __tsan_release(this);
    __tsan_release(NotifiedFlag(this));
  }
  Forward([&] {
    Real<void (*)(Notification*)>(kNotify)(this);
    return 0;
  });
}

void Notification::WaitForNotification() const {
  const bool outer = t_inside_abseil == 0;
  Forward([&] {
    Real<void (*)(const Notification*)>(kWaitForNotification)(this);
    return 0;
  });
  if (outer) __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  const bool outer = t_inside_abseil == 0;
  const bool notified = Forward([&] {
    return Real<bool (*)(const Notification*, Duration)>(kWaitForNotificationWithTimeout)(
        this, timeout);
  });
  if (outer && notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  const bool outer = t_inside_abseil == 0;
  const bool notified = Forward([&] {
    return Real<bool (*)(const Notification*, Time)>(kWaitForNotificationWithDeadline)(
        this, deadline);
  });
  if (outer && notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

// --- absl::Status ---------------------------------------------------------------------

void absl::Status::UnrefNonInlined(uintptr_t rep) {
  // rep is a pointer to the StatusRep plus 1 (Status::PointerToRep, status.h).
  auto* r = reinterpret_cast<absl::status_internal::StatusRep*>(rep - 1);
  // 1: this call drops the last reference and frees the rep; nobody else holds it, so the
  // count cannot change under us. Read before the release, so that the release covers it.
  const bool last = r->ref.load(std::memory_order_acquire) == 1;
  __tsan_release(r);
  if (last) __tsan_acquire(r);
  Real<void (*)(uintptr_t)>(kStatusUnrefNonInlined)(rep);
}
