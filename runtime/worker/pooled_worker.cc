// A pooled worker: started by its node agent ahead of any actor, it says it
// is ready and waits for its WorkerAssignment, acknowledges it, then serves
// that actor as a worker started for it would (run_worker), telling the
// agent when it does.
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "troupe/runtime/core/process.h"
#include "troupe/runtime/node/worker_assignment.h"
#include "troupe/runtime/wire/address.h"
#include "troupe/runtime/wire/auth.h"
#include "troupe/runtime/worker/worker.h"

namespace troupe::worker {

namespace {

// KEY=VALUE into this process's environment.
void apply_env(const std::vector<std::string>& env) {
  for (const auto& kv : env) {
    auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) continue;
    ::setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
  }
}

// What the first connection of a process pays once, done while idle: the
// resolver's first lookup (NSS modules loaded on first use) and OpenSSL's
// first random bytes and HMAC (DRBG seeding, provider and digest fetch).
// Measured at a few ms of a pooled spawn on a loaded machine. Failures are
// left to the real connect, which reports them.
void warm_up_connect(const core::WorkerEnv& env) {
  try {
    wire::resolve_host(wire::parse_address(env.head_address).first);
    wire::Nonce n = wire::random_nonce();
    (void)wire::make_proof(env.token, 'w', n, n);
  } catch (const std::exception&) {
  }
}

}  // namespace

void run_pooled_worker(core::WorkerEnv env) {
  const int fd = env.pool_fd;
  warm_up_connect(env);
  // The agent may have sent the assignment and closed its end already: no
  // SIGPIPE for that.
  const char ready = 'R';
  (void)!::send(fd, &ready, 1, MSG_NOSIGNAL);
  std::optional<node::WorkerAssignment> a;
  try {
    a = node::receive_assignment(fd);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe pooled worker %d: bad assignment from the node agent: %s\n", getpid(), e.what());
    std::_Exit(2);
  }
  // EOF: the agent let us go (idle timeout, shutdown) or died.
  if (!a) std::_Exit(0);
  // Taken: the agent kills a worker that does not say so within its
  // bound (stopped, hung) and starts the actor elsewhere. The serving byte
  // ('S', run_worker) follows on the same socket.
  const char ack = 'A';
  (void)!::send(fd, &ack, 1, MSG_NOSIGNAL);
  // Kept until the actor serves (run_worker), but not for the actor's children.
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  env.pool_fd = -1;
  env.actor_id = a->actor_id;
  env.incarnation = a->incarnation;
  env.node_id = a->node_id;
  env.gpu_ids.assign(a->gpu_ids.begin(), a->gpu_ids.end());
  // The same environment a worker started for this actor has, before
  // anything in this process touches CUDA.
  ::unsetenv(core::kEnvPoolFd);
  apply_env(env.to_env());
  apply_env(a->env);
  // The command line (ps, pgrep -f) says whose worker this is now, as a
  // cold worker's argv[0] does; so does the thread name (ps -o comm, top).
  core::set_process_title("troupe-worker:" + a->class_name);
  ::prctl(PR_SET_NAME, ("a" + std::to_string(a->actor_id) + ":" + a->class_name).substr(0, 15).c_str());
  run_worker(env, fd);
}

}  // namespace troupe::worker
