// The object store of one process: a service of its client core that keeps
// the objects this process owns (rt.put, call_ref results), serves them to
// consumers that connect directly (an object server started with the first
// object, authenticated with the cluster token), counts who refers to them,
// and fetches objects owned by other processes for this process's borrowed
// refs. Users see ObjectRef<T> (object_ref.h).
//
// Counting. An owned object lives while any of these holds:
//   - a local handle (an ObjectRef in the owner; RefHolder counts them),
//   - a registration of a borrower (a process that decoded a ref registers
//     over its connection to the owner; the registration goes when its last
//     handle does, or when that connection drops),
//   - a pin: every time a ref is encoded to be sent, the sender pins the
//     object for that copy (the owner in place; a borrower by a Pin frame
//     to the owner, sent before the message that carries the ref), and the
//     receiver's registration names the pin and takes its place.
// So the object outlives the window between a sender dropping its handle
// and the receiver registering, whichever arrives first at the owner. A ref
// encoded but never decoded (its receiver died first) stays pinned until
// the owner exits.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "troupe/runtime/client/core.h"
#include "troupe/runtime/client/object_value.h"
#include "troupe/runtime/wire/connection.h"

namespace troupe::client {

class ObjectStore;

// How long a borrower may leave what it asked for untaken, an owner what
// it was asked, and a stream's writer the credits its reader returns
// (TROUPE_OBJECT_SEND_TIMEOUT_S, 120 s by default; 0: the kernel's
// default), before the connection is dropped (TCP_USER_TIMEOUT): the peer
// stopped taking, or its host vanished. The peers' I/O threads read all
// they are sent, so live ones, however busy, always acknowledge requests.
std::chrono::milliseconds send_timeout();

// What a process's store holds (a typed query for tests and tools).
struct ObjectStoreStats {
  uint64_t objects = 0;
  uint64_t bytes = 0;
  uint64_t limit = 0;
  // File pieces read for borrowers and not yet written to them.
  uint64_t unsent_pieces = 0;
  TROUPE_FIELDS(objects, bytes, limit, unsent_pieces)
};

// One handle's worth of reference, shared by the copies of an ObjectRef:
// a local handle of an owned object, or one registration of a borrowed one.
// Releases it when the last copy goes.
class RefHolder {
 public:
  RefHolder(std::weak_ptr<ObjectStore> store, ObjectRefInfo info, bool owned)
      : store_(std::move(store)), info_(std::move(info)), owned_(owned) {}
  ~RefHolder();
  RefHolder(const RefHolder&) = delete;
  RefHolder& operator=(const RefHolder&) = delete;

  const ObjectRefInfo& info() const { return info_; }
  bool owned() const { return owned_; }
  // The store, or Error when the runtime was shut down.
  std::shared_ptr<ObjectStore> store() const;
  // The borrowed value, fetched from its owner within `timeout`. A get
  // that times out leaves its fetch running for the next get to take:
  // each one asked the owner for another whole copy, queued behind the
  // others, so a caller retrying a large object in short slices never got
  // it. The Timeout names the object and its owner.
  wire::Message fetch(std::chrono::milliseconds timeout);

 private:
  std::weak_ptr<ObjectStore> store_;
  ObjectRefInfo info_;
  bool owned_;
  std::mutex fetch_mu_;
  std::shared_ptr<Future<wire::Message>> fetching_;  // under fetch_mu_
};

class ObjectStore : public std::enable_shared_from_this<ObjectStore> {
 public:
  // Cheap: reads the limit (TROUPE_OBJECT_STORE_BYTES or the default) and
  // starts nothing, so that decoding a ref may create it on any thread.
  explicit ObjectStore(Core& core);
  ~ObjectStore();
  ObjectStore(const ObjectStore&) = delete;
  ObjectStore& operator=(const ObjectStore&) = delete;

  // Keeps `value` and returns the first local handle to it; ObjectStoreFull
  // when it does not fit under the limit.
  std::shared_ptr<RefHolder> put(ObjectValue value);
  // Keeps a value this process holds anyway (the Python shim's answer to
  // a call, sent on inside another value once it had come) whatever the
  // limit: storing it shares its memory rather than adding to it. Its
  // bytes count toward what later puts find held. (Refusing it made
  // `f.remote([done])` raise ObjectStoreFull for a result in hand.)
  std::shared_ptr<RefHolder> put_held(ObjectValue value);
  // An object whose value comes later (a call's result sent on inside
  // another value before it is answered): its first local handle, now.
  // Fetches of it wait, here and at borrowers, until fill() or fail().
  std::shared_ptr<RefHolder> put_pending(const char* type);
  // Gives pending object `id` its value or its error, which fetching it
  // then raises; answers the fetches that waited. A value past the limit
  // is refused as put() refuses it: the object fails with ObjectStoreFull.
  // Ids no longer held are ignored.
  void fill(uint64_t id, ObjectValue value);
  void fail(uint64_t id, std::exception_ptr error);
  // Runs `ready` once owned object `id` is not pending (at once, on this
  // thread, if it is not, or is gone); else on the thread that fills it.
  void when_ready(uint64_t id, std::function<void()> ready);
  // The typed value of an owned object (ObjectLost when it is gone,
  // DecodeError when it holds another type, its error when it failed,
  // Error while it is pending: see when_ready).
  std::shared_ptr<const void> local_value(uint64_t id, const std::string& type) const;
  // Asks the owner for a borrowed object's payload (a RESPONSE message whose
  // body and attachments are the payload); fails with ObjectLost.
  Future<wire::Message> fetch(const ObjectRefInfo& info);

  // Encodes a valid reference held through `holder`, pinned for this copy,
  // as Codec<ObjectRef<T>> does.
  void encode_ref(wire::Encoder& e, const RefHolder& holder);
  // Decodes a reference: a local handle when this process owns it, else a
  // registration with its owner.
  std::shared_ptr<RefHolder> adopt(ObjectRefInfo info);
  // Called by RefHolder when the last copy of a handle goes.
  void release(const ObjectRefInfo& info, bool owned);

  ObjectStoreStats stats() const;
  Core* core() const { return &core_; }
  // Changes the limit (objects already held stay).
  void set_limit(uint64_t bytes);
  // The default limit: a quarter of the machine's memory, or of this
  // process's cgroup limit when lower (2 GiB if unknown).
  static uint64_t default_limit();

 private:
  using ConnPtr = std::shared_ptr<wire::Connection>;
  struct Entry {
    ObjectValue value;
    int64_t local = 0;             // local handles
    int64_t remote = 0;            // borrowers' registrations
    std::set<uint64_t> pins;       // copies in flight
    std::set<uint64_t> pins_used;  // registrations that came before their pin
    // put_pending: no value yet. Borrowers' gets (connection, request id)
    // and local waiters are answered when it is filled or fails.
    bool pending = false;
    std::exception_ptr error;
    std::vector<std::pair<std::weak_ptr<wire::Connection>, uint64_t>> waiting_gets;
    std::vector<std::function<void()>> waiting_local;
  };
  // This process's connection to one owner, made on first use.
  struct Link {
    ConnPtr conn;  // null while connecting
    std::vector<wire::Message> queued;
    struct Get {
      std::shared_ptr<core::FutureState<wire::Message>> reply;
      std::string object;  // describe(info), for ObjectLost
    };
    std::map<uint64_t, Get> gets;  // by request id
  };

  void ensure_server();
  std::string full_text_locked(const std::string& what, uint64_t bytes) const;
  // put() (limited) and put_held().
  std::shared_ptr<RefHolder> keep(ObjectValue value, bool limited);
  void start_listener();
  ObjectRefInfo owner_info(uint64_t id, const std::string& type) const;
  uint64_t new_pin();
  void pin_local(uint64_t id, uint64_t pin);
  void unpin_locked(Entry& e, uint64_t pin);
  // Removes the object when nothing refers to it; returns its value, to be
  // destroyed after mu_ is released (it may hold refs of its own).
  ObjectValue free_if_unused_locked(uint64_t id);
  // Owner side: frames of one borrower's connection.
  void accept(ConnPtr c);
  void on_borrower_frame(const ConnPtr& c, wire::Message&& m);
  void serve_get(const ConnPtr& c, const wire::Message& m);
  // The answer to get request `request` of object `id`: its payload, or
  // the error (held outside the lock).
  static wire::Message get_answer(uint64_t request, const ObjectValue& value, std::exception_ptr error);
  void settle(uint64_t id, ObjectValue value, std::exception_ptr error);
  void on_borrower_closed(wire::Connection* raw);
  // Borrower side: the connection to an owner.
  void send_to_owner(const ObjectRefInfo& info, wire::Message m,
                     std::shared_ptr<core::FutureState<wire::Message>> reply = nullptr);
  void connect_link(const std::string& address);
  void on_link_ready(const std::string& address, ConnPtr c, const std::string& error);
  void on_link_frame(const std::string& address, wire::Message&& m);
  void fail_link(const std::string& address, const std::string& reason);

  Core& core_;
  const uint64_t instance_;
  std::mutex server_mu_;   // held while the object server starts
  mutable std::mutex mu_;  // everything below
  uint64_t limit_;
  uint64_t bytes_ = 0;
  uint64_t next_id_ = 1;
  uint64_t next_pin_ = 1;
  uint64_t next_request_ = 1;
  std::string address_;  // of the object server, once started
  std::unique_ptr<wire::Listener> listener_;
  std::map<uint64_t, Entry> objects_;
  // Registrations per borrower connection: object id -> count.
  std::map<wire::Connection*, std::pair<ConnPtr, std::map<uint64_t, int64_t>>> borrowers_;
  std::map<std::string, Link> links_;  // by owner address
  // File pieces (file_piece_value) are read off the I/O thread, one at a
  // time, with at most a few read and not yet written; started with the
  // first piece served.
  struct PieceReader;
  std::unique_ptr<PieceReader> pieces_;
};

}  // namespace troupe::client
