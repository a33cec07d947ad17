// Schedule generators. Each refuses combinations it cannot serve by throwing
// ScheduleError naming the constraint and the values given. Orders, bubble
// and memory formulas: docs/SCHEDULES.md.
//
// Every returned schedule passes Schedule::validate() and, lowered by
// lower() (plan.h), verifies deadlock-free under both CommModel::Blocking
// and CommModel::Fifo. Generation is O(actions) and deterministic.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "baton/schedule.h"

namespace baton {

// p ranks, m microbatches. Stage count is implied by the schedule:
// p (contiguous), p*v (interleaved), 2p (ZB-V, V-Min, V-Half, DualPipeV).
// Accepted (besides p >= 1, m >= 1):
//   interleaved_one_f_one_b: v >= 1; for v >= 2, m % p == 0 or m <= p.
//                            v == 1 gives the 1F1B order.
//   dualpipe_v:              m >= 2p.
Schedule gpipe(int p, int m);
Schedule one_f_one_b(int p, int m);
Schedule eager_one_f_one_b(int p, int m);
Schedule interleaved_one_f_one_b(int p, int m, int v);
Schedule zb_h1(int p, int m);
Schedule zb_h2(int p, int m);
Schedule zb_v(int p, int m);
Schedule v_min(int p, int m);
Schedule v_half(int p, int m);
Schedule dualpipe_v(int p, int m);

// Generator by name: "gpipe", "1f1b", "eager1f1b", "interleaved", "zbh1",
// "zbh2", "zbv", "vmin", "vhalf", "dualpipev" (case-insensitive; '-' and '_' ignored;
// "interleaved1f1b" is accepted for "interleaved"). `v` is used by
// "interleaved" only; every other schedule refuses v != 1.
Schedule make_schedule(std::string_view name, int p, int m, int v = 1);
// The names above, in that order.
std::vector<std::string> schedule_names();

// A schedule where every F(s,m) directly followed on its rank by B(s,m) of
// the same stage and microbatch becomes one fused action "F s.m+B s.m" (the
// stash is then internal to the action: the runtime may compute forward and
// backward as one program and keep no stash buffer). Only the last stage can
// qualify (any other F must send its activation before its B can start), so
// dependencies and deadlock freedom are unchanged. Already fused actions and
// I/W tasks are left alone.
Schedule fuse_forward_backward(const Schedule& s);

}  // namespace baton
