#include "troupe/runtime/collective/completion_work.h"

#include "troupe/runtime/core/errors.h"

namespace troupe::collective {

void CompletionWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
    throw Timeout("wait for " + description_ + " timed out after " + std::to_string(timeout.count()) + " ms");
  }
  if (error_) std::rethrow_exception(error_);
}

bool CompletionWork::is_completed() {
  std::lock_guard lock(mu_);
  return done_;
}

bool CompletionWork::complete() { return finish(nullptr); }

bool CompletionWork::fail(std::exception_ptr error) { return finish(std::move(error)); }

bool CompletionWork::finish(std::exception_ptr error) {
  {
    std::lock_guard lock(mu_);
    if (done_) return false;
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
  return true;
}

}  // namespace troupe::collective
