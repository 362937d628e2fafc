// Adapts troupe's KvStore (the head's KV, or FileKvStore/MemoryKvStore in
// tests) to gloo::rendezvous::Store, so gloo's full-mesh rendezvous runs
// through the runtime. Every key is prefixed with "<group>/gen<generation>/":
// members of different generations of a group never see each other's
// addresses, so a stale member can never join a re-formed group.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "troupe/runtime/core/kv_store.h"

namespace troupe::collective {

class KvGlooStore final : public gloo::rendezvous::Store {
 public:
  // `timeout` bounds waits that gloo issues without one.
  KvGlooStore(KvStore& kv, std::string group_name, int64_t generation, std::chrono::milliseconds timeout);

  // "<group>/gen<generation>/", the prefix of every key this store touches.
  static std::string key_prefix(const std::string& group_name, int64_t generation);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  // Throws troupe::Timeout listing every key still missing when time runs
  // out.
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  const std::string& prefix() const { return prefix_; }

  // Erases every key this store has set (best effort: a head that is away
  // leaves them). Call it once no member can still need them.
  void erase_own_keys() noexcept;

 private:
  KvStore& kv_;
  const std::string prefix_;
  const std::chrono::milliseconds timeout_;
  std::vector<std::string> own_keys_;
};

}  // namespace troupe::collective
