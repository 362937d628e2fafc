// Counter-based random numbers for data loading. Every sample's randomness
// (synthetic features, crop offsets, flips) is a pure function of
// (seed, epoch, index), so any subset of a data set can be produced in any
// order, on any thread or machine, and still be bitwise reproducible. A
// shared stateful generator would make results depend on thread scheduling.
#pragma once

#include <cmath>
#include <cstdint>

namespace troupe::actors {

// SplitMix64's finalizer: a fast, well-mixed bijection on 64-bit words.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// A small generator seeded from a tuple of keys. Not cryptographic; meant
// for per-sample streams of a few hundred draws at most.
class SampleRng {
 public:
  explicit SampleRng(uint64_t seed, uint64_t a = 0, uint64_t b = 0, uint64_t c = 0)
      : state_(mix64(mix64(mix64(mix64(seed) ^ a) ^ b) ^ c)) {}

  uint64_t next_u64() {
    state_ += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return double(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n); the modulo bias is below 2^-40 for n < 2^24.
  int64_t uniform_int(int64_t n) { return n <= 1 ? 0 : int64_t(next_u64() % uint64_t(n)); }
  bool bernoulli(double p) { return uniform() < p; }
  // Standard normal by Box-Muller (one value per call; simplicity over speed).
  double normal() {
    double u1 = uniform();
    double u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586476925 * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace troupe::actors
