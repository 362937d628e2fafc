#include "troupe/runtime/client/process_stats.h"

#include <cstdio>

namespace troupe::client {

ProcessStats& process_stats() {
  static ProcessStats stats;
  return stats;
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
