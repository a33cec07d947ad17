// Unit tests of the schedule generators: shapes, counts, placements,
// validate(), golden orders for small cases and error messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "baton/error.h"
#include "baton/generators.h"

namespace baton {
namespace {

std::string row(const Schedule& s, int r) {
  std::string out;
  for (const Action& a : s.rank_actions[r]) {
    if (!out.empty()) out += ' ';
    out += to_string(a);
  }
  return out;
}

// Number of tasks of kind k on rank r (fused actions count both tasks).
int count(const Schedule& s, int r, TaskKind k) {
  int n = 0;
  for (const Action& a : s.rank_actions[r]) {
    n += a.first.kind == k;
    n += a.is_fused() && a.second.kind == k;
  }
  return n;
}

// Expects fn() to throw ScheduleError whose message contains `needle`.
template <class Fn>
void expect_schedule_error(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected ScheduleError containing: " << needle;
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

struct Case {
  std::string name;
  int p, m, v;
};

std::vector<Case> grid() {
  std::vector<Case> out;
  for (const auto& n : schedule_names())
    for (int p : {1, 2, 3, 4, 5, 8})
      for (int m : {1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17}) {
        if (n == "dualpipev" && m < 2 * p) continue;
        if (n == "interleaved") {
          for (int v : {1, 2, 3, 4})
            if (v == 1 || m % p == 0 || m <= p) out.push_back({n, p, m, v});
          continue;
        }
        out.push_back({n, p, m, 1});
      }
  return out;
}

TEST(Generators, EveryOutputValidatesWithExpectedShape) {
  for (const Case& c : grid()) {
    SCOPED_TRACE(c.name + " p=" + std::to_string(c.p) + " m=" + std::to_string(c.m) +
                 " v=" + std::to_string(c.v));
    const Schedule s = make_schedule(c.name, c.p, c.m, c.v);
    EXPECT_NO_THROW(s.validate());
    EXPECT_EQ(s.name, c.name);
    EXPECT_EQ(s.num_ranks, c.p);
    EXPECT_EQ(s.num_microbatches, c.m);
    const bool vshape = c.name == "zbv" || c.name == "vmin" || c.name == "vhalf" ||
                        c.name == "dualpipev";
    const int stages = vshape ? 2 * c.p : c.p * c.v;
    ASSERT_EQ(s.num_stages, stages);
    if (vshape)
      EXPECT_EQ(s.stage_rank, v_placement(c.p));
    else if (c.name == "interleaved")
      EXPECT_EQ(s.stage_rank, interleaved_placement(c.p, c.v));
    else
      EXPECT_EQ(s.stage_rank, contiguous_placement(c.p));
    const bool split = c.name == "zbh1" || c.name == "zbh2" || c.name == "zbv" ||
                       c.name == "vmin" || c.name == "vhalf";
    if (c.name != "dualpipev") {
      EXPECT_EQ(s.split_backward(), split);
    }
    const int chunks = stages / c.p;
    for (int r = 0; r < c.p; ++r) {
      EXPECT_EQ(count(s, r, TaskKind::F), chunks * c.m);
      if (split) {
        EXPECT_EQ(count(s, r, TaskKind::I), chunks * c.m);
        EXPECT_EQ(count(s, r, TaskKind::W), chunks * c.m);
        EXPECT_EQ(count(s, r, TaskKind::B), 0);
      } else if (c.name != "dualpipev") {
        EXPECT_EQ(count(s, r, TaskKind::B), chunks * c.m);
      }
    }
  }
}

TEST(Generators, Deterministic) {
  for (const auto& n : schedule_names()) {
    const int v = n == "interleaved" ? 2 : 1;
    EXPECT_EQ(make_schedule(n, 4, 8, v), make_schedule(n, 4, 8, v)) << n;
  }
}

TEST(Generators, GPipeOrder) {
  const Schedule s = gpipe(2, 3);
  EXPECT_EQ(row(s, 0), "F0.0 F0.1 F0.2 B0.0 B0.1 B0.2");
  EXPECT_EQ(row(s, 1), "F1.0 F1.1 F1.2 B1.0 B1.1 B1.2");
}

TEST(Generators, OneFOneBOrder) {
  const Schedule s = one_f_one_b(3, 6);
  EXPECT_EQ(row(s, 0), "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 F0.4 B0.2 F0.5 B0.3 B0.4 B0.5");
  EXPECT_EQ(row(s, 1), "F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 F1.4 B1.3 F1.5 B1.4 B1.5");
  EXPECT_EQ(row(s, 2), "F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3 F2.4 B2.4 F2.5 B2.5");
  // Fewer microbatches than ranks: warm-up capped at m.
  EXPECT_EQ(row(one_f_one_b(4, 2), 0), "F0.0 F0.1 B0.0 B0.1");
}

TEST(Generators, EagerWarmup) {
  const Schedule s = eager_one_f_one_b(3, 6);
  EXPECT_EQ(row(s, 0), "F0.0 F0.1 F0.2 F0.3 F0.4 B0.0 F0.5 B0.1 B0.2 B0.3 B0.4 B0.5");
  EXPECT_EQ(row(s, 1), "F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 F1.4 B1.2 F1.5 B1.3 B1.4 B1.5");
  EXPECT_EQ(row(s, 2), "F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3 F2.4 B2.4 F2.5 B2.5");
  // Warm-up 2(p-r)-1 forwards, capped by m.
  for (int p : {2, 5, 8})
    for (int m : {1, 3, 20}) {
      const Schedule e = eager_one_f_one_b(p, m);
      for (int r = 0; r < p; ++r) {
        int warm = 0;
        while (warm < static_cast<int>(e.rank_actions[r].size()) &&
               e.rank_actions[r][warm].first.kind == TaskKind::F)
          ++warm;
        EXPECT_EQ(warm, std::min(2 * (p - r) - 1, m)) << "p=" << p << " m=" << m << " r=" << r;
      }
    }
}

TEST(Generators, InterleavedOrder) {
  const Schedule s = interleaved_one_f_one_b(2, 4, 2);
  EXPECT_EQ(s.stage_rank, (std::vector<int32_t>{0, 1, 0, 1}));
  EXPECT_EQ(row(s, 0),
            "F0.0 F0.1 F2.0 F2.1 F0.2+B2.0 F0.3+B2.1 F2.2+B0.0 F2.3+B0.1 B2.2 B2.3 B0.2 B0.3");
  EXPECT_EQ(row(s, 1),
            "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2+B1.0 F1.3+B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3");
  // v = 1 is plain 1F1B.
  const Schedule one = interleaved_one_f_one_b(3, 5, 1);
  EXPECT_EQ(one.rank_actions, one_f_one_b(3, 5).rank_actions);
  EXPECT_EQ(one.name, "interleaved");
}

TEST(Generators, ZBH1DefersWeightPasses) {
  const Schedule s = zb_h1(3, 6);
  EXPECT_EQ(
      row(s, 0),
      "F0.0 F0.1 F0.2 I0.0 W0.0 F0.3 I0.1 W0.1 F0.4 I0.2 W0.2 F0.5 I0.3 W0.3 I0.4 W0.4 I0.5 W0.5");
  EXPECT_EQ(
      row(s, 1),
      "F1.0 F1.1 I1.0 F1.2 I1.1 W1.0 F1.3 I1.2 W1.1 F1.4 I1.3 W1.2 F1.5 I1.4 W1.3 I1.5 W1.4 W1.5");
  EXPECT_EQ(
      row(s, 2),
      "F2.0 I2.0 F2.1 I2.1 F2.2 I2.2 W2.0 F2.3 I2.3 W2.1 F2.4 I2.4 W2.2 F2.5 I2.5 W2.3 W2.4 W2.5");
}

TEST(Generators, ZBH2WarmupAndOrder) {
  const Schedule s = zb_h2(3, 6);
  EXPECT_EQ(
      row(s, 0),
      "F0.0 F0.1 F0.2 F0.3 F0.4 I0.0 W0.0 I0.1 F0.5 I0.2 W0.1 I0.3 W0.2 I0.4 W0.3 W0.4 I0.5 W0.5");
  EXPECT_EQ(
      row(s, 2),
      "F2.0 I2.0 F2.1 I2.1 F2.2 I2.2 F2.3 I2.3 F2.4 I2.4 W2.0 F2.5 I2.5 W2.1 W2.2 W2.3 W2.4 W2.5");
  // Rank r runs 2(p-r)-1 forwards before its first I (for m large enough).
  const Schedule big = zb_h2(5, 20);
  for (int r = 0; r < 5; ++r) {
    int warm = 0;
    while (big.rank_actions[r][warm].first.kind == TaskKind::F) ++warm;
    EXPECT_EQ(warm, 2 * (5 - r) - 1) << r;
  }
}

// Link r -> r+1 of a V schedule carries F outputs of stage r and backward
// outputs of stage 2p-1-r. DualPipeV interleaves those two (and the mirror
// pair) in the same pattern on every rank: with DeepSeek's warm-up counts,
// which break the pattern, rank r runs ahead of rank r+1 and blocking groups
// deadlock (docs/SCHEDULES.md). Returns the two patterns.
std::pair<std::string, std::string> v_patterns(const Schedule& s, int r) {
  const int down = r, up = s.num_stages - 1 - r;
  std::string a, b;
  for (const Action& x : s.rank_actions[r])
    for (const Task* t : {&x.first, x.is_fused() ? &x.second : nullptr}) {
      if (!t) continue;
      const bool bwd = t->kind == TaskKind::B || t->kind == TaskKind::I;
      if (t->kind == TaskKind::F && t->stage == down) a += 'F';
      if (bwd && t->stage == up) a += 'B';
      if (t->kind == TaskKind::F && t->stage == up) b += 'F';
      if (bwd && t->stage == down) b += 'B';
    }
  return {a, b};
}

TEST(Generators, DualPipeVUsesOneChannelPatternOnEveryRank) {
  for (int p : {2, 3, 4, 7})
    for (int m : {2 * p, 2 * p + 3, 5 * p}) {
      const Schedule s = dualpipe_v(p, m);
      const auto ref = v_patterns(s, 0);
      for (int r = 1; r < p; ++r)
        EXPECT_EQ(v_patterns(s, r), ref) << " p=" << p << " m=" << m << " r=" << r;
    }
}

TEST(Generators, ZBVOrder) {
  const Schedule s = zb_v(2, 4);
  EXPECT_EQ(s.stage_rank, (std::vector<int32_t>{0, 1, 1, 0}));
  EXPECT_EQ(row(s, 0),
            "F0.0 F0.1 F3.0 F0.2 F3.1 I3.0 F3.2 I3.1 I0.0 W0.0 W3.0 F0.3 I0.1 I3.2 F3.3 W0.1 "
            "W3.1 I3.3 I0.2 W0.2 W3.2 W3.3 I0.3 W0.3");
  EXPECT_EQ(row(s, 1),
            "F1.0 F2.0 F1.1 F2.1 F1.2 F2.2 I2.0 I1.0 I2.1 W1.0 W2.0 I1.1 F1.3 F2.3 I2.2 W1.1 "
            "W2.1 I1.2 I2.3 W1.2 W2.2 I1.3 W1.3 W2.3");
}

// ZB-V runs its W passes in the steady state: along every rank's order the
// W passes it owes (I done, W not yet) stay at most ceil(3p/2) and the
// microbatches between F and I at most 2p+2 chunks, whatever m is. (The
// former order ran every W at the end: it owed 2m.)
TEST(Generators, ZBVBoundsWorkInFlight) {
  for (int p : {1, 2, 3, 4, 7, 16})
    for (int m : {2 * p, 8 * p, 64}) {
      const Schedule s = zb_v(p, m);
      for (int r = 0; r < p; ++r) {
        int owed = 0, held = 0, max_owed = 0, max_held = 0;
        for (const Action& a : s.rank_actions[r]) {
          ASSERT_FALSE(a.is_fused());
          const TaskKind k = a.first.kind;
          owed += k == TaskKind::I ? 1 : k == TaskKind::W ? -1 : 0;
          held += k == TaskKind::F ? 1 : k == TaskKind::I ? -1 : 0;
          max_owed = std::max(max_owed, owed);
          max_held = std::max(max_held, held);
        }
        EXPECT_LE(max_owed, (3 * p + 1) / 2) << "p=" << p << " m=" << m << " r=" << r;
        EXPECT_LE(max_held, 2 * p + 2) << "p=" << p << " m=" << m << " r=" << r;
      }
    }
}

// V-Min starts a stage-0 forward every 6 ticks (three down slots of rank 0);
// V-Half first runs ceil(p/3) of them back to back. Measured orders for p=2.
TEST(Generators, VMinAndVHalfOrders) {
  const Schedule vm = v_min(2, 4);
  EXPECT_EQ(vm.stage_rank, (std::vector<int32_t>{0, 1, 1, 0}));
  EXPECT_EQ(row(vm, 0),
            "F0.0 F3.0 I3.0 W3.0 F0.1 I0.0 W0.0 F3.1 I3.1 W3.1 F0.2 I0.1 W0.1 F3.2 I3.2 W3.2 "
            "F0.3 I0.2 W0.2 F3.3 I3.3 W3.3 I0.3 W0.3");
  EXPECT_EQ(row(vm, 1),
            "F1.0 F2.0 I2.0 I1.0 F1.1 F2.1 W1.0 W2.0 I2.1 I1.1 F1.2 F2.2 W1.1 W2.1 I2.2 I1.2 "
            "F1.3 F2.3 W1.2 W2.2 I2.3 I1.3 W1.3 W2.3");
  // For p <= 3 the burst is one forward: V-Half is V-Min.
  EXPECT_EQ(v_half(3, 6).rank_actions, v_min(3, 6).rank_actions);
  EXPECT_EQ(row(v_half(4, 4), 0), 
            "F0.0 F0.1 F7.0 F0.2 F7.1 I7.0 W7.0 I7.1 W7.1 F0.3 F7.2 I7.2 I0.0 W0.0 I0.1 W0.1 "
            "F7.3 I7.3 W7.2 W7.3 I0.2 W0.2 I0.3 W0.3");
}

// Between F and I of stage 0 a V-Min rank 0 holds at most ceil(2p/3) + 1
// microbatches, a V-Half one ceil(p/3) more, whatever m is.
TEST(Generators, VMinAndVHalfBoundWorkInFlight) {
  for (int p : {1, 2, 3, 4, 7, 12})
    for (int m : {p, 2 * p, 8 * p}) {
      for (const bool half : {false, true}) {
        const Schedule s = half ? v_half(p, m) : v_min(p, m);
        int held = 0, max_held = 0;
        for (const Action& a : s.rank_actions[0]) {
          ASSERT_FALSE(a.is_fused());
          if (a.first.stage != 0) continue;
          held += a.first.kind == TaskKind::F ? 1 : a.first.kind == TaskKind::I ? -1 : 0;
          max_held = std::max(max_held, held);
        }
        const int bound = (2 * p + 2) / 3 + 1 + (half ? (p + 2) / 3 : 0);
        EXPECT_LE(max_held, bound) << s.name << " p=" << p << " m=" << m;
      }
    }
}

TEST(Generators, DualPipeVOrder) {
  const Schedule s = dualpipe_v(3, 6);
  EXPECT_EQ(row(s, 0),
            "F0.0 F0.1 F0.2 F0.3 F5.0 F5.1 I5.0 W5.0 F0.4 F5.2 I5.1 W5.1 F0.5+B5.2 F5.3+B0.0 B5.3 "
            "F5.4+B0.1 "
            "B5.4 F5.5+B0.2 B5.5 I0.3 W0.3 I0.4 W0.4 I0.5 W0.5");
  EXPECT_EQ(row(s, 2),
            "F2.0 F3.0 F2.1 F3.1 F2.2 F3.2 F2.3 B3.0 F3.3+B2.0 F2.4+B3.1 F3.4+B2.1 F2.5+B3.2 "
            "F3.5+B2.2 B3.3 "
            "B2.3 B3.4 I2.4 I3.5 I2.5 W2.4 W3.5 W2.5");
  // Fused actions pair a forward with a backward of the other chunk.
  for (const Action& a : s.rank_actions[1])
    if (a.is_fused()) {
      EXPECT_EQ(a.first.kind, TaskKind::F);
      EXPECT_EQ(a.second.kind, TaskKind::B);
      EXPECT_NE(a.first.stage, a.second.stage);
    }
}

TEST(Generators, SingleRank) {
  for (const auto& n : schedule_names()) {
    const int m = 3;
    const Schedule s = make_schedule(n, 1, m);
    EXPECT_NO_THROW(s.validate()) << n;
    const bool vshape = n == "zbv" || n == "vmin" || n == "vhalf" || n == "dualpipev";
    EXPECT_EQ(s.num_stages, vshape ? 2 : 1) << n;
  }
  EXPECT_EQ(row(dualpipe_v(1, 2), 0), "F0.0 F1.0 F0.1 B1.0 F1.1+B0.0 B1.1 I0.1 W0.1");
}

TEST(Generators, NameLookupIgnoresCaseAndSeparators) {
  EXPECT_EQ(make_schedule("ZB-H1", 2, 4), zb_h1(2, 4));
  EXPECT_EQ(make_schedule("zb_h2", 2, 4), zb_h2(2, 4));
  EXPECT_EQ(make_schedule("Eager-1F1B", 3, 4), eager_one_f_one_b(3, 4));
  EXPECT_EQ(make_schedule("DualPipeV", 2, 4), dualpipe_v(2, 4));
  EXPECT_EQ(make_schedule("Interleaved_1F1B", 2, 4, 2), interleaved_one_f_one_b(2, 4, 2));
  EXPECT_EQ(make_schedule("V-Min", 3, 6), v_min(3, 6));
  EXPECT_EQ(make_schedule("v_half", 3, 6), v_half(3, 6));
  EXPECT_EQ(schedule_names().size(), 10u);
}

TEST(Generators, Refusals) {
  expect_schedule_error([] { make_schedule("pipedream", 2, 4); },
                        "unknown schedule 'pipedream' (known: gpipe, 1f1b");
  expect_schedule_error([] { gpipe(0, 4); }, "gpipe needs ranks >= 1 (got ranks=0)");
  expect_schedule_error([] { one_f_one_b(2, 0); },
                        "1f1b needs microbatches >= 1 (got microbatches=0)");
  expect_schedule_error([] { zb_v(-1, 4); }, "zbv needs ranks >= 1 (got ranks=-1)");
  expect_schedule_error([] { dualpipe_v(4, 7); },
                        "dualpipev needs microbatches >= 2*ranks (got ranks=4, microbatches=7)");
  expect_schedule_error(
      [] { interleaved_one_f_one_b(4, 6, 2); },
      "interleaved needs microbatches to be a multiple of ranks, or at most ranks "
      "(got ranks=4, microbatches=6, v=2)");
  expect_schedule_error([] { interleaved_one_f_one_b(4, 8, 0); }, "virtual stages >= 1 (got v=0)");
  expect_schedule_error(
      [] { gpipe(4096, 4096); },
      "gpipe is too large: stages*microbatches = 16777216 (ranks=4096, microbatches=4096)");
  expect_schedule_error([] { interleaved_one_f_one_b(1024, 1024, 8); },
                        "stages*microbatches = 8388608");
  expect_schedule_error([] { zb_v(1024, 4096); }, "stages*microbatches = 8388608");
  expect_schedule_error([] { v_min(0, 4); }, "vmin needs ranks >= 1 (got ranks=0)");
  expect_schedule_error([] { v_half(2, 0); }, "vhalf needs microbatches >= 1 (got microbatches=0)");
  for (const char* n :
       {"gpipe", "1f1b", "eager1f1b", "zbh1", "zbh2", "zbv", "vmin", "vhalf", "dualpipev"})
    expect_schedule_error([n] { make_schedule(n, 2, 4, 2); },
                          std::string("schedule '") + n + "' takes no virtual stages (got v=2)");
}

}  // namespace
}  // namespace baton
