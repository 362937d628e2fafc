// GlooGroup::create against a peer that is alive (its keys are in the
// store) but cannot be reached: its advertised address drops SYNs, or it
// never dials. Everything stays on loopback: a "black hole" is a listening
// socket whose accept queue is full and never accepted (Linux drops further
// SYNs silently), and the two sides of a pair use 127.0.0.1 and 127.0.0.2
// so that which one dials (gloo: the higher address) is known. Without a
// bound of its own, gloo waited five times the rendezvous timeout (and the
// kernel's SYN retries, about two minutes) before create() failed, with an
// error that named no peer.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gloo/transport/tcp/address.h>

#include "tests/support/wait.h"
#include "troupe/runtime/collective/gloo_group.h"
#include "troupe/runtime/collective/kv_gloo_store.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/kv_store.h"

namespace troupe::collective {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kRendezvous = 3s;
// gloo alone gave up after 5 x kRendezvous (15 s); the bound leaves
// kRendezvous + 6 s for a loaded machine.
constexpr auto kBound = kRendezvous + 6s;

int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

sockaddr_in loopback(const char* ip, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  ::inet_pton(AF_INET, ip, &a.sin_addr);
  return a;
}

// A listening socket on `ip` whose accept queue (backlog 0: one
// connection) is full: the kernel drops every further SYN without an
// answer, as a filtered address does. `ok` once it is.
struct BlackHole {
  Fd listener;
  Fd filler{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  sockaddr_in addr{};
  bool ok = false;

  explicit BlackHole(const char* ip) : listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    addr = loopback(ip, 0);
    socklen_t len = sizeof addr;
    if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return;
    if (::listen(listener.get(), 0) != 0) return;
    if (::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) return;
    if (::connect(filler.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return;
    // The filler is in the accept queue once the listener counts it
    // (tcpi_unacked of a listening socket is its accept queue's length).
    ok = test::eventually(
        [&] {
          tcp_info info{};
          socklen_t n = sizeof info;
          return ::getsockopt(listener.get(), IPPROTO_TCP, TCP_INFO, &info, &n) == 0 && info.tcpi_unacked >= 1;
        },
        10s);
  }
};

// Stands in for rank 1 of group `name` generation 1 in a group of two: alive
// (its member key is there) and advertising `addr` for its pair with rank 0.
void fake_rank_one(KvStore& kv, const std::string& name, const sockaddr_in& addr) {
  const std::string prefix = KvGlooStore::key_prefix(name, 1);
  kv.put(prefix + "member/1", "4242");
  sockaddr_storage ss{};
  std::memcpy(&ss, &addr, sizeof addr);
  const auto bytes = gloo::transport::tcp::Address(ss).bytes();
  kv.put(prefix + "1", std::string(bytes.begin(), bytes.end()));
}

std::string endpoint(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN];
  ::inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
  return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
}

// Rank 0 of a group of two whose rank 1 is faked; returns the error.
std::string create_rank_zero(KvStore& kv, const std::string& name, const std::string& bind_host, int64_t* took_ms) {
  GlooGroupOptions opts;
  opts.bind_host = bind_host;
  opts.rendezvous_timeout = kRendezvous;
  const auto start = Clock::now();
  std::string error;
  try {
    auto group = GlooGroup::create(kv, name, 1, 0, 2, opts);
    error = "formed a group with an unreachable peer";
  } catch (const Timeout& e) {
    error = e.what();
  } catch (const std::exception& e) {
    error = std::string("not a Timeout: ") + e.what();
  }
  *took_ms = ms_since(start);
  std::fprintf(stderr, "rank 0 of '%s' failed after %lld ms: %s\n", name.c_str(), static_cast<long long>(*took_ms),
               error.c_str());
  return error;
}

// Rank 0 listens on 127.0.0.2, above rank 1's 127.0.0.1: it dials, and its
// SYNs vanish.
TEST(GlooConnectTest, DialingABlackHoleFailsAtTheRendezvousDeadlineNamingThePeer) {
  BlackHole hole("127.0.0.1");
  ASSERT_TRUE(hole.ok) << "could not fill a loopback listener's accept queue";
  {
    Fd probe(::socket(AF_INET, SOCK_STREAM, 0));
    sockaddr_in a = loopback("127.0.0.2", 0);
    if (::bind(probe.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
      GTEST_SKIP() << "127.0.0.2 is not a local address here";
  }
  MemoryKvStore kv;
  fake_rank_one(kv, "hole", hole.addr);
  int64_t took = 0;
  const std::string error = create_rank_zero(kv, "hole", "127.0.0.2", &took);
  EXPECT_LT(took, std::chrono::duration_cast<std::chrono::milliseconds>(kBound).count()) << error;
  EXPECT_NE(error.find("rank 0 cannot connect to rank 1 at " + endpoint(hole.addr) + " within 3000 ms"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("'hole' generation 1"), std::string::npos) << error;
  EXPECT_NE(error.find("rank 0 dials"), std::string::npos) << error;
  EXPECT_FALSE(kv.get(KvGlooStore::key_prefix("hole", 1) + "0")) << "a failed rendezvous left its mesh key";
}

// Rank 0 listens on 127.0.0.1, below rank 1's 127.0.0.2: it waits for rank
// 1 to dial, which never comes.
TEST(GlooConnectTest, WaitingForAPeerThatNeverDialsFailsAtTheDeadlineNamingIt) {
  MemoryKvStore kv;
  const sockaddr_in peer = loopback("127.0.0.2", 40999);  // never dialled from: only its address matters
  fake_rank_one(kv, "mute", peer);
  int64_t took = 0;
  const std::string error = create_rank_zero(kv, "mute", "127.0.0.1", &took);
  EXPECT_LT(took, std::chrono::duration_cast<std::chrono::milliseconds>(kBound).count()) << error;
  EXPECT_NE(error.find("rank 0 cannot connect to rank 1 at 127.0.0.2:40999 within 3000 ms"), std::string::npos)
      << error;
  EXPECT_NE(error.find("waited for rank 1 to connect to 127.0.0.1:"), std::string::npos) << error;
}

// A member that dies after publishing its addresses never dials: the
// runtime's member watch says so (GlooGroupOptions::abandoned), and the
// rendezvous fails then with the death as its reason, not at its deadline
// (a heal whose replacement died there waited the whole 60 s).
TEST(GlooConnectTest, AMemberDyingWhileTheMeshConnectsFailsItAtOnceWithTheDeath) {
  MemoryKvStore kv;
  const sockaddr_in peer = loopback("127.0.0.2", 40998);  // rank 0 waits for it to dial
  fake_rank_one(kv, "dies", peer);
  const std::string mesh_key = KvGlooStore::key_prefix("dies", 1) + "0";
  GlooGroupOptions opts;
  opts.bind_host = "127.0.0.1";
  opts.rendezvous_timeout = 2min;  // without the watch, a Timeout after 2 min
  // Rank 1 "dies" once rank 0 has published its own addresses, so rank 0
  // is connecting its pairs by then.
  opts.abandoned = [&] { return kv.get(mesh_key) ? std::string("member rank 1 (actor 7) is DEAD: killed") : ""; };
  try {
    auto group = GlooGroup::create(kv, "dies", 1, 0, 2, opts);
    FAIL() << "formed a group with a dead member";
  } catch (const Aborted& e) {
    const std::string error = e.what();
    EXPECT_NE(error.find("'dies' generation 1"), std::string::npos) << error;
    EXPECT_NE(error.find("rank 0 cannot connect to rank 1 at 127.0.0.2:40998: member rank 1 (actor 7) is DEAD"),
              std::string::npos)
        << error;
  }
  EXPECT_FALSE(kv.get(mesh_key)) << "a failed rendezvous left its mesh key";
}

// An operation of a group of two can only wait on the other rank: its
// messages name it and its host.
TEST(GlooConnectTest, OperationsOfAGroupOfTwoNameThePeerHost) {
  MemoryKvStore kv;
  GlooGroupOptions opts;
  opts.rendezvous_timeout = 30s;
  std::unique_ptr<GlooGroup> one;
  std::string one_error;
  std::thread t([&] {
    try {
      one = GlooGroup::create(kv, "two", 1, 1, 2, opts);
    } catch (const std::exception& e) {
      one_error = e.what();
    }
  });
  auto zero = GlooGroup::create(kv, "two", 1, 0, 2, opts);
  t.join();
  ASSERT_TRUE(one) << one_error;
  float x = 1, y = 2;
  auto work = zero->allreduce(&x, 1, DType::kFloat32);  // rank 1 has not joined it yet
  try {
    work->wait(100ms);
    FAIL() << "an allreduce without its peer completed";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("(rank 0 of 2; peer rank 1 on 127.0.0.1)"), std::string::npos) << e.what();
  }
  one->allreduce(&y, 1, DType::kFloat32)->wait(test::kWaitBound);
  work->wait(test::kWaitBound);
  EXPECT_EQ(x, 3.0f);
}

// The process's connected IPv4 sockets: local endpoint by socket inode.
// Read from /proc (the links of /proc/self/fd, the table of
// /proc/net/tcp), never through the descriptors, which gloo's device
// thread may close meanwhile (TSan calls touching them a race).
std::map<ino_t, sockaddr_in> connected_sockets() {
  std::set<unsigned long long> ours;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (dirent* entry = ::readdir(dir)) {
      char target[64];
      const std::string link = std::string("/proc/self/fd/") + entry->d_name;
      const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
      if (n <= 0) continue;
      target[n] = '\0';
      unsigned long long inode = 0;
      if (std::sscanf(target, "socket:[%llu]", &inode) == 1) ours.insert(inode);
    }
    ::closedir(dir);
  }
  std::map<ino_t, sockaddr_in> found;
  std::ifstream table("/proc/net/tcp");
  std::string line;
  std::getline(table, line);  // the header
  while (std::getline(table, line)) {
    unsigned ip = 0, port = 0, state = 0;
    unsigned long long inode = 0;
    // sl: local rem st tx:rx tr:when retrnsmt uid timeout inode
    if (std::sscanf(line.c_str(), " %*d: %8X:%4X %*8X:%*4X %2X %*s %*s %*s %*u %*u %llu", &ip, &port, &state, &inode) !=
        4)
      continue;
    if (state != 0x01 || ours.count(inode) == 0) continue;  // ESTABLISHED, this process's
    sockaddr_in local{};
    local.sin_family = AF_INET;
    local.sin_addr.s_addr = ip;  // the table prints the address as the host reads the word
    local.sin_port = htons(static_cast<uint16_t>(port));
    found[static_cast<ino_t>(inode)] = local;
  }
  return found;
}

// Still connected: nothing to read yet, and no end of stream.
bool open_and_quiet(int fd) {
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT | MSG_PEEK) < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

// A store that remembers every value put in it (the group erases its
// rendezvous keys once it has formed).
class RecordingStore final : public KvStore {
 public:
  void put(const std::string& key, const std::string& value) override {
    {
      std::lock_guard lock(mu_);
      ever_[key] = value;
    }
    inner_.put(key, value);
  }
  std::optional<std::string> get(const std::string& key) override { return inner_.get(key); }
  std::string wait(const std::string& key, std::chrono::milliseconds timeout) override {
    return inner_.wait(key, timeout);
  }
  void erase(const std::string& key) override { inner_.erase(key); }
  int64_t add(const std::string& key, int64_t delta) override { return inner_.add(key, delta); }
  std::string ever(const std::string& key) {
    std::lock_guard lock(mu_);
    return ever_[key];
  }

 private:
  MemoryKvStore inner_;
  std::mutex mu_;
  std::map<std::string, std::string> ever_;
};

// An abort shuts down its pairs' sockets (gloo would leave an operation
// waiting on them until its timeout), found by their endpoints. The pair
// that dials has an ephemeral port, and Linux gives a connection to
// elsewhere the same local port: a process's connection to its head could
// share it, and was shut down with the group when only the local address
// was compared (a trainer whose peer died then "lost the head" and exited
// instead of healing the peer). The pair that waits has its listening
// port, which another connection may get once the pair's closed: it is
// known by both ends too.
TEST(GlooConnectTest, AnAbortLeavesAConnectionSharingAPairsPortAlone) {
  // Another service, and connections to it from each pair's local address
  // (what the kernel may hand out on its own).
  Fd service(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in service_addr = loopback("127.0.0.1", 0);
  socklen_t len = sizeof service_addr;
  ASSERT_EQ(::bind(service.get(), reinterpret_cast<sockaddr*>(&service_addr), sizeof service_addr), 0);
  ASSERT_EQ(::listen(service.get(), 16), 0);
  ASSERT_EQ(::getsockname(service.get(), reinterpret_cast<sockaddr*>(&service_addr), &len), 0);

  RecordingStore kv;
  GlooGroupOptions opts;
  opts.bind_host = "127.0.0.1";
  opts.rendezvous_timeout = 30s;
  std::unique_ptr<GlooGroup> zero, one;
  struct Sharing {
    std::unique_ptr<Fd> fd;
    std::string endpoint;
    const char* pair;  // "dialing" or "waiting"
  };
  std::vector<Sharing> sharing;
  // bind() refuses a port now and then (a connection of an earlier test in
  // TIME_WAIT on it, which connect() may share): form the group again.
  for (int attempt = 1; attempt <= 10 && sharing.size() != 2; ++attempt) {
    sharing.clear();
    zero.reset();
    one.reset();
    const auto before = connected_sockets();
    const std::string name = "ports-" + std::to_string(attempt);
    std::string one_error;
    std::thread t([&] {
      try {
        one = GlooGroup::create(kv, name, 1, 1, 2, opts);
      } catch (const std::exception& e) {
        one_error = e.what();
      }
    });
    zero = GlooGroup::create(kv, name, 1, 0, 2, opts);
    t.join();
    ASSERT_TRUE(one) << one_error;
    // The ports the two pairs listened on (what each rank advertised).
    std::vector<uint16_t> listened;
    for (const char* rank : {"0", "1"}) {
      const std::string bytes = kv.ever(KvGlooStore::key_prefix(name, 1) + rank);
      ASSERT_FALSE(bytes.empty()) << "rank " << rank << " advertised no address";
      const auto addr = gloo::transport::tcp::Address(std::vector<char>(bytes.begin(), bytes.end())).getSockaddr();
      listened.push_back(ntohs(reinterpret_cast<const sockaddr_in&>(addr).sin_port));
    }
    int dialing = 0, waiting = 0;
    for (const auto& [inode, local] : connected_sockets()) {
      if (before.count(inode) != 0) continue;
      const bool waits = std::find(listened.begin(), listened.end(), ntohs(local.sin_port)) != listened.end();
      ++(waits ? waiting : dialing);
      auto fd = std::make_unique<Fd>(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
      const int on = 1;
      ::setsockopt(fd->get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
      sockaddr_in at = local;
      if (::bind(fd->get(), reinterpret_cast<sockaddr*>(&at), sizeof at) != 0) {
        std::fprintf(stderr, "attempt %d: bind to %s: %s\n", attempt, endpoint(local).c_str(), std::strerror(errno));
        continue;
      }
      ASSERT_EQ(::connect(fd->get(), reinterpret_cast<sockaddr*>(&service_addr), sizeof service_addr), 0)
          << std::strerror(errno);
      sharing.push_back({std::move(fd), endpoint(local), waits ? "waiting" : "dialing"});
    }
    ASSERT_EQ(dialing, 1) << "the dialing pair's socket was not found";
    ASSERT_EQ(waiting, 1) << "the waiting pair's socket was not found";
  }
  ASSERT_EQ(sharing.size(), 2u) << "no connection could take both pairs' local addresses";
  for (const auto& c : sharing) ASSERT_TRUE(open_and_quiet(c.fd->get())) << c.pair;

  float x = 1;
  auto waiting = zero->allreduce(&x, 1, DType::kFloat32);  // rank 1 never joins it
  zero->abort("the test aborts");
  one->abort("the test aborts");
  EXPECT_THROW(waiting->wait(test::kWaitBound), Aborted);
  for (const auto& c : sharing)
    EXPECT_TRUE(open_and_quiet(c.fd->get()))
        << "the connection from " << c.endpoint << " (the " << c.pair << " pair's local address) was shut down";
}

}  // namespace
}  // namespace troupe::collective
