// ProtectionPolicy: how a job's in-memory node blobs are protected against node
// loss (docs/architecture.md "Protection"), as the metadata service's domain code sees it. The rpc
// layer translates ckpt.v1.ProtectionPolicy to and from this struct; jobs store
// it and the placement planner (planner.h) turns it into a plan.
//
//   none                          local memory only; tolerates no node loss
//   replicate{copies N, ring}     node i copies its blob to nodes i+1..i+N-1
//   replicate{copies N, group}    groups of N nodes copy to each other
//   ec{data k, parity m}          rotated-parity stripes over groups of k+m
//
// Fields that the kind does not use are ignored (`copies` and `placement` under
// ec, everything under none), so a policy converted from the wire need not zero
// them.
//
// Thread safety: a plain value type; const methods are pure and safe to call
// concurrently.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "ec/layout.h"

namespace ckpt::meta {

struct ProtectionPolicy {
  enum class Kind { kNone, kReplicate, kErasureCode };
  enum class Placement { kRing, kGroup };

  // Limits enforced by Validate(). `copies` counts the node's own copy, so
  // copies = 2 means one replica and tolerates one node loss. The EC limits
  // are those of ec::Codec (ISA-L), kept in ec/layout.h.
  static constexpr int kMinCopies = 2;
  static constexpr int kMaxCopies = 8;
  static constexpr int kMinDataK = ec::kMinDataK;
  static constexpr int kMaxDataK = ec::kMaxDataK;
  static constexpr int kMinParityM = ec::kMinParityM;
  static constexpr int kMaxParityM = ec::kMaxParityM;

  Kind kind = Kind::kNone;
  // kReplicate: total in-memory copies of every blob, own copy included.
  int copies = 0;
  // kReplicate: how the copies' holders are chosen.
  Placement placement = Placement::kRing;
  // kErasureCode: segments each blob is cut into (k).
  int data_k = 0;
  // kErasureCode: parity segments per stripe (m).
  int parity_m = 0;

  static ProtectionPolicy None() { return ProtectionPolicy{}; }
  static ProtectionPolicy Replicate(int copies, Placement placement) {
    ProtectionPolicy p;
    p.kind = Kind::kReplicate;
    p.copies = copies;
    p.placement = placement;
    return p;
  }
  static ProtectionPolicy ErasureCode(int data_k, int parity_m) {
    ProtectionPolicy p;
    p.kind = Kind::kErasureCode;
    p.data_k = data_k;
    p.parity_m = parity_m;
    return p;
  }

  // OK, or InvalidArgument whose message names the field, its value and the
  // allowed range, e.g. "replicate: copies is 1; it must be 2..8 (copies
  // counts the node's own copy, so 2 means one replica)".
  absl::Status Validate() const {
    switch (kind) {
      case Kind::kNone:
        return absl::OkStatus();
      case Kind::kReplicate:
        if (copies < kMinCopies || copies > kMaxCopies) {
          return absl::InvalidArgumentError(absl::StrCat(
              "replicate: copies is ", copies, "; it must be ", kMinCopies, "..", kMaxCopies,
              " (copies counts the node's own copy, so 2 means one replica)"));
        }
        if (placement != Placement::kRing && placement != Placement::kGroup) {
          return absl::InvalidArgumentError(absl::StrCat(
              "replicate: placement is ", static_cast<int>(placement),
              "; it must be ring or group"));
        }
        return absl::OkStatus();
      case Kind::kErasureCode:
        return ec::ValidateShape(data_k, parity_m);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "protection kind is ", static_cast<int>(kind), "; it must be none, replicate or ec"));
  }

  // Fewest alive nodes a plan for this (valid) policy needs: 0 for none,
  // `copies` for replicate, k+m for ec.
  int MinNodes() const {
    switch (kind) {
      case Kind::kReplicate:
        return copies;
      case Kind::kErasureCode:
        return data_k + parity_m;
      case Kind::kNone:
        break;
    }
    return 0;
  }

  // Simultaneous node losses that never lose data under any plan for this
  // (valid) policy: 0 for none, copies-1 for replicate, m for ec.
  int ToleratedFailures() const {
    switch (kind) {
      case Kind::kReplicate:
        return copies - 1;
      case Kind::kErasureCode:
        return parity_m;
      case Kind::kNone:
        break;
    }
    return 0;
  }

  // "none", "replicate{3, ring}", "replicate{2, group}", "ec{4, 2}".
  std::string ToString() const {
    switch (kind) {
      case Kind::kReplicate:
        return absl::StrCat("replicate{", copies, ", ",
                            placement == Placement::kGroup ? "group" : "ring", "}");
      case Kind::kErasureCode:
        return absl::StrCat("ec{", data_k, ", ", parity_m, "}");
      case Kind::kNone:
        break;
    }
    return "none";
  }

  // Field-wise, ignored fields included: normalise before comparing policies
  // that came from different sources.
  friend bool operator==(const ProtectionPolicy&, const ProtectionPolicy&) = default;
};

// Parses the command-line spelling shared by ckpt-meta's --default-protection,
// the Python client and quickstart: "none", "replicate:COPIES[:ring|group]"
// (ring when omitted) or "ec:K+M". The result is Validate()d. InvalidArgument
// quoting `text` and the expected forms otherwise.
absl::StatusOr<ProtectionPolicy> ParseProtectionPolicy(std::string_view text);

}  // namespace ckpt::meta
