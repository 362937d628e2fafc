#include "troupe/runtime/core/cpu_priority.h"

#include <dirent.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

namespace troupe::core {

namespace {

bool set_policy(pid_t tid, int policy) {
  sched_param p{};
  p.sched_priority = 0;
  return ::sched_setscheduler(tid, policy, &p) == 0;
}

// Applies `move` to every thread of `pid` (0: this process); false when
// the process is gone or `move` failed for some thread.
template <class F>
bool for_each_thread(pid_t pid, F move) {
  const std::string dir = pid == 0 ? "/proc/self/task" : "/proc/" + std::to_string(pid) + "/task";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return false;
  bool all = true;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    pid_t tid = static_cast<pid_t>(std::strtol(e->d_name, nullptr, 10));
    if (tid > 0) all = move(tid) && all;
  }
  ::closedir(d);
  return all;
}

}  // namespace

bool can_restore_normal_priority() {
  static const bool can = [] {
    bool ok = false;
    // A thread of its own: were the way back refused, only it would stay idle.
    std::thread probe([&ok] { ok = set_policy(0, SCHED_IDLE) && set_policy(0, SCHED_OTHER); });
    probe.join();
    return ok;
  }();
  return can;
}

bool enter_idle_priority(pid_t pid) {
  return for_each_thread(pid, [](pid_t tid) { return set_policy(tid, SCHED_IDLE); });
}

// Threads are scheduled one by one; each keeps the nice value it inherited.
bool leave_idle_priority(pid_t pid) {
  return for_each_thread(
      pid, [](pid_t tid) { return ::sched_getscheduler(tid) != SCHED_IDLE || set_policy(tid, SCHED_OTHER); });
}

}  // namespace troupe::core
