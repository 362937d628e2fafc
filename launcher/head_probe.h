// Checking, before anything is started or persisted, that an address given
// to the CLI is a troupe head that accepts our token: a bounded connect and
// handshake, so that `troupe start --address` at another service or with a
// wrong token fails within seconds and says which.
#pragma once

#include <chrono>
#include <string>

namespace troupe::launcher {

// Throws troupe::ConnectionError: "HOST:PORT is not a troupe head (...)",
// "cannot connect to HOST:PORT: ...", or "... refused the cluster token".
void probe_head(const std::string& address, const std::string& token,
                std::chrono::milliseconds timeout = std::chrono::seconds(3));

}  // namespace troupe::launcher
