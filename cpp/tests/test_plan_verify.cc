// Verifier: clean plans pass; planted faults are each caught with a precise report.
#include <gtest/gtest.h>

#include <random>

#include "baton/error.h"
#include "baton/plan.h"
#include "baton/verify.h"
#include "test_plan_util.h"

namespace baton {
namespace {

using namespace baton::testing;

// Index of an instruction by its text; fails the test when absent.
int at(const Plan& p, int rank, const std::string& text) {
  const int i = find_instr(p, rank, text);
  EXPECT_GE(i, 0) << "no '" << text << "' on rank " << rank;
  return i;
}

// Moves the instruction at `from` to just before the one now at `before`.
void move_instr(Plan& p, int rank, int from, int before) {
  auto& prog = p.programs[rank];
  const Instr in = prog[from];
  prog.erase(prog.begin() + from);
  prog.insert(prog.begin() + (from < before ? before - 1 : before), in);
}

const Violation* find_violation(const VerifyReport& rep, const std::string& check,
                                const std::string& needle) {
  for (const Violation& v : rep.violations)
    if (v.check == check && v.message.find(needle) != std::string::npos) return &v;
  return nullptr;
}

TEST(Verify, CleanHandSchedulesPass) {
  for (int p = 1; p <= 4; ++p)
    for (int m = 1; m <= 6; ++m)
      for (bool split : {false, true}) {
        const Plan plan = lower(hand_1f1b(p, m, split));
        const VerifyReport rep = verify(plan);
        EXPECT_TRUE(rep.ok()) << "p=" << p << " m=" << m << "\n" << rep.to_string();
        EXPECT_EQ(rep.to_string(), "OK");
        EXPECT_NO_THROW(verify_or_throw(plan));
      }
  for (int p = 1; p <= 3; ++p)
    for (int v = 1; v <= 3; ++v) {
      const Plan plan = lower(hand_gpipe_interleaved(p, v, 3));
      EXPECT_TRUE(verify(plan).ok()) << verify(plan).to_string();
      EXPECT_TRUE(check_deadlock(plan, CommModel::Fifo).ok());
      EXPECT_TRUE(check_deadlock(plan, CommModel::Blocking).ok());
    }
}

// Rank 0 runs F0.1 before sending act(s0,m0), and then sends act(s0,m1) and
// act(s0,m0) in one group: fine when matched by buffer, but on the FIFO
// activation channel 0->1 the first message is act(s0,m1) while rank 1 first
// waits for act(s0,m0).
TEST(Verify, SwappedSendsDeadlockOnlyUnderFifo) {
  Plan p = lower(hand_1f1b(2, 2));
  move_instr(p, 0, at(p, 0, "RUN F0.1"), 1);  // RUN F0.0, RUN F0.1, SEND act00, FREE act00, ...
  move_instr(p, 0, at(p, 0, "FREE act(s0,m0)"), at(p, 0, "FREE act(s0,m1)"));
  move_instr(p, 0, at(p, 0, "SEND act(s0,m0)->1"), at(p, 0, "RECV grad(s1,m0)<-1"));
  ASSERT_EQ(at(p, 0, "SEND act(s0,m1)->1"), 2);
  ASSERT_EQ(at(p, 0, "SEND act(s0,m0)->1"), 3);
  ASSERT_EQ(at(p, 0, "RECV grad(s1,m0)<-1"), 4);

  EXPECT_TRUE(check_deadlock(p, CommModel::Blocking).ok())
      << check_deadlock(p, CommModel::Blocking).to_string();
  const VerifyReport fifo = check_deadlock(p, CommModel::Fifo);
  ASSERT_FALSE(fifo.ok());
  const Violation* hol =
      find_violation(fifo, "comm", "head-of-line mismatch on the act channel 0->1");
  ASSERT_NE(hol, nullptr) << fifo.to_string();
  EXPECT_EQ(hol->message,
            "comm (fifo model): head-of-line mismatch on the act channel 0->1: the 1st message is "
            "rank 0 #2 SEND act(s0,m1)->1, but rank 1 #0 RECV act(s0,m0)<-0 expects act(s0,m0)");
  EXPECT_EQ(hol->ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(hol->instrs, (std::vector<int>{2, 0}));
  EXPECT_EQ(hol->stage, 0);
  EXPECT_EQ(hol->microbatch, 0);
  const Violation* dl = find_violation(fifo, "deadlock", "deadlock (fifo model)");
  ASSERT_NE(dl, nullptr) << fifo.to_string();
  EXPECT_NE(dl->message.find("rank 1 #0 RECV act(s0,m0)<-0"), std::string::npos) << dl->message;
  EXPECT_NE(dl->message.find("rank 0 #2 SEND act(s0,m1)->1"), std::string::npos) << dl->message;

  // The full verifier: data and buffers are fine, only the fifo model fails.
  const VerifyReport all = verify(p);
  for (const Violation& v : all.violations) {
    EXPECT_TRUE(v.check == "comm" || v.check == "deadlock") << v.message;
    EXPECT_EQ(v.message.find("blocking"), std::string::npos) << v.message;
  }
  EXPECT_NE(find_violation(all, "deadlock", "(fifo model)"), nullptr);
  EXPECT_THROW(verify_or_throw(p), VerifyError);
}

// Activations and gradients travel on separate FIFO channels: rank 0 sends
// act(s0,m1) and then grad(s3,m0) to rank 1 in one group (a fused F+I), and
// rank 1 receives them in the other order. With one channel per rank pair the
// first message after act(s0,m0) would be act(s0,m1) where rank 1 expects
// grad(s3,m0); with one channel per kind both channels stay in order.
TEST(Verify, KindsUseSeparateFifoChannels) {
  const Schedule s =
      make("custom", 2, {0, 1, 1, 0}, 2,
           {{A(F(0, 0)), A(F(3, 0)), A(F(0, 1), I(3, 0)), A(I(0, 0)), A(F(3, 1)), A(I(3, 1)),
             A(I(0, 1)), A(W(0, 0)), A(W(0, 1)), A(W(3, 0)), A(W(3, 1))},
            {A(F(1, 0)), A(F(2, 0)), A(I(2, 0)), A(I(1, 0)), A(F(1, 1)), A(F(2, 1)), A(I(2, 1)),
             A(I(1, 1)), A(W(1, 0)), A(W(1, 1)), A(W(2, 0)), A(W(2, 1))}});
  const Plan p = lower(s);
  EXPECT_LT(at(p, 0, "SEND act(s0,m1)->1"), at(p, 0, "SEND grad(s3,m0)->1"));
  EXPECT_GT(at(p, 1, "RECV act(s0,m1)<-0"), at(p, 1, "RECV grad(s3,m0)<-0"));
  EXPECT_TRUE(check_deadlock(p, CommModel::Fifo).ok())
      << check_deadlock(p, CommModel::Fifo).to_string();
  EXPECT_TRUE(verify(p).ok()) << verify(p).to_string();

  // Swapping the two activation sends of rank 0 (same kind, same link) is
  // still caught.
  Plan q = lower(hand_1f1b(2, 3));
  move_instr(q, 0, at(q, 0, "RUN F0.1"), 1);
  move_instr(q, 0, at(q, 0, "FREE act(s0,m0)"), at(q, 0, "FREE act(s0,m1)"));
  move_instr(q, 0, at(q, 0, "SEND act(s0,m0)->1"), at(q, 0, "RECV grad(s1,m0)<-1"));
  EXPECT_NE(find_violation(check_deadlock(q, CommModel::Fifo), "comm", "act channel 0->1"),
            nullptr);
}

TEST(Verify, RecvThatNeverGetsItsSend) {
  Plan p = lower(hand_1f1b(2, 2));
  auto& r1 = p.programs[1];
  r1.erase(r1.begin() + at(p, 1, "SEND grad(s1,m1)->0"));
  r1.erase(r1.begin() + at(p, 1, "FREE grad(s1,m1)"));
  const VerifyReport rep = verify(p);
  const Violation* comm = find_violation(rep, "comm", "RECV grad(s1,m1)<-1");
  ASSERT_NE(comm, nullptr) << rep.to_string();
  EXPECT_EQ(comm->message, "comm: rank 0 #12 RECV grad(s1,m1)<-1 has no matching SEND on rank 1");
  const Violation* dl = find_violation(rep, "deadlock", "never gets its send");
  ASSERT_NE(dl, nullptr) << rep.to_string();
  EXPECT_EQ(dl->message,
            "deadlock (blocking and fifo models): rank 0 #12 RECV grad(s1,m1)<-1 never gets its "
            "send: rank 1 finished");
  EXPECT_EQ(dl->ranks, std::vector<int>{0});
  EXPECT_EQ(dl->instrs, std::vector<int>{12});
  EXPECT_EQ(dl->stage, 1);
  EXPECT_EQ(dl->microbatch, 1);
}

TEST(Verify, SendMissingWhilePeerIsBlocked) {
  Plan p = lower(hand_1f1b(2, 2));
  auto& r0 = p.programs[0];
  r0.erase(r0.begin() + at(p, 0, "SEND act(s0,m1)->1"));
  const VerifyReport rep = check_deadlock(p, CommModel::Blocking);
  const Violation* dl = find_violation(rep, "deadlock", "RECV act(s0,m1)<-0 never gets its send");
  ASSERT_NE(dl, nullptr) << rep.to_string();
  EXPECT_NE(dl->message.find("rank 0 has no matching SEND (it is blocked at rank 0 #11 RECV "
                             "grad(s1,m1)<-1)"),
            std::string::npos)
      << dl->message;
  EXPECT_NE(
      find_violation(rep, "comm", "rank 1 #8 RECV act(s0,m1)<-0 has no matching SEND on rank 0"),
      nullptr)
      << rep.to_string();
  // The other ranks wait on rank 1, which waits on nothing that will come.
  EXPECT_EQ(find_violation(rep, "deadlock", "a cycle"), nullptr) << rep.to_string();
}

TEST(Verify, ActionBeforeItsReceivedInput) {
  Plan p = lower(hand_1f1b(2, 2));
  // rank 1: RUN F1.1 before the RECV of its input.
  move_instr(p, 1, at(p, 1, "RECV act(s0,m1)<-0"), at(p, 1, "FREE act(s0,m1)"));
  ASSERT_EQ(at(p, 1, "RUN F1.1"), 9);
  ASSERT_EQ(at(p, 1, "RECV act(s0,m1)<-0"), 10);
  const VerifyReport rep = verify(p);
  const Violation* v = find_violation(rep, "data", "RUN F1.1");
  ASSERT_NE(v, nullptr) << rep.to_string();
  EXPECT_EQ(v->message,
            "data: rank 1 #9 RUN F1.1 needs act(s0,m1), which is received later at #10");
  EXPECT_EQ(v->stage, 0);
  EXPECT_EQ(v->microbatch, 1);
  // Executed, the RUN waits forever.
  EXPECT_NE(find_violation(rep, "deadlock", "rank 1 #9 RUN F1.1 can never run"), nullptr)
      << rep.to_string();
}

TEST(Verify, ActionBeforeItsLocalInput) {
  // W before its I on the same rank: produced later, not received.
  Schedule s = hand_1f1b(2, 1, /*split=*/true);
  ASSERT_EQ(to_string(s.rank_actions[1][1]), "I1.0");
  std::swap(s.rank_actions[1][1], s.rank_actions[1][2]);
  const Plan p = lower(s);
  const VerifyReport rep = verify(p);
  const Violation* v = find_violation(rep, "data", "RUN W1.0 needs");
  ASSERT_NE(v, nullptr) << rep.to_string();
  EXPECT_EQ(v->message,
            "data: rank 1 #3 RUN W1.0 needs wstash(s1,m0), which is produced later at #7 (RUN "
            "I1.0)");
  EXPECT_NE(find_violation(rep, "buffer", "frees wstash(s1,m0), which does not exist"), nullptr)
      << rep.to_string();
  EXPECT_NE(find_violation(rep, "buffer",
                           "wstash(s1,m0) (created by rank 1 #7 RUN I1.0) is never "
                           "freed"),
            nullptr)
      << rep.to_string();

  // A stage whose input is never produced anywhere it can reach.
  Plan q = lower(hand_1f1b(2, 1));
  q.programs[0].erase(q.programs[0].begin() + at(q, 0, "SEND act(s0,m0)->1"));
  q.programs[1].erase(q.programs[1].begin() + at(q, 1, "RECV act(s0,m0)<-0"));
  const VerifyReport rq = verify(q);
  EXPECT_NE(find_violation(rq, "data",
                           "rank 1 #0 RUN F1.0 needs act(s0,m0), which is never received by rank "
                           "1 (its producer on rank 0 never sends it there)"),
            nullptr)
      << rq.to_string();
}

TEST(Verify, BufferFreedTwice) {
  Plan p = lower(hand_1f1b(2, 2));
  const int f = at(p, 1, "FREE act(s0,m0)");
  p.programs[1].insert(p.programs[1].begin() + f + 2, p.programs[1][f]);  // after RUN B1.0
  const VerifyReport rep = verify(p);
  ASSERT_EQ(rep.violations.size(), 1u) << rep.to_string();
  const Violation& v = rep.violations[0];
  EXPECT_EQ(v.check, "buffer");
  EXPECT_EQ(v.message,
            "buffer: rank 1 #4 FREE act(s0,m0) frees act(s0,m0) twice: it was already freed by "
            "rank 1 #2 FREE act(s0,m0)");
  EXPECT_EQ(v.ranks, (std::vector<int>{1, 1}));
  EXPECT_EQ(v.instrs, (std::vector<int>{2, 4}));
}

TEST(Verify, BufferNeverFreed) {
  Plan p = lower(hand_1f1b(2, 2));
  p.programs[1].erase(p.programs[1].begin() + at(p, 1, "FREE stash(s1,m0)"));
  const VerifyReport rep = verify(p);
  ASSERT_EQ(rep.violations.size(), 1u) << rep.to_string();
  EXPECT_EQ(rep.violations[0].message,
            "buffer: rank 1: stash(s1,m0) (created by rank 1 #1 RUN F1.0) is never freed");
  EXPECT_EQ(rep.violations[0].stage, 1);
  EXPECT_EQ(rep.violations[0].microbatch, 0);
}

TEST(Verify, BufferFreedBeforeLastUse) {
  Plan p = lower(hand_1f1b(2, 2));
  move_instr(p, 1, at(p, 1, "FREE stash(s1,m0)"), at(p, 1, "RUN B1.0"));
  const VerifyReport rep = verify(p);
  ASSERT_EQ(rep.violations.size(), 1u) << rep.to_string();
  EXPECT_EQ(rep.violations[0].message,
            "buffer: rank 1 #4 RUN B1.0 uses stash(s1,m0) after rank 1 #3 FREE stash(s1,m0) "
            "(freed before its last use)");
  // Sending a freed buffer is caught too.
  Plan q = lower(hand_1f1b(2, 2));
  move_instr(q, 0, at(q, 0, "FREE act(s0,m0)"), at(q, 0, "SEND act(s0,m0)->1"));
  EXPECT_NE(find_violation(verify(q), "buffer",
                           "rank 0 #2 SEND act(s0,m0)->1 sends act(s0,m0) after rank 0 #1 FREE"),
            nullptr)
      << verify(q).to_string();
}

TEST(Verify, WeightGradientMustBeAccumulated) {
  Plan p = lower(hand_1f1b(2, 1));
  p.programs[0].erase(p.programs[0].begin() + at(p, 0, "ACCUMULATE wgrad(s0,m0)"));
  EXPECT_NE(find_violation(verify(p), "data",
                           "frees weight gradient wgrad(s0,m0) before it is "
                           "ACCUMULATEd"),
            nullptr);
}

// Both ranks send first and receive in a separate group: each blocks on a
// send the other will only match later (rendezvous). A cycle under both models.
TEST(Verify, BlockingSendCycle) {
  Plan p = lower(hand_1f1b(2, 2));
  // rank 0: [SEND act01] FREE act01 [RECV grad10]; rank 1: [SEND grad10] FREE grad10 [RECV act01].
  move_instr(p, 0, at(p, 0, "FREE act(s0,m1)"), at(p, 0, "RECV grad(s1,m0)<-1"));
  move_instr(p, 1, at(p, 1, "FREE grad(s1,m0)"), at(p, 1, "RECV act(s0,m1)<-0"));
  ASSERT_EQ(at(p, 0, "SEND act(s0,m1)->1"), 4);
  ASSERT_EQ(at(p, 0, "RECV grad(s1,m0)<-1"), 6);
  ASSERT_EQ(at(p, 1, "SEND grad(s1,m0)->0"), 7);
  ASSERT_EQ(at(p, 1, "RECV act(s0,m1)<-0"), 9);
  const VerifyReport rep = verify(p);
  ASSERT_EQ(rep.violations.size(), 1u) << rep.to_string();
  const Violation& v = rep.violations[0];
  EXPECT_EQ(v.check, "deadlock");
  EXPECT_EQ(v.message,
            "deadlock (blocking and fifo models): rank 0 #4 SEND act(s0,m1)->1 waits for rank 1 "
            "#9 RECV act(s0,m1)<-0, but rank 1 is blocked at #7 SEND grad(s1,m0)->0, which waits "
            "for rank 0 #6 RECV grad(s1,m0)<-1, but rank 0 is blocked at #4: a cycle");
  EXPECT_EQ(v.ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(v.instrs, (std::vector<int>{4, 7}));
}

// A schedule-level deadlock: rank 0 waits for a gradient that rank 1 only
// produces after a forward that needs rank 0's next activation.
TEST(Verify, ScheduleDeadlockCycleAcrossThreeRanks) {
  const Schedule s = make("bad", 3, contiguous_placement(3), 2,
                          {{A(F(0, 0)), A(B(0, 0)), A(F(0, 1)), A(B(0, 1))},
                           {A(F(1, 0)), A(F(1, 1)), A(B(1, 0)), A(B(1, 1))},
                           {A(F(2, 0)), A(B(2, 0)), A(F(2, 1)), A(B(2, 1))}});
  const Plan p = lower(s);
  const VerifyReport rep = check_deadlock(p, CommModel::Blocking);
  const Violation* v = find_violation(rep, "deadlock", "a cycle");
  ASSERT_NE(v, nullptr) << rep.to_string();
  EXPECT_EQ(v->message.rfind("deadlock (blocking model): rank 0 #", 0), 0u) << v->message;
  EXPECT_NE(v->message.find("RECV grad(s1,m0)<-1 waits for rank 1"), std::string::npos)
      << v->message;
  EXPECT_NE(v->message.find("but rank 1 is blocked at"), std::string::npos) << v->message;
  EXPECT_NE(v->message.find("RECV act(s0,m1)<-0, which waits for rank 0"), std::string::npos)
      << v->message;
}

TEST(Verify, StructureErrorsStopEarly) {
  Plan p = lower(hand_1f1b(2, 2));
  p.programs[1].push_back(Instr{OpCode::Run, 0, -1, -1});  // F1.0 again
  VerifyReport rep = verify(p);
  ASSERT_EQ(rep.violations.size(), 1u) << rep.to_string();
  EXPECT_EQ(rep.violations[0].check, "structure");
  EXPECT_EQ(rep.violations[0].message,
            "structure: rank 1 #18 runs action 0 (F1.0) again (first at #1)");

  Plan q = lower(hand_1f1b(2, 2));
  q.programs[0][1].peer = 0;
  q.programs[0][2].buffer = 1000;
  rep = verify(q);
  EXPECT_NE(find_violation(rep, "structure", "rank 0 #1: SEND names peer rank 0"), nullptr)
      << rep.to_string();
  EXPECT_NE(find_violation(rep, "structure", "rank 0 #2: FREE names buffer id 1000"), nullptr)
      << rep.to_string();

  Plan r = lower(hand_1f1b(2, 2));
  r.programs.pop_back();
  EXPECT_EQ(verify(r).to_string(),
            "structure: plan has programs for 1 ranks but the schedule has 2 ranks");
  Plan t = lower(hand_1f1b(2, 2));
  t.schedule.rank_actions[0].pop_back();
  EXPECT_EQ(verify(t).violations.at(0).check, "structure");
}

TEST(Verify, ManyFaultsAreCapped) {
  Plan p = lower(hand_1f1b(2, 64));
  for (auto& prog : p.programs)
    std::erase_if(prog, [](const Instr& in) { return in.op == OpCode::Free; });
  const VerifyReport rep = verify(p);
  ASSERT_FALSE(rep.ok());
  EXPECT_LE(rep.violations.size(), 51u);
  EXPECT_EQ(rep.violations.back().check, "summary");
  EXPECT_NE(rep.violations.back().message.find("further violations not listed"), std::string::npos);
}

// Random edits of small plans: the verifier reports (or accepts) them but
// never throws or crashes; an edit that breaks a dependency is never
// accepted.
TEST(Verify, RandomEditsNeverCrash) {
  std::mt19937 rng(12345);
  int caught = 0;
  for (int trial = 0; trial < 400; ++trial) {
    Plan p = lower(hand_1f1b(3, 3, trial % 2 == 1));
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      auto& prog = p.programs[rng() % p.programs.size()];
      const size_t n = prog.size();
      const size_t i = rng() % n, j = rng() % n;
      switch (rng() % 6) {
        case 0:
          prog.erase(prog.begin() + static_cast<long>(i));
          break;
        case 1:
          std::swap(prog[i], prog[j]);
          break;
        case 2:
          prog.insert(prog.begin() + static_cast<long>(j), prog[i]);
          break;
        case 3:
          prog[i].peer = static_cast<int32_t>(rng() % 5) - 1;
          break;
        case 4:
          prog[i].buffer = static_cast<int32_t>(rng() % (p.num_buffer_ids() + 2)) - 1;
          break;
        case 5:
          prog[i].action = static_cast<int32_t>(rng() % 8) - 1;
          break;
      }
    }
    VerifyReport rep;
    EXPECT_NO_THROW(rep = verify(p));
    EXPECT_NO_THROW(check_deadlock(p, CommModel::Blocking));
    EXPECT_NO_THROW(check_deadlock(p, CommModel::Fifo));
    for (const Violation& v : rep.violations) {
      EXPECT_FALSE(v.message.empty());
      EXPECT_EQ(v.ranks.size(), v.instrs.size()) << v.message;
    }
    caught += !rep.ok();
  }
  EXPECT_GT(caught, 300);  // most random edits break something
}

// Erasing any single instruction of a clean plan is always caught.
TEST(Verify, EveryEssentialInstructionMatters) {
  const Plan clean = lower(hand_1f1b(3, 2, /*split=*/true));
  for (size_t r = 0; r < clean.programs.size(); ++r)
    for (size_t i = 0; i < clean.programs[r].size(); ++i) {
      Plan p = clean;
      p.programs[r].erase(p.programs[r].begin() + static_cast<long>(i));
      EXPECT_FALSE(verify(p).ok())
          << "erasing " << clean.describe(static_cast<int>(r), static_cast<int>(i));
    }
}

}  // namespace
}  // namespace baton
