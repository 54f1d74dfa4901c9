// A cluster of real daemons on 127.0.0.1 for protection tests: ckpt-meta
// and N agents (ckpt-agent, or ckpt-dpu-agent for the nodes a test names),
// ranks saving and restoring byte-checked state, kills and restarts by PID.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "integration/agent_process.h"
#include "integration/client_options.h"
#include "integration/meta_process.h"
#include "support/temp_dir.h"

namespace ckpt::testing {

inline constexpr absl::Duration kLong = absl::Seconds(90);

inline std::vector<uint8_t> RankBytes(uint32_t rank, uint64_t step, size_t n) {
  std::mt19937_64 rng(rank * 1000003ull + step);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(rng());
  return v;
}

class ClusterTest : public ::testing::Test {
 protected:
  // Nodes n0..n<agents-1>; those `dpu` names run ckpt-dpu-agent (pull-mode
  // ingest) serving the host id it maps them to, the others ckpt-agent.
  void StartCluster(int agents, const std::string& memory = "96MiB", const std::map<int, std::string>& dpu = {}) {
    absl::StatusOr<TempDir> dir = TempDir::Create();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::make_unique<TempDir>(*std::move(dir));
    // A short lease (meta_lease_ms_): a killed agent is declared dead within ~2 s.
    absl::StatusOr<std::unique_ptr<MetaProcess>> meta =
        MetaProcess::Start(*dir_->Sub("meta"), dir_->path(), meta_lease_ms_);
    ASSERT_TRUE(meta.ok()) << meta.status();
    meta_ = *std::move(meta);
    for (int i = 0; i < agents; ++i) {
      AgentProcessOptions o;
      o.node_id = absl::StrCat("n", i);
      o.meta_address = meta_->address();
      o.dir = *dir_->Sub(o.node_id);
      o.memory = memory;
      o.extra_args = {"--data-chunk", "1MiB"};
      o.extra_args.insert(o.extra_args.end(), extra_agent_args_.begin(), extra_agent_args_.end());
      if (auto host = dpu.find(i); host != dpu.end()) {
        o.binary = "ckpt-dpu-agent";
        o.extra_args.insert(o.extra_args.end(), {"--host-node", host->second});
      }
      absl::StatusOr<std::unique_ptr<AgentProcess>> a = AgentProcess::Start(o);
      ASSERT_TRUE(a.ok()) << a.status();
      agents_.push_back(*std::move(a));
      alive_.push_back(true);
    }
  }

  std::string Logs() {
    std::string out = "--- meta ---\n" + meta_->proc()->LogTail();
    for (size_t i = 0; i < agents_.size(); ++i) {
      if (agents_[i]->proc() != nullptr) absl::StrAppend(&out, "--- n", i, " ---\n", agents_[i]->proc()->LogTail());
    }
    return out;
  }

  // Rank r saves on node r; waits until the version is PROTECTED.
  void SaveAll(const std::string& job, uint64_t step, uint32_t world, Protection protection, size_t bytes) {
    std::vector<SaveHandle> handles;
    protection_ = protection;
    for (uint32_t r = 0; r < world; ++r) {
      ClientOptions o = testing::ClientOptionsFor(*meta_, *agents_[r], job, r, world);
      o.protection = protection;
      o.keep_in_memory = 4;
      absl::StatusOr<Client> c = Client::Connect(o);
      ASSERT_TRUE(c.ok()) << c.status();
      const std::vector<uint8_t> data = RankBytes(r, step, bytes + r * 4099);
      SaveBuilder s = c->BeginSave(step);
      ASSERT_TRUE(s.Add("state", std::as_bytes(std::span<const uint8_t>(data)), DType::kU8, {data.size()}).ok());
      absl::StatusOr<SaveHandle> h = s.Commit();
      ASSERT_TRUE(h.ok()) << h.status();
      handles.push_back(*h);
      clients_.push_back(*std::move(c));
    }
    for (SaveHandle& h : handles) {
      absl::Status st = h.Wait(Level::kProtected, absl::Now() + kLong);
      ASSERT_TRUE(st.ok()) << st << "\n" << Logs();
    }
  }

  // Every rank restored through `via(rank)`'s agent: byte-identical. Returns
  // where each came from.
  std::vector<ServedFrom> LoadAll(const std::string& job, uint64_t step, uint32_t world, size_t bytes,
                                  const std::function<int(uint32_t)>& via) {
    std::vector<ServedFrom> from;
    for (uint32_t r = 0; r < world; ++r) {
      const int node = via(r);
      EXPECT_TRUE(alive_[node]);
      ClientOptions o = testing::ClientOptionsFor(*meta_, *agents_[node], job, r, world);
      o.protection = protection_;
      absl::StatusOr<Client> c = Client::Connect(o);
      EXPECT_TRUE(c.ok()) << c.status();
      if (!c.ok()) return from;
      absl::StatusOr<LoadedShard> shard = c->Load(step);
      EXPECT_TRUE(shard.ok()) << "rank " << r << " via n" << node << ": " << shard.status() << "\n" << Logs();
      if (!shard.ok()) return from;
      absl::StatusOr<std::span<const std::byte>> view = shard->View("state");
      EXPECT_TRUE(view.ok());
      const std::vector<uint8_t> want = RankBytes(r, step, bytes + r * 4099);
      EXPECT_EQ(view->size(), want.size()) << "rank " << r;
      EXPECT_EQ(std::memcmp(view->data(), want.data(), std::min(view->size(), want.size())), 0) << "rank " << r;
      from.push_back(shard->served_from());
    }
    return from;
  }

  // The first alive node after `r` (mod n) that is not in `avoid`.
  int AliveAfter(uint32_t r, std::set<int> avoid = {}) {
    const int n = static_cast<int>(agents_.size());
    for (int i = 1; i <= n; ++i) {
      const int c = (static_cast<int>(r) + i) % n;
      if (alive_[c] && !avoid.count(c)) return c;
    }
    return -1;
  }

  void Kill(int node) {
    ASSERT_TRUE(agents_[node]->proc()->Kill().ok());
    (void)agents_[node]->proc()->Wait();
    alive_[node] = false;
  }

  v1::VersionState State(const std::string& job, uint64_t step) {
    v1::GetVersionRequest req;
    req.set_job_id(job);
    req.set_step(step);
    v1::GetVersionResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!meta_->stub()->GetVersion(&ctx, req, &resp).ok()) return v1::VERSION_STATE_UNSPECIFIED;
    return resp.version().state();
  }

  // Waits (bounded) until meta has declared the node dead.
  bool WaitDead(int node) {
    const absl::Time deadline = absl::Now() + kLong;
    while (absl::Now() < deadline) {
      v1::ListNodesRequest req;
      v1::ListNodesResponse resp;
      grpc::ClientContext ctx;
      if (meta_->stub()->ListNodes(&ctx, req, &resp).ok()) {
        for (const auto& n : resp.nodes()) {
          if (n.endpoint().node_id() == absl::StrCat("n", node) && n.state() == v1::NODE_STATE_DEAD) return true;
        }
      }
      absl::SleepFor(absl::Milliseconds(50));  // bounded poll of real processes
    }
    return false;
  }

  // Waits (bounded) until the version is in `want`.
  bool WaitState(const std::string& job, uint64_t step, v1::VersionState want) {
    const absl::Time deadline = absl::Now() + kLong;
    while (absl::Now() < deadline) {
      if (State(job, step) == want) return true;
      absl::SleepFor(absl::Milliseconds(50));  // bounded poll of real processes
    }
    return false;
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<MetaProcess> meta_;
  std::vector<std::unique_ptr<AgentProcess>> agents_;
  std::vector<bool> alive_;
  std::vector<std::string> extra_agent_args_;  // given to every agent StartCluster starts
  int64_t meta_lease_ms_ = 2000;               // meta's --lease-ms for StartCluster
  std::vector<Client> clients_;
  Protection protection_;
};

}  // namespace ckpt::testing
