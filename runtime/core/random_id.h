// Random 64-bit ids that nothing else hands out: a process's id towards the
// head, a head's cluster id, an object store's instance. Never 0, which
// these ids keep for "none said".
#pragma once

#include <cstdint>
#include <random>

namespace troupe::core {

inline uint64_t random_id() {
  std::random_device rd;
  uint64_t id = 0;
  while (id == 0) id = (uint64_t(rd()) << 32) ^ rd();
  return id;
}

}  // namespace troupe::core
