#include "troupe/trainer/checkpoint_manifest.h"

#include <nlohmann/json.hpp>

#include "troupe/runtime/core/errors.h"

namespace troupe::trainer {

namespace {

using nlohmann::json;

// Reads the fields of one JSON object, each checked for presence, type and
// range, with the manifest's path and the field's name in every error.
class Fields {
 public:
  Fields(const json& j, std::string where, const std::string& path) : j_(j), where_(std::move(where)), path_(path) {
    if (!j_.is_object()) fail("is not an object");
  }
  const json& at(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end()) fail(std::string("has no '") + key + "'");
    return *it;
  }
  int64_t integer(const char* key, int64_t min) const {
    const json& v = at(key);
    if (!v.is_number_integer()) fail(std::string("'") + key + "' is not an integer");
    const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX) ? -1 : v.get<int64_t>();
    if (x < min) fail(std::string("'") + key + "' is " + v.dump() + ", below " + std::to_string(min));
    return x;
  }
  [[noreturn]] void fail(const std::string& problem) const {
    throw Error("checkpoint manifest " + path_ + ": " + where_ + " " + problem);
  }

 private:
  const json& j_;
  std::string where_;
  const std::string& path_;
};

bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

bool sha256_hex(const json& v) {
  if (!v.is_string()) return false;
  const auto& s = v.get_ref<const std::string&>();
  return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

CheckpointManifest::File read_file_entry(const std::string& name, const json& entry, const std::string& path) {
  Fields f(entry, "file '" + name + "'", path);
  if (!plain_file_name(name)) f.fail("is not a plain file name in the checkpoint directory");
  const json& sha = f.at("sha256");
  if (!sha256_hex(sha)) f.fail("has a 'sha256' that is not 64 lowercase hex digits");
  CheckpointManifest::File file;
  file.sha256 = sha.get<std::string>();
  file.bytes = uint64_t(f.integer("bytes", 0));
  return file;
}

}  // namespace

std::string manifest_text(const CheckpointManifest& m) {
  json j;
  j["format"] = kCheckpointFormat;
  j["step"] = m.step;
  j["epoch"] = m.epoch;
  j["world_size"] = m.world_size;
  j["sampler_cursor"] = {{"epoch", m.cursor.epoch},
                         {"world_size", m.cursor.world_size},
                         {"segment_start", m.cursor.segment_start},
                         {"segment_consumed", m.cursor.segment_consumed}};
  j["metrics"] = json::object();
  for (const auto& [k, v] : m.metrics) j["metrics"][k] = v;
  if (!m.data_order.empty()) j["data_order"] = m.data_order;
  if (!m.epoch_sums.empty()) j["epoch_sums"] = m.epoch_sums;
  j["files"] = json::object();
  for (const auto& [name, f] : m.files) j["files"][name] = {{"sha256", f.sha256}, {"bytes", f.bytes}};
  return j.dump(2) + "\n";
}

CheckpointManifest parse_manifest(std::string_view text, const std::string& path) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const std::exception& e) {
    throw Error("checkpoint manifest " + path + " is not valid JSON: " + e.what());
  }
  Fields top(j, "(top level)", path);
  const json& format = top.at("format");
  if (!format.is_string() || format.get_ref<const std::string&>() != kCheckpointFormat)
    throw Error("checkpoint manifest " + path + " has an unknown format " + format.dump() + " (this troupe reads " +
                kCheckpointFormat + ")");
  CheckpointManifest m;
  m.step = top.integer("step", 0);
  m.epoch = top.integer("epoch", 0);
  m.world_size = top.integer("world_size", 1);
  Fields cursor(top.at("sampler_cursor"), "'sampler_cursor'", path);
  m.cursor.epoch = cursor.integer("epoch", 0);
  m.cursor.world_size = cursor.integer("world_size", 1);
  m.cursor.segment_start = cursor.integer("segment_start", 0);
  m.cursor.segment_consumed = cursor.integer("segment_consumed", 0);
  if (j.contains("metrics")) {
    const json& metrics = top.at("metrics");
    Fields check(metrics, "'metrics'", path);
    for (const auto& [k, v] : metrics.items())
      if (v.is_number()) m.metrics[k] = v.get<double>();
  }
  if (j.contains("epoch_sums")) {
    const json& sums = top.at("epoch_sums");
    Fields check(sums, "'epoch_sums'", path);
    for (const auto& [k, v] : sums.items())
      if (v.is_number()) m.epoch_sums[k] = v.get<double>();
  }
  if (j.contains("data_order")) {
    Fields order(top.at("data_order"), "'data_order'", path);
    for (const auto& [k, v] : top.at("data_order").items()) m.data_order[k] = order.integer(k.c_str(), INT64_MIN);
  }
  Fields files(top.at("files"), "'files'", path);
  for (const auto& [name, entry] : top.at("files").items()) m.files[name] = read_file_entry(name, entry, path);
  return m;
}

}  // namespace troupe::trainer
