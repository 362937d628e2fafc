// KV keys that live as long as an actor: the head erases every key under
// actor_key_prefix(id) once actor `id` is dead for good, and drops a put
// under it that comes later (or names no actor it knows). For what a
// process keeps about an actor for others who find it by name: the
// Python shim's method table of a named actor's class.
#pragma once

#include <cstdint>
#include <string>

namespace troupe::client {

inline constexpr const char* kActorKeyPrefix = "troupe.actor/";

inline std::string actor_key_prefix(uint64_t actor_id) {
  return std::string(kActorKeyPrefix) + std::to_string(actor_id) + "/";
}

}  // namespace troupe::client
