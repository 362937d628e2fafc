// Streams between processes: order, credit-based back-pressure, end of
// stream, items whose credits exceed the write bound, errors when either
// side dies, and streams that share a connection.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <future>
#include <iterator>
#include <mutex>

#include "tests/support/wait.h"
#include "troupe/runtime/client/stream.h"
#include "troupe/runtime/client/stream_server.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;
using troupe::test::kWaitBound;

struct Item {
  int64_t seq = 0;
  troupe::Buffer payload;
  TROUPE_FIELDS(seq, payload)
};

class Producer {
 public:
  // Writes n items of `bytes` each and closes; returns the most items that
  // were ever in flight (sent, not yet credited back by the reader).
  int64_t produce(troupe::StreamRef ref, int n, int bytes) {
    troupe::StreamWriter<Item> w(troupe::this_actor::runtime(), ref);
    for (int i = 0; i < n; ++i) w.write(Item{i, troupe::Buffer::from_string(std::string(bytes, char('a' + i % 26)))});
    w.close();
    return static_cast<int64_t>(w.max_in_flight());
  }
  // Writes until the stream breaks; returns the error text.
  std::string produce_until_error(troupe::StreamRef ref) {
    troupe::StreamWriter<Item> w(troupe::this_actor::runtime(), ref);
    try {
      for (int64_t i = 0;; ++i) w.write(Item{i, troupe::Buffer::from_string("x")}, 10s);
    } catch (const troupe::StreamError& e) {
      return e.what();
    }
  }
  // Writes n items that all view one block of `bytes` (no copies here) and
  // closes; returns the write attempts that timed out. Each write gets
  // `slice_ms` and is tried again after a Timeout, as the data loader's
  // feed does (to notice a stop between slices).
  int64_t produce_views(troupe::StreamRef ref, int n, int64_t bytes, int slice_ms) {
    auto block = std::make_shared<std::vector<std::byte>>(static_cast<size_t>(bytes), std::byte{'v'});
    troupe::Buffer view(block, block->data(), block->size());
    troupe::StreamWriter<Item> w(troupe::this_actor::runtime(), ref);
    int64_t timeouts = 0;
    for (int i = 0; i < n; ++i) {
      for (;;) {
        try {
          w.write(Item{i, view}, std::chrono::milliseconds(slice_ms));
          break;
        } catch (const troupe::Timeout& e) {
          ++timeouts;
          if (std::string(e.what()).find("drain") != std::string::npos) ++drain_timeouts_;
        }
      }
    }
    w.close();
    return timeouts;
  }
  // How many of produce_views' timeouts were waits for the connection to
  // drain (the rest waited for credit).
  int64_t drain_timeouts() { return drain_timeouts_; }
  int pid() { return getpid(); }

 private:
  int64_t drain_timeouts_ = 0;
};
TROUPE_ACTOR(Producer, &Producer::produce, &Producer::produce_until_error, &Producer::produce_views,
             &Producer::drain_timeouts, &Producer::pid)

class Consumer {
 public:
  troupe::StreamRef open(int credits) {
    reader_ = std::make_unique<troupe::StreamReader<Item>>(troupe::this_actor::runtime(), credits);
    return reader_->ref();
  }
  // A second stream to this process, beside the first.
  troupe::StreamRef open_another(int credits) {
    another_ = std::make_unique<troupe::StreamReader<Item>>(troupe::this_actor::runtime(), credits);
    return another_->ref();
  }
  int64_t read_one() { return reader_->read(10s)->seq; }
  int pid() { return getpid(); }

 private:
  std::unique_ptr<troupe::StreamReader<Item>> reader_, another_;
};
TROUPE_ACTOR(Consumer, &Consumer::open, &Consumer::open_another, &Consumer::read_one, &Consumer::pid)

namespace {

using troupe::test::eventually;

class StreamTest : public ::testing::Test {
 protected:
  StreamTest() : rt_(cluster_.connect()) {}
  troupe::testing::LocalCluster cluster_;
  troupe::Runtime rt_;
};

TEST_F(StreamTest, DeliversInOrderAndEnds) {
  troupe::StreamReader<Item> r(rt_, 8);
  auto p = rt_.spawn<Producer>({});
  auto done = p.call(&Producer::produce, r.ref(), 500, 100000);  // 100 kB items: attachments
  for (int i = 0; i < 500; ++i) {
    auto item = r.read(kWaitBound);
    ASSERT_TRUE(item.has_value());
    ASSERT_EQ(item->seq, i);
    ASSERT_EQ(item->payload.size(), 100000u);
    ASSERT_EQ(static_cast<char>(item->payload.data()[99999]), char('a' + i % 26));
  }
  EXPECT_FALSE(r.read(10s).has_value());
  EXPECT_LE(done.get(kWaitBound), 8);
}

TEST_F(StreamTest, SlowReaderBoundsWhatTheWriterHasInFlight) {
  const int credits = 4;
  troupe::StreamReader<Item> r(rt_, credits);
  auto p = rt_.spawn<Producer>({});
  auto done = p.call(&Producer::produce, r.ref(), 200, 1000);
  size_t max_buffered = 0;
  for (int i = 0; i < 200; ++i) {
    // Credit goes back in halves of the window: after every second read the
    // writer may refill it completely. Let it, before reading on.
    if (i % (credits / 2) == 0) {
      ASSERT_TRUE(
          eventually([&] { return r.buffered() >= static_cast<size_t>(std::min(credits, 200 - i)); }, kWaitBound));
    }
    max_buffered = std::max(max_buffered, r.buffered());
    ASSERT_EQ(r.read(kWaitBound)->seq, i);
  }
  EXPECT_FALSE(r.read(10s).has_value());
  int64_t max_in_flight = done.get(kWaitBound);
  std::printf("[measured] credits %d: writer max in flight %lld, reader max buffered %zu\n", credits,
              static_cast<long long>(max_in_flight), max_buffered);
  EXPECT_LE(max_in_flight, credits);
  EXPECT_EQ(max_buffered, static_cast<size_t>(credits));  // the writer did fill the window
}

// Credits bound items, not bytes: four credits of 160 MB items are more than
// a connection's write bound (256 MB of queued bytes, past which a peer
// counts as not reading and is dropped). The writer waits for the socket
// to take its frames instead, and every item arrives: with writes that
// wait as long as they need, and with writes of 1 ms tried again after
// each Timeout, which must leave the credit window whole.
TEST_F(StreamTest, ItemsWhoseCreditsExceedTheWriteBoundStillFlow) {
  const int64_t bytes = 160ll << 20;
  for (int slice_ms : {86'400'000, 1}) {
    troupe::StreamReader<Item> r(rt_, 4);
    auto p = rt_.spawn<Producer>({});
    auto done = p.call(&Producer::produce_views, r.ref(), 8, bytes, slice_ms);
    for (int i = 0; i < 8; ++i) {
      auto item = r.read(kWaitBound);
      ASSERT_TRUE(item.has_value()) << "item " << i << ", writes of " << slice_ms << " ms";
      EXPECT_EQ(item->seq, i);
      ASSERT_EQ(item->payload.size(), static_cast<size_t>(bytes));
      EXPECT_EQ(static_cast<char>(item->payload.data()[bytes - 1]), 'v');
    }
    EXPECT_FALSE(r.read(kWaitBound).has_value());
    int64_t timeouts = done.get(kWaitBound);
    std::printf("[measured] writes of %d ms: %lld timed out and were tried again (%lld waiting to drain)\n", slice_ms,
                static_cast<long long>(timeouts),
                static_cast<long long>(p.call(&Producer::drain_timeouts).get(kWaitBound)));
    if (slice_ms > 1000) {
      EXPECT_EQ(timeouts, 0);
    }
  }
}

// A value larger than the write bound goes out alone, and the end that
// close() sends right after it waits until the socket has taken enough of
// it: sent at once, it tripped the bound and dropped the connection with
// the value half sent (the reader got "stream writer disconnected", not
// the value and the end), as a data loader's close after a last batch of
// over 256 MB did.
TEST_F(StreamTest, AValueLargerThanTheWriteBoundAndTheEndArriveWhole) {
  const int64_t bytes = 300ll << 20;
  troupe::StreamReader<Item> r(rt_, 2);
  auto p = rt_.spawn<Producer>({});
  auto done = p.call(&Producer::produce_views, r.ref(), 1, bytes, 86'400'000);
  auto item = r.read(kWaitBound);
  ASSERT_TRUE(item.has_value());
  ASSERT_EQ(item->payload.size(), static_cast<size_t>(bytes));
  EXPECT_EQ(static_cast<char>(item->payload.data()[bytes - 1]), 'v');
  EXPECT_FALSE(r.read(kWaitBound).has_value());
  EXPECT_EQ(done.get(kWaitBound), 0);
}

// A value over the write bound goes out alone, and the frames sent behind
// it while it is written (another stream's open, an error, a credit) must
// not count it against the bound: a stream opened then tripped it, the
// connection dropped, the large value was cut off (its writer never knew)
// and the new stream's reader was never told.
TEST_F(StreamTest, AStreamOpenedBehindAValueOverTheWriteBoundLosesNothing) {
  const size_t bytes = 300u << 20;
  auto block = std::make_shared<std::vector<std::byte>>(bytes, std::byte{'v'});
  troupe::Buffer view(block, block->data(), block->size());
  troupe::StreamReader<Item> a(rt_, 2), b(rt_, 2);
  auto wrote = std::async(std::launch::async, [this, &a, &b, view] {
    troupe::StreamWriter<Item> big(rt_, a.ref());
    big.write(Item{0, view}, kWaitBound);
    troupe::StreamWriter<Item> small(rt_, b.ref());  // its open goes while the value is being written
    small.write(Item{1, troupe::Buffer::from_string("small")}, kWaitBound);
    small.close();
    big.close();
  });
  auto first = a.read(kWaitBound);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->payload.size(), bytes);
  auto second = b.read(kWaitBound);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->seq, 1);
  EXPECT_FALSE(a.read(kWaitBound).has_value());
  EXPECT_FALSE(b.read(kWaitBound).has_value());
  ASSERT_EQ(wrote.wait_for(kWaitBound), std::future_status::ready);
  wrote.get();
}

// A read that times out throws Timeout and changes nothing: the next read
// gets the next value. A "for ever" timeout (milliseconds::max()) waits:
// it overflowed into a deadline in the past and threw at once.
TEST_F(StreamTest, AReadTimesOutChangingNothingAndForeverWaits) {
  troupe::StreamReader<Item> r(rt_, 4);
  EXPECT_THROW(r.read(200ms), troupe::Timeout);
  troupe::StreamWriter<Item> w(rt_, r.ref());
  EXPECT_THROW(r.read(200ms), troupe::Timeout);  // a writer that sends nothing
  auto wrote = std::async(std::launch::async, [&w] {
    w.write(Item{7, troupe::Buffer::from_string("x")}, std::chrono::milliseconds::max());
    w.close();
  });
  auto item = r.read(std::chrono::milliseconds::max());
  ASSERT_TRUE(item.has_value());
  EXPECT_EQ(item->seq, 7);
  EXPECT_FALSE(r.read(kWaitBound).has_value());
  ASSERT_EQ(wrote.wait_for(kWaitBound), std::future_status::ready);
  wrote.get();
}

namespace {
// How `f` ended: "done", or the kind of error it threw.
template <class F>
std::string outcome(F&& f) {
  try {
    f();
    return "done";
  } catch (const troupe::StreamError&) {
    return "StreamError";
  } catch (const troupe::Timeout&) {
    return "Timeout";
  }
}
}  // namespace

// A reader and a writer blocked on other threads are woken, with a
// StreamError, when their runtime shuts down: calls and tasks were failed
// then, while streams waited out their timeout (a day by default).
TEST_F(StreamTest, ReadersAndWritersWaitingAreWokenByTheirRuntimesShutdown) {
  troupe::StreamReader<Item> elsewhere(rt_, 1);
  troupe::Runtime other = cluster_.connect();
  auto r = std::make_unique<troupe::StreamReader<Item>>(other, 4);
  auto w = std::make_unique<troupe::StreamWriter<Item>>(other, elsewhere.ref());
  w->write(Item{0, troupe::Buffer::from_string("x")}, kWaitBound);  // its one credit
  auto reading = std::async(std::launch::async, [&] { return outcome([&] { r->read(std::chrono::minutes(10)); }); });
  auto writing = std::async(std::launch::async, [&] {
    return outcome([&] { w->write(Item{1, troupe::Buffer::from_string("y")}, std::chrono::minutes(10)); });
  });
  ASSERT_TRUE(troupe::test::eventually([&] { return elsewhere.buffered() == 1; }));
  other.shutdown();
  ASSERT_EQ(reading.wait_for(kWaitBound), std::future_status::ready);
  ASSERT_EQ(writing.wait_for(kWaitBound), std::future_status::ready);
  EXPECT_EQ(reading.get(), "StreamError");
  EXPECT_EQ(writing.get(), "StreamError");
}

namespace {
// Thread `tid` of this process is asleep (waiting, here on a condition).
bool thread_sleeps(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'S';
}

troupe::Buffer zeros(size_t n) {
  std::byte* p = nullptr;
  auto b = troupe::Buffer::allocate(n, &p);
  std::memset(p, 0, n);
  return b;
}
}  // namespace

// Writers that wait for the connection to drain (to a reader that stopped
// taking bytes: SIGSTOPped here), and a writer of another stream waiting
// for the link's turn behind one, are woken at shutdown too: the I/O
// thread that would have drained it is stopped, and they waited out their
// timeout.
TEST_F(StreamTest, WritersWaitingForRoomOrTheirTurnAreWokenByTheirRuntimesShutdown) {
  auto c = rt_.spawn<Consumer>({});
  auto first = c.call(&Consumer::open, 4).get(kWaitBound);
  auto second = c.call(&Consumer::open_another, 4).get(kWaitBound);
  const int pid = c.call(&Consumer::pid).get(kWaitBound);
  troupe::Runtime other = cluster_.connect();
  auto w1 = std::make_unique<troupe::StreamWriter<Item>>(other, first);
  auto w2 = std::make_unique<troupe::StreamWriter<Item>>(other, second);
  // Each has its credits before the reader stops: a stream's first value
  // goes on the one credit every window holds, its second waits for the
  // open's answer, which brings the rest of the window (4).
  for (int seq : {0, 1}) {
    w1->write(Item{seq, troupe::Buffer::from_string("x")}, kWaitBound);
    w2->write(Item{seq, troupe::Buffer::from_string("x")}, kWaitBound);
  }
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  struct Continue {
    int pid;
    ~Continue() { ::kill(pid, SIGCONT); }
  } resume{pid};
  constexpr size_t kBig = 160u << 20;           // two are over the write bound (256 MiB)
  w1->write(Item{2, zeros(kBig)}, kWaitBound);  // queued: the stopped reader takes little of it
  std::atomic<pid_t> room_tid{0}, turn_tid{0};
  auto room = std::async(std::launch::async, [&] {
    room_tid = ::gettid();
    return outcome([&] { w1->write(Item{3, zeros(kBig)}, std::chrono::minutes(10)); });
  });
  ASSERT_TRUE(eventually([&] { return room_tid != 0 && thread_sleeps(room_tid); }));
  auto turn = std::async(std::launch::async, [&] {
    turn_tid = ::gettid();
    return outcome([&] { w2->write(Item{2, zeros(kBig)}, std::chrono::minutes(10)); });
  });
  ASSERT_TRUE(eventually([&] { return turn_tid != 0 && thread_sleeps(turn_tid); }));
  other.shutdown();
  ASSERT_EQ(room.wait_for(kWaitBound), std::future_status::ready);
  ASSERT_EQ(turn.wait_for(kWaitBound), std::future_status::ready);
  EXPECT_EQ(room.get(), "StreamError");
  EXPECT_EQ(turn.get(), "StreamError");
}

TEST_F(StreamTest, WriterKilledGivesReaderAClearError) {
  troupe::StreamReader<Item> r(rt_, 4);
  auto p = rt_.spawn<Producer>({});
  int pid = p.call(&Producer::pid).get(kWaitBound);
  auto f = p.call(&Producer::produce_until_error, r.ref());
  ASSERT_TRUE(r.read(kWaitBound).has_value());
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  try {
    for (;;) r.read(kWaitBound);
  } catch (const troupe::StreamError& e) {
    EXPECT_NE(std::string(e.what()).find("writer disconnected"), std::string::npos) << e.what();
  }
}

TEST_F(StreamTest, ReaderKilledStopsTheWriter) {
  auto c = rt_.spawn<Consumer>({});
  auto p = rt_.spawn<Producer>({});
  auto ref = c.call(&Consumer::open, 4).get(kWaitBound);
  auto f = p.call(&Producer::produce_until_error, ref);
  EXPECT_EQ(c.call(&Consumer::read_one).get(kWaitBound), 0);
  ASSERT_EQ(::kill(c.call(&Consumer::pid).get(kWaitBound), SIGKILL), 0);
  std::string error = f.get(kWaitBound);  // the producer returns: its buffers are freed
  EXPECT_NE(error.find("reader disconnected"), std::string::npos) << error;
}

// One writer per stream, ever: after the first ended or died, another is
// refused at open (an actor call resent to a restarted actor must not feed
// a reader that stopped reading, and then wait for credit forever). The
// open is not waited for: the refused writer's first value may go before
// the refusal comes (and is dropped); its second waits for the window,
// which the refusal answers.
TEST_F(StreamTest, AStreamTakesNoSecondWriterAfterItsFirstEndedOrDied) {
  auto refusal = [&](const troupe::StreamRef& ref) -> std::string {
    troupe::StreamWriter<Item> again(rt_, ref, 10s);
    for (int i = 0; i < 2; ++i) {
      try {
        again.write(Item{100 + i, {}}, kWaitBound);
      } catch (const troupe::StreamError& e) {
        return e.what();
      }
    }
    return "a second writer wrote on";
  };
  // Frames on one connection are handled in order: once a value written
  // after them is read, whatever the refused writer sent was handled.
  auto settled = [&] {
    troupe::StreamReader<Item> probe(rt_, 1);
    troupe::StreamWriter<Item> w(rt_, probe.ref());
    w.write(Item{7, {}});
    return probe.read(kWaitBound)->seq == 7;
  };
  troupe::StreamReader<Item> ended(rt_, 4);
  {
    troupe::StreamWriter<Item> w(rt_, ended.ref());
    w.write(Item{1, {}});
    w.close();
  }
  ASSERT_EQ(ended.read(kWaitBound)->seq, 1);
  EXPECT_FALSE(ended.read(kWaitBound).has_value());
  std::string error = refusal(ended.ref());
  EXPECT_NE(error.find("is over"), std::string::npos) << error;
  ASSERT_TRUE(settled());
  EXPECT_EQ(ended.buffered(), 0u);  // what the refused writer sent was dropped
  EXPECT_FALSE(ended.read(kWaitBound).has_value());

  troupe::StreamReader<Item> failed(rt_, 4);
  auto p = rt_.spawn<Producer>({});
  int pid = p.call(&Producer::pid).get(kWaitBound);
  auto f = p.call(&Producer::produce_until_error, failed.ref());
  ASSERT_TRUE(failed.read(kWaitBound).has_value());
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  EXPECT_THROW(for (;;) failed.read(kWaitBound), troupe::StreamError);
  error = refusal(failed.ref());
  EXPECT_NE(error.find("is over"), std::string::npos) << error;

  // A stream whose reader is gone refuses too.
  troupe::StreamRef gone;
  {
    troupe::StreamReader<Item> r(rt_, 4);
    gone = r.ref();
  }
  error = refusal(gone);
  EXPECT_NE(error.find("no stream with id"), std::string::npos) << error;
}

// peek() says what a read would do without taking anything, and
// on_change() is told each time that may have changed (an item came, the
// stream ended or failed): what Python's troupe.wait sleeps on for a
// generator.
TEST_F(StreamTest, PeekAndOnChangeSayWhenAReadWouldNotWait) {
  using Peek = troupe::client::StreamReaderCore::Peek;
  // Owned by the callback: a call under way when a reader goes may finish
  // after this test's frame is gone.
  struct Changes {
    std::mutex mu;
    std::condition_variable cv;
    int count = 0;
  };
  auto changes = std::make_shared<Changes>();
  auto counted = [changes] {
    std::lock_guard lock(changes->mu);
    ++changes->count;
    changes->cv.notify_all();
  };
  auto seen_now = [&] {
    std::lock_guard lock(changes->mu);
    return changes->count;
  };
  auto changed_past = [&](int seen) {
    std::unique_lock lock(changes->mu);
    return changes->cv.wait_for(lock, kWaitBound, [&] { return changes->count > seen; });
  };

  // The writers are other processes: a writer of this process that ended
  // (and left gracefully) could still be closing when the test ends.
  auto p = rt_.spawn<Producer>({});
  troupe::StreamReader<Item> r(rt_, 4);
  r.on_change(counted);
  EXPECT_EQ(r.peek(), Peek::kWait);
  auto done = p.call(&Producer::produce, r.ref(), 1, 8);  // one item, then the end
  ASSERT_TRUE(changed_past(0));
  // The item stays first until it is read, whether the end came or not.
  EXPECT_EQ(r.peek(), Peek::kItem);
  EXPECT_EQ(r.peek(), Peek::kItem);  // peeking takes nothing
  EXPECT_EQ(r.read(kWaitBound)->seq, 0);
  ASSERT_TRUE(eventually([&] { return r.peek() == Peek::kEnd; }, kWaitBound));
  EXPECT_FALSE(r.read(kWaitBound).has_value());
  done.get(kWaitBound);

  troupe::StreamReader<Item> failed(rt_, 4);
  failed.on_change(counted);
  int pid = p.call(&Producer::pid).get(kWaitBound);
  auto f = p.call(&Producer::produce_until_error, failed.ref());
  ASSERT_TRUE(failed.read(kWaitBound).has_value());
  int seen = seen_now();
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  ASSERT_TRUE(changed_past(seen));
  // What was received before the writer died is read first.
  ASSERT_TRUE(eventually(
      [&] {
        while (failed.peek() == Peek::kItem) failed.read(kWaitBound);
        return failed.peek() == Peek::kFailed;
      },
      kWaitBound));
  EXPECT_THROW(failed.read(kWaitBound), troupe::StreamError);
}

// Streams from one process to another share one connection, one after
// another or at once: opening a stream is a round trip on it, not a TCP
// connect and a handshake.
TEST_F(StreamTest, StreamsFromOneProcessShareOneConnection) {
  auto server = rt_.core()->service<troupe::client::StreamServer>();
  auto p = rt_.spawn<Producer>({});
  const uint64_t before = server->connections_accepted();
  for (int i = 0; i < 20; ++i) {
    troupe::StreamReader<Item> r(rt_, 4);
    auto done = p.call(&Producer::produce, r.ref(), 3, 10);
    for (int k = 0; k < 3; ++k) ASSERT_EQ(r.read(kWaitBound)->seq, k);
    EXPECT_FALSE(r.read(kWaitBound).has_value());
    done.get(kWaitBound);
  }
  EXPECT_EQ(server->connections_accepted() - before, 1u);
}

// Two writers of one process (two threads here, writing to this process's
// own listener over a real connection) send values of 150 MB to two streams
// at once: two such values queued are over the connection's write bound
// (256 MB), past which the peer counts as not reading and is dropped, every
// stream with it. Two writers that both waited for room (woken together
// once the queue drained) would send one each. They take turns, and every
// value arrives.
TEST_F(StreamTest, WritersOfLargeValuesTakeTurnsOnTheirSharedConnection) {
  const size_t bytes = 150u << 20;
  const int n = 4;
  auto block = std::make_shared<std::vector<std::byte>>(bytes, std::byte{'v'});
  troupe::Buffer view(block, block->data(), block->size());
  auto server = rt_.core()->service<troupe::client::StreamServer>();
  const uint64_t before = server->connections_accepted();
  troupe::StreamReader<Item> a(rt_, 4), b(rt_, 4);
  auto write_all = [&](troupe::StreamRef ref) {
    return std::async(std::launch::async, [this, ref, view] {
      troupe::StreamWriter<Item> w(rt_, ref);
      for (int i = 0; i < n; ++i) w.write(Item{i, view}, kWaitBound);
      w.close();
    });
  };
  auto done_a = write_all(a.ref());
  auto done_b = write_all(b.ref());
  for (int i = 0; i < n; ++i) {
    for (auto* r : {&a, &b}) {
      auto item = r->read(kWaitBound);
      ASSERT_TRUE(item.has_value()) << "item " << i;
      EXPECT_EQ(item->seq, i);
      ASSERT_EQ(item->payload.size(), bytes);
    }
  }
  EXPECT_FALSE(a.read(kWaitBound).has_value());
  EXPECT_FALSE(b.read(kWaitBound).has_value());
  for (auto* done : {&done_a, &done_b}) {
    ASSERT_EQ(done->wait_for(kWaitBound), std::future_status::ready);
    done->get();  // rethrows what a writer threw
  }
  EXPECT_EQ(server->connections_accepted() - before, 1u);
}

// A value over the frame limits would make the reader's process close the
// connection, and every stream on it: the writer refuses it, and the
// stream and its connection go on.
TEST_F(StreamTest, AValueOverTheFrameLimitsIsRefusedByItsWriterAlone) {
  auto server = rt_.core()->service<troupe::client::StreamServer>();
  const uint64_t before = server->connections_accepted();
  troupe::StreamReader<std::string> r(rt_, 4), other(rt_, 4);
  troupe::StreamWriter<std::string> w(rt_, r.ref()), wo(rt_, other.ref());
  wo.write("before");
  try {
    w.write(std::string((64u << 20) + 1, 'x'));  // the message part's limit is 64 MiB
    ADD_FAILURE() << "a value over the limits was sent";
  } catch (const troupe::StreamError& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds limit"), std::string::npos) << e.what();
  }
  w.write("small");
  w.close();
  wo.write("after");
  wo.close();
  EXPECT_EQ(*r.read(kWaitBound), "small");
  EXPECT_FALSE(r.read(kWaitBound).has_value());
  EXPECT_EQ(*other.read(kWaitBound), "before");
  EXPECT_EQ(*other.read(kWaitBound), "after");
  EXPECT_FALSE(other.read(kWaitBound).has_value());
  EXPECT_EQ(server->connections_accepted() - before, 1u);
}

// A reader that cancels its stream stops that stream's writer only: the
// other stream on the same connection goes on to its end.
TEST_F(StreamTest, ACancelledStreamLeavesTheOthersOnItsConnection) {
  auto server = rt_.core()->service<troupe::client::StreamServer>();
  const uint64_t before = server->connections_accepted();
  troupe::StreamReader<Item> a(rt_, 4), b(rt_, 4);
  troupe::StreamWriter<Item> wa(rt_, a.ref()), wb(rt_, b.ref());
  wa.write(Item{1, {}});
  wb.write(Item{1, {}});
  ASSERT_EQ(a.read(kWaitBound)->seq, 1);
  a.cancel("enough");
  std::string error;
  ASSERT_TRUE(eventually(
      [&] {
        try {
          wa.write(Item{2, {}}, 1s);  // taken until the cancel arrives
          return false;
        } catch (const troupe::Timeout&) {
          return false;  // out of credit: the reader reads no more
        } catch (const troupe::StreamError& e) {
          error = e.what();
          return true;
        }
      },
      kWaitBound));
  EXPECT_NE(error.find("enough"), std::string::npos) << error;
  EXPECT_THROW(a.read(kWaitBound), troupe::StreamError);
  for (int i = 1; i <= 20; ++i) {
    if (i > 1) wb.write(Item{i, {}});
    ASSERT_EQ(b.read(kWaitBound)->seq, i);
  }
  wb.close();
  EXPECT_FALSE(b.read(kWaitBound).has_value());
  EXPECT_EQ(server->connections_accepted() - before, 1u);
}

// A writer that breaks the protocol on one stream (more items than its
// credit, an unknown frame) fails that stream alone: the connection and the
// other streams on it go on, and frames for streams it does not carry are
// dropped. Frames are sent by hand here, as a faulty writer would.
TEST_F(StreamTest, AWriterBreakingOneStreamFailsThatStreamAlone) {
  namespace client = troupe::client;
  namespace wire = troupe::wire;
  using Op = client::StreamOp;
  troupe::StreamReader<Item> over(rt_, 2), odd(rt_, 2), good(rt_, 2);
  struct Seen {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::pair<Op, uint64_t>> frames;
  };
  auto seen = std::make_shared<Seen>();
  auto has = [&](Op op, uint64_t id) {
    std::unique_lock lock(seen->mu);
    return seen->cv.wait_for(lock, kWaitBound, [&] {
      return std::find(seen->frames.begin(), seen->frames.end(), std::pair{op, id}) != seen->frames.end();
    });
  };
  auto core = rt_.core();
  auto [host, port] = wire::parse_address(good.ref().address);
  auto connected = std::make_shared<troupe::core::FutureState<std::shared_ptr<wire::Connection>>>();
  asio::post(core->io(), [&, host = host, port = port] {
    wire::Connection::connect(
        core->io(), host, port, core->token(), wire::FrameLimits{},
        [seen](wire::Message&& m) {
          std::lock_guard lock(seen->mu);
          seen->frames.emplace_back(static_cast<Op>(m.op), m.id);
          seen->cv.notify_all();
        },
        [](const std::string&) {},
        [connected](std::shared_ptr<wire::Connection> c, std::string error) {
          if (c) return connected->set_value(std::move(c));
          connected->set_error(std::make_exception_ptr(troupe::Error(error)));
        });
  });
  auto conn = troupe::Future<std::shared_ptr<wire::Connection>>(connected).get(kWaitBound);
  auto item = [](uint64_t id, int64_t seq) {
    troupe::wire::Encoder e;
    troupe::wire::encode(e, Item{seq, {}});
    wire::Message m = client::stream_event(Op::kData, id, std::move(e.bytes()));
    m.attachments = std::move(e.attachments());
    return m;
  };
  for (auto* r : {&over, &odd, &good}) {
    conn->send(client::stream_event(Op::kOpen, r->ref().id));
    ASSERT_TRUE(has(Op::kOpened, r->ref().id));
  }
  for (int i = 0; i < 3; ++i) conn->send(item(over.ref().id, i));  // 2 credits
  conn->send(client::stream_event(static_cast<Op>(999), odd.ref().id));
  conn->send(item(987654321, 0));  // no such stream here
  ASSERT_TRUE(has(Op::kCancel, over.ref().id));
  ASSERT_TRUE(has(Op::kCancel, odd.ref().id));
  conn->send(item(good.ref().id, 7));
  conn->send(client::stream_event(Op::kEnd, good.ref().id));
  EXPECT_EQ(good.read(kWaitBound)->seq, 7);
  EXPECT_FALSE(good.read(kWaitBound).has_value());
  // What came within the credit is read, then the stream's error.
  EXPECT_EQ(over.read(kWaitBound)->seq, 0);
  EXPECT_EQ(over.read(kWaitBound)->seq, 1);
  try {
    over.read(kWaitBound);
    ADD_FAILURE() << "an overrun stream went on";
  } catch (const troupe::StreamError& e) {
    EXPECT_NE(std::string(e.what()).find("exceeded its credit"), std::string::npos) << e.what();
  }
  EXPECT_THROW(odd.read(kWaitBound), troupe::StreamError);
  EXPECT_TRUE(conn->is_open());
  conn->close("test over");
}

}  // namespace
