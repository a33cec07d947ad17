// Skip edges: direct transfers between non-neighbouring stages (plan.h Skip /
// SkipGrad) lowered, verified and simulated for every schedule family.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "baton/cost.h"
#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/sim.h"
#include "baton/verify.h"

namespace baton {
namespace {

int count_ops(const Plan& p, int rank, OpCode op, BufKind kind) {
  int n = 0;
  for (const Instr& in : p.programs[rank])
    if (in.op == op && in.buffer >= 0 && p.buffer_key(in.buffer).kind == kind) ++n;
  return n;
}

TEST(PlanSkips, IdsRoundTripAndNames) {
  const std::vector<SkipEdge> skips{{0, 2}, {0, 3}, {1, 3}};
  const Plan p = lower(one_f_one_b(4, 3), skips);
  EXPECT_EQ(p.num_buffer_ids(), (5 * 4 + 2 * 3) * 3);
  std::set<int32_t> seen;
  for (int32_t id = 0; id < p.num_buffer_ids(); ++id) {
    const BufferKey k = p.buffer_key(id);
    EXPECT_EQ(p.buffer_id(k), id);
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(p.num_buffer_ids()));
  const int32_t skip = p.buffer_id({BufKind::Skip, 1, 2});
  const int32_t grad = p.buffer_id({BufKind::SkipGrad, 2, 0});
  EXPECT_EQ(p.describe_buffer(skip), "skip(s0->s3,m2)");
  EXPECT_EQ(p.describe_buffer(grad), "skipgrad(s3->s1,m0)");
  EXPECT_EQ(p.producer_rank(skip), 0);
  EXPECT_EQ(p.consumer_rank(skip), 3);
  EXPECT_EQ(p.producer_rank(grad), 3);
  EXPECT_EQ(p.consumer_rank(grad), 1);
  // channels: kinds 0..4, then one per edge and direction
  EXPECT_EQ(p.num_channels(), 11);
  EXPECT_EQ(p.channel(p.buffer_id({BufKind::Grad, 2, 1})), 1);
  EXPECT_EQ(p.channel(skip), 6);
  EXPECT_EQ(p.channel(grad), 10);
  EXPECT_THROW(p.buffer_id({BufKind::Skip, 3, 0}), ScheduleError);
  EXPECT_NE(p.fingerprint(), lower(one_f_one_b(4, 3)).fingerprint());
  EXPECT_NE(p.to_text().find("skips: s0->s2 s0->s3 s1->s3"), std::string::npos);
}

TEST(PlanSkips, TasksReadAndWriteTheirEdges) {
  const Plan p = lower(zb_h1(4, 2), {{0, 2}, {0, 3}});
  auto id = [&](BufKind k, int s, int m) { return p.buffer_id({k, s, m}); };
  using V = std::vector<int32_t>;
  EXPECT_EQ(p.task_outputs({TaskKind::F, 0, 1}),
            (V{id(BufKind::Act, 0, 1), id(BufKind::Skip, 0, 1), id(BufKind::Skip, 1, 1),
               id(BufKind::Stash, 0, 1)}));
  EXPECT_EQ(p.task_inputs({TaskKind::F, 3, 0}),
            (V{id(BufKind::Act, 2, 0), id(BufKind::Skip, 1, 0)}));
  EXPECT_EQ(p.task_outputs({TaskKind::I, 3, 0}),
            (V{id(BufKind::Grad, 3, 0), id(BufKind::SkipGrad, 1, 0), id(BufKind::WStash, 3, 0)}));
  EXPECT_EQ(p.task_inputs({TaskKind::I, 0, 1}),
            (V{id(BufKind::Stash, 0, 1), id(BufKind::Grad, 1, 1), id(BufKind::SkipGrad, 0, 1),
               id(BufKind::SkipGrad, 1, 1)}));
  EXPECT_EQ(p.task_inputs({TaskKind::W, 0, 1}), V{id(BufKind::WStash, 0, 1)});
}

TEST(PlanSkips, SentStraightBetweenTheTwoRanks) {
  const Plan p = lower(one_f_one_b(4, 4), {{0, 3}});
  // rank 0 sends each microbatch's skip to rank 3 and receives its gradient
  // from there; ranks 1 and 2 never see it
  EXPECT_EQ(count_ops(p, 0, OpCode::Send, BufKind::Skip), 4);
  EXPECT_EQ(count_ops(p, 3, OpCode::Recv, BufKind::Skip), 4);
  EXPECT_EQ(count_ops(p, 3, OpCode::Send, BufKind::SkipGrad), 4);
  EXPECT_EQ(count_ops(p, 0, OpCode::Recv, BufKind::SkipGrad), 4);
  for (int r : {1, 2}) {
    EXPECT_EQ(count_ops(p, r, OpCode::Send, BufKind::Skip), 0);
    EXPECT_EQ(count_ops(p, r, OpCode::Recv, BufKind::Skip), 0);
  }
  for (const Instr& in : p.programs[0]) {
    if (in.op == OpCode::Send && p.buffer_key(in.buffer).kind == BufKind::Skip) {
      EXPECT_EQ(in.peer, 3);
    }
  }
  EXPECT_TRUE(verify(p).ok()) << verify(p).to_string();
}

TEST(PlanSkips, ForwardOnlyEdgeHasNoGradientBuffers) {
  const Plan p = lower(zb_h2(4, 4), {{0, 3, true, false}});
  EXPECT_EQ(count_ops(p, 0, OpCode::Send, BufKind::Skip), 4);
  EXPECT_EQ(count_ops(p, 3, OpCode::Send, BufKind::SkipGrad), 0);
  EXPECT_EQ(count_ops(p, 0, OpCode::Recv, BufKind::SkipGrad), 0);
  for (int r = 0; r < 4; ++r) {
    for (const Instr& in : p.programs[r]) {
      if (in.buffer >= 0) {
        EXPECT_NE(p.buffer_key(in.buffer).kind, BufKind::SkipGrad);
      }
    }
  }
  EXPECT_TRUE(verify(p).ok()) << verify(p).to_string();
  EXPECT_NE(p.fingerprint(), lower(zb_h2(4, 4), {{0, 3}}).fingerprint());
  EXPECT_THROW(lower(zb_h2(4, 4), {{0, 3, false, false}}), ScheduleError);
}

TEST(PlanSkips, SameRankIsALocalHandOff) {
  // ZB-V on 2 ranks: stages 0 and 3 are on rank 0
  const Plan p = lower(zb_v(2, 4), {{0, 2}, {0, 3}});
  ASSERT_EQ(p.schedule.stage_rank[0], p.schedule.stage_rank[3]);
  const int r0 = p.schedule.stage_rank[0];
  int sends_to_self_stage = 0;
  for (const Instr& in : p.programs[r0])
    if ((in.op == OpCode::Send || in.op == OpCode::Recv) &&
        p.buffer_key(in.buffer).kind != BufKind::Act &&
        p.buffer_key(in.buffer).kind != BufKind::Grad) {
      const BufferKey k = p.buffer_key(in.buffer);
      if (p.skips[k.stage].to == 3) ++sends_to_self_stage;
    }
  EXPECT_EQ(sends_to_self_stage, 0);
  // the 0 -> 2 edge crosses ranks
  EXPECT_EQ(count_ops(p, r0, OpCode::Send, BufKind::Skip), 4);
  EXPECT_TRUE(verify(p).ok()) << verify(p).to_string();
}

TEST(PlanSkips, EveryFamilyVerifiesAndSimulates) {
  struct Case {
    std::string name;
    int ranks, v;
  };
  const Case cases[] = {{"gpipe", 4, 1},        {"1f1b", 4, 1},        {"eager1f1b", 4, 1},
                        {"zbh1", 4, 1},         {"zbh2", 4, 1},        {"interleaved", 2, 2},
                        {"interleaved", 2, 3},  {"zbv", 2, 1},         {"dualpipev", 2, 1}};
  for (const Case& c : cases) {
    const Schedule s = make_schedule(c.name, c.ranks, 6, c.v);
    const int S = s.num_stages;
    // every pair of non-neighbouring stages: several edges share a rank pair
    std::vector<SkipEdge> skips;
    for (int i = 0; i < S; ++i)
      for (int j = i + 2; j < S; ++j) skips.push_back({i, j});
    const Plan p = lower(s, skips);
    const VerifyReport rep = verify(p);
    EXPECT_TRUE(rep.ok()) << c.name << " v" << c.v << ": " << rep.to_string();
    CostModel cm = CostModel::uniform(1, 2, 1, 1);
    for (const SkipEdge& e : skips) cm.skips.push_back({e.from, e.to, 1000, 500});
    const SimResult r = simulate(p, cm);
    int64_t skip_bytes = 0;
    for (const TransferEvent& t : r.transfers) {
      const BufKind k = p.buffer_key(t.buffer).kind;
      if (k == BufKind::Skip) {
        EXPECT_EQ(t.bytes, 1000);
        skip_bytes += t.bytes;
      } else if (k == BufKind::SkipGrad) {
        EXPECT_EQ(t.bytes, 500);
      }
    }
    int crossing = 0;
    for (const SkipEdge& e : skips)
      crossing += s.stage_rank[e.from] != s.stage_rank[e.to];
    EXPECT_EQ(skip_bytes, int64_t{1000} * crossing * 6) << c.name;
  }
}

TEST(PlanSkips, ReceivedSkipsCountInMemory) {
  // 1F1B on 4 ranks: rank 3 holds the received skip of a microbatch until F3
  // runs; with a huge skip its peak grows by at least one of them.
  const Schedule s = one_f_one_b(4, 4);
  CostModel cm = CostModel::uniform(1, 2, 1, 1);
  const SimResult base = simulate(lower(s), cm);
  cm.skips.push_back({0, 3, 1 << 20, 0});
  const SimResult with = simulate(lower(s, {{0, 3}}), cm);
  EXPECT_GE(with.peak_total[3] - base.peak_total[3], 1 << 20);
  EXPECT_GE(with.peak_total[0] - base.peak_total[0], 0);
}

TEST(PlanSkips, BadEdgesAreNamed) {
  const Schedule s = one_f_one_b(4, 2);
  try {
    lower(s, {{0, 1}});
    FAIL();
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("skip edge 0 (stage 0 -> stage 1)"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(lower(s, {{0, 4}}), ScheduleError);
  EXPECT_THROW(lower(s, {{1, 3}, {0, 2}}), ScheduleError);
  EXPECT_THROW(lower(s, {{0, 2}, {0, 2}}), ScheduleError);
}

TEST(PlanSkips, CostJsonRoundTrip) {
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.skips.push_back({0, 3, 4096, 2048});
  const CostModel back = CostModel::from_json(c.to_json());
  EXPECT_EQ(back, c);
  EXPECT_THROW(CostModel::from_json(R"({"skips": [{"from": 0, "too": 2}]})"), FormatError);
  EXPECT_THROW(CostModel::from_json(R"({"skips": [{"from": 0, "to": 2, "act_bytes": -1}]})"),
               ConfigError);
}

}  // namespace
}  // namespace baton
