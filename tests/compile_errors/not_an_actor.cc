#include "tests/compile_errors/common.h"
void misuse(troupe::Runtime& rt) { rt.spawn<NotAnActor>({}); }
