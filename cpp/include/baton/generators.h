// Schedule generators. Each refuses combinations it cannot serve by throwing
// ScheduleError naming the constraint and the values given.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "baton/schedule.h"

namespace baton {

// p ranks, m microbatches. Stage count is implied by the schedule:
// p (contiguous), p*v (interleaved), 2p (ZB-V, DualPipeV).
Schedule gpipe(int p, int m);
Schedule one_f_one_b(int p, int m);
Schedule eager_one_f_one_b(int p, int m);
Schedule interleaved_one_f_one_b(int p, int m, int v);
Schedule zb_h1(int p, int m);
Schedule zb_h2(int p, int m);
Schedule zb_v(int p, int m);
Schedule dualpipe_v(int p, int m);

// Generator by name: "gpipe", "1f1b", "eager1f1b", "interleaved", "zbh1",
// "zbh2", "zbv", "dualpipev" (case-insensitive; '-' and '_' ignored).
// `v` is used by "interleaved" only (others reject v != 1 ... except they
// ignore it when v == 1).
Schedule make_schedule(std::string_view name, int p, int m, int v = 1);
std::vector<std::string> schedule_names();

}  // namespace baton
