// nanobind module baton._core: thin conversion layer, no logic.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

#if BATON_BIND_PLANNER
// bind_planner.cc (with bind_plan.cc, bind_sim.cc, bind_autoplan.cc): schedules, plans,
// verify, sim, render, autoplan, cluster planning
void init_planner(nb::module_& m);
void init_rankir(nb::module_& m);  // bind_rankir.cc: rank programs
#endif
#if BATON_BIND_GRAPH
void init_graph(nb::module_& m);  // bind_graph.cc: Program IR and graph passes
#endif
#if BATON_BIND_RUNTIME
// bind_runtime.cc (with bind_values.cc, bind_comm.cc): executor, transports, transfer
// contexts (_core.runtime)
void init_runtime(nb::module_& m);
void init_ffi(nb::module_& m);  // ffi_handlers.cc: XLA FFI transfer handlers (_core.ffi)
#endif

NB_MODULE(_core, m) {
  m.doc() = "Baton C++ core";
#if BATON_BIND_PLANNER
  init_planner(m);
  init_rankir(m);
#endif
#if BATON_BIND_GRAPH
  init_graph(m);
#endif
#if BATON_BIND_RUNTIME
  init_runtime(m);
  init_ffi(m);
#endif
}
