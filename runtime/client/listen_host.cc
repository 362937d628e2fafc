#include "troupe/runtime/client/listen_host.h"

#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/wire/address.h"

namespace troupe::client {

std::string listen_host(const std::string& head_address) {
  if (std::string host = core::env_value(core::kEnvBindHost); !host.empty()) return host;
  try {
    auto [host, port] = wire::parse_address(head_address);
    return wire::local_address_towards(host, port);
  } catch (const std::exception&) {
    return "127.0.0.1";  // no head address (an embedded core), or no route: loopback as before
  }
}

}  // namespace troupe::client
