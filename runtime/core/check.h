// The one precondition macro: TROUPE_CHECK(cond) << "context";
// throws troupe::Error naming the file, line and the failed condition.
#pragma once

#include <sstream>
#include <string>

#include "troupe/runtime/core/errors.h"

namespace troupe::core {

class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* cond) {
    stream_ << file << ":" << line << ": check failed: " << cond;
  }
  template <class T>
  CheckFailure& operator<<(const T& v) {
    if (!has_detail_) {
      stream_ << ": ";
      has_detail_ = true;
    }
    stream_ << v;
    return *this;
  }
  [[noreturn]] void raise() const { throw Error(stream_.str()); }

 private:
  std::ostringstream stream_;
  bool has_detail_ = false;
};

// Lets `TROUPE_CHECK(x) << a << b;` throw at the end of the full expression.
struct CheckRaiser {
  [[noreturn]] void operator&(const CheckFailure& f) const { f.raise(); }
};

}  // namespace troupe::core

#define TROUPE_CHECK(cond)             \
  if (__builtin_expect(!!(cond), 1)) { \
  } else                               \
    ::troupe::core::CheckRaiser{} & ::troupe::core::CheckFailure(__FILE__, __LINE__, #cond)
