#include "troupe/runtime/collective/kv_gloo_store.h"

#include <algorithm>

#include "troupe/runtime/core/errors.h"

namespace troupe::collective {

KvGlooStore::KvGlooStore(KvStore& kv, std::string group_name, int64_t generation, std::chrono::milliseconds timeout)
    : kv_(kv), prefix_(key_prefix(group_name, generation)), timeout_(timeout) {}

std::string KvGlooStore::key_prefix(const std::string& group_name, int64_t generation) {
  return group_name + "/gen" + std::to_string(generation) + "/";
}

void KvGlooStore::set(const std::string& key, const std::vector<char>& data) {
  kv_.put(prefix_ + key, std::string(data.begin(), data.end()));
  own_keys_.push_back(prefix_ + key);
}

void KvGlooStore::erase_own_keys() noexcept {
  for (const auto& key : own_keys_) {
    try {
      kv_.erase(key);
    } catch (const std::exception&) {
      // The key outlives this group; the next generation uses other keys.
    }
  }
  own_keys_.clear();
}

std::vector<char> KvGlooStore::get(const std::string& key) {
  // gloo calls get only after wait, but a get that races a slow put should
  // still not fail spuriously: wait for it within the store timeout.
  std::string value = kv_.wait(prefix_ + key, timeout_);
  return std::vector<char>(value.begin(), value.end());
}

void KvGlooStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void KvGlooStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& key : keys) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      kv_.wait(prefix_ + key, std::max(left, std::chrono::milliseconds(0)));
    } catch (const Timeout&) {
      std::string missing;
      for (const auto& k : keys) {
        if (!kv_.get(prefix_ + k)) missing += (missing.empty() ? "" : ", ") + prefix_ + k;
      }
      throw Timeout("rendezvous store wait timed out after " + std::to_string(timeout.count()) +
                    " ms; missing keys: " + missing);
    }
  }
}

}  // namespace troupe::collective
