// Rank programs: golden text, the verifier on every generator, mutations
// the verifier must catch (each naming rank and instruction), slots, share
// classes, and the simulator over rank programs against the plan simulator.
#include <gtest/gtest.h>

#include <string>

#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/rank_program.h"
#include "baton/render.h"
#include "baton/sim.h"
#include "baton/verify.h"
#include "test_golden_util.h"

namespace baton {
namespace {

void expect_golden(const std::string& name, const std::string& text) {
  testing::expect_golden(name, text, "rank IR text");
}

RankIR ir_of(const Schedule& s, const std::vector<SkipEdge>& skips = {}) {
  return build_rank_ir(lower(s, skips));
}

// Moves instruction `from` of rank r to position `to` (before the
// instruction now at `to`) and updates the back-references, as an editing
// pass would: the verifier must then judge the order alone.
void move_instr(RankProgram& p, int from, int to) {
  const RankInstr in = p.instrs[from];
  p.instrs.erase(p.instrs.begin() + from);
  p.instrs.insert(p.instrs.begin() + (to > from ? to - 1 : to), in);
  for (int i = 0; i < static_cast<int>(p.instrs.size()); ++i) {
    const RankInstr& x = p.instrs[i];
    if (x.op == RankOp::Run) p.units[x.unit].instr = i;
    if (x.op == RankOp::Post) p.groups[x.group].post = i;
    if (x.op == RankOp::Wait) p.transfers[x.transfer].wait = i;
  }
}

// The index of the rank's buffer with `key`, -1 when it has none.
int find_buffer(const RankProgram& p, const BufferKey& key) {
  for (int b = 0; b < static_cast<int>(p.buffers.size()); ++b)
    if (p.buffers[b].key == key) return b;
  return -1;
}

int find_instr(const RankProgram& p, RankOp op, int after = 0) {
  for (int i = after; i < static_cast<int>(p.instrs.size()); ++i)
    if (p.instrs[i].op == op) return i;
  return -1;
}

std::string report(const RankIR& ir) { return verify_rank_ir(ir).to_string(); }

TEST(RankIR, Golden1F1B) {
  const RankIR ir = ir_of(one_f_one_b(4, 8));
  expect_golden("rank_ir_1f1b_p4_m8.txt", ir.to_text());
}

TEST(RankIR, GoldenZBV) {
  const RankIR ir = ir_of(zb_v(2, 4));
  expect_golden("rank_ir_zbv_p2_m4.txt", ir.to_text());
}

TEST(RankIR, EveryGeneratorVerifiesAndSimulatesAsThePlan) {
  CostModel costs = CostModel::uniform(1.0, 2.0, 1.0, 1.0);
  costs.default_stage.act_bytes = 3;
  costs.default_stage.grad_bytes = 5;
  costs.default_stage.stash_bytes = 7;
  costs.default_stage.wstash_bytes = 2;
  costs.default_stage.wgrad_bytes = 11;
  costs.link.latency = 0.25;
  costs.link.bandwidth = 8;
  int checked = 0;
  for (const std::string& name : schedule_names()) {
    for (int p : {1, 2, 3, 4}) {
      for (int m : {1, 4, 8}) {
        Schedule s;
        try {
          s = make_schedule(name, p, m, name == "interleaved" ? 2 : 1);
        } catch (const ScheduleError&) {
          continue;  // a combination the generator refuses
        }
        for (const Schedule& sched : {s, fuse_forward_backward(s)}) {
          SCOPED_TRACE(name + " p" + std::to_string(p) + " m" + std::to_string(m));
          const RankIR ir = ir_of(sched);
          EXPECT_TRUE(verify_rank_ir(ir).ok()) << report(ir);
          const SimResult a = simulate(ir.plan, costs);
          const SimResult b = simulate(ir, costs);
          EXPECT_DOUBLE_EQ(a.step_time, b.step_time);
          ASSERT_EQ(a.runs.size(), b.runs.size());
          for (size_t k = 0; k < a.runs.size(); ++k) {
            EXPECT_EQ(a.runs[k].rank, b.runs[k].rank);
            EXPECT_EQ(a.runs[k].action, b.runs[k].action);
            EXPECT_DOUBLE_EQ(a.runs[k].start, b.runs[k].start);
            EXPECT_DOUBLE_EQ(a.runs[k].end, b.runs[k].end);
          }
          EXPECT_EQ(a.transfers.size(), b.transfers.size());
          EXPECT_EQ(a.peak_total, b.peak_total);
          EXPECT_EQ(a.peak_activation, b.peak_activation);
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(RankIR, PicturesDrawTheRankPrograms) {
  const RankIR ir = ir_of(zb_v(2, 4));
  const SimResult r = simulate(ir, CostModel::uniform(1, 2, 1, 1));
  const std::string svg = to_svg(ir.plan, r);
  size_t rects = 0;
  for (size_t at = svg.find("<rect class=\"action"); at != std::string::npos;
       at = svg.find("<rect class=\"action", at + 1))
    ++rects;
  EXPECT_EQ(rects, r.runs.size());
  size_t units = 0;
  for (const RankProgram& p : ir.programs) units += p.units.size();
  EXPECT_EQ(r.runs.size(), units);
  EXPECT_NE(to_chrome_trace(ir.plan, r).find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(summary_table(ir.plan, r, nullptr).find("zbv"), std::string::npos);
}

TEST(RankIR, SkipEdgesVerify) {
  const Schedule s = one_f_one_b(4, 4);
  const RankIR ir = ir_of(s, {SkipEdge{0, 2, true, true}, SkipEdge{1, 3, true, false}});
  EXPECT_TRUE(verify_rank_ir(ir).ok()) << report(ir);
  const SimResult a = simulate(ir.plan, CostModel::uniform(1, 2, 1, 1));
  const SimResult b = simulate(ir, CostModel::uniform(1, 2, 1, 1));
  EXPECT_DOUBLE_EQ(a.step_time, b.step_time);
}

TEST(RankIR, ReceivesArePostedWhereThePlanPostsThemAndWaitedAtFirstUse) {
  const RankIR ir = ir_of(one_f_one_b(2, 3));
  const RankProgram& p = ir.programs[1];
  // Rank 1 (the last stage: F1.0 B1.0 F1.1 ...): the receive of act(s0,m1),
  // which the plan places before F1.1, is posted before B1.0 (the RUN that
  // precedes the plan's RECV) and waited on just before F1.1.
  ASSERT_EQ(p.instrs[0].op, RankOp::Post);
  EXPECT_EQ(ir.describe(1, 0), "rank 1 #0 POST g0: RECV act(s0,m0)<-0");
  EXPECT_EQ(ir.describe(1, 1), "rank 1 #1 WAIT act(s0,m0)<-0");
  EXPECT_EQ(ir.describe(1, 2), "rank 1 #2 RUN F1.0");
  EXPECT_EQ(ir.describe(1, 3), "rank 1 #3 FREE act(s0,m0)");
  EXPECT_EQ(ir.describe(1, 4), "rank 1 #4 POST g1: RECV act(s0,m1)<-0");
  EXPECT_EQ(ir.describe(1, 5), "rank 1 #5 RUN B1.0");
  EXPECT_EQ(ir.describe(1, 9), "rank 1 #9 POST g2: SEND grad(s1,m0)->0");
  EXPECT_EQ(ir.describe(1, 11), "rank 1 #11 WAIT act(s0,m1)<-0");
  EXPECT_EQ(ir.describe(1, 12), "rank 1 #12 RUN F1.1");
  for (const Transfer& t : p.transfers) {
    if (t.dir != TransferDir::Recv) continue;
    EXPECT_LT(p.groups[t.group].post, t.wait);
    EXPECT_EQ(p.instrs[t.wait + 1].op, RankOp::Run);
  }
}

TEST(RankIR, UnitsNameTheirBuffersExplicitly) {
  const RankIR ir = ir_of(one_f_one_b(3, 2));
  const RankProgram& p = ir.programs[1];
  const Unit& f = p.units[0];  // F1.0: reads act(s0,m0), writes act(s1,m0), stash(s1,m0)
  ASSERT_EQ(f.reads.size(), 1u);
  EXPECT_EQ(p.buffers[f.reads[0]].key, (BufferKey{BufKind::Act, 0, 0}));
  ASSERT_EQ(f.writes.size(), 2u);
  EXPECT_EQ(p.buffers[f.writes[0]].key, (BufferKey{BufKind::Act, 1, 0}));
  EXPECT_EQ(p.buffers[f.writes[1]].key, (BufferKey{BufKind::Stash, 1, 0}));
}

TEST(RankIR, SlotsAreTheLivePeakAndPoolsCanBeShared) {
  const Plan plan = lower(one_f_one_b(4, 8));
  const RankIR ir = build_rank_ir(plan);
  // Rank 0 keeps p = 4 stashes live in 1F1B; its stash pool has 4 slots.
  const RankProgram& p0 = ir.programs[0];
  int stash_pool = -1;
  for (const RankBuffer& b : p0.buffers)
    if (b.key.kind == BufKind::Stash) stash_pool = b.pool;
  ASSERT_GE(stash_pool, 0);
  EXPECT_EQ(p0.pools[stash_pool].slots, 4);
  // One pool for every row: no fewer slots than the largest pool alone, no
  // more than the sum; still verified.
  RankIROptions opts;
  opts.pool_of.assign(plan.num_buffer_ids() / 8, 0);
  const RankIR one = build_rank_ir(plan, opts);
  EXPECT_TRUE(verify_rank_ir(one).ok());
  ASSERT_EQ(one.programs[0].pools.size(), 1u);
  int sum = 0;
  for (const Pool& q : p0.pools) sum += q.slots;
  EXPECT_GE(one.programs[0].pools[0].slots, 4);
  EXPECT_LE(one.programs[0].pools[0].slots, sum);
  opts.pool_of.pop_back();
  EXPECT_THROW(build_rank_ir(plan, opts), ConfigError);
}

TEST(RankIR, BuffersAreHeldFromWhereTheProgramPutsThemToTheirLastRead) {
  const RankIR ir = build_rank_ir(lower(one_f_one_b(4, 8)));
  const RankProgram& p1 = ir.programs[1];
  for (const Transfer& t : p1.transfers) {
    const RankBuffer& b = p1.buffers[t.buffer];
    if (t.dir == TransferDir::Recv) {
      // A receive lands in its slot at its WAIT, not at its POST.
      EXPECT_EQ(b.held_from, t.wait);
      EXPECT_GT(b.held_from, p1.groups[t.group].post);
    } else {
      // A sent buffer is held until the POST that sends it.
      EXPECT_EQ(b.held_to, p1.groups[t.group].post);
    }
  }
  // Rank 1 posts two receives from rank 0 ahead, but holds one at a time:
  // one slot for act(s0), where the plan's lifetimes (to the FREE) need two.
  for (const RankBuffer& b : p1.buffers) {
    if (b.key.kind == BufKind::WGrad) {
      EXPECT_EQ(b.pool, -1) << "a weight gradient is added where it is made";
    } else if (b.key.kind == BufKind::Act && b.key.stage == 0) {
      EXPECT_EQ(p1.pools[b.pool].slots, 1);
    }
  }
}

TEST(RankIR, ShareClasses) {
  // Middle ranks of 1F1B run the same units and transfers (peers and stages
  // relative to the rank); the first and last rank differ.
  EXPECT_EQ(ir_of(one_f_one_b(4, 8)).share_classes,
            (std::vector<std::vector<int32_t>>{{0}, {1, 2}, {3}}));
  EXPECT_EQ(ir_of(one_f_one_b(2, 4)).share_classes, (std::vector<std::vector<int32_t>>{{0}, {1}}));
  EXPECT_EQ(ir_of(zb_h1(5, 8)).share_classes,
            (std::vector<std::vector<int32_t>>{{0}, {1, 2, 3}, {4}}));
  EXPECT_EQ(ir_of(gpipe(1, 4)).share_classes, (std::vector<std::vector<int32_t>>{{0}}));
  const RankIR ir = ir_of(one_f_one_b(4, 8));
  for (const RankProgram& p : ir.programs)
    EXPECT_EQ(ir.share_classes[p.share_class].front() <= p.rank, true);
}

TEST(RankIR, RefusesAnUnverifiedPlan) {
  Plan plan = lower(one_f_one_b(2, 2));
  plan.programs[1].erase(plan.programs[1].begin());  // drop rank 1's first RECV
  EXPECT_THROW(build_rank_ir(plan), VerifyError);
}

// ---- mutations: each is caught, naming rank and instruction ----

TEST(RankIRMutation, WaitMovedBeforeItsPost) {
  RankIR ir = ir_of(one_f_one_b(4, 8));
  RankProgram& p = ir.programs[2];
  const int post = find_instr(p, RankOp::Post);
  const int wait = find_instr(p, RankOp::Wait);
  ASSERT_LT(post, wait);
  move_instr(p, wait, post);
  const std::string rep = report(ir);
  EXPECT_NE(rep.find("post/wait: rank 2 #0 WAIT act(s1,m0)<-1 waits before its receive is "
                     "posted (at #1)"),
            std::string::npos)
      << rep;
}

TEST(RankIRMutation, WaitMovedAfterTheRunThatReadsIt) {
  RankIR ir = ir_of(one_f_one_b(4, 8));
  RankProgram& p = ir.programs[1];
  const int wait = find_instr(p, RankOp::Wait);
  const int run = find_instr(p, RankOp::Run, wait);
  move_instr(p, wait, run + 1);
  const std::string rep = report(ir);
  const std::string want = "data: rank 1 #" + std::to_string(run - 1) +
                           " RUN F1.0 reads act(s0,m0), which is not present: its receive is "
                           "waited on only later, at #" +
                           std::to_string(run);
  EXPECT_NE(rep.find(want), std::string::npos) << rep;
}

TEST(RankIRMutation, SlotReusedWhileLive) {
  RankIR ir = ir_of(one_f_one_b(4, 8));
  RankProgram& p = ir.programs[0];
  // stash(s0,m1) is created while stash(s0,m0) is live: give it m0's slot.
  const int m0 = find_buffer(p, {BufKind::Stash, 0, 0});
  const int m1 = find_buffer(p, {BufKind::Stash, 0, 1});
  ASSERT_GE(m0, 0);
  ASSERT_GE(m1, 0);
  ASSERT_NE(p.buffers[m0].slot, p.buffers[m1].slot);
  p.buffers[m1].slot = p.buffers[m0].slot;
  const int at = p.buffers[m1].live_from;
  const std::string rep = report(ir);
  const std::string want = "slots: rank 0 #" + std::to_string(at) +
                           " RUN F0.1 puts stash(s0,m1) into slot p" +
                           std::to_string(p.buffers[m0].pool) + "." +
                           std::to_string(p.buffers[m0].slot) + ", which still holds stash(s0,m0)";
  EXPECT_NE(rep.find(want), std::string::npos) << rep;
}

TEST(RankIRMutation, HeldRangeMisstatedOrNoSlot) {
  RankIR ir = ir_of(one_f_one_b(4, 8));
  RankProgram& p = ir.programs[0];
  const int m0 = find_buffer(p, {BufKind::Stash, 0, 0});
  const int m1 = find_buffer(p, {BufKind::Stash, 0, 1});
  ASSERT_GE(m0, 0);
  ASSERT_GE(m1, 0);
  const int put = p.buffers[m0].held_from, last = p.buffers[m0].held_to;
  p.buffers[m0].held_to = put;  // says it is free before B0.0 reads it
  p.buffers[m1].pool = -1;      // read by B0.1 but given no slot
  const std::string rep = report(ir);
  EXPECT_NE(rep.find("slots: rank 0: stash(s0,m0) records that it is held from #" +
                     std::to_string(put) + " to #" + std::to_string(put) +
                     ", but the instructions put it into its slot at #" + std::to_string(put) +
                     " and last read it at #" + std::to_string(last)),
            std::string::npos)
      << rep;
  EXPECT_NE(rep.find("slots: rank 0 #" + std::to_string(p.buffers[m1].held_from) +
                     " RUN F0.1 puts stash(s0,m1) into no slot, but #" +
                     std::to_string(p.buffers[m1].held_to) + " reads it"),
            std::string::npos)
      << rep;
}

TEST(RankIRMutation, SwappedChannel) {
  RankIR ir = ir_of(one_f_one_b(4, 8));
  RankProgram& p = ir.programs[1];
  // Rank 1's first receive (act from rank 0, channel 0) now says the grad
  // channel.
  Transfer& t = p.transfers[p.groups[0].transfers[0]];
  ASSERT_EQ(t.dir, TransferDir::Recv);
  ASSERT_EQ(t.channel, static_cast<int>(BufKind::Act));
  t.channel = static_cast<int>(BufKind::Grad);
  const std::string rep = report(ir);
  EXPECT_NE(rep.find("channels: rank 1 #0 POST g0: RECV act(s0,m0)<-0 travels on channel 1, but "
                     "the plan's channel of the buffer is 0"),
            std::string::npos)
      << rep;
  EXPECT_NE(rep.find("channels: rank 1 #0 POST g0: RECV act(s0,m0)<-0 arrives on channel 1, but "
                     "rank 0 #1 POST g0: SEND act(s0,m0)->1 sends it on channel 0"),
            std::string::npos)
      << rep;
}

TEST(RankIRMutation, MissingPost) {
  RankIR ir = ir_of(one_f_one_b(4, 8));
  RankProgram& p = ir.programs[3];
  // Drop the first receive from its group: it is never posted.
  TransferGroup& g = p.groups[0];
  const int32_t t = g.transfers.front();
  g.transfers.erase(g.transfers.begin());
  const int wait = p.transfers[t].wait;
  const std::string rep = report(ir);
  EXPECT_NE(rep.find("post/wait: rank 3 #" + std::to_string(wait) +
                     " WAIT act(s2,m0)<-2 waits for a receive that no POST posts"),
            std::string::npos)
      << rep;
  // The sender's messages then meet the wrong receives.
  EXPECT_NE(
      rep.find("channels: head-of-line mismatch on channel 0 from rank 2 to rank 3: message 1 "
               "is act(s2,m0) (rank 2 #"),
      std::string::npos)
      << rep;
}

TEST(RankIRMutation, ReceivesWaitedOutOfPostOrder) {
  RankIR ir = ir_of(one_f_one_b(4, 8));
  RankProgram& p = ir.programs[1];
  // Swap which receive the first two WAITs take (both of g0).
  const int w0 = find_instr(p, RankOp::Wait);
  const int w1 = find_instr(p, RankOp::Wait, w0 + 1);
  std::swap(p.instrs[w0].transfer, p.instrs[w1].transfer);
  std::swap(p.transfers[p.instrs[w0].transfer].wait, p.transfers[p.instrs[w1].transfer].wait);
  const std::string rep = report(ir);
  EXPECT_NE(rep.find("post/wait: rank 1 #" + std::to_string(w0) +
                     " WAIT act(s0,m1)<-0 waits for "
                     "receive 2 on channel 0 from rank 0, but receive 1 is not yet waited on"),
            std::string::npos)
      << rep;
}

TEST(RankIRMutation, DeadlockIsNamed) {
  // Two ranks whose first instructions wait on each other: rank 1's first
  // group (receives of act m0, m1) is posted only after a WAIT that needs
  // rank 0's gradient, which rank 0 sends only after receiving... Built by
  // moving rank 0's first POST of sends to its end.
  RankIR ir = ir_of(one_f_one_b(2, 2));
  RankProgram& p = ir.programs[0];
  const int post = find_instr(p, RankOp::Post);
  move_instr(p, post, static_cast<int>(p.instrs.size()));
  const std::string rep = report(ir);
  EXPECT_NE(rep.find("rank 0 #"), std::string::npos) << rep;
  EXPECT_FALSE(verify_rank_ir(ir).ok());
}

}  // namespace
}  // namespace baton
