// build_step (build.h): one step's plan, its verification and its rank
// programs, each made once; the same programs lower + build_rank_ir give; a
// failing plan refused with the verifier's report; with_pools as
// build_rank_ir with the same pools.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "baton/build.h"
#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/rank_program.h"
#include "baton/text_format.h"
#include "baton/verify.h"

namespace baton {
namespace {

constexpr const char* kDeadlock =
    "baton-schedule 1\nname custom\nranks 2\nstages 2\nmicrobatches 2\nplacement 0 1\n"
    "rank 0: F0.0 F0.1 B0.0 B0.1\nrank 1: F1.1 B1.1 F1.0 B1.0\n";

struct Delta {
  BuildCounts before = build_counts();
  uint64_t lower() const { return build_counts().lower - before.lower; }
  uint64_t verify() const { return build_counts().verify - before.verify; }
  uint64_t rank_ir() const { return build_counts().rank_ir - before.rank_ir; }
  uint64_t with_pools() const { return build_counts().with_pools - before.with_pools; }
};

TEST(BuildStep, EachPassOnceAndTheSameProgramsAsLowerAndBuildRankIR) {
  const std::vector<SkipEdge> skips{{0, 3}, {1, 3}};
  const Schedule s = zb_h1(4, 8);
  Delta d;
  const StepBuild b = build_step(s, skips);
  EXPECT_EQ(d.lower(), 1u);
  EXPECT_EQ(d.verify(), 1u);
  EXPECT_EQ(d.rank_ir(), 1u);
  EXPECT_TRUE(b.report.ok());
  EXPECT_EQ(b.plan().skips, skips);
  const RankIR want = build_rank_ir(lower(s, skips));
  EXPECT_EQ(b.rank_ir.to_text(), want.to_text());
  EXPECT_EQ(b.plan().fingerprint(), want.plan.fingerprint());
}

TEST(BuildStep, FusesForwardAndBackwardOnlyWhenAskedAndNotSplit) {
  const Schedule s = one_f_one_b(2, 4);
  StepOptions fuse;
  fuse.fuse_forward_backward = true;
  EXPECT_EQ(build_step(s, {}, fuse).plan().schedule, fuse_forward_backward(s));
  EXPECT_NE(fuse_forward_backward(s), s);
  EXPECT_EQ(build_step(s).plan().schedule, s);
  const Schedule split = zb_h1(2, 4);
  EXPECT_EQ(build_step(split, {}, fuse).plan().schedule, split);
}

TEST(BuildStep, OffloadAndPoolsAsBuildRankIR) {
  const Schedule s = one_f_one_b(4, 8);
  StepOptions o;
  o.offload.assign(4, Offload::Stash);
  o.fetch_lookahead = 2;
  RankIROptions ro;
  ro.offload = o.offload;
  ro.fetch_lookahead = 2;
  EXPECT_EQ(build_step(s, {}, o).rank_ir.to_text(), build_rank_ir(lower(s), ro).to_text());
  // with_pools: the slot pass again, as build_rank_ir with the same labels
  const StepBuild b = build_step(s);
  std::vector<int32_t> one(b.plan().num_buffer_ids() / 8, 0);
  Delta d;
  const RankIR pooled = with_pools(b.rank_ir, one);
  EXPECT_EQ(d.with_pools(), 1u);
  EXPECT_EQ(d.lower() + d.verify() + d.rank_ir(), 0u);
  RankIROptions po;
  po.pool_of = one;
  EXPECT_EQ(pooled.to_text(), build_rank_ir(lower(s), po).to_text());
  one.pop_back();
  EXPECT_THROW(with_pools(b.rank_ir, one), ConfigError);
}

TEST(BuildStep, AFailingPlanIsRefusedWithItsReportAndBuildsNoPrograms) {
  const Schedule s = load_schedule(kDeadlock);
  const std::string want = verify(lower(s)).to_string();
  Delta d;
  try {
    (void)build_step(s);
    FAIL() << "a deadlocking plan was built";
  } catch (const VerifyError& e) {
    EXPECT_EQ(std::string(e.what()), want);
  }
  EXPECT_EQ(d.lower(), 1u);
  EXPECT_EQ(d.verify(), 1u);
  EXPECT_EQ(d.rank_ir(), 0u);
}

}  // namespace
}  // namespace baton
