// A small key-value store interface. The head implements it cluster-wide
// (rendezvous for collective groups); MemoryKvStore serves in-process unit
// tests.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "troupe/runtime/core/errors.h"

namespace troupe {

class KvStore {
 public:
  virtual ~KvStore() = default;
  // Sets key to value (overwrites).
  virtual void put(const std::string& key, const std::string& value) = 0;
  // The value of key, or nullopt when absent.
  virtual std::optional<std::string> get(const std::string& key) = 0;
  // Blocks until key exists and returns its value; throws troupe::Timeout
  // naming the key when timeout passes first.
  virtual std::string wait(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Removes key (no-op when absent).
  virtual void erase(const std::string& key) = 0;
  // Atomically adds delta to the integer stored at key (absent = 0) and
  // returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

// Thread-safe in-memory store for tests within one process.
class MemoryKvStore final : public KvStore {
 public:
  void put(const std::string& key, const std::string& value) override {
    std::lock_guard lock(mu_);
    map_[key] = value;
    cv_.notify_all();
  }
  std::optional<std::string> get(const std::string& key) override {
    std::lock_guard lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return std::nullopt;
    return it->second;
  }
  std::string wait(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return map_.count(key) > 0; }))
      throw Timeout("kv wait for key '" + key + "' timed out after " + std::to_string(timeout.count()) + " ms");
    return map_[key];
  }
  void erase(const std::string& key) override {
    std::lock_guard lock(mu_);
    map_.erase(key);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard lock(mu_);
    auto& v = map_[key];
    int64_t n = (v.empty() ? 0 : std::stoll(v)) + delta;
    v = std::to_string(n);
    cv_.notify_all();
    return n;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> map_;
};

}  // namespace troupe
