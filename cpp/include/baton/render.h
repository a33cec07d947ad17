// Pictures and traces of a simulated (or measured) run.
#pragma once
#include <string>

#include "baton/plan.h"
#include "baton/sim.h"

namespace baton {

struct VerifyReport;

// Chrome / Perfetto trace-event JSON ("traceEvents" array of complete "X"
// events; pid 0, one tid per rank named "rank r"; transfers as flow events).
// Timestamps in microseconds: time_unit_us converts simulator time units.
// Details: one "X" event per RUN (name = action, e.g. "F3.1" or
// "F0.3+B7.1"; cat = "F", "B", "I", "W" or "fused"; args {stage, microbatch,
// instr, action}); one "X" event per transfer (cat "transfer", name = buffer)
// on a track per used link (tid = ranks + k, named "link a->b"), with a flow
// ("s" on the link track at its start, "f" on the receiving rank at its
// arrival); one "C" counter series per rank named "memory rank r" with args
// {activation, total} in bytes; "displayTimeUnit": "ms".
std::string to_chrome_trace(const Plan& plan, const SimResult& r, double time_unit_us = 1000.0);
// SVG timeline: ranks as rows, actions coloured by kind (F, B, I, W, fused)
// and labelled with the microbatch; idle time visible as gaps. Each action is
// exactly one <rect class="action ..."> (with a <title> tooltip); labels read
// "m" on single-stage ranks and "m/s" (microbatch/stage) on multi-stage ranks.
std::string to_svg(const Plan& plan, const SimResult& r);
// Text grid for terminals: one row per rank, one column per `width`-th of the
// step; cells show the task kind letter and microbatch, '.' for idle.
// A cell shows what runs at the middle of its column; a fused action shows
// 'X' and its first task's microbatch. width <= 0 picks one column per the
// shortest RUN's duration (at most 200 columns). Output: a header line, then
// one line per rank "rank R | " followed by `width` cells of equal width.
std::string to_text_grid(const Plan& plan, const SimResult& r, int width = 0);

// Fixed-width summary: schedule, ranks, stages, microbatches, step time,
// bubble; per rank busy time, bubble %, span, peak activation and peak total
// bytes; then the verification result ("verification: not run" when
// `report` is null).
std::string summary_table(const Plan& plan, const SimResult& r, const VerifyReport* report);

}  // namespace baton
