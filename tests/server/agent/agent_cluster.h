// AgentCluster: a test fixture of several in-process agents joined by the
// loopback transport (optionally behind a FaultTransport), each with its own
// FakeMeta, memory tier in a temp dir, and helpers to save a shard, read a
// holding's bytes, and wait (bounded) for a task result. The agents run their
// threads on the real clock; every wait is bounded, nothing sleeps.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/mem_file_system.h"
#include "fake_meta.h"
#include "server/agent/agent.h"
#include "support/temp_dir.h"
#include "transport/fault/fault_transport.h"
#include "transport/loopback/loopback_transport.h"

namespace ckpt::agent {

inline constexpr uint64_t kMiB = 1 << 20;
inline constexpr absl::Duration kWait = absl::Seconds(30);

struct Node {
  std::string id;
  FakeMeta meta;
  MetricsRegistry metrics;
  std::unique_ptr<transport::Transport> transport;
  transport::FaultTransport* fault = nullptr;  // when the node injects faults
  std::unique_ptr<Agent> agent;
  PeerEndpoint endpoint;
};

struct NodeOptions {
  bool faulty = false;
  int64_t peer_timeout_ms = 20000;
  int64_t hedge_ms = 0;
  int64_t parity_expire_ms = 0;  // 0: the agent's default
  uint64_t memory_bytes = 8 * kMiB;
  uint64_t chunk_bytes = 1000;  // several chunks per shard, unaligned
  bool check_membership = false;  // AgentOptions::check_peer_membership
};

class AgentCluster : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = std::make_unique<ckpt::testing::TempDir>(*ckpt::testing::TempDir::Create()); }
  void TearDown() override {
    for (auto& n : nodes_) {
      if (n->agent) n->agent->Stop();
    }
  }

  Node& AddNode(uint32_t world, NodeOptions no = {}) {
    static int counter = 0;
    auto n = std::make_unique<Node>();
    n->id = absl::StrCat("n", nodes_.size());
    n->meta.world["job"] = world;
    n->transport = transport::NewLoopbackTransport();
    if (no.faulty) {
      auto f = std::make_unique<transport::FaultTransport>(std::move(n->transport));
      n->fault = f.get();
      n->transport = std::move(f);
    }
    AgentOptions o;
    o.node_id = n->id;
    o.memory_dir = absl::StrCat(dir_->path(), "/", n->id);
    o.memory_bytes = no.memory_bytes;
    o.populate = false;
    o.transport = n->transport.get();
    o.data_listen_address = absl::StrCat("loop:agent-cluster-", ::getpid(), "-", counter++);
    o.bulk.chunk_bytes = no.chunk_bytes;
    o.bulk.max_in_flight = 2;
    o.peer_timeout_ms = no.peer_timeout_ms;
    o.parity_expire_ms = no.parity_expire_ms;
    o.hedge_ms = no.hedge_ms;
    o.check_peer_membership = no.check_membership;
    absl::StatusOr<std::unique_ptr<Agent>> a = Agent::Create(o, &n->meta, RealClock(), &fs_, &n->metrics);
    EXPECT_TRUE(a.ok()) << a.status();
    n->agent = *std::move(a);
    n->agent->ControlOnce();  // registers: incarnation 1
    n->endpoint = PeerEndpoint{n->id, 1, n->agent->data_address(), false};
    nodes_.push_back(std::move(n));
    return *nodes_.back();
  }

  static std::string RandomBytes(uint64_t size, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::string bytes(size, '\0');
    for (auto& c : bytes) c = static_cast<char>(rng());
    return bytes;
  }

  // Saves `size` random bytes as one item of `rank`; verified and reported.
  ShardRecord Save(Node& n, uint64_t step, uint32_t rank, uint64_t size, uint64_t seed) {
    const std::string bytes = RandomBytes(size, seed);
    absl::StatusOr<LeaseGrant> g = n.agent->AcquireLease(LeaseRequest{"job", step, rank, size, "run", 0, 0, "", {}});
    EXPECT_TRUE(g.ok()) << g.status();
    if (!g.ok()) return {};
    uint64_t off = 0;
    for (const Region& r : g->regions) {
      const uint64_t len = std::min<uint64_t>(r.length, size - off);
      std::memcpy(const_cast<std::byte*>(n.agent->arena().Data(r.file_offset)), bytes.data() + off, len);
      off += len;
      if (off == size) break;
    }
    ManifestItem it;
    it.name = "w";
    it.dtype = kDTypeBytes;
    it.length_bytes = size;
    it.crc32c = Crc32c(bytes);
    absl::StatusOr<std::shared_ptr<const ShardRecord>> rec = n.agent->Commit(g->lease_id, size, {it});
    EXPECT_TRUE(rec.ok()) << rec.status();
    n.agent->VerifyOnce();
    contents_[{n.id, rank}] = bytes;
    return rec.ok() ? **rec : ShardRecord{};
  }

  std::string Bytes(Agent& a, const ShardId& id) {
    std::string out;
    absl::Status s = a.ReadShard(id, 0, 0, [&](const std::byte* p, uint64_t n) {
      out.append(reinterpret_cast<const char*>(p), n);
      return absl::OkStatus();
    }, nullptr);
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }

  // Waits until meta got a result for `task`; returns it.
  absl::Status WaitResult(Node& n, const std::string& task) {
    absl::MutexLock lock(&n.meta.mu);
    auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(n.meta.mu) {
      for (const auto& [id, st] : n.meta.results)
        if (id == task) return true;
      return false;
    };
    if (!n.meta.mu.AwaitWithTimeout(absl::Condition(&has), kWait)) return absl::DeadlineExceededError(task);
    for (const auto& [id, st] : n.meta.results)
      if (id == task) return st;
    return absl::InternalError("unreachable");
  }

  // Waits (bounded, polling another agent's threads) until `cond` holds.
  template <typename Cond>
  static bool Eventually(Cond cond) {
    const absl::Time deadline = absl::Now() + kWait;
    while (!cond()) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return true;
  }

  // The value of a metric (without labels) in a node's registry; -1 if absent.
  static double Metric(Node& n, const std::string& name) {
    const std::string text = n.metrics.SerializeText();
    size_t pos = 0;
    while ((pos = text.find(name + " ", pos)) != std::string::npos) {
      if (pos == 0 || text[pos - 1] == '\n') return std::stod(text.substr(pos + name.size() + 1));
      pos += name.size();
    }
    return -1;
  }

  // Waits until `n` reported the parity segment (position 2) of `stripe` of
  // `step`; false after kWait.
  bool WaitParityReport(Node& n, uint64_t step, uint32_t stripe) {
    absl::MutexLock lock(&n.meta.mu);
    auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(n.meta.mu) {
      for (const HoldingReport& r : n.meta.reports) {
        if (r.kind == HoldingReport::Kind::kSegment && r.segment.step == step && r.segment.stripe == stripe &&
            r.segment.position == 2) {
          return true;
        }
      }
      return false;
    };
    return n.meta.mu.AwaitWithTimeout(absl::Condition(&has), kWait);
  }

  std::vector<HoldingReport> SegmentReports(Node& n) {
    absl::MutexLock lock(&n.meta.mu);
    std::vector<HoldingReport> out;
    for (const HoldingReport& r : n.meta.reports)
      if (r.kind == HoldingReport::Kind::kSegment) out.push_back(r);
    return out;
  }

  std::string Content(const std::string& node, uint32_t rank) { return contents_[{node, rank}]; }

  // What `n`'s meta answers heartbeats with from now on: `members` (node id,
  // incarnation) as generation `generation`.
  static void SetMembers(Node& n, uint64_t generation, const std::vector<Member>& members) {
    absl::MutexLock lock(&n.meta.mu);
    n.meta.membership_generation = generation;
    n.meta.members = members;
  }

  AgentTask ReplicateTask(const std::string& id, uint64_t step, uint32_t rank,
                          const std::vector<PeerEndpoint>& targets) {
    AgentTask t;
    t.id = id;
    t.kind = TaskKind::kReplicate;
    t.kind_name = "replicate";
    t.job_id = "job";
    t.step = step;
    t.ranks = {rank};
    t.targets = targets;
    return t;
  }

  // The ec_encode task of EncodeRs21's layout (the id left for the caller).
  AgentTask Rs21EncodeTask(uint64_t step, const uint64_t sizes[3]) {
    AgentTask t;
    t.kind = TaskKind::kEcEncode;
    t.kind_name = "ec_encode";
    t.job_id = "job";
    t.step = step;
    t.group.data_k = 2;
    t.group.parity_m = 1;
    for (uint32_t s = 0; s < 3; ++s) {
      t.group.node_ids.push_back(nodes_[s]->id);
      EcStripeLayout st;
      st.stripe_index = s;
      st.data_node_ids = {nodes_[(s + 1) % 3]->id, nodes_[(s + 2) % 3]->id};
      st.data_segment_indices = {0, 1};
      st.parity_node_ids = {nodes_[s]->id};
      t.group.stripes.push_back(st);
      NodeBlob b;
      b.node_id = nodes_[s]->id;
      b.parts.push_back(BlobPart{s, 0, sizes[s]});
      b.size_bytes = sizes[s];
      b.segment_bytes = (sizes[s] + 1) / 2;
      t.blobs.push_back(b);
      t.members.push_back(nodes_[s]->endpoint);
    }
    return t;
  }

  // Saves one shard of `sizes[j]` bytes on nodes_[j] (j < 3) and runs an
  // RS(2,1) encode over them: stripe s has its parity on node s and data
  // segments of nodes s+1 (position 0) and s+2 (position 1). Returns the
  // segment reports by stripe and position.
  std::map<uint32_t, std::map<uint32_t, HoldingReport>> EncodeRs21(uint64_t step, const uint64_t sizes[3]) {
    for (uint32_t j = 0; j < 3; ++j) recs_.push_back(Save(*nodes_[j], step, j, sizes[j], 20 + j));
    for (auto& n : nodes_) n->agent->Start();
    AgentTask t = Rs21EncodeTask(step, sizes);
    for (uint32_t j = 0; j < 3; ++j) {
      t.id = absl::StrCat("t-ec-", j);
      nodes_[j]->agent->EnqueueTasks({t});
    }
    bool done = true;
    for (uint32_t j = 0; j < 3; ++j) {
      const absl::Status s = WaitResult(*nodes_[j], absl::StrCat("t-ec-", j));
      EXPECT_TRUE(s.ok()) << s;
      done = done && s.ok();
    }
    // A node's task can end before the last data node's push to its parity
    // arrives: once every task succeeded, each stripe's parity report is
    // waited for (node s holds stripe s's).
    for (uint32_t s = 0; done && s < 3; ++s) {
      EXPECT_TRUE(WaitParityReport(*nodes_[s], step, s)) << "stripe " << s << ": no parity report";
    }
    std::map<uint32_t, std::map<uint32_t, HoldingReport>> seg;
    for (uint32_t j = 0; j < 3; ++j) {
      for (const HoldingReport& r : SegmentReports(*nodes_[j])) seg[r.segment.stripe][r.segment.position] = r;
    }
    seg_ = seg;
    return seg;
  }
  SegmentLocation Loc(uint64_t step, uint32_t s, uint32_t p, const Node& holder) {
    SegmentLocation l;
    l.key = SegmentId{"job", step, 0, s, p};
    l.kind = p < 2 ? SegmentKind::kData : SegmentKind::kParity;
    l.length_bytes = seg_[s][p].size_bytes;
    l.crc32c = seg_[s][p].crc32c;
    l.holder = holder.endpoint;
    return l;
  }

  // Where n0's shard of EncodeRs21's layout is: its segment 0 in stripe 2
  // (position 0), its segment 1 in stripe 1 (position 1). `adjust` may change
  // each location (e.g. mark a holder SUSPECT).
  EcDecodeSource N0DecodeSource(uint64_t step, const uint64_t sizes[3],
                                const std::function<void(SegmentLocation&)>& adjust = nullptr) {
    auto loc = [&](uint32_t s, uint32_t p, const Node& holder) {
      SegmentLocation l = Loc(step, s, p, holder);
      if (adjust) adjust(l);
      return l;
    };
    EcDecodeSource src;
    src.data_k = 2;
    src.parity_m = 1;
    src.owner_node_id = "n0";
    src.segment_bytes = (sizes[0] + 1) / 2;
    src.stripes = {{2, 0, 0, std::max(seg_[2][0].size_bytes, seg_[2][1].size_bytes),
                    {loc(2, 0, *nodes_[0]), loc(2, 1, *nodes_[1]), loc(2, 2, *nodes_[2])}},
                   {1, 1, 1, std::max(seg_[1][0].size_bytes, seg_[1][1].size_bytes),
                    {loc(1, 0, *nodes_[2]), loc(1, 1, *nodes_[0]), loc(1, 2, *nodes_[1])}}};
    return src;
  }

  std::unique_ptr<ckpt::testing::TempDir> dir_;
  MemFileSystem fs_;
  std::vector<std::unique_ptr<Node>> nodes_;
  std::map<std::pair<std::string, uint32_t>, std::string> contents_;
  std::vector<ShardRecord> recs_;                               // EncodeRs21's shards
  std::map<uint32_t, std::map<uint32_t, HoldingReport>> seg_;  // EncodeRs21's segments
};

}  // namespace ckpt::agent
