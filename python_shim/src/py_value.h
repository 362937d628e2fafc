// Python values on troupe's wire. A Python value is its pickle (protocol 5)
// plus the out-of-band buffers pickle handed over (NumPy arrays, tensors:
// frame attachments, never copied into the message) plus the object refs
// found inside it (nested refs stay refs: each crosses as an
// ObjectRef<PyValue>, pinned and registered with its owner like any ref).
//
// A call's arguments are one PyValue (the pickled (args, kwargs), in which
// top-level refs are placeholders) and the top-level refs beside it: each
// either the value already (a call result the driver had) or a ref the
// callee resolves before the function runs, as Ray does.
//
// Conversions to and from Python objects live here too; they need the GIL.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "troupe/runtime/client/object_ref.h"
#include "troupe/runtime/wire/codec.h"
#include "troupe/runtime/wire/frame.h"

namespace troupe::py {

namespace pyb = pybind11;

struct PyValue {
  Buffer data;  // the pickle stream
  std::vector<Buffer> buffers;
  std::vector<ObjectRef<PyValue>> refs;
  TROUPE_FIELDS(data, buffers, refs)
};

// A top-level argument that was an object ref.
struct PyArg {
  uint8_t inline_value = 0;  // 1: `value` holds it; 0: fetch `ref`
  PyValue value;
  ObjectRef<PyValue> ref;
  TROUPE_FIELDS(inline_value, value, ref)
};

// One call: an actor method (by name) or a task (by its function's hash),
// with its arguments.
struct PyCall {
  std::string target;
  PyValue args;
  std::vector<PyArg> top;
  // A task's token in the process that submitted it (0 for other calls):
  // what troupe.cancel's PyInterruptTask names.
  uint64_t task = 0;
  // A streaming call (a generator task or method, Ray's
  // num_returns="streaming"): where its values go, one stream item each
  // (the caller's stream listener and stream id; empty for other calls),
  // after the first `stream_skip` (those a failed attempt already
  // delivered).
  std::string stream_address;
  uint64_t stream_id = 0;
  uint64_t stream_skip = 0;
  TROUPE_FIELDS(target, args, top, task, stream_address, stream_id, stream_skip)
};

// Control message of troupe.cancel (without force) to the worker that runs
// task or actor call `task` (a task's PyCall::task, a call's id): a task
// not started, or a call, is marked so that it never starts; a running
// task gets KeyboardInterrupt, a running async method's coroutine is
// cancelled (a plain method runs on: it may ask is_canceled()). With
// `recursive`, the tasks it submitted that have not finished are cancelled
// too (without force, recursively: Ray's recursive=True). Replies what the
// worker knew (client::TaskState) once asked; the interrupt is delivered on
// a thread of its own.
struct PyInterruptTask {
  static constexpr const char* kControlTag = "troupe.py.interrupt_task";
  using Reply = int32_t;  // client::TaskState
  uint64_t task = 0;
  bool recursive = true;
  TROUPE_FIELDS(task, recursive)
};

// What a Python actor's constructor receives: its class, pickled, and the
// constructor's arguments.
struct PyActorSpec {
  Buffer class_blob;
  PyCall ctor;
  TROUPE_FIELDS(class_blob, ctor)
};

// The most an actor's spec may take: the head keeps it (for restarts) and
// takes one message of wire::kHeadFrameLimits, less room for the rest of
// the actor's spec.
inline constexpr size_t kMaxSpecBytes = wire::kHeadFrameLimits.max_message_bytes - (64u << 10);

// A call's answer. A Python exception is an answer too (error = 1, the value
// being the pickled exception with its traceback): the caller rebuilds the
// original class; failures of the runtime itself travel as error replies.
struct PyReply {
  uint8_t error = 0;
  PyValue value;
  TROUPE_FIELDS(error, value)
};

}  // namespace troupe::py

namespace troupe::client {
// A stored Python value costs its pickle and buffers; it encodes as itself
// (the generic size estimate would encode it, pinning its refs).
template <>
struct ObjectPayload<py::PyValue> {
  static void encode(const std::shared_ptr<const py::PyValue>& v, wire::Encoder& e) { wire::encode(e, *v); }
  static py::PyValue decode(wire::Decoder& d) { return wire::decode<py::PyValue>(d); }
  static ObjectSize measure(const py::PyValue& v) {
    ObjectSize size;
    // The pickle and each buffer: attached when large, else inline
    // (Codec<Buffer>), and its refs inline.
    auto add = [&](const Buffer& b) {
      size.bytes += b.size();
      const bool attached = b.size() >= wire::kAttachThreshold;
      size.inline_bytes += attached ? 16 : b.size() + 16;
      size.attachments += attached ? 1 : 0;
    };
    add(v.data);
    for (const auto& b : v.buffers) add(b);
    // Each ref: its owner's address, ids and type, about a hundred bytes.
    size.inline_bytes += v.refs.size() * 128;
    return size;
  }
};
}  // namespace troupe::client

namespace troupe::py {

// Python -> C++: `data` is a bytes-like pickle, `buffers` a list of
// PickleBuffers (or any buffer), `refs` a list of ObjectRef (PyRef) objects
// already turned into stored refs. A large buffer whose memory can never
// change (bytes, a troupe buffer, read-only views of them), or one troupe
// made (`owned`: the pickle), is viewed, not copied: the view keeps the
// Python object alive and releases it under the GIL. Any other is copied,
// so that what the caller writes afterwards is not seen.
Buffer buffer_from_python(const pyb::handle& object, bool owned = false);
// C++ -> Python: a read-only buffer object viewing `b` (no copy).
pyb::object buffer_to_python(const Buffer& b);

}  // namespace troupe::py
