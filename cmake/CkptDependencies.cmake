# Finds every third-party dependency once, by the names that work on Debian 12
# (docs/building.md "The machine the figures come from"). Targets link them
# PRIVATE from their adapters.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)

find_package(absl CONFIG REQUIRED)
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_package(RocksDB CONFIG REQUIRED)
find_package(prometheus-cpp CONFIG REQUIRED)
find_package(civetweb CONFIG REQUIRED)  # installed with prometheus-cpp; serves /metrics
find_package(fmt CONFIG REQUIRED)
find_package(spdlog CONFIG REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(yaml-cpp CONFIG REQUIRED)
find_package(OpenSSL REQUIRED)  # libcrypto: HMAC-SHA256 of the data plane's handshake; random ids, tokens (common/crypto)

pkg_check_modules(ISAL REQUIRED IMPORTED_TARGET libisal)
pkg_check_modules(URING IMPORTED_TARGET liburing)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
# Optional: Type=notify readiness for the systemd units (src/common/sd_notify.cc).
pkg_check_modules(SYSTEMD IMPORTED_TARGET libsystemd)

if(CKPT_WITH_UCX)
  find_package(ucx CONFIG REQUIRED)
  pkg_check_modules(IBVERBS IMPORTED_TARGET libibverbs)
  pkg_check_modules(RDMACM IMPORTED_TARGET librdmacm)
endif()

if(CKPT_BUILD_TESTS)
  find_package(GTest CONFIG REQUIRED)
  include(GoogleTest)
endif()
if(CKPT_BUILD_BENCHMARKS)
  find_package(benchmark CONFIG REQUIRED)
endif()
