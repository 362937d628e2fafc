#include "troupe/runtime/node/stats_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <utility>

#include "troupe/runtime/client/process_stats.h"
#include "troupe/runtime/core/worker_env.h"

namespace troupe::node {

StatsPages& StatsPages::instance() {
  // Never destroyed: a pool may reap a worker while the process exits.
  static auto* pages = new StatsPages;
  return *pages;
}

StatsPages::Page StatsPages::prepare(core::SpawnOptions& o) {
  Page p;
  // Close-on-exec in every other child; spawn_process clears that for the
  // worker's kept descriptors.
  p.fd = ::memfd_create(client::kStatsPageName, MFD_CLOEXEC);
  if (p.fd < 0) return {};
  if (::ftruncate(p.fd, client::kStatsPageBytes) != 0) {
    ::close(p.fd);
    return {};
  }
  p.map = ::mmap(nullptr, client::kStatsPageBytes, PROT_READ, MAP_SHARED, p.fd, 0);
  if (p.map == MAP_FAILED) {
    ::close(p.fd);
    return {};
  }
  o.keep_fds.push_back(p.fd);
  std::string setting = core::kEnvStatsFd;
  setting += '=';
  setting += std::to_string(p.fd);
  o.env.push_back(std::move(setting));
  return p;
}

void StatsPages::adopt(pid_t pid, Page page) {
  if (page.fd < 0) return;
  ::close(page.fd);
  void* old = nullptr;
  {
    std::lock_guard lock(mu_);
    auto [it, fresh] = pages_.try_emplace(pid, page.map);
    if (!fresh) old = std::exchange(it->second, page.map);  // a pid reused before its reap was seen
  }
  if (old) ::munmap(old, client::kStatsPageBytes);
}

void StatsPages::discard(Page page) {
  if (page.fd < 0) return;
  ::close(page.fd);
  ::munmap(page.map, client::kStatsPageBytes);
}

std::optional<StatsPages::Counts> StatsPages::read(pid_t pid) const {
  std::lock_guard lock(mu_);
  auto it = pages_.find(pid);
  if (it == pages_.end()) return std::nullopt;
  // The worker's ProcessStats, as it wrote them: relaxed atomics of
  // uint64_t, lock-free, so the same bytes as two uint64_t.
  const auto* words = static_cast<const uint64_t*>(it->second);
  Counts c;
  c.calls = __atomic_load_n(&words[0], __ATOMIC_RELAXED);
  c.stream_bytes = __atomic_load_n(&words[1], __ATOMIC_RELAXED);
  return c;
}

void StatsPages::release(pid_t pid) {
  void* map = nullptr;
  {
    std::lock_guard lock(mu_);
    auto it = pages_.find(pid);
    if (it == pages_.end()) return;
    map = it->second;
    pages_.erase(it);
  }
  ::munmap(map, client::kStatsPageBytes);
}

}  // namespace troupe::node
