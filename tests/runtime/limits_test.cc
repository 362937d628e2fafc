// What a connection may cost the process it reaches (issue 12, items 1 and
// 6): unauthenticated storms against the head, a worker and a stream
// listener; fd exhaustion; huge frame announcements; a pipelining client; a
// peer that never reads. Memory is read from /proc/PID/status of the target
// process, with bounds generous for a loaded machine but far below what a
// 256 KiB buffer per connection or a zero-filled announcement would cost.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "tests/support/process.h"
#include "tests/support/raw_client.h"
#include "tests/support/wait.h"
#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/client/stream.h"
#include "troupe/runtime/head/head.h"
#include "troupe/runtime/testing/local_cluster.h"
#include "troupe/runtime/wire/connection.h"
#include "troupe/runtime/wire/protocol.h"

using namespace std::chrono_literals;
using troupe::test::kWaitBound;

class Holder {
 public:
  int pid() { return getpid(); }
  std::string open_stream() {
    reader_ = std::make_unique<troupe::StreamReader<int>>(troupe::this_actor::runtime(), 4);
    ref_ = reader_->ref();
    return ref_.address + "#" + std::to_string(ref_.id);
  }
  int read_one() { return *reader_->read(30s); }
  void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }
  troupe::Buffer bytes(int64_t n) {
    std::byte* p = nullptr;
    auto b = troupe::Buffer::allocate(static_cast<size_t>(n), &p);
    std::memset(p, 7, static_cast<size_t>(n));
    return b;
  }

 private:
  std::unique_ptr<troupe::StreamReader<int>> reader_;
  troupe::StreamRef ref_;
};
TROUPE_ACTOR(Holder, &Holder::pid, &Holder::open_stream, &Holder::read_one, &Holder::sleep_ms, &Holder::bytes)

namespace {

using troupe::test::eventually;
using troupe::test::RawClient;
using troupe::testing::LocalCluster;
using namespace troupe::wire;

// A field of /proc/PID/status in KiB (VmRSS, VmSize).
long proc_kb(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  return -1;
}

// User + system CPU seconds the process has used.
double cpu_seconds(pid_t pid) {
  std::string all = troupe::test::read_proc_file("/proc/" + std::to_string(pid) + "/stat");
  std::istringstream rest(all.substr(all.rfind(')') + 2));
  std::string f;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> f; ++i) {
    if (i == 14) utime = std::stoull(f);
    if (i == 15) stime = std::stoull(f);
  }
  return double(utime + stime) / double(sysconf(_SC_CLK_TCK));
}

// A plain blocking TCP connection (no io_context: a storm opens hundreds).
int open_socket(const std::string& address) {
  auto [host, port] = parse_address(address);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  ::fcntl(fd, F_SETFL, O_NONBLOCK);
  return fd;
}

// N connections that never speak and N that send a partial hello one byte
// at a time and never finish it.
class Storm {
 public:
  Storm(const std::string& address, int n) {
    for (int i = 0; i < n; ++i) {
      idle_.push_back(open_socket(address));
      dribbling_.push_back(open_socket(address));
    }
  }
  ~Storm() {
    for (int fd : idle_) ::close(fd);
    for (int fd : dribbling_) ::close(fd);
  }
  // One more byte of the hello, at most every 200 ms and never all 40.
  void dribble() {
    auto now = std::chrono::steady_clock::now();
    if (now - last_ < 200ms || sent_ >= 39) return;
    last_ = now;
    char b = sent_ < 8 ? kAuthMagic[sent_] : 'n';
    for (int fd : dribbling_) ::send(fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    ++sent_;
  }
  // Connections the server has not closed yet.
  size_t open_count() {
    size_t open = 0;
    for (auto* v : {&idle_, &dribbling_})
      for (int fd : *v)
        if (fd >= 0 && still_open(fd)) ++open;
    return open;
  }
  size_t size() const { return idle_.size() + dribbling_.size(); }

 private:
  static bool still_open(int fd) {
    char buf[256];
    for (;;) {
      ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n > 0) continue;  // the server's hello
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
  }
  std::vector<int> idle_, dribbling_;
  std::chrono::steady_clock::time_point last_{};
  int sent_ = 0;
};

// Calls `step` every 50 ms for `d` (a storm is paced by the clock, not
// waiting for anything).
void for_duration(std::chrono::milliseconds d, const std::function<void()>& step) {
  auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) {
    step();
    std::this_thread::sleep_for(50ms);
  }
}

constexpr int kStormSize = 300;           // idle + dribbling = 600 connections
constexpr long kStormBoundKb = 48 << 10;  // 600 × 256 KiB would be 150 MiB

// Runs a storm against `address` (served by process `target`): while it
// lasts `serves` must succeed and RSS stays bounded; every storm connection
// is then closed by the server (deadline or cap) and RSS stays bounded.
void storm_against(pid_t target, const std::string& address, const std::function<void()>& serves) {
  long before = proc_kb(target, "VmRSS");
  Storm storm(address, kStormSize);
  long peak = before;
  for_duration(2s, [&] {
    storm.dribble();
    peak = std::max(peak, proc_kb(target, "VmRSS"));
  });
  serves();
  peak = std::max(peak, proc_kb(target, "VmRSS"));
  EXPECT_LT(peak - before, kStormBoundKb) << "RSS " << before << " KiB before, " << peak << " KiB during the storm";
  EXPECT_TRUE(eventually(
      [&] {
        storm.dribble();
        return storm.open_count() == 0;
      },
      kWaitBound))
      << storm.open_count() << " of " << storm.size() << " unauthenticated connections still open";
  serves();
  EXPECT_LT(proc_kb(target, "VmRSS") - before, kStormBoundKb);
}

class LimitsTest : public ::testing::Test {
 protected:
  LimitsTest() : cluster_(options()), rt_(cluster_.connect()) {}
  static troupe::testing::LocalClusterOptions options() {
    troupe::testing::LocalClusterOptions o;
    o.nodes = {{{"CPU", 2}}};
    return o;
  }
  // A fresh client answers `status` (new connection, new handshake).
  void status_answers() {
    auto fresh = cluster_.connect();
    auto j = nlohmann::json::parse(fresh.status_json());
    EXPECT_TRUE(j.contains("nodes"));
    EXPECT_TRUE(nlohmann::json::parse(rt_.status_json()).contains("nodes"));
  }
  std::string address_of(uint64_t actor_id) {
    auto status = nlohmann::json::parse(rt_.status_json());
    for (auto& a : status["actors"])
      if (a["id"].get<uint64_t>() == actor_id) return a["address"].get<std::string>();
    return "";
  }
  LocalCluster cluster_;
  troupe::Runtime rt_;
};

TEST_F(LimitsTest, HeadSurvivesIdleAndDribblingConnections) {
  storm_against(cluster_.head_pid(), cluster_.address(), [&] { status_answers(); });
}

TEST_F(LimitsTest, WorkerSurvivesIdleAndDribblingConnections) {
  auto h = rt_.spawn<Holder>({});
  pid_t pid = h.call(&Holder::pid).get(kWaitBound);
  std::string address = address_of(h.id());
  ASSERT_FALSE(address.empty());
  storm_against(pid, address, [&] { EXPECT_EQ(h.call(&Holder::pid).get(kWaitBound), pid); });
}

TEST_F(LimitsTest, StreamListenerSurvivesIdleAndDribblingConnections) {
  auto h = rt_.spawn<Holder>({});
  pid_t pid = h.call(&Holder::pid).get(kWaitBound);
  // A fresh stream each time: a reader whose writer has gone reports that
  // (racing the next writer's items), so streams are not reused. Every
  // stream of the process has the same listener address.
  auto open = [&] {
    std::string ref = h.call(&Holder::open_stream).get(kWaitBound);
    return troupe::StreamRef{ref.substr(0, ref.find('#')), std::stoull(ref.substr(ref.find('#') + 1))};
  };
  const std::string address = open().address;
  int next = 0;
  storm_against(pid, address, [&] {
    // A writer still connects and its items arrive.
    troupe::StreamWriter<int> w(rt_, open());
    w.write(++next);
    EXPECT_EQ(h.call(&Holder::read_one).get(kWaitBound), next);
  });
}

// A connection that authenticates and then says nothing is closed after
// the head's hello_timeout (here 300 ms; 30 s by default): 20,000 of them
// held a descriptor each and locked every client out. A client that said
// hello, older than that, is kept.
TEST(HeadHello, AConnectionThatAuthenticatesAndSaysNoHelloIsClosed) {
  troupe::head::HeadOptions o;
  o.token = "hello-token";
  o.hello_timeout = 300ms;
  troupe::head::Head head(o);
  head.start();
  troupe::InitOptions io;
  io.address = head.address();
  io.token = o.token;
  troupe::Runtime rt = troupe::Runtime::connect(io);
  RawClient silent(head.address());
  ASSERT_TRUE(silent.handshake(o.token));
  EXPECT_TRUE(silent.closed_by_peer(kWaitBound));
  EXPECT_TRUE(nlohmann::json::parse(rt.status_json()).contains("nodes"));  // its connection is older still
}

// The head with few descriptors: a storm exhausts them; the listener pauses
// accepting instead of spinning, and serves again once the storm is gone.
TEST(LimitsFd, HeadOutOfDescriptorsBacksOffAndServesAfterwards) {
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = 128;  // inherited by the head and node started now
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  troupe::testing::LocalClusterOptions o;
  o.nodes = {{{"CPU", 1}}};
  std::unique_ptr<LocalCluster> cluster;
  try {
    cluster = std::make_unique<LocalCluster>(o);
  } catch (...) {
    setrlimit(RLIMIT_NOFILE, &old);
    throw;
  }
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  auto rt = cluster->connect();
  pid_t head = cluster->head_pid();
  {
    Storm storm(cluster->address(), kStormSize);  // 600 > 128: the head runs out
    double cpu0 = cpu_seconds(head);
    auto t0 = std::chrono::steady_clock::now();
    for_duration(3s, [] {});
    double cpu = cpu_seconds(head) - cpu0;
    double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // A listener re-arming at once after EMFILE keeps a core busy.
    EXPECT_LT(cpu, 0.5 * wall) << "head used " << cpu << " s of CPU in " << wall << " s out of descriptors";
    // Connections made before the storm keep working.
    EXPECT_TRUE(nlohmann::json::parse(rt.status_json()).contains("nodes"));
  }
  // After the storm a new client gets in.
  auto fresh = cluster->connect();
  EXPECT_TRUE(nlohmann::json::parse(fresh.status_json()).contains("nodes"));
}

// A frame for the head with the message size patched to `message_bytes`.
std::vector<std::byte> header_only(uint32_t message_bytes, uint32_t attachments = 0) {
  std::vector<std::byte> h(kFrameHeaderBytes);
  uint32_t v[4] = {kFrameMagic, message_bytes, attachments, 0};
  std::memcpy(h.data(), v, sizeof(v));
  return h;
}

TEST_F(LimitsTest, HugeFrameAnnouncementsDoNotGrowTheHeadOrWorker) {
  pid_t head = cluster_.head_pid();
  long before = proc_kb(head, "VmRSS");
  // Beyond the head's frame limits: refused at once.
  RawClient too_big(cluster_.address());
  ASSERT_TRUE(too_big.handshake(cluster_.token()));
  auto h64 = header_only(64u << 20);
  too_big.write(h64.data(), h64.size());
  EXPECT_TRUE(too_big.closed_by_peer(kWaitBound));
  // Within them (12 MiB each), announced and never sent: nothing committed.
  std::vector<std::unique_ptr<RawClient>> stalled;
  for (int i = 0; i < 20; ++i) {
    stalled.push_back(std::make_unique<RawClient>(cluster_.address()));
    ASSERT_TRUE(stalled.back()->handshake(cluster_.token()));
    auto h = header_only(12u << 20);
    stalled.back()->write(h.data(), h.size());
  }
  status_answers();
  EXPECT_FALSE(eventually([&] { return proc_kb(head, "VmRSS") - before >= (48l << 10); }, 3s))
      << "20 × 12 MiB announced: RSS " << before << " KiB before, " << proc_kb(head, "VmRSS") << " KiB after";

  // A worker: a call announcing a ~4 GiB attachment, a few bytes sent.
  auto h = rt_.spawn<Holder>({});
  pid_t worker = h.call(&Holder::pid).get(kWaitBound);
  std::string address = address_of(h.id());
  long vm_before = proc_kb(worker, "VmSize");
  long rss_before = proc_kb(worker, "VmRSS");
  Message call;
  call.kind = Kind::CALL;
  call.id = 1;
  call.attachments.push_back(troupe::Buffer::from_string(std::string(16, 'a')));
  OutFrame f = encode_frame(call);
  uint64_t huge = (4ull << 30) - 4096;
  std::memcpy(f.head.data() + kFrameHeaderBytes, &huge, 8);
  std::vector<std::unique_ptr<RawClient>> announcers;
  std::string some(1000, 'b');
  for (int i = 0; i < 4; ++i) {
    announcers.push_back(std::make_unique<RawClient>(address));
    ASSERT_TRUE(announcers.back()->handshake(cluster_.token()));
    announcers.back()->write(f.head.data(), f.head.size());
    announcers.back()->write(some.data(), some.size());
  }
  EXPECT_EQ(h.call(&Holder::pid).get(kWaitBound), worker);
  EXPECT_FALSE(eventually([&] { return proc_kb(worker, "VmSize") - vm_before >= (1l << 20); }, 3s))
      << "4 × 4 GiB announced: address space reserved";
  EXPECT_LT(proc_kb(worker, "VmRSS") - rss_before, 48l << 10);
}

// One client pipelines thousands of requests (and reads the replies); a
// second client's request is still answered.
// A caller that reads is never dropped for the size of the replies it
// asked for: calls pipelined behind a slow one are read in one batch by
// an in-order actor, whose replies wait for the batch's end; past 256 MiB
// the worker dropped the caller as "not reading", and every call in flight
// failed as if the actor had died (with retries, they ran again).
TEST_F(LimitsTest, RepliesAddingUpPastTheWriteBoundReachACallerThatReads) {
  auto h = rt_.spawn<Holder>({});
  ASSERT_TRUE(h.wait_ready(kWaitBound));
  auto slow = h.call(&Holder::sleep_ms, 300);
  std::vector<troupe::Future<troupe::Buffer>> replies;
  for (int i = 0; i < 40; ++i) replies.push_back(h.call(&Holder::bytes, int64_t{8} << 20));
  slow.get(kWaitBound);
  for (auto& r : replies) EXPECT_EQ(r.get(kWaitBound).size(), size_t{8} << 20);
}

TEST_F(LimitsTest, PipeliningClientDoesNotStarveAnother) {
  RawClient flood(cluster_.address());
  ASSERT_TRUE(flood.handshake(cluster_.token()));
  std::vector<std::byte> bytes;
  for (uint64_t i = 1; i <= 20000; ++i) {
    Message m;
    m.kind = Kind::REQUEST;
    m.id = i;
    m.op = static_cast<uint32_t>(Op::kStatus);
    OutFrame f = encode_frame(m);
    bytes.insert(bytes.end(), f.head.begin(), f.head.end());
  }
  std::atomic<bool> stop{false};
  std::thread drain([&] {
    std::vector<char> buf(1 << 16);
    while (!stop && flood.read_some(buf.data(), buf.size()) > 0) {
    }
  });
  std::thread writer([&] { flood.write(bytes.data(), bytes.size()); });
  auto fresh = cluster_.connect();
  EXPECT_TRUE(nlohmann::json::parse(fresh.status_json()).contains("nodes"));
  writer.join();
  stop = true;
  flood.shutdown();
  drain.join();
}

// A peer that never reads: what is queued for it passes the bound and the
// connection is dropped with a reason that says so.
TEST(ConnectionLimits, PeerThatDoesNotReadIsDroppedPastTheWriteBound) {
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  ListenerOptions lo;
  lo.connection.max_queued_bytes = 1 << 20;
  std::promise<std::string> closed;
  std::shared_ptr<Connection> server;
  std::atomic<bool> ready{false};
  Listener listener(io, "127.0.0.1", 0, "token", lo, [&](std::shared_ptr<Connection> c) {
    server = c;
    c->start([&] { ready = true; }, [](Message&&) {}, [&](const std::string& why) { closed.set_value(why); });
  });
  std::thread loop([&] { io.run(); });
  RawClient client("127.0.0.1:" + std::to_string(listener.port()));
  ASSERT_TRUE(client.handshake("token"));
  ASSERT_TRUE(eventually([&] { return ready.load(); }));
  Message m;
  m.kind = Kind::EVENT;
  m.body = std::string(64 << 10, 'x');
  auto done = closed.get_future();
  for (int i = 0; i < 4000 && done.wait_for(0s) != std::future_status::ready; ++i) server->send(m);
  ASSERT_EQ(done.wait_for(kWaitBound), std::future_status::ready);
  std::string why = done.get();
  EXPECT_NE(why.find("does not read"), std::string::npos) << why;
  EXPECT_NE(why.find(std::to_string(1 << 20)), std::string::npos) << why;
  asio::post(io, [&] { listener.close(); });
  guard.reset();
  io.stop();
  loop.join();
}

// What Connection::connect's callback says of a peer on loopback that
// `serve` handles (on the I/O thread, with the accepted socket, which stays
// open until the end); "connected" if it connected, "no answer" if it
// said nothing within kWaitBound.
std::string connect_error(const std::function<void(asio::ip::tcp::socket&)>& serve) {
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  asio::ip::tcp::acceptor acceptor(io, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  const uint16_t port = acceptor.local_endpoint().port();
  std::optional<asio::ip::tcp::socket> peer;
  acceptor.async_accept([&](asio::error_code ec, asio::ip::tcp::socket s) {
    if (ec) return;
    peer.emplace(std::move(s));
    serve(*peer);
  });
  std::thread loop([&] { io.run(); });
  std::promise<std::string> answered;
  asio::post(io, [&] {
    Connection::connect(
        io, "127.0.0.1", port, "token", troupe::wire::FrameLimits{}, [](Message&&) {}, [](const std::string&) {},
        [&](std::shared_ptr<Connection> c, std::string error) { answered.set_value(c ? "connected" : error); });
  });
  auto done = answered.get_future();
  const std::string why = done.wait_for(kWaitBound) == std::future_status::ready ? done.get() : "no answer";
  guard.reset();
  io.stop();
  loop.join();
  return why;
}

// A peer that accepts and closes before its handshake: the connecting side
// says the peer went away, not that it was a port check (what the accepting
// side says of a client that connects and sends nothing).
TEST(ConnectionLimits, APeerClosingBeforeItsHandshakeIsNamedOnTheConnectingSide) {
  const std::string why = connect_error([](asio::ip::tcp::socket& s) { s.close(); });
  EXPECT_NE(why.find("closed the connection before its handshake"), std::string::npos) << why;
  EXPECT_EQ(why.find("port check"), std::string::npos) << why;
}

// A client that sends its hello and leaves before its proof (a process that
// exited while connecting) is not called a wrong token on the accepting
// side: the connecting side proves first whatever its token. Before, the
// listener warned of a wrong cluster token when a worker ended mid-connect.
TEST(ConnectionLimits, AClientLeavingBeforeItsProofIsNotCalledAWrongToken) {
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  std::promise<std::string> closed;
  Listener listener(io, "127.0.0.1", 0, "token", ListenerOptions{}, [&](std::shared_ptr<Connection> c) {
    c->start([] {}, [](Message&&) {}, [&](const std::string& why) { closed.set_value(why); });
  });
  std::thread loop([&] { io.run(); });
  {
    RawClient client("127.0.0.1:" + std::to_string(listener.port()));
    std::array<uint8_t, 40> hello{};
    std::memcpy(hello.data(), troupe::wire::kAuthMagic, 8);
    client.write(hello.data(), hello.size());
    std::array<uint8_t, 40> theirs{};
    size_t got = 0;
    while (got < theirs.size()) {
      const size_t n = client.read_some(theirs.data() + got, theirs.size() - got);
      ASSERT_GT(n, 0u) << "the listener closed before its hello";
      got += n;
    }
  }  // closes before its proof
  auto done = closed.get_future();
  ASSERT_EQ(done.wait_for(kWaitBound), std::future_status::ready);
  const std::string why = done.get();
  EXPECT_NE(why.find("before proving its token (it exited or gave up while connecting)"), std::string::npos) << why;
  EXPECT_EQ(why.find("wrong"), std::string::npos) << why;
  asio::post(io, [&] { listener.close(); });
  guard.reset();
  io.stop();
  loop.join();
}

// A peer of another troupe version is refused at the handshake, naming both
// wire versions: before, processes of two versions connected and failed on
// the first message one of them could not decode.
TEST(ConnectionLimits, APeerOfAnotherWireVersionIsRefusedNamingBoth) {
  std::string older(troupe::wire::kAuthMagic, 7);
  older += '1';
  older += std::string(troupe::wire::kNonceBytes, 'n');
  const std::string why = connect_error([&](asio::ip::tcp::socket& s) {
    asio::error_code ec;
    asio::write(s, asio::buffer(older), ec);
  });
  EXPECT_NE(
      why.find(std::string("peer speaks troupe wire version 1, this process version ") + troupe::wire::kWireVersion),
      std::string::npos)
      << why;
}

}  // namespace
