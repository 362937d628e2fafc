// ActorWatch: the handle of a listener registered with Runtime::watch_actor.
// The listener lives exactly as long as the watch (reset() or destruction
// removes it), so a process that forms groups or follows actors over a long
// run does not pile up callbacks for actors and groups long gone.
#pragma once

#include <cstdint>
#include <memory>

namespace troupe {

namespace client {
class ActorClient;
}

class [[nodiscard]] ActorWatch {
 public:
  ActorWatch() = default;
  ActorWatch(std::weak_ptr<client::ActorClient> client, uint64_t listener_id)
      : client_(std::move(client)), id_(listener_id) {}
  ~ActorWatch() { reset(); }
  ActorWatch(ActorWatch&& o) noexcept : client_(std::move(o.client_)), id_(o.id_) { o.id_ = 0; }
  ActorWatch& operator=(ActorWatch&& o) noexcept;
  ActorWatch(const ActorWatch&) = delete;
  ActorWatch& operator=(const ActorWatch&) = delete;

  // Removes the listener now; it may still be running on the I/O thread,
  // but is not called again.
  void reset();
  bool active() const { return id_ != 0; }

 private:
  std::weak_ptr<client::ActorClient> client_;
  uint64_t id_ = 0;
};

}  // namespace troupe
