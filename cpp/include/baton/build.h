// One step's plan, built once: the schedule (fused F+B when asked) lowered
// with the step's skip edges, verified, and its rank programs built (offloads,
// slots, share classes), each exactly once. The frontend asks this object its
// questions instead of lowering, verifying or building rank programs again.
#pragma once

#include <cstdint>
#include <vector>

#include "baton/plan.h"
#include "baton/rank_program.h"
#include "baton/schedule.h"
#include "baton/verify.h"

namespace baton {

struct StepOptions {
  // Fuse F(s,m)+B(s,m) into one action where adjacent (fuse_forward_backward;
  // ignored for schedules that split the backward into I and W).
  bool fuse_forward_backward = false;
  // Rank-program options (RankIROptions): per stage what it offloads, how far
  // ahead a fetch runs, and pool labels of plan rows (empty: one per row).
  std::vector<Offload> offload;
  int32_t fetch_lookahead = 1;
  std::vector<int32_t> pool_of;
};

struct StepBuild {
  VerifyReport report;  // the verifier's report on the plan (ok; else build_step throws)
  RankIR rank_ir;       // its rank programs; rank_ir.plan is the lowered plan
  const Plan& plan() const { return rank_ir.plan; }
};

// schedule -> (fuse) -> lower(schedule, skips) -> verify -> rank IR. Throws
// VerifyError with the report's text when the plan fails verification,
// ScheduleError for an invalid schedule or skip edge, ConfigError for invalid
// options. Calls lower, verify and the rank-IR passes once each.
StepBuild build_step(const Schedule& schedule, const std::vector<SkipEdge>& skips = {},
                     const StepOptions& options = {});

// `ir` with its slots given again with pool labels `pool_of` (RankIROptions::
// pool_of; rows of one label share slots): the slot pass only, on programs
// already built and verified (no lowering, no plan verification), then the
// rank-IR verifier on the result. What the compiled table programs use once
// they know which buffer kinds have equal shapes.
RankIR with_pools(const RankIR& ir, const std::vector<int32_t>& pool_of);

// How often this process has lowered a plan, verified one and built rank
// programs (build_rank_ir / build_step): a check that one step is built once.
struct BuildCounts {
  uint64_t lower = 0, verify = 0, rank_ir = 0, with_pools = 0;
};
BuildCounts build_counts();

}  // namespace baton
