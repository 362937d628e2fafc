// YAML job files for `troupe train`: a YAML document read with libyaml
// (Debian's libyaml-dev) into the JSON value a JSON job file would give, so
// one reader checks both. Plain scalars that read as integers, floats,
// booleans (true/false, and YAML 1.1's yes/no/on/off, in lower, Capitalised
// or UPPER case) or null become those; quoted ones, and mapping keys, stay
// strings.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace troupe::launcher {

// ConfigError naming `file` and the line of a syntax error.
nlohmann::json yaml_to_json(const std::string& text, const std::string& file);

}  // namespace troupe::launcher
