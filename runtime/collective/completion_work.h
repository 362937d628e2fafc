// A Work completed from outside by whoever finishes first: the backend's
// operation thread (success or its error) or abort() (troupe::Aborted). The
// first completion wins, later ones are ignored, which is what lets abort()
// fail an operation that is still blocked inside the transport.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>

#include "troupe/runtime/collective/group.h"

namespace troupe::collective {

class CompletionWork final : public Work {
 public:
  // `description` names the operation in timeout messages, e.g.
  // "allreduce of group 'g' gen 2 rank 1".
  explicit CompletionWork(std::string description) : description_(std::move(description)) {}

  void wait(std::chrono::milliseconds timeout = kDefaultWaitTimeout) override;
  bool is_completed() override;

  // Returns false when the work was already completed.
  bool complete();
  bool fail(std::exception_ptr error);

  const std::string& description() const { return description_; }

 private:
  bool finish(std::exception_ptr error);

  const std::string description_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace troupe::collective
