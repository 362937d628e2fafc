// The open data layer: TensorDict samples and batches, a data set's own
// collate (graph batching) inside the TBB pipeline, a collate that throws,
// user data sets registered by name, and data from files a Python user has
// (.npz stored and compressed, one .npy per key, token streams as raw
// uint16 .bin and uint32 .npy).
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "tests/actors/python_helper.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "troupe/actors/array_datasets.h"
#include "troupe/actors/batch_pipeline.h"
#include "troupe/actors/dataset.h"
#include "troupe/actors/graph_collate.h"
#include "troupe/actors/npy.h"
#include "troupe/runtime/core/errors.h"

using namespace troupe;
using namespace troupe::actors;

namespace {

// Graph i has i % 3 + 2 nodes in a chain: features [n, 2], edge_index [2, n-1].
class ChainGraphs final : public Dataset {
 public:
  explicit ChainGraphs(int64_t n, bool broken = false) : n_(n), broken_(broken) {}
  int64_t size() const override { return n_; }
  std::string describe() const override { return "chain_graphs"; }

  TensorDict collate(std::vector<Sample>&& samples) const override {
    if (broken_) throw std::runtime_error("edge_index out of range");
    return graph_collate(samples);
  }

 protected:
  Sample load(int64_t index, int64_t /*epoch*/) const override {
    const int64_t nodes = index % 3 + 2;
    auto x = torch::arange(nodes * 2, torch::kFloat).reshape({nodes, 2}) + static_cast<double>(index);
    auto src = torch::arange(nodes - 1, torch::kLong);
    return {{"x", x}, {"edge_index", torch::stack({src, src + 1})}, {"y", torch::scalar_tensor(double(index))}};
  }

 private:
  int64_t n_;
  bool broken_;
};

TROUPE_DATASET("test_chain_graphs",
               [](const DatasetSpec& s) { return std::make_unique<ChainGraphs>(s.get_int("size", 10)); });

TEST(TensorDict, NamesTheMissingKey) {
  TensorDict d{{"input", torch::ones({2})}, {"target", torch::Tensor()}};
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"input"}));
  EXPECT_FALSE(d.get("target").defined());
  try {
    d.at("edge_index");
    ADD_FAILURE() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'edge_index'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("input"), std::string::npos) << e.what();
  }
}

TEST(CustomCollate, GraphBatchesComeOutOfThePipeline) {
  auto ds = make_dataset(DatasetSpec("test_chain_graphs").set("size", 9));
  BatchPipeline pipeline(*ds, {.batch_size = 3, .num_threads = 2});
  std::vector<Batch> got;
  std::vector<int64_t> indices = {0, 1, 2, 3, 4, 5, 6, 7, 8};
  pipeline.run(indices, 0, [&](Batch&& b) { got.push_back(std::move(b)); });
  ASSERT_EQ(got.size(), 3u);
  // Graphs 0, 1, 2 have 2, 3, 4 nodes: 9 nodes, 6 edges.
  const auto& b = got[0].tensors;
  EXPECT_EQ(got[0].size(), 3);
  EXPECT_EQ(b.at("x").sizes(), (std::vector<int64_t>{9, 2}));
  EXPECT_EQ(b.at("edge_index").sizes(), (std::vector<int64_t>{2, 6}));
  auto batch = b.at("batch");
  EXPECT_TRUE(torch::equal(batch, torch::tensor({0, 0, 1, 1, 1, 2, 2, 2, 2}, torch::kLong)));
  // The second graph's edges start at its first node, 2.
  EXPECT_EQ(b.at("edge_index")[0][1].item<int64_t>(), 2);
  EXPECT_EQ(b.at("edge_index").max().item<int64_t>(), 8);
  EXPECT_TRUE(torch::equal(b.at("y"), torch::tensor({0.f, 1.f, 2.f})));
}

TEST(CustomCollate, GraphCollateNamesABadEdgeIndex) {
  std::vector<Sample> s = {{{"x", torch::zeros({2, 1})}, {"edge_index", torch::tensor({{0}, {1}}, torch::kLong)}},
                           {{"x", torch::zeros({2, 1})}, {"edge_index", torch::tensor({{0}, {2}}, torch::kLong)}}};
  try {
    graph_collate(s);
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sample 1 has an edge index outside its 2 nodes"), std::string::npos)
        << e.what();
  }
}

// Node and edge keys have a row per node and per edge of their sample, in
// every sample: rows out of line with the others' were concatenated into a
// batch whose rows no longer matched its nodes.
TEST(GraphCollate, KeysWithoutARowPerNodeOrEdgeAreNamed) {
  auto edge = torch::tensor({{0}, {1}}, torch::kLong);
  auto refused = [](const std::vector<Sample>& s, const std::string& says) {
    try {
      graph_collate(s);
      ADD_FAILURE() << "taken; expected: " << says;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  GraphKeys keys;
  keys.node = {"x", "pos"};
  auto collate = [&](const std::vector<Sample>& s) { return graph_collate(s, keys); };
  std::vector<Sample> two_rows = {{{"x", torch::zeros({5, 2})}, {"pos", torch::zeros({4, 3})}}};
  try {
    collate(two_rows);
    ADD_FAILURE() << "pos with 4 rows for 5 nodes was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sample 0 has"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("under 'pos'; it must have 5 rows, one per node"), std::string::npos)
        << e.what();
  }
  std::vector<Sample> missing = {{{"x", torch::zeros({5, 2})}, {"pos", torch::zeros({5, 3})}},
                                 {{"x", torch::zeros({4, 2})}}};
  try {
    collate(missing);
    ADD_FAILURE() << "pos in one sample of two was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sample 1 has no 'pos', which other samples have, though it has nodes (4)"),
              std::string::npos)
        << e.what();
  }
  refused({{{"x", torch::zeros({2, 1})}, {"edge_index", edge}, {"edge_attr", torch::zeros({3, 4})}}},
          "under 'edge_attr'; it must have 1 rows, one per edge");
  refused({{{"x", torch::zeros({2, 1})}, {"edge_attr", torch::zeros({1, 4})}}},
          "has 'edge_attr' but no edge index 'edge_index'");
  // What fits is taken: 2 + 3 nodes, 1 + 2 edges.
  auto ok = graph_collate({{{"x", torch::zeros({2, 1})}, {"edge_index", edge}, {"edge_attr", torch::ones({1, 4})}},
                           {{"x", torch::zeros({3, 1})},
                            {"edge_index", torch::tensor({{0, 1}, {1, 2}}, torch::kLong)},
                            {"edge_attr", torch::ones({2, 4})}}});
  EXPECT_EQ(ok.at("edge_attr").size(0), 3);
  EXPECT_EQ(ok.at("batch").size(0), 5);
  // A graph without edges (a single atom) may leave its edge keys out.
  auto atom = graph_collate({{{"x", torch::zeros({2, 1})}, {"edge_index", edge}, {"edge_attr", torch::ones({1, 4})}},
                             {{"x", torch::zeros({1, 1})}},
                             {{"x", torch::zeros({1, 1})}, {"edge_index", torch::zeros({2, 0}, torch::kLong)}}});
  EXPECT_EQ(atom.at("edge_attr").size(0), 1);
  EXPECT_EQ(atom.at("edge_index").size(1), 1);
  refused({{{"x", torch::zeros({2, 1})}, {"edge_index", edge}, {"edge_attr", torch::ones({1, 4})}},
           {{"x", torch::zeros({2, 1})}, {"edge_index", edge}}},
          "sample 1 has no 'edge_attr', which other samples have, though it has edges (1)");
}

TEST(CustomCollate, AThrowingCollateNamesTheDataSet) {
  ChainGraphs broken(6, /*broken=*/true);
  BatchPipeline pipeline(broken, {.batch_size = 2, .num_threads = 2});
  std::vector<int64_t> indices = {0, 1, 2, 3};
  try {
    pipeline.run(indices, 0, [](Batch&&) {});
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("collate of chain_graphs failed"), std::string::npos) << what;
    EXPECT_NE(what.find("edge_index out of range"), std::string::npos) << what;
    // Which samples: a collate names them by their place in the batch.
    EXPECT_TRUE(what.find("are data set indices 0, 1)") != std::string::npos ||
                what.find("are data set indices 2, 3)") != std::string::npos)
        << what;
  }
}

TEST(Registry, UnknownNamesListTheRegisteredOnes) {
  try {
    make_dataset(DatasetSpec("no_such_set"));
    ADD_FAILURE() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("test_chain_graphs"), std::string::npos) << e.what();
  }
}

// A name registered twice, or under a built-in name, was used silently:
// the later registration replaced the earlier (which one is later depends
// on the order of static initialisation) and a built-in shadowed the
// user's. Both are refused when the name is asked for, naming it. A
// factory's own exception arrives as a ConfigError naming what it made
// (a bare std::runtime_error escaped a driver's catch of troupe::Error).
struct TestFactory {
  int value;
};
TEST(Registry, ANameRegisteredTwiceOrUnderABuiltInIsRefusedNamingIt) {
  auto& registry = FactoryRegistry<TestFactory>::instance();
  registry.add("once", {1});
  registry.add("twice", {1});
  registry.add("twice", {2});
  registry.add("builtin", {3});
  EXPECT_NO_THROW(registry.check("once", false, "model", "TROUPE_MODEL"));
  EXPECT_NO_THROW(registry.check("unregistered", true, "model", "TROUPE_MODEL"));
  auto refused = [&](const std::string& name, bool builtin, const std::string& says) {
    try {
      registry.check(name, builtin, "model", "TROUPE_MODEL");
      ADD_FAILURE() << name << " was taken";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused("twice", false, "model 'twice' is registered twice (TROUPE_MODEL with that name twice");
  refused("builtin", true, "model 'builtin' is a built-in name: the TROUPE_MODEL of that name is never used");
  EXPECT_EQ(registry.names({"builtin", "mlp"}), (std::vector<std::string>{"builtin", "mlp", "once", "twice"}));
  try {
    run_factory("dataset 'waves'", []() -> int { throw std::runtime_error("cannot open /data/waves.bin"); });
    ADD_FAILURE() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "dataset 'waves' could not be made: std::runtime_error: cannot open /data/waves.bin");
  }
  EXPECT_THROW(run_factory("x", []() -> int { throw troupe::Timeout("troupe's own"); }), troupe::Timeout);
}

class FileData : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_ = troupe::test::fresh_dir("open-data");
};

TEST_F(FileData, NpzStoredAndCompressedAndNpyByKey) {
  if (!python_has_numpy()) GTEST_SKIP() << "no /usr/bin/python3 with numpy";
  run_python("import numpy as np\nd = '" + dir_.string() +
             "'\n"
             "x = np.arange(40, dtype=np.float32).reshape(10, 4) / 3\n"
             "y = np.arange(10, dtype=np.int64) % 3\n"
             "w = np.linspace(0, 1, 10)\n"
             "np.savez(d + '/plain.npz', features=x, label=y, weight=w)\n"
             "np.savez_compressed(d + '/packed.npz', features=x, label=y, weight=w)\n"
             "np.save(d + '/x.npy', x)\nnp.save(d + '/y.npy', y)\n"
             "np.savez(d + '/ragged.npz', a=x, b=y[:7])\n"
             "np.savez(d + '/hollow.npz', a=np.empty((2**40, 0)), b=np.empty((2**40, 0), dtype=np.int8))\n");
  auto x = torch::arange(40, torch::kFloat).reshape({10, 4}) / 3;
  for (const char* name : {"plain.npz", "packed.npz"}) {
    auto ds = make_dataset(DatasetSpec("npz").set("path", path(name)));
    ASSERT_EQ(ds->size(), 10) << name;
    auto s = ds->get(7);
    EXPECT_EQ(s.keys(), (std::vector<std::string>{"features", "label", "weight"})) << name;
    EXPECT_TRUE(torch::allclose(s.at("features"), x[7])) << name;
    EXPECT_EQ(s.at("label").item<int64_t>(), 1) << name;
    EXPECT_NEAR(s.at("weight").item<double>(), 7.0 / 9.0, 1e-12) << name;
  }
  auto arrays = make_dataset(DatasetSpec("arrays").set("input", path("x.npy")).set("target", path("y.npy")));
  ASSERT_EQ(arrays->size(), 10);
  EXPECT_TRUE(torch::allclose(arrays->get(3).at("input"), x[3]));
  try {
    make_dataset(DatasetSpec("npz").set("path", path("ragged.npz")));
    ADD_FAILURE() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'b' has 7 rows"), std::string::npos) << e.what();
  }
  // Rows of nothing: 2**40 of them in a few hundred bytes.
  try {
    make_dataset(DatasetSpec("npz").set("path", path("hollow.npz")));
    ADD_FAILURE() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("1099511627776 rows hold no data"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("has shape (1099511627776, 0)"), std::string::npos) << e.what();
  }
}

namespace {
// This process's resident memory in MiB.
double resident_mib() {
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}
}  // namespace

// A compressed member is inflated when its data is first read, not when the
// archive is opened: counting samples (the driver) or being fed by loaders
// (a trainer) used to cost a whole inflated copy of the data set.
TEST_F(FileData, ACompressedArrayIsInflatedOnlyWhenItsDataIsRead) {
  if (!python_has_numpy()) GTEST_SKIP() << "no /usr/bin/python3 with numpy";
  run_python(
      "import numpy as np\n"
      "x = np.zeros((65536, 256), dtype=np.float32)\n"  // 64 MiB
      "x[-1] = np.arange(256)\n"
      "np.savez_compressed('" +
      path("big.npz") + "', input=x, target=np.arange(65536) % 7)\n");
  const double before = resident_mib();
  auto ds = make_dataset(DatasetSpec("npz").set("path", path("big.npz")));
  ASSERT_EQ(ds->size(), 65536);
  const double opened = resident_mib();
  EXPECT_LT(opened - before, 24) << "opening the archive took " << opened - before << " MiB";
  auto last = ds->get(65535);
  EXPECT_TRUE(torch::equal(last.at("input"), torch::arange(256, torch::kFloat)));
  EXPECT_EQ(last.at("target").item<int64_t>(), 65535 % 7);
  EXPECT_GT(resident_mib() - before, 56) << "the 64 MiB array was not inflated when read";
  // Many threads reading at once inflate it once and all see it.
  std::vector<std::thread> readers;
  std::atomic<int> right{0};
  auto again = make_dataset(DatasetSpec("npz").set("path", path("big.npz")));
  for (int t = 0; t < 4; ++t)
    readers.emplace_back([&] {
      if (torch::equal(again->get(65535).at("input"), torch::arange(256, torch::kFloat))) ++right;
    });
  for (auto& r : readers) r.join();
  EXPECT_EQ(right.load(), 4);
}

namespace {
// This process's peak resident memory in MiB since reset_peak_resident().
double peak_resident_mib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  return 0;
}
void reset_peak_resident() { std::ofstream("/proc/self/clear_refs") << "5"; }
}  // namespace

// A compressed member whose header is refused (here fortran order) is
// refused from the header's bytes: the whole member was inflated first
// (64 MiB here; 4 GB of a 4 MB archive of zeros) to say the same thing.
TEST_F(FileData, ACompressedMemberWithARefusedHeaderIsNotInflated) {
  if (!python_has_numpy()) GTEST_SKIP() << "no /usr/bin/python3 with numpy";
  run_python(
      "import numpy as np\n"
      "x = np.asfortranarray(np.zeros((4096, 4096), dtype=np.float32))\n"  // 64 MiB
      "np.savez_compressed('" +
      path("fortran.npz") + "', input=x, target=np.arange(4096))\n");
  reset_peak_resident();
  const double before = peak_resident_mib();
  try {
    make_dataset(DatasetSpec("npz").set("path", path("fortran.npz")));
    ADD_FAILURE() << "a fortran-order member was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("fortran_order"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fortran.npz"), std::string::npos) << e.what();
  }
  EXPECT_LT(peak_resident_mib() - before, 24) << "the member was inflated to refuse its header";
}

// A deflated member is inflated from the archive's mapping when first read:
// an archive written in place since it was opened is refused, naming it,
// as a mapped .npy is (it read as a CRC error, or faulted past a shorter
// end).
TEST_F(FileData, ACompressedArchiveWrittenInPlaceBeforeItsFirstReadIsRefused) {
  if (!python_has_numpy()) GTEST_SKIP() << "no /usr/bin/python3 with numpy";
  const std::string save = "import numpy as np\np = '" + path("val.npz") + "'\n";
  run_python(save + "np.savez_compressed(p, x=np.arange(65536, dtype=np.float32).reshape(4096, 16))\n");
  auto ds = make_dataset(DatasetSpec("npz").set("path", path("val.npz")));
  run_python(save + "np.savez_compressed(p, x=np.random.default_rng(0).random((8192, 16)).astype(np.float32))\n");
  try {
    (void)ds->get(0);
    ADD_FAILURE() << "the rewritten archive was read";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'" + path("val.npz") + "' was written while the job read it"),
              std::string::npos)
        << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not named as rewritten: " << e.what();
  }
}

// image_records' .npy files stay mapped: one written in place while a job
// reads it is refused, naming it, as the other .npy data sets do (its new
// pixels were trained on, or a shorter file faulted the loader).
TEST_F(FileData, ImageRecordsWrittenInPlaceAreRefusedNamingThem) {
  if (!python_has_numpy()) GTEST_SKIP() << "no /usr/bin/python3 with numpy";
  const std::string save = "import numpy as np\nd = '" + dir_.string() + "'\n";
  run_python(save +
             "np.save(d + '/imgs.npy', np.zeros((16, 3, 8, 8), dtype=np.uint8))\n"
             "np.save(d + '/labels.npy', np.arange(16, dtype=np.int64))\n");
  auto ds = make_dataset(DatasetSpec("image_records").set("path", path("imgs.npy")).set("labels", path("labels.npy")));
  EXPECT_EQ(ds->get(3).at("target").item<int64_t>(), 3);
  run_python(save + "np.save(d + '/imgs.npy', np.full((16, 3, 8, 8), 9, dtype=np.uint8))\n");  // same size
  std::string error;
  EXPECT_TRUE(troupe::test::eventually([&] {
    try {
      (void)ds->get(1);
      (void)ds->load_batch({1, 2}, 0);
    } catch (const ConfigError& e) {
      error = e.what();
      return true;
    }
    return false;
  })) << "the rewritten images were read on";
  EXPECT_NE(error.find("'" + path("imgs.npy") + "' was written while the job read it"), std::string::npos) << error;
}

// A compressed member whose bytes are not those written (its CRC-32 in the
// archive differs) is refused when it is inflated whole, naming it: it was
// trained on as it came out.
TEST_F(FileData, ACompressedMemberWhoseCrcDiffersIsRefusedNamingIt) {
  if (!python_has_numpy()) GTEST_SKIP() << "no /usr/bin/python3 with numpy";
  run_python(
      "import numpy as np\n"
      "p = '" +
      path("crc.npz") +
      "'\n"
      "np.savez_compressed(p, input=np.arange(64, dtype=np.float32).reshape(16, 4), target=np.arange(16))\n"
      "b = bytearray(open(p, 'rb').read())\n"
      "at = b.find(b'PK\\x01\\x02')\n"  // the first member's central directory entry
      "b[at + 16] ^= 0xFF\n"            // its CRC-32
      "open(p, 'wb').write(bytes(b))\n");
  try {
    // A small member is inflated whole at the open, a big one at its
    // first read: either is checked.
    make_dataset(DatasetSpec("npz").set("path", path("crc.npz")))->get(3);
    ADD_FAILURE() << "a member with a wrong CRC-32 was read";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("do not match the archive's CRC-32"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("crc.npz"), std::string::npos) << e.what();
  }
}

// A data file written in place while a job reads it (np.savez to the
// same path truncates it, then writes): its mapping would read the new
// bytes, zeros past a shorter end, or die of SIGBUS. The next sample read
// says so, naming the file. One renamed over it is another file: the
// mapping reads on from the old one.
TEST_F(FileData, AFileWrittenInPlaceWhileReadIsRefusedNamingIt) {
  if (!python_has_numpy()) GTEST_SKIP() << "no /usr/bin/python3 with numpy";
  const std::string save = "import numpy as np, os\nd = '" + dir_.string() + "'\n";
  run_python(save +
             "np.savez(d + '/live.npz', x=np.arange(4096, dtype=np.float32).reshape(1024, 4))\n"
             "np.savez(d + '/other.npz', x=np.zeros((8, 4), dtype=np.float32))\n");
  auto renamed = make_dataset(DatasetSpec("npz").set("path", path("live.npz")));
  EXPECT_EQ(renamed->get(5).at("x")[0].item<float>(), 20.0f);
  run_python(save + "os.rename(d + '/other.npz', d + '/live.npz')\n");
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  while (std::chrono::steady_clock::now() < until)  // past the 100 ms between looks, twice
    EXPECT_EQ(renamed->get(5).at("x")[0].item<float>(), 20.0f);

  auto ds = make_dataset(DatasetSpec("npz").set("path", path("live.npz")));
  EXPECT_EQ(ds->get(3).at("x")[0].item<float>(), 0.0f);
  run_python(save + "np.savez(d + '/live.npz', x=np.ones((2, 4), dtype=np.float32))\n");  // in place
  std::string error;
  EXPECT_TRUE(troupe::test::eventually([&] {
    try {
      (void)ds->get(1);
    } catch (const ConfigError& e) {
      error = e.what();
      return true;
    }
    return false;
  })) << "the rewritten file was read on";
  EXPECT_NE(error.find("npz file '" + path("live.npz") + "' was written while the job read it"), std::string::npos)
      << error;
}

// A file cut short under its mapping (np.save truncates, then writes) is
// read within the 100 ms between looks: the read faulted (SIGBUS) and the
// loader died; its replacement then trained on the new data unsaid. The
// fault is the ConfigError naming the file, and the process lives on.
TEST_F(FileData, AFileCutShortUnderARowBeingReadIsRefusedNotFatal) {
  const std::string file = path("cut.npy");
  troupe::actors::write_npy(file, torch::ones({4096, 1024}, torch::kFloat));  // 16 MiB
  auto a = troupe::actors::NpyArray::open(file);
  EXPECT_EQ(a.row(0)[0].item<float>(), 1.0f);  // and the look at the file, for the next 100 ms
  ASSERT_EQ(::truncate(file.c_str(), 256), 0);
  try {
    (void)a.row(4000);
    ADD_FAILURE() << "a row past the file's new end was read";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'" + file + "' was written while the job read it"), std::string::npos)
        << e.what();
  }
  // Reads go on being refused, not fatal.
  EXPECT_THROW((void)a.row(4001), ConfigError);
}

TEST_F(FileData, NotAZipIsNamed) {
  std::ofstream(path("junk.npz")) << "this is not a zip archive at all, just some text";
  try {
    NpyArray::open_npz(path("junk.npz"));
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("junk.npz"), std::string::npos) << e.what();
  }
}

TEST_F(FileData, TokenStreamWindowsFromBinAndNpy) {
  // 0, 1, ..., 99 and then 65535, as raw uint16.
  std::vector<uint16_t> tokens(101);
  for (size_t i = 0; i < 100; ++i) tokens[i] = static_cast<uint16_t>(i);
  tokens[100] = 65535;
  {
    std::ofstream f(path("train.bin"), std::ios::binary);
    f.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
  }
  auto ds = make_dataset(DatasetSpec("token_stream").set("path", path("train.bin")).set("block_size", 10));
  ASSERT_EQ(ds->size(), 10);  // (101 - 11) / 10 + 1
  auto s = ds->get(2);
  EXPECT_TRUE(torch::equal(s.at("input"), torch::arange(20, 30, torch::kLong)));
  EXPECT_TRUE(torch::equal(s.at("target"), torch::arange(21, 31, torch::kLong)));
  EXPECT_EQ(ds->get(9).at("target")[9].item<int64_t>(), 65535);  // read unsigned

  auto overlapping =
      make_dataset(DatasetSpec("token_stream").set("path", path("train.bin")).set("block_size", 10).set("stride", 1));
  EXPECT_EQ(overlapping->size(), 91);

  if (python_has_numpy()) {
    run_python("import numpy as np\nnp.save('" + path("ids.npy") +
               "', np.array([4000000000, 1, 2, 3, 4, 5], dtype=np.uint32))\n");
    auto npy = make_dataset(DatasetSpec("token_stream").set("path", path("ids.npy")).set("block_size", 2));
    ASSERT_EQ(npy->size(), 2);
    EXPECT_EQ(npy->get(0).at("input")[0].item<int64_t>(), 4000000000LL);
  }
  try {
    make_dataset(DatasetSpec("token_stream").set("path", path("train.bin")).set("block_size", 200));
    ADD_FAILURE() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train.bin"), std::string::npos) << e.what();
  }
}

}  // namespace
