// KV keys that live as long as an actor or a client process.
//
// - Under actor_key_prefix(id): the head erases every such key once actor
//   `id` is dead for good, and drops a put under it that comes later (or
//   names no actor it knows). For what a process keeps about an actor for
//   others who find it by name: the Python shim's method table of a named
//   actor's class.
// - Under client_key_prefix(id): the same for a client process (a driver,
//   or a worker as a caller), by the client id it said hello with: erased
//   when its connection to the head closes (or, after a head restart, when
//   it does not come back in time).
// - References. A key <scope prefix>ref/<target> (either scope) holds
//   `target`: every key that starts with `target` lives while one such
//   reference does, and the head erases them when the last one goes (its
//   actor died, its client left, or it was erased). `target` may not be a
//   scoped key itself. For what many processes use and none owns: the
//   Python shim's runtime_env packages, held by the drivers that uploaded
//   them and the actors that run with them.
#pragma once

#include <cstdint>
#include <string>

namespace troupe::client {

inline constexpr const char* kActorKeyPrefix = "troupe.actor/";
inline constexpr const char* kClientKeyPrefix = "troupe.client/";
inline constexpr const char* kRefInfix = "ref/";

inline std::string actor_key_prefix(uint64_t actor_id) {
  return std::string(kActorKeyPrefix) + std::to_string(actor_id) + "/";
}

inline std::string client_key_prefix(uint64_t client_id) {
  return std::string(kClientKeyPrefix) + std::to_string(client_id) + "/";
}

}  // namespace troupe::client
