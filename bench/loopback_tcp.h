// Plain loopback TCP for the benchmarks' raw-socket peers (the baseline a
// troupe case is compared with): blocking full reads and writes, and a
// listener / connection pair on 127.0.0.1. A peer that loses its socket
// exits at once (_exit), as a forked child must.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>

namespace troupe::bench {

inline void read_full(int fd, char* p, size_t n) {
  while (n) {
    ssize_t r = ::read(fd, p, n);
    if (r <= 0) _exit(1);
    p += r;
    n -= r;
  }
}

inline void write_full(int fd, const char* p, size_t n) {
  while (n) {
    ssize_t r = ::write(fd, p, n);
    if (r <= 0) _exit(1);
    p += r;
    n -= r;
  }
}

// A listening socket on 127.0.0.1 and an ephemeral port; `a` gets its address.
inline int listen_loopback(sockaddr_in& a) {
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  a = sockaddr_in{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len);
  listen(ls, 1);
  return ls;
}

// A connection to `a`, without Nagle's delay.
inline int connect_loopback(const sockaddr_in& a) {
  int c = socket(AF_INET, SOCK_STREAM, 0);
  connect(c, reinterpret_cast<const sockaddr*>(&a), sizeof(a));
  int one = 1;
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return c;
}

}  // namespace troupe::bench
