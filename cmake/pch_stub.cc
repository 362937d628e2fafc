// The stub that precompiles a header set for executables (cmake/TroupePch.cmake);
// never linked.
int main() { return 0; }
