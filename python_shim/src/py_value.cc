#include "python_shim/src/py_value.h"

#include <memory>

namespace troupe::py {

namespace {

// A view of a Python buffer that keeps its exporter alive; released under
// the GIL from whichever thread drops the last reference (the I/O thread
// after the frame went out), unless the interpreter is already gone.
struct PythonView {
  Py_buffer view{};
  ~PythonView() {
    if (!Py_IsInitialized()) return;
    pyb::gil_scoped_acquire gil;
    PyBuffer_Release(&view);
  }
};

}  // namespace

Buffer buffer_from_python(const pyb::handle& object) {
  auto held = std::make_shared<PythonView>();
  if (PyObject_GetBuffer(object.ptr(), &held->view, PyBUF_RECORDS_RO) != 0) throw pyb::error_already_set();
  const Py_buffer& v = held->view;
  size_t size = static_cast<size_t>(v.len);
  if (!PyBuffer_IsContiguous(&v, 'A')) {
    std::byte* out = nullptr;
    Buffer copy = Buffer::allocate(size, &out);
    if (PyBuffer_ToContiguous(out, &v, v.len, 'C') != 0) throw pyb::error_already_set();
    return copy;
  }
  // Small buffers travel inline (copied by the codec anyway): copy them
  // now and let the Python object go.
  if (size < wire::kAttachThreshold) return Buffer::copy(v.buf, size);
  const auto* data = static_cast<const std::byte*>(v.buf);
  return Buffer(std::shared_ptr<const void>(held, held.get()), data, size);
}

// A read-only Python buffer over a troupe Buffer (registered in module.cc).
pyb::object buffer_to_python(const Buffer& b) { return pyb::cast(b); }

}  // namespace troupe::py
