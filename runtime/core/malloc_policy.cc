#include "troupe/runtime/core/malloc_policy.h"

#include <malloc.h>

#include <string_view>

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
  // Built with string_views and append: GCC 12 warns (-Warray-bounds,
  // wrongly) on inlined std::string concatenations here.
  const std::string_view policy_name = kEnvWorkerMalloc;
  const std::string tunables_key = "GLIBC_TUNABLES=";
  const std::string* tunables = nullptr;
  bool system = false;  // anything but "reuse" and "system" was refused at the agent's start
  for (const auto& kv : env) {
    const std::string_view entry = kv;
    if (entry.size() > policy_name.size() && entry.starts_with(policy_name) && entry[policy_name.size()] == '=')
      system = entry.substr(policy_name.size() + 1) == "system";
    if (kv.rfind(tunables_key, 0) == 0) tunables = &kv;
  }
  if (system) return;
  constexpr std::string_view kHugePages = "glibc.malloc.hugetlb";
  if (tunables && tunables->find(kHugePages) != std::string::npos) return;
  std::string entry = tunables ? *tunables : tunables_key;
  if (entry.size() > tunables_key.size()) entry.push_back(':');
  entry.append(kHugePages).append("=1");
  env.push_back(std::move(entry));
}

}  // namespace troupe::core
