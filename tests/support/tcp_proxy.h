// A TCP proxy on loopback for tests that need a connection to break while
// both of its ends live: a client connects to the proxy's address, each
// accepted connection is joined to a new one to `upstream`, and cut()
// breaks every connection it carries at that moment (both sides see the
// close), as a network blip would. It goes on accepting after a cut;
// while refusing, it closes what it accepts at once (the link stays down).
// hold(true) is a partition instead: no byte moves either way and nothing
// closes, until hold(false) lets what waited through.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace troupe::test {

class TcpProxy {
 public:
  // `upstream`: "127.0.0.1:PORT".
  explicit TcpProxy(const std::string& upstream) {
    auto colon = upstream.rfind(':');
    if (colon == std::string::npos) throw std::runtime_error("TcpProxy: no port in " + upstream);
    up_.sin_family = AF_INET;
    up_.sin_port = htons(static_cast<uint16_t>(std::stoi(upstream.substr(colon + 1))));
    if (inet_pton(AF_INET, upstream.substr(0, colon).c_str(), &up_.sin_addr) != 1)
      throw std::runtime_error("TcpProxy: not an IPv4 address: " + upstream);
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        ::listen(listen_fd_, 16) != 0 || ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("TcpProxy: cannot listen");
    address_ = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  ~TcpProxy() {
    stop_ = true;
    hold(false);
    ::shutdown(listen_fd_, SHUT_RDWR);
    acceptor_.join();
    cut();
    std::vector<std::thread> pumps;
    {
      std::lock_guard lock(mu_);
      pumps.swap(pumps_);
    }
    for (auto& t : pumps) t.join();
    ::close(listen_fd_);
  }
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  const std::string& address() const { return address_; }
  // Connections accepted (and joined upstream) so far.
  int accepted() const { return accepted_; }
  void set_refusing(bool refusing) { refusing_ = refusing; }
  void hold(bool held) {
    {
      std::lock_guard lock(mu_);
      held_ = held;
    }
    held_cv_.notify_all();
  }

  // Bytes clients sent that wait unread in the proxy (under a hold: a
  // request known to be in flight).
  size_t held_from_clients() {
    std::lock_guard lock(mu_);
    size_t n = 0;
    for (auto& [client, server] : open_) {
      int queued = 0;
      if (::ioctl(client, FIONREAD, &queued) == 0 && queued > 0) n += static_cast<size_t>(queued);
    }
    return n;
  }

  // Breaks every connection carried now; returns how many.
  int cut() {
    std::lock_guard lock(mu_);
    int n = 0;
    for (auto& [a, b] : open_) {
      ::shutdown(a, SHUT_RDWR);
      ::shutdown(b, SHUT_RDWR);
      ++n;
    }
    return n;
  }

 private:
  void accept_loop() {
    while (!stop_) {
      int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) {
        if (stop_ || (errno != EINTR && errno != ECONNABORTED)) return;
        continue;
      }
      if (refusing_) {
        ::close(client);
        continue;
      }
      int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (server < 0 || ::connect(server, reinterpret_cast<const sockaddr*>(&up_), sizeof(up_)) != 0) {
        if (server >= 0) ::close(server);
        ::close(client);
        continue;
      }
      ++accepted_;
      std::lock_guard lock(mu_);
      open_.push_back({client, server});
      pumps_.emplace_back([this, client, server] { pump(client, server); });
    }
  }

  // Copies both ways until either side ends, then closes both.
  void pump(int a, int b) {
    char buf[64 * 1024];
    pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    bool open = true;
    while (open) {
      {
        std::unique_lock lock(mu_);
        held_cv_.wait(lock, [&] { return !held_; });
      }
      const int ready = ::poll(fds, 2, 50);  // bounded: a hold begun meanwhile is seen
      if (ready < 0) {
        if (errno == EINTR) continue;
        break;
      }
      {
        std::lock_guard lock(mu_);
        if (ready == 0 || held_) continue;
      }
      for (int i = 0; i < 2 && open; ++i) {
        if (!fds[i].revents) continue;
        ssize_t n = ::read(fds[i].fd, buf, sizeof(buf));
        if (n <= 0) {
          open = false;
          break;
        }
        for (ssize_t off = 0; off < n;) {
          ssize_t w = ::send(fds[1 - i].fd, buf + off, n - off, MSG_NOSIGNAL);  // a cut side: EPIPE, no signal
          if (w <= 0) {
            open = false;
            break;
          }
          off += w;
        }
      }
    }
    std::lock_guard lock(mu_);
    ::shutdown(a, SHUT_RDWR);
    ::shutdown(b, SHUT_RDWR);
    ::close(a);
    ::close(b);
    for (auto it = open_.begin(); it != open_.end(); ++it)
      if (it->first == a) {
        open_.erase(it);
        break;
      }
  }

  sockaddr_in up_{};
  int listen_fd_ = -1;
  std::string address_;
  std::atomic<bool> stop_{false}, refusing_{false};
  std::atomic<int> accepted_{0};
  std::mutex mu_;
  std::condition_variable held_cv_;
  bool held_ = false;                      // under mu_
  std::vector<std::pair<int, int>> open_;  // client side, upstream side
  std::vector<std::thread> pumps_;
  std::thread acceptor_;
};

}  // namespace troupe::test
