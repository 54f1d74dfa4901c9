// Slices of global tensors read straight from a committed durable version
// (docs/python.md "Another layout", offline): no daemon, only the items that
// overlap what is asked for, each read whole and checked against its crc32c.
// The same index and plan as Client::GlobalTensors / LoadSlices
// (common/global_tensor.h), over the version's manifest.json.
//
// Thread safety: pure functions over the file system (FileSystem is
// thread-safe); they block for their reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/durable_format.h"
#include "common/file_system.h"
#include "common/global_tensor.h"

namespace ckpt {

// One stored piece: rank `rank`'s item number `item` (of
// manifest.shards[rank].items) holds `box` of the tensor.
struct DurablePiece {
  uint32_t rank = 0;
  size_t item = 0;
  Box box;
};
struct DurableGlobalTensor {
  std::string name;
  int dtype = 0;
  std::vector<uint64_t> shape;
  std::vector<DurablePiece> pieces;  // replicas included, by rank
};

// The global tensors of a version, by name (items without ckpt.global_shape
// belong to none). InvalidArgument for malformed attributes or two items
// that disagree on a tensor's dtype or shape.
absl::StatusOr<std::map<std::string, DurableGlobalTensor>> DurableGlobalTensors(const DurableManifest& manifest);

// A slice of a global tensor into `dst` (row-major, exactly its bytes).
struct DurableSliceRequest {
  std::string name;
  Box want;
  std::span<std::byte> dst;
};

// Reads each slice from the rank files of the committed version at
// `version_dir` (`manifest` as ReadDurableManifest gave it): every item that
// overlaps a slice is read whole (from this version's rank file, or for a
// reference from the rank file of the version it names, whose manifest must
// hold it as its own item), its crc32c checked, and the overlap copied; of
// replicas the lowest rank's. Nothing is written into any dst before every
// item needed is read and checked. Returns the bytes read. Errors: NotFound
// (no such tensor; a referenced version not committed), InvalidArgument (a
// slice outside its tensor or with another dimension count, a dst of another
// size), DataLoss (part of a slice is in no rank's item; an item fails its
// crc32c; a rank file shorter than its manifest), the file system's.
absl::StatusOr<uint64_t> ReadDurableSlices(FileSystem* fs, const std::string& version_dir,
                                           const DurableManifest& manifest,
                                           std::span<const DurableSliceRequest> slices);

}  // namespace ckpt
