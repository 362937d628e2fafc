#include "troupe/runtime/client/object_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <thread>

#include "troupe/runtime/client/listen_host.h"
#include "troupe/runtime/core/errors.h"
#include "troupe/runtime/core/logging.h"
#include "troupe/runtime/core/process.h"
#include "troupe/runtime/core/random_id.h"
#include "troupe/runtime/core/worker_env.h"
#include "troupe/runtime/wire/error_kind.h"
#include "troupe/runtime/wire/frame.h"

namespace troupe::client {

using namespace troupe::wire;

namespace {

// The frames between a borrower and an owner's object server (Message::op).
enum class ObjectOp : uint32_t { kGet = 200, kAddRef = 201, kRemoveRef = 202, kPin = 203 };

// The body of every object frame: which object, at which owner, which pin.
struct ObjectFrame {
  uint64_t id = 0;
  uint64_t instance = 0;
  uint64_t pin = 0;
  TROUPE_FIELDS(id, instance, pin)
};

Message object_message(Kind kind, ObjectOp op, const ObjectRefInfo& info, uint64_t pin = 0) {
  Message m;
  m.kind = kind;
  m.op = static_cast<uint32_t>(op);
  m.body = encode_inline(ObjectFrame{info.id, info.owner_instance, pin});
  return m;
}

// The limit from TROUPE_OBJECT_STORE_BYTES, else the default.
uint64_t configured_limit() {
  std::string text = core::env_value(core::kEnvObjectStoreBytes);
  if (text.empty()) return ObjectStore::default_limit();
  uint64_t v = core::WorkerEnv::from_env().object_store_bytes;
  return v == 0 ? ObjectStore::default_limit() : v;
}

}  // namespace

namespace {

struct FilePiece {
  std::string path;  // read by this name, or only named when `file` is set
  uint64_t offset = 0;
  uint64_t size = 0;
  std::shared_ptr<const OpenFile> file;
};

// The pieces a PieceReader has read whose bytes are not written yet (their
// buffers give their slot back when they go), its queue and its stop. A
// borrower holds at most kPerBorrower slots: one that stops reading (a
// stopped process, a partitioned host) keeps what it holds until its
// connection's send timeout ends it, and the others are served meanwhile
// (one that had asked for four pieces held every slot: review r30).
struct PieceSlots {
  static constexpr int kMax = 4;  // 128 MiB of 32 MiB pieces
  static constexpr int kPerBorrower = 1;
  struct Job {
    const void* borrower;  // its connection: only counted, never used
    std::function<void()> run;
  };
  std::mutex mu;
  std::condition_variable cv;
  int used = 0;
  std::map<const void*, int> used_by;
  bool stopping = false;
  std::deque<Job> jobs;

  // The first job queued that may take a slot now (jobs.end(): none).
  std::deque<Job>::iterator runnable() {
    if (used >= kMax) return jobs.end();
    return std::find_if(jobs.begin(), jobs.end(), [&](const Job& j) {
      auto it = used_by.find(j.borrower);
      return it == used_by.end() || it->second < kPerBorrower;
    });
  }
};

void give_back(PieceSlots& slots, const void* borrower) {
  {
    std::lock_guard lock(slots.mu);
    --slots.used;
    if (auto it = slots.used_by.find(borrower); it != slots.used_by.end() && --it->second <= 0) slots.used_by.erase(it);
  }
  slots.cv.notify_all();
}

// Reads `p` into a buffer of its own (with `slots`: one slot of theirs,
// taken by the caller for `borrower`, given back when the buffer goes).
Buffer read_piece(const FilePiece& p, const std::shared_ptr<PieceSlots>& slots = nullptr,
                  const void* borrower = nullptr) {
  const std::string what =
      p.path + " (bytes " + std::to_string(p.offset) + " to " + std::to_string(p.offset + p.size) + ")";
  std::shared_ptr<std::byte[]> memory;
  try {
    memory = slots ? std::shared_ptr<std::byte[]>(new std::byte[p.size ? p.size : 1],
                                                  [slots, borrower](std::byte* q) {
                                                    delete[] q;
                                                    give_back(*slots, borrower);
                                                  })
                   : std::shared_ptr<std::byte[]>(new std::byte[p.size ? p.size : 1]);
  } catch (...) {
    if (slots) give_back(*slots, borrower);
    throw;
  }
  std::byte* data = memory.get();
  Buffer b(std::shared_ptr<const void>(memory, memory.get()), data, size_t(p.size));
  const int fd = p.file ? p.file->fd : ::open(p.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot read " + what + ": " + std::strerror(errno));
  const bool own = !p.file;
  std::unique_ptr<const int, std::function<void(const int*)>> closer(&fd, [own](const int* f) {
    if (own) ::close(*f);
  });
  uint64_t n = 0;
  for (ssize_t r; n < p.size && (r = ::pread(fd, data + n, size_t(p.size - n), off_t(p.offset + n))) != 0;) {
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw Error("cannot read " + what + ": " + std::strerror(errno));
    n += uint64_t(r);
  }
  if (n != p.size) throw Error("cannot read " + what + ": the file is shorter than when it was shipped");
  return b;
}

void encode_piece(const std::shared_ptr<const void>& v, wire::Encoder& e) {
  ObjectPayload<Buffer>::encode(std::make_shared<const Buffer>(read_piece(*static_cast<const FilePiece*>(v.get()))), e);
}

}  // namespace

// One thread that reads the pieces asked for and sends the answers, taking
// a slot for each: a driver that serves many hosts at once holds at most
// PieceSlots::kMax pieces read and not yet written, and its I/O thread
// never waits on the disk.
struct ObjectStore::PieceReader {
  std::shared_ptr<PieceSlots> slots = std::make_shared<PieceSlots>();
  std::thread thread{[this] { run(); }};

  ~PieceReader() {
    {
      std::lock_guard lock(slots->mu);
      slots->stopping = true;
    }
    slots->cv.notify_all();
    thread.join();
    // The jobs not run hold their connections, whose queued frames may
    // hold buffers that hold `slots`: dropped here, not left in a cycle.
    std::deque<PieceSlots::Job> dropped;
    {
      std::lock_guard lock(slots->mu);
      dropped.swap(slots->jobs);
    }
  }

  void serve(ConnPtr c, uint64_t request, ObjectValue piece) {
    {
      std::lock_guard lock(slots->mu);
      const void* borrower = c.get();
      slots->jobs.push_back({borrower, [this, c = std::move(c), request, piece = std::move(piece), borrower] {
                               std::exception_ptr error;
                               ObjectValue read;
                               try {
                                 read = make_object_value<Buffer>(
                                     read_piece(*static_cast<const FilePiece*>(piece.value.get()), slots, borrower));
                               } catch (...) {
                                 error = std::current_exception();
                               }
                               try {
                                 c->send(get_answer(request, read, error));
                               } catch (const std::exception&) {
                                 // The borrower is gone: nobody to answer.
                               }
                             }});
    }
    slots->cv.notify_all();
  }

  void run() {
    for (;;) {
      PieceSlots::Job job;
      {
        std::unique_lock lock(slots->mu);
        slots->cv.wait(lock, [&] { return slots->stopping || slots->runnable() != slots->jobs.end(); });
        if (slots->stopping) return;
        auto it = slots->runnable();
        job = std::move(*it);
        slots->jobs.erase(it);
        ++slots->used;  // given back by the piece's buffer
        ++slots->used_by[job.borrower];
      }
      job.run();
    }
  }

  int unsent() const {
    std::lock_guard lock(slots->mu);
    return slots->used;
  }
};

OpenFile::~OpenFile() {
  if (fd >= 0) ::close(fd);
}

ObjectValue file_piece_value(const std::string& path, uint64_t offset, uint64_t size) {
  return file_piece_value(nullptr, path, offset, size);
}

ObjectValue file_piece_value(std::shared_ptr<const OpenFile> file, const std::string& name, uint64_t offset,
                             uint64_t size) {
  ObjectValue o;
  o.value = std::make_shared<const FilePiece>(FilePiece{name, offset, size, std::move(file)});
  o.encode = &encode_piece;
  o.bytes = 0;  // nothing held
  o.type = typeid(Buffer).name();
  return o;
}

std::shared_ptr<const void> value_of(const ObjectValue& v) {
  if (v.encode != &encode_piece) return v.value;
  return std::make_shared<const Buffer>(read_piece(*static_cast<const FilePiece*>(v.value.get())));
}

std::string describe(const ObjectRefInfo& info) {
  std::string who = info.owner_actor ? "actor " + std::to_string(info.owner_actor) : std::string("driver");
  return "object " + std::to_string(info.id) + " of " + info.owner_address + " (pid " + std::to_string(info.owner_pid) +
         ", " + who + ")";
}

RefHolder::~RefHolder() {
  if (auto s = store_.lock()) s->release(info_, owned_);
}

std::shared_ptr<ObjectStore> RefHolder::store() const {
  auto s = store_.lock();
  if (!s) throw Error("the runtime that held " + describe(info_) + " is shut down");
  return s;
}

wire::Message RefHolder::fetch(std::chrono::milliseconds timeout) {
  std::shared_ptr<Future<Message>> f;
  {
    std::lock_guard lock(fetch_mu_);
    if (!fetching_) fetching_ = std::make_shared<Future<Message>>(store()->fetch(info_));
    f = fetching_;
  }
  if (!f->wait_for(timeout))
    throw Timeout(describe(info_) + " did not come from its owner within " + std::to_string(timeout.count()) +
                  " ms (still being fetched: a get after this one waits for the same copy)");
  {
    std::lock_guard lock(fetch_mu_);
    if (fetching_ == f) fetching_.reset();  // the next get asks again
  }
  return f->get();
}

ObjectStore::ObjectStore(Core& core) : core_(core), instance_(core::random_id()), limit_(configured_limit()) {}

// Destroyed by the core's shutdown, after its I/O thread stopped: the
// connections' handlers will never run again.
ObjectStore::~ObjectStore() = default;  // joins the piece reader; answers it has not sent go

std::chrono::milliseconds send_timeout() {
  const std::string v = core::env_value(core::kEnvObjectSendTimeout);
  char* end = nullptr;
  const double s = v.empty() ? -1 : std::strtod(v.c_str(), &end);
  if (s >= 0 && end && *end == '\0' && s < 1e6) return std::chrono::milliseconds(int64_t(s * 1000));
  if (!v.empty()) TROUPE_LOG_WARN("TROUPE_OBJECT_SEND_TIMEOUT_S={} is not a number of seconds; using 120", v);
  return std::chrono::seconds(120);
}

uint64_t ObjectStore::default_limit() {
  const uint64_t bytes = core::memory_limit_bytes();
  return bytes ? bytes / 4 : 2ull << 30;
}

void ObjectStore::set_limit(uint64_t bytes) {
  std::lock_guard lock(mu_);
  limit_ = bytes;
}

ObjectStoreStats ObjectStore::stats() const {
  std::lock_guard lock(mu_);
  return ObjectStoreStats{objects_.size(), bytes_, limit_, pieces_ ? uint64_t(pieces_->unsent()) : 0};
}

// ---- owner side -------------------------------------------------------------

namespace {
// Why no other process could fetch an object whose payload has
// `inline_bytes` in its message part and `attachments` buffers beside it.
std::string unfetchable_text(const char* type, uint64_t inline_bytes, uint64_t attachments) {
  const std::string what = "an object of type " + wire::readable_type_name(type);
  const wire::FrameLimits limits;
  if (attachments > limits.max_attachments)
    return what + " has " + std::to_string(attachments) + " buffers, more than the " +
           std::to_string(limits.max_attachments) + " one message carries to another process";
  char size[32];
  std::snprintf(size, sizeof size, "%.1f MiB", static_cast<double>(inline_bytes) / (1 << 20));
  return what + " encodes " + size + " in its message part, more than the " +
         std::to_string(limits.max_message_bytes >> 20) +
         " MiB one message carries to another process: keep bulk data in a std::vector of numbers or a "
         "troupe::Buffer, which travel beside the message";
}
}  // namespace

// What a store past its limit says of an object of `bytes` (`what`: which).
std::string ObjectStore::full_text_locked(const std::string& what, uint64_t bytes) const {
  return "object store full: " + what + " of " + std::to_string(bytes) +
         " bytes does not fit: " + std::to_string(bytes_) + " bytes held in " + std::to_string(objects_.size()) +
         " objects, limit " + std::to_string(limit_) + " bytes (TROUPE_OBJECT_STORE_BYTES)";
}

std::shared_ptr<RefHolder> ObjectStore::put(ObjectValue value) { return keep(std::move(value), true); }

std::shared_ptr<RefHolder> ObjectStore::put_held(ObjectValue value) { return keep(std::move(value), false); }

std::shared_ptr<RefHolder> ObjectStore::keep(ObjectValue value, bool limited) {
  // Another process could never fetch it (the owner's reply would exceed
  // the receiver's frame limit, read as an owner that is unreachable).
  if (value.bytes > wire::kMaxFramePayload) throw ConfigError(wire::too_big_for_a_frame("an object", value.bytes));
  // Nor one whose message part or attachment count a receiver refuses
  // (closing the connection, with every registration on it).
  if (value.inline_bytes > wire::kMaxInlineBody || value.attachments > wire::FrameLimits{}.max_attachments)
    throw ConfigError(unfetchable_text(value.type, value.inline_bytes, value.attachments));
  ensure_server();
  std::lock_guard lock(mu_);
  // An object of no bytes always fits (an actor's lifetime object, a file
  // piece): a store pushed past its limit (put_held, set_limit) refused
  // them too, and a Python actor was left running without its handle.
  if (limited && value.bytes > 0 && bytes_ + value.bytes > limit_)
    throw ObjectStoreFull(full_text_locked("an object", value.bytes));
  uint64_t id = next_id_++;
  std::string type = value.type;
  bytes_ += value.bytes;
  Entry& e = objects_[id];
  e.value = std::move(value);
  e.local = 1;
  return std::make_shared<RefHolder>(weak_from_this(), owner_info(id, type), true);
}

std::shared_ptr<RefHolder> ObjectStore::put_pending(const char* type) {
  ensure_server();
  std::lock_guard lock(mu_);
  uint64_t id = next_id_++;
  Entry& e = objects_[id];
  e.value.type = type;
  e.pending = true;
  e.local = 1;
  return std::make_shared<RefHolder>(weak_from_this(), owner_info(id, type), true);
}

void ObjectStore::fill(uint64_t id, ObjectValue value) { settle(id, std::move(value), nullptr); }

void ObjectStore::fail(uint64_t id, std::exception_ptr error) { settle(id, {}, std::move(error)); }

void ObjectStore::settle(uint64_t id, ObjectValue value, std::exception_ptr error) {
  std::vector<std::pair<std::weak_ptr<Connection>, uint64_t>> gets;
  std::vector<std::function<void()>> local;
  ObjectValue answer;
  {
    std::lock_guard lock(mu_);
    auto it = objects_.find(id);
    if (it == objects_.end() || !it->second.pending) return;
    Entry& e = it->second;
    if (!error && bytes_ + value.bytes > limit_) {
      // The limit holds for a value that arrives later too: the pending
      // object fails, typed, for whoever fetches it (the caller that made
      // the call still holds its own answer).
      error = std::make_exception_ptr(ObjectStoreFull(
          full_text_locked("a call's result, sent on inside another value before it was answered,", value.bytes)));
    }
    if (error) {
      e.error = error;
    } else {
      const char* type = e.value.type;
      e.value = std::move(value);
      e.value.type = type;
      bytes_ += e.value.bytes;
    }
    e.pending = false;
    gets.swap(e.waiting_gets);
    local.swap(e.waiting_local);
    answer = e.value;
  }
  for (auto& [weak, request] : gets)
    if (auto c = weak.lock()) c->send(get_answer(request, answer, error));
  for (auto& ready : local) ready();
}

void ObjectStore::when_ready(uint64_t id, std::function<void()> ready) {
  {
    std::lock_guard lock(mu_);
    auto it = objects_.find(id);
    if (it != objects_.end() && it->second.pending) {
      it->second.waiting_local.push_back(std::move(ready));
      return;
    }
  }
  ready();
}

ObjectRefInfo ObjectStore::owner_info(uint64_t id, const std::string& type) const {
  ObjectRefInfo info;
  info.owner_address = address_;
  info.owner_instance = instance_;
  info.owner_pid = getpid();
  info.owner_actor = core_.hello_reply().info.id;
  info.id = id;
  info.type = type;
  return info;
}

std::shared_ptr<const void> ObjectStore::local_value(uint64_t id, const std::string& type) const {
  ObjectValue v;
  {
    std::lock_guard lock(mu_);
    auto it = objects_.find(id);
    if (it == objects_.end()) throw ObjectLost(describe(owner_info(id, type)) + " is no longer held by its owner");
    if (it->second.error) std::rethrow_exception(it->second.error);
    if (it->second.pending) throw Error("object " + std::to_string(id) + " has no value yet");
    if (type != it->second.value.type)
      throw DecodeError("object " + std::to_string(id) + " holds a " + it->second.value.type + ", not a " + type);
    v = it->second.value;
  }
  return value_of(v);  // a file piece read outside the lock
}

// Unique per store (a counter), and across stores with high probability
// (mixed with the store's random instance).
uint64_t ObjectStore::new_pin() {
  std::lock_guard lock(mu_);
  uint64_t z = instance_ + 0x9e3779b97f4a7c15ull * next_pin_++;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (z ^ (z >> 31)) | 1;
}

void ObjectStore::pin_local(uint64_t id, uint64_t pin) {
  std::lock_guard lock(mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) return;
  if (!it->second.pins_used.erase(pin)) it->second.pins.insert(pin);
}

void ObjectStore::unpin_locked(Entry& e, uint64_t pin) {
  if (pin == 0) return;
  if (!e.pins.erase(pin)) e.pins_used.insert(pin);
}

ObjectValue ObjectStore::free_if_unused_locked(uint64_t id) {
  auto it = objects_.find(id);
  if (it == objects_.end()) return {};
  Entry& e = it->second;
  if (e.local > 0 || e.remote > 0 || !e.pins.empty()) return {};
  bytes_ -= e.value.bytes;
  ObjectValue dropped = std::move(e.value);
  objects_.erase(it);
  return dropped;
}

void ObjectStore::encode_ref(Encoder& e, const RefHolder& holder) {
  ObjectRefInfo info = holder.info();
  if (e.is_measuring()) {  // a size only: no pin, which nobody would release
    e.write_pod<uint8_t>(1);
    encode(e, info);
    return;
  }
  info.pin = new_pin();
  if (info.owner_instance == instance_) {
    pin_local(info.id, info.pin);
  } else {
    // Goes to the owner before the message that carries the ref can reach
    // anyone, on the connection this process's own registration uses.
    send_to_owner(info, object_message(Kind::EVENT, ObjectOp::kPin, info, info.pin));
  }
  // A message that never goes gives the pin back as its receiver would
  // have: registered, and let go at once.
  e.on_unsent([weak = weak_from_this(), info] {
    if (auto store = weak.lock()) store->adopt(info);
  });
  e.write_pod<uint8_t>(1);  // Codec<ObjectRef<T>>: a valid ref follows
  encode(e, info);
}

std::shared_ptr<RefHolder> ObjectStore::adopt(ObjectRefInfo info) {
  uint64_t pin = info.pin;
  info.pin = 0;
  if (info.owner_instance == instance_) {
    std::lock_guard lock(mu_);
    auto it = objects_.find(info.id);
    if (it != objects_.end()) {
      ++it->second.local;
      unpin_locked(it->second, pin);
    }
    return std::make_shared<RefHolder>(weak_from_this(), std::move(info), true);
  }
  send_to_owner(info, object_message(Kind::EVENT, ObjectOp::kAddRef, info, pin));
  return std::make_shared<RefHolder>(weak_from_this(), std::move(info), false);
}

void ObjectStore::release(const ObjectRefInfo& info, bool owned) {
  if (!owned) {
    if (!core_.head_lost()) send_to_owner(info, object_message(Kind::EVENT, ObjectOp::kRemoveRef, info));
    return;
  }
  ObjectValue dropped;  // destroyed after the lock: it may hold refs itself
  std::lock_guard lock(mu_);
  auto it = objects_.find(info.id);
  if (it == objects_.end()) return;
  --it->second.local;
  dropped = free_if_unused_locked(info.id);
}

void ObjectStore::ensure_server() {
  std::lock_guard server_lock(server_mu_);
  {
    std::lock_guard lock(mu_);
    if (!address_.empty()) return;
  }
  if (core_.io().get_executor().running_in_this_thread()) return start_listener();
  // The listener is created on the I/O thread that will serve it.
  auto done = std::make_shared<core::FutureState<bool>>();
  asio::post(core_.io(), [this, done] {
    try {
      start_listener();
      done->set_value(true);
    } catch (...) {
      done->set_error(std::current_exception());
    }
  });
  Future<bool>(done).get(std::chrono::seconds(10));
}

void ObjectStore::start_listener() {
  const std::string host = listen_host(core_.address());
  // Consumers connect to the advertise host (never a wildcard bind address).
  std::string advertise = core::env_value(core::kEnvAdvertiseHost);
  if (advertise.empty()) advertise = default_advertise_host(host);
  ListenerOptions options;
  options.connection = core_.connection_options();
  // A borrower that stops taking what it asked for is dropped (its pieces
  // hold the piece reader's slots): a stopped process, a partitioned host.
  options.connection.send_timeout = send_timeout();
  // No write bound: a borrower that asks for several large objects at once
  // (troupe.get of a list) has their answers queued together, and past the
  // bound of 256 MiB it was dropped as "not reading", with every
  // registration it held (objects it alone kept were freed). What queues
  // views the objects the store holds anyway; a borrower that truly stops
  // reading is dropped by the send timeout above.
  options.connection.max_queued_bytes = std::numeric_limits<uint64_t>::max();
  auto listener = std::make_unique<Listener>(core_.io(), host, 0, core_.token(), options,
                                             [this](ConnPtr c) { accept(std::move(c)); });
  std::lock_guard lock(mu_);
  address_ = format_address(advertise, listener->port());
  listener_ = std::move(listener);
}

void ObjectStore::accept(ConnPtr c) {
  {
    std::lock_guard lock(mu_);
    borrowers_[c.get()].first = c;
  }
  std::weak_ptr<Connection> weak = c;
  c->start([] {},
           [this, weak](Message&& m) {
             if (auto conn = weak.lock()) on_borrower_frame(conn, std::move(m));
           },
           [this, raw = c.get(), peer = c->peer()](const std::string& why) {
             // The send timeout's drop (TCP_USER_TIMEOUT: ETIMEDOUT) is
             // said where the driver's user sees it: the host's own error
             // only says its owner became unreachable (probe 27a).
             if (why.find("timed out") != std::string::npos)
               TROUPE_LOG_WARN(
                   "object server: dropped {}, which took nothing of what it asked for, or answered nothing, for "
                   "{} s (TROUPE_OBJECT_SEND_TIMEOUT_S; a stopped, vanished or cut-off process): its gets fail",
                   peer, send_timeout().count() / 1000.0);
             on_borrower_closed(raw);
           });
}

void ObjectStore::on_borrower_frame(const ConnPtr& c, Message&& m) {
  ObjectFrame f;
  try {
    f = decode_value<ObjectFrame>(m.body);
  } catch (const std::exception& e) {
    return c->close(std::string("bad object frame: ") + e.what());
  }
  auto op = static_cast<ObjectOp>(m.op);
  if (m.kind == Kind::REQUEST && op == ObjectOp::kGet) return serve_get(c, m);
  if (m.kind != Kind::EVENT || f.instance != instance_) return;
  ObjectValue dropped;  // destroyed after the lock: it may hold refs itself
  std::lock_guard lock(mu_);
  auto it = objects_.find(f.id);
  if (it == objects_.end()) return;  // freed: the borrower's get says ObjectLost
  Entry& e = it->second;
  auto& registered = borrowers_[c.get()].second;
  if (op == ObjectOp::kAddRef) {
    ++e.remote;
    ++registered[f.id];
    unpin_locked(e, f.pin);
  } else if (auto r = registered.find(f.id); op == ObjectOp::kRemoveRef && r != registered.end()) {
    --e.remote;
    if (--r->second == 0) registered.erase(r);
  } else if (op == ObjectOp::kPin && f.pin != 0) {
    if (!e.pins_used.erase(f.pin)) e.pins.insert(f.pin);
  }
  dropped = free_if_unused_locked(f.id);
}

void ObjectStore::serve_get(const ConnPtr& c, const Message& m) {
  ObjectValue v;
  std::exception_ptr error;
  try {
    auto f = decode_value<ObjectFrame>(m.body);
    std::lock_guard lock(mu_);
    auto it = objects_.find(f.id);
    // Another store's instance: its owner is gone and this process took its
    // port. Said so, not in this process's name (the owner_info of this
    // store named this pid and actor as the object's owner).
    if (f.instance != instance_)
      throw ObjectLost("object " + std::to_string(f.id) + " is lost: the process that owned it is gone, and " +
                       address_ + " is now another process's (pid " + std::to_string(::getpid()) + ")");
    if (it == objects_.end()) throw ObjectLost(describe(owner_info(f.id, "")) + " is no longer held by its owner");
    if (it->second.pending) {
      // Answered by settle(); the borrower's registration keeps it held.
      it->second.waiting_gets.emplace_back(c, m.id);
      return;
    }
    v = it->second.value;
    error = it->second.error;
    if (!error && v.encode == &encode_piece) {
      if (!pieces_) pieces_ = std::make_unique<PieceReader>();
      pieces_->serve(c, m.id, v);
      return;
    }
  } catch (...) {
    error = std::current_exception();
  }
  c->send(get_answer(m.id, v, error));
}

Message ObjectStore::get_answer(uint64_t request, const ObjectValue& value, std::exception_ptr error) {
  Message r;
  r.kind = Kind::RESPONSE;
  r.id = request;
  try {
    if (error) std::rethrow_exception(error);
    // Encoded outside the lock: large values are attachments viewing the
    // owner's memory, which the frame keeps alive until written.
    Encoder e;
    value.encode(value.value, e);
    r.body = std::move(e.bytes());
    r.attachments = std::move(e.attachments());
    // Refused here, with a reason, rather than by the borrower's frame
    // limits, which close the connection (a value put before its size was
    // measured, or grown past it: a file piece).
    if (r.attachments.size() > wire::FrameLimits{}.max_attachments)
      throw ConfigError(unfetchable_text(value.type, r.body.size(), r.attachments.size()));
    wire::check_sendable(r.body, r.attachments, [&] { return "object " + std::to_string(request); });
  } catch (const std::exception& e) {
    set_error(r, e);
  } catch (...) {
    set_unknown_error(r);
  }
  return r;
}

void ObjectStore::on_borrower_closed(Connection* raw) {
  std::vector<ObjectValue> dropped;  // destroyed after the lock
  std::lock_guard lock(mu_);
  auto it = borrowers_.find(raw);
  if (it == borrowers_.end()) return;
  auto registered = std::move(it->second.second);
  borrowers_.erase(it);
  for (auto& [id, n] : registered) {
    auto e = objects_.find(id);
    if (e == objects_.end()) continue;
    e->second.remote -= n;
    dropped.push_back(free_if_unused_locked(id));
  }
}

// ---- borrower side ----------------------------------------------------------

Future<Message> ObjectStore::fetch(const ObjectRefInfo& info) {
  auto st = std::make_shared<core::FutureState<Message>>();
  send_to_owner(info, object_message(Kind::REQUEST, ObjectOp::kGet, info), st);
  return Future<Message>(st);
}

// Sent under mu_ (Connection::send only queues, and calls back nothing):
// what this process tells an owner arrives in the order it happened, from
// whichever threads. A ref's RemoveRef sent outside the lock could overtake
// its AddRef (queued while the link connected, or sent by another thread):
// the owner ignored the first and kept the object for the second until
// this process exited.
void ObjectStore::send_to_owner(const ObjectRefInfo& info, Message m,
                                std::shared_ptr<core::FutureState<Message>> reply) {
  std::lock_guard lock(mu_);
  auto [it, fresh] = links_.try_emplace(info.owner_address);
  Link& link = it->second;
  if (reply) {
    m.id = next_request_++;
    link.gets[m.id] = Link::Get{reply, describe(info)};
  }
  if (link.conn) return link.conn->send(m);
  link.queued.push_back(std::move(m));
  if (fresh) asio::post(core_.io(), [this, address = info.owner_address] { connect_link(address); });
}

void ObjectStore::connect_link(const std::string& address) {
  std::pair<std::string, uint16_t> hp;
  try {
    hp = parse_address(address);
  } catch (const std::exception& e) {
    return fail_link(address, e.what());
  }
  // An owner that acknowledges nothing of what is sent to it (a get, the
  // connect itself) for the send timeout is gone (its host vanished): the
  // gets waiting on it fail with ObjectLost, where TCP retried for about 15
  // minutes. Its I/O thread reads whatever it is sent, so a live but busy
  // owner always acknowledges.
  ConnectionOptions options = core_.connection_options();
  options.send_timeout = send_timeout();
  Connection::connect(
      core_.io(), hp.first, hp.second, core_.token(), options,
      [this, address](Message&& m) { on_link_frame(address, std::move(m)); },
      [this, address](const std::string& reason) { fail_link(address, "connection dropped: " + reason); },
      [this, address](ConnPtr c, std::string error) { on_link_ready(address, std::move(c), error); });
}

void ObjectStore::on_link_ready(const std::string& address, ConnPtr c, const std::string& error) {
  if (!c) return fail_link(address, error);
  std::lock_guard lock(mu_);
  auto it = links_.find(address);
  if (it == links_.end()) return c->close("object link no longer wanted");
  it->second.conn = c;
  // Under mu_, before anything sent after them (send_to_owner).
  for (auto& m : std::exchange(it->second.queued, {})) c->send(m);
}

void ObjectStore::on_link_frame(const std::string& address, Message&& m) {
  std::shared_ptr<core::FutureState<Message>> reply;
  {
    std::lock_guard lock(mu_);
    auto it = links_.find(address);
    if (it == links_.end() || m.kind != Kind::RESPONSE) return;
    auto g = it->second.gets.find(m.id);
    if (g == it->second.gets.end()) return;
    reply = std::move(g->second.reply);
    it->second.gets.erase(g);
  }
  if (m.status != Status::OK) return reply->set_error(error_from_message(m));
  reply->set_value(std::move(m));
}

// The owner is gone or unreachable: every fetch waiting on it fails with
// ObjectLost, and the next use of the link connects afresh.
void ObjectStore::fail_link(const std::string& address, const std::string& reason) {
  const std::string dropped_prefix = "connection dropped: ";
  std::string why = " is lost: its owner is unreachable (" + reason + ")";
  if (reason.rfind(dropped_prefix, 0) == 0) {
    const std::string how = reason.substr(dropped_prefix.size());
    why = " is lost: the connection to its owner dropped (" + how + ")";
    // Closed by the owner: it ended, or it dropped this process for
    // reading nothing of what it asked for (its send timeout), which only
    // the owner's log says.
    if (how == "peer closed the connection" || how.find("reset by peer") != std::string::npos)
      why += std::string(": the owner ended, or dropped this process for taking nothing for ") +
             core::kEnvObjectSendTimeout + " seconds (a stopped process, a stalled link)";
    else if (how.find("timed out") != std::string::npos)
      why += std::string(": its host acknowledged nothing sent to it for ") + core::kEnvObjectSendTimeout +
             " seconds (it vanished, or the network between is cut)";
  }
  Link link;
  {
    std::lock_guard lock(mu_);
    auto it = links_.find(address);
    if (it == links_.end()) return;
    link = std::move(it->second);
    links_.erase(it);
  }
  for (auto& [id, get] : link.gets) get.reply->set_error(std::make_exception_ptr(ObjectLost(get.object + why)));
}

}  // namespace troupe::client
