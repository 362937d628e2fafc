// Data sets: specs and the factory, synthetic sets, .npy files (round trips,
// NumPy-written files, corrupt/missing/Fortran files), digits, image
// records and their transforms.
#include <gtest/gtest.h>

#include <unistd.h>
#include <numeric>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "tests/actors/python_helper.h"
#include "troupe/actors/batch.h"
#include "troupe/actors/batch_pipeline.h"
#include "troupe/actors/dataset.h"
#include "troupe/actors/digits_dataset.h"
#include "troupe/actors/image_dataset.h"
#include "troupe/actors/npy.h"
#include "troupe/actors/synthetic_dataset.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/files.h"

namespace troupe::actors {
namespace {

// A tensor's values as int64s, for readable EXPECT_EQs.
std::vector<int64_t> to_longs(const torch::Tensor& t) {
  auto c = t.to(torch::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

namespace fs = std::filesystem;

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "troupe_actors_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { troupe::core::remove_tree(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

// Expects `f` to throw troupe::Error with every one of `parts` in the message.
template <class F>
void expect_error_mentions(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

bool same_tensor(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() == b.defined() &&
         (!a.defined() || (a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.equal(b)));
}

// --- specs and the factory ---

TEST(DatasetSpec, TypedParametersAndWireRoundTrip) {
  DatasetSpec spec("image_records");
  spec.set("size", 10).set("crop", 4).set("flip", true).set("mean", {0.5, 0.4, 0.3}).set("scale", 0.5);
  spec.set("path", "x.npy").set("path", std::string("y.npy"));  // replaces
  EXPECT_EQ(spec.get_int("size", 0), 10);
  EXPECT_EQ(spec.get_int("flip", 0), 1);
  EXPECT_EQ(spec.get_double("size", 0), 10.0);  // ints read as doubles
  EXPECT_EQ(spec.get_list("mean"), (std::vector<double>{0.5, 0.4, 0.3}));
  EXPECT_EQ(spec.get_string("path"), "y.npy");
  EXPECT_EQ(spec.get_int("missing", 7), 7);
  EXPECT_THROW(spec.get_int("scale", 0), ConfigError);
  EXPECT_THROW(spec.get_string("size"), ConfigError);
  auto bytes = wire::encode_value(spec).bytes();
  auto back = wire::decode_value<DatasetSpec>(bytes);
  EXPECT_EQ(back.to_string(), spec.to_string());
  EXPECT_EQ(back.keys(), spec.keys());
}

TEST(DatasetSpec, FactoryNamesBadNamesAndParameters) {
  expect_error_mentions([] { make_dataset(DatasetSpec("imagenet")); }, {"imagenet", "synthetic_classification"});
  expect_error_mentions([] { make_dataset(DatasetSpec("synthetic_regression").set("nosie", 0.1)); },
                        {"nosie", "synthetic_regression"});
  expect_error_mentions([] { make_dataset(DatasetSpec("synthetic_classification").set("num_classes", 0)); },
                        {"num_classes", "0"});
  expect_error_mentions([] { make_dataset(DatasetSpec("synthetic_classification").set("size", "many")); },
                        {"size", "integer"});
  expect_error_mentions([] { make_dataset(DatasetSpec("npy")); }, {"inputs", "required"});
  expect_error_mentions(
      [] {
        make_dataset(DatasetSpec("image_records").set("mean", {0.5}).set("std", {0.2, 0.2}));
      },
      {"mean", "std"});
  EXPECT_THROW(make_dataset(DatasetSpec("digits").set("normalize", 2)), ConfigError);
}

// The parameters that name files (what a driver ships, and what a trainer
// checks is on its host): the built-in readers' paths, nothing of a
// registered or synthetic data set, no empty value.
TEST(DatasetSpec, FileKeysAreTheBuiltInReadersPaths) {
  using troupe::actors::DatasetSpec;
  using troupe::actors::file_keys;
  using Keys = std::vector<std::string>;
  EXPECT_EQ(file_keys(DatasetSpec("npz").set("path", "/d/train.npz")), Keys{"path"});
  EXPECT_EQ(file_keys(DatasetSpec("npy").set("inputs", "x.npy").set("targets", "y.npy")), (Keys{"inputs", "targets"}));
  EXPECT_EQ(file_keys(DatasetSpec("arrays").set("image", "i.npy").set("label", "l.npy")), (Keys{"image", "label"}));
  EXPECT_EQ(file_keys(DatasetSpec("image_records").set("path", "r.npy").set("labels", "l.npy").set("crop", 2)),
            (Keys{"path", "labels"}));
  EXPECT_EQ(file_keys(DatasetSpec("digits").set("path", "")), Keys{});
  EXPECT_EQ(file_keys(DatasetSpec("classification").set("size", 10)), Keys{});
  EXPECT_EQ(file_keys(DatasetSpec("my_shards").set("path", "s3://bucket/x")), Keys{});
}

TEST(DatasetSpec, FactoryBuildsEachBuiltIn) {
  auto c = make_dataset(DatasetSpec("synthetic_classification").set("size", 50).set("num_classes", 3));
  EXPECT_EQ(c->size(), 50);
  auto r = make_dataset(DatasetSpec("synthetic_regression").set("size", 20).set("num_outputs", 2));
  EXPECT_EQ(r->get(3).get("target").sizes(), (std::vector<int64_t>{2}));
  auto im = make_dataset(DatasetSpec("image_records")
                             .set("size", 8)
                             .set("height", 10)
                             .set("width", 12)
                             .set("crop", 6)
                             .set("flip", 1)
                             .set("mean", {0.5, 0.5, 0.5})
                             .set("std", {0.25, 0.25, 0.25}));
  EXPECT_EQ(im->get(7).at("input").sizes(), (std::vector<int64_t>{3, 6, 6}));
  // The built-ins, then the names this binary registered (TROUPE_DATASET).
  auto names = dataset_names();
  std::vector<std::string> built_in(names.begin(), names.begin() + 8);
  EXPECT_EQ(built_in, (std::vector<std::string>{"synthetic_classification", "synthetic_regression", "npy", "digits",
                                                "image_records", "npz", "arrays", "token_stream"}));
}

// --- synthetic ---

TEST(SyntheticDatasets, ReproducibleFromSeedAndIndexAlone) {
  SyntheticClassification a({.size = 300, .num_features = 5, .num_classes = 3, .seed = 9});
  SyntheticClassification b({.size = 300, .num_features = 5, .num_classes = 3, .seed = 9});
  SyntheticClassification other({.size = 300, .num_features = 5, .num_classes = 3, .seed = 10});
  std::set<int64_t> labels;
  // Any order, any instance: the same sample.
  for (int64_t i = 299; i >= 0; i -= 7) {
    auto x = a.get(i);
    auto y = b.get(i);
    EXPECT_TRUE(same_tensor(x.at("input"), y.at("input")) && same_tensor(x.get("target"), y.get("target"))) << i;
    EXPECT_EQ(x.at("input").scalar_type(), torch::kFloat);
    EXPECT_EQ(x.get("target").scalar_type(), torch::kLong);
    labels.insert(x.get("target").item<int64_t>());
  }
  EXPECT_EQ(labels, (std::set<int64_t>{0, 1, 2}));
  EXPECT_FALSE(same_tensor(a.get(5).at("input"), other.get(5).at("input")));
  EXPECT_THROW(a.get(300), Error);
  EXPECT_THROW(a.get(-1), Error);

  SyntheticRegression r({.size = 100, .num_features = 4, .num_outputs = 2, .seed = 1, .noise = 0.0});
  for (int64_t i : {0, 17, 99}) {
    auto s = r.get(i);
    auto expect = torch::matmul(r.weights(), s.at("input")) + r.bias();
    EXPECT_TRUE(torch::allclose(s.get("target"), expect, 1e-5, 1e-5));
  }
}

// --- .npy ---

class Npy : public TempDir {};

TEST_F(Npy, RoundTripsEveryDtype) {
  std::vector<torch::Tensor> tensors = {
      torch::arange(24, torch::kFloat).reshape({2, 3, 4}),
      torch::randn({5, 7}, torch::kDouble),
      torch::arange(-5, 5, torch::kLong),
      torch::arange(12, torch::kInt).reshape({3, 4}),
      torch::arange(200, torch::kShort).reshape({10, 20}),
      torch::randint(0, 255, {4, 3, 2}, torch::kByte),
      torch::randint(-100, 100, {6}, torch::kChar),
      torch::rand({3, 3}) > 0.5,
      torch::randn({2, 2}).to(torch::kHalf),
      torch::scalar_tensor(3.5, torch::kFloat),
      torch::empty({0, 3}, torch::kFloat),
      torch::arange(12, torch::kFloat).reshape({3, 4}).t(),  // non-contiguous
  };
  for (size_t k = 0; k < tensors.size(); ++k) {
    auto p = path("t" + std::to_string(k) + ".npy");
    write_npy(p, tensors[k]);
    auto a = NpyArray::open(p);
    EXPECT_TRUE(same_tensor(a.tensor(), tensors[k].contiguous())) << k;
    if (tensors[k].dim() > 0 && tensors[k].size(0) > 0) {
      EXPECT_TRUE(same_tensor(a.row(0), tensors[k][0])) << k;
    }
  }
  // The view outlives the handle: the mapping goes with the last tensor.
  torch::Tensor view;
  {
    write_npy(path("keep.npy"), torch::arange(10, torch::kFloat));
    view = NpyArray::open(path("keep.npy")).tensor();
  }
  EXPECT_EQ(view[9].item<float>(), 9.0f);
}

// Writes a .npy by hand: any version, any header text, `data_bytes` bytes.
void write_raw_npy(const std::string& path, int major, const std::string& dict, const std::string& data) {
  std::string header = dict;
  size_t prefix = major == 1 ? 10 : 12;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::string out = std::string("\x93NUMPY", 6);
  out.push_back(char(major));
  out.push_back(0);
  uint32_t len = header.size();
  out.append(reinterpret_cast<const char*>(&len), major == 1 ? 2 : 4);
  out += header;
  out += data;
  std::ofstream(path, std::ios::binary) << out;
}

TEST_F(Npy, ReadsVersionsTwoAndThree) {
  std::string data(6 * sizeof(float), '\0');
  float values[6] = {1, 2, 3, 4, 5, 6};
  std::memcpy(data.data(), values, sizeof values);
  for (int major : {1, 2, 3}) {
    auto p = path("v" + std::to_string(major) + ".npy");
    write_raw_npy(p, major, "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2, 3)}", data);
    auto a = NpyArray::open(p);
    EXPECT_EQ(a.shape(), (std::vector<int64_t>{2, 3}));
    EXPECT_TRUE(same_tensor(a.tensor(), torch::arange(1, 7, torch::kFloat).reshape({2, 3})));
  }
}

TEST_F(Npy, ErrorsNameTheFileAndTheProblem) {
  std::string good = path("good.npy");
  write_npy(good, torch::arange(100, torch::kDouble).reshape({10, 10}));
  auto bytes = fs::file_size(good);

  expect_error_mentions([&] { NpyArray::open(path("missing.npy")); }, {"missing.npy", "No such file"});

  std::string truncated = path("truncated.npy");
  fs::copy_file(good, truncated);
  fs::resize_file(truncated, bytes - 8);
  expect_error_mentions([&] { NpyArray::open(truncated); }, {"truncated.npy", "truncated"});

  std::string header_cut = path("header_cut.npy");
  fs::copy_file(good, header_cut);
  fs::resize_file(header_cut, 30);
  expect_error_mentions([&] { NpyArray::open(header_cut); }, {"header_cut.npy", "truncated"});

  std::string empty = path("empty.npy");
  std::ofstream(empty).close();
  expect_error_mentions([&] { NpyArray::open(empty); }, {"empty.npy", "truncated"});

  std::string garbage = path("garbage.npy");
  std::ofstream(garbage) << "this is not numpy at all, just some text";
  expect_error_mentions([&] { NpyArray::open(garbage); }, {"garbage.npy", "not a .npy"});

  std::string fortran = path("fortran.npy");
  write_raw_npy(fortran, 1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", std::string(24, '\0'));
  expect_error_mentions([&] { NpyArray::open(fortran); }, {"fortran.npy", "fortran_order"});

  std::string big_endian = path("big.npy");
  write_raw_npy(big_endian, 1, "{'descr': '>f8', 'fortran_order': False, 'shape': (3,), }", std::string(24, '\0'));
  expect_error_mentions([&] { NpyArray::open(big_endian); }, {"big.npy", "big-endian"});

  std::string u32 = path("u32.npy");
  write_raw_npy(u32, 1, "{'descr': '<u4', 'fortran_order': False, 'shape': (3,), }", std::string(12, '\0'));
  expect_error_mentions([&] { NpyArray::open(u32); }, {"u32.npy", "unsigned"});

  std::string structured = path("structured.npy");
  write_raw_npy(structured, 1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }",
                std::string(12, '\0'));
  expect_error_mentions([&] { NpyArray::open(structured); }, {"structured.npy", "structured"});

  std::string bad_dict = path("bad_dict.npy");
  write_raw_npy(bad_dict, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3, x), }", std::string(12, '\0'));
  expect_error_mentions([&] { NpyArray::open(bad_dict); }, {"bad_dict.npy", "corrupt header"});

  std::string v9 = path("v9.npy");
  write_raw_npy(v9, 9, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", std::string(12, '\0'));
  expect_error_mentions([&] { NpyArray::open(v9); }, {"v9.npy", "version 9"});

  // The data set and the factory say which file, too.
  expect_error_mentions([&] { make_dataset(DatasetSpec("npy").set("inputs", truncated)); }, {"truncated.npy"});
  expect_error_mentions([&] { NpyDataset(good, path("nope.npy")); }, {"nope.npy"});
  std::string short_targets = path("short_targets.npy");
  write_npy(short_targets, torch::zeros({9}, torch::kLong));
  expect_error_mentions([&] { NpyDataset(good, short_targets); }, {"short_targets.npy", "9 rows"});
}

// np.empty((2**40, 0)) is a valid .npy of a few bytes that claims 2**40
// rows: a data set of it made the loader's order of 2**40 indices
// (std::bad_alloc, the loader gone) instead of an error naming the file.
TEST_F(Npy, RowsThatHoldNoDataAreRefusedNamingTheShape) {
  const std::string empty_rows = path("empty_rows.npy");
  write_raw_npy(empty_rows, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 0), }", "");
  expect_error_mentions([&] { NpyDataset{empty_rows}; },
                        {"1099511627776 rows hold no data", "'" + empty_rows + "' has shape (1099511627776, 0)"});
  expect_error_mentions([&] { make_dataset(DatasetSpec("npy").set("inputs", empty_rows)); }, {"empty_rows.npy"});
  const std::string images = path("no_pixels.npy");
  write_raw_npy(images, 1, "{'descr': '|u1', 'fortran_order': False, 'shape': (4096, 3, 0, 8), }", "");
  expect_error_mentions([&] { ImageRecordDataset::from_npy(images, "", {}); }, {"no_pixels.npy", "rows hold no data"});

  // Rows of data beside them, or no rows at all, are a data set.
  const std::string labels = path("labels.npy");
  write_raw_npy(labels, 1, "{'descr': '<i8', 'fortran_order': False, 'shape': (2, 0), }", "");
  const std::string inputs = path("inputs.npy");
  write_npy(inputs, torch::zeros({2, 3}));
  EXPECT_EQ(NpyDataset(inputs, labels).size(), 2);
  const std::string none = path("none.npy");
  write_raw_npy(none, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 3), }", "");
  EXPECT_EQ(NpyDataset(none).size(), 0);
}

TEST_F(Npy, ReadsWhatNumPyWrites) {
  if (!python_has_numpy()) GTEST_SKIP() << "no /usr/bin/python3 with numpy";
  run_python(
      "import numpy as np\n"
      "d = '" +
      dir_.string() +
      "'\n"
      "x = np.arange(60, dtype=np.float32).reshape(5, 3, 4) / 7\n"
      "np.save(d + '/x.npy', x)\n"
      "np.save(d + '/y.npy', np.array([3, 1, 4, 1, 5], dtype=np.int64))\n"
      "np.save(d + '/b.npy', np.array([[True, False], [False, True]]))\n"
      "np.save(d + '/u8.npy', np.arange(24, dtype=np.uint8).reshape(2, 3, 2, 2))\n"
      "np.save(d + '/i32.npy', np.array([-1, 2, -3], dtype=np.int32))\n"
      "np.save(d + '/f64.npy', np.linspace(0, 1, 11))\n"
      "np.save(d + '/fortran.npy', np.asfortranarray(np.ones((3, 4))))\n"
      "with open(d + '/v2.npy', 'wb') as f:\n"
      "    np.lib.format.write_array(f, x, version=(2, 0))\n"
      "with open(d + '/v3.npy', 'wb') as f:\n"
      "    np.lib.format.write_array(f, x, version=(3, 0))\n");
  auto x = torch::arange(60, torch::kFloat).reshape({5, 3, 4}) / 7;
  for (const char* name : {"x.npy", "v2.npy", "v3.npy"}) {
    EXPECT_TRUE(torch::allclose(NpyArray::open(path(name)).tensor(), x)) << name;
  }
  EXPECT_TRUE(same_tensor(NpyArray::open(path("b.npy")).tensor(), torch::eye(2, torch::kBool)));
  EXPECT_TRUE(
      same_tensor(NpyArray::open(path("u8.npy")).tensor(), torch::arange(24, torch::kByte).reshape({2, 3, 2, 2})));
  EXPECT_TRUE(same_tensor(NpyArray::open(path("i32.npy")).tensor(), torch::tensor({-1, 2, -3}, torch::kInt)));
  EXPECT_TRUE(torch::allclose(NpyArray::open(path("f64.npy")).tensor(), torch::linspace(0, 1, 11, torch::kDouble)));
  expect_error_mentions([&] { NpyArray::open(path("fortran.npy")); }, {"fortran.npy", "fortran_order"});

  NpyDataset ds(path("x.npy"), path("y.npy"));
  ASSERT_EQ(ds.size(), 5);
  EXPECT_TRUE(torch::allclose(ds.get(2).at("input"), x[2]));
  EXPECT_EQ(ds.get(2).get("target").item<int64_t>(), 4);

  // And NumPy reads what write_npy writes.
  write_npy(path("from_cpp.npy"), torch::arange(6, torch::kLong).reshape({2, 3}));
  auto out = run_python("import numpy as np\na = np.load('" + path("from_cpp.npy") +
                        "')\nprint(a.dtype, a.shape, a.sum(), a.flags['C_CONTIGUOUS'])\n");
  EXPECT_EQ(out, "int64 (2, 3) 15 True\n");
}

// --- digits ---

TEST(Digits, LoadsTheScikitLearnSet) {
  if (find_digits_file().empty()) GTEST_SKIP() << "python3-sklearn's digits.csv.gz not installed";
  DigitsDataset ds;
  ASSERT_EQ(ds.size(), 1797);
  auto first = ds.get(0);
  EXPECT_EQ(first.at("input").sizes(), (std::vector<int64_t>{64}));
  EXPECT_EQ(first.get("target").item<int64_t>(), 0);
  // The first row of sklearn's load_digits().data.
  EXPECT_EQ(to_longs(first.at("input").slice(0, 0, 8)), (std::vector<int64_t>{0, 0, 5, 13, 9, 1, 0, 0}));
  auto counts = torch::bincount(ds.labels());
  ASSERT_EQ(counts.size(0), 10);
  for (int64_t c = 0; c < 10; ++c) EXPECT_GT(counts[c].item<int64_t>(), 170) << c;
  EXPECT_EQ(ds.images().max().item<float>(), 16.0f);
  DigitsDataset img({.normalize = true, .image = true});
  EXPECT_EQ(img.get(5).at("input").sizes(), (std::vector<int64_t>{1, 8, 8}));
  EXPECT_LE(img.images().max().item<float>(), 1.0f);
  auto via_spec = make_dataset(DatasetSpec("digits").set("normalize", 1));
  EXPECT_EQ(via_spec->size(), 1797);
}

TEST(Digits, MissingFileIsNamed) {
  expect_error_mentions([] { DigitsDataset({.path = "/nonexistent/digits.csv.gz"}); }, {"/nonexistent/digits.csv.gz"});
}

// --- image records and transforms ---

TEST(ImageTransforms, MatchReferenceOpsAndAreDeterministic) {
  auto image = torch::randint(0, 256, {3, 16, 20}, torch::kByte);
  ImageTransformOptions o{.crop = 12, .flip = true, .mean = {0.4, 0.5, 0.6}, .std = {0.2, 0.25, 0.3}, .seed = 4};
  int flips = 0;
  std::set<std::pair<int64_t, int64_t>> corners;
  for (int64_t index = 0; index < 200; ++index) {
    auto d = draw_image_transform(o, 16, 20, /*epoch=*/1, index);
    ASSERT_TRUE(d.top >= 0 && d.top <= 4 && d.left >= 0 && d.left <= 8);
    flips += d.flip;
    corners.insert({d.top, d.left});
    auto out = transform_image(image, o, 1, index);
    // The same thing with plain tensor ops (torchvision's order).
    auto ref = image.slice(1, d.top, d.top + 12).slice(2, d.left, d.left + 12).to(torch::kFloat) / 255.0;
    if (d.flip) ref = ref.flip({2});
    ref = (ref - torch::tensor({0.4, 0.5, 0.6}).view({3, 1, 1})) / torch::tensor({0.2, 0.25, 0.3}).view({3, 1, 1});
    ASSERT_TRUE(torch::allclose(out, ref.to(torch::kFloat), 1e-5, 1e-5)) << index;
    ASSERT_TRUE(same_tensor(out, transform_image(image, o, 1, index)));
  }
  EXPECT_GT(flips, 70);
  EXPECT_LT(flips, 130);
  EXPECT_GT(corners.size(), 30u);
  // Another epoch draws differently; another seed too.
  int same = 0;
  for (int64_t index = 0; index < 50; ++index) {
    same += same_tensor(transform_image(image, o, 1, index), transform_image(image, o, 2, index));
  }
  EXPECT_LT(same, 10);
  EXPECT_THROW(transform_image(image.to(torch::kFloat), o, 0, 0), Error);
  EXPECT_THROW(transform_image(image, {.crop = 17}, 0, 0), Error);
  // Deferred normalisation flips whole words and then a tail: crops of
  // every width up to two words against the plain flip.
  for (int64_t crop = 1; crop <= 16; ++crop) {
    ImageTransformOptions raw{.crop = crop, .flip = true, .seed = 5, .defer_normalize = true};
    for (int64_t index = 0; index < 8; ++index) {
      auto d = draw_image_transform(raw, 16, 20, 0, index);
      auto ref = image.slice(1, d.top, d.top + crop).slice(2, d.left, d.left + crop);
      if (d.flip) ref = ref.flip({2});
      ASSERT_TRUE(torch::equal(transform_image(image, raw, 0, index), ref)) << "crop " << crop << ", index " << index;
    }
  }
}

// defer_normalize: the loader's samples are the cropped, flipped uint8
// pixels, and finish() on the collated batch gives exactly the floats the
// fused transform gives (the same per-channel table); a batch of the wrong
// type is refused by name, and data sets without the option pass batches
// through untouched.
TEST(ImageRecords, DeferredNormalisationFinishesToTheSameFloats) {
  ImageTransformOptions fused{.crop = 5, .flip = true, .mean = {0.485, 0.456}, .std = {0.229, 0.224}, .seed = 1};
  ImageTransformOptions deferred = fused;
  deferred.defer_normalize = true;
  SyntheticImageOptions o{.size = 16, .channels = 2, .height = 8, .width = 7, .seed = 3};
  auto a = ImageRecordDataset::synthetic(o, fused);
  auto b = ImageRecordDataset::synthetic(o, deferred);
  std::vector<Sample> sa, sb;
  for (int64_t i = 0; i < 16; ++i) {
    sa.push_back(a->get(i, 2));
    sb.push_back(b->get(i, 2));
  }
  EXPECT_EQ(sb[0].at("input").scalar_type(), torch::kByte);
  EXPECT_EQ(sb[0].at("input").sizes(), (std::vector<int64_t>{2, 5, 5}));
  auto fused_batch = a->finish(a->collate(std::move(sa)));
  auto deferred_batch = b->collate(std::move(sb));
  EXPECT_EQ(deferred_batch.at("input").scalar_type(), torch::kByte);
  auto finished = b->finish(deferred_batch);
  EXPECT_EQ(finished.at("input").scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(finished.at("input"), fused_batch.at("input")));
  EXPECT_TRUE(torch::equal(finished.at("target"), fused_batch.at("target")));
  // finish() writes into its last output again only once that is released.
  auto again = b->finish(deferred_batch);
  const void* out = again.at("input").data_ptr();
  EXPECT_NE(out, finished.at("input").data_ptr());  // `finished` is held
  auto view = again.at("input").view({-1});
  again = TensorDict();
  auto third = b->finish(deferred_batch);  // a view of `again` is held
  EXPECT_NE(third.at("input").data_ptr(), out);
  EXPECT_TRUE(torch::equal(view.view_as(fused_batch.at("input")), fused_batch.at("input")));
  const void* third_out = third.at("input").data_ptr();
  third = TensorDict();
  TensorDict flipped = deferred_batch;
  flipped.set("input", deferred_batch.at("input").flip(3).contiguous());
  auto fourth = b->finish(flipped);
  EXPECT_EQ(fourth.at("input").data_ptr(), third_out);
  EXPECT_TRUE(
      torch::equal(fourth.at("input"), ImageRecordDataset::synthetic(o, deferred)->finish(flipped).at("input")));
  EXPECT_FALSE(torch::equal(fourth.at("input"), fused_batch.at("input")));
  EXPECT_THROW(b->finish(fused_batch), ConfigError);
  auto spec = DatasetSpec("image_records").set("size", 4).set("height", 8).set("width", 8).set("defer_normalize", 1);
  EXPECT_NE(make_dataset(spec)->describe().find("normalised on the trainer"), std::string::npos);
}

// load_batch writes the batch at once, bit for bit what get() of each index
// then collate() give: both normalisations, crops, flips, any index order;
// into the thread's collate buffers when it has some; an index out of range
// is refused as get() refuses it.
TEST(ImageRecords, WholeBatchLoadEqualsSamplesCollated) {
  SyntheticImageOptions o{.size = 24, .channels = 3, .height = 9, .width = 11, .seed = 5};
  for (bool defer : {false, true}) {
    ImageTransformOptions t{
        .crop = 7, .flip = true, .mean = {0.4, 0.5, 0.6}, .std = {0.2, 0.25, 0.3}, .seed = 2, .defer_normalize = defer};
    auto ds = ImageRecordDataset::synthetic(o, t);
    const std::vector<int64_t> indices = {5, 0, 23, 17, 5, 9, 1, 12, 20, 3};
    std::vector<Sample> samples;
    for (int64_t i : indices) samples.push_back(ds->get(i, 4));
    const TensorDict expected = ds->collate(std::move(samples));
    const auto whole = ds->load_batch(indices, 4);
    ASSERT_TRUE(whole.has_value());
    EXPECT_EQ(whole->at("input").scalar_type(), defer ? torch::kByte : torch::kFloat);
    EXPECT_EQ(whole->at("input").sizes(), expected.at("input").sizes());
    EXPECT_TRUE(torch::equal(whole->at("input"), expected.at("input"))) << "defer " << defer;
    EXPECT_TRUE(torch::equal(whole->at("target"), expected.at("target"))) << "defer " << defer;
    EXPECT_FALSE(torch::equal(ds->load_batch(indices, 5)->at("input"), whole->at("input")))
        << "another epoch draws other crops";
    // In a scope, the batch lands in that set's buffers once released.
    CollateBuffers buffers(4);
    CollateBuffers::Scope scope(&buffers);
    const void* first = ds->load_batch(indices, 4)->at("input").data_ptr();
    EXPECT_EQ(ds->load_batch(indices, 4)->at("input").data_ptr(), first);
    EXPECT_THROW(ds->load_batch({0, 24}, 0), Error);
    EXPECT_THROW(ds->load_batch({-1}, 0), Error);
    // A loader's pipeline takes the same path: each batch as collated.
    BatchPipeline pipe(*ds, {.batch_size = 5, .num_threads = 2});
    std::vector<int64_t> order(24);
    std::iota(order.rbegin(), order.rend(), 0);
    int64_t batches = 0;
    pipe.run(order, 3, [&](Batch&& b) {
      std::vector<Sample> each;
      for (int64_t i : b.indices) each.push_back(ds->get(i, 3));
      EXPECT_EQ(b.size(), static_cast<int64_t>(b.indices.size()));
      EXPECT_TRUE(torch::equal(b.tensors.at("input"), ds->collate(std::move(each)).at("input")));
      ++batches;
    });
    EXPECT_EQ(batches, 5);  // 24 samples: 4 of 5 and the short last one of 4
  }
}

TEST(ImageRecords, SyntheticAndNpyBackedAgree) {
  ImageTransformOptions t{.crop = 5, .flip = true, .mean = {0.5, 0.5}, .std = {0.5, 0.5}, .seed = 1};
  auto ds = ImageRecordDataset::synthetic({.size = 20, .channels = 2, .height = 8, .width = 8, .seed = 3}, t);
  auto again = ImageRecordDataset::synthetic({.size = 20, .channels = 2, .height = 8, .width = 8, .seed = 3}, t);
  EXPECT_TRUE(same_tensor(ds->images(), again->images()));
  EXPECT_TRUE(same_tensor(ds->get(7, 3).at("input"), again->get(7, 3).at("input")));
  EXPECT_EQ(ds->get(7, 3).at("input").sizes(), (std::vector<int64_t>{2, 5, 5}));
  EXPECT_TRUE(same_tensor(ds->get(7, 3).at("input"), transform_image(ds->images()[7], t, 3, 7)));

  std::string dir = (fs::temp_directory_path() / ("troupe_img_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  write_npy(dir + "/img.npy", ds->images());
  write_npy(dir + "/lab.npy", ds->labels().to(torch::kInt));
  auto from_file = make_dataset(DatasetSpec("image_records")
                                    .set("path", dir + "/img.npy")
                                    .set("labels", dir + "/lab.npy")
                                    .set("crop", 5)
                                    .set("flip", 1)
                                    .set("mean", {0.5, 0.5})
                                    .set("std", {0.5, 0.5})
                                    .set("seed", 1));
  for (int64_t i = 0; i < 20; ++i) {
    EXPECT_TRUE(same_tensor(from_file->get(i, 2).at("input"), ds->get(i, 2).at("input"))) << i;
    EXPECT_TRUE(same_tensor(from_file->get(i, 2).get("target"), ds->get(i, 2).get("target"))) << i;
  }
  write_npy(dir + "/float.npy", torch::zeros({2, 3, 4, 4}));
  expect_error_mentions([&] { ImageRecordDataset::from_npy(dir + "/float.npy", "", {}); }, {"float.npy", "uint8"});
  troupe::core::remove_tree(dir);
}

}  // namespace
}  // namespace troupe::actors
