#include "troupe/runtime/collective/gloo_group.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "troupe/runtime/collective/completion_work.h"
#include "troupe/runtime/collective/kv_gloo_store.h"
#include "troupe/runtime/collective/reduce.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"

namespace troupe::collective {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Slot prefixes of gloo's own collectives are 0x01..0x08; these stay clear.
constexpr uint8_t kP2pSlotPrefix = 0x71;
constexpr uint8_t kReduceScatterSlotPrefix = 0x72;
constexpr uint8_t kP2pHeaderSlotPrefix = 0x73;
constexpr uint8_t kCheckSlotPrefix = 0x74;

// What a member was asked to do, as the agreement check compares it
// (GlooGroupOptions::check_agreement). Fixed-size and padding-free: the
// members allgather it byte for byte.
enum class CallKind : uint32_t { kAllreduce = 1, kBroadcast, kAllgather, kReduceScatter, kBarrier };
struct Call {
  CallKind kind = CallKind::kBarrier;
  uint32_t dtype = 0;
  uint64_t count = 0;
  int64_t arg = 0;  // the root of a broadcast, the ReduceOp of a reduction
  bool operator==(const Call&) const = default;
};
static_assert(sizeof(Call) == 24);

// The header a checked send puts ahead of its data: what the receive must
// expect. `bytes` sizes the scratch a disagreeing receive drops them into.
struct P2pHeader {
  uint64_t count = 0;
  uint64_t bytes = 0;
  uint32_t dtype = 0;
  uint32_t zero = 0;
};
static_assert(sizeof(P2pHeader) == 24);

std::string describe_call(const Call& c) {
  const auto dtype = static_cast<DType>(c.dtype);
  const std::string of = " of " + std::to_string(c.count) + " " + to_string(dtype);
  const auto op = static_cast<ReduceOp>(c.arg);
  switch (c.kind) {
    case CallKind::kAllreduce:
      return "allreduce" + of + " (" + to_string(op) + ")";
    case CallKind::kBroadcast:
      return "broadcast" + of + " from rank " + std::to_string(c.arg);
    case CallKind::kAllgather:
      return "allgather" + of;
    case CallKind::kReduceScatter:
      return "reduce_scatter" + of + " per rank (" + to_string(op) + ")";
    case CallKind::kBarrier:
      return "barrier";
  }
  return "operation #" + std::to_string(static_cast<uint32_t>(c.kind));
}

// Thrown on every member alike when the agreement check finds their calls
// differ: the operation fails with ConfigError and the group stays usable.
class Disagreement : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Calls f with a value of the C++ type that carries dtype's bytes (16-bit
// floats travel as uint16_t: only reductions care about their meaning).
template <class F>
void with_storage_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat64:
      return f(double{});
    case DType::kInt32:
      return f(int32_t{});
    case DType::kInt64:
      return f(int64_t{});
    case DType::kBFloat16:
    case DType::kFloat16:
      return f(uint16_t{});
    case DType::kUInt8:
      return f(uint8_t{});
  }
  throw ConfigError("unknown dtype");
}

// Creates the TCP device so that its event-loop thread runs under
// SCHED_BATCH. gloo's loop thread only try-locks a pair when its socket is
// readable (Pair::handleEvents) and epoll is level-triggered, so when it
// wakes up and preempts the operation thread while that thread holds the
// pair's mutex (inside Pair::send, writing to the socket), it spins on
// epoll_wait for a whole time slice before the holder can run again: a few
// milliseconds per operation whenever the ranks share busy cores. A
// SCHED_BATCH thread does not preempt on wake-up, so the holder finishes
// first. Threads inherit the policy of their creator, hence the helper
// thread. Unprivileged; if it fails, the device is created as usual.
std::shared_ptr<gloo::transport::Device> create_tcp_device(const gloo::transport::tcp::attr& attr) {
  std::shared_ptr<gloo::transport::Device> device;
  std::exception_ptr error;
  std::thread creator([&] {
    sched_param param{};
    (void)::sched_setscheduler(0, SCHED_BATCH, &param);
    try {
      device = gloo::transport::tcp::CreateDevice(attr);
    } catch (...) {
      error = std::current_exception();
    }
  });
  creator.join();
  if (error) std::rethrow_exception(error);
  return device;
}

milliseconds left_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  return std::max(left, milliseconds(1));
}

// Waits until every rank has put its key under `members`; a rank that never
// arrives is named by number. Ranks below the one that timed out were seen
// (a rank that gave up first has erased its key by now: it is not missing).
void wait_for_members(KvStore& kv, const std::string& members, int world_size, Clock::time_point deadline,
                      const std::string& where, const GlooGroupOptions& options) {
  for (int r = 0; r < world_size; ++r) {
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    try {
      kv.wait(members + std::to_string(r), std::max(left, milliseconds(0)));
    } catch (const Timeout&) {
      std::string missing = std::to_string(r);
      for (int m = r + 1; m < world_size; ++m) {
        if (!kv.get(members + std::to_string(m))) missing += ", " + std::to_string(m);
      }
      throw Timeout("rendezvous of " + where + " timed out after " +
                    std::to_string(options.rendezvous_timeout.count()) + " ms: rank(s) " + missing +
                    " never arrived (keys '" + members + "<rank>')");
    }
  }
}

// "10.1.2.3:41234" ("[::1]:41234"). gloo's Address::str() prints the port
// in network byte order.
std::string endpoint_text(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(ss);
    ::inet_ntop(AF_INET, &in.sin_addr, host, sizeof host);
    return std::string(host) + ":" + std::to_string(ntohs(in.sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(ss);
    ::inet_ntop(AF_INET6, &in6.sin6_addr, host, sizeof host);
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(in6.sin6_port));
  }
  return "an address of family " + std::to_string(ss.ss_family);
}

// The host alone ("10.1.2.3"): what names a peer once connected (the
// advertised port is the listening socket the pair no longer uses).
std::string host_text(const sockaddr_storage& ss) {
  std::string text = endpoint_text(ss);
  return text.substr(0, text.rfind(':'));
}

// Whether gloo's Pair::connect dials the peer (its own listening address
// sorts above the peer's, compared as gloo does) or waits for the peer to.
bool pair_dials(const sockaddr_storage& self, const sockaddr_storage& peer) {
  int rv = 0;
  if (self.ss_family == AF_INET && peer.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(self);
    const auto& b = reinterpret_cast<const sockaddr_in&>(peer);
    rv = std::memcmp(&a.sin_addr, &b.sin_addr, sizeof a.sin_addr);
    if (rv == 0) rv = a.sin_port - b.sin_port;
  } else if (self.ss_family == AF_INET6 && peer.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(self);
    const auto& b = reinterpret_cast<const sockaddr_in6&>(peer);
    rv = std::memcmp(&a.sin6_addr, &b.sin6_addr, sizeof a.sin6_addr);
    if (rv == 0) rv = a.sin6_port - b.sin6_port;
  }
  return rv > 0;
}

// `any_address`: a wildcard address in `a` (a peer bound to 0.0.0.0
// advertises it) matches every address of `b`.
bool same_endpoint(const sockaddr_storage& a, const sockaddr_storage& b, bool any_address = false) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port &&
           (x.sin_addr.s_addr == y.sin_addr.s_addr || (any_address && x.sin_addr.s_addr == htonl(INADDR_ANY)));
  }
  if (a.ss_family == AF_INET6) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
    return x.sin6_port == y.sin6_port && (std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof x.sin6_addr) == 0 ||
                                          (any_address && IN6_IS_ADDR_UNSPECIFIED(&x.sin6_addr)));
  }
  return false;
}

// Calls `visit(fd, inode)` for each socket of this process until it
// returns true. gloo's device thread may close a descriptor at any moment
// and its number be reused: `fd` is a duplicate, which no one else can
// close (a shutdown through it acts on the socket itself).
template <class Visit>
void for_each_socket(Visit&& visit) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return;
  while (dirent* entry = ::readdir(dir)) {
    char* end = nullptr;
    long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == ::dirfd(dir)) continue;
    const int dup = ::fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 0);
    if (dup < 0) continue;
    struct stat st {};
    const bool stop = ::fstat(dup, &st) == 0 && S_ISSOCK(st.st_mode) && visit(dup, st.st_ino);
    ::close(dup);
    if (stop) break;
  }
  ::closedir(dir);
}

// A connected socket's two ends; false for any other descriptor.
bool socket_ends(int fd, sockaddr_storage& local, sockaddr_storage& peer) {
  socklen_t len = sizeof local;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) return false;
  socklen_t peer_len = sizeof peer;
  return ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) == 0;
}

// The remote end of the connection that a pair which waited for its peer
// accepted on `local` (its listening address), while that connection is
// open: the only connected socket there then (the kernel gives no
// connect() a port that a socket bound explicitly; the peer's source
// address need not be the one it advertised, on a host with several).
// AF_UNIX, which matches no socket, when there is none: the connection
// closed already.
sockaddr_storage accepted_from(const sockaddr_storage& local) {
  sockaddr_storage found{};
  found.ss_family = AF_UNIX;
  for_each_socket([&](int fd, ino_t) {
    sockaddr_storage here{}, there{};
    if (!socket_ends(fd, here, there) || !same_endpoint(local, here, /*any_address=*/true)) return false;
    found = there;
    return true;
  });
  return found;
}

// A rendezvous context whose full mesh GlooGroup connects itself
// (connect_mesh) instead of through connectFullMesh.
class MeshContext final : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;

  void adopt(std::shared_ptr<gloo::transport::Device> device, std::shared_ptr<gloo::transport::Context> pairs) {
    device_ = std::move(device);
    transportContext_ = std::move(pairs);
  }
};

// Closes every pair of `context` at `deadline`, or as soon as `abandoned`
// gives a reason, unless destroyed first. gloo's Pair::connect waits five
// times the pair's timeout for the connection, and a dialing pair whose
// SYNs are dropped (a peer address that black-holes packets) stays in
// SYN_SENT for the kernel's retries (about two minutes) before the
// connection fails. Closing the pair wakes that wait at once: connect()
// returns (the pair CLOSED) or, when the close came first, throws; either
// way fired() tells, and abandoned_for() why when it was not the deadline.
class ConnectWatchdog {
 public:
  ConnectWatchdog(gloo::Context& context, Clock::time_point deadline, std::function<std::string()> abandoned)
      : abandoned_(std::move(abandoned)), thread_([this, &context, deadline] { watch(context, deadline); }) {}
  ~ConnectWatchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  ConnectWatchdog(const ConnectWatchdog&) = delete;
  ConnectWatchdog& operator=(const ConnectWatchdog&) = delete;

  bool fired() const { return fired_; }
  // Why it fired before the deadline; "" when it fired at the deadline.
  // Read only once fired() is true.
  const std::string& abandoned_for() const { return reason_; }

  // Stops the watchdog; false when it fired (the pairs are closed).
  bool disarm() {
    std::lock_guard lock(mu_);
    done_ = true;
    return !fired_;
  }

 private:
  void watch(gloo::Context& context, Clock::time_point deadline) {
    {
      std::unique_lock lock(mu_);
      for (;;) {
        const auto until = abandoned_ ? std::min(deadline, Clock::now() + kAbandonPoll) : deadline;
        if (cv_.wait_until(lock, until, [&] { return done_; })) return;
        if (Clock::now() >= deadline) break;
        lock.unlock();
        std::string why = abandoned_();
        lock.lock();
        if (done_) return;
        if (!why.empty()) {
          reason_ = std::move(why);
          break;
        }
      }
      fired_ = true;
    }
    for (int i = 0; i < context.size; ++i) {
      if (i == context.rank) continue;
      try {
        if (auto& pair = context.getPair(i)) pair->close();
      } catch (...) {
      }
    }
  }

  static constexpr milliseconds kAbandonPoll{100};

  std::function<std::string()> abandoned_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string reason_;  // written before fired_
  std::atomic<bool> fired_{false};
  std::thread thread_;  // last: starts once the members above exist
};

// Connects this rank's pair to `peer`, whose advertised address is
// `bytes`; a failure names the peer, its address and who dials.
void connect_pair(gloo::Context& context, int peer, const std::vector<char>& bytes, const ConnectWatchdog& watchdog,
                  milliseconds rendezvous_timeout) {
  auto& pair = context.getPair(peer);
  std::string gloo_error;
  if (!watchdog.fired()) {
    try {
      pair->connect(bytes);
    } catch (const std::exception& e) {
      gloo_error = e.what();
    }
  }
  if (!watchdog.fired() && gloo_error.empty()) return;
  const gloo::transport::tcp::Address advertised(bytes);
  const sockaddr_storage& there = advertised.getSockaddr();
  const std::string me = std::to_string(context.rank);
  const std::string them = std::to_string(peer);
  std::string how;
  if (const auto* self = dynamic_cast<const gloo::transport::tcp::Address*>(&pair->address())) {
    how = pair_dials(self->getSockaddr(), there)
              ? " (rank " + me + " dials; its host cannot reach that address, or nothing answers there)"
              : " (rank " + me + " waited for rank " + them + " to connect to " + endpoint_text(self->getSockaddr()) +
                    "; nothing arrived)";
  }
  const std::string what = "rank " + me + " cannot connect to rank " + them + " at " + endpoint_text(there);
  if (watchdog.fired() && !watchdog.abandoned_for().empty()) throw Aborted(what + ": " + watchdog.abandoned_for());
  if (watchdog.fired()) throw Timeout(what + " within " + std::to_string(rendezvous_timeout.count()) + " ms" + how);
  throw Error(what + ": gloo: " + gloo_error + how);
}

// gloo's connectFullMesh, bounded by `deadline`: creates a pair per peer,
// publishes their addresses under "<rank>", then connects the pairs in rank
// order while a watchdog closes them at the deadline. Records each peer's
// host in `peer_hosts`, and in `remote_ends` the remote end of each pair's
// connection: the address this rank dialed, or where the connection that
// it accepted came from (AF_UNIX when that closed already).
void connect_mesh(MeshContext& context, KvGlooStore& store, const std::shared_ptr<gloo::transport::Device>& device,
                  Clock::time_point deadline, const GlooGroupOptions& options, std::vector<std::string>& peer_hosts,
                  std::vector<sockaddr_storage>& remote_ends) {
  const milliseconds rendezvous_timeout = options.rendezvous_timeout;
  const int rank = context.rank;
  const int size = context.size;
  auto pairs = device->createContext(rank, size);
  pairs->setTimeout(left_until(deadline));
  std::vector<char> mine;
  for (int i = 0; i < size; ++i) {
    if (i == rank) continue;
    auto bytes = pairs->createPair(i)->address().bytes();
    mine.insert(mine.end(), bytes.begin(), bytes.end());
  }
  context.adopt(device, std::move(pairs));
  store.set(std::to_string(rank), mine);
  peer_hosts.assign(static_cast<size_t>(size), std::string());
  remote_ends.assign(static_cast<size_t>(size), sockaddr_storage{});
  ConnectWatchdog watchdog(context, deadline, options.abandoned);
  for (int i = 0; i < size; ++i) {
    if (i == rank) continue;
    store.wait({std::to_string(i)}, left_until(deadline));
    const auto all = store.get(std::to_string(i));
    // Rank i published one address per peer but itself, in rank order.
    const size_t width = all.size() / static_cast<size_t>(size - 1);
    const size_t slot = static_cast<size_t>(rank > i ? rank - 1 : rank);
    const std::vector<char> bytes(all.begin() + static_cast<std::ptrdiff_t>(slot * width),
                                  all.begin() + static_cast<std::ptrdiff_t>((slot + 1) * width));
    const sockaddr_storage there = gloo::transport::tcp::Address(bytes).getSockaddr();
    peer_hosts[static_cast<size_t>(i)] = host_text(there);
    if (const auto* self = dynamic_cast<const gloo::transport::tcp::Address*>(&context.getPair(i)->address()))
      if (pair_dials(self->getSockaddr(), there)) remote_ends[static_cast<size_t>(i)] = there;
    connect_pair(context, i, bytes, watchdog, rendezvous_timeout);
  }
  if (!watchdog.disarm() && !watchdog.abandoned_for().empty())
    throw Aborted("rank " + std::to_string(rank) + " stopped connecting to its peers: " + watchdog.abandoned_for());
  if (watchdog.fired())
    throw Timeout("rank " + std::to_string(rank) + " connected to its peers only at the deadline (" +
                  std::to_string(rendezvous_timeout.count()) + " ms)");
  // A pair that waited has its listening port, freed once its connection
  // closes and then free for the kernel to give an outgoing connection: its
  // connection is known by both ends too.
  for (int i = 0; i < size; ++i) {
    auto& end = remote_ends[static_cast<size_t>(i)];
    if (i == rank || end.ss_family != AF_UNSPEC) continue;
    if (const auto* self = dynamic_cast<const gloo::transport::tcp::Address*>(&context.getPair(i)->address()))
      end = accepted_from(self->getSockaddr());
  }
}

}  // namespace

// One queued operation: `run` executes on the operation thread and returns
// true when the work is finished (point-to-point posts return false; the
// p2p thread finishes them).
struct QueuedOp {
  std::shared_ptr<CompletionWork> work;
  std::function<bool(const std::shared_ptr<CompletionWork>&)> run;
};

// A posted send or receive waiting for completion. Checked (with the
// agreement check) it travels in two parts: the header, then the data; a
// receive posts the data's receive only once the header has arrived.
struct InflightP2p {
  std::shared_ptr<CompletionWork> work;
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;  // the data; set late on a checked receive
  bool is_send = false;
  milliseconds timeout{0};
  // Checked only: the header's buffer and what it carries (sent, or received).
  std::unique_ptr<gloo::transport::UnboundBuffer> header;
  std::unique_ptr<P2pHeader> header_value;
  // A checked receive's own call, and where its data goes.
  void* data = nullptr;
  uint64_t count = 0;
  DType dtype = DType::kUInt8;
  int peer = -1;
  uint64_t slot = 0;
  std::vector<char> dropped;  // a disagreeing send's bytes land here
};

struct GlooGroup::Shared {
  std::string name;
  int64_t generation = 0;
  int rank = 0;
  int size = 0;
  GlooGroupOptions options;
  // What gloo's device thread may still touch while an operation fails: the
  // operation's gloo options (their unbound buffers) and its scratch
  // memory. Operations allocate them here (hold()), and they are dropped
  // only once the pairs are closed (op_loop), never by the unwinding of a
  // failed operation. Op thread only. Declared before the context and the
  // device, so that when the group goes they go after them.
  std::vector<std::shared_ptr<void>> held;
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> context;
  // The host each peer advertised (connect_mesh); empty for this rank.
  std::vector<std::string> peer_hosts;
  // The remote end of each pair's connection (connect_mesh). See
  // shutdown_sockets.
  std::vector<sockaddr_storage> remote_ends;

  // Lock order: mu before a gloo buffer's lock (abort() calls abortWait*
  // under mu); never hold mu while calling into gloo otherwise.
  mutable std::mutex mu;
  std::condition_variable op_cv;
  std::condition_variable p2p_cv;
  std::condition_variable idle_cv;  // running changed
  std::deque<QueuedOp> queue;
  std::shared_ptr<CompletionWork> running;  // the op inside gloo, if any
  // Posted sends ([0]) and receives ([1]), each waited on in order by a
  // thread of its own (the front is being waited on): a checked receive
  // needs its thread to post the data's receive while the send ahead of it
  // waits for the peer to do the same.
  std::list<InflightP2p> p2p[2];
  bool stopping = false;
  bool aborted = false;
  bool pairs_closed = false;  // by break_group (idle_cv tells)
  std::exception_ptr broken;  // first failure; fails every later op
  uint32_t next_seq = 1;      // collective tags, equal on every rank
  std::thread op_thread;
  std::thread p2p_threads[2];
  std::atomic<bool> op_thread_done{false};
  std::atomic<bool> p2p_thread_done[2]{};

  std::string describe() const {
    return "collective group '" + name + "' generation " + std::to_string(generation) + " (rank " +
           std::to_string(rank) + " of " + std::to_string(size) + ")";
  }

  // What the messages of an operation call it: `what` of this group, and
  // the host of the peer it waits on when that is known (a point-to-point
  // operation's, the one peer of a group of two): gloo's timeouts do not
  // tell which pair was silent.
  std::string op_text(const std::string& what, int peer = -1) const {
    if (peer < 0 && size == 2) peer = 1 - rank;
    std::string note;
    if (peer >= 0 && static_cast<size_t>(peer) < peer_hosts.size() && !peer_hosts[peer].empty())
      note = "; peer rank " + std::to_string(peer) + " on " + peer_hosts[peer];
    return what + " of collective group '" + name + "' generation " + std::to_string(generation) + " (rank " +
           std::to_string(rank) + " of " + std::to_string(size) + note + ")";
  }

  std::exception_ptr aborted_error(const std::string& reason) const {
    return std::make_exception_ptr(Aborted(describe() + " aborted: " + reason));
  }

  template <class T, class... Args>
  T& hold(Args&&... args) {
    auto p = std::make_shared<T>(std::forward<Args>(args)...);
    held.push_back(p);
    return *p;
  }

  // After closeConnections() gloo's device thread touches no buffer of this
  // group's pairs (it handles a pair's events under the pair's lock, which
  // closing takes). Closing first would leave what waits on a pair waiting:
  // gloo's close() fails nothing pending; the end of stream that the
  // shutdown makes its device thread read does. So the device thread gets
  // until abort_settle to read it (it closes the socket when it has).
  void close_pairs() {
    if (context) {
      // Either may throw: a pair that already failed, or a rendezvous that
      // failed before gloo made its pairs. Nothing more to do then.
      try {
        const auto shut = shutdown_sockets();
        const auto settle = Clock::now() + options.abort_settle;
        while (!shut.empty() && any_open(shut) && Clock::now() < settle) std::this_thread::sleep_for(milliseconds(1));
      } catch (...) {
      }
      try {
        context->closeConnections();
      } catch (...) {
      }
    }
    {
      std::lock_guard lock(mu);
      pairs_closed = true;
    }
    idle_cv.notify_all();
  }

  void await_pairs_closed() {
    std::unique_lock lock(mu);
    idle_cv.wait(lock, [&] { return pairs_closed; });
  }

  milliseconds timeout_of(milliseconds requested) const {
    return requested.count() > 0 ? requested : options.op_timeout;
  }

  bool checks() const { return options.check_agreement && size > 1; }
  bool checks_p2p() const { return options.check_point_to_point; }

  // The tag of the next collective, equal on every member.
  uint32_t take_tag() {
    std::lock_guard lock(mu);
    return next_seq++;
  }

  // The agreement check: every member sends its call (24 bytes) to every
  // other before any byte of the operation travels, into receives it
  // posted first. One slot serves every check: gloo matches a peer's
  // messages of a slot in order, so the k-th check meets the k-th on every
  // member whatever each asked for. The buffers are held like any
  // operation's (hold()): none stays posted between operations, since gloo
  // may touch a posted receive until its pair closes. Calls that differ
  // throw Disagreement on every member alike, naming each rank's call; the
  // exchange itself always matches, so the group stays usable. It is a
  // barrier too: no member leaves it before every member has entered.
  void agree(const Call& mine, milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    const uint64_t slot = gloo::Slot::build(kCheckSlotPrefix, 0);
    auto& all = hold<std::vector<Call>>(size);
    all[rank] = mine;
    std::vector<gloo::transport::UnboundBuffer*> receives(size, nullptr);
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      auto& buffer =
          hold<std::unique_ptr<gloo::transport::UnboundBuffer>>(context->createUnboundBuffer(&all[peer], sizeof(Call)));
      buffer->recv(peer, slot);
      receives[peer] = buffer.get();
    }
    auto& send =
        hold<std::unique_ptr<gloo::transport::UnboundBuffer>>(context->createUnboundBuffer(&all[rank], sizeof(Call)));
    for (int peer = 0; peer < size; ++peer) {
      if (peer != rank) send->send(peer, slot);
    }
    for (int peer = 0; peer < size; ++peer) {
      if (peer != rank && !receives[peer]->waitRecv(left_until(deadline))) throw Aborted("agreement check interrupted");
    }
    for (int peer = 0; peer < size - 1; ++peer) {
      if (!send->waitSend(left_until(deadline))) throw Aborted("agreement check interrupted");
    }
    bool same = true;
    for (const auto& c : all) same = same && c == all.front();
    if (same) return;
    std::string text = "the members were asked for different operations, so none ran it (";
    for (int r = 0; r < size; ++r) {
      if (r > 0) text += "; ";
      text += "rank " + std::to_string(r) + ": " + describe_call(all[r]);
    }
    throw Disagreement(text + ")");
  }

  // Enqueues op unless the group is aborted or broken, in which case the
  // work fails at once with that error.
  WorkPtr submit(const std::string& what, std::function<bool(const std::shared_ptr<CompletionWork>&)> run,
                 int peer = -1) {
    auto work = std::make_shared<CompletionWork>(op_text(what, peer));
    std::exception_ptr refuse;
    {
      std::lock_guard lock(mu);
      if (broken) {
        refuse = broken;
      } else {
        queue.push_back(QueuedOp{work, std::move(run)});
      }
    }
    if (refuse) {
      work->fail(refuse);
    } else {
      op_cv.notify_one();
    }
    return work;
  }

  // Work that needs no communication (count 0, world size 1) still honours
  // abort and earlier failures.
  WorkPtr completed(const std::string& what) {
    auto work = std::make_shared<CompletionWork>(op_text(what));
    std::exception_ptr refuse;
    {
      std::lock_guard lock(mu);
      refuse = broken;
    }
    if (refuse) {
      work->fail(refuse);
    } else {
      work->complete();
    }
    return work;
  }

  // Turns whatever an operation threw into troupe's hierarchy, with context.
  std::exception_ptr translate(const std::string& what, std::exception_ptr raw) {
    {
      std::lock_guard lock(mu);
      if (aborted && broken) return broken;
    }
    try {
      std::rethrow_exception(raw);
    } catch (const Aborted&) {
      return std::current_exception();
    } catch (const Timeout&) {
      return std::current_exception();
    } catch (const Error& e) {
      return std::make_exception_ptr(Error(what + " failed: " + e.what()));
    } catch (const gloo::IoException& e) {
      std::string msg = e.what();
      if (msg.find("Timed out") != std::string::npos) {
        return std::make_exception_ptr(Timeout(what + " timed out: gloo: " + msg));
      }
      return std::make_exception_ptr(
          Error(what + " failed: gloo: " + msg + " (a peer's connection closed: a member may have died)"));
    } catch (const std::exception& e) {
      return std::make_exception_ptr(Error(what + " failed: " + e.what()));
    } catch (...) {
      return std::make_exception_ptr(Error(what + " failed with an unknown exception"));
    }
  }

  // Shuts down (without closing) every socket of this group's pairs. gloo's
  // Pair::close() does not wake operations waiting on the pair; a shutdown
  // makes the device thread read EOF, which fails every operation posted on
  // the pair, so the operation thread leaves gloo now rather than at its
  // timeout. gloo does not expose the descriptors: they are found by both
  // their endpoints (connect_mesh recorded the remote ones). The local one
  // alone is not enough: a pair that dialed has an ephemeral port, which
  // Linux also gives connections to elsewhere (the process's connection to
  // its head was shut down with the group, and a trainer whose peer died
  // then "lost the head"), and a pair that waited has its listening port,
  // free again once the pair's connection closed.
  // Returns the sockets' inode numbers.
  std::vector<ino_t> shutdown_sockets() {
    std::vector<ino_t> shut;
    std::vector<std::pair<sockaddr_storage, sockaddr_storage>> ends;  // local, remote (AF_UNSPEC: any)
    for (int i = 0; i < size; ++i) {
      if (i == rank) continue;
      auto& pair = context->getPair(i);
      if (!pair) continue;
      const auto* addr = dynamic_cast<const gloo::transport::tcp::Address*>(&pair->address());
      if (addr == nullptr) continue;
      ends.emplace_back(addr->getSockaddr(), static_cast<size_t>(i) < remote_ends.size()
                                                 ? remote_ends[static_cast<size_t>(i)]
                                                 : sockaddr_storage{});
    }
    if (ends.empty()) return shut;
    for_each_socket([&](int fd, ino_t inode) {
      if (is_pair_socket(fd, ends)) {
        ::shutdown(fd, SHUT_RDWR);
        shut.push_back(inode);
      }
      return false;
    });
    return shut;
  }

  // Whether a socket of `inodes` is still open in this process.
  static bool any_open(const std::vector<ino_t>& inodes) {
    DIR* dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) return false;
    bool found = false;
    char target[64];
    while (dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] == '.') continue;
      const std::string link = std::string("/proc/self/fd/") + entry->d_name;
      const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
      if (n <= 0) continue;
      target[n] = '\0';
      unsigned long long inode = 0;
      if (std::sscanf(target, "socket:[%llu]", &inode) != 1) continue;
      if (std::find(inodes.begin(), inodes.end(), static_cast<ino_t>(inode)) != inodes.end()) {
        found = true;
        break;
      }
    }
    ::closedir(dir);
    return found;
  }

  // A connected socket with the endpoints of one of `ends`.
  static bool is_pair_socket(int fd, const std::vector<std::pair<sockaddr_storage, sockaddr_storage>>& ends) {
    sockaddr_storage local{}, peer{};
    if (!socket_ends(fd, local, peer)) return false;
    for (const auto& [want_local, want_remote] : ends)
      if (same_endpoint(want_local, local) &&
          (want_remote.ss_family == AF_UNSPEC || same_endpoint(want_remote, peer, /*any_address=*/true)))
        return true;
    return false;
  }

  // Marks the group broken by `error` (the first wins; an abort's reason
  // replaces a transport error), and fails everything pending. Order
  // matters for memory the caller passed in: queued operations never
  // touched it and fail first; then the sockets are shut down and the pairs
  // closed, after which gloo's device thread no longer reads or writes user
  // memory, and posted sends/receives fail; the running operation fails
  // when its thread has left gloo, or after abort_settle at the latest (see
  // GlooGroupOptions::abort_settle).
  void break_group(std::exception_ptr error, bool by_abort) {
    std::vector<std::shared_ptr<CompletionWork>> queued;
    std::vector<std::shared_ptr<CompletionWork>> posted;
    std::shared_ptr<CompletionWork> in_gloo;
    {
      std::lock_guard lock(mu);
      if (by_abort) {
        if (aborted) return;
        aborted = true;
        broken = error;
      } else {
        if (broken) return;
        broken = error;
      }
      for (auto& op : queue) queued.push_back(op.work);
      queue.clear();
      in_gloo = running;
      for (auto& lane : p2p) {
        for (auto& p : lane) {
          posted.push_back(p.work);
          // Wakes the p2p thread if it waits on these buffers; sticky otherwise.
          for (auto* buffer : {p.header.get(), p.buffer.get()}) {
            if (buffer == nullptr) continue;
            if (p.is_send) {
              buffer->abortWaitSend();
            } else {
              buffer->abortWaitRecv();
            }
          }
        }
      }
    }
    for (auto& w : queued) w->fail(error);
    op_cv.notify_all();
    p2p_cv.notify_all();
    close_pairs();
    for (auto& w : posted) w->fail(error);
    if (in_gloo && by_abort) {
      std::unique_lock lock(mu);
      idle_cv.wait_for(lock, options.abort_settle, [&] { return running != in_gloo; });
    }
    if (in_gloo) in_gloo->fail(error);
  }

  // A transport failure (not a timeout) is usually a member's death that
  // the runtime is about to report through abort(): wait a little for it,
  // so the pending work fails with the reason instead (abort() fails it).
  void await_explanation(const std::exception_ptr& error) {
    try {
      std::rethrow_exception(error);
    } catch (const Timeout&) {
      return;
    } catch (const Aborted&) {
      return;
    } catch (...) {
    }
    std::unique_lock lock(mu);
    op_cv.wait_for(lock, options.error_grace, [&] { return aborted; });
  }

  // The error a failed operation reports: abort()'s, once aborted.
  std::exception_ptr final_error(std::exception_ptr error) {
    std::lock_guard lock(mu);
    return aborted && broken ? broken : error;
  }

  void op_loop() {
    for (;;) {
      QueuedOp op;
      {
        std::unique_lock lock(mu);
        op_cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) break;  // stopping and drained
        op = std::move(queue.front());
        queue.pop_front();
        running = op.work;
      }
      bool finished = false;
      bool disagreed = false;
      std::exception_ptr error;
      try {
        finished = op.run(op.work);
      } catch (const Disagreement& e) {
        error = std::make_exception_ptr(ConfigError(op.work->description() + ": " + e.what()));
        disagreed = true;
      } catch (...) {
        error = translate(op.work->description(), std::current_exception());
        await_explanation(error);
        error = final_error(error);
      }
      // On failure the pairs are closed (here, or by the abort that broke
      // the group) before the work fails and what the operation held goes,
      // so that no gloo thread touches the caller's memory once wait() has
      // returned, nor memory that was freed. A disagreement moved no byte of
      // the operation: the group goes on.
      if (error && !disagreed) {
        break_group(error, false);
        await_pairs_closed();
      }
      held.clear();
      {
        std::lock_guard lock(mu);
        running.reset();
      }
      idle_cv.notify_all();
      if (error) {
        op.work->fail(error);
      } else if (finished) {
        op.work->complete();
      }
    }
    op_thread_done = true;
  }

  // The thread of lane p2p[lane] (0: sends, 1: receives).
  void p2p_loop(int lane) {
    auto& posted = p2p[lane];
    for (;;) {
      // Only this thread pops the lane and sets an entry's data buffer (under
      // mu); the operation thread only appends.
      InflightP2p* front = nullptr;
      {
        std::unique_lock lock(mu);
        p2p_cv.wait(lock, [&] { return stopping || !posted.empty(); });
        if (posted.empty()) break;
        front = &posted.front();
      }
      std::exception_ptr error;
      std::string disagreement;
      bool ok = false;
      try {
        ok = finish_p2p(*front, disagreement);
      } catch (...) {
        error = translate(front->work->description(), std::current_exception());
        await_explanation(error);
        error = final_error(error);
      }
      InflightP2p done;
      {
        std::lock_guard lock(mu);
        done = std::move(posted.front());
        posted.pop_front();
        if (!ok && !error) error = broken ? broken : aborted_error("point-to-point wait interrupted");
      }
      if (error) {
        break_group(error, false);
        await_pairs_closed();
      }
      auto work = std::move(done.work);
      done = InflightP2p{};  // its buffers go once no gloo thread can touch them
      if (error) {
        work->fail(error);
      } else if (!disagreement.empty()) {
        work->fail(std::make_exception_ptr(ConfigError(work->description() + ": " + disagreement)));
      } else {
        work->complete();
      }
    }
    p2p_thread_done[lane] = true;
  }

  // Waits for a posted send or receive (p2p thread). A checked receive
  // waits for the header, then posts the data's receive. False when a wait
  // was interrupted (the group broke).
  bool finish_p2p(InflightP2p& p, std::string& disagreement) {
    if (p.header) {
      if (!(p.is_send ? p.header->waitSend(p.timeout) : p.header->waitRecv(p.timeout))) return false;
      if (!p.is_send) post_checked_data(p, disagreement);
    }
    if (!p.buffer) return true;  // no bytes to move
    return p.is_send ? p.buffer->waitSend(p.timeout) : p.buffer->waitRecv(p.timeout);
  }

  // A checked receive whose header has arrived: posts the data's receive
  // into the caller's memory when the header agrees with the call, else
  // into scratch that drops the bytes, `disagreement` saying why (gloo's
  // transport thread aborts the process on a message longer than the
  // receive it lands in). The sender's send completes either way.
  void post_checked_data(InflightP2p& p, std::string& disagreement) {
    const P2pHeader sent = *p.header_value;
    void* into = p.data;
    size_t bytes = p.count * element_size(p.dtype);
    if (sent.count != p.count || sent.dtype != static_cast<uint32_t>(p.dtype)) {
      disagreement = "rank " + std::to_string(p.peer) + " sent " + std::to_string(sent.count) + " " +
                     to_string(static_cast<DType>(sent.dtype)) + " and this receive takes " + std::to_string(p.count) +
                     " " + to_string(p.dtype) + "; the message was dropped";
      p.dropped.resize(sent.bytes);
      into = p.dropped.data();
      bytes = sent.bytes;
    }
    if (bytes == 0) return;
    auto buffer = context->createUnboundBuffer(into, bytes);
    buffer->recv(p.peer, p.slot);
    std::lock_guard lock(mu);
    p.buffer = std::move(buffer);
    // break_group() ran before this buffer was there to wake.
    if (broken) p.buffer->abortWaitRecv();
  }

  // Posts a send or receive (never blocks) and hands it to the p2p thread.
  // Checked, a send posts its header and its data at once (gloo moves the
  // data only once the receiver posts its receive); a receive posts the
  // header's receive only.
  void post_p2p(const std::shared_ptr<CompletionWork>& work, void* data, uint64_t count, DType dtype, int peer,
                uint32_t tag, bool is_send, milliseconds timeout) {
    InflightP2p p;
    p.work = work;
    p.is_send = is_send;
    p.timeout = timeout;
    p.peer = peer;
    p.slot = gloo::Slot::build(kP2pSlotPrefix, tag);
    const size_t bytes = count * element_size(dtype);
    if (checks_p2p()) {
      p.header_value = std::make_unique<P2pHeader>();
      if (is_send) *p.header_value = P2pHeader{count, bytes, static_cast<uint32_t>(dtype), 0};
      p.header = context->createUnboundBuffer(p.header_value.get(), sizeof(P2pHeader));
      const uint64_t header_slot = gloo::Slot::build(kP2pHeaderSlotPrefix, tag);
      if (is_send) {
        p.header->send(peer, header_slot);
      } else {
        p.header->recv(peer, header_slot);
      }
      p.data = data;
      p.count = count;
      p.dtype = dtype;
    }
    if (bytes > 0 && (is_send || !checks_p2p())) {
      p.buffer = context->createUnboundBuffer(data, bytes);
      if (is_send) {
        p.buffer->send(peer, p.slot);
      } else {
        p.buffer->recv(peer, p.slot);
      }
    }
    bool refused = false;
    {
      std::lock_guard lock(mu);
      // Aborted meanwhile: the work has failed already, and nothing would
      // wake a wait on these buffers; drop them once the pairs are closed.
      if (broken) {
        refused = true;
      } else {
        p2p[is_send ? 0 : 1].push_back(std::move(p));
      }
    }
    if (refused) {
      await_pairs_closed();
      return;
    }
    p2p_cv.notify_all();
  }

  // Ring reduce-scatter over float/native elements already laid out in
  // `acc` (size * count elements): after size-1 steps, block `rank` of acc
  // holds the reduction. gloo 0.5 has no unbound-buffer reduce-scatter.
  void ring_reduce_scatter(void* acc, size_t count, size_t elem, detail::ReduceFn fn, uint32_t tag,
                           milliseconds timeout) {
    const size_t block = count * elem;
    const int next = (rank + 1) % size;
    const int prev = (rank + size - 1) % size;
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
    auto deadline = Clock::now() + timeout;
    auto& incoming = hold<std::vector<char>>(block);
    auto& acc_buf =
        hold<std::unique_ptr<gloo::transport::UnboundBuffer>>(context->createUnboundBuffer(acc, block * size));
    auto& in_buf =
        hold<std::unique_ptr<gloo::transport::UnboundBuffer>>(context->createUnboundBuffer(incoming.data(), block));
    auto* base = static_cast<char*>(acc);
    for (int step = 0; step < size - 1; ++step) {
      const int send_block = ((rank - step - 1) % size + size) % size;
      const int recv_block = ((rank - step - 2) % size + size) % size;
      acc_buf->send(next, slot, send_block * block, block);
      in_buf->recv(prev, slot, 0, block);
      if (!in_buf->waitRecv(left_until(deadline))) throw Aborted("reduce_scatter receive interrupted");
      fn(base + recv_block * block, base + recv_block * block, incoming.data(), count);
      if (!acc_buf->waitSend(left_until(deadline))) throw Aborted("reduce_scatter send interrupted");
    }
  }
};

GlooGroup::GlooGroup(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}

std::unique_ptr<GlooGroup> GlooGroup::create(KvStore& kv, const std::string& name, int64_t generation, int rank,
                                             int world_size, const GlooGroupOptions& options) {
  TROUPE_CHECK(world_size >= 1) << "world_size " << world_size;
  TROUPE_CHECK(rank >= 0 && rank < world_size) << "rank " << rank << " of " << world_size;
  TROUPE_CHECK(!name.empty()) << "a collective group needs a name";

  // gloo writes to sockets without MSG_NOSIGNAL: a peer that died would
  // kill this process with SIGPIPE instead of failing the operation. Ignore
  // it unless the program installed its own handler.
  {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
  }

  auto shared = std::make_shared<Shared>();
  shared->name = name;
  shared->generation = generation;
  shared->rank = rank;
  shared->size = world_size;
  shared->options = options;
  const std::string where = shared->describe();
  const auto deadline = Clock::now() + options.rendezvous_timeout;

  // Announce this member, then wait for all of them, so that a rank that
  // never arrives is reported by rank number rather than as a gloo key.
  // Rendezvous keys are needed only until every member holds the mesh: each
  // member erases its own once a barrier on the new group shows that, or
  // when the rendezvous fails, so the head's KV store does not grow with
  // every group a long job forms.
  KvGlooStore store(kv, name, generation, options.rendezvous_timeout);
  const std::string pid = std::to_string(::getpid());
  store.set("member/" + std::to_string(rank), std::vector<char>(pid.begin(), pid.end()));
  try {
    wait_for_members(kv, store.prefix() + "member/", world_size, deadline, where, options);
  } catch (...) {
    store.erase_own_keys();
    throw;
  }

  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.bind_host;
    shared->device = create_tcp_device(attr);
    auto mesh = std::make_shared<MeshContext>(rank, world_size);
    shared->context = mesh;
    shared->context->setTimeout(left_until(deadline));
    if (world_size > 1) {
      connect_mesh(*mesh, store, shared->device, deadline, options, shared->peer_hosts, shared->remote_ends);
      auto& barrier = shared->hold<gloo::BarrierOptions>(shared->context);
      barrier.setTimeout(left_until(deadline));
      gloo::barrier(barrier);
    }
    shared->context->setTimeout(options.op_timeout);
  } catch (const Timeout& e) {
    shared->close_pairs();
    store.erase_own_keys();
    throw Timeout("rendezvous of " + where + " failed: " + e.what());
  } catch (const Aborted& e) {
    shared->close_pairs();
    store.erase_own_keys();
    throw Aborted("rendezvous of " + where + " failed: " + e.what());
  } catch (const std::exception& e) {
    shared->close_pairs();
    store.erase_own_keys();
    throw Error("rendezvous of " + where + " failed: " + e.what());
  }
  shared->held.clear();
  store.erase_own_keys();

  shared->op_thread = std::thread([s = shared.get()] { s->op_loop(); });
  for (int lane : {0, 1}) shared->p2p_threads[lane] = std::thread([s = shared.get(), lane] { s->p2p_loop(lane); });
  return std::unique_ptr<GlooGroup>(new GlooGroup(std::move(shared)));
}

GlooGroup::~GlooGroup() {
  bool pending;
  {
    std::lock_guard lock(shared_->mu);
    pending = !shared_->queue.empty() || shared_->running || !shared_->p2p[0].empty() || !shared_->p2p[1].empty();
  }
  // Unfinished operations cannot complete without their peers' cooperation
  // beyond this point; fail them rather than block on them.
  if (pending) abort("group destroyed with operations pending");
  {
    std::lock_guard lock(shared_->mu);
    shared_->stopping = true;
  }
  shared_->op_cv.notify_all();
  shared_->p2p_cv.notify_all();

  bool aborted;
  {
    std::lock_guard lock(shared_->mu);
    aborted = shared_->aborted;
  }
  // A healthy group's threads are idle and exit at once. An aborted group's
  // operation thread may sit in a gloo wait that nothing can interrupt (gloo
  // does not wake a receive whose bytes were mid-flight when the peer died)
  // until the operation's timeout: give it a grace period, then hand it to
  // the owner of stragglers (options.stragglers), holding its own reference
  // to the shared state. Without an owner, wait for it here: no thread is
  // ever detached.
  auto deadline = Clock::now() + shared_->options.abort_join_grace;
  auto finish = [&](std::thread& t, std::atomic<bool>& done) {
    if (!t.joinable()) return;
    if (aborted) {
      while (!done && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(5));
      auto owner = shared_->options.stragglers.lock();
      if (!done && owner) {
        owner->adopt(std::thread([keep = shared_, th = std::move(t)]() mutable { th.join(); }));
        return;
      }
      if (!done)
        TROUPE_LOG_WARN("group '{}': waiting for an operation thread parked in gloo (no owner for stragglers)",
                        shared_->name);
    }
    t.join();
  };
  finish(shared_->op_thread, shared_->op_thread_done);
  for (int lane : {0, 1}) finish(shared_->p2p_threads[lane], shared_->p2p_thread_done[lane]);
}

int GlooGroup::rank() const { return shared_->rank; }
int GlooGroup::world_size() const { return shared_->size; }
const std::string& GlooGroup::name() const { return shared_->name; }
int64_t GlooGroup::generation() const { return shared_->generation; }

bool GlooGroup::is_aborted() const {
  std::lock_guard lock(shared_->mu);
  return shared_->aborted;
}

void GlooGroup::abort(const std::string& reason) { shared_->break_group(shared_->aborted_error(reason), true); }

WorkPtr GlooGroup::allreduce(void* data, size_t count, DType dtype, const AllreduceOptions& opts) {
  TROUPE_CHECK(count == 0 || data != nullptr) << "allreduce of " << count << " elements at nullptr";
  const char* what = "allreduce";
  Shared* s = shared_.get();
  if ((count == 0 && !s->checks()) || (s->size == 1 && opts.op != ReduceOp::kAvg)) return s->completed(what);
  const auto timeout = s->timeout_of(opts.timeout);
  const uint32_t tag = s->take_tag();
  return s->submit(
      what, [s, data, count, dtype, op = opts.op, timeout, tag](const std::shared_ptr<CompletionWork>&) -> bool {
        // One deadline for the check and the operation.
        const auto deadline = Clock::now() + timeout;
        if (s->size == 1) {  // kAvg over one rank: nothing to divide by but 1
          return true;
        }
        if (s->checks()) {
          s->agree(Call{CallKind::kAllreduce, static_cast<uint32_t>(dtype), count, static_cast<int64_t>(op)}, timeout);
        }
        if (count == 0) return true;
        auto run = [&](void* buf, DType type) {
          with_storage_type(type, [&](auto zero) {
            using T = decltype(zero);
            auto& o = s->hold<gloo::AllreduceOptions>(s->context);
            o.setOutput(static_cast<T*>(buf), count);
            o.setReduceFunction(detail::reduce_function(type, op));
            o.setTag(tag);
            o.setTimeout(left_until(deadline));
            gloo::allreduce(o);
          });
          if (op == ReduceOp::kAvg) detail::divide_in_place(buf, count, type, s->size);
        };
        if (detail::is_half(dtype)) {
          auto& wide = s->hold<std::vector<float>>(count);
          detail::widen_to_float(data, wide.data(), count, dtype);
          run(wide.data(), DType::kFloat32);
          detail::narrow_from_float(wide.data(), data, count, dtype);
        } else {
          run(data, dtype);
        }
        return true;
      });
}

WorkPtr GlooGroup::broadcast(void* data, size_t count, DType dtype, int root, const BroadcastOptions& opts) {
  Shared* s = shared_.get();
  TROUPE_CHECK(root >= 0 && root < s->size) << "broadcast root " << root << " in a group of " << s->size;
  TROUPE_CHECK(count == 0 || data != nullptr) << "broadcast of " << count << " elements at nullptr";
  if ((count == 0 && !s->checks()) || s->size == 1) return s->completed("broadcast");
  const auto timeout = s->timeout_of(opts.timeout);
  const uint32_t tag = s->take_tag();
  return s->submit("broadcast",
                   [s, data, count, dtype, root, timeout, tag](const std::shared_ptr<CompletionWork>&) -> bool {
                     // One deadline for the check and the operation.
                     const auto deadline = Clock::now() + timeout;
                     if (s->checks())
                       s->agree(Call{CallKind::kBroadcast, static_cast<uint32_t>(dtype), count, root}, timeout);
                     if (count == 0) return true;
                     with_storage_type(dtype, [&](auto zero) {
                       using T = decltype(zero);
                       auto& o = s->hold<gloo::BroadcastOptions>(s->context);
                       o.setOutput(static_cast<T*>(data), count);
                       o.setRoot(root);
                       o.setTag(tag);
                       o.setTimeout(left_until(deadline));
                       gloo::broadcast(o);
                     });
                     return true;
                   });
}

WorkPtr GlooGroup::allgather(const void* in, void* out, size_t count, DType dtype, const AllgatherOptions& opts) {
  Shared* s = shared_.get();
  TROUPE_CHECK(count == 0 || (in != nullptr && out != nullptr)) << "allgather of " << count << " elements at nullptr";
  if (count == 0 && !s->checks()) return s->completed("allgather");
  const size_t bytes = count * element_size(dtype);
  if (s->size == 1) {
    if (in != out && bytes > 0) std::memmove(out, in, bytes);
    return s->completed("allgather");
  }
  const auto timeout = s->timeout_of(opts.timeout);
  const uint32_t tag = s->take_tag();
  return s->submit("allgather",
                   [s, in, out, count, dtype, timeout, tag](const std::shared_ptr<CompletionWork>&) -> bool {
                     // One deadline for the check and the operation.
                     const auto deadline = Clock::now() + timeout;
                     if (s->checks())
                       s->agree(Call{CallKind::kAllgather, static_cast<uint32_t>(dtype), count, 0}, timeout);
                     if (count == 0) return true;
                     with_storage_type(dtype, [&](auto zero) {
                       using T = decltype(zero);
                       auto& o = s->hold<gloo::AllgatherOptions>(s->context);
                       o.setInput(const_cast<T*>(static_cast<const T*>(in)), count);
                       o.setOutput(static_cast<T*>(out), count * s->size);
                       o.setTag(tag);
                       o.setTimeout(left_until(deadline));
                       gloo::allgather(o);
                     });
                     return true;
                   });
}

WorkPtr GlooGroup::reduce_scatter(const void* in, void* out, size_t count_per_rank, DType dtype,
                                  const ReduceScatterOptions& opts) {
  Shared* s = shared_.get();
  TROUPE_CHECK(count_per_rank == 0 || (in != nullptr && out != nullptr))
      << "reduce_scatter of " << count_per_rank << " elements at nullptr";
  if (count_per_rank == 0 && !s->checks()) return s->completed("reduce_scatter");
  if (s->size == 1 && opts.op != ReduceOp::kAvg) {
    if (in != out && count_per_rank > 0) std::memmove(out, in, count_per_rank * element_size(dtype));
    return s->completed("reduce_scatter");
  }
  const auto timeout = s->timeout_of(opts.timeout);
  const uint32_t tag = s->take_tag();
  return s->submit(
      "reduce_scatter",
      [s, in, out, count_per_rank, dtype, op = opts.op, timeout, tag](const std::shared_ptr<CompletionWork>&) -> bool {
        // One deadline for the check and the operation.
        const auto deadline = Clock::now() + timeout;
        if (s->checks()) {
          s->agree(
              Call{CallKind::kReduceScatter, static_cast<uint32_t>(dtype), count_per_rank, static_cast<int64_t>(op)},
              timeout);
        }
        if (count_per_rank == 0) return true;
        const size_t n = count_per_rank;
        const size_t total = n * s->size;
        const size_t mine = static_cast<size_t>(s->rank) * n;
        if (detail::is_half(dtype)) {
          auto& acc = s->hold<std::vector<float>>(total);
          detail::widen_to_float(in, acc.data(), total, dtype);
          if (s->size > 1) {
            s->ring_reduce_scatter(acc.data(), n, sizeof(float), detail::reduce_function(DType::kFloat32, op), tag,
                                   left_until(deadline));
          }
          if (op == ReduceOp::kAvg) detail::divide_in_place(acc.data() + mine, n, DType::kFloat32, s->size);
          detail::narrow_from_float(acc.data() + mine, out, n, dtype);
        } else {
          const size_t elem = element_size(dtype);
          auto& acc = s->hold<std::vector<char>>(total * elem);
          std::memcpy(acc.data(), in, total * elem);
          if (s->size > 1)
            s->ring_reduce_scatter(acc.data(), n, elem, detail::reduce_function(dtype, op), tag, left_until(deadline));
          if (op == ReduceOp::kAvg) detail::divide_in_place(acc.data() + mine * elem, n, dtype, s->size);
          std::memcpy(out, acc.data() + mine * elem, n * elem);
        }
        return true;
      });
}

WorkPtr GlooGroup::barrier(const BarrierOptions& opts) {
  Shared* s = shared_.get();
  if (s->size == 1) return s->completed("barrier");
  const auto timeout = s->timeout_of(opts.timeout);
  const uint32_t tag = s->take_tag();
  return s->submit("barrier", [s, timeout, tag](const std::shared_ptr<CompletionWork>&) -> bool {
    // One deadline for the check and the operation.
    const auto deadline = Clock::now() + timeout;
    // The agreement check is a barrier itself.
    if (s->checks()) {
      s->agree(Call{}, timeout);
      return true;
    }
    auto& o = s->hold<gloo::BarrierOptions>(s->context);
    o.setTag(tag);
    o.setTimeout(left_until(deadline));
    gloo::barrier(o);
    return true;
  });
}

WorkPtr GlooGroup::send(const void* data, size_t count, DType dtype, int dst, const SendOptions& opts) {
  Shared* s = shared_.get();
  TROUPE_CHECK(dst >= 0 && dst < s->size && dst != s->rank)
      << "send to rank " << dst << " from rank " << s->rank << " of " << s->size;
  TROUPE_CHECK(count == 0 || data != nullptr) << "send of " << count << " elements at nullptr";
  // Unchecked, both sides know the count: empty messages need not travel.
  if (count == 0 && !s->checks_p2p()) return s->completed("send");
  const auto timeout = s->timeout_of(opts.timeout);
  const uint32_t tag = opts.tag;
  return s->submit(
      "send to rank " + std::to_string(dst),
      [s, data, count, dtype, dst, tag, timeout](const std::shared_ptr<CompletionWork>& work) -> bool {
        s->post_p2p(work, const_cast<void*>(data), count, dtype, dst, tag, true, timeout);
        return false;
      },
      dst);
}

WorkPtr GlooGroup::recv(void* data, size_t count, DType dtype, int src, const RecvOptions& opts) {
  Shared* s = shared_.get();
  TROUPE_CHECK(src >= 0 && src < s->size && src != s->rank)
      << "recv from rank " << src << " at rank " << s->rank << " of " << s->size;
  TROUPE_CHECK(count == 0 || data != nullptr) << "recv of " << count << " elements at nullptr";
  if (count == 0 && !s->checks_p2p()) return s->completed("recv");
  const auto timeout = s->timeout_of(opts.timeout);
  const uint32_t tag = opts.tag;
  return s->submit(
      "recv from rank " + std::to_string(src),
      [s, data, count, dtype, src, tag, timeout](const std::shared_ptr<CompletionWork>& work) -> bool {
        s->post_p2p(work, data, count, dtype, src, tag, false, timeout);
        return false;
      },
      src);
}

}  // namespace troupe::collective
