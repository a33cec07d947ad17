// Bindings of the program IR and graph passes (placeholder until written).
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_graph(nb::module_& m) { (void)m; }
