// `troupe train`'s job files and flags in process (launcher/train_options.cc,
// launcher/yaml_to_json.cc): YAML 1.1 booleans, paths relative to the job
// file, problems named by the key and file (or the flag) that gave them,
// and model options refused for a TorchScript module.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "launcher/train_options.h"
#include "launcher/yaml_to_json.h"
#include "tests/support/temp_dir.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/files.h"

namespace fs = std::filesystem;
using troupe::ConfigError;
using troupe::launcher::TrainOptions;

namespace {

// parse_train_args then check(): the ConfigError's text ("" when none).
std::string problem(std::vector<std::string> args, TrainOptions& o) {
  args.insert(args.begin(), "troupe-train");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  try {
    troupe::launcher::parse_train_args(static_cast<int>(argv.size()), argv.data(), o);
    troupe::launcher::check(o);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string problem(const std::vector<std::string>& args) {
  TrainOptions o;
  return problem(args, o);
}

class TrainOptionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = troupe::test::fresh_dir("train-options");
    fs::create_directories(dir_ / "jobs");
    std::ofstream(dir_ / "jobs" / "step.pt") << "not read here";
    std::ofstream(dir_ / "jobs" / "train.npz") << "not read here";
  }
  void TearDown() override {
    std::error_code ec;
    troupe::core::remove_tree(dir_, ec);
  }
  std::string write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / "jobs" / name) << text;
    return (dir_ / "jobs" / name).string();
  }
  fs::path dir_;
};

}  // namespace

// YAML 1.1's booleans, unquoted and in every case form YAML 1.1 allows,
// are booleans; quoted, and in other case forms, they are strings.
TEST(YamlToJsonTest, Yaml11BooleansAreBooleansOnlyWhenPlain) {
  for (const char* t : {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"})
    EXPECT_EQ(troupe::launcher::yaml_to_json(std::string("v: ") + t + "\n", "t.yaml").at("v"), nlohmann::json(true))
        << t;
  for (const char* f : {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"})
    EXPECT_EQ(troupe::launcher::yaml_to_json(std::string("v: ") + f + "\n", "f.yaml").at("v"), nlohmann::json(false))
        << f;
  for (const char* s : {"\"yes\"", "'no'", "'on'", "\"OFF\"", "\"true\""}) {
    const auto v = troupe::launcher::yaml_to_json(std::string("v: ") + s + "\n", "s.yaml").at("v");
    EXPECT_TRUE(v.is_string()) << s << " read as " << v.dump();
  }
  for (const char* s : {"yEs", "nO", "oN", "yess", "tRUE"}) {
    const auto v = troupe::launcher::yaml_to_json(std::string("v: ") + s + "\n", "s.yaml").at("v");
    EXPECT_EQ(v, nlohmann::json(s)) << s;
  }
  // A key is its text: `on:` stays "on".
  EXPECT_EQ(troupe::launcher::yaml_to_json("on: 1\n", "k.yaml").at("on"), nlohmann::json(1));
}

// An integer past int64 is the number it says, as in a JSON job file (the
// options then refuse it): it was clamped to INT64_MAX without a word.
TEST(YamlToJsonTest, IntegersPastInt64AreNotClamped) {
  const auto v = troupe::launcher::yaml_to_json("seed: 99999999999999999999\n", "big.yaml").at("seed");
  EXPECT_NE(v, nlohmann::json(INT64_MAX)) << v.dump();
  EXPECT_EQ(v, nlohmann::json::parse("99999999999999999999")) << v.dump();
  EXPECT_EQ(troupe::launcher::yaml_to_json("seed: -42\n", "small.yaml").at("seed"), nlohmann::json(-42));
}

// Gradient accumulation reaches the trainers' config, from a flag or a job
// file's key; the flag wins.
TEST_F(TrainOptionsTest, AccumulationComesFromTheFlagOrTheJobFile) {
  const std::string job =
      write("acc.json", R"({"model": "mlp", "data": "train.npz", "checkpoint_dir": "ck", "accumulation": 4})");
  TrainOptions o;
  EXPECT_EQ(problem({"--config", job}, o), "");
  EXPECT_EQ(o.accumulation, 4);
  TrainOptions f;
  EXPECT_EQ(problem({"--config", job, "--accumulation", "2"}, f), "");
  EXPECT_EQ(f.accumulation, 2);
  EXPECT_EQ(problem({"--config", job, "--accumulation", "-1"}), "--accumulation must be between 1 and 1048576, got -1");
  const std::string bad =
      write("acc-bad.json", R"({"model": "mlp", "data": "train.npz", "checkpoint_dir": "ck", "accumulation": 1.5})");
  EXPECT_NE(problem({"--config", bad}).find("accumulation"), std::string::npos);
}

TEST_F(TrainOptionsTest, AYamlJobFileTakesSyncBatchnormYes) {
  const std::string job =
      write("yes.yaml", "model: step.pt\ndata: train.npz\ncheckpoint_dir: ck\nsync_batchnorm: yes\n");
  TrainOptions o;
  EXPECT_EQ(problem({"--config", job}, o), "");
  EXPECT_TRUE(o.sync_batchnorm);
}

// A job file's relative paths are its folder's, whatever the working
// directory; the command line's stay the working directory's.
TEST_F(TrainOptionsTest, AJobFilesRelativePathsAreRelativeToItsFolder) {
  const std::string job = write("job.json", R"({"model": "step.pt", "data": "train.npz", "val_data": "./train.npz",
      "checkpoint_dir": "ck", "metrics": "m.jsonl"})");
  TrainOptions o;
  EXPECT_EQ(problem({"--config", job}, o), "");  // run from elsewhere: the files are found
  const fs::path jobs = dir_ / "jobs";
  EXPECT_EQ(o.model, (jobs / "step.pt").string());
  EXPECT_EQ(o.data, (jobs / "train.npz").string());
  EXPECT_EQ(o.val_data, (jobs / "train.npz").string());
  EXPECT_EQ(o.checkpoint_dir, (jobs / "ck").string());
  EXPECT_EQ(o.metrics, (jobs / "m.jsonl").string());
  // A built-in model's name is no path.
  const std::string mlp = write("mlp.json", R"({"model": "mlp", "data": "train.npz", "checkpoint_dir": "ck"})");
  TrainOptions m;
  EXPECT_EQ(problem({"--config", mlp}, m), "");
  EXPECT_EQ(m.model, "mlp");
  // A flag's relative path is the working directory's.
  TrainOptions f;
  EXPECT_EQ(problem({"--config", job, "--data", "elsewhere.npz"}, f), "--data elsewhere.npz: no such file");
  EXPECT_EQ(f.data, "elsewhere.npz");
}

// A missing file a job file names is said as the key and the job file, not
// as a flag the user never gave; a flag's stays the flag's.
TEST_F(TrainOptionsTest, AMissingFileNamesTheJobFilesKeyOrTheFlag) {
  const std::string job = write("miss.json", R"({"model": "step.pt", "data": "nope.npz", "checkpoint_dir": "ck"})");
  const std::string nope = (dir_ / "jobs" / "nope.npz").string();
  EXPECT_EQ(problem({"--config", job}), "job file " + job + ": key 'data': " + nope + ": no such file");
  const std::string model = write("model.json", R"({"model": "gone.pt", "data": "train.npz", "checkpoint_dir": "ck"})");
  EXPECT_EQ(problem({"--config", model}),
            "job file " + model + ": key 'model': " + (dir_ / "jobs" / "gone.pt").string() + ": no such file");
  const std::string val =
      write("val.json", R"({"model": "step.pt", "data": "train.npz", "val_data": "v.npz", "checkpoint_dir": "ck"})");
  EXPECT_EQ(problem({"--config", val}),
            "job file " + val + ": key 'val_data': " + (dir_ / "jobs" / "v.npz").string() + ": no such file");
  // The flag overrides the key, and is named.
  EXPECT_EQ(problem({"--config", job, "--data", "/no/such.npz"}), "--data /no/such.npz: no such file");
  EXPECT_EQ(problem({"--model", "/no/step.pt", "--data", "x.npz", "--checkpoint-dir", "ck"}),
            "--model /no/step.pt: no such file");
  // A bare word that is neither a file nor a built-in: the names there are.
  EXPECT_EQ(problem({"--model", "resnet", "--data", "x.npz", "--checkpoint-dir", "ck"}),
            "--model resnet: no such file, and no built-in model of that name (mlp, cnn)");
}

// Model options size a built-in model; for a TorchScript module they would
// be ignored, so they are refused naming the option.
TEST_F(TrainOptionsTest, ModelOptionsForATorchScriptModuleAreRefused) {
  const std::string step = (dir_ / "jobs" / "step.pt").string(), data = (dir_ / "jobs" / "train.npz").string();
  const std::string flag =
      problem({"--model", step, "--data", data, "--checkpoint-dir", "ck", "--model-option", "hidden=64"});
  EXPECT_EQ(flag.rfind("--model-option (hidden=64) sizes a built-in model (mlp, cnn); --model " + step +
                           " is a TorchScript module",
                       0),
            0u)
      << flag;
  const std::string job =
      write("opts.json",
            R"({"model": "step.pt", "data": "train.npz", "checkpoint_dir": "ck", "model_options": {"hidden": 8}})");
  const std::string file = problem({"--config", job});
  EXPECT_EQ(file.rfind("job file " + job + ": key 'model_options' (hidden=8) sizes a built-in model (mlp, cnn)", 0), 0u)
      << file;
  // A built-in model takes them.
  EXPECT_EQ(problem({"--model", "mlp", "--data", data, "--checkpoint-dir", "ck", "--model-option", "hidden=64"}), "");
}

// `--help` shows each flag's default, as `troupe start --help` does: a
// new user sees that one worker and one epoch are what they get.
TEST_F(TrainOptionsTest, HelpShowsTheDefaults) {
  TrainOptions o;
  std::string arg0 = "troupe-train", help = "--help";
  std::vector<char*> argv = {arg0.data(), help.data()};
  testing::internal::CaptureStdout();
  const bool go_on = troupe::launcher::parse_train_args(static_cast<int>(argv.size()), argv.data(), o);
  const std::string text = testing::internal::GetCapturedStdout();
  EXPECT_FALSE(go_on);
  for (const char* shown : {"--workers INT=1", "--epochs INT=1", "--batch-size INT=32", "--optimizer TEXT=adamw",
                            "--lr FLOAT=0.001", "--log-every INT=10", "--step-timeout FLOAT=600"})
    EXPECT_NE(text.find(shown), std::string::npos) << shown << " in\n" << text;
}

// An unknown flag is named with its value in the order given, with the
// flag it was likely meant to be; a whole number past int64 is refused
// naming it, not clamped.
TEST_F(TrainOptionsTest, UnknownFlagsAreNamedInOrderAndHugeNumbersRefused) {
  const std::string model = write("m.pt", "x"), data = write("d.npz", "x");
  EXPECT_EQ(problem({"--model", model, "--data", data, "--epoch", "3"}),
            "unknown argument(s): --epoch 3 (did you mean --epochs?); see --help");
  EXPECT_EQ(problem({"--model", model, "--data", data, "--frobnicate"}),
            "unknown argument(s): --frobnicate; see --help");
  EXPECT_EQ(problem({"--model", model, "--data", data, "--batch-size", "99999999999999999999"}),
            "--batch-size: 99999999999999999999 is out of range (whole numbers up to 9223372036854775807)");
}

// How many checkpoints stay: 3 unless the flag or the job file says, 0
// keeps all, a negative count is refused naming where it came from.
TEST_F(TrainOptionsTest, KeepCheckpointsComesFromTheFlagOrTheJobFile) {
  const std::string job =
      write("keep.json", R"({"model": "mlp", "data": "train.npz", "checkpoint_dir": "ck", "keep_checkpoints": 0})");
  TrainOptions d;
  EXPECT_EQ(problem({"--model", "mlp", "--data", write("t.npz", "x"), "--checkpoint-dir", "ck"}, d), "");
  EXPECT_EQ(d.keep_checkpoints, 3);
  TrainOptions o;
  EXPECT_EQ(problem({"--config", job}, o), "");
  EXPECT_EQ(o.keep_checkpoints, 0);
  TrainOptions f;
  EXPECT_EQ(problem({"--config", job, "--keep-checkpoints", "5"}, f), "");
  EXPECT_EQ(f.keep_checkpoints, 5);
  EXPECT_EQ(problem({"--config", job, "--keep-checkpoints", "-1"}),
            "--keep-checkpoints -1 must be 0 (keep all) or the number of newest checkpoints to keep");
  const std::string bad = write(
      "keep-bad.json", R"({"model": "mlp", "data": "train.npz", "checkpoint_dir": "ck", "keep_checkpoints": -2})");
  EXPECT_NE(problem({"--config", bad}).find("key 'keep_checkpoints': -2 must be 0"), std::string::npos)
      << problem({"--config", bad});
}

// How long a failed trainer's replacement waits for room: 10 s, longer
// than a stalled node agent takes to be fenced and rejoin; from the flag
// or the job file, a value out of range refused naming it.
TEST_F(TrainOptionsTest, ReplacementTimeoutComesFromTheFlagOrTheJobFile) {
  const std::string data = write("t.npz", "x");
  TrainOptions d;
  EXPECT_EQ(problem({"--model", "mlp", "--data", data, "--checkpoint-dir", "ck"}, d), "");
  EXPECT_EQ(d.replacement_timeout_s, 10);
  const std::string job =
      write("repl.json", R"({"model": "mlp", "data": "t.npz", "checkpoint_dir": "ck", "replacement_timeout": 30})");
  TrainOptions o;
  EXPECT_EQ(problem({"--config", job}, o), "");
  EXPECT_EQ(o.replacement_timeout_s, 30);
  EXPECT_EQ(problem({"--model", "mlp", "--data", data, "--checkpoint-dir", "ck", "--replacement-timeout", "0"}),
            "--replacement-timeout must be a number of seconds from 0.1 to 604800, got 0");
}

// A value out of range that a job file gave is named by the job file and
// its key, not by a flag the user never typed; the flag that overrides the
// key is named as the flag.
TEST_F(TrainOptionsTest, AValueOutOfRangeNamesTheJobFilesKeyOrTheFlag) {
  write("t.npz", "x");
  const std::string job = write("range.json", R"({"model": "mlp", "data": "t.npz", "checkpoint_dir": "ck",
                                                  "workers": 0, "lr": -1, "optimizer": "lion"})");
  EXPECT_EQ(problem({"--config", job}), "job file " + job + ": key 'workers' must be at least 1, got 0");
  EXPECT_EQ(problem({"--config", job, "--workers", "2"}),
            "job file " + job + ": key 'optimizer' must be sgd or adamw, got 'lion'");
  EXPECT_EQ(problem({"--config", job, "--workers", "2", "--optimizer", "sgd"}),
            "job file " + job + ": key 'lr' must be a positive finite number, got -1");
  EXPECT_EQ(problem({"--config", job, "--workers", "2", "--optimizer", "sgd", "--lr", "0"}),
            "--lr must be a positive finite number, got 0");
}
