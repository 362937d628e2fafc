// One libFuzzer binary per target: TROUPE_FUZZ_TARGET names the function
// and TROUPE_FUZZ_NAME the target. With TROUPE_FUZZ_SEEDS set to a
// directory (scripts/fuzz.sh passes its working corpus), the target's seeds
// are written there before the fuzzer reads it.
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "tests/fuzz/targets.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("TROUPE_FUZZ_SEEDS");
  if (!dir) return 0;
  std::filesystem::create_directories(dir);
  int i = 0;
  for (const auto& s : troupe::fuzz::seeds(TROUPE_FUZZ_NAME))
    std::ofstream(std::filesystem::path(dir) / ("seed-" + std::to_string(i++)), std::ios::binary) << s;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return troupe::fuzz::TROUPE_FUZZ_TARGET(data, size);
}
