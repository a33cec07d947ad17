// Simulator: exact timings on small hand-checked plans, links, memory,
// critical path, fused actions and the errors for programs that cannot run.
#include <gtest/gtest.h>

#include <string>

#include "baton/cost.h"
#include "baton/error.h"
#include "baton/plan.h"
#include "baton/sim.h"
#include "test_plan_util.h"

namespace baton {
namespace {

using testing::error_of;
using testing::hand_1f1b;

Task T(TaskKind k, int s, int m) { return Task{k, s, m}; }
Action A(TaskKind k, int s, int m) { return Action{T(k, s, m)}; }


// Builds a Plan instruction by instruction (the simulator does not need the
// plan to come from lower()).
struct Builder {
  Plan plan;
  Builder(int ranks, int stages, int mbs) {
    Schedule& s = plan.schedule;
    s.name = "hand";
    s.num_ranks = ranks;
    s.num_stages = stages;
    s.num_microbatches = mbs;
    s.stage_rank.assign(stages, 0);
    for (int k = 0; k < stages; ++k) s.stage_rank[k] = k % ranks;
    s.rank_actions.resize(ranks);
    plan.programs.resize(ranks);
  }
  int id(BufKind k, int s, int m) const {
    const auto& sc = plan.schedule;
    return (static_cast<int>(k) * sc.num_stages + s) * sc.num_microbatches + m;
  }
  Builder& run(int r, Action a) {
    auto& acts = plan.schedule.rank_actions[r];
    acts.push_back(a);
    plan.programs[r].push_back(Instr{OpCode::Run, static_cast<int>(acts.size()) - 1, -1, -1});
    return *this;
  }
  Builder& run(int r, TaskKind k, int s, int m) { return run(r, A(k, s, m)); }
  Builder& op(int r, OpCode op, BufKind k, int s, int m, int peer = -1) {
    plan.programs[r].push_back(Instr{op, -1, id(k, s, m), peer});
    return *this;
  }
  Builder& send(int r, BufKind k, int s, int m, int to) { return op(r, OpCode::Send, k, s, m, to); }
  Builder& recv(int r, BufKind k, int s, int m, int from) {
    return op(r, OpCode::Recv, k, s, m, from);
  }
  Builder& free(int r, BufKind k, int s, int m) { return op(r, OpCode::Free, k, s, m); }
  // ACCUMULATE + FREE of a weight gradient.
  Builder& acc(int r, int s, int m) {
    op(r, OpCode::Accumulate, BufKind::WGrad, s, m);
    return free(r, BufKind::WGrad, s, m);
  }
};


bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// One rank, one stage, GPipe order F F F B B B.
TEST(Sim, SingleRankGpipeTimingAndMemory) {
  Builder b(1, 1, 3);
  for (int m = 0; m < 3; ++m) b.run(0, TaskKind::F, 0, m);
  for (int m = 0; m < 3; ++m)
    b.run(0, TaskKind::B, 0, m).free(0, BufKind::Stash, 0, m).acc(0, 0, m);
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.default_stage.stash_bytes = 10;
  c.default_stage.wgrad_bytes = 5;
  SimResult r = simulate(b.plan, c);
  EXPECT_DOUBLE_EQ(r.step_time, 9);
  ASSERT_EQ(r.runs.size(), 6u);
  const double starts[] = {0, 1, 2, 3, 5, 7};
  for (int k = 0; k < 6; ++k) {
    EXPECT_DOUBLE_EQ(r.runs[k].start, starts[k]) << k;
    EXPECT_EQ(r.runs[k].action, k);
    const Instr& in = b.plan.programs[0].at(r.runs[k].instr);
    EXPECT_EQ(in.op, OpCode::Run);
    EXPECT_EQ(in.action, k);
  }
  EXPECT_DOUBLE_EQ(r.busy[0], 9);
  EXPECT_DOUBLE_EQ(r.bubble[0], 0);
  EXPECT_DOUBLE_EQ(r.bubble_fraction, 0);
  EXPECT_TRUE(r.transfers.empty());
  EXPECT_EQ(r.peak_activation[0], 30);
  EXPECT_EQ(r.peak_total[0], 35);  // 3 stashes + the wgrad of B0
  // Timeline: (time, activation, total).
  const std::vector<MemorySample> want = {{0, 10, 10}, {1, 20, 20}, {2, 30, 30}, {3, 30, 35},
                                          {5, 20, 25}, {7, 10, 15}, {9, 0, 0}};
  ASSERT_EQ(r.memory[0].size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_DOUBLE_EQ(r.memory[0][k].time, want[k].time) << k;
    EXPECT_EQ(r.memory[0][k].activation, want[k].activation) << k;
    EXPECT_EQ(r.memory[0][k].total, want[k].total) << k;
  }
  EXPECT_DOUBLE_EQ(r.span_start[0], 0);
  EXPECT_DOUBLE_EQ(r.span_end[0], 9);
  EXPECT_DOUBLE_EQ(r.idle_inside_span(0), 0);
}

// 2 ranks, 2 stages, one microbatch: F0 -> act -> F1, B1 -> grad -> B0.
Plan two_rank_one_mb() {
  Builder b(2, 2, 1);
  b.run(0, TaskKind::F, 0, 0).send(0, BufKind::Act, 0, 0, 1).recv(0, BufKind::Grad, 1, 0, 1);
  b.free(0, BufKind::Act, 0, 0);
  b.run(0, TaskKind::B, 0, 0)
      .free(0, BufKind::Grad, 1, 0)
      .free(0, BufKind::Stash, 0, 0)
      .acc(0, 0, 0);
  b.recv(1, BufKind::Act, 0, 0, 0).run(1, TaskKind::F, 1, 0).free(1, BufKind::Act, 0, 0);
  b.run(1, TaskKind::B, 1, 0).free(1, BufKind::Stash, 1, 0).acc(1, 1, 0);
  b.send(1, BufKind::Grad, 1, 0, 0).free(1, BufKind::Grad, 1, 0);
  return b.plan;
}

TEST(Sim, LinkLatencyAndBandwidth) {
  Plan p = two_rank_one_mb();
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  SimResult r0 = simulate(p, c);
  EXPECT_DOUBLE_EQ(r0.step_time, 6);  // F0 F1 B1 B0 back to back
  c.link.latency = 0.5;
  c.link.bandwidth = 50;
  c.default_stage.act_bytes = 100;  // 0.5 + 2
  c.default_stage.grad_bytes = 25;  // 0.5 + 0.5
  SimResult r = simulate(p, c);
  EXPECT_DOUBLE_EQ(r.step_time, 6 + 2.5 + 1.0);
  ASSERT_EQ(r.transfers.size(), 2u);
  const TransferEvent& act = r.transfers[0].src == 0 ? r.transfers[0] : r.transfers[1];
  const TransferEvent& grad = r.transfers[0].src == 0 ? r.transfers[1] : r.transfers[0];
  EXPECT_EQ(act.dst, 1);
  EXPECT_EQ(act.bytes, 100);
  EXPECT_DOUBLE_EQ(act.posted, 1);
  EXPECT_DOUBLE_EQ(act.start, 1);
  EXPECT_DOUBLE_EQ(act.end, 3.5);
  EXPECT_EQ(act.send_instr, 1);
  EXPECT_EQ(act.recv_instr, 0);
  EXPECT_EQ(grad.bytes, 25);
  EXPECT_DOUBLE_EQ(grad.start, 6.5);
  EXPECT_DOUBLE_EQ(grad.end, 7.5);
  // Rank 1 idles 2.5 before its first RUN; rank 0 has a gap in its span.
  EXPECT_DOUBLE_EQ(r.span_start[1], 3.5);
  EXPECT_DOUBLE_EQ(r.span_end[1], 6.5);
  EXPECT_DOUBLE_EQ(r.idle_inside_span(0), 9.5 - 3);
  EXPECT_DOUBLE_EQ(r.busy[0], 3);
  EXPECT_DOUBLE_EQ(r.bubble[0], 1 - 3 / 9.5);
  EXPECT_DOUBLE_EQ(r.bubble_fraction, 1 - 6 / 19.0);
  // Rank 0 holds its act until the send completes (3.5), and its stash
  // throughout: the received grad adds to the total from its RECV (t=1).
  EXPECT_EQ(r.peak_total[0], 1 + 100 + 25);  // stash + act + grad receive buffer
  int64_t at_4 = -1;                         // after the act send completed at 3.5
  for (const auto& s : r.memory[0])
    if (s.time <= 4) at_4 = s.total;
  EXPECT_EQ(at_4, 1 + 25);
  // Critical path: F0.0, act transfer, F1.0, B1.0, grad transfer, B0.0.
  ASSERT_EQ(r.critical_path.size(), 6u);
  EXPECT_EQ(r.critical_path[0].what, "RUN F0.0");
  EXPECT_EQ(r.critical_path[1].what, "transfer act(s0,m0) 0->1");
  EXPECT_EQ(r.critical_path[2].what, "RUN F1.0");
  EXPECT_EQ(r.critical_path[3].what, "RUN B1.0");
  EXPECT_EQ(r.critical_path[4].what, "transfer grad(s1,m0) 1->0");
  EXPECT_EQ(r.critical_path[5].what, "RUN B0.0");
  EXPECT_EQ(r.critical_path[1].rank, 0);
  EXPECT_EQ(r.critical_path[1].instr, 1);
  for (size_t k = 1; k < r.critical_path.size(); ++k)
    EXPECT_DOUBLE_EQ(r.critical_path[k].start, r.critical_path[k - 1].end) << k;
  EXPECT_DOUBLE_EQ(r.critical_path.back().end, r.step_time);
}

// Two sends posted together on one link are serialised (FIFO); the reverse
// link is independent.
TEST(Sim, FifoLinkSerialisation) {
  Builder b(2, 2, 2);
  b.run(0, TaskKind::F, 0, 0).run(0, TaskKind::F, 0, 1);
  b.send(0, BufKind::Act, 0, 0, 1).send(0, BufKind::Act, 0, 1, 1);
  b.recv(0, BufKind::Grad, 1, 0, 1).recv(0, BufKind::Grad, 1, 1, 1);
  b.free(0, BufKind::Act, 0, 0).free(0, BufKind::Act, 0, 1);
  for (int m = 0; m < 2; ++m)
    b.run(0, TaskKind::B, 0, m)
        .free(0, BufKind::Grad, 1, m)
        .free(0, BufKind::Stash, 0, m)
        .acc(0, 0, m);
  b.recv(1, BufKind::Act, 0, 0, 0).recv(1, BufKind::Act, 0, 1, 0);
  for (int m = 0; m < 2; ++m) b.run(1, TaskKind::F, 1, m).free(1, BufKind::Act, 0, m);
  for (int m = 0; m < 2; ++m)
    b.run(1, TaskKind::B, 1, m)
        .free(1, BufKind::Stash, 1, m)
        .acc(1, 1, m)
        .send(1, BufKind::Grad, 1, m, 0);
  b.free(1, BufKind::Grad, 1, 0).free(1, BufKind::Grad, 1, 1);
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.link.bandwidth = 1;
  c.default_stage.act_bytes = 3;
  c.default_stage.grad_bytes = 0;
  c.default_stage.stash_bytes = 0;
  SimResult r = simulate(b.plan, c);
  std::vector<const TransferEvent*> acts;
  for (const auto& t : r.transfers)
    if (t.src == 0) acts.push_back(&t);
  ASSERT_EQ(acts.size(), 2u);
  if (acts[0]->start > acts[1]->start) std::swap(acts[0], acts[1]);
  EXPECT_DOUBLE_EQ(acts[0]->posted, 2);
  EXPECT_DOUBLE_EQ(acts[1]->posted, 2);
  EXPECT_DOUBLE_EQ(acts[0]->start, 2);
  EXPECT_DOUBLE_EQ(acts[0]->end, 5);
  EXPECT_DOUBLE_EQ(acts[1]->start, 5);  // waits for the link
  EXPECT_DOUBLE_EQ(acts[1]->end, 8);
  // rank 1: F1.0 [5,6], F1.1 [8,9], B1.0 [9,11], B1.1 [11,13];
  // rank 0: B0.0 [11,13], B0.1 [13,15].
  ASSERT_EQ(r.runs.size(), 8u);
  EXPECT_DOUBLE_EQ(r.runs[2].start, 11);
  EXPECT_DOUBLE_EQ(r.runs[3].start, 13);
  EXPECT_DOUBLE_EQ(r.runs[4].start, 5);
  EXPECT_DOUBLE_EQ(r.runs[5].start, 8);
  EXPECT_DOUBLE_EQ(r.step_time, 15);
  // Rank 0's act buffers are released when their sends complete (5 and 8):
  // total at t=2 is 2 acts + 2 grad receive buffers (0 bytes) = 6.
  EXPECT_EQ(r.peak_total[0], 6);
  int64_t at6 = -1;
  for (const auto& s : r.memory[0])
    if (s.time <= 6) at6 = s.total;
  EXPECT_EQ(at6, 3);
  // The critical path ends with B0.1 and goes through the busy link.
  bool via_link = false;
  for (const auto& st : r.critical_path) via_link |= st.what == "transfer act(s0,m1) 0->1";
  EXPECT_TRUE(via_link);
  EXPECT_EQ(r.critical_path.back().what, "RUN B0.1");
}

// A transfer completes no earlier than its RECV is posted.
TEST(Sim, LateRecvDelaysArrival) {
  Builder b(2, 2, 2);
  for (int m = 0; m < 2; ++m) b.run(0, TaskKind::F, 0, m).send(0, BufKind::Act, 0, m, 1);
  b.free(0, BufKind::Act, 0, 0).free(0, BufKind::Act, 0, 1);
  for (int m = 0; m < 2; ++m) {
    b.recv(0, BufKind::Grad, 1, m, 1);
    b.run(0, TaskKind::B, 0, m)
        .free(0, BufKind::Grad, 1, m)
        .free(0, BufKind::Stash, 0, m)
        .acc(0, 0, m);
  }
  for (int m = 0; m < 2; ++m) {
    b.recv(1, BufKind::Act, 0, m, 0).run(1, TaskKind::F, 1, m).free(1, BufKind::Act, 0, m);
    b.run(1, TaskKind::B, 1, m).free(1, BufKind::Stash, 1, m).acc(1, 1, m);
    b.send(1, BufKind::Grad, 1, m, 0).free(1, BufKind::Grad, 1, m);
  }
  CostModel c = CostModel::uniform(1, 5, 1, 1);
  // Receives posted at their RECV (as with NCCL).
  SimOptions late;
  late.early_receives = false;
  SimResult r = simulate(b.plan, c, late);
  // act m1 is sent at 2 but rank 1 posts its RECV only after B1.0 ends (7).
  const TransferEvent* t1 = nullptr;
  for (const auto& t : r.transfers)
    if (t.src == 0 && t.buffer == b.id(BufKind::Act, 0, 1)) t1 = &t;
  ASSERT_NE(t1, nullptr);
  EXPECT_DOUBLE_EQ(t1->start, 2);
  EXPECT_DOUBLE_EQ(t1->end, 7);
  // rank 1: F [1,2] B [2,7] F [7,8] B [8,13]; rank 0: B0.0 [7,12], B0.1 [13,18].
  EXPECT_DOUBLE_EQ(r.step_time, 18);
  // The received act m1 occupies rank 1 from its RECV (7), not from 2.
  for (const auto& s : r.memory[1])
    if (s.time < 7 && s.time >= 2) {
      EXPECT_LE(s.total, 3) << s.time;
    }
  // The runtime's default (early receives): rank 1 posts the RECV of act m1 when it reaches
  // B1.0 (at 2), so the transfer ends on arrival and the buffer counts from 2; the step is
  // the same (the data is not needed before F1.1 at 7).
  SimResult e = simulate(b.plan, c);
  for (const auto& t : e.transfers)
    if (t.src == 0 && t.buffer == b.id(BufKind::Act, 0, 1)) {
      EXPECT_DOUBLE_EQ(t.start, 2);
      EXPECT_DOUBLE_EQ(t.end, 2);
    }
  EXPECT_DOUBLE_EQ(e.step_time, 18);
  int64_t at5 = -1;
  for (const auto& s : e.memory[1])
    if (s.time <= 5) at5 = s.total;
  int64_t late5 = -1;
  for (const auto& s : r.memory[1])
    if (s.time <= 5) late5 = s.total;
  EXPECT_EQ(at5, late5 + 1);  // act m1 (1 byte) already held at 5
}

TEST(Sim, OneFOneBTwoRanksExact) {
  for (int m : {1, 2, 4, 7}) {
    Plan p = lower(hand_1f1b(2, m));
    CostModel c = CostModel::uniform(1, 2, 1, 1);
    SimResult r = simulate(p, c);
    EXPECT_DOUBLE_EQ(r.step_time, (m + 2 - 1) * 3.0) << "m=" << m;
    EXPECT_DOUBLE_EQ(r.busy[0], 3.0 * m);
    EXPECT_DOUBLE_EQ(r.busy[1], 3.0 * m);
    EXPECT_NEAR(r.bubble_fraction, 1.0 / (m + 1), 1e-12);
    EXPECT_EQ(r.runs.size(), static_cast<size_t>(4 * m));
    EXPECT_EQ(r.transfers.size(), static_cast<size_t>(2 * m));
    // Peak stash: p - r microbatches on rank r (capped by m).
    EXPECT_EQ(r.peak_activation[0], std::min(2, m));
    EXPECT_EQ(r.peak_activation[1], 1);
  }
}

TEST(Sim, OneFOneBMoreRanksMatchesFormula) {
  for (auto [p, m] : {std::pair{3, 5}, {4, 8}, {8, 32}, {16, 64}}) {
    Plan plan = lower(hand_1f1b(p, m));
    CostModel c = CostModel::uniform(1.5, 2.5, 1, 1);
    SimResult r = simulate(plan, c);
    EXPECT_NEAR(r.step_time, (m + p - 1) * 4.0, 1e-9) << p << " " << m;
    for (int rank = 0; rank < p; ++rank)
      EXPECT_EQ(r.peak_activation[rank], std::min(p - rank, m)) << rank;
  }
}

TEST(Sim, CriticalPathIsContiguousWithZeroComm) {
  Plan p = lower(hand_1f1b(2, 4));
  SimResult r = simulate(p, CostModel::uniform(1, 2, 1, 1));
  ASSERT_FALSE(r.critical_path.empty());
  EXPECT_DOUBLE_EQ(r.critical_path.front().start, 0);
  EXPECT_DOUBLE_EQ(r.critical_path.back().end, r.step_time);
  double run_time = 0;
  for (size_t k = 0; k < r.critical_path.size(); ++k) {
    const auto& st = r.critical_path[k];
    if (k > 0) {
      EXPECT_DOUBLE_EQ(st.start, r.critical_path[k - 1].end) << k;
    }
    if (st.what.rfind("RUN ", 0) == 0) {
      run_time += st.end - st.start;
    } else {
      EXPECT_EQ(st.what.rfind("transfer ", 0), 0u) << st.what;
    }
  }
  EXPECT_DOUBLE_EQ(run_time, r.step_time);
  EXPECT_EQ(r.critical_path.front().what, "RUN F0.0");
  EXPECT_EQ(r.critical_path.back().what, "RUN B0.3");
}

TEST(Sim, LocalHandOffHasNoTransfers) {
  Schedule s;
  s.name = "local";
  s.num_ranks = 1;
  s.num_stages = 2;
  s.num_microbatches = 2;
  s.stage_rank = {0, 0};
  s.rank_actions = {{A(TaskKind::F, 0, 0), A(TaskKind::F, 1, 0), A(TaskKind::B, 1, 0),
                     A(TaskKind::B, 0, 0), A(TaskKind::F, 0, 1), A(TaskKind::F, 1, 1),
                     A(TaskKind::B, 1, 1), A(TaskKind::B, 0, 1)}};
  SimResult r = simulate(lower(s), CostModel::uniform(1, 2, 1, 1));
  EXPECT_DOUBLE_EQ(r.step_time, 12);
  EXPECT_TRUE(r.transfers.empty());
  EXPECT_EQ(r.peak_activation[0], 2);
}

TEST(Sim, SplitBackwardCountsWStash) {
  Schedule s;
  s.name = "iw";
  s.num_ranks = 1;
  s.num_stages = 1;
  s.num_microbatches = 1;
  s.stage_rank = {0};
  s.rank_actions = {{A(TaskKind::F, 0, 0), A(TaskKind::I, 0, 0), A(TaskKind::W, 0, 0)}};
  CostModel c = CostModel::uniform(1, 2, 0.75, 0.5);
  c.default_stage.stash_bytes = 10;
  c.default_stage.wstash_bytes = 4;
  c.default_stage.wgrad_bytes = 100;
  SimResult r = simulate(lower(s), c);
  EXPECT_DOUBLE_EQ(r.step_time, 2.25);
  EXPECT_EQ(r.peak_activation[0], 14);  // stash + wstash while I runs
  EXPECT_EQ(r.peak_total[0], 104);      // wstash + wgrad while W runs
  EXPECT_EQ(r.memory[0].back().total, 0);
}

TEST(Sim, FusedActionDuration) {
  Builder b(1, 1, 2);
  b.run(0, TaskKind::F, 0, 0);
  b.run(0, Action{T(TaskKind::F, 0, 1), T(TaskKind::B, 0, 0)});
  b.free(0, BufKind::Stash, 0, 0).acc(0, 0, 0);
  b.run(0, TaskKind::B, 0, 1).free(0, BufKind::Stash, 0, 1).acc(0, 0, 1);
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.fused_factor = 0.5;
  SimResult r = simulate(b.plan, c);
  ASSERT_EQ(r.runs.size(), 3u);
  EXPECT_DOUBLE_EQ(r.runs[1].end - r.runs[1].start, 1.5);
  EXPECT_DOUBLE_EQ(r.step_time, 4.5);
  // A fused pair whose second task reads the first one's output (internal).
  Builder b2(1, 1, 1);
  b2.run(0, Action{T(TaskKind::F, 0, 0), T(TaskKind::B, 0, 0)});
  b2.free(0, BufKind::Stash, 0, 0).acc(0, 0, 0);
  SimResult r2 = simulate(b2.plan, c);
  EXPECT_DOUBLE_EQ(r2.step_time, 1.5);
}

TEST(Sim, StuckReceiveNamesRankAndInstruction) {
  Builder b(2, 2, 1);
  b.run(0, TaskKind::F, 0, 0).free(0, BufKind::Act, 0, 0);  // never sends
  b.recv(1, BufKind::Act, 0, 0, 0).run(1, TaskKind::F, 1, 0);
  const std::string msg = error_of<VerifyError>([&] { simulate(b.plan, CostModel{}); });
  EXPECT_TRUE(contains(msg, "rank 1 #1 RUN F1.0")) << msg;
  EXPECT_TRUE(contains(msg, "act(s0,m0)")) << msg;
  EXPECT_TRUE(contains(msg, "finished without sending")) << msg;
  EXPECT_TRUE(contains(msg, "rank 1 #0 RECV act(s0,m0)<-0 never gets its send")) << msg;
}

TEST(Sim, DeadlockNamesBothRanks) {
  // rank 1 runs F1.1 first, but rank 0 sends act m1 only after B0.0, which
  // needs the grad rank 1 produces after F1.0/B1.0.
  Builder b(2, 2, 2);
  b.run(0, TaskKind::F, 0, 0).send(0, BufKind::Act, 0, 0, 1).recv(0, BufKind::Grad, 1, 0, 1);
  b.run(0, TaskKind::B, 0, 0).run(0, TaskKind::F, 0, 1).send(0, BufKind::Act, 0, 1, 1);
  b.recv(1, BufKind::Act, 0, 0, 0).recv(1, BufKind::Act, 0, 1, 0);
  b.run(1, TaskKind::F, 1, 1).run(1, TaskKind::F, 1, 0).run(1, TaskKind::B, 1, 0);
  b.send(1, BufKind::Grad, 1, 0, 0);
  const std::string msg = error_of<VerifyError>([&] { simulate(b.plan, CostModel{}); });
  EXPECT_TRUE(contains(msg, "stuck ranks: 0 1")) << msg;
  EXPECT_TRUE(
      contains(msg, "rank 0 #3 RUN B0.0 waits for grad(s1,m0) from rank 1 (rank 1 is stuck at #2)"))
      << msg;
  EXPECT_TRUE(contains(msg, "rank 1 #2 RUN F1.1 waits for act(s0,m1) from rank 0")) << msg;
}

TEST(Sim, UnmatchedSendIsReported) {
  Builder b(2, 2, 1);
  b.run(0, TaskKind::F, 0, 0).send(0, BufKind::Act, 0, 0, 1).free(0, BufKind::Act, 0, 0);
  const std::string msg = error_of<VerifyError>([&] { simulate(b.plan, CostModel{}); });
  EXPECT_TRUE(contains(msg, "rank 0 #1 SEND act(s0,m0)->1 is never received")) << msg;
}

TEST(Sim, MalformedProgramsAreErrorsNotCrashes) {
  {
    Builder b(1, 1, 1);
    b.run(0, TaskKind::B, 0, 0);  // stash never produced
    const std::string msg = error_of<VerifyError>([&] { simulate(b.plan, CostModel{}); });
    EXPECT_TRUE(contains(msg, "rank 0 #0 RUN B0.0")) << msg;
    EXPECT_TRUE(contains(msg, "stash(s0,m0)")) << msg;
  }
  {
    Builder b(1, 1, 1);
    b.run(0, TaskKind::F, 0, 0).free(0, BufKind::Stash, 0, 0).run(0, TaskKind::B, 0, 0);
    EXPECT_TRUE(
        contains(error_of<VerifyError>([&] { simulate(b.plan, CostModel{}); }), "already freed"));
    // Freed while its send is still in flight.
    Builder b2(2, 2, 1);
    b2.run(0, TaskKind::F, 0, 0).send(0, BufKind::Act, 0, 0, 1).free(0, BufKind::Act, 0, 0);
    b2.free(0, BufKind::Act, 0, 0);
    EXPECT_TRUE(contains(error_of<VerifyError>([&] { simulate(b2.plan, CostModel{}); }),
                         "rank 0 #3 FREE act(s0,m0): frees act(s0,m0), which is not live"));
  }
  {
    Builder b(2, 2, 1);
    b.plan.programs[0].push_back(Instr{OpCode::Send, -1, 9999, 1});
    EXPECT_TRUE(
        contains(error_of<VerifyError>([&] { simulate(b.plan, CostModel{}); }), "rank 0 #0"));
    b.plan.programs[0][0] = Instr{OpCode::Send, -1, 0, 7};
    EXPECT_TRUE(
        contains(error_of<VerifyError>([&] { simulate(b.plan, CostModel{}); }), "bad peer rank 7"));
    b.plan.programs[0][0] = Instr{OpCode::Run, 3, -1, -1};
    EXPECT_TRUE(contains(error_of<VerifyError>([&] { simulate(b.plan, CostModel{}); }),
                         "action index 3 out of range"));
    b.plan.programs[0][0] = Instr{OpCode::Free, -1, 0, -1};
    EXPECT_TRUE(
        contains(error_of<VerifyError>([&] { simulate(b.plan, CostModel{}); }), "not live"));
    b.plan.programs.pop_back();
    EXPECT_THROW(simulate(b.plan, CostModel{}), VerifyError);
  }
  {
    Plan p = lower(hand_1f1b(2, 2));
    CostModel c;
    c.default_stage.f = -1;
    EXPECT_THROW(simulate(p, c), ConfigError);
  }
}

TEST(Sim, RunsSortedByRankThenStart) {
  Plan p = lower(hand_1f1b(4, 6));
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.link.latency = 0.1;
  SimResult r = simulate(p, c);
  for (size_t k = 1; k < r.runs.size(); ++k) {
    const auto& a = r.runs[k - 1];
    const auto& b = r.runs[k];
    EXPECT_TRUE(a.rank < b.rank || (a.rank == b.rank && a.end <= b.start)) << k;
  }
  // Latency adds (p-1) hops forward and back on the critical path at least.
  EXPECT_GE(r.step_time, (6 + 3) * 3.0 + 6 * 0.1 - 1e-9);
}

// Invariants on lowered plans with uneven stage costs, latency and bandwidth.
TEST(Sim, InvariantsOnLoweredPlans) {
  for (auto [p, m] : {std::pair{2, 3}, {3, 7}, {5, 11}}) {
    Plan plan = lower(hand_1f1b(p, m));
    CostModel c = CostModel::uniform(1, 2, 1, 1);
    c.stages.resize(p);
    for (int s = 0; s < p; ++s) {
      c.stages[s] = c.default_stage;
      c.stages[s].f = 0.5 + 0.25 * s;
      c.stages[s].b = 1.0 + 0.5 * ((s * 7) % 3);
      c.stages[s].act_bytes = 10 + s;
      c.stages[s].grad_bytes = 20 + s;
      c.stages[s].stash_bytes = 100;
      c.stages[s].wgrad_bytes = 7;
    }
    c.link = {0.125, 40};
    SimResult r = simulate(plan, c);
    for (const RunEvent& e : r.runs) {
      const Task& t = plan.schedule.rank_actions[e.rank][e.action].first;
      const double want = t.kind == TaskKind::F ? c.stages[t.stage].f : c.stages[t.stage].b;
      EXPECT_NEAR(e.end - e.start, want, 1e-9);
      EXPECT_LE(e.end, r.step_time);
    }
    // Per link: FIFO in posting order, no overlap on the wire.
    for (int a = 0; a < p; ++a)
      for (int b = 0; b < p; ++b) {
        const TransferEvent* prev = nullptr;
        for (const TransferEvent& t : r.transfers) {
          if (t.src != a || t.dst != b) continue;
          const double dur = 0.125 + static_cast<double>(t.bytes) / 40;
          EXPECT_GE(t.start, t.posted);
          EXPECT_GE(t.end, t.start + dur - 1e-12);
          if (prev) {
            EXPECT_GE(t.send_instr, prev->send_instr);
            EXPECT_GE(t.start, prev->start + 0.125 + static_cast<double>(prev->bytes) / 40 - 1e-12);
          }
          prev = &t;
        }
      }
    for (int rank = 0; rank < p; ++rank) {
      const auto& mem = r.memory[rank];
      ASSERT_FALSE(mem.empty());
      for (size_t k = 1; k < mem.size(); ++k) EXPECT_LT(mem[k - 1].time, mem[k].time);
      for (const auto& smp : mem) {
        EXPECT_GE(smp.activation, 0);
        EXPECT_LE(smp.activation, smp.total);
      }
      EXPECT_EQ(mem.back().total, 0) << "everything is freed by the end";
      EXPECT_EQ(r.peak_activation[rank], 100 * std::min(p - rank, m));
    }
    ASSERT_FALSE(r.critical_path.empty());
    EXPECT_DOUBLE_EQ(r.critical_path.front().start, 0);
    EXPECT_DOUBLE_EQ(r.critical_path.back().end, r.step_time);
  }
}

}  // namespace
}  // namespace baton
