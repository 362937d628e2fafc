#include "python_shim/src/py_convert.h"

namespace troupe::py {

PyValue value_from_python(const pyb::handle& parts) {
  auto t = pyb::reinterpret_borrow<pyb::tuple>(parts);
  if (t.size() != 3) throw pyb::value_error("a serialized value is (data, buffers, refs)");
  PyValue v;
  v.data = buffer_from_python(t[0], /*owned=*/true);  // the pickle troupe made
  for (auto b : pyb::reinterpret_borrow<pyb::list>(t[1])) v.buffers.push_back(buffer_from_python(b));
  for (auto r : pyb::reinterpret_borrow<pyb::list>(t[2])) {
    auto ref = r.cast<std::shared_ptr<PyRef>>();
    pyb::gil_scoped_release nogil;
    v.refs.push_back(ref->stored_ref());
  }
  return v;
}

pyb::tuple value_to_python(const PyValue& v, const std::shared_ptr<client::Core>& core) {
  // Small pickles as bytes (cheapest for pickle.loads), large ones viewed.
  pyb::object data = v.data.size() < 4096
                         ? pyb::object(pyb::bytes(reinterpret_cast<const char*>(v.data.data()), v.data.size()))
                         : buffer_to_python(v.data);
  pyb::list buffers;
  for (const auto& b : v.buffers) buffers.append(buffer_to_python(b));
  pyb::list refs;
  for (const auto& r : v.refs) refs.append(pyb::cast(std::make_shared<PyRef>(core, r)));
  return pyb::make_tuple(data, buffers, refs);
}

pyb::tuple reply_to_python(const PyReply& r, const std::shared_ptr<client::Core>& core) {
  pyb::tuple v = value_to_python(r.value, core);
  return pyb::make_tuple(pyb::bool_(r.error != 0), v[0], v[1], v[2]);
}

PyReply reply_from_python(const pyb::handle& parts) {
  auto t = pyb::reinterpret_borrow<pyb::tuple>(parts);
  if (t.size() != 4) throw pyb::value_error("a serialized reply is (error, data, buffers, refs)");
  PyReply r;
  r.error = t[0].cast<bool>() ? 1 : 0;
  r.value = value_from_python(pyb::make_tuple(t[1], t[2], t[3]));
  return r;
}

}  // namespace troupe::py
