// Command-line checks the examples share: CLI11's PositiveNumber and
// NonNegativeNumber let "nan" through (no comparison with NaN fails), and a
// NaN number of seconds would run forever or not at all.
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

}  // namespace troupe::examples
