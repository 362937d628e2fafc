// Data sets over arrays a Python user already has on disk, memory-mapped:
//
//   ArrayDataset        several equally long arrays by key — the arrays of
//                       one .npz archive, or one .npy file per key; sample i
//                       is {key: array[key][i]} for every key, so each array
//                       is a batch key and its first dimension the sample
//                       index.
//   TokenStreamDataset  a language-model corpus: one long 1-d stream of token
//                       ids (a raw uint16/uint32 .bin as nanoGPT writes, or
//                       a 1-d integer .npy); sample i is the window
//                       {"input": x[s : s+B], "target": x[s+1 : s+B+1]} with
//                       s = i * stride, as int64.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "troupe/actors/dataset.h"
#include "troupe/actors/npy.h"

namespace troupe::actors {

class ArrayDataset final : public Dataset {
 public:
  // Throws ConfigError naming the array whose first dimension differs from
  // the others', or when there is no array.
  ArrayDataset(std::map<std::string, NpyArray> arrays, std::string description);
  // The arrays of the .npz at `path`.
  static std::unique_ptr<ArrayDataset> from_npz(const std::string& path);
  // One .npy per key.
  static std::unique_ptr<ArrayDataset> from_npy_files(const std::map<std::string, std::string>& paths);

  int64_t size() const override { return rows_; }
  std::string describe() const override { return description_; }

 protected:
  Sample load(int64_t index, int64_t epoch) const override;

 private:
  std::map<std::string, NpyArray> arrays_;
  std::string description_;
  int64_t rows_ = 0;
};

struct TokenStreamOptions {
  std::string path;
  // Tokens per sample.
  int64_t block_size = 128;
  // Tokens between the starts of consecutive samples; 0 = block_size
  // (windows that do not overlap).
  int64_t stride = 0;
  // Element type of a raw (non-.npy) file: "uint16" or "uint32" (also
  // "int32", "int64"). A .npy file says its own.
  std::string dtype = "uint16";
};

class TokenStreamDataset final : public Dataset {
 public:
  // Throws ConfigError naming the file or option (not 1-d, not integers,
  // shorter than block_size + 1 tokens, bad dtype).
  explicit TokenStreamDataset(TokenStreamOptions options);

  int64_t size() const override { return windows_; }
  std::string describe() const override;
  int64_t tokens() const { return tokens_.shape()[0]; }

 protected:
  Sample load(int64_t index, int64_t epoch) const override;

 private:
  TokenStreamOptions options_;
  NpyArray tokens_;
  int64_t windows_ = 0;
};

}  // namespace troupe::actors
