// Status propagation macros for absl::Status / absl::StatusOr<T>.
//
// Debian 12's Abseil (20220623) ships no status macros, so ckpt defines its own.
// Both macros evaluate their argument exactly once and are safe in any function
// that returns absl::Status or absl::StatusOr<U>.
//
//   CKPT_RETURN_IF_ERROR(file->Sync());
//   CKPT_ASSIGN_OR_RETURN(auto codec, ec::Codec::Create(4, 2));
//   CKPT_ASSIGN_OR_RETURN(size, fs->GetFileSize(path));
//
// Errors are passed on unchanged: the function that decides an error logs it and
// adds context (docs/style.md "Errors"); callers that want to add context use
// CKPT_RETURN_IF_ERROR_CTX / Annotate() below.
#pragma once

#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace ckpt {

// Returns `status` with `context + ": "` prepended to its message, keeping the
// code. An OK status is returned unchanged.
inline absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(absl::string_view(context.data(), context.size()), ": ",
                                   status.message()));
}

namespace internal_status {
inline const absl::Status& AsStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& AsStatus(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace internal_status

}  // namespace ckpt

#define CKPT_STATUS_CONCAT_INNER_(a, b) a##b
#define CKPT_STATUS_CONCAT_(a, b) CKPT_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status or StatusOr)
// is not OK.
#define CKPT_RETURN_IF_ERROR(expr)                                              \
  do {                                                                          \
    const auto& ckpt_status_ = (expr);                                          \
    if (!::ckpt::internal_status::AsStatus(ckpt_status_).ok())                  \
      return ::ckpt::internal_status::AsStatus(ckpt_status_);                   \
  } while (false)

// As CKPT_RETURN_IF_ERROR, prefixing the message with `context` (a string).
#define CKPT_RETURN_IF_ERROR_CTX(expr, context)                                 \
  do {                                                                          \
    const auto& ckpt_status_ = (expr);                                          \
    if (!::ckpt::internal_status::AsStatus(ckpt_status_).ok())                  \
      return ::ckpt::Annotate(::ckpt::internal_status::AsStatus(ckpt_status_),  \
                              (context));                                       \
  } while (false)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else
// moves the value into `lhs`, which may be a declaration (`auto x`) or an
// existing lvalue.
#define CKPT_ASSIGN_OR_RETURN(lhs, rexpr)                                       \
  CKPT_ASSIGN_OR_RETURN_IMPL_(CKPT_STATUS_CONCAT_(ckpt_statusor_, __LINE__), lhs, rexpr)

#define CKPT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr)                       \
  auto statusor = (rexpr);                                                      \
  if (!statusor.ok()) return std::move(statusor).status();                      \
  lhs = std::move(statusor).value()
