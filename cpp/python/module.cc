// nanobind module baton._core: thin conversion layer, no logic.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_planner(nb::module_& m);  // bind_planner.cc: schedules, plans, verify, sim, render
void init_graph(nb::module_& m);    // bind_graph.cc: Program IR and graph passes

NB_MODULE(_core, m) {
  m.doc() = "Baton C++ core";
  init_planner(m);
  init_graph(m);
}
