// Checking, before anything is started or persisted, that an address given
// to the CLI is a troupe head that accepts our token: a bounded connect and
// handshake, so that `troupe start --address` at another service or with a
// wrong token fails within seconds and says which.
#pragma once

#include <chrono>
#include <string>

#include "troupe/runtime/core/errors.h"

namespace troupe::launcher {

// What probe_head throws while nothing answers at the address: a connect
// refused or timed out, or a host name that does not resolve (yet). A head
// starting later may still answer there; anything else it throws (another
// service, a wrong token) will not change by waiting.
class HeadUnreachable : public ConnectionError {
 public:
  using ConnectionError::ConnectionError;
};

// Throws troupe::ConnectionError: "HOST:PORT is not a troupe head (...)",
// or "... refused the cluster token"; HeadUnreachable: "cannot connect to
// HOST:PORT: ..." or "cannot resolve host ...".
inline constexpr std::chrono::milliseconds kProbeTimeout{3000};
void probe_head(const std::string& address, const std::string& token,
                std::chrono::milliseconds timeout = kProbeTimeout);

// probe_head, tried again every second while the head is unreachable, until
// `wait` has passed (0: once), saying on stderr what it waits for every 10 s
// (`who`: the command). Throws what the last try threw, the wait named; or
// StopSignal when SIGTERM, SIGINT or SIGHUP is pending (a caller that
// blocked them: a container's PID 1, where their default action is none).
void wait_for_head(const std::string& address, const std::string& token, std::chrono::milliseconds wait,
                   const std::string& who);

struct StopSignal {
  int signal;
};

}  // namespace troupe::launcher
