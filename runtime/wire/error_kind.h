// Errors as values on the wire: an error answer (a call's reply, a control
// or head response) carries the exception's kind, type name and message, so
// that the caller rethrows the same type: ActorDied, Timeout, ConfigError,
// Aborted, DecodeError and ConnectionError as themselves, a class
// registered with TROUPE_ERROR as that class, anything else as RemoteError
// naming the remote type.
#pragma once

#include <exception>
#include <string>

#include "troupe/runtime/wire/frame.h"

namespace troupe::wire {

// The demangled name of `e`'s dynamic type (for messages and RemoteError).
std::string type_name_of(const std::exception& e);
// Marks `m` as an error answer carrying `e` (status, kind, type, message);
// clears its body and attachments.
void set_error(Message& m, const std::exception& e);
// The same for something that is not a std::exception.
void set_unknown_error(Message& m);
// The exception an error answer stands for, typed by its kind.
std::exception_ptr error_from_message(const Message& m);

}  // namespace troupe::wire
