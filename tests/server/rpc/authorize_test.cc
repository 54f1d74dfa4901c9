// The rules of server/rpc/authorize.h on identities (the decisions the
// Authorizer takes once it knows the caller's certificate identity); through
// the real daemons in tests/security/insecure_test.py and
// tests/integration/dpu_proxy_test.cc.
#include "server/rpc/authorize.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ckpt::rpc {
namespace {

using ::testing::HasSubstr;
using pki::Identity;
using pki::Role;

const Identity kAdmin{Role::kAdmin, "alice"};
const Identity kOperator{Role::kOperator, "oncall"};
const Identity kTrainerA{Role::kTrainer, "team-a", {"job-a"}};
const Identity kHost{Role::kNode, "h1"};
const Identity kOtherNode{Role::kNode, "h2"};
const Identity kDpuOfHost{Role::kNode, "d1", {}, "h1"};
const Identity kMeta{Role::kMeta, ""};

struct Call {
  const char* rpc;
  std::string job;
  Access access;
};

// What AgentServiceImpl passes for each RPC (agent_service.cc).
const std::vector<Call> kTrainerCalls = {
    {"AcquireStagingLease", "job-b", Access::kSave}, {"CommitShard", "", Access::kSave},
    {"AbortLease", "", Access::kSave},                {"OpenShard", "job-b", Access::kReadBytes},
    {"ReadShard", "job-b", Access::kReadBytes},       {"CloseShard", "", Access::kOwnHandle},
    {"DeliverShard", "", Access::kOwnHandle},         {"AgentStatus", "", Access::kRead},
    {"GetInventory", "job-b", Access::kRead},         {"Verify", "job-b", Access::kRead},
};
const std::vector<Call> kNodeWideChanges = {
    {"Flush", "job-b", Access::kWrite}, {"Evict", "job-b", Access::kWrite}, {"PauseProtection", "", Access::kWrite}};

TEST(AgentPortDecision, ADpuAgentTakesItsHostsTrainerCallsForAnyJob) {
  for (const Call& c : kTrainerCalls) {
    grpc::Status s = AgentPortDecision(kHost, "h1", c.job, c.access, c.rpc);
    EXPECT_TRUE(s.ok()) << c.rpc << ": " << s.error_message();
  }
}

TEST(AgentPortDecision, ItsHostMayNotFlushEvictOrPause) {
  for (const Call& c : kNodeWideChanges) {
    grpc::Status s = AgentPortDecision(kHost, "h1", c.job, c.access, c.rpc);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << c.rpc;
    EXPECT_THAT(s.error_message(), HasSubstr("this DPU agent's host"));
    EXPECT_THAT(s.error_message(), HasSubstr(c.rpc));
  }
}

TEST(AgentPortDecision, NoOtherNodeCallsADpuAgent) {
  // Another node, the DPU's own certificate, or a DPU certificate of the
  // host's name: refused, naming the one node that may.
  for (const Identity& who : {kOtherNode, kDpuOfHost, Identity{Role::kNode, "h1", {}, "h9"}}) {
    for (const Call& c : kTrainerCalls) {
      grpc::Status s = AgentPortDecision(who, "h1", c.job, c.access, c.rpc);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << c.rpc << " " << IdentityText(who);
      EXPECT_THAT(s.error_message(), HasSubstr("only ckpt://node/h1, the host this DPU agent serves"));
    }
  }
}

TEST(AgentPortDecision, AHostAgentTakesNoNodeAtAll) {
  for (const Identity& who : {kHost, kOtherNode, kDpuOfHost, kMeta}) {
    for (const Call& c : kTrainerCalls) {
      grpc::Status s = AgentPortDecision(who, "", c.job, c.access, c.rpc);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << c.rpc;
      EXPECT_THAT(s.error_message(), HasSubstr("may not call an agent's port"));
    }
  }
}

TEST(AgentPortDecision, OtherRolesAreUnchangedByAHostNode) {
  for (const std::string host : {"", "h1"}) {
    for (const Call& c : kTrainerCalls) {
      EXPECT_TRUE(AgentPortDecision(kAdmin, host, c.job, c.access, c.rpc).ok()) << c.rpc;
      // An operator reads; a trainer reads its jobs' shards and its handles.
      EXPECT_EQ(AgentPortDecision(kOperator, host, c.job, c.access, c.rpc).ok(), c.access == Access::kRead)
          << c.rpc;
      EXPECT_EQ(AgentPortDecision(kTrainerA, host, c.job, c.access, c.rpc).ok(), c.access == Access::kOwnHandle)
          << c.rpc;  // job-b is not team-a's
      const bool own_read = c.access == Access::kRead || c.access == Access::kReadBytes ||
                            c.access == Access::kOwnHandle;
      EXPECT_EQ(AgentPortDecision(kTrainerA, host, c.job.empty() ? "" : "job-a", c.access, c.rpc).ok(),
                own_read && (!c.job.empty() || c.access == Access::kOwnHandle))
          << c.rpc;
    }
    for (const Call& c : kNodeWideChanges) {
      EXPECT_TRUE(AgentPortDecision(kAdmin, host, c.job, c.access, c.rpc).ok());
      EXPECT_FALSE(AgentPortDecision(kOperator, host, c.job, c.access, c.rpc).ok());
      EXPECT_FALSE(AgentPortDecision(kTrainerA, host, "job-a", c.access, c.rpc).ok());
    }
  }
  // A trainer saves through agent.sock, never on TCP (as before kSave).
  grpc::Status s = AgentPortDecision(kTrainerA, "h1", "job-a", Access::kSave, "AcquireStagingLease");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

TEST(HostClaimDecision, ADpuRegistersOnlyAsTheHostsItsCertificateNames) {
  EXPECT_TRUE(HostClaimDecision(kDpuOfHost, "h1", "RegisterNode").ok());
  EXPECT_TRUE(HostClaimDecision(kHost, "", "RegisterNode").ok());  // a host agent

  grpc::Status s = HostClaimDecision(kDpuOfHost, "h2", "RegisterNode");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("RegisterNode: the request claims to serve host \"h2\" but the caller's "
                                           "certificate ckpt://node/d1 (a DPU of host h1) names host \"h1\""));
  s = HostClaimDecision(Identity{Role::kNode, "d1"}, "h1", "RegisterNode");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("names no host"));
  EXPECT_THAT(s.error_message(), HasSubstr("ckptctl certs create-node --node-id d1 --host-node h1"));
  s = HostClaimDecision(kDpuOfHost, "", "RegisterNode");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("is a DPU's, serving host \"h1\""));
}

TEST(IdentityText, NamesTheHostOfADpu) {
  EXPECT_EQ(IdentityText(kDpuOfHost), "ckpt://node/d1 (a DPU of host h1)");
  EXPECT_EQ(IdentityText(kHost), "ckpt://node/h1");
}

}  // namespace
}  // namespace ckpt::rpc
