// The fuzz targets: every parser that reads bytes another process or a file
// controls, each as a function of one input. tests/fuzz/fuzz_main.cc makes
// a libFuzzer binary of each (the `fuzz` preset, scripts/fuzz.sh); the
// corpus test runs them over fixed inputs and the regressions under
// tests/fuzz/corpus/ in every build. A target returns 0 and must neither
// crash nor trip a sanitizer, whatever the input; refusing it with an
// exception of troupe's hierarchy is the expected answer to bad bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace troupe::fuzz {

// Frame header, attachment sizes and the Cap'n Proto Envelope, as a reader
// with the head's limits checks and decodes them.
int frame_target(const uint8_t* data, size_t size);
// Codec decoding of every control-plane type and of the built-in argument
// types; the first byte picks the type.
int codec_target(const uint8_t* data, size_t size);
// A real accepting Connection on loopback: the first byte says whether the
// client passes the handshake (then the rest is frames) or sends the rest
// as its handshake.
int connection_target(const uint8_t* data, size_t size);
// The head's KV store: values put by one client and read as counters
// (kv_add) by another.
int kv_target(const uint8_t* data, size_t size);
// .npy images (first byte even) and .npz archives (odd) as the data sets
// read them: header, data size, zip directory, inflated members.
int npy_target(const uint8_t* data, size_t size);
// A checkpoint's manifest.json; one that is accepted must write and read
// back as itself.
int manifest_target(const uint8_t* data, size_t size);
// The head's HTTP endpoint: a request head as HttpServer parses it, and
// the same bytes as a form body and as URL-encoded text.
int http_target(const uint8_t* data, size_t size);

struct Target {
  const char* name;
  int (*run)(const uint8_t*, size_t);
};
inline constexpr Target kTargets[] = {
    {"frame", frame_target}, {"codec", codec_target}, {"connection", connection_target},
    {"kv", kv_target},       {"npy", npy_target},     {"manifest", manifest_target},
    {"http", http_target}};

// Valid inputs of each target (seeds for the fuzzer, and the corpus test's
// starting points).
std::vector<std::string> seeds(const std::string& target);

}  // namespace troupe::fuzz
