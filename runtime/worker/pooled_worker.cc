// A pooled worker: started by its node agent ahead of any actor, it says it
// is ready and waits for its WorkerAssignment, then serves that actor as a
// worker started for it would (run_worker).
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "troupe/runtime/node/worker_assignment.h"
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

}  // namespace

void run_pooled_worker(core::WorkerEnv env) {
  const int fd = env.pool_fd;
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
  ::close(fd);
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
  // argv[0] stays "troupe-worker:pooled"; the thread name (ps -o comm, top)
  // says whose worker this is now.
  ::prctl(PR_SET_NAME, ("a" + std::to_string(a->actor_id) + ":" + a->class_name).substr(0, 15).c_str());
  run_worker(env);
}

}  // namespace troupe::worker
