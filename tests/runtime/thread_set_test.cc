// ThreadSet: every thread it starts or adopts is joined by join_all() or
// its destructor, and finished threads do not pile up.
#include "troupe/runtime/core/thread_set.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>

namespace {

TEST(ThreadSetTest, JoinAllWaitsForEverySpawnedThread) {
  std::atomic<int> ran{0};
  troupe::core::ThreadSet set;
  for (int i = 0; i < 50; ++i) set.spawn([&ran] { ran.fetch_add(1); });
  set.join_all();
  EXPECT_EQ(ran.load(), 50);
}

TEST(ThreadSetTest, DestructorJoinsAThreadStillRunning) {
  std::promise<void> release;
  std::atomic<bool> finished{false};
  {
    troupe::core::ThreadSet set;
    set.spawn([&finished, gate = release.get_future().share()] {
      gate.wait();
      finished.store(true);
    });
    release.set_value();
  }
  EXPECT_TRUE(finished.load());
}

TEST(ThreadSetTest, AdoptedThreadIsJoined) {
  std::atomic<bool> finished{false};
  {
    troupe::core::ThreadSet set;
    set.adopt(std::thread([&finished] { finished.store(true); }));
  }
  EXPECT_TRUE(finished.load());
}

TEST(ThreadSetTest, ThreadStartedByAThreadOfTheSetIsJoinedToo) {
  std::atomic<int> ran{0};
  troupe::core::ThreadSet set;
  set.spawn([&] {
    ran.fetch_add(1);
    set.spawn([&ran] { ran.fetch_add(1); });
  });
  set.join_all();
  EXPECT_EQ(ran.load(), 2);
}

}  // namespace
