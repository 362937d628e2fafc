// What a bad command line says, for troupe and troupe-train: CLI11's words
// for a value it could not convert ("Could not convert: --lr = abc") become
// the option and the value it was given, as troupe's own checks name them.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace troupe::launcher {

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
