#include "troupe/actors/image_dataset.h"

#include <ATen/Parallel.h>

#include <array>
#include <cstring>
#include <sstream>

#include "troupe/actors/batch.h"
#include "troupe/actors/random.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"

namespace troupe::actors {

namespace {

constexpr uint64_t kTransformTag = 0x1A6E'0001;
constexpr uint64_t kPixelTag = 0x1A6E'0002;
constexpr uint64_t kLabelTag = 0x1A6E'0003;

// dst[x] = src[n − 1 − x] for x < n, eight bytes a step (a byte swap of
// each 8-byte word taken from the other end): the flip of a uint8 row,
// which byte by byte was nearly all of a deferred-normalisation loader's
// time.
void reverse_bytes(uint8_t* dst, const uint8_t* src, int64_t n) {
  int64_t x = 0;
  for (; x + 8 <= n; x += 8) {
    uint64_t word = 0;
    std::memcpy(&word, src + n - x - 8, 8);
    word = __builtin_bswap64(word);
    std::memcpy(dst + x, &word, 8);
  }
  for (; x < n; ++x) dst[x] = src[n - 1 - x];
}

// Crop + flip + normalise from raw C×H×W bytes. Normalisation goes through a
// per-channel 256-entry table computed in double, so each output is the
// correctly rounded (x·scale − mean)/std and the inner loop is a lookup.
// (v·scale − mean[c])/std[c], computed in double and rounded once: the one
// formula both the loader's fused pass and finish() use.
float normalized(const ImageTransformOptions& o, int64_t c, int v) {
  double mean = o.mean.empty() ? 0.0 : o.mean[static_cast<size_t>(c)];
  double std = o.std.empty() ? 1.0 : o.std[static_cast<size_t>(c)];
  return static_cast<float>((v * o.scale - mean) / std);
}

// The C×oh×ow shape and dtype transform_raw gives an image of C×H×W.
std::vector<int64_t> transformed_sizes(int64_t channels, int64_t height, int64_t width,
                                       const ImageTransformOptions& o) {
  return {channels, o.crop > 0 ? o.crop : height, o.crop > 0 ? o.crop : width};
}
c10::ScalarType transformed_dtype(const ImageTransformOptions& o) {
  return o.defer_normalize ? torch::kByte : torch::kFloat;
}

// transform_raw's work, written to `out` (transformed_sizes() elements of
// transformed_dtype(), contiguous).
void transform_into(void* out, const uint8_t* src, int64_t channels, int64_t height, int64_t width,
                    const ImageTransformOptions& o, int64_t epoch, int64_t index) {
  TROUPE_CHECK(o.crop <= height && o.crop <= width)
      << "crop " << o.crop << " larger than the " << height << "x" << width << " image";
  TROUPE_CHECK(o.mean.size() == o.std.size() && (o.mean.empty() || int64_t(o.mean.size()) == channels))
      << "mean/std have " << o.mean.size() << "/" << o.std.size() << " values for " << channels << " channels";
  ImageTransformDraw d = draw_image_transform(o, height, width, epoch, index);
  const int64_t oh = o.crop > 0 ? o.crop : height;
  const int64_t ow = o.crop > 0 ? o.crop : width;
  if (o.defer_normalize) {
    // Crop and flip only; finish() normalises on the trainer's device.
    auto* dst = static_cast<uint8_t*>(out);
    for (int64_t c = 0; c < channels; ++c) {
      const uint8_t* plane = src + c * height * width;
      for (int64_t y = 0; y < oh; ++y) {
        const uint8_t* row = plane + (d.top + y) * width + d.left;
        uint8_t* out_row = dst + (c * oh + y) * ow;
        if (d.flip) {
          reverse_bytes(out_row, row, ow);
        } else {
          std::memcpy(out_row, row, static_cast<size_t>(ow));
        }
      }
    }
    return;
  }
  auto* dst = static_cast<float*>(out);
  std::array<float, 256> lut;
  for (int64_t c = 0; c < channels; ++c) {
    for (int v = 0; v < 256; ++v) lut[v] = normalized(o, c, v);
    const uint8_t* plane = src + c * height * width;
    for (int64_t y = 0; y < oh; ++y) {
      const uint8_t* row = plane + (d.top + y) * width + d.left;
      float* out_row = dst + (c * oh + y) * ow;
      if (d.flip) {
        for (int64_t x = 0; x < ow; ++x) out_row[x] = lut[row[ow - 1 - x]];
      } else {
        for (int64_t x = 0; x < ow; ++x) out_row[x] = lut[row[x]];
      }
    }
  }
}

torch::Tensor transform_raw(const uint8_t* src, int64_t channels, int64_t height, int64_t width,
                            const ImageTransformOptions& o, int64_t epoch, int64_t index) {
  auto out = torch::empty(transformed_sizes(channels, height, width, o), transformed_dtype(o));
  transform_into(out.data_ptr(), src, channels, height, width, o, epoch, index);
  return out;
}

}  // namespace

ImageTransformDraw draw_image_transform(const ImageTransformOptions& o, int64_t height, int64_t width, int64_t epoch,
                                        int64_t index) {
  SampleRng rng(static_cast<uint64_t>(o.seed), kTransformTag, static_cast<uint64_t>(epoch),
                static_cast<uint64_t>(index));
  ImageTransformDraw d;
  // Always draw all three, so the flip of a sample does not depend on
  // whether cropping is on.
  int64_t top = rng.uniform_int(o.crop > 0 ? height - o.crop + 1 : 1);
  int64_t left = rng.uniform_int(o.crop > 0 ? width - o.crop + 1 : 1);
  bool flip = rng.bernoulli(0.5);
  if (o.crop > 0) {
    d.top = top;
    d.left = left;
  }
  d.flip = o.flip && flip;
  return d;
}

torch::Tensor transform_image(const torch::Tensor& image, const ImageTransformOptions& options, int64_t epoch,
                              int64_t index) {
  TROUPE_CHECK(image.defined() && image.scalar_type() == torch::kByte && image.dim() == 3)
      << "transform_image wants a uint8 [C, H, W] tensor, got "
      << (image.defined() ? image.sizes() : c10::IntArrayRef{}) << " of "
      << (image.defined() ? c10::toString(image.scalar_type()) : "undefined");
  auto img = image.to(torch::kCPU).contiguous();
  return transform_raw(img.data_ptr<uint8_t>(), img.size(0), img.size(1), img.size(2), options, epoch, index);
}

ImageRecordDataset::ImageRecordDataset(torch::Tensor images, torch::Tensor labels, ImageTransformOptions transform)
    : transform_(std::move(transform)), origin_("tensors") {
  TROUPE_CHECK(images.defined() && images.scalar_type() == torch::kByte && images.dim() == 4)
      << "image records must be uint8 [N, C, H, W]";
  images_ = images.contiguous();
  const int64_t n = images_.size(0);
  if (labels.defined()) {
    TROUPE_CHECK(labels.dim() == 1 && labels.size(0) == n)
        << "labels must be [N] = [" << n << "], got " << labels.sizes();
    labels_ = labels.to(torch::kLong).contiguous();
  } else {
    labels_ = torch::zeros({n}, torch::kLong);
  }
  const int64_t c = images_.size(1), h = images_.size(2), w = images_.size(3);
  if (transform_.crop > h || transform_.crop > w) {
    throw ConfigError("image records: crop " + std::to_string(transform_.crop) + " larger than the " +
                      std::to_string(h) + "x" + std::to_string(w) + " images");
  }
  if (transform_.mean.size() != transform_.std.size() ||
      (!transform_.mean.empty() && int64_t(transform_.mean.size()) != c)) {
    throw ConfigError("image records: mean/std have " + std::to_string(transform_.mean.size()) + "/" +
                      std::to_string(transform_.std.size()) + " values for " + std::to_string(c) + " channels");
  }
}

std::unique_ptr<ImageRecordDataset> ImageRecordDataset::synthetic(const SyntheticImageOptions& o,
                                                                  ImageTransformOptions transform) {
  TROUPE_CHECK(o.size >= 0 && o.channels > 0 && o.height > 0 && o.width > 0 && o.num_classes > 0)
      << "bad synthetic image options";
  auto images = torch::empty({o.size, o.channels, o.height, o.width}, torch::kByte);
  auto labels = torch::empty({o.size}, torch::kLong);
  const int64_t bytes = o.channels * o.height * o.width;
  auto* px = images.data_ptr<uint8_t>();
  auto* lb = labels.data_ptr<int64_t>();
  const auto seed = static_cast<uint64_t>(o.seed);
  for (int64_t i = 0; i < o.size; ++i) {
    SampleRng rng(seed, kPixelTag, static_cast<uint64_t>(i));
    uint8_t* p = px + i * bytes;
    int64_t k = 0;
    for (; k + 8 <= bytes; k += 8) {
      uint64_t v = rng.next_u64();
      std::memcpy(p + k, &v, 8);
    }
    if (k < bytes) {
      uint64_t v = rng.next_u64();
      std::memcpy(p + k, &v, size_t(bytes - k));
    }
    lb[i] = SampleRng(seed, kLabelTag, static_cast<uint64_t>(i)).uniform_int(o.num_classes);
  }
  auto ds = std::make_unique<ImageRecordDataset>(images, labels, std::move(transform));
  std::ostringstream os;
  os << "synthetic " << o.size << "x" << o.channels << "x" << o.height << "x" << o.width << ", seed " << o.seed;
  ds->origin_ = os.str();
  return ds;
}

std::unique_ptr<ImageRecordDataset> ImageRecordDataset::from_npy(const std::string& images_path,
                                                                 const std::string& labels_path,
                                                                 ImageTransformOptions transform) {
  NpyArray images = NpyArray::open(images_path);
  if (images.dtype() != torch::kByte || images.shape().size() != 4) {
    throw Error("npy file '" + images_path + "': image records must be uint8 with shape (N, C, H, W)");
  }
  require_data_in_rows({&images}, "image records '" + images_path + "'");
  std::vector<NpyArray> files{images};
  torch::Tensor labels;
  if (!labels_path.empty()) {
    NpyArray l = NpyArray::open(labels_path);
    files.push_back(l);
    if (l.shape().size() != 1 || l.shape()[0] != images.rows() || !c10::isIntegralType(l.dtype(), false)) {
      throw Error("npy file '" + labels_path + "': labels must be integers with shape (" +
                  std::to_string(images.rows()) + ",)");
    }
    labels = l.tensor().to(torch::kLong);
  }
  auto ds = std::make_unique<ImageRecordDataset>(images.tensor(), labels, std::move(transform));
  ds->origin_ = "'" + images_path + "'" + (labels_path.empty() ? "" : ", labels '" + labels_path + "'");
  ds->files_ = std::move(files);
  return ds;
}

// The views of a file written in place since it was mapped read what the
// writer left, or fault (a shorter file): a ConfigError naming it instead,
// as NpyArray::row says for the other .npy data sets.
void ImageRecordDataset::check_files() const {
  for (const NpyArray& f : files_) f.check_unchanged();
}

std::string ImageRecordDataset::describe() const {
  std::ostringstream os;
  os << "image_records(" << origin_ << ", crop=" << transform_.crop << ", flip=" << transform_.flip
     << (transform_.defer_normalize ? ", normalised on the trainer" : "") << ")";
  return os.str();
}

Sample ImageRecordDataset::load(int64_t index, int64_t epoch) const {
  check_files();
  const int64_t c = images_.size(1), h = images_.size(2), w = images_.size(3);
  const uint8_t* src = images_.data_ptr<uint8_t>() + index * c * h * w;
  // Made before the guarded read: a fault jumps out of it, past the
  // destructors of whatever it made.
  auto input = torch::empty(transformed_sizes(c, h, w, transform_), transformed_dtype(transform_));
  int64_t label = 0;
  read_mapped(files_.data(), files_.size(), [&] {
    transform_into(input.data_ptr(), src, c, h, w, transform_, epoch, index);
    label = labels_.data_ptr<int64_t>()[index];
  });
  return {{"input", input}, {"target", torch::scalar_tensor(label, torch::kLong)}};
}

std::optional<TensorDict> ImageRecordDataset::load_batch(const std::vector<int64_t>& indices, int64_t epoch) const {
  if (indices.empty()) return std::nullopt;
  for (int64_t i : indices) check_index(i);
  check_files();
  const int64_t c = images_.size(1), h = images_.size(2), w = images_.size(3);
  const auto one = transformed_sizes(c, h, w, transform_);
  std::vector<int64_t> sizes{static_cast<int64_t>(indices.size())};
  sizes.insert(sizes.end(), one.begin(), one.end());
  torch::Tensor input = batch_buffer("input", transformed_dtype(transform_), sizes);
  torch::Tensor target = batch_buffer("target", torch::kLong, {static_cast<int64_t>(indices.size())});
  const uint8_t* images = images_.data_ptr<uint8_t>();
  const int64_t* labels = labels_.data_ptr<int64_t>();
  auto* rows = static_cast<char*>(input.data_ptr());
  const int64_t row_bytes = input.numel() / input.size(0) * static_cast<int64_t>(input.element_size());
  int64_t* targets = target.data_ptr<int64_t>();
  read_mapped(files_.data(), files_.size(), [&] {
    for (size_t k = 0; k < indices.size(); ++k) {
      const int64_t index = indices[k];
      transform_into(rows + static_cast<int64_t>(k) * row_bytes, images + index * c * h * w, c, h, w, transform_, epoch,
                     index);
      targets[k] = labels[index];
    }
  });
  return TensorDict{{"input", input}, {"target", target}};
}

TensorDict ImageRecordDataset::finish(TensorDict batch) const {
  if (!transform_.defer_normalize) return batch;
  const torch::Tensor& x = batch.at("input");
  if (x.scalar_type() != torch::kByte || x.dim() != 4)
    throw ConfigError(
        std::string("image records with defer_normalize: the batch's 'input' should be uint8 [B, C, H, W], got ") +
        c10::toString(x.scalar_type()) + " of " + std::to_string(x.dim()) + " dimensions");
  const int64_t channels = x.size(1);
  // One table of 256 floats per channel, indexed by channel·256 + pixel.
  auto make_lut = [&] {
    auto lut = torch::empty({channels * 256}, torch::kFloat);
    float* l = lut.data_ptr<float>();
    for (int64_t c = 0; c < channels; ++c)
      for (int v = 0; v < 256; ++v) l[c * 256 + v] = normalized(transform_, c, v);
    return lut;
  };
  if (x.device().is_cpu()) {
    auto lut = make_lut();
    const float* l = lut.data_ptr<float>();
    // A table lookup per pixel, plane by plane (the gather below widens
    // every pixel to int64 first: several times slower on a CPU).
    auto src = x.contiguous();
    torch::Tensor out;
    {
      // A caller still holding the last batch (or a view of it) gets its
      // own fresh tensor.
      std::lock_guard lock(finish_mu_);
      if (finish_out_.defined() && finish_out_.sizes() == src.sizes() && sole_handle(finish_out_))
        out = finish_out_;
      else
        out = finish_out_ = torch::empty(src.sizes(), torch::kFloat);
    }
    const uint8_t* in = src.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    const int64_t plane = src.size(2) * src.size(3);
    at::parallel_for(0, src.size(0) * channels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const float* table = l + (p % channels) * 256;
        const uint8_t* a = in + p * plane;
        float* b = dst + p * plane;
        for (int64_t i = 0; i < plane; ++i) b[i] = table[a[i]];
      }
    });
    batch.set("input", out);
    return batch;
  }
  torch::Tensor lut, offsets;
  {
    std::lock_guard lock(finish_mu_);
    if (!device_lut_.defined() || device_lut_.device() != x.device() || device_channels_ != channels) {
      device_lut_ = make_lut().to(x.device());
      device_offsets_ = (torch::arange(channels, torch::kLong) * 256).view({1, channels, 1, 1}).to(x.device());
      device_channels_ = channels;
    }
    lut = device_lut_;
    offsets = device_offsets_;
  }
  batch.set("input", lut.take(x.to(torch::kLong) + offsets));
  return batch;
}

}  // namespace troupe::actors
