// The schedule text format (documented in docs/SCHEDULES.md):
//
//   # comments start with '#'
//   baton-schedule 1
//   name 1f1b
//   ranks 2
//   stages 2
//   microbatches 2
//   placement 0 1            # rank of each stage, in stage order
//   rank 0: F0.0 F0.1 B0.0 B0.1
//   rank 1: F1.0 B1.0 F1.1 B1.1
//
// A task is <kind><stage>.<microbatch> with kind one of F B I W; a fused
// action joins two tasks with '+', e.g. F0.3+B7.1. One "rank" row per rank.
#pragma once
#include <string>
#include <string_view>

#include "baton/schedule.h"

namespace baton {

std::string save_schedule(const Schedule& s);
// Parses and validates; throws FormatError("line L, column C: ...") on
// syntax errors and ScheduleError (prefixed with the line) on invalid content.
Schedule load_schedule(std::string_view text);

}  // namespace baton
