// build_step (build.h): one step's plan and rank programs, each pass once.
#include <fmt/format.h>

#include <algorithm>

#include "baton/build.h"
#include "baton/error.h"
#include "baton/generators.h"
#include "baton/verify.h"

namespace baton {

StepBuild build_step(const Schedule& schedule, const std::vector<SkipEdge>& skips,
                     const StepOptions& options) {
  const bool fuse = options.fuse_forward_backward && !schedule.split_backward();
  StepBuild out;
  Plan plan = lower(fuse ? fuse_forward_backward(schedule) : schedule, skips);
  out.report = verify(plan);
  if (!out.report.ok()) throw VerifyError(out.report.to_string());
  RankIROptions ro;
  ro.offload = options.offload;
  ro.fetch_lookahead = options.fetch_lookahead;
  ro.pool_of = options.pool_of;
  out.rank_ir = build_rank_ir_of_verified(plan, ro);
  return out;
}

RankIR with_pools(const RankIR& ir, const std::vector<int32_t>& pool_of) {
  build_counters().with_pools.fetch_add(1, std::memory_order_relaxed);
  const Plan& plan = ir.plan;
  const int32_t rows = plan.num_buffer_ids() / std::max(1, plan.schedule.num_microbatches);
  if (!pool_of.empty() && static_cast<int32_t>(pool_of.size()) != rows)
    throw ConfigError(
        fmt::format("pool_of has {} entries; the plan has {} buffer rows", pool_of.size(), rows));
  RankIR out = ir;
  RankIROptions ro;
  ro.pool_of = pool_of;
  for (RankProgram& prog : out.programs) assign_slots(out.plan, prog, ro);
  verify_rank_ir_or_throw(out);
  return out;
}

BuildCounts build_counts() {
  const BuildCounters& c = build_counters();
  BuildCounts out;
  out.lower = c.lower.load(std::memory_order_relaxed);
  out.verify = c.verify.load(std::memory_order_relaxed);
  out.rank_ir = c.rank_ir.load(std::memory_order_relaxed);
  out.with_pools = c.with_pools.load(std::memory_order_relaxed);
  return out;
}

}  // namespace baton
