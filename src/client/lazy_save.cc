// LazySave: SaveBuilder::CommitItems on a thread of its own, with waits for
// the copy (all items or the first few) and for the commit.
#include "client/lazy_save.h"

#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client_core.h"
#include "client/save_state.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt {
namespace client {

LazyState::~LazyState() {
  if (thread.joinable()) thread.join();
}

void LazyState::Start() {
  items = builder.item_count();
  thread = std::thread([this] {
    absl::StatusOr<SaveHandle> h = builder.CommitItems(this, /*background=*/false);
    absl::MutexLock lock(&mu);
    copy_ended = true;  // (a failure before or during the copy ends it too)
    done = true;
    if (h.ok()) {
      handle = *std::move(h);
    } else {
      status = h.status();
    }
  });
}

void LazyState::MarkCopied(size_t n) {
  absl::MutexLock lock(&mu);
  copied = n;
  if (n == items) copy_ended = true;
}

void AwaitEarlierCommits(const std::vector<std::weak_ptr<LazyState>>& before) {
  for (const std::weak_ptr<LazyState>& w : before) {
    std::shared_ptr<LazyState> st = w.lock();
    if (st == nullptr) continue;
    {
      absl::MutexLock lock(&st->mu);
      auto done = [&st]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) { return st->done; };
      st->mu.Await(absl::Condition(&done));
    }
    // `st` may be the last reference: its destructor joins a thread that has
    // ended (after the lock above is released).
  }
}

std::vector<std::weak_ptr<LazyState>> ClientCore::RunningLazySaves() {
  absl::MutexLock lock(&lazy_mu);
  std::erase_if(lazy_saves, [](const std::weak_ptr<LazyState>& w) { return w.expired(); });
  return lazy_saves;
}

bool ClientCore::WaitSaves(absl::Time deadline) {
  std::vector<std::shared_ptr<LazyState>> running;
  {
    absl::MutexLock lock(&lazy_mu);
    for (const std::weak_ptr<LazyState>& w : lazy_saves) {
      if (std::shared_ptr<LazyState> st = w.lock()) running.push_back(std::move(st));
    }
  }
  for (const std::shared_ptr<LazyState>& st : running) {
    absl::MutexLock lock(&st->mu);
    auto done = [&st]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) { return st->done; };
    if (!st->mu.AwaitWithDeadline(absl::Condition(&done), deadline)) return false;
  }
  // The last reference to a finished save may be `running`'s: its
  // destructor joins a thread that has ended, without lazy_mu.
  running.clear();
  return WaitCommits(deadline);
}

}  // namespace client

namespace {

absl::Status Timeout(const char* what, uint64_t step) {
  return absl::DeadlineExceededError(absl::StrCat("lazy save of step ", step, ": ", what, " not done by the deadline"));
}

// Waits until `want` items are copied (or the save failed first). The time
// waited counts as the save's cost (the trainer was blocked).
absl::Status AwaitCopy(client::LazyState& st, size_t want, uint64_t step, absl::Time deadline) {
  CKPT_RETURN_IF_ERROR(st.core->CheckProcess());  // no save thread after fork()
  const absl::Time start = absl::Now();
  absl::Status out;
  {
    absl::MutexLock lock(&st.mu);
    auto ready = [&st, want]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu) { return st.copied >= want || st.copy_ended; };
    if (!st.mu.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
      out = Timeout("the copy", step);
    } else if (st.copied < want) {
      out = st.status;  // failed before: nothing is committed
    }
  }
  st.core->AddSaveCost(step, absl::Now() - start);
  return out;
}

}  // namespace

size_t LazySave::item_count() const { return state_ == nullptr ? 0 : state_->items; }

size_t LazySave::copied_items() const {
  if (state_ == nullptr) return 0;
  absl::MutexLock lock(&state_->mu);
  return state_->copied;
}

absl::Status LazySave::WaitItemCopied(size_t index, absl::Time deadline) const {
  if (state_ == nullptr) return absl::FailedPreconditionError("LazySave is empty");
  if (index >= state_->items) {
    return absl::InvalidArgumentError(
        absl::StrCat("item index ", index, " is past the save's ", state_->items, " items"));
  }
  return AwaitCopy(*state_, index + 1, step_, deadline);
}

absl::Status LazySave::WaitCopied(absl::Time deadline) const {
  if (state_ == nullptr) return absl::FailedPreconditionError("LazySave is empty");
  return AwaitCopy(*state_, state_->items, step_, deadline);
}

absl::StatusOr<SaveHandle> LazySave::Wait(absl::Time deadline) const {
  if (state_ == nullptr) return absl::FailedPreconditionError("LazySave is empty");
  client::LazyState& st = *state_;
  CKPT_RETURN_IF_ERROR(st.core->CheckProcess());
  absl::MutexLock lock(&st.mu);
  auto ready = [&st]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu) { return st.done; };
  if (!st.mu.AwaitWithDeadline(absl::Condition(&ready), deadline)) return Timeout("the commit", step_);
  if (!st.status.ok()) return st.status;
  return *st.handle;
}

absl::StatusOr<LazySave> SaveBuilder::CommitLazy() {
  if (state_ == nullptr || state_->spent || state_->core == nullptr) {
    return absl::FailedPreconditionError("SaveBuilder::CommitLazy after Commit");
  }
  CKPT_RETURN_IF_ERROR(ValidateStep(state_->step));
  CKPT_RETURN_IF_ERROR(state_->core->CheckProcess());
  const uint64_t step = state_->step;
  const absl::Time start = absl::Now();
  std::shared_ptr<client::ClientCore> core = state_->core;
  // Destroyed only in this process: a fork()ed child has no save thread to
  // join (client_core.h, NewClientCore).
  const pid_t creator = ::getpid();
  std::shared_ptr<client::LazyState> state(new client::LazyState(std::move(*this)),
                                           [creator](client::LazyState* s) {
                                             if (::getpid() == creator) delete s;
                                           });
  // (This builder, moved from, is spent: its state went with it.)
  state->core = core;
  {
    absl::MutexLock lock(&core->lazy_mu);
    std::erase_if(core->lazy_saves, [](const std::weak_ptr<client::LazyState>& w) { return w.expired(); });
    state->before = core->lazy_saves;  // registered earlier: they commit first
    core->lazy_saves.push_back(state);
  }
  state->Start();
  core->AddSaveCost(step, absl::Now() - start);
  return LazySave(std::move(state), step);
}

}  // namespace ckpt
