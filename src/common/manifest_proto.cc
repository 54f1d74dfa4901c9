#include "client/manifest_proto.h"

#include <utility>

namespace ckpt::client {

ManifestItem ManifestItemFromProto(const v1::Item& item) {
  ManifestItem m;
  m.name = item.name();
  m.dtype = item.dtype();
  m.shape.assign(item.shape().begin(), item.shape().end());
  m.offset_bytes = item.offset_bytes();
  m.length_bytes = item.length_bytes();
  m.crc32c = item.crc32c();
  m.attributes.insert(item.attributes().begin(), item.attributes().end());
  if (item.has_ref_step()) m.ref_step = item.ref_step();
  return m;
}

std::vector<ManifestItem> SortedManifestFromProto(const google::protobuf::RepeatedPtrField<v1::Item>& items) {
  std::vector<ManifestItem> out;
  out.reserve(static_cast<size_t>(items.size()));
  for (const v1::Item& it : items) out.push_back(ManifestItemFromProto(it));
  return SortedByOffset(out);
}

}  // namespace ckpt::client
