#include "troupe/runtime/client/actor_watch.h"

#include "troupe/runtime/client/core.h"

namespace troupe {

ActorWatch& ActorWatch::operator=(ActorWatch&& o) noexcept {
  if (this != &o) {
    reset();
    client_ = std::move(o.client_);
    id_ = std::exchange(o.id_, 0);
  }
  return *this;
}

void ActorWatch::reset() {
  if (id_ == 0) return;
  if (auto c = client_.lock()) c->remove_listener(id_);
  client_.reset();
  id_ = 0;
}

}  // namespace troupe
