// CUDA_VISIBLE_DEVICES as CUDA reads it: an index or a GPU-/MIG- UUID per
// entry (blanks around it ignored, as torch does), and the devices end at
// the first entry that is neither ("-1", "", "NoDevFiles" hide what
// follows). Read by the node agent (its GPU k is
// the k-th device) and by `troupe slurm` (a node's GPU count).
#pragma once

#include <string>
#include <vector>

namespace troupe::core {

inline std::vector<std::string> cuda_visible_devices(const std::string& value) {
  std::vector<std::string> out;
  for (size_t start = 0;;) {
    const size_t comma = value.find(',', start);
    std::string e = value.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t first = e.find_first_not_of(" \t\r\n");
    e = first == std::string::npos ? "" : e.substr(first, e.find_last_not_of(" \t\r\n") - first + 1);
    const bool index = !e.empty() && e.size() <= 9 && e.find_first_not_of("0123456789") == std::string::npos;
    if (!index && e.rfind("GPU-", 0) != 0 && e.rfind("MIG-", 0) != 0) return out;
    out.push_back(e);
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

}  // namespace troupe::core
