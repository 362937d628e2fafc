// How every benchmark prints a result: one JSON object per line on stdout,
// keys in the order written (bench, case, value, unit first),
// flushed at once (bench/run's readers and CI see rows as they come). A
// peer that fails or times out is an error row, never a missing one.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace troupe::bench {

inline void print_row(const nlohmann::ordered_json& row) {
  std::printf("%s\n", row.dump().c_str());
  std::fflush(stdout);
}

// {"bench": ..., "case": ..., "error": ...}
inline void print_error_row(const std::string& bench, const std::string& case_name, const std::string& error) {
  print_row({{"bench", bench}, {"case", case_name}, {"error", error}});
}

// The middle value (the upper one of an even count); v must not be empty.
template <class T>
T median(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace troupe::bench
