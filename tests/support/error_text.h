// What a call refuses with: the message of the troupe::Error it throws.
#pragma once

#include <string>

#include "troupe/runtime/core/errors.h"

namespace troupe::test {

// The message of the troupe::Error that `f` throws ("" when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const troupe::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace troupe::test
