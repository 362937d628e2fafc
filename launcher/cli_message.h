// What a bad command line says, for troupe and troupe-train: CLI11's words
// for a value it could not convert ("Could not convert: --lr = abc") become
// the option and the value it was given, as troupe's own checks name them.
#pragma once

#include <CLI/CLI.hpp>

#include <cmath>
#include <sstream>
#include <string>
#include <type_traits>

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
