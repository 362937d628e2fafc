#include "troupe/runtime/node/worker_assignment.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "troupe/runtime/core/errors.h"

namespace troupe::node {

namespace {

// Reads exactly n bytes; false on EOF before the first byte.
bool read_exactly(int fd, char* p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, p + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw Error(std::string("reading the worker assignment: ") + std::strerror(errno));
    if (r == 0) {
      if (got == 0) return false;
      throw DecodeError("worker assignment cut short after " + std::to_string(got) + " of " + std::to_string(n) +
                        " bytes");
    }
    got += static_cast<size_t>(r);
  }
  return true;
}

// How long a worker may take to read what does not fit in the socket's
// buffer at once. The agent's I/O thread (its heartbeats too) waits: only
// a ready worker gets a large assignment (WorkerPool::take), and reads it
// as it comes; one that does not within this is stuck.
constexpr int kAssignmentWriteMs = 250;

void write_exactly(int fd, const char* p, size_t n) {
  while (n > 0) {
    // A pooled worker that died meanwhile has closed its end of the socket
    // pair: EPIPE, never SIGPIPE, which would kill the agent's process (a
    // driver's, for an embedded cluster, whose program need not ignore it).
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    // The pool's socket is non-blocking (asio watched it): an assignment
    // larger than its buffer (an environment of a few hundred KiB) waits
    // for the worker to read, instead of taking EAGAIN for a dead worker
    // (every idle worker of the executable was killed so, one by one).
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd{fd, POLLOUT, 0};
      const int ready = ::poll(&pfd, 1, kAssignmentWriteMs);
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0)
        throw Error("sending the worker assignment: the worker took none of the rest within " +
                    std::to_string(kAssignmentWriteMs) + " ms");
      continue;
    }
    if (w < 0) throw Error(std::string("sending the worker assignment: ") + std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

bool large_assignment(const WorkerAssignment& a) { return wire::encode_inline(a).size() > kSmallAssignmentBytes; }

void send_assignment(int fd, const WorkerAssignment& a) {
  std::string body = wire::encode_inline(a);
  uint32_t size = static_cast<uint32_t>(body.size());
  std::string frame(reinterpret_cast<const char*>(&size), sizeof(size));
  frame += body;
  write_exactly(fd, frame.data(), frame.size());
}

std::optional<WorkerAssignment> receive_assignment(int fd) {
  uint32_t size = 0;
  if (!read_exactly(fd, reinterpret_cast<char*>(&size), sizeof(size))) return std::nullopt;
  if (size > kMaxAssignmentBytes)
    throw DecodeError("worker assignment of " + std::to_string(size) + " bytes exceeds " +
                      std::to_string(kMaxAssignmentBytes));
  std::string body(size, '\0');
  if (size > 0 && !read_exactly(fd, body.data(), size)) throw DecodeError("worker assignment cut short");
  return wire::decode_value<WorkerAssignment>(body);
}

std::string exec_time_variable(const std::vector<std::string>& env) {
  // PYTHON*: read by the interpreter as it starts (PYTHONPATH builds
  // sys.path, PYTHONHASHSEED the hash seed): a pooled worker took them
  // too late, and a literal PYTHONPATH did nothing there.
  static const char* const kPrefixes[] = {"LD_",  "GLIBC_TUNABLES", "MALLOC_", "OMP_",
                                          "KMP_", "MKL_",           "TROUPE_", "PYTHON"};
  for (const auto& kv : env)
    for (const char* prefix : kPrefixes)
      if (kv.rfind(prefix, 0) == 0) return kv.substr(0, kv.find('='));
  return "";
}

}  // namespace troupe::node
