#include "troupe/actors/digits_dataset.h"

#include <glob.h>
#include <sys/stat.h>
#include <zlib.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/worker_env.h"

namespace troupe::actors {

namespace {

constexpr int64_t kPixels = 64;
constexpr int64_t kClasses = 10;

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// The whole file through zlib: gzread passes uncompressed files through
// unchanged, so one reader serves digits.csv and digits.csv.gz.
std::string read_maybe_gzipped(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw Error("digits file '" + path + "': cannot open");
  std::string out;
  char buf[1 << 16];
  while (true) {
    int n = gzread(f, buf, sizeof buf);
    if (n < 0) {
      int code = 0;
      std::string msg = gzerror(f, &code);
      gzclose(f);
      throw Error("digits file '" + path + "': read failed: " + msg);
    }
    if (n == 0) break;
    out.append(buf, size_t(n));
  }
  gzclose(f);
  return out;
}

}  // namespace

std::string find_digits_file() {
  if (const char* env = std::getenv(core::kEnvDigitsPath); env && *env && is_file(env)) return env;
  const char* patterns[] = {
      "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz",
      "/usr/lib/python3*/dist-packages/sklearn/datasets/data/digits.csv.gz",
      "/usr/local/lib/python3*/dist-packages/sklearn/datasets/data/digits.csv.gz",
      "/usr/local/lib/python3*/site-packages/sklearn/datasets/data/digits.csv.gz",
  };
  for (const char* pattern : patterns) {
    glob_t g{};
    if (::glob(pattern, 0, nullptr, &g) == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) {
        std::string p = g.gl_pathv[i];
        if (is_file(p)) {
          globfree(&g);
          return p;
        }
      }
    }
    globfree(&g);
  }
  return "";
}

DigitsDataset::DigitsDataset(DigitsOptions options) : options_(std::move(options)) {
  path_ = options_.path.empty() ? find_digits_file() : options_.path;
  if (path_.empty()) {
    throw Error(
        "digits data set not found: install python3-sklearn (it ships "
        "sklearn/datasets/data/digits.csv.gz), or set TROUPE_DIGITS_PATH or the 'path' parameter");
  }
  if (!is_file(path_)) throw Error("digits file '" + path_ + "': no such file");
  std::string text = read_maybe_gzipped(path_);

  std::vector<float> pixels;
  std::vector<int64_t> labels;
  pixels.reserve(1797 * kPixels);
  labels.reserve(1797);
  size_t line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    ++line_no;
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    // 64 pixel values then the label, all small non-negative integers
    // (written as "3" or "3.0").
    int64_t column = 0;
    size_t i = 0;
    while (i <= line.size()) {
      size_t comma = line.find(',', i);
      if (comma == std::string_view::npos) comma = line.size();
      std::string field(line.substr(i, comma - i));
      char* stop = nullptr;
      double v = std::strtod(field.c_str(), &stop);
      if (field.empty() || *stop != '\0' || v < 0 || v > 16) {
        throw Error("digits file '" + path_ + "': line " + std::to_string(line_no) + ", column " +
                    std::to_string(column + 1) + ": bad value '" + field + "'");
      }
      if (column < kPixels) {
        pixels.push_back(static_cast<float>(v));
      } else if (column == kPixels) {
        if (v >= kClasses || v != double(int64_t(v))) {
          throw Error("digits file '" + path_ + "': line " + std::to_string(line_no) + ": bad label '" + field + "'");
        }
        labels.push_back(static_cast<int64_t>(v));
      }
      ++column;
      i = comma + 1;
    }
    if (column != kPixels + 1) {
      throw Error("digits file '" + path_ + "': line " + std::to_string(line_no) + " has " + std::to_string(column) +
                  " columns, expected 65");
    }
  }
  if (labels.empty()) throw Error("digits file '" + path_ + "': no samples");
  auto n = static_cast<int64_t>(labels.size());
  images_ = torch::from_blob(pixels.data(), {n, kPixels}, torch::kFloat).clone();
  if (options_.normalize) images_.div_(16.0);
  labels_ = torch::from_blob(labels.data(), {n}, torch::kLong).clone();
}

std::string DigitsDataset::describe() const {
  return "digits(path='" + path_ + "', normalize=" + std::to_string(options_.normalize) +
         ", image=" + std::to_string(options_.image) + ")";
}

Sample DigitsDataset::load(int64_t index, int64_t /*epoch*/) const {
  auto input = images_[index].clone();
  if (options_.image) input = input.view({1, 8, 8});
  return {{"input", input}, {"target", labels_[index].clone()}};
}

}  // namespace troupe::actors
