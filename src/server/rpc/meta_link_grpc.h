// MetaLink over gRPC: the agent's client of MetaService.
//
// Translates the agent's domain calls (server/agent/meta_link.h) to ckpt.v1
// messages and back. Every call carries a deadline (rpc_timeout); failures
// come back as the gRPC status (UNAVAILABLE when meta cannot be reached).
// Thread-safe: one channel, any number of concurrent calls.
#pragma once

#include <memory>
#include <grpcpp/security/credentials.h>

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "server/agent/meta_link.h"

namespace ckpt::rpc {

// Connects lazily to `meta_address` ("host:port"), over `credentials`
// (plaintext when null).
// `token` (if not empty) goes with every call as "authorization: Bearer".
std::unique_ptr<agent::MetaLink> NewGrpcMetaLink(const std::string& meta_address, absl::Duration rpc_timeout,
                                                 std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
                                                 std::string token = "");

}  // namespace ckpt::rpc
