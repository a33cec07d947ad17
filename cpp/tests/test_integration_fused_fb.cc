// fuse_forward_backward: last-stage F(s,m)+B(s,m) pairs fused into one
// action; the plan verifies, the simulator times the pair with `fb` and keeps
// no stash buffer for it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "baton/cost.h"
#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/sim.h"
#include "baton/verify.h"

namespace baton {
namespace {

int fused_count(const Schedule& s, int rank) {
  int n = 0;
  for (const Action& a : s.rank_actions[rank]) n += a.is_fused();
  return n;
}

SimResult checked(const Schedule& s, const CostModel& c) {
  const Plan plan = lower(s);
  EXPECT_TRUE(verify(plan).ok()) << verify(plan).to_string();
  for (CommModel m : {CommModel::Blocking, CommModel::Fifo})
    EXPECT_TRUE(check_deadlock(plan, m).ok());
  return simulate(plan, c);
}

TEST(FusedForwardBackward, OneRankOneF1BFusesEveryMicrobatch) {
  const Schedule s = one_f_one_b(1, 4);
  const Schedule f = fuse_forward_backward(s);
  ASSERT_EQ(f.rank_actions[0].size(), 4u);
  EXPECT_EQ(fused_count(f, 0), 4);
  EXPECT_EQ(to_string(f.rank_actions[0][2]), "F0.2+B0.2");
  EXPECT_NO_THROW(f.validate());
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.default_stage.stash_bytes = 100;
  const SimResult plain = checked(s, c);
  SimResult fused = checked(f, c);
  // fb unset: fused_factor * (f + b), the same step; the stash is internal.
  EXPECT_DOUBLE_EQ(fused.step_time, plain.step_time);
  EXPECT_EQ(plain.peak_activation[0], 100);
  EXPECT_EQ(fused.peak_activation[0], 0);
  c.default_stage.fb = 2.5;
  fused = checked(f, c);
  EXPECT_DOUBLE_EQ(fused.step_time, 4 * 2.5);
}

TEST(FusedForwardBackward, OnlyTheLastStageOfAPipeline) {
  const Schedule s = one_f_one_b(4, 8);
  const Schedule f = fuse_forward_backward(s);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(f.rank_actions[r], s.rank_actions[r]) << r;
  EXPECT_EQ(fused_count(f, 3), 8);
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.default_stage.stash_bytes = 10;
  const SimResult plain = checked(s, c);
  const SimResult fused = checked(f, c);
  EXPECT_DOUBLE_EQ(fused.step_time, plain.step_time);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(fused.peak_activation[r], plain.peak_activation[r]);
  EXPECT_EQ(plain.peak_activation[3], 10);
  EXPECT_EQ(fused.peak_activation[3], 0);
  // A faster fused pair shortens the step.
  c.stages.assign(4, c.default_stage);
  c.stages[3].fb = 2.0;
  EXPECT_LT(checked(f, c).step_time, plain.step_time);
}

TEST(FusedForwardBackward, OnlyAdjacentPairsAndSplitBackwardIsKept) {
  // GPipe runs the backwards in microbatch order: F1.3 is followed by B1.0.
  EXPECT_EQ(fuse_forward_backward(gpipe(2, 4)), gpipe(2, 4));
  const Schedule g = fuse_forward_backward(gpipe(2, 1));
  EXPECT_EQ(fused_count(g, 0), 0);
  EXPECT_EQ(fused_count(g, 1), 1);  // F1.0+B1.0
  checked(g, CostModel::uniform(1, 2, 1, 1));
  for (const Schedule& s : {zb_h1(2, 4), zb_v(2, 4), dualpipe_v(2, 4)}) {
    EXPECT_EQ(fuse_forward_backward(s), s) << s.name;
  }
  // Idempotent.
  EXPECT_EQ(fuse_forward_backward(g), g);
}

TEST(FusedForwardBackward, CostJsonRoundTripsFb) {
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.default_stage.fb = 2.75;
  const CostModel back = CostModel::from_json(c.to_json());
  EXPECT_DOUBLE_EQ(back.default_stage.fb, 2.75);
  c.default_stage.fb = -1;
  EXPECT_THROW(c.validate(), ConfigError);
}

}  // namespace
}  // namespace baton
