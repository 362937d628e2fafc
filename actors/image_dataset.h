// Image-like uint8 records (C×H×W) and their training-time augmentations:
// random crop, horizontal flip and per-channel normalisation, as torchvision's
// RandomCrop + RandomHorizontalFlip + ToTensor + Normalize do. The three are
// fused into one pass from the uint8 record into the float32 output, which
// is where a C++ loader beats a Python one. Random choices are a function of
// (seed, epoch, index), so an epoch's augmentations are reproducible whatever
// thread or machine loads which sample.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "troupe/actors/dataset.h"
#include "troupe/actors/npy.h"

namespace troupe::actors {

struct ImageTransformOptions {
  // Output side length of a random square crop; 0 keeps the full image.
  int64_t crop = 0;
  // Mirror left-right with probability 1/2.
  bool flip = false;
  // out = (pixel · scale − mean[c]) / std[c]; empty mean/std mean 0 and 1.
  // The default scale maps uint8 to [0, 1] as ToTensor does.
  double scale = 1.0 / 255.0;
  std::vector<double> mean{};
  std::vector<double> std{};
  int64_t seed = 0;
  // Crop and flip in the loader, but leave the pixels uint8: the trainer
  // applies the normalisation on its device (ImageRecordDataset::finish),
  // with the same per-channel table, so the values are the same floats.
  bool defer_normalize = false;
};

// The random choices for one (epoch, index): crop corner and flip.
struct ImageTransformDraw {
  int64_t top = 0;
  int64_t left = 0;
  bool flip = false;
};

ImageTransformDraw draw_image_transform(const ImageTransformOptions& options, int64_t height, int64_t width,
                                        int64_t epoch, int64_t index);

// Applies crop, flip and normalisation to a uint8 [C, H, W] tensor, giving
// float32 [C, crop, crop] (or [C, H, W] without crop). Throws troupe::Error
// for a wrong dtype/rank, a crop larger than the image, or a mean/std whose
// length is not C.
torch::Tensor transform_image(const torch::Tensor& image, const ImageTransformOptions& options, int64_t epoch,
                              int64_t index);

struct SyntheticImageOptions {
  int64_t size = 1024;
  int64_t channels = 3;
  int64_t height = 64;
  int64_t width = 64;
  int64_t num_classes = 10;
  int64_t seed = 0;
};

// uint8 records [N, C, H, W] with int64 labels [N]; samples are transformed
// records (float32) and their labels (int64 scalars).
class ImageRecordDataset final : public Dataset {
 public:
  // From tensors already in memory (or views of mapped .npy files).
  ImageRecordDataset(torch::Tensor images, torch::Tensor labels, ImageTransformOptions transform);
  // Random pixels and labels, deterministic from options.seed; materialised
  // at construction (N·C·H·W bytes) so loading measures the pipeline, not
  // the generator.
  static std::unique_ptr<ImageRecordDataset> synthetic(const SyntheticImageOptions& options,
                                                       ImageTransformOptions transform);
  // uint8 [N, C, H, W] images from one .npy file and integer labels [N] from
  // another (optional: labels are 0 without it); both stay memory-mapped.
  static std::unique_ptr<ImageRecordDataset> from_npy(const std::string& images_path, const std::string& labels_path,
                                                      ImageTransformOptions transform);

  int64_t size() const override { return images_.size(0); }
  std::string describe() const override;
  // With defer_normalize: uint8 "input" [B, C, H, W] → float32, by the
  // per-channel table transform_image uses, on the batch's own device. On
  // a CPU it writes into the previous call's output when nothing else holds
  // that any more (a fresh 77 MB tensor per batch of 128 × 224² spent more
  // time faulting in zeroed pages than normalising). On a GPU the table and
  // the channel offsets are copied there once and kept: a copy from host
  // memory per batch made the host wait for the device's queue to drain
  // every step (LibTorch synchronises a blocking host-to-device copy).
  TensorDict finish(TensorDict batch) const override;
  // Crops straight into the batch's rows (and its buffers, see
  // CollateBuffers): no per-sample tensor, no stacking copy.
  std::optional<TensorDict> load_batch(const std::vector<int64_t>& indices, int64_t epoch) const override;
  const torch::Tensor& images() const { return images_; }
  const torch::Tensor& labels() const { return labels_; }
  const ImageTransformOptions& transform() const { return transform_; }

 protected:
  Sample load(int64_t index, int64_t epoch) const override;

 private:
  torch::Tensor images_;
  torch::Tensor labels_;
  ImageTransformOptions transform_;
  std::string origin_;
  // The mapped .npy files images_ and labels_ view (none for synthetic
  // records): a read checks that they were not written in place since.
  std::vector<NpyArray> files_;
  void check_files() const;
  mutable std::mutex finish_mu_;
  mutable torch::Tensor finish_out_;  // finish()'s last CPU output
  // finish()'s table and channel offsets (channel·256) on the last GPU it
  // ran on, and the channel count they were made for.
  mutable torch::Tensor device_lut_, device_offsets_;
  mutable int64_t device_channels_ = 0;
};

}  // namespace troupe::actors
