// The manifest.json of a checkpoint directory (checkpoint.h): step, epoch,
// world size, sampler cursor, metrics, and the name, size and SHA-256 of
// every file beside it. save_checkpoint writes it last; load_checkpoint and
// latest_checkpoint read it before any tensor file. It needs no LibTorch,
// so the fuzz lane reads manifests exactly as the trainer does.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "troupe/actors/distributed_sampler.h"

namespace troupe::trainer {

struct CheckpointManifest {
  struct File {
    std::string sha256;  // 64 lowercase hex digits
    uint64_t bytes = 0;
  };
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t world_size = 1;
  actors::SamplerCursor cursor;
  std::map<std::string, double> metrics;
  std::map<std::string, File> files;  // by plain file name in the directory
  // What the sampler's order was made from (seed, dataset_size, shuffle,
  // drop_last): a resume mid-epoch must make the same order, or the
  // cursor's position means other samples. Empty in older manifests.
  std::map<std::string, int64_t> data_order;
  // The sums of the epoch under way at `step` (loss, samples, busy time,
  // the step's own metrics), so that a job restored here mid-epoch ends
  // the epoch with the summary of all of it. Empty in older manifests and
  // at an epoch's start.
  std::map<std::string, double> epoch_sums;
};

inline constexpr const char* kCheckpointFormat = "troupe-checkpoint-1";

// The JSON text of `m` (indented, newline-terminated).
std::string manifest_text(const CheckpointManifest& m);

// Parses a manifest's text. Whatever the bytes, the answer is the manifest
// or a troupe::Error naming `path` and the problem: not JSON, another
// format, a field missing, of the wrong type or out of range (negative
// steps, a world size below 1), or a file name that is not a plain name
// inside the checkpoint directory (no '/', "." or ".."). Metrics that are
// not numbers are left out.
CheckpointManifest parse_manifest(std::string_view text, const std::string& path);

}  // namespace troupe::trainer
