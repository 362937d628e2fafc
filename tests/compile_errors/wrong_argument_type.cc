#include "tests/compile_errors/common.h"
void misuse(troupe::ActorHandle<Adder> h) { h.call(&Adder::add, std::string("x")); }
