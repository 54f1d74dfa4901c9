// What a SaveBuilder holds while it is filled in (SaveState), and the lease
// asked for when a save began (EarlyLease). Internal to src/client: the
// public SaveBuilder (ckpt/client.h) owns one SaveState and forwards to it.
//
// The save itself (save.cc, SaveBuilder::CommitItems) runs in named steps:
//   PlanReferences  which items refer to the base's bytes (incremental saves)
//   LayOutShard     the items' offsets and the shard's size
//   TakeEarlyLease  the lease asked for at BeginSave, if the shard fits it
//   AcquireLease    a staging lease from the agent (session, then gRPC)
//   StageLease      the lease's regions mapped (or a pull staging buffer)
//   CopyItems       copy + crc, the manifest, the commit request
//   SendCommit      CommitShard on this thread or on the committer
// From AcquireLease's success to the commit being handed to SendCommit the
// lease is released by an absl::Cleanup on every early return.
//
// Thread safety: a SaveState belongs to the one thread filling or committing
// its SaveBuilder. An EarlyLease is written once by the thread that asks for
// it, then `done` is notified; readers wait for `done`.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "ckpt/client.h"
#include "ckpt/v1/agent.pb.h"
#include "client/session.h"

namespace ckpt::client {

struct ClientCore;

// One item added to a save.
struct SaveItem {
  std::string_view name;  // in SaveNames (stable)
  std::span<const std::byte> bytes;
  DType dtype;
  absl::InlinedVector<uint64_t, 4> shape;
  std::map<std::string, std::string> attributes;
  ItemChange change;
};

// The names added so far: their bytes in blocks that never move (no
// allocation per name), and a set of views of them for the duplicate check.
struct SaveNames {
  static constexpr size_t kBlockBytes = 64 << 10;
  std::vector<std::unique_ptr<char[]>> blocks;
  size_t used = 0;      // bytes of the last block taken
  size_t capacity = 0;  // of the last block
  absl::flat_hash_set<std::string_view> set;

  // A copy of `name` that lives as long as this.
  std::string_view Keep(std::string_view name) {
    if (capacity - used < name.size()) {
      capacity = std::max(kBlockBytes, name.size());
      blocks.push_back(std::make_unique_for_overwrite<char[]>(capacity));
      used = 0;
    }
    char* at = blocks.back().get() + used;
    std::memcpy(at, name.data(), name.size());
    used += name.size();
    return {at, name.size()};
  }
};

// A staging lease asked for on the session when a save began, of the size of
// the client's previous full save; `answer` is set, then `done` notified.
struct EarlyLease {
  uint64_t size_bytes = 0;
  uint64_t alignment = 0;  // the item alignment the size was laid out with
  absl::StatusOr<v1::AcquireStagingLeaseResponse> answer = absl::UnknownError("not answered");
  // The session that holds the lease: once it is closed (the agent stopped
  // or restarted since), the lease is gone and its regions may be another's.
  std::shared_ptr<AgentSession> session;
  absl::Notification done;
};

// A SaveBuilder's state (see SaveBuilder in ckpt/client.h).
struct SaveState {
  std::shared_ptr<ClientCore> core;
  uint64_t step = 0;
  bool spent = false;
  bool carry_rest = false;
  bool incremental = false;  // some item is not kChanged, or CarryRest
  std::vector<SaveItem> items;
  std::unique_ptr<SaveNames> names = std::make_unique<SaveNames>();
  // The lease BeginSave asked for in the background, of the size of this
  // client's previous save (a trainer saves the same state every time):
  // Commit uses it when the items fit, and releases it otherwise.
  std::shared_ptr<EarlyLease> early;
  // Which of this client's SaveBuilders this is (1, 2, ...): a lease is asked
  // ahead after its commit only if no builder began since.
  uint64_t begun_seq = 0;
};

}  // namespace ckpt::client
