// The data set abstraction of troupe's data layer. A Dataset is an indexed,
// read-only collection of Samples that many pipeline threads read at once. A
// DatasetSpec is the plain-value description of one (a built-in name plus
// string/int/double parameters): the driver builds a spec, sends it to a
// remote loader actor, and the loader calls make_dataset() on its side, so
// data sets never need to be serialised themselves.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/types.h>

#include "troupe/actors/factory_registry.h"
#include "troupe/actors/tensor_codec.h"
#include "troupe/actors/tensor_dict.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe::actors {

// One example: named tensors. The built-in data sets give {"input",
// "target"} ("target" absent for unlabelled data).
using Sample = TensorDict;

// A read-only, random-access data set. A resource: created by make_dataset()
// or directly, owned by one std::unique_ptr, shared with pipeline threads by
// const reference. get() must be safe to call concurrently: implementations
// keep no mutable state, and per-sample randomness comes from
// (seed, epoch, index) rather than from a shared generator.
class Dataset {
 public:
  Dataset() = default;
  Dataset(const Dataset&) = delete;
  Dataset& operator=(const Dataset&) = delete;
  virtual ~Dataset() = default;

  virtual int64_t size() const = 0;
  // A one-line description for logs and error messages.
  virtual std::string describe() const = 0;

  // Sample `index` as seen in `epoch` (the epoch matters only for data sets
  // with random transforms). Throws troupe::Error when index is out of range.
  Sample get(int64_t index, int64_t epoch = 0) const;

  // Turns the samples of one batch into the batch's tensors. Runs inside the
  // loader's pipeline (and the trainer's own loading), on one thread at a
  // time per batch but possibly concurrently for different batches. The
  // default stacks each key along a new first dimension (stack_collate());
  // ragged data (graphs: concatenated node features, offset edge indices, a
  // `batch` vector) overrides it. May throw; the error reaches the trainer.
  virtual TensorDict collate(std::vector<Sample>&& samples) const;

  // The batch of `indices` written straight into the batch's tensors:
  // bit for bit what collate() of get(i, epoch) for each index makes, without
  // each sample's own tensor or the copy into the batch. Empty (the
  // default) when the data set has no such path; the loader then gets and
  // collates sample by sample. Range-checks every index, as get() does. Only
  // for a data set that collates with the default stacking (a custom
  // collate must see its samples).
  virtual std::optional<TensorDict> load_batch(const std::vector<int64_t>& /*indices*/, int64_t /*epoch*/) const {
    return std::nullopt;
  }

  // The last step of loading, run by the trainer on a collated batch once
  // it is on the trainer's device (the GPU for a CUDA trainer). The default
  // returns it unchanged. A data set that ships a compact batch and expands
  // it where the arithmetic is cheap overrides it: image records with
  // defer_normalize ship uint8 pixels, a quarter of float32's bytes through
  // the stream and the host-to-device copy, and normalise here.
  virtual TensorDict finish(TensorDict batch) const { return batch; }

 protected:
  // The implementation of get(); `index` is already range-checked.
  virtual Sample load(int64_t index, int64_t epoch) const = 0;
  // Throws as get() does for an index out of range.
  void check_index(int64_t index) const;
};

// Plain-value description of a data set: what crosses the wire when a driver
// asks a remote loader to open one. Each parameter lives in exactly one of the
// typed maps; set() picks the map from the C++ type.
struct DatasetSpec {
  std::string name;
  std::map<std::string, std::string> strings;
  std::map<std::string, int64_t> ints;
  std::map<std::string, double> doubles;
  std::map<std::string, std::vector<double>> lists;

  TROUPE_FIELDS(name, strings, ints, doubles, lists);

  DatasetSpec() = default;
  explicit DatasetSpec(std::string n) : name(std::move(n)) {}

  // spec.set("size", 1000).set("noise", 0.5).set("path", "x.npy")
  template <class T>
  DatasetSpec& set(const std::string& key, const T& value) {
    erase(key);
    if constexpr (std::is_integral_v<T>) {
      ints[key] = static_cast<int64_t>(value);
    } else if constexpr (std::is_floating_point_v<T>) {
      doubles[key] = static_cast<double>(value);
    } else if constexpr (std::is_convertible_v<const T&, std::string>) {
      strings[key] = std::string(value);
    } else {
      lists[key] = std::vector<double>(std::begin(value), std::end(value));
    }
    return *this;
  }
  DatasetSpec& set(const std::string& key, std::initializer_list<double> value) {
    erase(key);
    lists[key] = std::vector<double>(value);
    return *this;
  }

  bool has(const std::string& key) const;
  // Typed reads; a parameter present with the wrong type is a ConfigError
  // naming it. get_double also accepts an integer parameter.
  std::string get_string(const std::string& key, const std::string& fallback = "") const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_double(const std::string& key, double fallback) const;
  std::vector<double> get_list(const std::string& key, const std::vector<double>& fallback = {}) const;
  // Every parameter key, sorted.
  std::vector<std::string> keys() const;
  // `name(key=value, ...)`, for messages.
  std::string to_string() const;

 private:
  void erase(const std::string& key);
};

// Builds a built-in data set from its spec. Known names:
//   synthetic_classification  size, num_features, num_classes, seed, noise
//   synthetic_regression      size, num_features, num_outputs, seed, noise
//   npy                       inputs (path), targets (path, optional)
//   npz                       path: each array of the archive a batch key
//   arrays                    key = path of a .npy, for every key
//   token_stream              path (.bin or 1-d .npy of token ids),
//                             block_size, stride, dtype (raw files)
//   digits                    path (optional), normalize (0/1), image (0/1)
//   image_records             path + labels (uint8 N×C×H×W .npy) or
//                             size, channels, height, width, num_classes;
//                             seed, crop, flip, mean, std, scale,
//                             defer_normalize (uint8 to the trainer, which
//                             normalises on its device)
// Throws troupe::ConfigError naming the bad name, parameter or value.
std::unique_ptr<Dataset> make_dataset(const DatasetSpec& spec);

// The built-in and registered names, for help texts.
std::vector<std::string> dataset_names();

// The parameters of `spec` that name files a built-in reader opens at that
// path (npz's `path`, npy's `inputs`/`targets`, every key of `arrays`, ...),
// present in `spec.strings`. None for a registered data set: its `path`
// may be anything its factory reads (a URL, a shard prefix).
std::vector<std::string> file_keys(const DatasetSpec& spec);

// A user-defined data set: built from its spec (parameters in the spec's
// maps, e.g. a path or a config string) on the loader's or trainer's side.
using DatasetFactory = std::function<std::unique_ptr<Dataset>(const DatasetSpec&)>;
// Registers `factory` under `name` (make_dataset() then finds it); returns
// true so it can initialise a static. Prefer TROUPE_DATASET.
bool register_dataset(const std::string& name, DatasetFactory factory);

// Throws ConfigError if `spec` has a parameter not in `known`. The built-in
// factories call this; custom ones may too.
void check_known_parameters(const DatasetSpec& spec, const std::vector<std::string>& known);

}  // namespace troupe::actors

// At namespace scope in the user's binary:
//   TROUPE_DATASET("my_graphs", [](const troupe::actors::DatasetSpec& s) {
//     return std::make_unique<MyGraphs>(s.get_string("path"));
//   });
#define TROUPE_DATASET(name, factory)                                                 \
  static const bool TROUPE_REGISTRY_CONCAT(troupe_dataset_registered_, __COUNTER__) = \
      ::troupe::actors::register_dataset(name, factory)
