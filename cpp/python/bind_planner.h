// Internal to the planner bindings: the binders of bind_plan.cc, bind_sim.cc
// and bind_autoplan.cc, which init_planner (bind_planner.cc) calls in order.
#pragma once
#include <nanobind/nanobind.h>

#include "baton/schedule.h"

namespace baton::python {

namespace nb = nanobind;

// Raises IndexError unless `rank` is a rank of `s`.
void check_rank(const baton::Schedule& s, int rank);

void bind_cost(nb::module_& m);      // bind_sim.cc: stage, link and skip costs; CostModel
void bind_plan(nb::module_& m);      // bind_plan.cc: buffers, instructions, Plan, lower
void bind_verify(nb::module_& m);    // bind_plan.cc: the verifier and its report
void bind_sim(nb::module_& m);       // bind_sim.cc: simulator results, simulate, renderers
void bind_autoplan(nb::module_& m);  // bind_autoplan.cc: autoplan, autoplan_evaluate
void bind_cluster(nb::module_& m);   // bind_autoplan.cc: cluster planning, collectives

}  // namespace baton::python
