// ParityBuilder on its own: pushes are simulated by calling BeginPush /
// Fold / PushFailed / PushComplete as the PeerServer would, over an Arena in
// a temp dir and a HoldingTable (MemoryTier), on a FakeClock. The parity it
// stores is compared byte for byte with a full ISA-L encode of the stripe.
#include "server/agent/parity_builder.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ec/codec.h"
#include "memory_tier.h"

namespace ckpt::agent {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kExpire = absl::Seconds(30);
constexpr uint64_t kStripe = 5000;

// Data segment `d` of an RS(2, 2) stripe of 5000 bytes whose parity row 1
// (position 3) this node builds; segment 1 is shorter than the stripe.
PutBegin Push(uint32_t d, uint64_t step = 5) {
  PutBegin b;
  b.kind = PutKind::kEcData;
  b.job_id = "job";
  b.step = step;
  b.group = 0;
  b.stripe = 1;
  b.data_position = d;
  b.parity_position = 3;
  b.data_k = 2;
  b.parity_m = 2;
  b.stripe_bytes = kStripe;
  b.expect_mask = 0b11;
  b.total_bytes = d == 0 ? kStripe : 3000;
  return b;
}

const SegmentId kParity{"job", 5, 0, 1, 3};

class ParityBuilderTest : public ::testing::Test {
 protected:
  ParityBuilderTest()
      : data_{SeededBytes(kStripe, 1), SeededBytes(3000, 2)},
        builder_(&tier_.arena(), &tier_.holdings(), &tier_.clock(), &tier_.metrics(), kExpire) {}

  // Parity row `row` of a full encode of data_.
  std::string ExpectedParity(int row) {
    auto codec = ec::Codec::Create(2, 2);
    EXPECT_TRUE(codec.ok());
    std::vector<uint8_t> p0(kStripe), p1(kStripe);
    std::vector<ec::ConstBuffer> data;
    for (const std::string& d : data_) data.emplace_back(reinterpret_cast<const uint8_t*>(d.data()), d.size());
    std::vector<ec::MutableBuffer> parity{ec::MutableBuffer(p0), ec::MutableBuffer(p1)};
    EXPECT_TRUE((*codec)->Encode(data, parity).ok());
    const std::vector<uint8_t>& p = row == 0 ? p0 : p1;
    return std::string(p.begin(), p.end());
  }

  // Folds data_[d] bytes [from, to) in chunks of `chunk`.
  void FoldRange(uint32_t d, uint64_t from, uint64_t to, uint64_t chunk = 999) {
    for (uint64_t off = from; off < to; off += chunk) {
      const uint64_t len = std::min(chunk, to - off);
      ASSERT_TRUE(builder_.Fold(Push(d), off, AsBytes(data_[d]).subspan(off, len)).ok()) << d << "@" << off;
    }
  }

  MemoryTier tier_;
  std::string data_[2];
  ParityBuilder builder_;
};

TEST_F(ParityBuilderTest, FoldsChunksInAnyOrderIntoTheEncodersParity) {
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  EXPECT_EQ(builder_.size(), 1u);
  EXPECT_EQ(tier_.metrics().parity_builds->Value(), 1.0);
  ASSERT_TRUE(builder_.BeginPush(Push(1)).ok());
  EXPECT_EQ(builder_.size(), 1u);  // one build per parity
  // Interleaved, the second half of segment 0 first.
  FoldRange(0, 2500, kStripe);
  FoldRange(1, 0, 3000, 700);
  FoldRange(0, 0, 2500);
  ASSERT_TRUE(builder_.PushComplete(Push(1)).ok());
  EXPECT_FALSE(tier_.holdings().HasValidSegment(kParity));  // segment 0 is not in yet
  ASSERT_TRUE(builder_.PushComplete(Push(0)).ok());

  EXPECT_EQ(builder_.size(), 0u);
  EXPECT_EQ(tier_.metrics().parity_stored->Value(), 1.0);
  absl::StatusOr<Pin> pin = tier_.holdings().PinSegment(kParity);
  ASSERT_TRUE(pin.ok()) << pin.status();
  const std::string expected = ExpectedParity(1);
  EXPECT_EQ(ReadBack(*pin->bytes, kStripe), expected);
  EXPECT_EQ(pin->rec->segment_kind, SegmentKind::kParity);
  EXPECT_EQ(pin->rec->crc32c, Crc32c(expected));
  std::vector<HoldingReport> reports = tier_.Reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].kind, HoldingReport::Kind::kSegment);
  EXPECT_EQ(reports[0].segment, kParity);
  EXPECT_EQ(reports[0].copy_state, CopyState::kValid);
  EXPECT_EQ(reports[0].crc32c, Crc32c(expected));
  EXPECT_EQ(reports[0].size_bytes, kStripe);

  // The parity is held: another push of it is AlreadyExists.
  EXPECT_EQ(builder_.BeginPush(Push(0)).code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(ParityBuilderTest, AnEmptyDataSegmentIsNotWaitedFor) {
  PutBegin b = Push(0);
  b.expect_mask = 0b01;  // segment 1 is empty
  ASSERT_TRUE(builder_.BeginPush(b).ok());
  ASSERT_TRUE(builder_.Fold(b, 0, AsBytes(data_[0])).ok());
  ASSERT_TRUE(builder_.PushComplete(b).ok());
  data_[1].clear();
  absl::StatusOr<Pin> pin = tier_.holdings().PinSegment(kParity);
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(ReadBack(*pin->bytes, kStripe), ExpectedParity(1));
}

TEST_F(ParityBuilderTest, RefusesASecondPushOfASegmentAndADifferentGeometry) {
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  absl::Status s = builder_.BeginPush(Push(0));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;  // being received
  PutBegin other = Push(1);
  other.stripe_bytes = kStripe + 1;
  s = builder_.BeginPush(other);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("stripe 5001 bytes"));
  other = Push(1);
  other.expect_mask = 0b01;
  EXPECT_EQ(builder_.BeginPush(other).code(), absl::StatusCode::kInvalidArgument);

  FoldRange(0, 0, kStripe);
  ASSERT_TRUE(builder_.PushComplete(Push(0)).ok());
  // Folding segment 0 twice would cancel it out.
  s = builder_.BeginPush(Push(0));
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_EQ(builder_.size(), 1u);
}

TEST_F(ParityBuilderTest, FoldRefusesWhatItCannotPlace) {
  EXPECT_EQ(builder_.Fold(Push(0), 0, AsBytes(data_[0]).subspan(0, 10)).code(),
            absl::StatusCode::kFailedPrecondition);  // no build
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  EXPECT_EQ(builder_.Fold(Push(1), 0, AsBytes(data_[1]).subspan(0, 10)).code(),
            absl::StatusCode::kFailedPrecondition);  // segment 1 was not begun
  EXPECT_EQ(builder_.Fold(Push(0), kStripe - 5, AsBytes(data_[0]).subspan(0, 10)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(builder_.Fold(Push(0), kStripe + 1, {}).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ParityBuilderTest, APushThatBrokeOffBeforeAnyFoldMayBeSentAgain) {
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  builder_.PushFailed(Push(0), absl::UnavailableError("peer died"));
  EXPECT_EQ(builder_.size(), 1u);
  EXPECT_TRUE(builder_.TakeFailure(kParity).ok());
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  ASSERT_TRUE(builder_.BeginPush(Push(1)).ok());
  FoldRange(0, 0, kStripe);
  FoldRange(1, 0, 3000);
  ASSERT_TRUE(builder_.PushComplete(Push(0)).ok());
  ASSERT_TRUE(builder_.PushComplete(Push(1)).ok());
  EXPECT_EQ(ReadBack(*tier_.holdings().PinSegment(kParity)->bytes, kStripe), ExpectedParity(1));
}

TEST_F(ParityBuilderTest, APushThatBrokeOffMidFoldSpoilsTheParity) {
  const uint64_t cap = tier_.arena().capacity_bytes();
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  ASSERT_TRUE(builder_.BeginPush(Push(1)).ok());
  EXPECT_EQ(tier_.arena().free_bytes(), cap - 2 * kArenaPageBytes);
  FoldRange(0, 0, 2000);
  builder_.PushFailed(Push(0), absl::UnavailableError("peer n1 died"));
  // Segment 1 is still being received: the build stays, spoiled.
  EXPECT_EQ(builder_.size(), 1u);
  absl::Status s = builder_.BeginPush(Push(0));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("spoiled by a broken push: peer n1 died"));
  EXPECT_EQ(builder_.Fold(Push(1), 0, AsBytes(data_[1]).subspan(0, 10)).code(),
            absl::StatusCode::kFailedPrecondition);
  // Its last push ends too: the build goes, its space with it, the error stays.
  builder_.PushFailed(Push(1), absl::CancelledError("sender gave up"));
  EXPECT_EQ(builder_.size(), 0u);
  EXPECT_EQ(tier_.arena().free_bytes(), cap);
  EXPECT_EQ(tier_.metrics().parity_builds_dropped->Value(), 1.0);
  s = builder_.TakeFailure(kParity);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("peer n1 died"));
  EXPECT_TRUE(builder_.TakeFailure(kParity).ok());  // taken once
  EXPECT_FALSE(tier_.holdings().HasValidSegment(kParity));
  EXPECT_TRUE(tier_.Reports().empty());
}

TEST_F(ParityBuilderTest, TakeFailureEndsASpoiledBuildStillWaiting) {
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  ASSERT_TRUE(builder_.BeginPush(Push(1)).ok());
  FoldRange(0, 0, 100);
  builder_.PushFailed(Push(0), absl::DeadlineExceededError("no ack"));
  EXPECT_EQ(builder_.TakeFailure(kParity).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(builder_.size(), 0u);
  // A late completion of the other push finds nothing.
  EXPECT_EQ(builder_.PushComplete(Push(1)).code(), absl::StatusCode::kFailedPrecondition);
  // A new push starts a new build.
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  EXPECT_EQ(builder_.size(), 1u);
}

TEST_F(ParityBuilderTest, ExpiresBuildsWithoutProgressAfterTheirTime) {
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  tier_.clock().Advance(kExpire - absl::Seconds(1));
  FoldRange(0, 0, 100);  // progress
  tier_.clock().Advance(kExpire);
  EXPECT_EQ(builder_.Expire(), 0);  // exactly expire_after since the fold
  tier_.clock().Advance(absl::Milliseconds(1));
  EXPECT_EQ(builder_.Expire(), 1);
  EXPECT_EQ(builder_.size(), 0u);
  EXPECT_EQ(tier_.arena().free_bytes(), tier_.arena().capacity_bytes());
  absl::Status s = builder_.TakeFailure(kParity);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("made no progress"));
}

TEST_F(ParityBuilderTest, AnEvictedVersionsLatePushesAreRefusedForAWhile) {
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  ASSERT_TRUE(builder_.BeginPush(Push(0, /*step=*/6)).ok());
  builder_.EvictVersion("job", 5);
  EXPECT_EQ(builder_.size(), 1u);  // step 6 stays
  absl::Status s = builder_.BeginPush(Push(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("evicted"));
  tier_.clock().Advance(kExpire);
  EXPECT_EQ(builder_.BeginPush(Push(1)).code(), absl::StatusCode::kFailedPrecondition);
  tier_.clock().Advance(absl::Milliseconds(1));
  EXPECT_TRUE(builder_.BeginPush(Push(1)).ok());
}

TEST_F(ParityBuilderTest, DropVersionForgetsBuildsButTakesLaterPushes) {
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  FoldRange(0, 0, 100);
  ASSERT_TRUE(builder_.BeginPush(Push(0, /*step=*/6)).ok());
  builder_.DropVersion("job", 5);
  EXPECT_EQ(builder_.size(), 1u);
  EXPECT_TRUE(builder_.TakeFailure(kParity).ok());  // dropped, not failed
  EXPECT_EQ(builder_.Fold(Push(0), 100, AsBytes(data_[0]).subspan(100, 10)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(builder_.BeginPush(Push(0)).ok());  // meta may plan it again
}

TEST_F(ParityBuilderTest, NoRoomForTheParityIsResourceExhausted) {
  PutBegin b = Push(0);
  b.stripe_bytes = tier_.arena().capacity_bytes() + 1;
  EXPECT_EQ(builder_.BeginPush(b).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(builder_.size(), 0u);
}

TEST_F(ParityBuilderTest, AParityThatCannotBeRecordedFailsItsBuild) {
  ASSERT_TRUE(builder_.BeginPush(Push(0)).ok());
  ASSERT_TRUE(builder_.BeginPush(Push(1)).ok());
  FoldRange(0, 0, kStripe);
  FoldRange(1, 0, 3000);
  ASSERT_TRUE(builder_.PushComplete(Push(0)).ok());
  tier_.fault_fs().FailAllWrites(true);
  absl::Status s = builder_.PushComplete(Push(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(builder_.size(), 0u);
  EXPECT_FALSE(tier_.holdings().HasValidSegment(kParity));
  EXPECT_EQ(builder_.TakeFailure(kParity).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(tier_.arena().free_bytes(), tier_.arena().capacity_bytes());
}

}  // namespace
}  // namespace ckpt::agent
