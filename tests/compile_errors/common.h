// What the snippets in this folder share: an actor, a task, a type with no
// Codec. Each snippet misuses the API once; check.sh builds it and expects
// troupe's static_assert to be the first error, with few errors in all.
#pragma once

#include <string>
#include <vector>

#include "troupe/runtime/client/runtime.h"

class Adder {
 public:
  explicit Adder(int start) : value_(start) {}
  int add(int x) { return value_ += x; }
  int sum(std::vector<int> xs) {
    for (int x : xs) value_ += x;
    return value_;
  }
  std::string unlisted(double, double) { return "never listed"; }

 private:
  int value_;
};
TROUPE_ACTOR(Adder, &Adder::add, &Adder::sum)

inline int twice(int x) { return 2 * x; }
TROUPE_TASK(twice)

struct NoCodec {
  int x = 0;
};
class NotAnActor {};
