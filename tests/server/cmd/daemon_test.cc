// Daemon helpers: listen-address validation and what an agent advertises for
// a wildcard listen address (peers must never be told to dial 0.0.0.0).
#include "server/cmd/daemon.h"

#include <gtest/gtest.h>

namespace ckpt::daemon {
namespace {

TEST(Daemon, SpecificListenAddressesAreAdvertisedAsTheyAre) {
  EXPECT_EQ(*AdvertisedAddress("127.0.0.1:7402", ""), "127.0.0.1:7402");
  EXPECT_EQ(*AdvertisedAddress("10.1.2.3:7401", "ignored"), "10.1.2.3:7401");
  EXPECT_EQ(*AdvertisedAddress("[::1]:7401", ""), "[::1]:7401");
}

TEST(Daemon, WildcardListenAddressesAdvertiseARealHost) {
  EXPECT_EQ(*AdvertisedAddress("0.0.0.0:7402", "node-7.example"), "node-7.example:7402");
  EXPECT_EQ(*AdvertisedAddress("[::]:7401", "10.0.0.5"), "10.0.0.5:7401");
  // Without --advertise-host: an interface address, never the wildcard (or a
  // clear error on a machine with no non-loopback IPv4 address).
  absl::StatusOr<std::string> a = AdvertisedAddress("0.0.0.0:7402", "");
  if (a.ok()) {
    EXPECT_NE(HostOf(*a), "0.0.0.0");
    EXPECT_NE(HostOf(*a), "127.0.0.1");
    EXPECT_TRUE(a->ends_with(":7402"));
  } else {
    EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(a.status().message().find("--advertise-host"), std::string::npos);
  }
  EXPECT_FALSE(AdvertisedAddress("no-port", "").ok());
}

TEST(Daemon, ListenAddressesAreValidated) {
  EXPECT_TRUE(ValidateHostPort("listen", "0.0.0.0:7401").ok());
  EXPECT_FALSE(ValidateHostPort("listen", "0.0.0.0").ok());
  EXPECT_FALSE(ValidateHostPort("listen", ":7401").ok());
  EXPECT_FALSE(ValidateHostPort("listen", "host:99999").ok());
}

}  // namespace
}  // namespace ckpt::daemon
