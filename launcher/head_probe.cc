#include "head_probe.h"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/wire/address.h"
#include "troupe/runtime/wire/auth.h"

namespace troupe::launcher {

namespace {

using Clock = std::chrono::steady_clock;

// A socket that closes itself.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? static_cast<int>(left) : 0;
}

// Waits for `events` on fd; false at the deadline.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, ms_left(deadline));
    if (r < 0 && errno == EINTR) continue;
    return r > 0;
  }
}

void connect_by(int fd, const asio::ip::address& ip, uint16_t port, Clock::time_point deadline,
                const std::string& address) {
  sockaddr_storage sa{};
  socklen_t len = wire::to_sockaddr(ip, port, sa);
  int err = 0;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), len) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      if (!wait_for(fd, POLLOUT, deadline)) throw HeadUnreachable("cannot connect to " + address + ": timed out");
      socklen_t el = sizeof(err);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
    }
  }
  if (err != 0) throw HeadUnreachable("cannot connect to " + address + ": " + std::strerror(err));
}

// Reads exactly n bytes; returns how many arrived before EOF or the deadline.
size_t read_some(int fd, uint8_t* out, size_t n, Clock::time_point deadline) {
  size_t got = 0;
  while (got < n && wait_for(fd, POLLIN, deadline)) {
    ssize_t r = ::recv(fd, out + got, n - got, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

void write_all(int fd, const uint8_t* p, size_t n, Clock::time_point deadline, const std::string& address) {
  size_t off = 0;
  while (off < n) {
    if (!wait_for(fd, POLLOUT, deadline)) throw ConnectionError("writing to " + address + " timed out");
    ssize_t r = ::send(fd, p + off, n - off, MSG_NOSIGNAL);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r <= 0) throw ConnectionError("writing to " + address + " failed: " + std::strerror(errno));
    off += static_cast<size_t>(r);
  }
}

// Printable start of what a foreign service sent, for the error message.
std::string printable(const uint8_t* p, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += (p[i] >= 32 && p[i] < 127) ? static_cast<char>(p[i]) : '.';
  return s;
}

}  // namespace

void probe_head(const std::string& address, const std::string& token, std::chrono::milliseconds timeout) {
  auto [host, port] = wire::parse_address(address);
  asio::ip::address ip;
  try {
    ip = wire::resolve_host(host);
  } catch (const ConfigError& e) {
    throw HeadUnreachable(e.what());  // a name published once the head is up (a Kubernetes service)
  }
  auto deadline = Clock::now() + timeout;
  Fd s{::socket(ip.is_v4() ? AF_INET : AF_INET6, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
  if (s.fd < 0) throw ConnectionError(std::string("socket: ") + std::strerror(errno));
  connect_by(s.fd, ip, port, deadline, address);
  std::array<uint8_t, 8 + wire::kNonceBytes> hello{}, theirs{};
  wire::Nonce mine = wire::random_nonce();
  std::memcpy(hello.data(), wire::kAuthMagic, 8);
  std::memcpy(hello.data() + 8, mine.data(), mine.size());
  write_all(s.fd, hello.data(), hello.size(), deadline, address);
  size_t got = read_some(s.fd, theirs.data(), theirs.size(), deadline);
  std::string seconds = std::to_string(timeout.count() / 1000.0).substr(0, 3) + " s";
  if (got >= 8 && std::memcmp(theirs.data(), wire::kAuthMagic, 8) != 0) {
    // A troupe process of another version says so; anything else is no head.
    if (std::memcmp(theirs.data(), wire::kAuthMagic, 7) == 0)
      throw ConnectionError(address + ": " + wire::check_magic(theirs.data()));
    throw ConnectionError(address + " is not a troupe head (it answered \"" + printable(theirs.data(), got) +
                          "\", not the troupe handshake)");
  }
  if (got == 0 && ms_left(deadline) == 0)
    throw ConnectionError(address + " did not answer the troupe handshake within " + seconds +
                          ": it is not a troupe head, or a head that is stopped or overloaded");
  if (got < theirs.size())
    throw ConnectionError(address + " is not a troupe head (it closed the connection without the troupe handshake)");
  wire::Nonce their_nonce;
  std::memcpy(their_nonce.data(), theirs.data() + 8, their_nonce.size());
  wire::Proof proof = wire::make_proof(token, 'C', mine, their_nonce);
  write_all(s.fd, proof.data(), proof.size(), deadline, address);
  wire::Proof answer{};
  const size_t answered = read_some(s.fd, answer.data(), answer.size(), deadline);
  if (answered == 0 && ms_left(deadline) > 0)
    // A head closes on a wrong proof, and also drops the oldest handshakes
    // when too many are pending (a flood of connections): say both.
    throw ConnectionError("the troupe head at " + address +
                          " closed the connection after our proof: a wrong cluster token (TROUPE_TOKEN, or the "
                          "session's token file), or the head is shedding handshakes under a flood of connections "
                          "(try again)");
  if (answered != answer.size() || !wire::proofs_equal(answer, wire::make_proof(token, 'S', their_nonce, mine)))
    throw ConnectionError("the troupe head at " + address + " refused the cluster token (wrong TROUPE_TOKEN?)");
}

void wait_for_head(const std::string& address, const std::string& token, std::chrono::milliseconds wait,
                   const std::string& who) {
  const auto start = Clock::now();
  auto say_at = start;
  for (;;) {
    // Each try within what is left of the wait (it ran up to 3 s past it),
    // but never shorter than a second's (a connect across a slow network).
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(wait - (Clock::now() - start));
    const auto timeout = wait.count() == 0
                             ? kProbeTimeout
                             : std::clamp<std::chrono::milliseconds>(left, std::chrono::seconds(1), kProbeTimeout);
    try {
      return probe_head(address, token, timeout);
    } catch (const HeadUnreachable& e) {
      const auto now = Clock::now();
      const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - start).count();
      if (now - start >= wait) {
        if (wait.count() == 0) throw;
        throw HeadUnreachable(std::string(e.what()) + " (waited " + std::to_string(waited) + " s for the head)");
      }
      if (now >= say_at) {
        const auto left = std::chrono::duration_cast<std::chrono::seconds>(wait - (now - start)).count();
        std::fprintf(stderr, "%s: waiting for the head at %s (%s); %lld s left\n", who.c_str(), address.c_str(),
                     e.what(), static_cast<long long>(left));
        say_at = now + std::chrono::seconds(10);
      }
      // A retry interval, not a wait for an event: nothing tells us when a
      // head starts listening on another machine. A stop signal the caller
      // blocked ends the wait (sigtimedwait takes it).
      sigset_t stop;
      sigemptyset(&stop);
      for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&stop, sig);
      const auto pause = std::min<Clock::duration>(std::chrono::seconds(1), wait - (now - start));
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(pause).count();
      const timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      sigset_t blocked;
      ::pthread_sigmask(SIG_BLOCK, nullptr, &blocked);
      bool any_blocked = false;
      for (int sig : {SIGTERM, SIGINT, SIGHUP}) any_blocked = any_blocked || sigismember(&blocked, sig);
      if (!any_blocked) {
        std::this_thread::sleep_for(pause);
        continue;
      }
      if (const int sig = ::sigtimedwait(&stop, nullptr, &ts); sig > 0) throw StopSignal{sig};
    }
  }
}

}  // namespace troupe::launcher
