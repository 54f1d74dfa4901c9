// The fixture meta's unit tests share: a MetaCore on an in-memory store and
// a fake clock, with nodes that register, heartbeat and stage shards the
// way agents do. Tests derive from MetaFixture and add what is theirs.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <set>
#include <string>

#include "common/clock.h"
#include "server/meta/meta_core.h"
#include "server/meta/store/mem_meta_store.h"

namespace ckpt::meta {

class MetaFixture : public ::testing::Test {
 protected:
  void SetUp() override { Reopen(); }

  // A new MetaCore over the same store (a meta restart).
  void Reopen() {
    core_.reset();
    auto c = MetaCore::Open(store_.get(), &clock_, options_);
    ASSERT_TRUE(c.ok()) << c.status();
    core_ = std::move(*c);
  }

  // Node `id` (1 GiB of memory) registers: its incarnation. It is alive
  // from then on (no longer in dead_).
  uint64_t Register(const std::string& id, const std::string& domain = "") {
    RegisterRequest r;
    r.node_id = id;
    r.grpc_address = id + ":7401";
    r.data_address = id + ":7402";
    r.memory_capacity_bytes = 1 << 30;
    r.failure_domain = domain;
    auto res = core_->RegisterNode(r);
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) return 0;
    inc_[id] = res->incarnation;
    dead_.erase(id);
    return res->incarnation;
  }

  // One heartbeat of `id` (`stopping`: the agent is stopping cleanly).
  HeartbeatResult Beat(const std::string& id, bool stopping = false) {
    HeartbeatRequest h;
    h.node_id = id;
    h.incarnation = inc_[id];
    h.stopping = stopping;
    auto res = core_->Heartbeat(h);
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? *res : HeartbeatResult{};
  }

  // Lets `d` pass a second at a time while every live node heartbeats.
  void Pass(absl::Duration d) {
    for (absl::Duration t; t < d; t += absl::Seconds(1)) {
      clock_.Advance(absl::Seconds(1));
      for (const auto& [n, inc] : inc_)
        if (!dead_.count(n)) Beat(n);
      ASSERT_TRUE(core_->Tick().ok());
    }
  }

  // `node` stops heartbeating until meta declares it DEAD (lease 5 s).
  void Silence(const std::string& node) {
    dead_.insert(node);
    Pass(absl::Seconds(7));
  }

  void CreateJob(const std::string& id, uint32_t world, ProtectionPolicy p, FlushPolicy f = {},
                 RetentionPolicy r = {}) {
    JobSpec spec;
    spec.job_id = id;
    spec.world_size = world;
    spec.protection = p;
    spec.flush = f;
    spec.retention = r;
    auto res = core_->CreateJob(spec, false);
    ASSERT_TRUE(res.ok()) << res.status();
  }

  // Rank `rank`'s shard of `size` bytes: one u8 item "w" over all of it.
  static Shard MakeShard(uint32_t rank, uint64_t size) {
    Shard s;
    s.rank = rank;
    s.size_bytes = size;
    s.crc32c = 0x1000 + rank;
    s.manifest_digest = 77 + rank;
    Item it;
    it.name = "w";
    it.dtype = 9;  // u8: a length of any size matches its shape
    it.shape = {size};
    it.length_bytes = size;
    s.items.push_back(it);
    return s;
  }

  // A STAGED report of `shard` from `node`: meta's verdict on it.
  absl::Status StageShard(const std::string& node, const std::string& job, uint64_t step, Shard shard) {
    ShardReport r;
    r.kind = ShardReport::Kind::kStaged;
    r.staged.job_id = job;
    r.staged.step = step;
    r.staged.shard = std::move(shard);
    auto res = core_->ReportShards(node, inc_[node], {r});
    if (!res.ok()) return res.status();
    return res->results[0];
  }

  absl::Status Stage(const std::string& node, const std::string& job, uint64_t step, uint32_t rank,
                     uint64_t size = 4096) {
    return StageShard(node, job, step, MakeShard(rank, size));
  }

  FakeClock clock_;
  MetaOptions options_;
  std::unique_ptr<MetaStore> store_ = NewMemMetaStore();
  std::unique_ptr<MetaCore> core_;
  std::map<std::string, uint64_t> inc_;  // node -> its incarnation
  std::set<std::string> dead_;           // nodes that do not heartbeat in Pass
};

}  // namespace ckpt::meta
