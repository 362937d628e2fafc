// What an exception says, for messages that name a failure's cause.
#pragma once

#include <exception>
#include <string>

namespace troupe::core {

// An exception_ptr's what() for a std::exception, a fixed text for anything
// else thrown.
inline std::string exception_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "not a std::exception";
  }
}

// The first non-empty line of a message, without its trailing blanks: a
// one-line reason for a message that may go on (a torch error's source
// excerpt). The text itself when no line has anything.
inline std::string first_line(const std::string& text) {
  const size_t begin = text.find_first_not_of(" \n\r\t");
  if (begin == std::string::npos) return text;
  std::string line = text.substr(begin, text.find('\n', begin) - begin);
  line.erase(line.find_last_not_of(" \r\t") + 1);
  return line;
}

// The last non-empty line of a message that ends a traceback (TorchScript's
// interpreter errors): the line that says what went wrong, e.g.
// "RuntimeError: KeyError: features".
inline std::string last_line(const std::string& text) {
  const size_t end = text.find_last_not_of(" \n\r\t");
  if (end == std::string::npos) return text;
  const size_t newline = text.rfind('\n', end);
  const size_t begin = newline == std::string::npos ? 0 : newline + 1;
  return text.substr(begin, end + 1 - begin);
}

}  // namespace troupe::core
