#include "tests/compile_errors/common.h"
void misuse(troupe::ActorHandle<Adder> h, troupe::ObjectRef<std::vector<int>> ref) { h.call(&Adder::sum, ref); }
