// What an exception_ptr says, for messages that name a failure's cause:
// its what() for a std::exception, a fixed text for anything else thrown.
#pragma once

#include <exception>
#include <string>

namespace troupe::core {

inline std::string exception_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "not a std::exception";
  }
}

}  // namespace troupe::core
