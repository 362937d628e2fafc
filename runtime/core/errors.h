// The exception hierarchy of troupe. Inside a process, logistics failures
// (I/O, timeouts, bugs) are exceptions; across the wire they travel as error
// values (kind + type name + message, wire/error_kind.h) and Future::get
// rethrows the same type.
#pragma once

#include <stdexcept>
#include <string>

namespace troupe {

// Base of every exception troupe throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wait ran out of time (Future::get, KV wait, rendezvous, collectives).
class Timeout : public Error {
 public:
  using Error::Error;
};

// The actor that should run a call is dead (crashed, killed, or out of
// restarts), or died while the call was in flight.
class ActorDied : public Error {
 public:
  using Error::Error;
};

// The worker process that ran a task died while it ran (and the task had no
// retries left), or task executors kept dying before they could start; the
// message names the task and the cause of death.
class WorkerDied : public ActorDied {
 public:
  using ActorDied::ActorDied;
};

// A user method threw a class that is neither one of these nor registered
// with TROUPE_ERROR; carries the remote type name. (A constructor that
// throws kills its actor, without using a restart: the calls fail with
// ActorDied, whose message carries the constructor's error.)
class RemoteError : public Error {
 public:
  RemoteError(std::string type_name, std::string message)
      : Error(type_name + ": " + message), type_name_(std::move(type_name)), remote_message_(std::move(message)) {}
  const std::string& type_name() const { return type_name_; }
  const std::string& remote_message() const { return remote_message_; }

 private:
  std::string type_name_;
  std::string remote_message_;
};

// A task was cancelled (TaskSubmitter::cancel, troupe.cancel) before it
// finished: its result will never come. The message names the task.
class TaskCancelled : public Error {
 public:
  using Error::Error;
};

// A value could not be decoded (malformed or truncated bytes).
class DecodeError : public Error {
 public:
  using Error::Error;
};

// A connection failed, was refused, or closed.
class ConnectionError : public Error {
 public:
  using Error::Error;
};

// Bad configuration or argument supplied by the user.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// An operation was aborted (collective group aborted, runtime shutting down).
class Aborted : public Error {
 public:
  using Error::Error;
};

// An ObjectRef's value cannot be had: its owner process died or cannot be
// reached, or no longer holds the object. The message names the owner
// (address, pid, actor) and the object.
class ObjectLost : public Error {
 public:
  using Error::Error;
};

// A put (or a call_ref result) would take the process's object store past
// its limit (InitOptions::object_store_bytes, TROUPE_OBJECT_STORE_BYTES);
// the message gives the object's size, what is held and the limit.
class ObjectStoreFull : public Error {
 public:
  using Error::Error;
};

}  // namespace troupe
