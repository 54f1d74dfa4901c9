#include "server/rpc/status_convert.h"

#include "absl/strings/str_cat.h"

namespace ckpt::rpc {
namespace {
constexpr int kMaxCanonicalCode = static_cast<int>(absl::StatusCode::kUnauthenticated);
}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

void ToProto(const absl::Status& status, v1::EntryStatus* out) {
  out->set_code(static_cast<int32_t>(status.code()));
  out->set_message(status.ok() ? std::string() : std::string(status.message()));
}

absl::StatusOr<absl::Status> StatusFromProto(const v1::EntryStatus& entry, const std::string& field) {
  if (entry.code() < 0 || entry.code() > kMaxCanonicalCode) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".code is ", entry.code(),
                                                   "; it must be a canonical status code 0..",
                                                   kMaxCanonicalCode));
  }
  if (entry.code() == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(entry.code()), entry.message());
}

}  // namespace ckpt::rpc
