#include "tests/compile_errors/common.h"
void misuse(troupe::Runtime& rt) { rt.submit(&twice, {}, std::vector<int>{1}); }
