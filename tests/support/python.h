// The Python interpreter tests run scripts with (writing TorchScript files,
// reading checkpoints with torch.load): $TROUPE_TEST_PYTHON when set (the
// GPU lane points it at that machine's PyTorch), else the one the test
// target names (TROUPE_PYTHON: Debian's /usr/bin/python3, which has torch).
#pragma once

#include <cstdlib>
#include <string>

namespace troupe::test {

inline std::string python() {
  const char* p = std::getenv("TROUPE_TEST_PYTHON");
  if (p && *p) return p;
#ifdef TROUPE_PYTHON
  return TROUPE_PYTHON;
#else
  return "/usr/bin/python3";
#endif
}

}  // namespace troupe::test
