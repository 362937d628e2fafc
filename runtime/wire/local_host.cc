#include "troupe/runtime/wire/local_host.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <utility>
#include <vector>

#include "troupe/runtime/core/errors.h"

namespace troupe::wire {

std::string interface_of(const std::string& address) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* a = list; a && name.empty(); a = a->ifa_next) {
    if (!a->ifa_addr || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6)) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    const void* raw = a->ifa_addr->sa_family == AF_INET
                          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr)
                          : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr);
    if (::inet_ntop(a->ifa_addr->sa_family, raw, buf, sizeof buf) && address == buf) name = a->ifa_name;
  }
  ::freeifaddrs(list);
  return name;
}

namespace {

// The kernel's ephemeral port range (ip_local_port_range): the ports
// outgoing connects are given.
std::pair<uint16_t, uint16_t> ephemeral_port_range() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  unsigned lo = 0, hi = 0;
  if (!(in >> lo >> hi) || lo < 1 || hi > 65535 || lo > hi) return {32768, 60999};  // Linux's default
  return {static_cast<uint16_t>(lo), static_cast<uint16_t>(hi)};
}

// Binds a TCP socket on every interface to `port` (0: the kernel picks one)
// and gives it back: the port bound, or 0 when it was taken.
uint16_t bind_and_release(uint16_t port, int* err) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("no free port: socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(port);
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  *err = errno;
  ::close(fd);
  return ok ? ntohs(a.sin_port) : 0;
}

}  // namespace

uint16_t free_listen_port() {
  const auto [lo, hi] = ephemeral_port_range();
  std::vector<std::pair<unsigned, unsigned>> spans;  // [first, last] outside it, above the well-known ports
  if (lo > 10000) spans.emplace_back(10000u, lo - 1u);
  if (hi < 65535) spans.emplace_back(hi + 1u, 65535u);
  std::mt19937 pick(std::random_device{}());
  int err = 0;
  for (int tries = 0; tries < 64 && !spans.empty(); ++tries) {
    const auto& span = spans[pick() % spans.size()];
    const auto port = static_cast<uint16_t>(span.first + pick() % (span.second - span.first + 1));
    if (bind_and_release(port, &err) == port) return port;
  }
  const uint16_t any = bind_and_release(0, &err);
  if (any == 0) throw Error(std::string("no free port: ") + std::strerror(err));
  return any;
}

}  // namespace troupe::wire
