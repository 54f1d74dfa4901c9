#include "common/prefault.h"

namespace ckpt {

void PrefaultForWrite(void* data, size_t size, size_t page_bytes) {
  auto* p = static_cast<unsigned char*>(data);
  for (size_t off = 0; off < size; off += page_bytes) {
    __atomic_fetch_add(p + off, static_cast<unsigned char>(0), __ATOMIC_RELAXED);
  }
}

}  // namespace ckpt
