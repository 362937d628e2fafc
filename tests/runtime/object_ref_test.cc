// Object references between real processes: put/get in the owner and from
// an actor, call_ref results consumed on another node without the driver in
// the path, freeing when the last handle goes, ObjectLost when the owner is
// killed, the store's limit, and refs inside streams and control messages.
#include <gtest/gtest.h>
#include <unistd.h>

#include <numeric>
#include <optional>

#include "tests/support/wait.h"
#include "troupe/runtime/client/stream.h"
#include "troupe/runtime/testing/local_cluster.h"

using namespace std::chrono_literals;
using Bytes = std::vector<uint8_t>;

namespace {

// Bytes 0, 1, 2, ... (mod 251) and their sum, to check a transfer.
Bytes pattern(int64_t n) {
  Bytes b(n);
  for (int64_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i % 251);
  return b;
}
int64_t checksum(const Bytes& b) { return std::accumulate(b.begin(), b.end(), int64_t{0}); }

}  // namespace

// A stream item that carries a ref: the bytes stay with their owner.
struct Shard {
  int64_t seq = 0;
  troupe::ObjectRef<Bytes> data;
  TROUPE_FIELDS(seq, data)
};

// Makes objects in its own process (call_ref results, puts).
class Maker {
 public:
  Bytes make(int64_t n) { return pattern(n); }
  troupe::ObjectRef<std::string> put_text(std::string s) { return troupe::this_actor::runtime().put(std::move(s)); }
  // Puts n shards of 1..n KiB here and streams refs to them.
  void stream_shards(troupe::StreamRef ref, int n) {
    troupe::StreamWriter<Shard> w(troupe::this_actor::runtime(), ref);
    for (int i = 1; i <= n; ++i) w.write(Shard{i, troupe::this_actor::runtime().put(pattern(i << 10))});
    w.close();
  }
  troupe::client::ObjectStoreStats stats() { return troupe::this_actor::runtime().object_store_stats(); }
  int pid() { return getpid(); }
};
TROUPE_ACTOR(Maker, &Maker::make, &Maker::put_text, &Maker::stream_shards, &Maker::stats, &Maker::pid)

// Control messages with refs: one hands the worker a ref to keep, one
// asks it for a ref to a value it puts.
struct StashRef {
  static constexpr const char* kControlTag = "test.stash_ref";
  using Reply = void;
  troupe::ObjectRef<Bytes> ref;
  TROUPE_FIELDS(ref)
};
struct PutText {
  static constexpr const char* kControlTag = "test.put_text";
  using Reply = troupe::ObjectRef<std::string>;
  std::string text;
  TROUPE_FIELDS(text)
};

class Stasher {
 public:
  Stasher() : stash_(std::make_shared<Stash>()) {
    // Handlers run on the I/O thread: keep the ref, fetch it in a call.
    troupe::this_actor::on_control<StashRef>([s = stash_](const StashRef& m) {
      std::lock_guard lock(s->mu);
      s->ref = m.ref;
    });
    troupe::this_actor::on_control<PutText>([](const PutText& m) { return troupe::this_actor::runtime().put(m.text); });
  }
  int64_t stashed_checksum() {
    troupe::ObjectRef<Bytes> r;
    {
      std::lock_guard lock(stash_->mu);
      r = stash_->ref;
    }
    return checksum(r.get(30s));
  }

 private:
  struct Stash {
    std::mutex mu;
    troupe::ObjectRef<Bytes> ref;
  };
  std::shared_ptr<Stash> stash_;
};
TROUPE_ACTOR(Stasher, &Stasher::stashed_checksum)

// Consumes refs made elsewhere.
class User {
 public:
  int64_t consume(troupe::ObjectRef<Bytes> r) { return checksum(r.get(30s)); }
  int64_t sum(troupe::ObjectRef<std::vector<int>> r) {
    auto v = r.get(30s);
    return std::accumulate(v.begin(), v.end(), int64_t{0});
  }
  // Keeps a ref beyond the call, then lets it go.
  void keep(troupe::ObjectRef<Bytes> r) { kept_ = std::move(r); }
  void drop() { kept_ = {}; }
  // Consumes a ref given to it inside a value, and hands the ref back.
  troupe::ObjectRef<Bytes> pass(troupe::ObjectRef<Bytes> r) { return r; }

 private:
  troupe::ObjectRef<Bytes> kept_;
};
TROUPE_ACTOR(User, &User::consume, &User::sum, &User::keep, &User::drop, &User::pass)

// Takes a ref in its constructor.
class RefHolder {
 public:
  explicit RefHolder(troupe::ObjectRef<Bytes> r) : r_(std::move(r)) {}
  int64_t checksum_of_it() { return checksum(r_.get(30s)); }

 private:
  troupe::ObjectRef<Bytes> r_;
};
TROUPE_ACTOR(RefHolder, &RefHolder::checksum_of_it)

namespace {

using troupe::test::eventually;
using troupe::test::kWaitBound;

class ObjectRefTest : public ::testing::Test {
 protected:
  ObjectRefTest()
      : cluster_(troupe::testing::LocalClusterOptions{.nodes = {{{"CPU", 2}, {"a", 4}}, {{"CPU", 2}, {"b", 4}}}}),
        rt_(cluster_.connect()) {}
  troupe::ActorHandle<Maker> maker(std::vector<std::string> env = {}) {
    return rt_.spawn<Maker>({.resources = {{"a", 1}}, .env = std::move(env)});
  }
  troupe::ActorHandle<User> user() { return rt_.spawn<User>({.resources = {{"b", 1}}}); }
  troupe::testing::LocalCluster cluster_;
  troupe::Runtime rt_;
};

TEST_F(ObjectRefTest, PutAndGetInTheOwner) {
  auto before = rt_.object_store_stats();
  {
    auto r = rt_.put(std::vector<int>{1, 2, 3});
    auto copy = r;
    EXPECT_EQ(copy.get(), (std::vector<int>{1, 2, 3}));
    EXPECT_EQ(rt_.object_store_stats().objects, before.objects + 1);
    EXPECT_EQ(rt_.object_store_stats().bytes, before.bytes + 3 * sizeof(int));
  }
  EXPECT_EQ(rt_.object_store_stats().objects, before.objects);
  EXPECT_EQ(rt_.object_store_stats().bytes, before.bytes);
}

TEST_F(ObjectRefTest, ActorGetsWhatTheDriverPut) {
  auto u = user();
  std::vector<int> v(100000);
  std::iota(v.begin(), v.end(), 0);
  auto r = rt_.put(v);
  EXPECT_EQ(u.call(&User::sum, r).get(30s), int64_t{99999} * 100000 / 2);
  // The ref the actor returns is the driver's own object again.
  auto back = u.call(&User::pass, rt_.put(pattern(10))).get(30s);
  EXPECT_EQ(back.get(), pattern(10));
}

TEST_F(ObjectRefTest, ActorPutReachesTheDriver) {
  auto m = maker();
  auto r = m.call(&Maker::put_text, std::string(50000, 'x')).get(30s);
  EXPECT_EQ(r.get(30s), std::string(50000, 'x'));
  r = {};
  EXPECT_TRUE(eventually([&] { return m.call(&Maker::stats).get(30s).objects == 0; }));
}

// The value goes from the maker's node to the user's node directly: the
// driver's connections carry the ref, not the 8 MiB.
TEST_F(ObjectRefTest, CallRefIsConsumedOnAnotherNodeWithoutTheDriver) {
  constexpr int64_t kBytes = 8 << 20;
  auto m = maker();
  auto u = user();
  ASSERT_TRUE(m.wait_ready(30s));
  ASSERT_TRUE(u.wait_ready(30s));
  EXPECT_NE(m.info().node_id, u.info().node_id);
  const auto& traffic = rt_.core()->traffic();
  uint64_t read0 = traffic.read, written0 = traffic.written;

  auto r = m.call_ref(&Maker::make, kBytes).get(30s);
  EXPECT_EQ(u.call(&User::consume, r).get(60s), checksum(pattern(kBytes)));

  uint64_t moved = (traffic.read - read0) + (traffic.written - written0);
  EXPECT_LT(moved, 64u * 1024) << "the driver's connections carried " << moved << " bytes";
  EXPECT_EQ(m.call(&Maker::stats).get(30s).bytes, static_cast<uint64_t>(kBytes));
  r = {};
  EXPECT_TRUE(eventually([&] { return m.call(&Maker::stats).get(30s).objects == 0; }));
}

// A get that times out leaves its fetch running, and the next get takes
// it: each asked the owner for a whole copy more, so a caller retrying in
// short slices read the object many times (or, on a slow link, never got
// it). The Timeout names the object.
TEST_F(ObjectRefTest, AGetAfterATimedOutOneTakesTheSameFetch) {
  constexpr int64_t kBytes = 64 << 20;
  auto m = maker();
  auto r = m.call_ref(&Maker::make, kBytes).get(60s);
  const auto& traffic = rt_.core()->traffic();
  const uint64_t read0 = traffic.read;
  int timed_out = 0;
  std::optional<Bytes> got;
  // Until one comes: a get that returns takes the one copy in flight (a
  // get after it would ask for another, as it should). The first waits
  // not at all, so it times out on any machine (a 1 ms wait did not, once).
  for (int i = 0; i < 10 && !got; ++i) {
    try {
      got = r.get(i == 0 ? 0ms : 1ms);
    } catch (const troupe::Timeout& e) {
      ++timed_out;
      EXPECT_NE(std::string(e.what()).find("object " + std::to_string(r.id())), std::string::npos) << e.what();
    }
  }
  if (!got) got = r.get(60s);
  EXPECT_EQ(checksum(*got), checksum(pattern(kBytes)));
  // (Where a copy arrives within a get's first look, none timed out and
  // the bound below holds trivially: seen in CI's clone, not explained.)
  const uint64_t read = traffic.read - read0;
  EXPECT_LT(read, 2 * static_cast<uint64_t>(kBytes)) << "read " << read << " bytes for " << timed_out + 1 << " gets";
}

TEST_F(ObjectRefTest, FreedWhenTheLastHandleGoes) {
  auto m = maker();
  auto u = user();
  auto base = m.call(&Maker::stats).get(30s);
  auto r = m.call_ref(&Maker::make, int64_t{1} << 20).get(30s);
  u.call(&User::keep, r).get(30s);
  r = {};
  // The user still holds it, so it stays: the driver's pin for the copy it
  // sent held it until the user registered.
  EXPECT_EQ(m.call(&Maker::stats).get(30s).objects, base.objects + 1);
  u.call(&User::drop).get(30s);
  EXPECT_TRUE(eventually([&] {
    auto s = m.call(&Maker::stats).get(30s);
    return s.objects == base.objects && s.bytes == base.bytes;
  }));
}

// A value holding refs is measured for the store by encoding it: the refs
// took a pin each there, which nothing released, so the objects they named
// stayed until their owner exited. Both owned here and borrowed (the
// maker's, pinned at the maker by a message).
TEST_F(ObjectRefTest, AValueHoldingRefsFreesThemWhenItGoes) {
  const auto base = rt_.object_store_stats();
  {
    auto inner = rt_.put(pattern(1 << 20));
    auto outer = rt_.put(std::vector<troupe::ObjectRef<Bytes>>{inner});
    auto shard = rt_.put(Shard{1, inner});
    EXPECT_EQ(rt_.object_store_stats().objects, base.objects + 3);
  }
  EXPECT_TRUE(eventually([&] { return rt_.object_store_stats().objects == base.objects; }))
      << rt_.object_store_stats().objects << " objects left of " << base.objects;
  EXPECT_EQ(rt_.object_store_stats().bytes, base.bytes);

  auto m = maker();
  const auto maker_base = m.call(&Maker::stats).get(30s);
  {
    auto borrowed = m.call_ref(&Maker::make, int64_t{1} << 20).get(30s);
    auto outer = rt_.put(std::vector<troupe::ObjectRef<Bytes>>{borrowed});
    EXPECT_EQ(m.call(&Maker::stats).get(30s).objects, maker_base.objects + 1);
  }
  EXPECT_TRUE(eventually([&] { return m.call(&Maker::stats).get(30s).objects == maker_base.objects; }))
      << "the maker still holds the borrowed object";
}

// A call that is never sent (its actor is dead) gives back the pins its
// refs took, as its receiver would have: they kept the objects until this
// process exited (here, and at the maker for one borrowed from it).
TEST_F(ObjectRefTest, RefsInACallThatIsNeverSentAreLetGo) {
  auto m = maker();
  auto u = user();
  ASSERT_TRUE(u.wait_ready(kWaitBound));
  rt_.kill(u);
  ASSERT_TRUE(eventually([&] { return u.info().state == troupe::ActorState::kDead; }));
  const auto base = rt_.object_store_stats();
  const auto maker_base = m.call(&Maker::stats).get(30s);
  {
    auto owned = rt_.put(pattern(1 << 20));
    auto borrowed = m.call_ref(&Maker::make, int64_t{1} << 20).get(30s);
    EXPECT_THROW(u.call(&User::consume, owned).get(30s), troupe::ActorDied);
    EXPECT_THROW(u.call(&User::consume, borrowed).get(30s), troupe::ActorDied);
  }
  EXPECT_TRUE(eventually([&] { return rt_.object_store_stats().objects == base.objects; }))
      << rt_.object_store_stats().objects << " objects left of " << base.objects;
  EXPECT_TRUE(eventually([&] { return m.call(&Maker::stats).get(30s).objects == maker_base.objects; }))
      << "the maker still holds the object the call to a dead actor carried";
}

// An actor creation refused (its name taken) sent nothing a worker will
// decode: its constructor's refs' pins are given back (the object stayed
// in its owner until the owner exited; a notebook cell re-run with the
// same name kept one more each time).
TEST_F(ObjectRefTest, RefsOfARefusedActorCreationAreLetGo) {
  auto first = rt_.spawn<User>({.name = "only"});
  ASSERT_TRUE(first.wait_ready(kWaitBound));
  const auto base = rt_.object_store_stats();
  {
    auto owned = rt_.put(pattern(1 << 20));
    EXPECT_THROW(rt_.spawn<RefHolder>({.name = "only"}, owned), troupe::ConfigError);
  }
  EXPECT_TRUE(eventually([&] { return rt_.object_store_stats().objects == base.objects; }))
      << rt_.object_store_stats().objects << " objects left of " << base.objects;
  // One that is made keeps its ref as before.
  auto owned = rt_.put(pattern(1 << 20));
  auto holder = rt_.spawn<RefHolder>({}, owned);
  owned = {};
  EXPECT_EQ(holder.call(&RefHolder::checksum_of_it).get(30s), checksum(pattern(1 << 20)));
}

// A stream write that times out (no credit) gives back the pins of the
// refs its value carries: a writer that retries in short slices kept one
// more pin of the object at each try, for good.
TEST_F(ObjectRefTest, RefsInAStreamWriteThatTimesOutAreLetGo) {
  const auto base = rt_.object_store_stats();
  {
    troupe::StreamReader<troupe::ObjectRef<Bytes>> r(rt_, 1);
    troupe::StreamWriter<troupe::ObjectRef<Bytes>> w(rt_, r.ref());
    w.write(rt_.put(pattern(1 << 10)), kWaitBound);  // the window's one value
    {
      auto late = rt_.put(pattern(2 << 10));
      for (int i = 0; i < 5; ++i) EXPECT_THROW(w.write(late, 10ms), troupe::Timeout);
    }
    auto first = r.read(kWaitBound);
    ASSERT_TRUE(first.has_value());
    EXPECT_EQ(first->get(30s), pattern(1 << 10));
    w.close();
    EXPECT_FALSE(r.read(kWaitBound).has_value());
  }
  EXPECT_TRUE(eventually([&] { return rt_.object_store_stats().objects == base.objects; }))
      << rt_.object_store_stats().objects << " objects left of " << base.objects;
}

// A value encoded inside its message (a string, a struct) past the 64 MiB
// a message carries could be put, and read here, but not fetched: the
// borrower's frame limit closed the connection ("bad frame", taken for a
// lost owner, every registration on it dropped). Refused at put, naming it.
TEST_F(ObjectRefTest, AnObjectNoOtherProcessCouldFetchIsRefusedAtPut) {
  try {
    rt_.put(std::string(80 << 20, 'x'));
    FAIL() << "an 80 MiB string was put";
  } catch (const troupe::ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("an object of type std::"), std::string::npos) << what;
    EXPECT_NE(what.find("80.0 MiB in its message part, more than the 64 MiB"), std::string::npos) << what;
  }
  // Numbers travel beside the message: as many bytes are fetched whole.
  auto big = rt_.put(std::vector<int>(20 << 20, 1));
  EXPECT_EQ(user().call(&User::sum, big).get(60s), int64_t{20} << 20);
}

TEST_F(ObjectRefTest, OwnerKilledMeansObjectLost) {
  auto m = maker();
  auto r = m.call_ref(&Maker::make, int64_t{1000}).get(30s);
  int pid = m.call(&Maker::pid).get(30s);
  rt_.kill(m);
  // DEAD once its node agent reaped the process: the owner is gone for sure.
  ASSERT_TRUE(eventually([&] { return rt_.actor_info(m.id()).state == troupe::ActorState::kDead; }, 30s));
  auto t0 = std::chrono::steady_clock::now();
  try {
    r.get(30s);
    FAIL() << "get() of an object whose owner was killed returned";
  } catch (const troupe::ObjectLost& e) {
    EXPECT_NE(std::string(e.what()).find("pid " + std::to_string(pid)), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
  // A consumer gets the same error, typed, through its call.
  auto u = user();
  EXPECT_THROW(u.call(&User::consume, r).get(30s), troupe::ObjectLost);
}

TEST_F(ObjectRefTest, StoreLimitIsEnforced) {
  rt_.core()->service<troupe::client::ObjectStore>()->set_limit(1 << 20);
  auto kept = rt_.put(pattern(600 << 10));
  try {
    rt_.put(pattern(600 << 10));
    FAIL() << "put past the limit succeeded";
  } catch (const troupe::ObjectStoreFull& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(600 << 10)), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(1 << 20)), std::string::npos) << e.what();
  }
  // Past its limit (lowered under what it holds), the store still takes
  // objects of no bytes: an actor's lifetime object is one.
  rt_.core()->service<troupe::client::ObjectStore>()->set_limit(1 << 19);
  EXPECT_THROW(rt_.put(pattern(1)), troupe::ObjectStoreFull);
  EXPECT_EQ(rt_.put(Bytes{}).get(30s), Bytes{});
  rt_.core()->service<troupe::client::ObjectStore>()->set_limit(1 << 20);
  // A worker's limit comes from TROUPE_OBJECT_STORE_BYTES; a call_ref past
  // it fails typed at the caller.
  auto m = maker({"TROUPE_OBJECT_STORE_BYTES=100000"});
  EXPECT_THROW(m.call_ref(&Maker::make, int64_t{200000}).get(30s), troupe::ObjectStoreFull);
  EXPECT_EQ(m.call_ref(&Maker::make, int64_t{1000}).get(30s).get(30s), pattern(1000));
  // A value that arrives after its ref was sent on (a call's result, as
  // the Python shim keeps one) is held to the same limit: the object fails,
  // typed, and the store holds no more than before.
  auto store = rt_.core()->service<troupe::client::ObjectStore>();
  const char* type = troupe::client::make_object_value(Bytes{}).type;
  troupe::ObjectRef<Bytes> late(store->put_pending(type));
  const uint64_t held = store->stats().bytes;
  store->fill(late.id(), troupe::client::make_object_value(pattern(600 << 10)));
  EXPECT_EQ(store->stats().bytes, held);
  try {
    late.get(30s);
    FAIL() << "a pending object past the limit was filled";
  } catch (const troupe::ObjectStoreFull& e) {
    EXPECT_NE(std::string(e.what()).find("a call's result"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(600 << 10)), std::string::npos) << e.what();
  }
  troupe::ObjectRef<Bytes> fits(store->put_pending(type));
  store->fill(fits.id(), troupe::client::make_object_value(pattern(1000)));
  EXPECT_EQ(fits.get(30s), pattern(1000));
}

// A ref written into a stream decodes on the reader's side (registering
// with its owner) and get() fetches from the writer's process; the owner
// frees the objects once the reader lets the refs go.
TEST_F(ObjectRefTest, RefsInsideStreamsDecodeOnTheReader) {
  auto m = maker();
  {
    troupe::StreamReader<Shard> r(rt_, 4);
    auto done = m.call(&Maker::stream_shards, r.ref(), 10);
    std::vector<troupe::ObjectRef<Bytes>> kept;
    for (int i = 1; i <= 10; ++i) {
      auto shard = r.read(kWaitBound);
      ASSERT_TRUE(shard.has_value());
      ASSERT_EQ(shard->seq, i);
      ASSERT_TRUE(shard->data.valid());
      EXPECT_EQ(checksum(shard->data.get(30s)), checksum(pattern(i << 10)));
      kept.push_back(shard->data);
    }
    EXPECT_FALSE(r.read(10s).has_value());
    done.get(kWaitBound);
    EXPECT_EQ(m.call(&Maker::stats).get(30s).objects, 10u);
  }
  EXPECT_TRUE(eventually([&] { return m.call(&Maker::stats).get(30s).objects == 0; }));
}

// Refs inside a control message and inside a control reply decode too.
TEST_F(ObjectRefTest, RefsInsideControlMessagesDecode) {
  auto s = rt_.spawn<Stasher>({.resources = {{"b", 1}}});
  ASSERT_TRUE(s.wait_ready(kWaitBound));
  s.control(StashRef{rt_.put(pattern(100000))}).get(kWaitBound);
  EXPECT_EQ(s.call(&Stasher::stashed_checksum).get(30s), checksum(pattern(100000)));
  auto text = s.control(PutText{"kept in the worker"}).get(kWaitBound);
  EXPECT_EQ(text.get(30s), "kept in the worker");
}

}  // namespace
