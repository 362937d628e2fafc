// Failure behaviour of GlooGroup with ranks in real processes: SIGKILL one
// rank during large allreduces. With abort (what the runtime does when it
// learns of the death) survivors fail within 2 s naming the dead rank, then
// re-form generation 2 and all-reduce again; without abort they still fail
// within the operation timeout instead of hanging.
#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <thread>
#include <vector>

#include "tests/support/rank_processes.h"
#include "tests/support/temp_dir.h"
#include "tests/support/wait.h"
#include "troupe/runtime/collective/file_kv_store.h"
#include "troupe/runtime/collective/gloo_group.h"
#include "troupe/runtime/core/check.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/thread_set.h"

namespace troupe::collective {
namespace {

using namespace std::chrono_literals;
using test::monotonic_ms;
using troupe::test::kWaitBound;

constexpr int kWorld = 3;
constexpr int kVictim = 1;
constexpr size_t kLarge = 4'000'000;  // 16 MB of float32 per allreduce

// Runs allreduces until one fails; marks the rank as looping after the first
// success so the parent kills the victim mid-allreduce. Returns the failure.
std::exception_ptr allreduce_until_failure(Group& g, KvStore& kv) {
  std::vector<float> buf(kLarge);
  for (int iter = 0; iter < 100000; ++iter) {
    std::fill(buf.begin(), buf.end(), 1.0f);
    auto work = g.allreduce(buf.data(), buf.size(), DType::kFloat32);
    try {
      work->wait(60s);
    } catch (...) {
      return std::current_exception();
    }
    TROUPE_CHECK(buf[0] == static_cast<float>(g.world_size())) << "allreduce result " << buf[0];
    if (iter == 0) kv.put("control/looping/" + std::to_string(g.rank()), "1");
  }
  throw Error("allreduce never failed although a rank was killed");
}

void report(int rank, int64_t ms, const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] failed %lld ms after the kill: %s\n", rank, static_cast<long long>(ms), e.what());
  }
}

// Parent side: wait until every rank loops, kill the victim, publish when.
void kill_victim_when_looping(test::RankProcesses& ranks, KvStore& kv) {
  for (int r = 0; r < kWorld; ++r) kv.wait("control/looping/" + std::to_string(r), kWaitBound);
  kv.put("control/killed_at", std::to_string(monotonic_ms()));
  ranks.kill(kVictim, SIGKILL);
}

void expect_survivors_passed(const std::vector<test::RankExit>& exits) {
  for (const auto& e : exits) {
    if (e.rank == kVictim) {
      EXPECT_EQ(e.signal, SIGKILL) << test::describe(e);
    } else {
      EXPECT_TRUE(e.exited && e.code == 0) << test::describe(e);
    }
  }
}

TEST(GlooFaultTest, KilledRankAbortsSurvivorsWhichReformGenerationTwo) {
  const std::string dir = test::make_temp_dir("fault-abort");
  test::RankProcesses ranks(kWorld, [&](int rank) {
    FileKvStore kv(dir);
    // Owns an operation thread the aborted group leaves behind (as the
    // runtime's group table does), so destroying the group stays fast.
    auto stragglers = std::make_shared<core::ThreadSet>();
    GlooGroupOptions opts;
    opts.rendezvous_timeout = 30s;
    opts.op_timeout = 60s;  // long: only abort can make the failure fast
    opts.stragglers = stragglers;
    auto group = GlooGroup::create(kv, "fault", 1, rank, kWorld, opts);

    // Stands in for the runtime's control message: when the parent reports
    // a death, abort the group with the reason.
    std::atomic<bool> stop{false};
    std::thread watcher([&] {
      while (!stop) {
        try {
          std::string dead = kv.wait("control/dead", 50ms);
          group->abort("rank " + dead + " (actor 7) died");
          return;
        } catch (const Timeout&) {
        }
      }
    });
    std::exception_ptr failure = allreduce_until_failure(*group, kv);
    const int64_t failed_at = monotonic_ms();
    stop = true;
    watcher.join();

    try {
      std::rethrow_exception(failure);
    } catch (const Aborted& e) {
      std::string msg = e.what();
      TROUPE_CHECK(msg.find("rank 1") != std::string::npos) << "error does not name the dead rank: " << msg;
      TROUPE_CHECK(msg.find("'fault'") != std::string::npos) << "error does not name the group: " << msg;
    }
    const int64_t killed_at = std::stoll(kv.wait("control/killed_at", kWaitBound));
    report(rank, failed_at - killed_at, failure);
    TROUPE_CHECK(failed_at - killed_at < 2000) << "survivor failed " << (failed_at - killed_at) << " ms after the kill";

    // Later operations fail at once, with the same reason.
    float x = 1;
    try {
      group->allreduce(&x, 1, DType::kFloat32)->wait(1s);
      throw Error("allreduce on an aborted group succeeded");
    } catch (const Aborted& e) {
      TROUPE_CHECK(std::string(e.what()).find("rank 1") != std::string::npos) << e.what();
    }

    const int64_t destroy_start = monotonic_ms();
    group.reset();
    TROUPE_CHECK(monotonic_ms() - destroy_start < 3000) << "destroying the aborted group took too long";

    // Generation 2 with the survivors only.
    const int new_rank = rank < kVictim ? rank : rank - 1;
    auto g2 = GlooGroup::create(kv, "fault", 2, new_rank, kWorld - 1, opts);
    std::vector<float> buf(kLarge, static_cast<float>(new_rank + 1));
    g2->allreduce(buf.data(), buf.size(), DType::kFloat32)->wait(60s);
    for (size_t i = 0; i < buf.size(); i += 4099) TROUPE_CHECK(buf[i] == 3.0f) << "gen 2 result " << buf[i];
  });
  FileKvStore kv(dir);
  kill_victim_when_looping(ranks, kv);
  kv.put("control/dead", std::to_string(kVictim));
  auto exits = ranks.wait_all(120s);
  test::remove_dir(dir);
  expect_survivors_passed(exits);
}

TEST(GlooFaultTest, WithoutAbortSurvivorsFailWithinOpTimeout) {
  constexpr auto kOpTimeout = 3s;
  const std::string dir = test::make_temp_dir("fault-noabort");
  test::RankProcesses ranks(kWorld, [&](int rank) {
    FileKvStore kv(dir);
    GlooGroupOptions opts;
    opts.rendezvous_timeout = 30s;
    opts.op_timeout = kOpTimeout;
    auto group = GlooGroup::create(kv, "noabort", 1, rank, kWorld, opts);
    std::exception_ptr failure = allreduce_until_failure(*group, kv);
    const int64_t failed_at = monotonic_ms();
    try {
      std::rethrow_exception(failure);
    } catch (const Aborted& e) {
      throw Error(std::string("unexpected Aborted without abort(): ") + e.what());
    } catch (const Error&) {
      // troupe::Error (peer closed) or troupe::Timeout: both are fine.
    }
    const int64_t killed_at = std::stoll(kv.wait("control/killed_at", kWaitBound));
    report(rank, failed_at - killed_at, failure);
    const int64_t limit = std::chrono::milliseconds(kOpTimeout).count() + 2000;
    TROUPE_CHECK(failed_at - killed_at < limit)
        << "survivor failed " << (failed_at - killed_at) << " ms after the kill";
    const int64_t destroy_start = monotonic_ms();
    group.reset();
    TROUPE_CHECK(monotonic_ms() - destroy_start < 3000) << "destroying the failed group took too long";
  });
  FileKvStore kv(dir);
  kill_victim_when_looping(ranks, kv);
  auto exits = ranks.wait_all(120s);
  test::remove_dir(dir);
  expect_survivors_passed(exits);
}

}  // namespace
}  // namespace troupe::collective
