// Bubble and memory formulas of every generator (docs/SCHEDULES.md), checked
// through the whole pipeline: generate -> lower -> verify -> simulate.
// Equal costs per stage, no communication cost. For the interleaved and V
// schedules each stage is a chunk, so chunk costs are 1/v (1/2) of a
// full-rank stage. Peak activation is in units of stash_bytes (= 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "baton/cost.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/sim.h"
#include "baton/verify.h"

namespace baton {
namespace {

std::string label(const std::string& n, int p, int m, int v = 1) {
  return n + " p=" + std::to_string(p) + " m=" + std::to_string(m) + " v=" + std::to_string(v);
}

SimResult run(const Schedule& s, const CostModel& c) {
  const Plan plan = lower(s);
  const VerifyReport rep = verify(plan);
  EXPECT_TRUE(rep.ok()) << s.name << ": " << rep.to_string();
  return simulate(plan, c);
}

// Idle time of rank r between the start of its first RUN and the end of its
// last one.
double idle_inside(const SimResult& res, int r) {
  double first = 1e300, last = -1e300;
  for (const RunEvent& e : res.runs)
    if (e.rank == r) {
      first = std::min(first, e.start);
      last = std::max(last, e.end);
    }
  return (last - first) - res.busy[r];
}

constexpr double kEps = 1e-9;

// F=1, B=2 (I=W=1) on a full-rank stage.
const CostModel kUnit = CostModel::uniform(1, 2, 1, 1);
// The same on a half stage (the chunks of the V schedules).
const CostModel kHalf = CostModel::uniform(0.5, 1, 0.5, 0.5);

TEST(ScheduleFormulas, EveryGeneratorVerifies) {
  for (const auto& n : schedule_names())
    for (int p : {1, 2, 3, 4, 6})
      for (int m : {1, 2, 3, 5, 6, 8, 12, 13}) {
        for (int v : {1, 2, 3}) {
          if (v > 1 && n != "interleaved") continue;
          if (n == "interleaved" && v > 1 && m % p && m > p) continue;
          if (n == "dualpipev" && m < 2 * p) continue;
          SCOPED_TRACE(label(n, p, m, v));
          const VerifyReport rep = verify(lower(make_schedule(n, p, m, v)));
          EXPECT_TRUE(rep.ok()) << rep.to_string();
        }
      }
}

TEST(ScheduleFormulas, LargeConfigurationsVerify) {
  for (const auto& n : schedule_names()) {
    const int v = n == "interleaved" ? 2 : 1;
    SCOPED_TRACE(n);
    const VerifyReport rep = verify(lower(make_schedule(n, 16, 64, v)));
    EXPECT_TRUE(rep.ok()) << rep.to_string();
  }
}

// The verifier's fifo model has one channel per buffer kind, but every
// built-in order also keeps a single order per link across kinds: on every
// rank pair the sequence of SENDs equals the sequence of RECVs. So a
// transport with one channel per rank pair runs the built-in schedules too.
TEST(ScheduleFormulas, BuiltInOrdersKeepOneOrderPerLink) {
  for (const auto& n : schedule_names())
    for (int p : {2, 3, 4, 7})
      for (int m : {p, 2 * p, 3 * p + 1, 6 * p}) {
        const int v = n == "interleaved" ? 2 : 1;
        if ((n == "interleaved" && m % p) || (n == "dualpipev" && m < 2 * p)) continue;
        SCOPED_TRACE(label(n, p, m, v));
        const Plan plan = lower(make_schedule(n, p, m, v));
        std::vector<std::vector<int32_t>> sent(p * p), received(p * p);
        for (int r = 0; r < p; ++r)
          for (const Instr& in : plan.programs[r]) {
            if (in.op == OpCode::Send) sent[r * p + in.peer].push_back(in.buffer);
            if (in.op == OpCode::Recv) received[in.peer * p + r].push_back(in.buffer);
          }
        EXPECT_EQ(sent, received);
      }
}

TEST(ScheduleFormulas, GPipeAnd1F1BBubble) {
  for (const char* n : {"gpipe", "1f1b", "eager1f1b"})
    for (int p : {1, 2, 3, 4, 7})
      for (int m : {1, 2, 4, 7, 16}) {
        SCOPED_TRACE(label(n, p, m));
        const SimResult r = run(make_schedule(n, p, m), kUnit);
        EXPECT_NEAR(r.bubble_fraction, double(p - 1) / (m + p - 1), kEps);
        EXPECT_NEAR(r.step_time, 3.0 * (m + p - 1), kEps);
      }
}

TEST(ScheduleFormulas, InterleavedBubble) {
  for (int p : {1, 2, 3, 4})
    for (int v : {1, 2, 3, 4})
      for (int k : {1, 2, 3}) {
        const int m = k * p;
        SCOPED_TRACE(label("interleaved", p, m, v));
        const SimResult r =
            run(interleaved_one_f_one_b(p, m, v), CostModel::uniform(1.0 / v, 2.0 / v, 1, 1));
        EXPECT_NEAR(r.bubble_fraction, double(p - 1) / (v * m + p - 1), kEps);
      }
}

TEST(ScheduleFormulas, ZBH1BubbleIsAThirdOf1F1B) {
  for (int p : {2, 3, 4, 6})
    for (int m : {p, p + 1, 2 * p, 3 * p + 1}) {
      SCOPED_TRACE(label("zbh1", p, m));
      const double work = 3.0 * m;  // F + I + W per microbatch
      const double zb = run(zb_h1(p, m), kUnit).step_time - work;
      const double base = run(one_f_one_b(p, m), kUnit).step_time - work;
      EXPECT_NEAR(zb, base / 3, kEps);
      EXPECT_NEAR(zb, p - 1.0, kEps);  // (p-1)(F+I-W)
    }
}

TEST(ScheduleFormulas, ZBH2HasNoBubbleButTheFill) {
  for (int p : {1, 2, 3, 4, 6})
    for (int m : {p, 2 * p - 1, 2 * p, 3 * p + 2}) {
      SCOPED_TRACE(label("zbh2", p, m));
      const SimResult r = run(zb_h2(p, m), kUnit);
      // Makespan = work of one rank + the fill of the last rank.
      EXPECT_NEAR(r.step_time, 3.0 * m + (p - 1), kEps);
      if (m >= 2 * p - 1) {
        for (int k = 0; k < p; ++k) EXPECT_NEAR(idle_inside(r, k), 0.0, kEps) << "rank " << k;
      }
    }
}

TEST(ScheduleFormulas, ZBVHasNoBubbleButTheFill) {
  for (int p : {1, 2, 3, 4, 6, 9})
    for (int m : {p, 2 * p, 2 * p + 1, 3 * p + 2, 4 * p, 8 * p}) {
      SCOPED_TRACE(label("zbv", p, m));
      const SimResult r = run(zb_v(p, m), kHalf);
      // Work per rank: two chunks of F+I+W = 3 per microbatch; fill: p-1
      // chunk forwards. Rank k starts at k chunk forwards and every rank
      // ends at the same time, so it idles (p-1-k) forwards in between.
      EXPECT_NEAR(r.step_time, 3.0 * m + 0.5 * (p - 1), kEps);
      for (int k = 0; k < p; ++k) {
        EXPECT_NEAR(r.busy[k], 3.0 * m, kEps);
        EXPECT_NEAR(idle_inside(r, k), 0.5 * (p - 1 - k), kEps) << "rank " << k;
      }
    }
  // Between p and 2p microbatches the tail is longer (measured, e.g. p = 7,
  // m = 10: 9 chunk forwards instead of 6).
  EXPECT_NEAR(run(zb_v(7, 10), kHalf).step_time, 3.0 * 10 + 0.5 * 9, kEps);
}

TEST(ScheduleFormulas, DualPipeVBubble) {
  for (int p : {1, 2, 3, 4, 5, 8})
    for (int m : {2 * p, 2 * p + 1, 3 * p, 5 * p}) {
      SCOPED_TRACE(label("dualpipev", p, m));
      const SimResult r = run(dualpipe_v(p, m), kHalf);
      // Bubble per rank in chunk forwards (F = 0.5): 2p for p >= 3, 3 for
      // p = 2, none for p = 1; rank r idles 2p - r of it between its first
      // and last action.
      const double bubble_f = p == 1 ? 0 : p == 2 ? 3 : 2.0 * p;
      EXPECT_NEAR(r.step_time, 3.0 * m + 0.5 * bubble_f, kEps);
      if (p >= 3) {
        for (int k = 0; k < p; ++k)
          EXPECT_NEAR(idle_inside(r, k), 0.5 * (2 * p - k), kEps) << "rank " << k;
      }
    }
}

std::vector<int64_t> peaks(const Schedule& s, const CostModel& c) {
  return run(s, c).peak_activation;
}

// ZB-V peak stash in chunks once m >= 2p+1 (measured): rank r < p-1 holds
// floor(3p/2) + 2 + ceil(r/2), the last rank 2p+2.
std::vector<int64_t> zbv_stash_peaks(int p) {
  std::vector<int64_t> v;
  for (int r = 0; r < p; ++r) v.push_back(r == p - 1 ? 2 * p + 2 : 3 * p / 2 + 2 + (r + 1) / 2);
  return v;
}

TEST(ScheduleFormulas, PeakActivation) {
  for (int p : {1, 2, 3, 5})
    for (int m : {1, 2, p, 2 * p, 3 * p + 1}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      std::vector<int64_t> gp, fb, eg, h1;
      for (int r = 0; r < p; ++r) {
        gp.push_back(m);
        fb.push_back(std::min(p - r, m));
        eg.push_back(std::min(2 * (p - r) - 1, m));
        h1.push_back(std::min(p - r, m));
      }
      EXPECT_EQ(peaks(gpipe(p, m), kUnit), gp);
      EXPECT_EQ(peaks(one_f_one_b(p, m), kUnit), fb);
      EXPECT_EQ(peaks(eager_one_f_one_b(p, m), kUnit), eg);
      EXPECT_EQ(peaks(zb_h1(p, m), kUnit), h1);
      if (m >= 2 * p - 1) {
        std::vector<int64_t> h2;
        for (int r = 0; r < p; ++r) h2.push_back(2 * (p - r) - 1);
        EXPECT_EQ(peaks(zb_h2(p, m), kUnit), h2);
      }
      if (m >= 2 * p + 1) {
        EXPECT_EQ(peaks(zb_v(p, m), kHalf), zbv_stash_peaks(p));
      }
      if (m >= 2 * p) {
        EXPECT_EQ(peaks(dualpipe_v(p, m), kHalf), std::vector<int64_t>(p, 2 * p + 1));
      }
    }
}

// Controllable memory (Qi et al., NeurIPS 2024) on unit costs: the model is
// cut in 2p chunks for the V schedules and in p stages of two chunks for
// 1F1B, so 1F1B's peak of p stages is 2p chunks. V-Min holds about a third of
// it (at most ceil(2p/3) + 2 chunks), V-Half about a half (at most p + 2),
// both for every m, and both finish no later than 1F1B.
TEST(ScheduleFormulas, VMinAndVHalfMemoryRelativeTo1F1B) {
  for (int p : {2, 3, 4, 5, 6, 8, 12})
    for (int m : {p, 2 * p, 4 * p, 8 * p}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const SimResult base = run(one_f_one_b(p, m), kUnit);
      const int64_t base_chunks = 2 * *std::max_element(base.peak_activation.begin(),
                                                        base.peak_activation.end());
      ASSERT_EQ(base_chunks, 2 * p);
      const SimResult vmin = run(v_min(p, m), kHalf);
      const SimResult vhalf = run(v_half(p, m), kHalf);
      const int64_t pmin = *std::max_element(vmin.peak_activation.begin(),
                                             vmin.peak_activation.end());
      const int64_t phalf = *std::max_element(vhalf.peak_activation.begin(),
                                              vhalf.peak_activation.end());
      EXPECT_LE(pmin, (2 * p + 2) / 3 + 2);
      EXPECT_LE(phalf, p + 2);
      EXPECT_LE(pmin, phalf);
      if (p >= 8) {  // the ratios approach 1/3 and 1/2 as p grows
        EXPECT_LE(double(pmin) / base_chunks, 0.43);
        EXPECT_LE(double(phalf) / base_chunks, 0.63);
      }
      EXPECT_LE(vmin.step_time, base.step_time + kEps);
      EXPECT_LE(vhalf.step_time, vmin.step_time + kEps);
      // Same work as every V schedule: 3 per microbatch per rank.
      for (int r = 0; r < p; ++r) EXPECT_NEAR(vmin.busy[r], 3.0 * m, kEps);
    }
  // The memory ZB-V spends instead: about 1F1B's (2p + 2 chunks).
  EXPECT_EQ(peaks(zb_v(8, 32), kHalf).back(), 18);
}

// Step time (chunk f = 0.5): V-Min 3m + 2p - 2.5, i.e. a bubble of (4p-5)f,
// about 2/3 of 1F1B's 3(p-1); V-Half saves 2 per burst forward after the
// first (b = min(ceil(p/3), m)). Swept for p <= 16.
TEST(ScheduleFormulas, VMinAndVHalfBubble) {
  for (int p = 2; p <= 16; ++p)
    for (int m : {1, 2, p, p + 1, 2 * p, 3 * p + 1, 8 * p}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const int b = std::min((p + 2) / 3, m);
      EXPECT_NEAR(run(v_min(p, m), kHalf).step_time, 3.0 * m + 2 * p - 2.5, kEps);
      EXPECT_NEAR(run(v_half(p, m), kHalf).step_time, 3.0 * m + 2 * p - 2.5 - 2 * (b - 1), kEps);
    }
  for (int m : {1, 4}) EXPECT_NEAR(run(v_min(1, m), kHalf).step_time, 3.0 * m, kEps);
}

TEST(ScheduleFormulas, InterleavedPeakActivation) {
  for (int p : {1, 2, 3, 4})
    for (int v : {2, 3})
      for (int m : {1, p, 2 * p, 3 * p}) {
        if (m % p && m > p) continue;
        SCOPED_TRACE(label("interleaved", p, m, v));
        const int g = std::min(p, m);
        std::vector<int64_t> want;
        for (int r = 0; r < p; ++r)
          want.push_back(std::min(2 * (p - r - 1) + (v - 1) * g + 1, v * m));
        EXPECT_EQ(
            peaks(interleaved_one_f_one_b(p, m, v), CostModel::uniform(1.0 / v, 2.0 / v, 1, 1)),
            want);
      }
}

// With the zero-bubble memory model (I keeps as much for W as F kept for I),
// ZB-H1 holds p+1 microbatches on every rank at its peak, ZB-H2 2p.
TEST(ScheduleFormulas, ZeroBubbleMemoryWithWeightStash) {
  CostModel c = kUnit;
  c.default_stage.wstash_bytes = 1;
  for (int p : {2, 3, 5})
    for (int m : {2 * p, 3 * p}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      EXPECT_EQ(peaks(zb_h1(p, m), c), std::vector<int64_t>(p, p + 1));
      EXPECT_EQ(peaks(zb_h2(p, m), c), std::vector<int64_t>(p, 2 * p));
    }
}

// ZB-V runs its W passes in the steady state, so what I keeps for W does not
// pile up: with wstash_bytes = stash_bytes the peak per rank is the same for
// every m from 2p+1 to 8p (rank r: floor(5p/2) + 3 + ceil(r/2) chunks), and
// no more at m = 2p. The bubble stays the fill (ZBVHasNoBubbleButTheFill).
TEST(ScheduleFormulas, ZBVMemoryWithWeightStashIsBounded) {
  CostModel c = kHalf;
  c.default_stage.wstash_bytes = 1;
  for (int p : {1, 2, 3, 4, 5, 8}) {
    std::vector<int64_t> want;
    for (int r = 0; r < p; ++r) want.push_back(5 * p / 2 + 3 + (r + 1) / 2);
    for (int m : {2 * p + 1, 3 * p, 4 * p, 6 * p + 1, 8 * p}) {
      SCOPED_TRACE(label("zbv", p, m));
      EXPECT_EQ(peaks(zb_v(p, m), c), want);
    }
    const std::vector<int64_t> at_2p = peaks(zb_v(p, 2 * p), c);
    for (int r = 0; r < p; ++r) EXPECT_LE(at_2p[r], want[r]) << "p=" << p << " rank " << r;
  }
}

}  // namespace
}  // namespace baton
