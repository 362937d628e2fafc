// ShippedFile: a file the driver reads, sent to actors on hosts that do not
// share the driver's file system. The driver serves the file from its own
// object store in chunks read from the file when asked (ship_file); an
// actor that is handed the
// ShippedFile fetches it once per host into its session directory
// (local_copy), checking its SHA-256, and reads that copy. Every process of
// a host that needs the same content reads one copy: the copy is named by
// the content, written under a lock and renamed into place whole.
//
//   // driver
//   auto model = troupe::ship_file(rt, "/home/me/model.pt");
//   a.call(&A::load, model).get();
//   // actor
//   void A::load(troupe::ShippedFile f) { auto m = torch::jit::load(troupe::local_copy(f)); }
//
// A directory travels the same way, packed into one file (ship_dir,
// local_dir below).
//
// The chunks are objects of the driver's, served by the driver alone and
// read from disk when fetched, so they hold no memory and no store limit
// applies: a file's (ship_file) from the file, a directory's (ship_dir)
// from its archive, written to an unlinked file of shipping_folder() whose
// disk is freed when the ShippedDir's chunks go.
#pragma once

#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "troupe/runtime/client/object_ref.h"
#include "troupe/runtime/core/buffer.h"
#include "troupe/runtime/wire/codec.h"

namespace troupe {

class Runtime;

struct ShippedFile {
  // The path as the driver named it: what the receivers' configurations
  // still say, replaced there by the local copy (shipped_path).
  std::string path;
  uint64_t size = 0;
  std::string sha256;  // hex, of the whole file
  std::vector<ObjectRef<Buffer>> chunks;
  TROUPE_FIELDS(path, size, sha256, chunks);
};

// The bytes of one chunk (the last one may be shorter).
inline constexpr uint64_t kShippedChunkBytes = 32ull << 20;

// Ships `path`: reads it once for its size and SHA-256 and puts its
// pieces in this process's object store as file pieces (object_value.h),
// read again each time a host fetches one, so the driver holds none of it
// in memory and no store limit applies. A host's copy of a file changed
// after this is refused there (its digest differs). Throws ConfigError
// naming the path when it cannot be read or is not a regular file.
ShippedFile ship_file(Runtime& rt, const std::string& path);

// The path of this host's copy of `file`: <session>/shipped/<sha256
// prefix>-<file name>, fetched from the driver when not there yet (one
// process of the host fetches; the others wait for it and read its copy),
// or when the copy changed since it was checked (its size, modification
// time and inode are kept beside it, in NAME.ok). Throws Error naming the
// host, the file and the driver when it cannot be fetched, written, or its
// bytes do not match their digest.
std::string local_copy(const ShippedFile& file);

// `path`'s local copy when one of `files` ships it, else `path` itself.
std::string shipped_path(const std::vector<ShippedFile>& files, const std::string& path);

// The local copies an actor reads in place of the driver's paths, so that
// what it says (its errors, a model's description) names the driver's:
// the copy's name means nothing to the user. Thread-safe.
class DriverPaths {
 public:
  // shipped_path(files, path), remembering a copy it gives.
  std::string use(const std::vector<ShippedFile>& files, const std::string& path);
  // `text` with every copy's path replaced by the driver's.
  std::string named(std::string text) const;
  // Called in a catch block: rethrows the exception being handled, with
  // named(what()) when that changes it, as its registered class or the
  // troupe kind the wire carries it as (else unchanged).
  [[noreturn]] void rethrow(const std::exception& e) const;

 private:
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, std::string>> copies_;  // copy, driver's path; guarded by mu_
};

// A directory shipped whole (`troupe torchrun --ship-working-dir`): its
// files packed into one archive (core/dir_pack.h chooses them as a Python
// runtime_env working_dir's: .gitignore/.rayignore and `excludes` leave
// files out), shipped as a ShippedFile.
struct ShippedDir {
  std::string path;  // the driver's directory; "" = nothing shipped
  uint64_t files = 0;
  uint64_t bytes = 0;  // of the files, unpacked
  ShippedFile archive;
  // Random, one per ship_dir call: the copies its users share (a later
  // ship of the same files gets fresh ones, not what earlier users left).
  std::string shipment;
  TROUPE_FIELDS(path, files, bytes, archive, shipment);
};

struct DirShipping {
  std::vector<std::string> excludes;  // fnmatch patterns (dir_pack.h)
  // How the refusals tell the user to leave files out.
  std::string leave_out = "excludes (.gitignore and .rayignore count too)";
};

// Packs `dir` and ships it; `names` (if given) receives the files' paths
// inside it. ConfigError naming the directory when it cannot be read or
// its archive does not fit the free space of shipping_folder() (checked
// before anything is read).
ShippedDir ship_dir(Runtime& rt, const std::string& dir, const DirShipping& how = {},
                    std::vector<std::string>* names = nullptr);

// Where ship_dir writes archives: TROUPE_SHIPPING_DIR when set, else the
// first of $TMPDIR, /var/tmp and /tmp that this user can write and that is
// not held in memory (a tmpfs, such as $XDG_RUNTIME_DIR where sessions
// live by default, capped at a tenth of RAM), else the first writable,
// else the session folder.
std::string shipping_folder();

// This host's copy of `dir`'s shipment:
// <session>/shipped/<sha256 prefix>-<name>.<shipment prefix>.d, unpacked
// once per host (under a lock, through a staging directory renamed into
// place) and then left as the processes that run in it make it: it is
// their working directory, shared by every process of the host that uses
// the same shipment. This process holds a shared flock on NAME.d.use
// while it lives; each new copy marks the host's other copies that no
// process holds, and removes those marked at least
// TROUPE_SHIPPED_COPY_GRACE_S (600 s) before and not used since. Throws
// Error naming the host and the directory.
std::string local_dir(const ShippedDir& dir);

// `path` with the driver's directory `dir.path` replaced by `copy` when it
// lies inside it, else `path` itself.
std::string path_in_copy(const ShippedDir& dir, const std::string& copy, const std::string& path);

}  // namespace troupe
