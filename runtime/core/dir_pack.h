// Packing a directory into one block of bytes and unpacking it elsewhere:
// how a driver's working directory reaches hosts that do not share its
// files (shipped_file.h's ship_dir). Which files go is decided as the
// Python shim's runtime_env working_dir decides (docs/python.md): every
// regular file under the directory but those an exclude pattern names,
// those the .gitignore and .rayignore files of their directories leave
// out (gitignore's syntax, as git reads it), and `.git`, `.hg`, `.svn`,
// `__pycache__`; links to directories are not followed.
//
// The archive is troupe's own, simple and deterministic (the same files
// make the same bytes): "TRPK1\n", the count of files (u64), then per
// file its name's length (u32),
// the name (relative, '/'-separated), its mode (u32: 0755 or 0644), its
// size (u64) and its bytes, integers little-endian. No times, owners or
// links travel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "troupe/runtime/core/buffer.h"

namespace troupe::core {

struct PackedFile {
  std::string disk;  // the path on this machine
  std::string name;  // relative to the packed directory
  uint64_t size = 0;
  bool executable = false;
};

// The ignore files read in each directory: .gitignore and .rayignore, or
// .rayignore alone when TROUPE_RUNTIME_ENV_IGNORE_GITIGNORE (or Ray's
// RAY_RUNTIME_ENV_IGNORE_GITIGNORE) is 1.
std::vector<std::string> default_ignore_files();

// The files of `root` that a pack holds, sorted by name. `excludes` are
// fnmatch patterns matched against the relative path and against each of
// its parts. A folder below `root` this user may not read is left out (as
// os.walk does). Throws ConfigError naming the path when `root` is not a
// directory or cannot be read, or an ignore file cannot be read.
std::vector<PackedFile> files_to_pack(const std::string& root, const std::vector<std::string>& excludes,
                                      const std::vector<std::string>& ignore_files = default_ignore_files());

// The archive of `files`, handed to `out` a few MiB at a time (it is never
// held whole): a file that grew since it was listed goes as the bytes it
// had then (a log being appended to). Throws ConfigError naming a file
// that cannot be read or shrank (what `out` throws goes through).
void pack_files(const std::vector<PackedFile>& files, const std::function<void(const std::byte*, size_t)>& out);
// The same archive in memory, and its size.
Buffer pack_files(const std::vector<PackedFile>& files);
uint64_t packed_size(const std::vector<PackedFile>& files);

// Writes the archive's files under `dest` (made if absent, 0755). Refuses,
// with an Error that names the entry, an archive that is cut short, a name
// that is absolute, empty or climbs out (a ".." part), or a file that is
// there already.
void unpack_files(const std::byte* data, size_t size, const std::string& dest);

}  // namespace troupe::core
