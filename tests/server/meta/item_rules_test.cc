// Meta refuses exactly the items the manifest refuses (issue 35 "one home per
// rule"). The agent checks a commit's items with common's ValidateManifest
// (src/common/manifest.h); meta checks a shard report's meta::Items with its
// own loop over common's pieces (src/server/meta/meta_reports.cc). Until meta
// calls common's function itself, this test holds the two to the same rules:
// every case below goes through both, common's ValidateManifest and a STAGED
// report to a MetaCore on the in-memory store, and both must accept it or
// both refuse it with InvalidArgument.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/clock.h"
#include "common/manifest.h"
#include "server/meta/meta_core.h"
#include "server/meta/store/mem_meta_store.h"

namespace ckpt::meta {
namespace {

constexpr uint64_t kShardBytes = 4096;
constexpr int kU8 = 9;   // ckpt.v1.DType U8: one byte an element
constexpr int kF32 = 1;  // F32: four bytes an element (checked below)

Item Own(const std::string& name, uint64_t offset, uint64_t length, int dtype = kU8) {
  Item it;
  it.name = name;
  it.dtype = dtype;
  it.shape = {dtype == kF32 ? length / 4 : length};
  it.offset_bytes = offset;
  it.length_bytes = length;
  return it;
}

Item Ref(const std::string& name, int64_t ref_step, uint64_t length) {
  Item it = Own(name, 0, length);
  it.ref_step = ref_step;
  return it;
}

std::vector<ManifestItem> AsManifest(const std::vector<Item>& items) {
  std::vector<ManifestItem> out;
  for (const Item& it : items) {
    ManifestItem m;
    m.name = it.name;
    m.dtype = it.dtype;
    m.shape = it.shape;
    m.offset_bytes = it.offset_bytes;
    m.length_bytes = it.length_bytes;
    m.crc32c = it.crc32c;
    m.attributes = it.attributes;
    if (it.ref_step >= 0) m.ref_step = static_cast<uint64_t>(it.ref_step);
    out.push_back(std::move(m));
  }
  return out;
}

struct Case {
  std::string what;
  std::vector<Item> items;
  bool valid;
};

class ItemRulesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<MetaCore>> c = MetaCore::Open(store_.get(), &clock_, MetaOptions{});
    ASSERT_TRUE(c.ok()) << c.status();
    core_ = *std::move(c);
    RegisterRequest r;
    r.node_id = "a";
    r.grpc_address = "a:7401";
    r.data_address = "a:7402";
    r.memory_capacity_bytes = 1 << 30;
    absl::StatusOr<RegisterResult> reg = core_->RegisterNode(r);
    ASSERT_TRUE(reg.ok()) << reg.status();
    incarnation_ = reg->incarnation;
    JobSpec spec;
    spec.job_id = "job";
    spec.world_size = 1;
    spec.protection = ProtectionPolicy::None();
    ASSERT_TRUE(core_->CreateJob(spec, false).ok());
  }

  // Meta's verdict on a STAGED report of rank 0 at a new step with `items`.
  absl::Status MetaVerdict(const std::vector<Item>& items, uint64_t step) {
    absl::StatusOr<std::pair<Version, bool>> begun = core_->BeginVersion("job", step, "");
    if (!begun.ok()) return begun.status();
    ShardReport r;
    r.kind = ShardReport::Kind::kStaged;
    r.staged.job_id = "job";
    r.staged.step = step;
    r.staged.shard.rank = 0;
    r.staged.shard.size_bytes = kShardBytes;
    r.staged.shard.crc32c = 0x1234;
    r.staged.shard.manifest_digest = 77;
    r.staged.shard.items = items;
    absl::StatusOr<ReportResult> res = core_->ReportShards("a", incarnation_, {r});
    if (!res.ok()) return res.status();
    return res->results.at(0);
  }

  FakeClock clock_;
  std::unique_ptr<MetaStore> store_ = NewMemMetaStore();
  std::unique_ptr<MetaCore> core_;
  uint64_t incarnation_ = 0;
};

TEST_F(ItemRulesTest, MetaRefusesExactlyTheItemsTheManifestRefuses) {
  ASSERT_TRUE(ItemByteLength(kF32, std::vector<uint64_t>{3}).ok());
  ASSERT_EQ(*ItemByteLength(kF32, std::vector<uint64_t>{3}), 12u);
  Item dup = Own("w", 100, 100);
  Item bad_shape = Own("w", 0, 11);
  bad_shape.shape = {10};
  Item wraps = Own("w", UINT64_MAX - 5, 10);
  Item f32_odd = Own("w", 0, 10, kF32);  // 10 bytes are not a whole number of f32s
  const std::vector<Case> cases = {
      // Accepted by both.
      {"one item over the whole shard", {Own("w", 0, kShardBytes)}, true},
      {"two adjacent items, out of order", {Own("b", 100, 50), Own("a", 0, 100)}, true},
      {"an empty item inside another", {Own("a", 0, 100), Own("e", 50, 0)}, true},
      {"an empty item at the shard's end", {Own("a", 0, 100), Own("e", kShardBytes, 0)}, true},
      {"f32 of the right length", {Own("f", 0, 12, kF32)}, true},
      {"opaque bytes of any shape", {Own("o", 0, 7, 14)}, true},
      {"no items at all", {}, true},
      // Refused by both.
      {"an empty name", {Own("", 0, 10)}, false},
      {"a name with a newline", {Own("a\nb", 0, 10)}, false},
      {"a name twice", {Own("w", 0, 100), dup}, false},
      {"dtype 0", {Own("w", 0, 10, 0)}, false},
      {"dtype beyond the last", {Own("w", 0, 10, kMaxDType + 1)}, false},
      {"a length that is not dtype x shape", {bad_shape}, false},
      {"f32 of a length not a multiple of 4", {f32_odd}, false},
      {"an item past the shard's end", {Own("w", 4000, 200)}, false},
      {"an item whose end wraps", {wraps}, false},
      {"two items that overlap", {Own("a", 0, 100), Own("b", 50, 100)}, false},
      {"an overlap with an empty item between", {Own("a", 0, 100), Own("e", 60, 0), Own("b", 80, 20)}, false},
      {"a reference to this very version", {Own("a", 0, 10), Ref("r", /*ref_step=*/0, 10)}, false},
      {"a reference with a length not dtype x shape", {[] {
          Item r = Ref("r", /*ref_step=*/1, 10);  // an older version
          r.shape = {9};
          return r;
        }()}, false},
  };
  uint64_t step = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ++step;
    // A reference "to this very version" names the step it is reported at.
    std::vector<Item> items = c.items;
    for (Item& it : items) {
      if (it.ref_step == 0) it.ref_step = static_cast<int64_t>(step);
    }
    const absl::Status manifest = ValidateManifest(AsManifest(items), kShardBytes, step);
    const absl::Status meta = MetaVerdict(items, step);
    EXPECT_EQ(manifest.ok(), c.valid) << manifest;
    EXPECT_EQ(meta.ok(), c.valid) << meta;
    if (!c.valid) {
      EXPECT_EQ(manifest.code(), absl::StatusCode::kInvalidArgument) << manifest;
      EXPECT_EQ(meta.code(), absl::StatusCode::kInvalidArgument) << meta;
    }
  }
}

}  // namespace
}  // namespace ckpt::meta
