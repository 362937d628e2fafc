// Where a host keeps the copies of files drivers shipped to its workers
// (shipped_file.h): one folder of the session, removed by whoever ends the
// session's processes on that host (its node agent, `troupe stop`,
// `troupe slurm`).
#pragma once

#include <string>

namespace troupe {

// SESSION/shipped.
std::string shipped_copies_dir(const std::string& session_dir);
// Removes SESSION/shipped and what it holds; errors are ignored (cleanup).
void remove_shipped_copies(const std::string& session_dir);

}  // namespace troupe
