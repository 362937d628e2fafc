// Where a process's own listeners (its stream server, its object store)
// bind when TROUPE_BIND_HOST does not say: the local address of the
// interface that routes to the head (127.0.0.1 for a head on loopback), so
// workers on other hosts can reach a driver's streams and objects. Workers
// and node agents are told (TROUPE_BIND_HOST); a driver is not.
#pragma once

#include <string>

namespace troupe::client {

std::string listen_host(const std::string& head_address);

}  // namespace troupe::client
