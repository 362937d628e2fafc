// Network addresses: "HOST:PORT" text (IPv6 literals in brackets,
// "[::1]:6380"), host names resolved, and the choice of the address a
// process advertises. A process binds to one address (possibly the wildcard
// 0.0.0.0) and tells others another one: the address they can reach it at,
// never the wildcard.
#pragma once

#include <sys/socket.h>

#include <asio/ip/address.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

namespace troupe::wire {

// Splits "host:port" or "[v6]:port" (brackets dropped from the host);
// throws ConfigError naming the text when malformed or the port is not in
// 1..65535.
std::pair<std::string, uint16_t> parse_address(const std::string& address);
// "host:port", or "[host]:port" for an IPv6 literal.
std::string format_address(const std::string& host, uint16_t port);
// Drops brackets around an IPv6 literal ("[::1]" -> "::1").
std::string strip_brackets(const std::string& host);
// Throws ConfigError naming `what` and the text unless `host` can be a host
// part of an address others connect to: a host name or IPv4 literal
// (letters, digits, '.', '-', '_'), or an IPv6 literal, bracketed or not.
// Nothing is resolved.
void check_host(const std::string& what, const std::string& host);

// An IP literal as is, "localhost" as 127.0.0.1, a host name through the
// resolver (IPv4 first). Throws ConfigError naming the host.
asio::ip::address resolve_host(const std::string& host);

// Fills `out` with ip:port; returns the length to pass to connect/bind.
socklen_t to_sockaddr(const asio::ip::address& ip, uint16_t port, sockaddr_storage& out);

// One plain TCP connect to `address` (nothing sent): 0 when something
// accepts it, else the errno (ETIMEDOUT past `timeout`). ECONNREFUSED says
// the host was reached and nothing listens on that port.
int tcp_connect_error(const std::string& address, std::chrono::milliseconds timeout);

// Why a process listening on `bind_host` cannot be reached at
// `advertise_host` from this machine ("" when it can): a listener of its
// own on bind_host is connected to at the advertised address. An address
// of another machine, or one that leads to another interface than the
// bound one, fails. (Behind a NAT without hairpinning a good address
// fails too, so callers warn rather than refuse.)
std::string advertised_unreachable(const std::string& bind_host, const std::string& advertise_host);

// 0.0.0.0, :: or "": listening on every interface.
bool is_wildcard_host(const std::string& host);
// The address of this machine's first non-loopback interface that is up
// (IPv4 first), or 127.0.0.1 when there is none.
std::string first_non_loopback_address();
// The local address of the interface that routes to host:port (a UDP
// socket's getsockname after connect; nothing is sent).
std::string local_address_towards(const std::string& host, uint16_t port);
// What a process bound to `bind_host` advertises when not told: the bind
// host itself, or for a wildcard first_non_loopback_address().
std::string default_advertise_host(const std::string& bind_host);

}  // namespace troupe::wire
