// Starting troupe processes in a role (head, node): fork + exec of a binary
// with TROUPE_ROLE and a ready pipe, waiting (bounded) for the ready line.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace troupe::core {

struct RoleProcessOptions {
  std::string executable;        // "" = this binary
  std::vector<std::string> env;  // KEY=VALUE added to a clean copy of ours
  std::string log_file;          // "" = inherit stdout/stderr
  bool die_with_parent = true;   // PR_SET_PDEATHSIG; off for daemons
  bool new_session = false;      // setsid(); on for daemons
  std::chrono::milliseconds ready_timeout{20000};
};

struct RoleProcess {
  pid_t pid = -1;
  std::string ready_line;  // what the process wrote to its ready pipe
};

// Starts the process and waits for its ready line; on timeout kills it and
// throws troupe::Error naming `what`.
RoleProcess start_role_process(const RoleProcessOptions& options, const std::string& what);

// Waits for pid to exit, SIGKILLing it after `grace`.
void reap_process(pid_t pid, std::chrono::milliseconds grace = std::chrono::seconds(10));

// Absolute path of the running binary.
std::string self_executable_path();

}  // namespace troupe::core
