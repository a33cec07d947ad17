// Pictures and traces of a simulated (or measured) run.
#pragma once
#include <string>

#include "baton/plan.h"
#include "baton/sim.h"

namespace baton {

// Chrome / Perfetto trace-event JSON ("traceEvents" array of complete "X"
// events; pid 0, one tid per rank named "rank r"; transfers as flow events).
// Timestamps in microseconds: time_unit_us converts simulator time units.
std::string to_chrome_trace(const Plan& plan, const SimResult& r, double time_unit_us = 1000.0);
// SVG timeline: ranks as rows, actions coloured by kind (F, B, I, W, fused)
// and labelled with the microbatch; idle time visible as gaps.
std::string to_svg(const Plan& plan, const SimResult& r);
// Text grid for terminals: one row per rank, one column per `width`-th of the
// step; cells show the task kind letter and microbatch, '.' for idle.
std::string to_text_grid(const Plan& plan, const SimResult& r, int width = 0);

}  // namespace baton
