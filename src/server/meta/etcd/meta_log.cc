#include "server/meta/etcd/meta_log.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/endian.h"

namespace ckpt::meta::replica {
namespace {

constexpr std::string_view kMagic = "CKL1";
constexpr uint8_t kFirst = 1;
constexpr uint8_t kLast = 2;
constexpr size_t kHeaderBytes = 4 + 1 + 4;

std::string EncodeGroup(const WriteBatch& group) {
  std::string out;
  AppendLe32(out, static_cast<uint32_t>(group.size()));
  for (const WriteBatch::Op& op : group.ops()) {
    out.push_back(op.type == WriteBatch::OpType::kPut ? 0 : 1);
    AppendLe32(out, static_cast<uint32_t>(op.key.size()));
    out += op.key;
    AppendLe32(out, static_cast<uint32_t>(op.value.size()));
    out += op.value;
  }
  return out;
}

absl::StatusOr<WriteBatch> DecodeGroup(std::string_view in) {
  auto damaged = [](const char* what) {
    return absl::DataLossError(absl::StrCat("meta log: a group's encoding is damaged (", what, ")"));
  };
  auto take32 = [&](uint32_t* v) {
    if (in.size() < 4) return false;
    *v = LoadLe32(in.data());
    in.remove_prefix(4);
    return true;
  };
  uint32_t count = 0;
  if (!take32(&count)) return damaged("no op count");
  WriteBatch out;
  for (uint32_t i = 0; i < count; ++i) {
    if (in.empty()) return damaged("fewer ops than counted");
    const uint8_t type = static_cast<uint8_t>(in[0]);
    in.remove_prefix(1);
    if (type > 1) return damaged("unknown op type");
    uint32_t n = 0;
    if (!take32(&n) || in.size() < n) return damaged("truncated key");
    std::string key(in.substr(0, n));
    in.remove_prefix(n);
    if (!take32(&n) || in.size() < n) return damaged("truncated value");
    std::string value(in.substr(0, n));
    in.remove_prefix(n);
    if (type == 0) {
      out.Put(std::move(key), std::move(value));
    } else {
      out.Delete(std::move(key));
    }
  }
  if (!in.empty()) return damaged("bytes after the last op");
  return out;
}

}  // namespace

std::string LeaderPrefix(std::string_view root) { return std::string(root) + "/leader"; }
std::string LogPrefix(std::string_view root) { return std::string(root) + "/log/"; }
std::string LogKey(std::string_view root, uint64_t index) { return LogPrefix(root) + EncodeIndex(index); }
std::string EncodeIndex(uint64_t index) { return absl::StrFormat("%020u", index); }

std::string SnapshotHeadKey(std::string_view root) { return std::string(root) + "/snapshot"; }
std::string SnapshotPrefix(std::string_view root) { return std::string(root) + "/snap/"; }
std::string SnapshotPartKey(std::string_view root, uint64_t index, uint32_t part) {
  return absl::StrFormat("%s%s/%06u", SnapshotPrefix(root), EncodeIndex(index), part);
}

std::string EncodeSnapshotHead(const SnapshotHead& head) { return absl::StrCat(head.index, " ", head.parts); }

absl::StatusOr<SnapshotHead> DecodeSnapshotHead(std::string_view value) {
  const std::string v(value);
  const size_t space = v.find(' ');
  SnapshotHead head;
  if (space == std::string::npos || !absl::SimpleAtoi(v.substr(0, space), &head.index) ||
      !absl::SimpleAtoi(v.substr(space + 1), &head.parts) || head.index == 0 || head.parts == 0) {
    return absl::DataLossError(absl::StrCat("meta log: the snapshot head is damaged: ", absl::CHexEscape(v)));
  }
  return head;
}

absl::StatusOr<uint64_t> LogIndexOf(std::string_view root, std::string_view key) {
  const std::string prefix = LogPrefix(root);
  uint64_t index = 0;
  if (key.substr(0, prefix.size()) != prefix || !absl::SimpleAtoi(std::string(key.substr(prefix.size())), &index) ||
      index == 0) {
    return absl::InvalidArgumentError(absl::StrCat("not a log key of ", std::string(root), ": ", absl::CHexEscape(std::string(key))));
  }
  return index;
}

std::vector<std::string> EncodeEntries(const WriteBatch& group) {
  const std::string payload = EncodeGroup(group);
  constexpr size_t kPiece = kMaxEntryBytes - kHeaderBytes;
  std::vector<std::string> out;
  for (size_t at = 0; at == 0 || at < payload.size(); at += kPiece) {
    const std::string_view piece = std::string_view(payload).substr(at, kPiece);
    uint8_t flags = 0;
    if (at == 0) flags |= kFirst;
    if (at + kPiece >= payload.size()) flags |= kLast;
    std::string e(kMagic);
    e.push_back(static_cast<char>(flags));
    AppendLe32(e, Crc32c(piece));
    e += piece;
    out.push_back(std::move(e));
  }
  return out;
}

absl::StatusOr<std::optional<WriteBatch>> EntryAssembler::Add(std::string_view entry) {
  if (entry.size() < kHeaderBytes || entry.substr(0, kMagic.size()) != kMagic) {
    return absl::DataLossError("meta log: an entry without the CKL1 header");
  }
  const uint8_t flags = static_cast<uint8_t>(entry[4]);
  const uint32_t crc = LoadLe32(entry.data() + 5);
  const std::string_view piece = entry.substr(kHeaderBytes);
  if (Crc32c(piece) != crc) return absl::DataLossError("meta log: an entry fails its crc32c");
  if (flags & kFirst) {
    pending_.clear();  // a group left unfinished by a dead leader was never acknowledged
    open_ = true;
  } else if (!open_) {
    return absl::DataLossError("meta log: an entry continues a group whose first entry is not in the log");
  }
  pending_.append(piece);
  if (!(flags & kLast)) return std::optional<WriteBatch>();
  open_ = false;
  absl::StatusOr<WriteBatch> group = DecodeGroup(pending_);
  pending_.clear();
  if (!group.ok()) return group.status();
  return std::optional<WriteBatch>(*std::move(group));
}

absl::StatusOr<uint64_t> ReadAppliedIndex(MetaStore* local) {
  absl::StatusOr<std::string> v = local->Get(kAppliedKey);
  if (absl::IsNotFound(v.status())) return 0;
  if (!v.ok()) return v.status();
  uint64_t index = 0;
  if (!absl::SimpleAtoi(*v, &index)) {
    return absl::DataLossError(absl::StrCat("the store's ", kAppliedKey, " is not a number: ", absl::CHexEscape(*v)));
  }
  return index;
}

}  // namespace ckpt::meta::replica
