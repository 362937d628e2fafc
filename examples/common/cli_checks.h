// Command-line checks the examples share: CLI11's PositiveNumber and
// NonNegativeNumber let "nan" through (no comparison with NaN fails), and a
// NaN number of seconds would run forever or not at all; their message
// names the range up to the largest double, 309 digits.
#pragma once

#include <CLI/CLI.hpp>

#include <cmath>
#include <optional>
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

// Parses the command line: std::nullopt to go on, else the exit status
// (0 after --help; 2, as the troupe CLI, for a bad flag or value: CLI11's
// own codes, 105-109, told a script nothing common).
inline std::optional<int> parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  return std::nullopt;
}

}  // namespace troupe::examples

// In main(): returns the exit status when the command line says to stop.
#define TROUPE_EXAMPLE_PARSE(app, argc, argv)                                                               \
  do {                                                                                                      \
    if (auto troupe_parse_exit = troupe::examples::parse((app), (argc), (argv))) return *troupe_parse_exit; \
  } while (0)
