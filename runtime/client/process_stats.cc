#include "troupe/runtime/client/process_stats.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <string_view>

#include "troupe/runtime/core/worker_env.h"

namespace troupe::client {

namespace {

// The agent's page named by core::kEnvStatsFd, mapped; null when there is none
// or the descriptor is not that page (an inherited variable naming some
// other file: it is left alone).
void* map_agent_page() {
  const char* v = std::getenv(core::kEnvStatsFd);
  if (!v) return nullptr;
  char* end = nullptr;
  const long fd = std::strtol(v, &end, 10);
  ::unsetenv(core::kEnvStatsFd);
  if (end == v || *end != '\0' || fd < 3 || fd > 1 << 20) return nullptr;
  char link[64];
  std::snprintf(link, sizeof(link), "/proc/self/fd/%ld", fd);
  char target[64] = {};
  const ssize_t n = ::readlink(link, target, sizeof(target) - 1);
  if (n <= 0) return nullptr;
  std::string_view name(target, static_cast<size_t>(n));
  constexpr std::string_view kMemfd = "/memfd:";
  if (!name.starts_with(kMemfd) || !name.substr(kMemfd.size()).starts_with(kStatsPageName)) return nullptr;
  void* map = ::mmap(nullptr, kStatsPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, static_cast<int>(fd), 0);
  ::close(static_cast<int>(fd));  // the mapping stays; no child inherits the page
  return map == MAP_FAILED ? nullptr : map;
}

}  // namespace

ProcessStats& process_stats() {
  // Never destroyed: counted into until the process ends.
  static ProcessStats* stats = [] {
    if (void* page = map_agent_page()) return new (page) ProcessStats;
    return new ProcessStats;
  }();
  return *stats;
}

std::string format_stats(uint64_t calls, uint64_t stream_bytes) {
  return std::to_string(calls) + " " + std::to_string(stream_bytes);
}

bool parse_stats(const std::string& text, uint64_t* calls, uint64_t* stream_bytes) {
  unsigned long long c = 0, b = 0;
  char extra = 0;
  if (std::sscanf(text.c_str(), "%llu %llu %c", &c, &b, &extra) != 2) return false;
  *calls = c;
  *stream_bytes = b;
  return true;
}

}  // namespace troupe::client
