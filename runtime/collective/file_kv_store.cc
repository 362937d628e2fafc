#include "troupe/runtime/collective/file_kv_store.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include "troupe/runtime/core/errors.h"

namespace troupe::collective {
namespace {

std::atomic<uint64_t> g_temp_counter{0};

std::string encode(const std::string& key) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  // "." and ".." are not usable file names.
  if (out == "." || out == ".." || out.empty()) out = "%" + out;
  return out;
}

}  // namespace

FileKvStore::FileKvStore(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw Error("FileKvStore: cannot create directory '" + dir_ + "': " + ec.message());
}

std::string FileKvStore::path_of(const std::string& key) const { return dir_ + "/" + encode(key); }

void FileKvStore::put(const std::string& key, const std::string& value) {
  const std::string path = path_of(key);
  const std::string temp = dir_ + "/.tmp." + std::to_string(::getpid()) + "." + std::to_string(g_temp_counter++);
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out.write(value.data(), static_cast<std::streamsize>(value.size()));
    out.flush();
    if (!out) throw Error("FileKvStore: cannot write '" + temp + "'");
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    std::remove(temp.c_str());
    throw Error("FileKvStore: cannot rename to '" + path + "'");
  }
}

std::optional<std::string> FileKvStore::get(const std::string& key) {
  std::ifstream in(path_of(key), std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string FileKvStore::wait(const std::string& key, std::chrono::milliseconds timeout) {
  // Polling is the price of having no server; the sleep grows from 1 ms to
  // 20 ms so rendezvous stays quick without spinning.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    if (auto v = get(key)) return *v;
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      throw Timeout("kv wait for key '" + key + "' timed out after " + std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

void FileKvStore::erase(const std::string& key) { std::remove(path_of(key).c_str()); }

int64_t FileKvStore::add(const std::string& key, int64_t delta) {
  const std::string lock_path = dir_ + "/.lock";
  int fd = ::open(lock_path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw Error("FileKvStore: cannot open lock file '" + lock_path + "'");
  if (::flock(fd, LOCK_EX) != 0) {
    ::close(fd);
    throw Error("FileKvStore: flock failed on '" + lock_path + "'");
  }
  int64_t value = 0;
  try {
    auto current = get(key);
    value = (current && !current->empty() ? std::stoll(*current) : 0) + delta;
    put(key, std::to_string(value));
  } catch (...) {
    ::flock(fd, LOCK_UN);
    ::close(fd);
    throw;
  }
  ::flock(fd, LOCK_UN);
  ::close(fd);
  return value;
}

}  // namespace troupe::collective
