#include "troupe/runtime/core/dir_pack.h"

#include <dirent.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <vector>

#include "troupe/runtime/core/errors.h"

namespace troupe::core {
namespace {

constexpr char kMagic[] = "TRPK1\n";
constexpr size_t kMagicBytes = sizeof kMagic - 1;
const char* const kAlwaysExcluded[] = {"__pycache__", ".git", ".hg", ".svn"};

// ---- .gitignore patterns (the Python shim's _packages.py, ported) ----

// One byte as a regex matches it: letters and digits as they are, the
// rest as \xHH (the same inside and outside a bracket expression).
std::string literal(char c) {
  const auto u = static_cast<unsigned char>(c);
  if (std::isalnum(u)) return std::string(1, c);
  char out[5];
  std::snprintf(out, sizeof out, "\\x%02x", u);
  return out;
}

// A well-formed UTF-8 sequence of two to four bytes (no overlongs,
// surrogates or code points past U+10FFFF: Python's decoder takes their
// bytes one by one).
const std::string& well_formed() {
  static const std::string sequence =
      "[\\xc2-\\xdf][\\x80-\\xbf]|\\xe0[\\xa0-\\xbf][\\x80-\\xbf]|[\\xe1-\\xec\\xee\\xef][\\x80-\\xbf]{2}|"
      "\\xed[\\x80-\\x9f][\\x80-\\xbf]|\\xf0[\\x90-\\xbf][\\x80-\\xbf]{2}|[\\xf1-\\xf3][\\x80-\\xbf]{3}|"
      "\\xf4[\\x80-\\x8f][\\x80-\\xbf]{2}";
  return sequence;
}

// Names are matched per character, as Python decodes them (UTF-8, with a
// byte that starts no whole sequence as one character of its own): a
// character other than '/' is one ASCII byte, a whole 2-, 3- or 4-byte
// sequence, or a byte past ASCII that starts none (never the lead of a
// whole sequence: a ? must not take é as two characters).
const std::string& any_char() {
  static const std::string any =
      "(?:[\\x00-\\x2e\\x30-\\x7f]|" + well_formed() + "|(?!" + well_formed() + ")[\\x80-\\xff])";
  return any;
}

// Bytes [lo, hi] past ASCII each standing alone (starting no whole
// sequence): the characters U+DC00 + byte of Python's surrogateescape.
std::string lone_bytes(unsigned char lo, unsigned char hi) {
  return "(?!" + well_formed() + ")[" + literal(char(lo)) + "-" + literal(char(hi)) + "]";
}

// The code point of the well-formed UTF-8 sequence at s[i] and its length
// (0: none starts there; ASCII is a sequence of one).
size_t utf8_at(const std::string& s, size_t i, uint32_t& cp) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char u = b(0);
  size_t n = u < 0x80 ? 1 : u >= 0xc2 && u <= 0xdf ? 2 : u >= 0xe0 && u <= 0xef ? 3 : u >= 0xf0 && u <= 0xf4 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  cp = n == 1 ? u : u & (0xff >> (n + 1));
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (b(k) & 0x3f);
  }
  const uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < least[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

// The character at s[i] as Python decodes it (surrogateescape): a
// well-formed sequence's code point, or one byte (ASCII, or past it and
// starting none: U+DC00 + the byte); its length in bytes.
size_t char_at(const std::string& s, size_t i, uint32_t& cp) {
  if (const size_t n = utf8_at(s, i, cp)) return n;
  cp = 0xdc00 + static_cast<unsigned char>(s[i]);
  return 1;
}

std::string utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += {char(0xc0 | (cp >> 6)), char(0x80 | (cp & 0x3f))};
  } else if (cp < 0x10000) {
    out += {char(0xe0 | (cp >> 12)), char(0x80 | ((cp >> 6) & 0x3f)), char(0x80 | (cp & 0x3f))};
  } else {
    out += {char(0xf0 | (cp >> 18)), char(0x80 | ((cp >> 12) & 0x3f)), char(0x80 | ((cp >> 6) & 0x3f)),
            char(0x80 | (cp & 0x3f))};
  }
  return out;
}

// Regexes of the UTF-8 sequences of code points [lo, hi] (no surrogates
// within), added to `out`: split until each piece's sequences have one
// length and differ only in trailing bytes that cover their whole range,
// so each piece is one byte range per position.
void utf8_ranges(uint32_t lo, uint32_t hi, std::vector<std::string>& out) {
  if (lo > hi) return;
  for (uint32_t edge : {0x7fu, 0x7ffu, 0xffffu}) {
    if (lo <= edge && hi > edge) {
      utf8_ranges(lo, edge, out);
      utf8_ranges(edge + 1, hi, out);
      return;
    }
  }
  const size_t n = utf8(lo).size();
  for (size_t k = 1; k < n; ++k) {
    const uint32_t m = (1u << (6 * k)) - 1;
    if ((lo & ~m) == (hi & ~m)) continue;
    if ((lo & m) != 0) {
      utf8_ranges(lo, lo | m, out);
      utf8_ranges((lo | m) + 1, hi, out);
      return;
    }
    if ((hi & m) != m) {
      utf8_ranges(lo, (hi & ~m) - 1, out);
      utf8_ranges(hi & ~m, hi, out);
      return;
    }
  }
  const std::string a = utf8(lo), z = utf8(hi);
  std::string regex;
  for (size_t k = 0; k < n; ++k)
    regex += a[k] == z[k] ? literal(a[k]) : "[" + literal(a[k]) + "-" + literal(z[k]) + "]";
  out.push_back(regex);
}

// The members of code points [lo, hi] (a range of a bracket expression
// with an end past ASCII, compared by code point as Python's re does): the
// ASCII ones added to a class's `body`, the others to `chars`. Throws
// regex_error for a reversed range (Python's pattern fails to compile,
// and the rule is dropped, as an ASCII one's).
void code_point_range(uint32_t lo, uint32_t hi, std::string& body, std::vector<std::string>& chars) {
  if (lo > hi) throw std::regex_error(std::regex_constants::error_range);
  if (lo < 0x80) body += literal(char(lo)) + "-" + literal(char(std::min<uint32_t>(hi, 0x7f)));
  if (hi < 0x80) return;
  // Surrogates have no UTF-8; U+DC80 to U+DCFF are the lone bytes.
  const uint32_t from = std::max<uint32_t>(lo, 0x80);
  if (from <= std::min<uint32_t>(hi, 0xd7ff)) utf8_ranges(from, std::min<uint32_t>(hi, 0xd7ff), chars);
  if (hi >= 0xe000) utf8_ranges(std::max<uint32_t>(from, 0xe000), hi, chars);
  const uint32_t a = std::max<uint32_t>(from, 0xdc80), z = std::min<uint32_t>(hi, 0xdcff);
  if (a <= z)
    chars.push_back(lone_bytes(static_cast<unsigned char>(a - 0xdc00), static_cast<unsigned char>(z - 0xdc00)));
}

std::string literals(const std::string& s) {
  std::string out;
  for (char c : s) out += literal(c);
  return out;
}

// POSIX classes of a bracket expression ([[:digit:]]), as git knows them.
const std::map<std::string, std::string>& posix_classes() {
  static const std::map<std::string, std::string> classes = {
      {"alnum", "a-zA-Z0-9"},
      {"alpha", "a-zA-Z"},
      {"blank", literals(" \t")},
      {"digit", "0-9"},
      {"lower", "a-z"},
      {"upper", "A-Z"},
      {"space", literals(" \t\n\r\f\v")},
      {"xdigit", "0-9A-Fa-f"},
      {"punct", literals("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")},
  };
  return classes;
}

// The regex of the bracket expression at pattern[i] ('['), with the index
// past it; false when it does not close. A '/' never matches one.
bool bracket(const std::string& p, size_t i, std::string& regex, size_t& past) {
  size_t j = i + 1;
  const bool negated = j < p.size() && (p[j] == '!' || p[j] == '^');
  j += negated;
  std::string body;                // the ASCII members, as a class's contents
  std::vector<std::string> chars;  // members past ASCII, one character each
  bool first = true;
  while (j < p.size()) {
    char c = p[j];
    if (c == ']' && !first) {
      std::string item = body.empty() ? "" : "[" + body + "]";
      for (const auto& m : chars) item += (item.empty() ? "" : "|") + m;
      item = "(?:" + item + ")";
      regex = negated ? "(?!" + item + ")" + any_char() : "(?!\\x2f)" + item;
      past = j + 1;
      return true;
    }
    first = false;
    if (c == '[' && p.compare(j, 2, "[:") == 0) {
      const size_t end = p.find(":]", j + 2);
      if (end != std::string::npos) {
        auto it = posix_classes().find(p.substr(j + 2, end - j - 2));
        if (it != posix_classes().end()) {
          body += it->second;
          j = end + 2;
          continue;
        }
      }
    }
    if (c == '\\' && j + 1 < p.size()) c = p[++j];
    // A range with an end past ASCII: by code point, as Python compares.
    uint32_t lo = 0, hi = 0;
    const size_t lo_bytes = char_at(p, j, lo);
    if (j + lo_bytes + 1 < p.size() && p[j + lo_bytes] == '-' && p[j + lo_bytes + 1] != ']') {
      size_t h = j + lo_bytes + 1;
      if (p[h] == '\\' && h + 1 < p.size()) ++h;
      const size_t hi_bytes = char_at(p, h, hi);
      if (lo >= 0x80 || hi >= 0x80) {
        code_point_range(lo, hi, body, chars);
        j = h + hi_bytes;
        continue;
      }
    }
    if (lo >= 0x80) {
      chars.push_back(lo >= 0xdc80 && lo <= 0xdcff ? lone_bytes(p[j], p[j]) : literals(p.substr(j, lo_bytes)));
      j += lo_bytes;
      continue;
    }
    if (j + 2 < p.size() && p[j + 1] == '-' && p[j + 2] != ']') {
      char high = p[j + 2];
      if (high == '\\' && j + 3 < p.size()) {
        high = p[j + 3];
        ++j;
      }
      body += literal(c) + "-" + literal(high);
      j += 3;
    } else {
      body += literal(c);
      ++j;
    }
  }
  return false;
}

// A gitignore pattern (its !, leading / and trailing / taken off) as a
// regex: * and ? never match a /; ** matches across them where it is a
// whole component ("**/x", "x/**", "x/**/y"), and is * elsewhere.
std::string wildmatch(const std::string& p) {
  std::string out;
  const size_t n = p.size();
  for (size_t i = 0; i < n;) {
    const char c = p[i];
    if (c == '*') {
      size_t j = i;
      while (j < n && p[j] == '*') ++j;
      const bool whole = (i == 0 || p[i - 1] == '/') && (j == n || p[j] == '/');
      if (j - i >= 2 && whole && j == n) {
        out += "[\\s\\S]*";  // everything inside
      } else if (j - i >= 2 && whole) {
        out += "(?:[\\s\\S]*\\x2f)?";  // no directory or any, its / included
        ++j;
      } else {
        out += "[^\\x2f]*";
      }
      i = j;
    } else if (c == '?') {
      out += any_char();
      ++i;
    } else if (c == '[') {
      std::string regex;
      size_t past = i;
      if (bracket(p, i, regex, past)) {
        out += regex;
        i = past;
      } else {
        out += literal(c);
        ++i;
      }
    } else if (c == '\\' && i + 1 < n) {
      out += literal(p[i + 1]);
      i += 2;
    } else {
      out += literal(c);
      ++i;
    }
  }
  return out;
}

struct IgnoreRule {
  std::string base;  // the ignore file's directory in the pack: "" or ending in /
  std::shared_ptr<const std::regex> regex;
  bool negated = false;
  bool dir_only = false;
  bool anchored = false;  // matched against the path below base, else the name alone

  bool matches(const std::string& relative, bool is_dir) const {
    if (dir_only && !is_dir) return false;
    const std::string target =
        anchored ? relative.substr(base.size()) : relative.substr(relative.find_last_of('/') + 1);
    return std::regex_match(target, *regex);
  }
};

// The rule of one line of an ignore file in directory `base`; false for a
// blank line, a comment or a pattern git matches nothing with.
bool ignore_rule(std::string line, const std::string& base, IgnoreRule& rule) {
  if (!line.empty() && line.back() == '\r') line.pop_back();
  if (line.empty() || line[0] == '#') return false;
  // Trailing spaces go, unless a backslash quotes them (git's
  // trim_trailing_spaces: a line that ends in a lone backslash keeps all).
  std::optional<size_t> last_space;
  for (size_t i = 0; i < line.size(); ++i) {
    if (line[i] == ' ') {
      if (!last_space) last_space = i;
      continue;
    }
    if (line[i] == '\\' && ++i == line.size()) {
      last_space.reset();
      break;
    }
    last_space.reset();
  }
  if (last_space) line.resize(*last_space);
  rule.negated = !line.empty() && line[0] == '!';
  if (rule.negated) line.erase(0, 1);
  rule.dir_only = !line.empty() && line.back() == '/';
  if (rule.dir_only) line.pop_back();
  rule.anchored = line.find('/') != std::string::npos;
  if (!line.empty() && line[0] == '/') line.erase(0, 1);
  if (line.empty()) return false;
  try {
    rule.regex = std::make_shared<const std::regex>(wildmatch(line), std::regex::ECMAScript);
  } catch (const std::regex_error&) {
    return false;  // a range such as [z-a]: git's matches nothing
  }
  rule.base = base;
  return true;
}

void add_ignore_rules(const std::string& directory, const std::string& base, const std::vector<std::string>& names,
                      std::vector<IgnoreRule>& rules) {
  for (const auto& name : names) {
    const std::string path = directory + "/" + name;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    std::ifstream in(path, std::ios::binary);
    if (!in) throw ConfigError("cannot read " + path + ": " + std::strerror(errno));
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    size_t start = 0;
    for (;;) {
      const size_t end = text.find('\n', start);
      IgnoreRule rule;
      if (ignore_rule(text.substr(start, end == std::string::npos ? std::string::npos : end - start), base, rule))
        rules.push_back(std::move(rule));
      if (end == std::string::npos) break;
      start = end + 1;
    }
  }
}

// The last rule that matches decides, as in git.
bool ignored(const std::string& relative, bool is_dir, const std::vector<IgnoreRule>& rules) {
  bool out = false;
  for (const auto& rule : rules)
    if (rule.matches(relative, is_dir)) out = !rule.negated;
  return out;
}

bool excluded(const std::string& relative, const std::vector<std::string>& excludes) {
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t end = relative.find('/', start);
    parts.push_back(relative.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  for (const auto& part : parts)
    for (const char* always : kAlwaysExcluded)
      if (part == always) return true;
  for (std::string pattern : excludes) {
    while (!pattern.empty() && pattern.front() == '/') pattern.erase(0, 1);
    while (!pattern.empty() && pattern.back() == '/') pattern.pop_back();
    if (::fnmatch(pattern.c_str(), relative.c_str(), FNM_NOESCAPE) == 0) return true;
    for (const auto& part : parts)
      if (::fnmatch(pattern.c_str(), part.c_str(), FNM_NOESCAPE) == 0) return true;
  }
  return false;
}

void walk(const std::string& directory, const std::string& relative_dir, std::vector<IgnoreRule> rules,
          const std::vector<std::string>& excludes, const std::vector<std::string>& ignore_files,
          std::vector<PackedFile>& out) {
  add_ignore_rules(directory, relative_dir, ignore_files, rules);
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(directory.c_str()), ::closedir);
  // A folder below the root that this user may not read is left out, as
  // the Python packer's os.walk leaves it (a database volume of root's).
  if (!d && errno == EACCES && !relative_dir.empty()) return;
  if (!d) throw ConfigError("cannot read the directory " + directory + ": " + std::strerror(errno));
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d.get())) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  d.reset();
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    const std::string path = directory + "/" + name, relative = relative_dir + name;
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) continue;  // gone meanwhile
    if (S_ISDIR(st.st_mode)) {
      if (!excluded(relative, excludes) && !ignored(relative, true, rules))
        walk(path, relative + "/", rules, excludes, ignore_files, out);
      continue;
    }
    // A link to a file goes as the file; a link to a directory not at all.
    if (S_ISLNK(st.st_mode) && ::stat(path.c_str(), &st) != 0) continue;
    if (!S_ISREG(st.st_mode) || excluded(relative, excludes) || ignored(relative, false, rules)) continue;
    out.push_back({path, relative, uint64_t(st.st_size), (st.st_mode & 0111) != 0});
  }
}

}  // namespace

std::vector<std::string> default_ignore_files() {
  for (const char* name : {"TROUPE_RUNTIME_ENV_IGNORE_GITIGNORE", "RAY_RUNTIME_ENV_IGNORE_GITIGNORE"}) {
    const char* v = std::getenv(name);
    if (v && std::string(v) == "1") return {".rayignore"};
  }
  return {".gitignore", ".rayignore"};
}

std::vector<PackedFile> files_to_pack(const std::string& root, const std::vector<std::string>& excludes,
                                      const std::vector<std::string>& ignore_files) {
  struct stat st {};
  if (::stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw ConfigError(root + " is not a directory on this machine");
  std::vector<PackedFile> out;
  walk(root, "", {}, excludes, ignore_files, out);
  std::sort(out.begin(), out.end(), [](const PackedFile& a, const PackedFile& b) { return a.name < b.name; });
  return out;
}

uint64_t packed_size(const std::vector<PackedFile>& files) {
  uint64_t total = kMagicBytes + 8;
  for (const auto& f : files) total += 4 + f.name.size() + 4 + 8 + f.size;
  return total;
}

void pack_files(const std::vector<PackedFile>& files, const std::function<void(const std::byte*, size_t)>& out) {
  const auto put = [&](const void* p, size_t n) { out(static_cast<const std::byte*>(p), n); };
  const auto integer = [&](uint64_t v, size_t bytes) {
    unsigned char b[8];
    for (size_t i = 0; i < bytes; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    put(b, bytes);
  };
  put(kMagic, kMagicBytes);
  integer(files.size(), 8);
  // Files go through this much memory at a time, however big they are.
  uint64_t largest = 0;
  for (const auto& f : files) largest = std::max(largest, f.size);
  std::vector<std::byte> piece(size_t(std::min<uint64_t>(largest, 4u << 20)) + 1);
  for (const auto& f : files) {
    integer(f.name.size(), 4);
    put(f.name.data(), f.name.size());
    integer(f.executable ? 0755 : 0644, 4);
    integer(f.size, 8);
    int fd = ::open(f.disk.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw ConfigError("cannot read " + f.disk + ": " + std::strerror(errno));
    std::unique_ptr<int, void (*)(int*)> closer(&fd, [](int* p) { ::close(*p); });
    uint64_t n = 0;
    for (ssize_t r;
         n < f.size && (r = ::read(fd, piece.data(), size_t(std::min<uint64_t>(piece.size(), f.size - n)))) != 0;) {
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw ConfigError("cannot read " + f.disk + ": " + std::strerror(errno));
      put(piece.data(), size_t(r));
      n += uint64_t(r);
    }
    // A file that grew since it was listed (a log being written) goes as
    // its first f.size bytes; one that shrank cannot be packed.
    if (n != f.size) throw ConfigError(f.disk + " shrank while it was packed");
  }
}

Buffer pack_files(const std::vector<PackedFile>& files) {
  std::byte* p = nullptr;
  Buffer out = Buffer::allocate(size_t(packed_size(files)), &p);
  pack_files(files, [&](const std::byte* data, size_t n) {
    std::memcpy(p, data, n);
    p += n;
  });
  return out;
}

namespace {

struct Reader {
  const std::byte* p;
  size_t left;
  bool take(void* out, size_t n) {
    if (n > left) return false;
    std::memcpy(out, p, n);
    p += n;
    left -= n;
    return true;
  }
  template <class T>
  bool integer(T& v) {
    unsigned char b[sizeof(T)];
    if (!take(b, sizeof b)) return false;
    v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= T(b[i]) << (8 * i);
    return true;
  }
};

bool safe_name(const std::string& name) {
  if (name.empty() || name[0] == '/' || name.find('\0') != std::string::npos) return false;
  for (size_t start = 0;;) {
    const size_t end = name.find('/', start);
    const std::string part = name.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (part.empty() || part == "." || part == "..") return false;
    if (end == std::string::npos) return true;
    start = end + 1;
  }
}

// Makes the directories of `name` below `dest`, refusing one that is there
// as something else (a file or a link).
void make_parents(const std::string& dest, const std::string& name) {
  for (size_t slash = name.find('/'); slash != std::string::npos; slash = name.find('/', slash + 1)) {
    const std::string dir = dest + "/" + name.substr(0, slash);
    if (::mkdir(dir.c_str(), 0755) == 0) continue;
    struct stat st {};
    if (errno != EEXIST || ::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      throw Error("cannot unpack " + name + ": " + dir + " cannot be made a directory");
  }
}

}  // namespace

void unpack_files(const std::byte* data, size_t size, const std::string& dest) {
  Reader in{data, size};
  char magic[kMagicBytes];
  if (!in.take(magic, kMagicBytes) || std::memcmp(magic, kMagic, kMagicBytes) != 0)
    throw Error("not a troupe directory pack (no TRPK1 header)");
  uint64_t count = 0;
  if (!in.integer(count)) throw Error("a directory pack cut short (its count of files)");
  if (::mkdir(dest.c_str(), 0755) != 0 && errno != EEXIST)
    throw Error("cannot make " + dest + ": " + std::strerror(errno));
  for (uint64_t i = 0; i < count; ++i) {
    uint32_t name_size = 0, mode = 0;
    uint64_t file_size = 0;
    std::string name;
    if (!in.integer(name_size) || name_size > in.left) throw Error("a directory pack cut short (a name)");
    name.resize(name_size);
    in.take(name.data(), name_size);
    if (!safe_name(name)) throw Error("a directory pack names " + name + ", which is not a path inside it");
    if (!in.integer(mode) || !in.integer(file_size) || file_size > in.left)
      throw Error("a directory pack cut short (in " + name + ")");
    make_parents(dest, name);
    const std::string path = dest + "/" + name;
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode == 0755 ? 0755 : 0644);
    if (fd < 0) throw Error("cannot unpack " + name + " into " + dest + ": " + std::strerror(errno));
    for (uint64_t n = 0; n < file_size;) {
      ssize_t w = ::write(fd, in.p + n, size_t(file_size - n));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const std::string why = std::strerror(errno);
        ::close(fd);
        throw Error("cannot write " + path + ": " + why);
      }
      n += uint64_t(w);
    }
    ::close(fd);
    in.p += file_size;
    in.left -= size_t(file_size);
  }
  if (in.left != 0) throw Error("a directory pack holds more than its count of files");
}

}  // namespace troupe::core
