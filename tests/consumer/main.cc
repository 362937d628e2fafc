// A driver written outside the troupe tree, as a user writes one: an
// actor, tasks, an object reference handed from one task to another and
// to the actor, and an actor method that throws. Exits 0 and prints
// "consumer: ok" when every answer is right. Its Runtime is a global,
// default-constructed and never shut down, as a test suite's shared
// fixture holds one: it stops its embedded cluster while the program's
// statics are destroyed (check.sh runs it at TROUPE_LOG_LEVEL=info, so
// that the stopping cluster logs then).
#include <troupe/troupe.h>

#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <vector>

std::vector<int> range_to(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 1);
  return v;
}
TROUPE_TASK(range_to)

int total_of(troupe::ObjectRef<std::vector<int>> ref) {
  auto v = ref.get();
  return std::accumulate(v.begin(), v.end(), 0);
}
TROUPE_TASK(total_of)

class Tally {
 public:
  explicit Tally(int start) : sum_(start) {}
  int add_all(troupe::ObjectRef<std::vector<int>> ref) {
    for (int x : ref.get()) sum_ += x;
    return sum_;
  }
  int checked(int x) {
    if (x < 0) throw std::invalid_argument("negative: " + std::to_string(x));
    return x;
  }

 private:
  int sum_;
};
TROUPE_ACTOR(Tally, &Tally::add_all, &Tally::checked)

troupe::Runtime g_rt;

int main(int argc, char** argv) {
  g_rt = troupe::init(argc, argv);
  troupe::Runtime& rt = g_rt;
  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      std::fprintf(stderr, "consumer: wrong: %s\n", what);
      ++failures;
    }
  };
  auto ref = rt.submit_ref(&range_to, {}, 10).get();
  auto by_task = rt.submit(&total_of, {}, ref);
  auto tally = rt.spawn<Tally>({.resources = {{"CPU", 1}}}, 100);
  auto by_actor = tally.call(&Tally::add_all, ref);
  troupe::wait_all(by_task, by_actor);
  expect(by_task.get() == 55, "a task's total of another task's ref");
  expect(by_actor.get() == 155, "the actor's total of the same ref");
  try {
    tally.call(&Tally::checked, -1).get();
    expect(false, "a method that throws");
  } catch (const troupe::RemoteError& e) {
    expect(std::string(e.what()).find("negative: -1") != std::string::npos, "the thrown message");
  }
  expect(tally.call(&Tally::checked, 7).get() == 7, "the actor after a throw");
  if (failures == 0) std::printf("consumer: ok\n");
  return failures == 0 ? 0 : 1;
}
