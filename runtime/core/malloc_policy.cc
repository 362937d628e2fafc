#include "troupe/runtime/core/malloc_policy.h"

#include <malloc.h>

#include "troupe/runtime/core/errors.h"

namespace troupe::core {

MallocPolicy malloc_policy_from_env() {
  const std::string value = env_value(kEnvWorkerMalloc);
  if (value.empty() || value == "reuse") return MallocPolicy::kReuse;
  if (value == "system") return MallocPolicy::kSystem;
  throw ConfigError(std::string(kEnvWorkerMalloc) + "='" + value + "' is not \"reuse\" or \"system\"");
}

std::string apply_malloc_policy(MallocPolicy policy) {
  if (policy == MallocPolicy::kSystem) return "";
  // glibc caps the mmap threshold at half its per-thread heap size (32 MiB
  // on 64-bit); larger blocks are mapped and unmapped as before.
  constexpr int kMmapThreshold = 32 << 20;
  constexpr int kTopPad = 64 << 20;
  std::string refused;
  if (::mallopt(M_MMAP_THRESHOLD, kMmapThreshold) != 1) refused += " M_MMAP_THRESHOLD";
  if (::mallopt(M_TRIM_THRESHOLD, -1) != 1) refused += " M_TRIM_THRESHOLD";
  if (::mallopt(M_TOP_PAD, kTopPad) != 1) refused += " M_TOP_PAD";
  return refused.empty() ? "" : "mallopt refused" + refused;
}

}  // namespace troupe::core
