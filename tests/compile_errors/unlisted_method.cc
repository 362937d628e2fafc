#include "tests/compile_errors/common.h"
void misuse(troupe::ActorHandle<Adder> h) { h.call(&Adder::unlisted, 1.0, 2.0); }
