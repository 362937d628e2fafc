// What a bad command line says, for troupe and troupe-train: CLI11's words
// for a value it could not convert ("Could not convert: --lr = abc") become
// the option and the value it was given, as troupe's own checks name them.
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

namespace troupe::launcher {

// CLI::Range's check, saying what is wrong: CLI::Range calls "1e3" for a
// whole-number option, or "abc", "not in range", and lets NaN through.
template <class T>
CLI::Validator in_range(T lo, T hi) {
  std::ostringstream d;
  d << (std::is_integral_v<T> ? "INT" : "NUMBER") << " in [" << lo << " - " << hi << "]";
  return CLI::Validator(
      [lo, hi](std::string& given) -> std::string {
        std::ostringstream range;
        range << given << " is not in [" << lo << ", " << hi << "]";
        long double x{};
        if (!CLI::detail::lexical_cast(given, x) || std::isnan(x)) return given + " is not a number";
        T v{};
        if (!CLI::detail::lexical_cast(given, v)) {
          // A whole number past what T holds (-1 for a count), or none.
          const bool whole = given.find_first_of(".eE") == std::string::npos;
          return whole ? range.str() : given + " is not a whole number";
        }
        if (v < lo || v > hi) return range.str();
        return "";
      },
      d.str());
}

// For a whole-number option: a value past what int64 holds is refused,
// naming it (CLI11 alone clamps 99999999999999999999 to 9223372036854775807).
inline CLI::Validator fits_int64() {
  return CLI::Validator(
      [](std::string& given) -> std::string {
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(given.data(), given.data() + given.size(), v);
        if (ec != std::errc::result_out_of_range) return "";
        std::string why = given;
        why += " is out of range (whole numbers up to 9223372036854775807)";
        return why;
      },
      "");
}

// The edit distance of a and b (insertions, deletions, substitutions).
inline size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// What a command line that `app` (parsed with allow_extras) left over says:
// the arguments in the order given, and the option nearest the first
// unknown one ("--epoch" → "--epochs").
inline std::string unknown_arguments(const CLI::App& app, const std::vector<std::string>& extra) {
  std::string out = "unknown argument(s):";
  for (const auto& a : extra) {
    out += ' ';
    out += a;
  }
  const auto flag = std::find_if(extra.begin(), extra.end(), [](const auto& a) { return a.rfind("--", 0) == 0; });
  std::string best;
  if (flag != extra.end()) {
    const std::string name = flag->substr(2, flag->find('=') - 2);  // "--x=1" → "x"; npos - 2 takes the rest
    size_t best_distance = 3;                                       // at most 2 edits away
    for (const CLI::Option* opt : app.get_options()) {
      for (const auto& l : opt->get_lnames()) {
        if (const size_t d = edit_distance(name, l); d < best_distance) {
          best_distance = d;
          best = l;
        }
      }
    }
  }
  if (!best.empty()) {
    out += " (did you mean --";
    out += best;
    out += "?)";
  }
  out += "; see --help";
  return out;
}

inline std::string cli_message(const CLI::ParseError& e) {
  const std::string what = e.what();
  static const std::string kPrefix = "Could not convert: ";
  if (what.rfind(kPrefix, 0) != 0) return what;
  const std::string rest = what.substr(kPrefix.size());
  const auto eq = rest.find(" = ");
  if (eq == std::string::npos) return what;
  const std::string option = rest.substr(0, eq), value = rest.substr(eq + 3);
  // A value given twice reaches here joined by a comma.
  return option + " " + value + ": not a value " + option + " takes (see --help" +
         (value.find(',') != std::string::npos ? "; was it given twice?)" : ")");
}

}  // namespace troupe::launcher
