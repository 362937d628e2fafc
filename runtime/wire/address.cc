#include "troupe/runtime/wire/address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "troupe/runtime/core/errors.h"

namespace troupe::wire {

std::string strip_brackets(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') return host.substr(1, host.size() - 2);
  return host;
}

namespace {

// A character as a message shows it: itself when printable, else \xNN.
std::string shown(char c) {
  if (std::isprint(static_cast<unsigned char>(c))) return std::string(1, c);
  char hex[8];
  std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned char>(c));
  return hex;
}

}  // namespace

void check_host(const std::string& what, const std::string& host_text) {
  const std::string host = strip_brackets(host_text);
  const auto bad = [&](const std::string& why) {
    throw ConfigError(what + " '" + host_text + "' is not a host name or IP address: " + why);
  };
  if (host.empty()) bad("it is empty");
  if (host.size() > 253) bad("it is longer than 253 characters");
  if (host.find(':') != std::string::npos) {
    asio::error_code ec;
    asio::ip::make_address_v6(host, ec);
    if (ec) bad("it has a ':' but is not an IPv6 address");
    return;
  }
  for (char c : host)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_')
      bad("it has the character '" + shown(c) + "'");
}

std::pair<std::string, uint16_t> parse_address(const std::string& address) {
  // A URL (the dashboard's, or Ray's ray://) is the likeliest slip.
  if (const auto scheme = address.find("://"); scheme != std::string::npos)
    throw ConfigError("address '" + address + "' is not HOST:PORT: leave out the '" + address.substr(0, scheme + 3) +
                      "' (the head's address is HOST:PORT, as `troupe start --head` prints it)");
  auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size())
    throw ConfigError("address '" + address + "' is not HOST:PORT");
  std::string host = address.substr(0, colon);
  bool bracketed = host.front() == '[';
  if (bracketed != (host.back() == ']') || (!bracketed && host.find(':') != std::string::npos))
    throw ConfigError("address '" + address + "' is not HOST:PORT (write IPv6 addresses as [ADDR]:PORT)");
  host = strip_brackets(host);
  if (host.empty()) throw ConfigError("address '" + address + "' has no host");
  int port = 0;
  try {
    size_t used = 0;
    port = std::stoi(address.substr(colon + 1), &used);
    if (used != address.size() - colon - 1) throw std::invalid_argument("");
  } catch (const std::exception&) {
    throw ConfigError("address '" + address + "' has a bad port");
  }
  if (port <= 0 || port > 65535) throw ConfigError("address '" + address + "' has port out of range");
  return {host, static_cast<uint16_t>(port)};
}

std::string format_address(const std::string& host, uint16_t port) {
  std::string h = strip_brackets(host);
  if (h.find(':') != std::string::npos) h = "[" + h + "]";
  return h + ":" + std::to_string(port);
}

asio::ip::address resolve_host(const std::string& host_text) {
  std::string host = strip_brackets(host_text);
  if (host == "localhost") return asio::ip::make_address("127.0.0.1");
  asio::error_code ec;
  auto literal = asio::ip::make_address(host, ec);
  if (!ec) return literal;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || !found) throw ConfigError("cannot resolve host '" + host + "': " + ::gai_strerror(rc));
  // IPv4 first: loopback and most clusters are reachable by it.
  const addrinfo* pick = found;
  for (const addrinfo* a = found; a; a = a->ai_next)
    if (a->ai_family == AF_INET) {
      pick = a;
      break;
    }
  char buf[INET6_ADDRSTRLEN] = {0};
  const void* raw = pick->ai_family == AF_INET
                        ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(pick->ai_addr)->sin_addr)
                        : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(pick->ai_addr)->sin6_addr);
  ::inet_ntop(pick->ai_family, raw, buf, sizeof(buf));
  ::freeaddrinfo(found);
  return asio::ip::make_address(buf);
}

bool is_wildcard_host(const std::string& host) {
  std::string h = strip_brackets(host);
  return h.empty() || h == "0.0.0.0" || h == "::";
}

std::string first_non_loopback_address() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "127.0.0.1";
  std::string v4, v6;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
    char buf[INET6_ADDRSTRLEN] = {0};
    if (i->ifa_addr->sa_family == AF_INET && v4.empty()) {
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
      v4 = buf;
    } else if (i->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      auto* a6 = reinterpret_cast<sockaddr_in6*>(i->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&a6->sin6_addr)) continue;  // needs a scope id to be reachable
      ::inet_ntop(AF_INET6, &a6->sin6_addr, buf, sizeof(buf));
      v6 = buf;
    }
  }
  ::freeifaddrs(list);
  return !v4.empty() ? v4 : !v6.empty() ? v6 : "127.0.0.1";
}

socklen_t to_sockaddr(const asio::ip::address& ip, uint16_t port, sockaddr_storage& out) {
  out = {};
  if (ip.is_v4()) {
    auto* a = reinterpret_cast<sockaddr_in*>(&out);
    a->sin_family = AF_INET;
    a->sin_port = htons(port);
    auto bytes = ip.to_v4().to_bytes();
    std::memcpy(&a->sin_addr, bytes.data(), bytes.size());
    return sizeof(sockaddr_in);
  }
  auto* a = reinterpret_cast<sockaddr_in6*>(&out);
  a->sin6_family = AF_INET6;
  a->sin6_port = htons(port);
  auto bytes = ip.to_v6().to_bytes();
  std::memcpy(&a->sin6_addr, bytes.data(), bytes.size());
  return sizeof(sockaddr_in6);
}

std::string local_address_towards(const std::string& host, uint16_t port) {
  sockaddr_storage peer{};
  socklen_t len = to_sockaddr(resolve_host(host), port, peer);
  int fd = ::socket(peer.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw ConfigError(std::string("socket: ") + std::strerror(errno));
  sockaddr_storage local{};
  socklen_t local_len = sizeof(local);
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&peer), len) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) == 0;
  int err = errno;
  ::close(fd);
  if (!ok) throw ConfigError("no route to " + format_address(host, port) + ": " + std::strerror(err));
  char buf[INET6_ADDRSTRLEN] = {0};
  if (local.ss_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&local)->sin_addr, buf, sizeof(buf));
  else
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr, buf, sizeof(buf));
  return buf;
}

std::string default_advertise_host(const std::string& bind_host) {
  return is_wildcard_host(bind_host) ? first_non_loopback_address() : strip_brackets(bind_host);
}

int tcp_connect_error(const std::string& address, std::chrono::milliseconds timeout) {
  const auto [host, port] = parse_address(address);
  sockaddr_storage sa{};
  const socklen_t len = to_sockaddr(resolve_host(host), port, sa);
  const int fd = ::socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  int err = 0;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&sa), len) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int n = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(timeout.count(), 0)));
      socklen_t sl = sizeof err;
      if (n == 0)
        err = ETIMEDOUT;
      else if (n < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl) != 0)
        err = errno;
    }
  }
  ::close(fd);
  return err;
}

std::string advertised_unreachable(const std::string& bind_host, const std::string& advertise_host) {
  sockaddr_storage sa{};
  const socklen_t len =
      to_sockaddr(resolve_host(is_wildcard_host(bind_host) ? "0.0.0.0" : strip_brackets(bind_host)), 0, sa);
  const int fd = ::socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::string("socket: ") + std::strerror(errno);
  std::string why;
  socklen_t got = sizeof(sa);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&sa), len) != 0 || ::listen(fd, 4) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &got) != 0) {
    why = "cannot listen on " + bind_host + ": " + std::strerror(errno);
  } else {
    const uint16_t port = ntohs(sa.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&sa)->sin_port
                                                        : reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port);
    const std::string target = format_address(strip_brackets(advertise_host), port);
    if (const int err = tcp_connect_error(target, std::chrono::seconds(1)); err != 0)
      why = "a connection to " + target + " that something listening on " +
            format_address(strip_brackets(bind_host), port) + " should take: " + std::strerror(err);
  }
  ::close(fd);
  return why;
}

}  // namespace troupe::wire
