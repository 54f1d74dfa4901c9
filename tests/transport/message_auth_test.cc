// Per-message authentication of the UCX data plane
// (transport/ucx/message_auth.h): keys per connection and direction, tags
// that change with every byte and sequence number, encryption that round
// trips in any split, and a replay window.
#include "transport/ucx/message_auth.h"

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <string>
#include <vector>

namespace ckpt::transport::ucx_wire {
namespace {

using Pieces = std::vector<std::span<const std::byte>>;
using MutPieces = std::vector<std::span<std::byte>>;

std::vector<std::byte> Bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

// `v` cut at `cuts` (offsets, ascending).
Pieces Cut(const std::vector<std::byte>& v, std::vector<size_t> cuts) {
  Pieces out;
  size_t at = 0;
  cuts.push_back(v.size());
  for (size_t c : cuts) {
    out.emplace_back(v.data() + at, c - at);
    at = c;
  }
  return out;
}

TEST(MessageAuth, KeysDifferPerDirectionConnectionAndClusterKey) {
  const ConnectionKeys k = DeriveConnectionKeys("cluster", 1, 2, 3, 4);
  std::set<std::string> all = {k.to_acceptor.mac_key, k.to_acceptor.aes_key, k.to_connector.mac_key,
                               k.to_connector.aes_key};
  EXPECT_EQ(all.size(), 4u);
  for (const std::string& key : all) EXPECT_EQ(key.size(), 32u);
  const ConnectionKeys same = DeriveConnectionKeys("cluster", 1, 2, 3, 4);
  EXPECT_EQ(same.to_acceptor.mac_key, k.to_acceptor.mac_key);
  EXPECT_EQ(same.to_connector.aes_key, k.to_connector.aes_key);
  for (const ConnectionKeys& other :
       {DeriveConnectionKeys("Cluster", 1, 2, 3, 4), DeriveConnectionKeys("cluster", 1, 9, 3, 4),
        DeriveConnectionKeys("cluster", 1, 2, 3, 9), DeriveConnectionKeys("cluster", 3, 4, 1, 2)}) {
    EXPECT_NE(other.to_acceptor.mac_key, k.to_acceptor.mac_key);
    EXPECT_NE(other.to_acceptor.aes_key, k.to_acceptor.aes_key);
  }
}

TEST(MessageAuth, HeaderTagsCoverEveryByteAndThePayloadLength) {
  const std::string key(32, 'm');
  const std::string header = "0123456789abcdefghij";
  const std::string tag = HeaderTag(key, header, 100);
  EXPECT_EQ(tag.size(), kTagBytes);
  EXPECT_EQ(HeaderTag(key, header, 100), tag);
  EXPECT_NE(HeaderTag(key, header, 101), tag);
  EXPECT_NE(HeaderTag(std::string(32, 'n'), header, 100), tag);
  for (size_t i = 0; i < header.size(); ++i) {
    std::string h = header;
    h[i] ^= 1;
    EXPECT_NE(HeaderTag(key, h, 100), tag) << i;
  }
}

TEST(MessageAuth, PayloadTagsCheckAnySplitAndCatchAnyChange) {
  PayloadSealer send(std::string(32, 'a')), recv(std::string(32, 'a')), other(std::string(32, 'b'));
  const std::vector<std::byte> data = Bytes(100000, 1);
  const std::string tag = send.Tag(7, {std::span<const std::byte>(data)});
  for (const auto& cuts : std::vector<std::vector<size_t>>{{}, {1}, {15, 16, 17}, {4096, 65536, 99999}}) {
    EXPECT_TRUE(recv.Check(7, Cut(data, cuts), tag));
    EXPECT_EQ(send.Tag(7, Cut(data, cuts)), tag);
  }
  EXPECT_FALSE(recv.Check(8, Cut(data, {}), tag)) << "another sequence number";
  EXPECT_FALSE(other.Check(7, Cut(data, {}), tag)) << "another key";
  for (size_t at : {size_t{0}, size_t{777}, data.size() - 1}) {
    std::vector<std::byte> changed = data;
    changed[at] ^= std::byte{0x40};
    EXPECT_FALSE(recv.Check(7, Cut(changed, {}), tag)) << at;
  }
  std::vector<std::byte> shorter(data.begin(), data.end() - 1);
  EXPECT_FALSE(recv.Check(7, Cut(shorter, {}), tag));
  EXPECT_FALSE(recv.Check(7, Cut(data, {}), tag.substr(0, 15)));
}

TEST(MessageAuth, EncryptionRoundTripsInPlaceOrFromACopyAndRefusesAChange) {
  PayloadSealer send(std::string(32, 'k')), recv(std::string(32, 'k'));
  const std::vector<std::byte> plain = Bytes(300000, 2);
  std::vector<std::byte> wire(plain.size());
  const std::string tag = send.Encrypt(3, Cut(plain, {10, 70000}), wire);
  EXPECT_NE(wire, plain);
  // From the wire bytes into pieces (eager receive).
  std::vector<std::byte> got(plain.size());
  MutPieces dst = {std::span<std::byte>(got.data(), 5), std::span<std::byte>(got.data() + 5, got.size() - 5)};
  ASSERT_TRUE(recv.Decrypt(3, wire.data(), dst, tag));
  EXPECT_EQ(got, plain);
  // In place (rendezvous receive into the pieces).
  std::vector<std::byte> in_place = wire;
  ASSERT_TRUE(recv.Decrypt(3, nullptr, {std::span<std::byte>(in_place)}, tag));
  EXPECT_EQ(in_place, plain);
  // A flipped ciphertext byte, or another sequence number, is refused.
  std::vector<std::byte> bad = wire;
  bad[123456] ^= std::byte{1};
  EXPECT_FALSE(recv.Decrypt(3, nullptr, {std::span<std::byte>(bad)}, tag));
  std::vector<std::byte> again = wire;
  EXPECT_FALSE(recv.Decrypt(4, nullptr, {std::span<std::byte>(again)}, tag));
  // Encryption differs per sequence number (no IV is reused).
  std::vector<std::byte> wire2(plain.size());
  send.Encrypt(4, Cut(plain, {}), wire2);
  EXPECT_NE(wire2, wire);
}

TEST(MessageAuth, ReplayWindowAcceptsEachNumberOnce) {
  ReplayWindow w;
  EXPECT_FALSE(w.Accept(0));
  EXPECT_TRUE(w.Accept(1));
  EXPECT_FALSE(w.Accept(1));
  EXPECT_TRUE(w.Accept(3));
  EXPECT_TRUE(w.Accept(2)) << "a little late, first time";
  EXPECT_FALSE(w.Accept(2));
  EXPECT_TRUE(w.Accept(100));
  EXPECT_FALSE(w.Accept(3)) << "too far behind";
  EXPECT_TRUE(w.Accept(37));
  EXPECT_FALSE(w.Accept(36)) << "64 below the highest";
  EXPECT_FALSE(w.Accept(37));
  EXPECT_TRUE(w.Accept(1000));
  EXPECT_FALSE(w.Accept(100));
}

}  // namespace
}  // namespace ckpt::transport::ucx_wire
