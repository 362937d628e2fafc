// troupe.util.collective's bindings: _core.join_group and CollectiveGroup.
#pragma once

#include <pybind11/pybind11.h>

namespace troupe::py {

void bind_collective(pybind11::module_& m);

}  // namespace troupe::py
