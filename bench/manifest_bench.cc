// manifest_bench: what one shard's manifest costs the agent, step by step,
// for shards of many small items (the per-item cost of a save and a load).
//
// Builds a manifest of N items (names like a model's parameters, f32, 1 KiB
// each), then times, in this process, each step the agent's CommitShard and
// OpenShard take on it: parsing a CommitShardRequest of Item messages (the
// old wire form) and converting them, encoding and decoding the packed
// manifest (the current one), ValidateManifest, SortedByOffset,
// ManifestDigest, EncodeShardRecord + Arena::WriteRecord (to a tmpfs),
// DecodeShardRecord (re-adoption), copying a ShardRecord (Ingest::Commit keeps
// copies), and RecordToShardInfo with items plus its serialisation (an
// OpenShard answer without packed_manifest). Median of --runs, in ms and ns
// per item, and the sizes of the two wire forms and of the record.
//
//   manifest_bench [--items 1000,10000] [--runs 9] [--dir /dev/shm]
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "ckpt/v1/agent.pb.h"
#include "common/manifest.h"
#include "server/agent/arena.h"
#include "server/rpc/agent_convert.h"

namespace ckpt {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Run(const std::vector<uint64_t>& counts, int runs, const std::string& dir) {
  const std::string mem = absl::StrCat(dir, "/ckpt-manifest-bench-", ::getpid());
  absl::StatusOr<std::unique_ptr<agent::Arena>> arena =
      agent::Arena::Open({mem, 64 << 20, /*populate=*/false});
  if (!arena.ok()) {
    std::fprintf(stderr, "manifest_bench: %s\n", arena.status().ToString().c_str());
    return 1;
  }
  std::printf("%-7s %-44s %10s %10s\n", "items", "step", "median ms", "ns/item");
  for (const uint64_t n : counts) {
    v1::CommitShardRequest req;
    req.set_lease_id("lease-1");
    uint64_t off = 0;
    for (uint64_t i = 0; i < n; ++i) {
      v1::Item* it = req.add_items();
      it->set_name(absl::StrCat("model/layers.", i / 8, ".block.", i % 8, ".weight"));
      it->set_dtype(v1::DTYPE_F32);
      it->add_shape(256);
      it->set_offset_bytes(off);
      it->set_length_bytes(1024);
      it->set_crc32c(static_cast<uint32_t>(i * 2654435761u));
      off += 1024;
    }
    req.set_size_bytes(off);
    const std::string wire = req.SerializeAsString();
    auto time = [&](const char* what, const std::function<void()>& fn) {
      std::vector<double> t;
      for (int r = 0; r < runs; ++r) {
        const absl::Time t0 = absl::Now();
        fn();
        t.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
      }
      const double med = Median(t);
      std::printf("%-7llu %-44s %10.3f %10.0f\n", static_cast<unsigned long long>(n), what, med,
                  med * 1e6 / static_cast<double>(n));
    };
    time("parse CommitShardRequest (Item messages)", [&] {
      v1::CommitShardRequest parsed;
      parsed.ParseFromString(wire);
    });
    std::vector<ManifestItem> items;
    time("ItemFromProto x n", [&] {
      items.clear();
      items.reserve(n);
      for (const v1::Item& it : req.items()) items.push_back(rpc::ItemFromProto(it));
    });
    time("ValidateManifest", [&] {
      if (!ValidateManifest(items, off).ok()) std::abort();
    });
    time("SortedByOffset", [&] { (void)SortedByOffset(items); });
    agent::ShardRecord rec;
    time("ManifestDigest", [&] { rec.manifest_digest = ManifestDigest(items); });
    rec.id = {"bench", 1, 0};
    rec.size_bytes = off;
    rec.items = items;
    rec.extents = {{0, (off + 4095) / 4096 * 4096}};
    std::string packed;
    time("EncodeManifest (packed manifest)", [&] { packed = EncodeManifest(items); });
    time("DecodeManifest", [&] {
      if (!DecodeManifest(packed).ok()) std::abort();
    });
    std::string encoded;
    time("EncodeShardRecord", [&] { encoded = agent::EncodeShardRecord(rec); });
    time("Arena::WriteRecord (encode + write tmpfs)", [&] {
      if (!(*arena)->WriteRecord(&rec).ok()) std::abort();
    });
    time("DecodeShardRecord", [&] {
      if (!agent::DecodeShardRecord(encoded).ok()) std::abort();
    });
    time("copy a ShardRecord", [&] {
      agent::ShardRecord copy = rec;
      (void)copy;
    });
    time("RecordToShardInfo(with items) + serialise", [&] {
      v1::OpenShardResponse resp;
      rpc::RecordToShardInfo(rec, "node-1", true, resp.mutable_shard());
      (void)resp.SerializeAsString();
    });
    std::printf("%-7llu %-44s %10.3f MB\n", static_cast<unsigned long long>(n), "manifest as Item messages",
                static_cast<double>(wire.size()) / 1e6);
    std::printf("%-7llu %-44s %10.3f MB\n", static_cast<unsigned long long>(n), "manifest packed",
                static_cast<double>(packed.size()) / 1e6);
    std::printf("%-7llu %-44s %10.3f MB\n", static_cast<unsigned long long>(n), "record size",
                static_cast<double>(encoded.size()) / 1e6);
    std::printf("\n");
  }
  std::error_code ec;
  std::filesystem::remove_all(mem, ec);
  return 0;
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) {
  std::vector<uint64_t> counts = {1000, 10000};
  int runs = 9;
  std::string dir = "/dev/shm";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--items") {
      counts.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        uint64_t v = 0;
        if (!absl::SimpleAtoi(s, &v) || v == 0) return 2;
        counts.push_back(v);
      }
    } else if (flag == "--runs") {
      runs = std::max(1, std::atoi(value.c_str()));
    } else if (flag == "--dir") {
      dir = value;
    } else {
      std::fprintf(stderr, "usage: manifest_bench [--items 1000,10000] [--runs 9] [--dir /dev/shm]\n");
      return 2;
    }
  }
  return ckpt::Run(counts, runs, dir);
}
