#include "python_shim/src/py_value.h"

#include <memory>
#include <string_view>

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

// Whether the memory behind `view` can never change: read-only all the way
// to a bytes object or a troupe Buffer, through memoryviews and NumPy
// arrays (an array's base). Anything else belongs to the caller, who may
// write it once the call has returned.
bool immutable_memory(const Py_buffer& view) {
  if (!view.readonly) return false;
  PyObject* obj = view.obj;
  for (int depth = 0; obj && depth < 16; ++depth) {
    if (PyBytes_CheckExact(obj) || pyb::isinstance<Buffer>(obj)) return true;
    if (PyMemoryView_Check(obj)) {
      obj = PyMemoryView_GET_BASE(obj);
      continue;
    }
    if (std::string_view(Py_TYPE(obj)->tp_name) != "numpy.ndarray") return false;
    pyb::object array = pyb::reinterpret_borrow<pyb::object>(obj);
    if (array.attr("flags").attr("writeable").cast<bool>()) return false;
    pyb::object base = array.attr("base");
    if (base.is_none()) return false;
    obj = base.ptr();  // kept alive by the array, which the view holds
  }
  return false;
}

}  // namespace

Buffer buffer_from_python(const pyb::handle& object, bool owned) {
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
  // now and let the Python object go. So is memory the caller may still
  // write (a NumPy array put, then changed in place): a value is what it
  // was at the call, as in Ray's object store.
  if (size < wire::kAttachThreshold || (!owned && !immutable_memory(v))) return Buffer::copy(v.buf, size);
  const auto* data = static_cast<const std::byte*>(v.buf);
  return Buffer(std::shared_ptr<const void>(held, held.get()), data, size);
}

// A read-only Python buffer over a troupe Buffer (registered in module.cc).
pyb::object buffer_to_python(const Buffer& b) { return pyb::cast(b); }

}  // namespace troupe::py
