// FileKvStore: a KvStore shared by processes through a directory, for tests
// and benchmarks that form collective groups in forked processes without a
// head. Each key is one file (name percent-encoded); put writes a temporary
// file and renames it, so readers see a whole value or none; add serialises
// through flock(2) on a lock file; wait polls with short bounded sleeps.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "troupe/runtime/core/kv_store.h"

namespace troupe::collective {

class FileKvStore final : public KvStore {
 public:
  // Creates `dir` (and parents) when missing.
  explicit FileKvStore(std::string dir);

  void put(const std::string& key, const std::string& value) override;
  std::optional<std::string> get(const std::string& key) override;
  std::string wait(const std::string& key, std::chrono::milliseconds timeout) override;
  void erase(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;

  const std::string& dir() const { return dir_; }

 private:
  std::string path_of(const std::string& key) const;

  const std::string dir_;
};

}  // namespace troupe::collective
