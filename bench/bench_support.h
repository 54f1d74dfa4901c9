// Small pieces the end-to-end benchmark programs share.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>

#include "absl/time/time.h"

namespace ckpt::bench {

inline double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// A private buffer, pre-faulted at allocation (first touch of fresh memory is
// slow on this VM and must not land inside a measurement).
struct Buffer {
  explicit Buffer(size_t n) : size(n) {
    data = static_cast<std::byte*>(
        ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0));
    if (data == MAP_FAILED) {
      std::perror("mmap");
      std::exit(1);
    }
  }
  ~Buffer() { ::munmap(data, size); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::byte* data;
  size_t size;
};

}  // namespace ckpt::bench
