#include "troupe/actors/dataset.h"

#include <algorithm>
#include <sstream>

#include "troupe/actors/array_datasets.h"
#include "troupe/actors/batch.h"
#include "troupe/actors/digits_dataset.h"
#include "troupe/actors/image_dataset.h"
#include "troupe/actors/npy.h"
#include "troupe/actors/synthetic_dataset.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

Sample Dataset::get(int64_t index, int64_t epoch) const {
  check_index(index);
  // A sample the data set cannot give fails again at every retry: a
  // ConfigError naming it, which TrainJob does not retry.
  try {
    return load(index, epoch);
  } catch (const ConfigError&) {
    throw;
  } catch (const std::exception& e) {
    throw ConfigError(describe() + ": sample " + std::to_string(index) + " (epoch " + std::to_string(epoch) +
                      ") failed: " + e.what());
  }
}

void Dataset::check_index(int64_t index) const {
  TROUPE_CHECK(index >= 0 && index < size())
      << "index " << index << " out of range for " << describe() << " of size " << size();
}

TensorDict Dataset::collate(std::vector<Sample>&& samples) const { return stack_collate(samples); }

// --- DatasetSpec ---

void DatasetSpec::erase(const std::string& key) {
  strings.erase(key);
  ints.erase(key);
  doubles.erase(key);
  lists.erase(key);
}

bool DatasetSpec::has(const std::string& key) const {
  return strings.count(key) || ints.count(key) || doubles.count(key) || lists.count(key);
}

namespace {

[[noreturn]] void wrong_type(const DatasetSpec& spec, const std::string& key, const char* wanted) {
  throw ConfigError("dataset '" + spec.name + "': parameter '" + key + "' must be " + wanted + " (spec " +
                    spec.to_string() + ")");
}

std::string format_double(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

std::string DatasetSpec::get_string(const std::string& key, const std::string& fallback) const {
  if (auto it = strings.find(key); it != strings.end()) return it->second;
  if (has(key)) wrong_type(*this, key, "a string");
  return fallback;
}

int64_t DatasetSpec::get_int(const std::string& key, int64_t fallback) const {
  if (auto it = ints.find(key); it != ints.end()) return it->second;
  if (has(key)) wrong_type(*this, key, "an integer");
  return fallback;
}

double DatasetSpec::get_double(const std::string& key, double fallback) const {
  if (auto it = doubles.find(key); it != doubles.end()) return it->second;
  if (auto it = ints.find(key); it != ints.end()) return static_cast<double>(it->second);
  if (has(key)) wrong_type(*this, key, "a number");
  return fallback;
}

std::vector<double> DatasetSpec::get_list(const std::string& key, const std::vector<double>& fallback) const {
  if (auto it = lists.find(key); it != lists.end()) return it->second;
  // A single number is accepted as a one-element list (e.g. mean=0.5 for grey images).
  if (doubles.count(key) || ints.count(key)) return {get_double(key, 0.0)};
  if (has(key)) wrong_type(*this, key, "a list of numbers");
  return fallback;
}

std::vector<std::string> DatasetSpec::keys() const {
  std::vector<std::string> out;
  for (auto& [k, v] : strings) out.push_back(k);
  for (auto& [k, v] : ints) out.push_back(k);
  for (auto& [k, v] : doubles) out.push_back(k);
  for (auto& [k, v] : lists) out.push_back(k);
  std::sort(out.begin(), out.end());
  return out;
}

std::string DatasetSpec::to_string() const {
  std::ostringstream os;
  os << name << "(";
  bool first = true;
  for (const auto& key : keys()) {
    if (!first) os << ", ";
    first = false;
    os << key << "=";
    if (auto it = strings.find(key); it != strings.end()) {
      os << "'" << it->second << "'";
    } else if (auto it = ints.find(key); it != ints.end()) {
      os << it->second;
    } else if (auto it = doubles.find(key); it != doubles.end()) {
      os << format_double(it->second);
    } else {
      const auto& l = lists.at(key);
      os << "[";
      for (size_t i = 0; i < l.size(); ++i) os << (i ? ", " : "") << format_double(l[i]);
      os << "]";
    }
  }
  os << ")";
  return os.str();
}

void check_known_parameters(const DatasetSpec& spec, const std::vector<std::string>& known) {
  for (const auto& key : spec.keys()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string list;
    for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
    throw ConfigError("dataset '" + spec.name + "': unknown parameter '" + key + "' (known: " + list + ")");
  }
}

// --- factory ---

namespace {

// Reads an integer parameter that must be at least `min`.
int64_t positive_int(const DatasetSpec& spec, const std::string& key, int64_t fallback, int64_t min = 1) {
  int64_t v = spec.get_int(key, fallback);
  if (v < min) {
    throw ConfigError("dataset '" + spec.name + "': parameter '" + key + "' = " + std::to_string(v) +
                      " must be >= " + std::to_string(min));
  }
  return v;
}

double non_negative_double(const DatasetSpec& spec, const std::string& key, double fallback) {
  double v = spec.get_double(key, fallback);
  if (!(v >= 0)) {
    throw ConfigError("dataset '" + spec.name + "': parameter '" + key + "' = " + format_double(v) + " must be >= 0");
  }
  return v;
}

bool flag(const DatasetSpec& spec, const std::string& key, bool fallback) {
  int64_t v = spec.get_int(key, fallback ? 1 : 0);
  if (v != 0 && v != 1) {
    throw ConfigError("dataset '" + spec.name + "': parameter '" + key + "' = " + std::to_string(v) +
                      " must be 0 or 1");
  }
  return v == 1;
}

std::string required_string(const DatasetSpec& spec, const std::string& key) {
  std::string v = spec.get_string(key);
  if (v.empty()) throw ConfigError("dataset '" + spec.name + "': parameter '" + key + "' is required");
  return v;
}

std::unique_ptr<Dataset> make_classification(const DatasetSpec& spec) {
  check_known_parameters(spec, {"size", "num_features", "num_classes", "seed", "noise"});
  SyntheticClassificationOptions o;
  o.size = positive_int(spec, "size", o.size, 0);
  o.num_features = positive_int(spec, "num_features", o.num_features);
  o.num_classes = positive_int(spec, "num_classes", o.num_classes);
  o.seed = spec.get_int("seed", o.seed);
  o.noise = non_negative_double(spec, "noise", o.noise);
  return std::make_unique<SyntheticClassification>(o);
}

std::unique_ptr<Dataset> make_regression(const DatasetSpec& spec) {
  check_known_parameters(spec, {"size", "num_features", "num_outputs", "seed", "noise"});
  SyntheticRegressionOptions o;
  o.size = positive_int(spec, "size", o.size, 0);
  o.num_features = positive_int(spec, "num_features", o.num_features);
  o.num_outputs = positive_int(spec, "num_outputs", o.num_outputs);
  o.seed = spec.get_int("seed", o.seed);
  o.noise = non_negative_double(spec, "noise", o.noise);
  return std::make_unique<SyntheticRegression>(o);
}

std::unique_ptr<Dataset> make_npy(const DatasetSpec& spec) {
  check_known_parameters(spec, {"inputs", "targets"});
  return std::make_unique<NpyDataset>(required_string(spec, "inputs"), spec.get_string("targets"));
}

std::unique_ptr<Dataset> make_digits(const DatasetSpec& spec) {
  check_known_parameters(spec, {"path", "normalize", "image"});
  DigitsOptions o;
  o.path = spec.get_string("path");
  o.normalize = flag(spec, "normalize", false);
  o.image = flag(spec, "image", false);
  return std::make_unique<DigitsDataset>(o);
}

std::unique_ptr<Dataset> make_image_records(const DatasetSpec& spec) {
  check_known_parameters(spec, {"path", "labels", "size", "channels", "height", "width", "num_classes", "seed", "crop",
                                "flip", "mean", "std", "scale", "defer_normalize"});
  ImageTransformOptions t;
  t.crop = positive_int(spec, "crop", 0, 0);
  t.flip = flag(spec, "flip", false);
  t.defer_normalize = flag(spec, "defer_normalize", false);
  t.scale = spec.get_double("scale", t.scale);
  t.mean = spec.get_list("mean");
  t.std = spec.get_list("std");
  t.seed = spec.get_int("seed", 0);
  if (t.mean.size() != t.std.size()) {
    throw ConfigError("dataset '" + spec.name + "': 'mean' has " + std::to_string(t.mean.size()) +
                      " values but 'std' has " + std::to_string(t.std.size()));
  }
  for (double s : t.std) {
    if (!(s > 0)) throw ConfigError("dataset '" + spec.name + "': 'std' values must be > 0, got " + format_double(s));
  }
  if (spec.has("path")) {
    for (const char* k : {"size", "channels", "height", "width", "num_classes"}) {
      if (spec.has(k)) {
        throw ConfigError("dataset '" + spec.name + "': parameter '" + k +
                          "' describes synthetic records and cannot be combined with 'path'");
      }
    }
    return ImageRecordDataset::from_npy(required_string(spec, "path"), spec.get_string("labels"), t);
  }
  if (spec.has("labels")) throw ConfigError("dataset '" + spec.name + "': 'labels' needs 'path'");
  SyntheticImageOptions o;
  o.size = positive_int(spec, "size", o.size, 0);
  o.channels = positive_int(spec, "channels", o.channels);
  o.height = positive_int(spec, "height", o.height);
  o.width = positive_int(spec, "width", o.width);
  o.num_classes = positive_int(spec, "num_classes", o.num_classes);
  o.seed = t.seed;
  return ImageRecordDataset::synthetic(o, t);
}

std::unique_ptr<Dataset> make_npz(const DatasetSpec& spec) {
  check_known_parameters(spec, {"path"});
  return ArrayDataset::from_npz(required_string(spec, "path"));
}

// Every parameter is a batch key naming its .npy file.
std::unique_ptr<Dataset> make_arrays(const DatasetSpec& spec) {
  if (!spec.ints.empty() || !spec.doubles.empty() || !spec.lists.empty() || spec.strings.empty())
    throw ConfigError("dataset 'arrays': every parameter must be key = path of a .npy file (spec " + spec.to_string() +
                      ")");
  return ArrayDataset::from_npy_files(spec.strings);
}

std::unique_ptr<Dataset> make_token_stream(const DatasetSpec& spec) {
  check_known_parameters(spec, {"path", "block_size", "stride", "dtype"});
  TokenStreamOptions o;
  o.path = required_string(spec, "path");
  o.block_size = positive_int(spec, "block_size", o.block_size);
  o.stride = positive_int(spec, "stride", o.stride, 0);
  o.dtype = spec.get_string("dtype", o.dtype);
  return std::make_unique<TokenStreamDataset>(o);
}

struct Builder {
  const char* name;
  std::unique_ptr<Dataset> (*make)(const DatasetSpec&);
};

constexpr Builder kBuilders[] = {
    {"synthetic_classification", make_classification},
    {"synthetic_regression", make_regression},
    {"npy", make_npy},
    {"digits", make_digits},
    {"image_records", make_image_records},
    {"npz", make_npz},
    {"arrays", make_arrays},
    {"token_stream", make_token_stream},
};

}  // namespace

std::vector<std::string> file_keys(const DatasetSpec& spec) {
  std::vector<std::string> keys;
  if (spec.name == "arrays") {
    for (const auto& [key, value] : spec.strings) keys.push_back(key);
  } else if (spec.name == "npy") {
    for (const char* key : {"inputs", "targets"})
      if (spec.strings.count(key)) keys.emplace_back(key);
  } else if (spec.name == "npz" || spec.name == "token_stream" || spec.name == "image_records" ||
             spec.name == "digits") {
    if (spec.strings.count("path")) keys.emplace_back("path");
    if (spec.name == "image_records" && spec.strings.count("labels")) keys.emplace_back("labels");
  }
  // An empty value names no file (a reader's default).
  std::erase_if(keys, [&](const std::string& k) { return spec.strings.at(k).empty(); });
  return keys;
}

std::vector<std::string> dataset_names() {
  std::vector<std::string> out;
  for (const auto& b : kBuilders) out.push_back(b.name);
  return FactoryRegistry<DatasetFactory>::instance().names(std::move(out));
}

bool register_dataset(const std::string& name, DatasetFactory factory) {
  return FactoryRegistry<DatasetFactory>::instance().add(name, std::move(factory));
}

std::unique_ptr<Dataset> make_dataset(const DatasetSpec& spec) {
  const auto& registry = FactoryRegistry<DatasetFactory>::instance();
  const bool builtin =
      std::any_of(std::begin(kBuilders), std::end(kBuilders), [&](const auto& b) { return spec.name == b.name; });
  registry.check(spec.name, builtin, "dataset", "TROUPE_DATASET");
  for (const auto& b : kBuilders) {
    if (spec.name == b.name) return b.make(spec);
  }
  if (auto factory = registry.find(spec.name)) {
    auto ds = run_factory("dataset '" + spec.name + "'", [&] { return (*factory)(spec); });
    if (!ds) throw ConfigError("dataset factory '" + spec.name + "' returned no data set");
    return ds;
  }
  std::string list;
  for (const auto& n : dataset_names()) list += (list.empty() ? "" : ", ") + n;
  throw ConfigError("unknown dataset '" + spec.name + "' (known: " + list + ")");
}

}  // namespace troupe::actors
