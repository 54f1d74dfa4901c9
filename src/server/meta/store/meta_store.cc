#include "server/meta/store/meta_store.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace ckpt::meta {

void WriteBatch::Put(std::string key, std::string value) {
  byte_size_ += key.size() + value.size() + kOpOverheadBytes;
  ops_.push_back(Op{OpType::kPut, std::move(key), std::move(value)});
}

void WriteBatch::Delete(std::string key) {
  byte_size_ += key.size() + kOpOverheadBytes;
  ops_.push_back(Op{OpType::kDelete, std::move(key), std::string()});
}

void WriteBatch::Clear() {
  ops_.clear();
  byte_size_ = 0;
}

namespace internal {

absl::Status KeyNotFound(std::string_view key) {
  return absl::NotFoundError(absl::StrCat(
      "meta store has no key \"", absl::CEscape(absl::string_view(key.data(), key.size())), "\""));
}

absl::Status RefusedAfterWriteError(const absl::Status& original) {
  return absl::UnavailableError(
      absl::StrCat("meta store refuses reads and writes after an earlier write error (",
                   original.ToString(), "); restart the daemon to reload its state"));
}

}  // namespace internal
}  // namespace ckpt::meta
