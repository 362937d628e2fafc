// Conversions between the wire's Python values (py_value.h) and the tuples
// troupe/_serialization.py works with: (data, [buffers], [ObjectRef]). They
// run under the GIL, except where a ref must first be stored (a call answer
// nested in a value), which waits with the GIL released.
#pragma once

#include <memory>

#include "python_shim/src/py_ref.h"
#include "python_shim/src/py_value.h"

namespace troupe::py {

// (data, buffers, refs) -> PyValue.
PyValue value_from_python(const pyb::handle& parts);
// PyValue -> (data, buffers, refs); refs get `core` (this process's).
pyb::tuple value_to_python(const PyValue& v, const std::shared_ptr<client::Core>& core);
// A reply -> (error, data, buffers, refs).
pyb::tuple reply_to_python(const PyReply& r, const std::shared_ptr<client::Core>& core);
// (error, data, buffers, refs) -> a reply.
PyReply reply_from_python(const pyb::handle& parts);

}  // namespace troupe::py
