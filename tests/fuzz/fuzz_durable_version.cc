// libFuzzer target: a committed durable version's files as a restore reads
// them (`ckptctl restore --from-dir`, ckpt.DurableVersion): rank files whose
// bytes do not match their manifest, incremental versions whose references
// point anywhere, global-tensor attributes that overlap or leave holes.
//
// The input is a list of records, each a tag byte, a 2-byte little-endian
// length and that many bytes:
//   'M'  this version's manifest.json (it must parse, or the input is done)
//   'R'  a rank file of this version (the first is rank 0's, then rank 1's)
//   'm'  an older version's manifest.json, placed where a reference to its
//        step looks (DurableRefDir)
//   'r'  a rank file of that older version
// The files go into a MemFileSystem and the versions are committed with
// WriteDurableManifest (which checks the rank files' sizes). Then, for each
// shard: ReadRankFile, MaterializeDurableShard; and for each global tensor
// of at most 1 MiB, ReadDurableSlices of the whole tensor. Whatever fails
// must fail with a status; what succeeds must hold:
//   - a materialized shard: every item self-contained, inside the shard, its
//     bytes with the item's crc32c, the shard's crc32c that of its bytes;
//   - a rank file read: every own item's bytes with the item's crc32c, the
//     same bytes as the materialized shard's copy of that item;
//   - a whole tensor read: the bytes of the lowest rank's item that holds
//     the whole tensor, when one does (the reader's rule for replicas).
// Aborts (a libFuzzer crash, the input kept) when one does not hold.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/crc32c.h"
#include "common/durable_format.h"
#include "common/durable_slices.h"
#include "common/manifest.h"
#include "common/mem_file_system.h"
#include "common/names.h"

namespace {

constexpr char kVersionDir[] = "/durable/job/9";
constexpr uint64_t kMaxTensorBytes = 1 << 20;

struct Version {
  std::optional<ckpt::DurableManifest> manifest;
  std::vector<std::string> rank_files;
};

[[noreturn]] void Broken(const char* what) {
  std::fprintf(stderr, "durable version invariant broken: %s\n", what);
  std::abort();
}

uint32_t CrcOf(const std::vector<std::byte>& bytes, uint64_t offset, uint64_t length) {
  return ckpt::Crc32c(bytes.data() + offset, length);
}

// Writes `v`'s rank files and commits it at `dir`; false if it cannot be.
bool Commit(ckpt::MemFileSystem* fs, const std::string& dir, const Version& v) {
  if (!v.manifest || !fs->CreateDirs(dir).ok()) return false;
  for (size_t r = 0; r < v.rank_files.size(); ++r) {
    if (!ckpt::WriteStringToFileAtomically(fs, ckpt::DurableRankFilePath(dir, static_cast<uint32_t>(r)),
                                          v.rank_files[r])
             .ok()) {
      return false;
    }
  }
  return ckpt::WriteDurableManifest(fs, dir, *v.manifest).ok();
}

void CheckShards(ckpt::MemFileSystem* fs, const ckpt::DurableManifest& m) {
  for (const ckpt::DurableShard& shard : m.shards) {
    std::vector<std::byte> dense_bytes;
    absl::StatusOr<ckpt::DurableShard> dense = ckpt::MaterializeDurableShard(fs, kVersionDir, m, shard, &dense_bytes);
    if (dense.ok()) {
      if (dense->size_bytes != dense_bytes.size()) Broken("materialized size differs from its bytes");
      if (dense->items.size() != shard.items.size()) Broken("materialized item count differs");
      if (dense->crc32c != ckpt::Crc32c(dense_bytes.data(), dense_bytes.size())) Broken("materialized crc32c");
      for (const ckpt::ManifestItem& item : dense->items) {
        if (item.ref_step) Broken("a materialized item still refers to another version");
        if (item.offset_bytes > dense_bytes.size() || item.length_bytes > dense_bytes.size() - item.offset_bytes) {
          Broken("a materialized item lies outside its shard");
        }
        if (CrcOf(dense_bytes, item.offset_bytes, item.length_bytes) != item.crc32c) {
          Broken("a materialized item's bytes do not have its crc32c");
        }
      }
    }
    if (shard.size_bytes > kMaxTensorBytes * 4) continue;  // the file is as long (WriteDurableManifest checked)
    std::vector<std::byte> file(shard.size_bytes);
    if (!ckpt::ReadRankFile(fs, kVersionDir, shard, file).ok()) continue;
    for (size_t i = 0; i < shard.items.size(); ++i) {
      const ckpt::ManifestItem& item = shard.items[i];
      if (item.ref_step) continue;
      if (CrcOf(file, item.offset_bytes, item.length_bytes) != item.crc32c) Broken("a rank file item's crc32c");
      if (dense.ok()) {
        // MaterializeShard keeps the manifest's order.
        const ckpt::ManifestItem& copy = dense->items[i];
        if (copy.name != item.name || copy.length_bytes != item.length_bytes ||
            std::memcmp(dense_bytes.data() + copy.offset_bytes, file.data() + item.offset_bytes, item.length_bytes) !=
                0) {
          Broken("the materialized copy of an item differs from the rank file's");
        }
      }
    }
  }
}

void CheckSlices(ckpt::MemFileSystem* fs, const ckpt::DurableManifest& m) {
  absl::StatusOr<std::map<std::string, ckpt::DurableGlobalTensor>> tensors = ckpt::DurableGlobalTensors(m);
  if (!tensors.ok()) return;
  for (const auto& [name, t] : *tensors) {
    const uint32_t elem = ckpt::DTypeElementSize(t.dtype);
    uint64_t bytes = elem;
    bool small = elem > 0;
    for (uint64_t d : t.shape) {
      if (d != 0 && bytes > kMaxTensorBytes / d) small = false;
      bytes = small ? bytes * d : 0;
    }
    if (!small || bytes > kMaxTensorBytes) continue;
    ckpt::Box whole;
    whole.offsets.assign(t.shape.size(), 0);
    whole.lengths = t.shape;
    std::vector<std::byte> dst(bytes, std::byte{0xA5});
    const ckpt::DurableSliceRequest req{name, whole, dst};
    if (!ckpt::ReadDurableSlices(fs, kVersionDir, m, {&req, 1}).ok()) continue;
    // The lowest rank's piece that holds the whole tensor, read alone.
    for (const ckpt::DurablePiece& p : t.pieces) {
      if (p.box.offsets != whole.offsets || p.box.lengths != whole.lengths) continue;
      const ckpt::ManifestItem& item = m.shards[p.rank].items[p.item];
      if (item.ref_step || item.length_bytes != bytes) break;
      std::vector<std::byte> file(m.shards[p.rank].size_bytes);
      if (m.shards[p.rank].size_bytes > kMaxTensorBytes * 4 ||
          !ckpt::ReadRankFile(fs, kVersionDir, m.shards[p.rank], file).ok()) {
        break;
      }
      if (std::memcmp(dst.data(), file.data() + item.offset_bytes, bytes) != 0) {
        Broken("a whole tensor read differs from the lowest rank's item holding it");
      }
      break;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Version current, older;
  for (size_t at = 0; at + 3 <= size;) {
    const char tag = static_cast<char>(data[at]);
    const size_t n = data[at + 1] | (size_t{data[at + 2]} << 8);
    at += 3;
    if (n > size - at) break;
    const std::string_view bytes(reinterpret_cast<const char*>(data + at), n);
    at += n;
    switch (tag) {
      case 'M':
      case 'm': {
        absl::StatusOr<ckpt::DurableManifest> m = ckpt::ParseDurableManifest(bytes);
        if (m.ok()) (tag == 'M' ? current : older).manifest = *std::move(m);
        break;
      }
      case 'R':
        current.rank_files.emplace_back(bytes);
        break;
      case 'r':
        older.rank_files.emplace_back(bytes);
        break;
      default:
        break;
    }
  }
  ckpt::MemFileSystem fs;
  if (older.manifest) (void)Commit(&fs, ckpt::DurableRefDir(kVersionDir, older.manifest->step), older);
  if (!Commit(&fs, kVersionDir, current)) return 0;
  absl::StatusOr<ckpt::DurableManifest> m = ckpt::ReadDurableManifest(&fs, kVersionDir);
  if (!m.ok()) Broken("a version just committed does not read back");
  if (*m != *current.manifest) Broken("a version just committed reads back as another manifest");
  CheckShards(&fs, *m);
  CheckSlices(&fs, *m);
  return 0;
}
