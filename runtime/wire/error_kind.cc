#include "troupe/runtime/wire/error_kind.h"

#include <cxxabi.h>

#include <cstdlib>
#include <typeinfo>

#include "troupe/runtime/core/error_registry.h"

namespace troupe::wire {

namespace {

// The object store's errors, and what fetching a task's result may raise
// (TaskCancelled, WorkerDied), travel by name (as TROUPE_ERROR classes do);
// registered here, in code every caller links, so they arrive typed.
[[maybe_unused]] const bool kObjectErrorsRegistered =
    core::register_error<ObjectLost>("troupe::ObjectLost") &&
    core::register_error<ObjectStoreFull>("troupe::ObjectStoreFull") &&
    core::register_error<TaskCancelled>("troupe::TaskCancelled") &&
    core::register_error<WorkerDied>("troupe::WorkerDied");

// Built-in kinds; a subclass travels as its nearest built-in base unless it
// is registered itself (checked first, by exact type).
ErrorKind builtin_kind(const std::exception& e) {
  if (dynamic_cast<const ActorDied*>(&e)) return ErrorKind::ACTOR_DIED;
  if (dynamic_cast<const Timeout*>(&e)) return ErrorKind::TIMEOUT;
  if (dynamic_cast<const ConfigError*>(&e)) return ErrorKind::CONFIG_ERROR;
  if (dynamic_cast<const Aborted*>(&e)) return ErrorKind::ABORTED;
  if (dynamic_cast<const DecodeError*>(&e)) return ErrorKind::DECODE_ERROR;
  if (dynamic_cast<const ConnectionError*>(&e)) return ErrorKind::CONNECTION_ERROR;
  return ErrorKind::USER;
}

}  // namespace

std::string readable_type_name(const char* mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = (status == 0 && d) ? d : mangled;
  std::free(d);
  return s;
}

std::string readable_type_name(const std::type_info& type) { return readable_type_name(type.name()); }

std::string type_name_of(const std::exception& e) { return readable_type_name(typeid(e)); }

void set_error(Message& m, const std::exception& e) {
  m.status = Status::ERROR;
  m.body.clear();
  m.attachments.clear();
  m.error_message = e.what();
  if (std::string name = core::registered_error_name(e); !name.empty()) {
    m.error_kind = ErrorKind::USER;
    m.error_type = std::move(name);
    return;
  }
  m.error_kind = builtin_kind(e);
  m.error_type = type_name_of(e);
}

void set_unknown_error(Message& m) {
  m.status = Status::ERROR;
  m.body.clear();
  m.attachments.clear();
  m.error_kind = ErrorKind::USER;
  m.error_type = "unknown";
  m.error_message = "a non-standard exception was thrown";
}

std::exception_ptr error_from_message(const Message& m) {
  const std::string& msg = m.error_message;
  if (m.status == Status::ACTOR_DIED) return std::make_exception_ptr(ActorDied(msg));
  switch (m.error_kind) {
    case ErrorKind::ACTOR_DIED:
      return std::make_exception_ptr(ActorDied(msg));
    case ErrorKind::TIMEOUT:
      return std::make_exception_ptr(Timeout(msg));
    case ErrorKind::CONFIG_ERROR:
      return std::make_exception_ptr(ConfigError(msg));
    case ErrorKind::ABORTED:
      return std::make_exception_ptr(Aborted(msg));
    case ErrorKind::DECODE_ERROR:
      return std::make_exception_ptr(DecodeError(msg));
    case ErrorKind::CONNECTION_ERROR:
      return std::make_exception_ptr(ConnectionError(msg));
    case ErrorKind::USER:
      if (auto e = core::make_registered_error(m.error_type, msg)) return e;
      break;
    default:  // NONE, or a kind from a newer peer
      break;
  }
  return std::make_exception_ptr(RemoteError(m.error_type.empty() ? "unknown" : m.error_type, msg));
}

}  // namespace troupe::wire
