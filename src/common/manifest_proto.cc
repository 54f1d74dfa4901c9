#include "common/manifest_proto.h"

#include <utility>

namespace ckpt {

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

void ManifestItemToProto(const ManifestItem& item, v1::Item* out) {
  out->set_name(item.name);
  out->set_dtype(static_cast<v1::DType>(item.dtype));
  for (uint64_t d : item.shape) out->add_shape(d);
  out->set_offset_bytes(item.offset_bytes);
  out->set_length_bytes(item.length_bytes);
  out->set_crc32c(item.crc32c);
  for (const auto& [k, v] : item.attributes) (*out->mutable_attributes())[k] = v;
  if (item.ref_step) out->set_ref_step(*item.ref_step);
}

std::vector<ManifestItem> SortedManifestFromProto(const google::protobuf::RepeatedPtrField<v1::Item>& items) {
  std::vector<ManifestItem> out;
  out.reserve(static_cast<size_t>(items.size()));
  for (const v1::Item& it : items) out.push_back(ManifestItemFromProto(it));
  return SortedByOffset(out);
}

}  // namespace ckpt
