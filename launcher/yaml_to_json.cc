#include "yaml_to_json.h"

#include <yaml.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "troupe/runtime/core/errors.h"

namespace troupe::launcher {
namespace {

using Json = nlohmann::json;

Json scalar(const yaml_node_t& n) {
  std::string s(reinterpret_cast<const char*>(n.data.scalar.value), n.data.scalar.length);
  if (n.data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return s;
  // YAML 1.1's booleans (a job file's `sync_batchnorm: yes`), in each case
  // form it allows; quoted ("yes"), they stay strings.
  for (const char* t : {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"})
    if (s == t) return true;
  for (const char* f : {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"})
    if (s == f) return false;
  if (s == "null" || s == "~" || s.empty()) return nullptr;
  char* end = nullptr;
  errno = 0;
  long long i = std::strtoll(s.c_str(), &end, 10);
  // Past int64 it is the number it says, as a JSON job file's (strtoll
  // clamped it to INT64_MAX silently).
  if (end && *end == '\0' && errno != ERANGE) return static_cast<int64_t>(i);
  double d = std::strtod(s.c_str(), &end);
  if (end && *end == '\0') return d;
  return s;
}

// A job file holds tens of values. Aliases share nodes, so a few lines
// can name a tree of billions (each level's list repeating the one below):
// past this many values, converting stops.
constexpr int64_t kMaxValues = 100000;

Json convert(yaml_document_t& doc, yaml_node_t* n, int depth, int64_t& values) {
  if (!n) return nullptr;
  // An alias inside the node it names (`a: &x [*x]`) nests without end.
  if (depth > 64) throw ConfigError("YAML nested deeper than 64 levels (an alias that refers to itself?)");
  if (++values > kMaxValues)
    throw ConfigError("YAML expands to more than " + std::to_string(kMaxValues) +
                      " values (aliases that repeat each other?)");
  switch (n->type) {
    case YAML_SCALAR_NODE:
      return scalar(*n);
    case YAML_SEQUENCE_NODE: {
      Json a = Json::array();
      for (auto* it = n->data.sequence.items.start; it < n->data.sequence.items.top; ++it)
        a.push_back(convert(doc, yaml_document_get_node(&doc, *it), depth + 1, values));
      return a;
    }
    case YAML_MAPPING_NODE: {
      Json o = Json::object();
      for (auto* p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; ++p) {
        // A scalar key is its text as written (`on:` stays "on", not "true").
        yaml_node_t* k = yaml_document_get_node(&doc, p->key);
        Json key = k && k->type == YAML_SCALAR_NODE
                       ? Json(std::string(reinterpret_cast<const char*>(k->data.scalar.value), k->data.scalar.length))
                       : convert(doc, k, depth + 1, values);
        o[key.is_string() ? key.get<std::string>() : key.dump()] =
            convert(doc, yaml_document_get_node(&doc, p->value), depth + 1, values);
      }
      return o;
    }
    default:
      return nullptr;
  }
}

}  // namespace

Json yaml_to_json(const std::string& text, const std::string& file) {
  yaml_parser_t parser;
  if (!yaml_parser_initialize(&parser)) throw ConfigError("cannot start a YAML parser for " + file);
  std::unique_ptr<yaml_parser_t, void (*)(yaml_parser_t*)> parser_guard(&parser, yaml_parser_delete);
  yaml_parser_set_input_string(&parser, reinterpret_cast<const unsigned char*>(text.data()), text.size());
  yaml_document_t doc;
  if (!yaml_parser_load(&parser, &doc))
    throw ConfigError("job file " + file + " is not YAML: " + (parser.problem ? parser.problem : "parse error") +
                      " at line " + std::to_string(parser.problem_mark.line + 1));
  std::unique_ptr<yaml_document_t, void (*)(yaml_document_t*)> doc_guard(&doc, yaml_document_delete);
  try {
    int64_t values = 0;
    return convert(doc, yaml_document_get_root_node(&doc), 0, values);
  } catch (const ConfigError& e) {
    throw ConfigError("job file " + file + ": " + e.what());
  }
}

}  // namespace troupe::launcher
