// absl::Status <-> grpc::Status and ckpt.v1.EntryStatus, shared by every gRPC
// adapter of the daemons. Pure functions, thread-safe.
#pragma once

#include <string>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ckpt/v1/common.pb.h"

namespace ckpt::rpc {

// Same numeric code, same message. absl::StatusCode and grpc::StatusCode share
// their numbers.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// code and message (empty message for OK).
void ToProto(const absl::Status& status, v1::EntryStatus* out);

// The absl::Status an EntryStatus describes (OK for code 0, whatever the
// message). InvalidArgument naming `field` if the code is not a canonical code
// (0..16). The outer StatusOr is about the conversion, the inner value is the
// reported outcome.
absl::StatusOr<absl::Status> StatusFromProto(const v1::EntryStatus& entry, const std::string& field);

}  // namespace ckpt::rpc
