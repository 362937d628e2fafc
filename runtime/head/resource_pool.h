// ResourcePool: the resources of one node (or of one placement-group bundle
// reserved on a node) as a value: what it has in total, what is in use, and
// which GPU ids are free. Every take and give-back of resources and GPU ids
// in the head goes through here, so the bookkeeping lives in one place.
// validate_resources is the one check every resource value passes at every
// entry (node registration, actor options, bundles), on the head and in the
// client.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "troupe/runtime/wire/protocol.h"

namespace troupe::head {

using wire::Resources;

// Largest amount of any resource, and of GPUs, that anyone may ask for or
// register: enough for any real machine, small enough that sums stay exact.
inline constexpr double kMaxResourceAmount = 1e9;
inline constexpr double kMaxGpus = 1024;
// "memory" is counted in whole bytes (as Ray's): up to 1 PiB, where sums of
// whole numbers are still exact in a double.
inline constexpr double kMaxMemoryBytes = double(1ull << 50);
// The smallest part of a resource anyone may ask for (as Ray's): smaller
// amounts read as zero in the scheduler's comparisons and in status.
inline constexpr double kSmallestAmount = 1e-4;

// Throws ConfigError naming `where`, the key and the value unless every
// amount is finite, >= 0 and within the bounds above (and every key is
// non-empty).
void validate_resources(const Resources& r, const std::string& where);
// A name that status, logs and the dashboard print (an actor's name or
// class): UTF-8 text without control characters (a newline would forge a
// line of a log or break a table), at most kMaxShownName bytes.
constexpr size_t kMaxShownName = 1024;
void validate_shown_name(const std::string& name, const std::string& what);

// An actor's max_concurrency: its worker runs that many call threads, so it
// is bounded like any other request (the head checks it again for any
// client). ConfigError naming the value outside [1, kMaxActorConcurrency].
inline constexpr int32_t kMaxActorConcurrency = 1024;
void validate_max_concurrency(int64_t n);
// An actor's concurrency groups: at most client::kMaxConcurrencyGroups,
// each with a distinct non-empty name and a max_concurrency as above, and
// no method in two groups; with `methods` (the actor's, when known), every
// listed method among them. ConfigError naming `class_name` and the value.
void validate_concurrency_groups(const std::vector<wire::ConcurrencyGroup>& groups, const std::string& class_name,
                                 const std::vector<std::string>* methods = nullptr);

// What a take handed out: the amounts and the GPU ids that go with them.
struct Grant {
  Resources resources;
  std::vector<int32_t> gpu_ids;
};

// GPU ids in `r`: its "GPU" amount rounded, and 1 for a part of one GPU.
int gpu_count(const Resources& r);

class ResourcePool {
 public:
  ResourcePool() = default;
  // A node's pool: GPU ids 0..GPU-1.
  explicit ResourcePool(Resources total);
  // A bundle's pool: exactly the GPU ids it reserved (a bundle of a fraction
  // of a GPU has that fraction of its one GPU).
  ResourcePool(Resources total, std::vector<int32_t> gpu_ids);

  const Resources& total() const { return total_; }
  const Resources& available() const { return available_; }
  // total - available, per key of total.
  Resources used() const;
  const std::vector<int32_t>& gpu_ids() const { return gpu_ids_; }
  // The GPU ids that are wholly free.
  std::vector<int32_t> free_gpus() const;
  // The free part of each GPU of gpu_ids() (1 = all of it), in that order.
  const std::vector<double>& gpu_free() const { return gpu_free_; }

  bool fits(const Resources& req) const;
  // Takes `req` and its GPUs: whole free GPUs for a whole number, a share of
  // one GPU for a fraction (scheduler.h pick_gpus); ConfigError when it does
  // not fit (callers check fits first).
  Grant take(const Resources& req);
  // Returns what take handed out.
  void give_back(const Grant& grant);
  // Takes back amounts (no GPUs) that were lent to the pool, whether or not
  // they are free now: available() may go below zero, and nothing fits
  // there until enough comes back (a task that resumes after lending its
  // CPU runs at once, as in Ray).
  void reclaim(const Resources& amounts);
  // Takes exactly `grant` again (its amounts and its GPU ids): a restarted
  // head rebuilding what it had handed out. ConfigError when its GPUs are
  // not free (other amounts may run over, as after reclaim).
  void retake(const Grant& grant);

 private:
  Resources total_;
  Resources available_;
  std::vector<int32_t> gpu_ids_;
  // Per GPU of gpu_ids_: what this pool has of it, and what is free now.
  std::vector<double> gpu_capacity_;
  std::vector<double> gpu_free_;
};

}  // namespace troupe::head
