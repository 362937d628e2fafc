// User exception classes that cross the wire by type. A class registered
// with TROUPE_ERROR(MyError) and thrown by an actor method is rebuilt on the
// caller, so `catch (const MyError&)` works there; an unregistered class
// arrives as troupe::RemoteError naming it. Like the TROUPE_ACTOR method
// table, the registry is filled during static initialisation and only read
// afterwards.
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <type_traits>
#include <typeindex>

#include "troupe/runtime/core/errors.h"

namespace troupe::core {

using ErrorMaker = std::function<std::exception_ptr(const std::string& message)>;

// Registers the exception class `type` under `name` (what the wire
// carries; both sides must register the class under the same name).
bool register_error_type(std::type_index type, const std::string& name, ErrorMaker make);
// The name `e`'s exact dynamic type is registered under, or "" when it is
// not registered.
std::string registered_error_name(const std::exception& e);
// Rebuilds an exception registered under `name` with `message`; nullptr
// when no class is registered under that name in this process.
std::exception_ptr make_registered_error(const std::string& name, const std::string& message);

template <class E>
bool register_error(const char* name) {
  static_assert(std::is_base_of_v<std::exception, E>, "TROUPE_ERROR needs a class derived from std::exception");
  static_assert(std::is_constructible_v<E, std::string>, "TROUPE_ERROR needs a class constructible from a message");
  return register_error_type(typeid(E), name,
                             [](const std::string& message) { return std::make_exception_ptr(E(message)); });
}

}  // namespace troupe::core

#define TROUPE_ERROR_CONCAT_INNER(a, b) a##b
#define TROUPE_ERROR_CONCAT(a, b) TROUPE_ERROR_CONCAT_INNER(a, b)
// Makes `Class` (derived from std::exception, constructible from a message
// string) reach callers as itself. Use at namespace scope, once per class,
// in code linked into both the caller and the actor's worker. Like
// TROUPE_TASK and TROUPE_ACTOR it needs no semicolon after it (one is
// harmless).
#define TROUPE_ERROR(Class)                                                      \
  static const bool TROUPE_ERROR_CONCAT(troupe_error_registered_, __COUNTER__) = \
      ::troupe::core::register_error<Class>(#Class);
