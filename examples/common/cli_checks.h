// Command-line checks the examples share: CLI11's PositiveNumber and
// NonNegativeNumber let "nan" through (no comparison with NaN fails), and a
// NaN number of seconds would run forever or not at all; their message
// names the range up to the largest double, 309 digits.
#pragma once

#include <CLI/CLI.hpp>

#include <cmath>
#include <string>

namespace troupe::examples {

// A finite number: "nan" and "inf" are refused, naming the value.
inline const CLI::Validator kFinite(
    [](std::string& text) -> std::string {
      double v = 0;
      if (!CLI::detail::lexical_cast(text, v) || std::isfinite(v)) return {};  // not a number: the option's own error
      return "not a finite number: " + text;
    },
    "FINITE");

namespace detail {

inline CLI::Validator number_check(bool (*ok)(double), const char* must_be, const char* name) {
  return CLI::Validator(
      [ok, must_be](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return {};  // not a number: the option's own error
        return ok(v) ? std::string() : std::string("must be ") + must_be + ", got " + text;
      },
      name);
}

}  // namespace detail

// "--hidden: must be a positive number, got 0".
inline const CLI::Validator kPositive =
    detail::number_check([](double v) { return std::isfinite(v) && v > 0; }, "a positive number", "POSITIVE");
inline const CLI::Validator kNonNegative =
    detail::number_check([](double v) { return std::isfinite(v) && v >= 0; }, "a number >= 0", "NONNEGATIVE");

}  // namespace troupe::examples
