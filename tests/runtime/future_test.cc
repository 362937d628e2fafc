// wait_all_or_first_failure on futures completed by other threads: no
// processes, no sleeps as synchronisation (threads complete what the test
// tells them to; the waits are bounded by generous timeouts).
#include <gtest/gtest.h>

#include <thread>

#include "troupe/runtime/client/runtime.h"
#include "troupe/runtime/core/exception_text.h"
#include "troupe/runtime/core/future.h"

namespace {

using troupe::Future;
using troupe::core::FutureState;
using troupe::core::FutureStateBase;
using namespace std::chrono_literals;

template <class T>
Future<T> pending() {
  return Future<T>(std::make_shared<FutureState<T>>());
}

using troupe::core::exception_text;

TEST(WaitAllOrFirstFailure, ReturnsNullWhenEverySucceeded) {
  std::vector<Future<int>> fs{pending<int>(), pending<int>(), pending<int>()};
  std::vector<std::thread> ts;
  for (size_t i = 0; i < fs.size(); ++i) ts.emplace_back([f = fs[i], i] { f.state()->set_value(static_cast<int>(i)); });
  EXPECT_EQ(troupe::wait_all_or_first_failure(fs, 60s), nullptr);
  for (auto& t : ts) t.join();
  for (size_t i = 0; i < fs.size(); ++i) EXPECT_EQ(fs[i].get(), static_cast<int>(i));
}

TEST(WaitAllOrFirstFailure, NoFuturesIsSuccess) {
  EXPECT_EQ(troupe::wait_all_or_first_failure(std::vector<Future<int>>{}, 1ms), nullptr);
}

TEST(WaitAllOrFirstFailure, ReturnsAsSoonAsOneFailedWhileOthersNeverAnswer) {
  // The second future never completes: only a fail-fast wait returns the
  // error (a plain wait_all would hit the 60 s timeout instead).
  auto ok = pending<int>();
  auto stuck = pending<int>();
  auto bad = pending<void>();
  std::thread t([&] {
    ok.state()->set_value(1);
    bad.state()->set_error(std::make_exception_ptr(troupe::ActorDied("rank 2 died")));
  });
  std::vector<std::shared_ptr<FutureStateBase>> states{ok.state(), stuck.state(), bad.state()};
  auto e = troupe::wait_all_or_first_failure(states, 60s);
  t.join();
  ASSERT_NE(e, nullptr);
  EXPECT_THROW(std::rethrow_exception(e), troupe::ActorDied);
  EXPECT_EQ(exception_text(e), "rank 2 died");
}

TEST(WaitAllOrFirstFailure, FirstFailureInOrderGivenWhenSeveralFailed) {
  auto a = pending<int>();
  auto b = pending<int>();
  a.state()->set_value(1);
  b.state()->set_error(std::make_exception_ptr(troupe::Error("b failed")));
  auto c = pending<int>();
  c.state()->set_error(std::make_exception_ptr(troupe::Error("c failed")));
  EXPECT_EQ(exception_text(troupe::wait_all_or_first_failure(std::vector<Future<int>>{a, b, c}, 60s)), "b failed");
}

TEST(WaitAllOrFirstFailure, TimeoutWhenNothingAnswers) {
  std::vector<Future<int>> fs{pending<int>(), pending<int>()};
  fs[0].state()->set_value(1);
  auto e = troupe::wait_all_or_first_failure(fs, 20ms);
  ASSERT_NE(e, nullptr);
  EXPECT_THROW(std::rethrow_exception(e), troupe::Timeout);
  EXPECT_EQ(exception_text(e), "no answer within 20 ms");
}

}  // namespace

// A traceback's last non-empty line is what a one-line report keeps.
TEST(ExceptionText, LastLineIsTheLastNonEmptyOne) {
  using troupe::core::last_line;
  EXPECT_EQ(last_line("The following operation failed.\n  File \"s.py\", line 7\nRuntimeError: KeyError: x\n  \n"),
            "RuntimeError: KeyError: x");
  EXPECT_EQ(last_line("one line"), "one line");
  EXPECT_EQ(last_line("first\nsecond"), "second");
  EXPECT_EQ(last_line(""), "");
  EXPECT_EQ(last_line("\n\n"), "\n\n");
}

// A handle's class, for the empty handle below.
class Idle {
 public:
  int value() const { return 1; }
};
TROUPE_ACTOR(Idle, &Idle::value)

// A Future or ActorHandle made by default (or moved from) stands for
// nothing: using it throws troupe::Error naming what it is. Each of these
// dereferenced a null pointer (a probe's driver died of SIGSEGV).
TEST(FutureTest, AnEmptyFutureOrActorHandleThrowsInsteadOfCrashing) {
  troupe::Future<int> f;
  EXPECT_FALSE(f.valid());
  EXPECT_THROW(f.get(), troupe::Error);
  EXPECT_THROW(f.get(std::chrono::milliseconds(1)), troupe::Error);
  EXPECT_THROW(f.wait_for(std::chrono::milliseconds(1)), troupe::Error);
  EXPECT_THROW(f.on_ready([] {}), troupe::Error);
  EXPECT_THROW(troupe::wait_all(f), troupe::Error);
  try {
    f.get();
  } catch (const troupe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("an empty troupe::Future"), std::string::npos) << e.what();
  }
  troupe::ActorHandle<Idle> h;
  EXPECT_FALSE(h.valid());
  EXPECT_THROW(h.id(), troupe::Error);
  EXPECT_THROW(h.info(), troupe::Error);
  EXPECT_THROW(h.wait_ready(std::chrono::milliseconds(1)), troupe::Error);
  EXPECT_THROW(h.call(&Idle::value), troupe::Error);
  troupe::ActorHandle<Idle> moved = std::move(h);
  EXPECT_THROW(moved.call(&Idle::value), troupe::Error);
}
