// The in-memory MetaStore: a std::map behind a mutex, for unit tests of the
// metadata service (no disk, no threads, deterministic).
//
// It follows the MetaStore contract (meta_store.h) exactly, except that
// nothing survives the object: a batch is applied and "durable" inside
// Submit(), so AwaitDurable never waits and stats().fsyncs counts one write
// per non-empty batch (no grouping). There is no queue, so Submit never waits
// for backpressure. MemMetaStoreOptions::test_write_hook makes a write fail,
// to exercise the sticky-error contract.
//
// Thread safety: all methods may be called concurrently from any thread.
#pragma once

#include <memory>

#include "server/meta/store/meta_store.h"

namespace ckpt::meta {

struct MemMetaStoreOptions {
  // Test seam: called inside Submit() before a non-empty batch is applied
  // (with no lock held); an error fails that batch as a write error would.
  WriteHook test_write_hook;
};

// Returns an empty in-memory store. Never fails.
std::unique_ptr<MetaStore> NewMemMetaStore(MemMetaStoreOptions options = {});

}  // namespace ckpt::meta
