// Rolled rank programs (roll.h): golden text of the runs, the items of a rank
// program, and the rules that choose, rotate and describe the runs.
#include <gtest/gtest.h>

#include <string>

#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/rank_program.h"
#include "baton/roll.h"
#include "test_golden_util.h"

namespace baton {
namespace {

void expect_golden(const std::string& name, const std::string& text) {
  testing::expect_golden(name, text, "rolled rank text");
}

struct Rolled {
  RankIR ir;
  RolledRank rolled;
};

Rolled roll_of(const Schedule& s, int rank, const RollOptions& opts = {}) {
  Rolled r{build_rank_ir(lower(s)), {}};
  r.rolled = roll_rank(r.ir.plan, r.ir.programs.at(rank), opts);
  return r;
}

// Every item in exactly one run, in order; repetitions repeat the pattern.
void expect_covers(const RolledRank& r) {
  int pos = 0;
  for (const RollRun& run : r.runs) {
    EXPECT_EQ(run.first, pos);
    ASSERT_GE(run.period, 1);
    ASSERT_GE(run.repetitions, 1);
    for (int t = 1; t < run.repetitions; ++t)
      for (int j = 0; j < run.period; ++j)
        EXPECT_TRUE(r.items.at(run.first + t * run.period + j)
                        .same_shifted(r.items.at(run.first + j), t * run.delta))
            << "run at " << run.first << " repetition " << t << " item " << j;
    if (run.repetitions == 1) {
      EXPECT_EQ(run.period, 1);
      EXPECT_TRUE(run.slots.empty());
      EXPECT_TRUE(run.stacked.empty());
    }
    pos += run.period * run.repetitions;
  }
  EXPECT_EQ(pos, static_cast<int>(r.items.size()));
}

TEST(Roll, Golden1F1BRank1) {
  const Rolled r = roll_of(one_f_one_b(4, 8), 1);
  expect_covers(r.rolled);
  expect_golden("roll_1f1b_p4_m8_rank1.txt", r.rolled.to_text(r.ir.plan));
}

TEST(Roll, GoldenZBH1Rank0) {
  const Rolled r = roll_of(zb_h1(4, 8), 0);
  expect_covers(r.rolled);
  expect_golden("roll_zbh1_p4_m8_rank0.txt", r.rolled.to_text(r.ir.plan));
}

TEST(Roll, GoldenOneRankFused) {
  const Rolled r = roll_of(fuse_forward_backward(one_f_one_b(1, 8)), 0);
  expect_covers(r.rolled);
  expect_golden("roll_1f1b_fused_p1_m8.txt", r.rolled.to_text(r.ir.plan));
}

// A rank program's items: one per transfer posted or waited on and one per
// task, with the plan's reads and writes (weight gradients left out).
TEST(Roll, ItemsOfARankProgram) {
  const RankIR ir = build_rank_ir(lower(one_f_one_b(2, 2)));
  const std::vector<RollItem> items = rank_items(ir.plan, ir.programs[1]);
  int runs = 0, waits = 0, sends = 0, posts = 0;
  for (const RollItem& it : items) {
    runs += it.op == ItemOp::Run;
    waits += it.op == ItemOp::Wait;
    sends += it.op == ItemOp::Send;
    posts += it.op == ItemOp::Post;
    for (const BufferKey& k : it.writes) EXPECT_NE(k.kind, BufKind::WGrad);
  }
  EXPECT_EQ(runs, 4);   // F1.0 B1.0 F1.1 B1.1
  EXPECT_EQ(posts, 2);  // act(s0,m0), act(s0,m1)
  EXPECT_EQ(waits, 2);
  EXPECT_EQ(sends, 2);  // grad(s1,m0), grad(s1,m1)
  const RollItem& first = items.at(0);
  EXPECT_EQ(first.op, ItemOp::Post);
  EXPECT_EQ(first.buffer, BufKind::Act);
  EXPECT_EQ(first.peer, 0);
  for (const RollItem& it : items) {
    if (it.op == ItemOp::Run && it.task == TaskKind::F) {
      ASSERT_EQ(it.reads.size(), 1u);
      EXPECT_EQ(it.reads[0], (BufferKey{BufKind::Act, 0, it.microbatch}));
      EXPECT_EQ(it.peer, -1);
    }
    if (it.op == ItemOp::Send) {
      EXPECT_EQ(it.reads.size(), 1u);
    }
    if (it.op == ItemOp::Wait) {
      EXPECT_EQ(it.writes.size(), 1u);
    }
  }
}

// A fused F+B action is one FB item, or its two tasks without fuse_fb.
TEST(Roll, FusedActionIsOneItemOrTwo) {
  const RankIR ir = build_rank_ir(lower(fuse_forward_backward(one_f_one_b(1, 4))));
  const std::vector<RollItem> fused = rank_items(ir.plan, ir.programs[0]);
  ASSERT_EQ(fused.size(), 4u);
  for (const RollItem& it : fused) {
    EXPECT_TRUE(it.fused);
    EXPECT_TRUE(it.reads.empty());  // the stash is internal
  }
  RollOptions split;
  split.fuse_fb = false;
  const std::vector<RollItem> two = rank_items(ir.plan, ir.programs[0], split);
  ASSERT_EQ(two.size(), 8u);
  EXPECT_EQ(two[0].task, TaskKind::F);
  EXPECT_EQ(two[1].task, TaskKind::B);
  EXPECT_FALSE(two[1].fused);
  ASSERT_EQ(two[1].reads.size(), 1u);
  EXPECT_EQ(two[1].reads[0].kind, BufKind::Stash);
}

// One rank fused: one scan of every microbatch, nothing carried or stacked.
TEST(Roll, OneRankFusedIsOneScan) {
  const Rolled r = roll_of(fuse_forward_backward(one_f_one_b(1, 8)), 0);
  ASSERT_EQ(r.rolled.runs.size(), 1u);
  const RollRun& run = r.rolled.runs[0];
  EXPECT_EQ(run.period, 1);
  EXPECT_EQ(run.repetitions, 8);
  EXPECT_EQ(run.delta, 1);
  EXPECT_TRUE(run.slots.empty());
  EXPECT_TRUE(run.stacked.empty());
}

// GPipe on one rank: the forwards hand their stashes to the backwards
// stacked; without stacked outputs they stay unrolled.
TEST(Roll, StackedOutputsOrUnrolled) {
  const Rolled with = roll_of(gpipe(1, 4), 0);
  expect_covers(with.rolled);
  ASSERT_FALSE(with.rolled.runs.empty());
  const RollRun& fw = with.rolled.runs[0];
  EXPECT_EQ(fw.repetitions, 4);
  ASSERT_EQ(fw.stacked.size(), 1u);
  EXPECT_EQ(fw.stacked[0], (BufferKey{BufKind::Stash, 0, 0}));
  RollOptions opts;
  opts.stacked = false;
  const Rolled without = roll_of(gpipe(1, 4), 0, opts);
  expect_covers(without.rolled);
  for (const RollRun& run : without.rolled.runs) EXPECT_TRUE(run.stacked.empty());
  EXPECT_EQ(without.rolled.runs[0].repetitions, 1);
}

// Rank 1 of a fused 1F1B on 2 ranks: the steady state's pattern [<act FB
// >grad +act] starts and ends with transfers, so it is rotated to start at
// its task, one repetition fewer, and the receive one repetition waits on for
// the next is its carry slot.
TEST(Roll, RotatedSteadyStateCarriesItsReceive) {
  const Rolled r = roll_of(fuse_forward_backward(one_f_one_b(2, 8)), 1);
  expect_covers(r.rolled);
  const RollRun* scan = nullptr;
  for (const RollRun& run : r.rolled.runs)
    if (run.repetitions > 2) scan = &run;
  ASSERT_NE(scan, nullptr) << r.rolled.to_text(r.ir.plan);
  EXPECT_EQ(scan->period, 4);
  EXPECT_EQ(scan->repetitions, 5);
  const RollItem& head = r.rolled.items.at(scan->first);
  EXPECT_EQ(head.op, ItemOp::Run);
  EXPECT_TRUE(head.fused);
  EXPECT_EQ(r.rolled.items.at(scan->first + scan->period - 1).op, ItemOp::Wait);
  EXPECT_EQ(scan->slots, (std::vector<BufferKey>{{BufKind::Act, 0, 1}}));
  EXPECT_TRUE(scan->stacked.empty());
  EXPECT_EQ(r.rolled.items.at(scan->first - 1).op, ItemOp::Wait);  // the head, in place
}

// A period bound of one rolls only runs of single items.
TEST(Roll, MaxPeriodBoundsThePattern) {
  RollOptions opts;
  opts.max_period = 1;
  const Rolled r = roll_of(one_f_one_b(4, 8), 1, opts);
  expect_covers(r.rolled);
  for (const RollRun& run : r.rolled.runs) EXPECT_EQ(run.period, 1);
}

}  // namespace
}  // namespace baton
