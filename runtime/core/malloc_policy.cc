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

void add_exec_time_malloc_settings(std::vector<std::string>& env) {
  const std::string policy_key = std::string(kEnvWorkerMalloc) + "=";
  const std::string tunables_key = "GLIBC_TUNABLES=";
  const std::string* tunables = nullptr;
  bool system = false;  // anything but "reuse" and "system" was refused at the agent's start
  for (const auto& kv : env) {
    if (kv.rfind(policy_key, 0) == 0) system = kv.substr(policy_key.size()) == "system";
    if (kv.rfind(tunables_key, 0) == 0) tunables = &kv;
  }
  if (system) return;
  constexpr const char* kHugePages = "glibc.malloc.hugetlb";
  if (!tunables) {
    env.push_back(tunables_key + kHugePages + "=1");
  } else if (tunables->find(kHugePages) == std::string::npos) {
    const std::string value = tunables->substr(tunables_key.size());
    env.push_back(tunables_key + (value.empty() ? "" : value + ":") + kHugePages + "=1");
  }
}

}  // namespace troupe::core
