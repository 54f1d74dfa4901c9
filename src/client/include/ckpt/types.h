// Public value types of libckpt (ckpt/client.h): element types, durability
// levels, protection policies, how an item of a save relates to the last
// save, the items of a loaded shard and the checkpoint interval advice.
// Plain values: no behaviour beyond the functions declared here, no
// dependency on the rest of the library. Thread safety: as any value type.
#pragma once

#include <cstdint>
#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/time/time.h"

namespace ckpt {

// Element type of an item. The numbers are those of ckpt.v1.DType
// (proto/ckpt/v1/common.proto). Items are dense and row-major (C order).
// For every type except kBytes, an item's length in bytes must equal the
// product of its shape's dimensions (1 for an empty shape: a scalar) times the
// element size.
enum class DType : int {
  kF32 = 1,        // 4 bytes
  kF16 = 2,        // 2 bytes
  kBF16 = 3,       // 2 bytes
  kF64 = 4,        // 8 bytes
  kI8 = 5,         // 1 byte
  kI16 = 6,        // 2 bytes
  kI32 = 7,        // 4 bytes
  kI64 = 8,        // 8 bytes
  kU8 = 9,         // 1 byte
  kU16 = 10,       // 2 bytes
  kU32 = 11,       // 4 bytes
  kU64 = 12,       // 8 bytes
  kBool = 13,      // 1 byte
  kBytes = 14,     // opaque bytes, any length; shape ignored (empty or {length})
  kC64 = 15,       // 8 bytes (two f32)
  kC128 = 16,      // 16 bytes (two f64)
  kF8E4M3FN = 17,  // 1 byte
  kF8E5M2 = 18,    // 1 byte
};

// Bytes per element of `dtype` (1, 2, 4, 8 or 16); 0 for kBytes and for
// numbers that are not a DType.
uint32_t DTypeSize(DType dtype);

// A durability level a version can reach (ckpt.v1.DurabilityLevel):
//   kStaged:    every rank's shard is in some agent's memory tier (survives
//               trainer crashes);
//   kProtected: the job's protection policy is complete (survives the
//               configured number of node losses);
//   kPersisted: in the durable tier with a commit marker.
// A version at a higher level also satisfies the lower ones.
enum class Level { kStaged = 1, kProtected = 2, kPersisted = 3 };

// Where a load was served from (ckpt.v1.SourceKind).
enum class ServedFrom {
  kUnknown = 0,   // the agent did not say
  kLocal = 1,     // this node's memory tier (zero copy)
  kReplica = 2,   // a peer's full copy, fetched over the data plane
  kEcDecode = 3,  // rebuilt from erasure-coded stripes
  kDurable = 4,   // the durable tier
};

// "local", "replica", "ec_decode", "durable" or "unknown".
const char* ServedFromName(ServedFrom served_from);

// How a job's shards are protected against node loss (docs/architecture.md "Protection"), if the
// trainer states one (ClientOptions::protection): rank 0 creates the job with
// it, and meta compares it when the job already exists.
struct Protection {
  enum class Kind { kNone, kReplicate, kErasureCode };
  enum class Placement { kRing, kGroup };

  // Local memory only: survives a trainer crash, not a node loss.
  static Protection None() { return Protection{}; }
  // `copies` in-memory copies (2..8) counting the primary.
  static Protection Replicate(uint32_t copies, Placement placement = Placement::kRing) {
    Protection p;
    p.kind = Kind::kReplicate;
    p.copies = copies;
    p.placement = placement;
    return p;
  }
  // Reed-Solomon stripes of k data (1..32) and m parity (1..8) segments.
  static Protection ErasureCode(uint32_t data_k, uint32_t parity_m) {
    Protection p;
    p.kind = Kind::kErasureCode;
    p.data_k = data_k;
    p.parity_m = parity_m;
    return p;
  }

  Kind kind = Kind::kNone;
  uint32_t copies = 0;                    // kReplicate
  Placement placement = Placement::kRing; // kReplicate
  uint32_t data_k = 0;                    // kErasureCode
  uint32_t parity_m = 0;                  // kErasureCode
};

// How an item of a save relates to the same-named item of the client's
// previous save (its "base": the last save of this Client that committed, or
// the version it last loaded if that is newer, so that a restarted trainer
// goes on from the version it restored; docs/protocol.md "Incremental saves"). An item that is the base's is
// stored as a reference to the base's bytes: nothing is copied, sent to
// peers or kept twice. Loads follow references transparently.
enum class ItemChange {
  kChanged,    // copy it (the default)
  kUnchanged,  // the caller vouches it is equal to the base's item (frozen
               // parameters): referenced without reading it, if the base has
               // an item of that name and length; copied otherwise
  kDetect,     // hash it (XXH3-64, a read-only pass) and reference the base's
               // item when that was hashed too and is equal; copied otherwise
};

// One item of a loaded shard, as recorded in its manifest.
struct LoadedItem {
  std::string name;
  DType dtype = DType::kBytes;
  std::vector<uint64_t> shape;
  // Position of the item inside the shard of version `step` (this rank's).
  uint64_t offset_bytes = 0;
  uint64_t length_bytes = 0;
  // CRC-32C of the item's bytes, computed by the writer.
  uint32_t crc32c = 0;
  std::map<std::string, std::string> attributes;
  // The version whose save copied these bytes: the loaded version's own
  // step, or an older one for an item an incremental save carried over
  // (a reference: unchanged, or not stated by a partial save).
  uint64_t step = 0;
};

// Global tensors (Client::GlobalTensors, Client::LoadSlices): a tensor of
// the whole model that ranks save slices of (tensor-parallel splits, ZeRO
// partitions) or whole copies of (data-parallel replicas). An item says it is
// one with attributes (GlobalAttributes below; docs/format.md "Global
// tensors").
struct GlobalPiece {
  uint32_t rank = 0;              // the rank whose shard holds it
  std::string item;               // the item's name in that shard
  std::vector<uint64_t> offsets;  // the slice it holds, per dimension
  std::vector<uint64_t> lengths;
};
struct GlobalTensor {
  std::string name;
  DType dtype = DType::kBytes;
  std::vector<uint64_t> shape;
  // Every stored piece (replicas of the same slice included), by rank.
  std::vector<GlobalPiece> pieces;
};

// The attributes that say an item named `item_name` holds the slice at
// `offsets` (one per dimension; its lengths are the item's shape) of global
// tensor `global_name` of `global_shape`; merge them into the item's own
// (SaveBuilder::Add checks them). A replica saved whole: offsets all 0 and
// global_shape the item's shape.
std::map<std::string, std::string> GlobalAttributes(std::string_view item_name, std::string_view global_name,
                                                    std::span<const uint64_t> global_shape,
                                                    std::span<const uint64_t> offsets);

// A slice of a global tensor to load (Client::LoadSlices) into `dst`, which
// holds exactly its elements, row-major (product of lengths x element size).
struct SliceRequest {
  std::string name;
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> lengths;
  std::span<std::byte> dst;
};

// How often to checkpoint (Client::RecommendedInterval): the Young/Daly
// interval sqrt(2 x C x M) for a checkpoint cost C (what this client's saves
// blocked the trainer, measured) and the job's mean time between failures M
// (from meta's history of node failures).
struct IntervalAdvice {
  uint64_t steps = 1;                  // the interval in training steps (at least 1)
  absl::Duration interval;             // sqrt(2 x C x M)
  absl::Duration checkpoint_cost;      // C: median blocking time of the recent saves
  absl::Duration mtbf;                 // M: the job's MTBF
  bool mtbf_is_lower_bound = false;    // meta has seen no failure: M is the time observed
  uint64_t failures_seen = 0;          // node failures meta has seen (all nodes)
  absl::Duration observed_node_time;   // node time meta has watched (all nodes)
  uint32_t job_nodes = 0;              // nodes the job runs on
  std::string explanation;             // the numbers in one sentence
};

}  // namespace ckpt
