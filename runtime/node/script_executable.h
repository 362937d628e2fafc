// A worker executable given as a script's text rather than a path
// (ActorSpec::executable starting with "#!"): each node agent writes it
// into a directory of its own, named by the hash of its content, and runs
// that file. A Python driver names its worker launcher this way, so that
// every node of a cluster runs it without the driver's file system (a
// launcher written to the driver's /tmp was missing on every other host).
#pragma once

#include <string>

namespace troupe::node {

// Whether `executable` is a script's text, not a path.
bool is_script_text(const std::string& executable);

// The path of `text` written (mode 0700, once: an existing file of that
// content is reused) into `dir`, which is made with mode 0700 and must be
// this user's and closed to others. Throws Error naming the directory or
// the size (at most 64 KiB of text).
std::string script_executable(const std::string& text, const std::string& dir);

}  // namespace troupe::node
