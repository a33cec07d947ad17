// Automatic planning (autoplan.h): segment cost JSON and scaling, the stage
// model, and the search against brute force on small random instances.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "baton/autoplan.h"
#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/sim.h"
#include "baton/verify.h"

namespace baton {
namespace {

SegmentCosts sample_costs() {
  SegmentCosts c;
  c.batch = 64;
  c.ref_microbatch = 8;
  c.link = {0.5, 100.0};
  c.fused_factor = 0.9;
  c.task_overhead = 0.5;
  c.step_overhead = 0.125;
  c.host_link_bandwidth = 250.0;
  for (int k = 0; k < 4; ++k) {
    SegmentCost s;
    s.name = "layer" + std::to_string(k);
    s.f = 1.0 + k;
    s.b = 2.0 + k;
    s.i = 1.25 + k;
    s.w = 0.75;
    s.overhead = 0.25;
    s.update = k == 3 ? 0.7 : 0.1 * (k + 1);
    s.act_bytes = 100 * (k + 1);
    s.stash_bytes = 400 + k;
    s.min_stash_bytes = 50 + k;
    s.min_recompute = 0.5;
    s.wstash_bytes = 30;
    s.param_bytes = 1000 * (k + 1);
    s.opt_bytes = 2000 * (k + 1);
    s.temp_bytes = 70 * (4 - k);
    c.segments.push_back(s);
  }
  return c;
}

template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(AutoplanJson, RoundTrip) {
  const SegmentCosts c = sample_costs();
  const SegmentCosts d = SegmentCosts::from_json(c.to_json());
  EXPECT_EQ(d.batch, c.batch);
  EXPECT_EQ(d.ref_microbatch, c.ref_microbatch);
  EXPECT_EQ(d.link, c.link);
  EXPECT_EQ(d.host_link_bandwidth, c.host_link_bandwidth);
  EXPECT_EQ(d.fused_factor, c.fused_factor);
  EXPECT_EQ(d.segments, c.segments);
}

TEST(AutoplanJson, DefaultsAndErrors) {
  const SegmentCosts d = SegmentCosts::from_json(R"({"segments": [{"f": 1, "b": 3}]})");
  EXPECT_EQ(d.batch, 1);
  EXPECT_EQ(d.segments[0].i, 3.0);  // i defaults to b
  EXPECT_EQ(d.segments[0].w, 0.0);
  EXPECT_NE(error_of<FormatError>([] {
              SegmentCosts::from_json(R"({"segments": [{"f": 1}, {"f": 1, "q": 2}]})");
            }).find("'segments[1].q'"),
            std::string::npos);
  EXPECT_NE(error_of<FormatError>([] {
              SegmentCosts::from_json(R"({"segments": [{"f": 1}, {"f": 1}, {"b": "x"}]})");
            }).find("'segments[2].b' must be a number"),
            std::string::npos);
  EXPECT_NE(error_of<FormatError>([] {
              SegmentCosts::from_json(R"({"segments": [{"act_bytes": 1.5}]})");
            }).find("'segments[0].act_bytes'"),
            std::string::npos);
  EXPECT_NE(error_of<ConfigError>([] {
              SegmentCosts::from_json(R"({"segments": [{"f": 1}, {"f": 1}, {"f": 1}, {"f": -1}]})");
            }).find("segments[3].f"),
            std::string::npos);
  EXPECT_NE(error_of<FormatError>([] {
              SegmentCosts::from_json(R"({"batch": 4})");
            }).find("'segments' is required"),
            std::string::npos);
  EXPECT_NE(error_of<FormatError>([] {
              SegmentCosts::from_json(R"({"link": {"lat": 1}})");
            }).find("'link.lat'"),
            std::string::npos);
  EXPECT_NE(error_of<ConfigError>([] {
              SegmentCosts::from_json(R"({"batch": 0, "segments": [{}]})");
            }).find("batch"),
            std::string::npos);
  try {
    SegmentCosts::from_json("{\n  \"segments\": [,]\n}");
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.line, 2);
  }
}

TEST(AutoplanStage, Scaling) {
  const SegmentCosts c = sample_costs();
  // M = 2: 32 samples per microbatch, k = 32 / 8 = 4.
  const SegmentCosts s = c.scaled(2);
  EXPECT_EQ(s.ref_microbatch, 32);
  EXPECT_DOUBLE_EQ(s.segments[1].f, 0.25 + (2.0 - 0.25) * 4);
  EXPECT_DOUBLE_EQ(s.segments[1].w, 0.25 + 0.5 * 4);
  EXPECT_DOUBLE_EQ(s.segments[1].min_recompute, 2.0);
  EXPECT_EQ(s.segments[1].act_bytes, 800);
  EXPECT_EQ(s.segments[1].stash_bytes, 401 * 4);
  EXPECT_EQ(s.segments[1].temp_bytes, 210 * 4);
  EXPECT_EQ(s.segments[1].param_bytes, 2000);  // unscaled
  EXPECT_EQ(s.segments[1].opt_bytes, 4000);
  // M = 16: 4 samples, k = 0.5.
  EXPECT_DOUBLE_EQ(c.scaled(16).segments[0].f, 0.25 + 0.75 * 0.5);
  EXPECT_THROW(c.scaled(3), ConfigError);
  EXPECT_THROW(c.scaled(0), ConfigError);
}

TEST(AutoplanStage, Aggregation) {
  const SegmentCosts c = sample_costs();
  // Two segments in one stage: each task kind pays task_overhead (0.5) once.
  const StageCost k = stage_cost(c, 1, 3, Remat::Keep);
  EXPECT_DOUBLE_EQ(k.f, 2.0 + 3.0 - 0.5);
  EXPECT_DOUBLE_EQ(k.b, 3.0 + 4.0 - 0.5);
  EXPECT_DOUBLE_EQ(k.i, 2.25 + 3.25 - 0.5);
  EXPECT_DOUBLE_EQ(k.w, 1.5 - 0.5);
  EXPECT_EQ(k.act_bytes, 300);   // last segment's output
  EXPECT_EQ(k.grad_bytes, 100);  // output of the segment before the stage
  EXPECT_EQ(k.stash_bytes, 401 + 402);
  EXPECT_EQ(k.wstash_bytes, 60);
  EXPECT_EQ(k.wgrad_bytes, 2000 + 3000);
  EXPECT_EQ(k.fb, 0.0);
  const StageCost m = stage_cost(c, 1, 3, Remat::Min);
  EXPECT_EQ(m.stash_bytes, 51 + 52);
  EXPECT_DOUBLE_EQ(m.b, 6.5 + 1.0);
  EXPECT_DOUBLE_EQ(m.i, 5.0 + 1.0);
  const StageCost f = stage_cost(c, 1, 3, Remat::Full);
  EXPECT_EQ(f.stash_bytes, 100);
  EXPECT_DOUBLE_EQ(f.b, 6.5 + 4.5);
  EXPECT_DOUBLE_EQ(f.i, 5.0 + 4.5);
  EXPECT_DOUBLE_EQ(stage_cost(c, 1, 2, Remat::Keep).f, 2.0);  // one segment: as measured
  // The saving is clamped per kind to the smallest segment time of that kind,
  // so a stage never gets cheaper by taking another segment.
  SegmentCosts big = c;
  big.task_overhead = 5.0;
  EXPECT_EQ(big.tasks_saved(), (std::array<double, 4>{1.0, 2.0, 1.25, 0.75}));
  EXPECT_DOUBLE_EQ(stage_cost(big, 0, 4, Remat::Keep).w, 4 * 0.75 - 3 * 0.75);
  EXPECT_EQ(stage_cost(c, 0, 1, Remat::Keep).grad_bytes, 0);
  EXPECT_EQ(stage_cost(c, 0, 1, Remat::Full).stash_bytes, 0);
  EXPECT_EQ(stage_static_bytes(c, 1, 3), 2 * 5000 + 10000);
  EXPECT_EQ(stage_temp_bytes(c, 1, 3), 210 + 2000 + 3000);  // temps, new sums
  EXPECT_THROW(stage_cost(c, 2, 2, Remat::Keep), ConfigError);
  const CostModel cm = stage_cost_model(c, {0, 1, 3}, {Remat::Keep, Remat::Min, Remat::Full});
  ASSERT_EQ(cm.stages.size(), 3u);
  EXPECT_EQ(cm.stages[1], m);
  EXPECT_EQ(cm.stages[2], stage_cost(c, 3, 4, Remat::Full));
  EXPECT_EQ(cm.fused_factor, 0.9);
  EXPECT_EQ(cm.link, c.link);
}

TEST(AutoplanStage, FullRematPerLayerKeepsEachLayersInput) {
  SegmentCosts c = sample_costs();
  // Without full_stash_bytes a Full stage keeps its input only (above); with it on every
  // segment of the stage (each layer checkpointed on its own) it keeps their sum.
  c.segments[1].full_stash_bytes = 70;
  EXPECT_EQ(stage_cost(c, 1, 3, Remat::Full).stash_bytes, 100);  // segment 2 has none
  c.segments[2].full_stash_bytes = 90;
  const StageCost f = stage_cost(c, 1, 3, Remat::Full);
  EXPECT_EQ(f.stash_bytes, 70 + 90);
  EXPECT_DOUBLE_EQ(f.b, 6.5 + 4.5);  // the time is the same: every forward again
  EXPECT_EQ(stage_cost(c, 1, 3, Remat::Keep).stash_bytes, 401 + 402);
  // Scaled with the microbatch, written to and read from JSON, negative refused.
  EXPECT_EQ(c.scaled(2).segments[1].full_stash_bytes, 70 * 4);
  const SegmentCosts back = SegmentCosts::from_json(c.to_json());
  EXPECT_EQ(back.segments, c.segments);
  EXPECT_EQ(SegmentCosts::from_json(sample_costs().to_json()).segments[1].full_stash_bytes, -1);
  EXPECT_NE(error_of<ConfigError>([] {
              SegmentCosts::from_json(R"({"segments": [{"full_stash_bytes": -2}]})");
            }).find("full_stash_bytes"),
            std::string::npos);
}

TEST(AutoplanStage, RematHoldsOneUnitsRecomputationAtOnce) {
  SegmentCosts c = sample_costs();
  c.segments[1].min_transient_bytes = 300;
  c.segments[1].full_transient_bytes = 380;
  c.segments[2].full_transient_bytes = 395;
  // The stage's largest unit, per remat; nothing under keep.
  EXPECT_EQ(stage_transient_bytes(c, 1, 3, Remat::Keep), 0);
  EXPECT_EQ(stage_transient_bytes(c, 1, 3, Remat::Min), 300);
  EXPECT_EQ(stage_transient_bytes(c, 1, 3, Remat::Full), 395);
  EXPECT_EQ(c.scaled(2).segments[2].full_transient_bytes, 395 * 4);
  EXPECT_EQ(SegmentCosts::from_json(c.to_json()).segments, c.segments);
  EXPECT_NE(error_of<ConfigError>([] {
              SegmentCosts::from_json(R"({"segments": [{"min_transient_bytes": -1}]})");
            }).find("min_transient_bytes"),
            std::string::npos);
  // A candidate's peak holds it beside the stage's temporaries: rank 0 of ZB-V holds
  // stages 0 and 3, the first two ranks' stages 1 and 2 (cuts 0, 1, 2, 3).
  const std::vector<int> cuts{0, 1, 2, 3};
  const std::vector<Remat> rm{Remat::Keep, Remat::Min, Remat::Full, Remat::Full};
  const PlanCandidate none = evaluate_candidate(sample_costs(), "zbv", 2, 2, 4, cuts, rm, 0, true);
  const PlanCandidate with = evaluate_candidate(c, "zbv", 2, 2, 4, cuts, rm, 0, true);
  EXPECT_EQ(with.peak_memory[0], none.peak_memory[0]);  // stages 0 and 3 have none
  const SegmentCosts s = sample_costs().scaled(4);
  const int64_t t1 = stage_temp_bytes(s, 1, 2), t2 = stage_temp_bytes(s, 2, 3);
  // Rank 1, at microbatches of twice the reference: the larger of stage 1's temporaries
  // + 300 x 2 (min) and stage 2's + 395 x 2 (full).
  EXPECT_EQ(with.peak_memory[1] - none.peak_memory[1],
            std::max(t1 + 300 * 2, t2 + 395 * 2) - std::max(t1, t2));
  EXPECT_EQ(with.step_time, none.step_time);
}

TEST(AutoplanStage, EvaluateMatchesSimulator) {
  const SegmentCosts c = sample_costs();
  const std::vector<int> cuts{0, 1, 2, 3};
  const std::vector<Remat> rm{Remat::Keep, Remat::Min, Remat::Keep, Remat::Full};
  const PlanCandidate p = evaluate_candidate(c, "zbv", 2, 2, 4, cuts, rm, 0, true);
  const SimResult r = simulate(lower(zb_v(2, 4)), stage_cost_model(c.scaled(4), cuts, rm));
  // Plus the update after the loop: rank 0 (stages 0 and 3) 0.1 + 0.7, rank 1
  // 0.2 + 0.3; plus step_overhead.
  EXPECT_DOUBLE_EQ(p.step_time, r.step_time + 0.8 + 0.125);
  EXPECT_DOUBLE_EQ(update_time(c, cuts, {0, 1, 1, 0}, 2), 0.8 + 0.125);
  const SegmentCosts s = c.scaled(4);
  // Rank 0 holds stages 0 and 3.
  EXPECT_EQ(p.peak_memory[0], stage_static_bytes(s, 0, 1) + stage_static_bytes(s, 3, 4) +
                                  std::max(stage_temp_bytes(s, 0, 1), stage_temp_bytes(s, 3, 4)) +
                                  r.peak_total[0]);
  EXPECT_EQ(p.virtual_stages, 2);
  // Without donation the update after the loop allocates the new parameters
  // and optimizer state beside the old ones: rank 0 (stages 0 and 3) then
  // peaks at static + (1000 + 2000) + (4000 + 8000), above its loop.
  EXPECT_EQ(stage_update_bytes(s, 3, 4), 4000 + 8000);
  const PlanCandidate q = evaluate_candidate(c, "zbv", 2, 2, 4, cuts, rm);
  const int64_t statics = stage_static_bytes(s, 0, 1) + stage_static_bytes(s, 3, 4);
  ASSERT_GT(15000, p.peak_memory[0] - statics);
  EXPECT_EQ(q.peak_memory[0], statics + 15000);
  EXPECT_EQ(q.step_time, p.step_time);
}

TEST(AutoplanStage, DualPipeVHoldsTheWeightStashBetweenIAndW) {
  // DualPipeV's B tasks (its overlapped pairs) run as I then W because the
  // schedule also has I and W tasks: I's weight stash is live while W runs.
  EXPECT_TRUE(runs_b_as_i_then_w(dualpipe_v(2, 4)));
  EXPECT_FALSE(runs_b_as_i_then_w(zb_v(2, 4)));         // I and W only
  EXPECT_FALSE(runs_b_as_i_then_w(one_f_one_b(2, 4)));  // B only
  const SegmentCosts c = sample_costs();
  EXPECT_EQ(stage_temp_bytes(c, 1, 3, true), 210 + 2000 + 3000 + 2 * 30);
  const std::vector<int> cuts{0, 1, 2, 3};
  const std::vector<Remat> rm(4, Remat::Keep);
  const PlanCandidate p = evaluate_candidate(c, "dualpipev", 2, 2, 4, cuts, rm, 0, true);
  const SimResult r = simulate(lower(dualpipe_v(2, 4)), stage_cost_model(c.scaled(4), cuts, rm));
  const SegmentCosts s = c.scaled(4);
  EXPECT_EQ(p.peak_memory[0],
            stage_static_bytes(s, 0, 1) + stage_static_bytes(s, 3, 4) +
                std::max(stage_temp_bytes(s, 0, 1, true), stage_temp_bytes(s, 3, 4, true)) +
                r.peak_total[0]);
}

TEST(AutoplanStage, ParseBytes) {
  EXPECT_EQ(parse_bytes("20GiB"), int64_t{20} << 30);
  EXPECT_EQ(parse_bytes("1.5GB"), 1500000000);
  EXPECT_EQ(parse_bytes("512 MiB"), int64_t{512} << 20);
  EXPECT_EQ(parse_bytes("1e9"), 1000000000);
  EXPECT_EQ(parse_bytes("123"), 123);
  EXPECT_EQ(parse_bytes("4kb"), 4000);
  EXPECT_THROW(parse_bytes("lots"), ConfigError);
  EXPECT_THROW(parse_bytes("3 parsecs"), ConfigError);
  EXPECT_THROW(parse_bytes("-1GB"), ConfigError);
}

// ---- brute force ----

struct Space {
  std::vector<std::string> families;
  std::vector<int> microbatches;
  std::vector<Remat> modes;
};

// Every (family, v, M, partition, remat) candidate, evaluated by simulation.
std::vector<PlanCandidate> enumerate_all(const SegmentCosts& c, int P, const Space& sp,
                                         bool in_place) {
  std::vector<PlanCandidate> out;
  const int n = static_cast<int>(c.segments.size());
  for (const std::string& f : sp.families) {
    for (int M : sp.microbatches) {
      const int v = f == "interleaved" ? 2 : 1;
      Schedule s;
      try {
        s = make_schedule(f, P, M, v);
      } catch (const ScheduleError&) {
        continue;
      }
      const int S = s.num_stages;
      if (S > n) continue;
      // Partitions: choose S-1 cut points among 1..n-1.
      std::vector<int> cuts(S);
      std::function<void(int, int)> part = [&](int st, int a) {
        cuts[st] = a;
        if (st == S - 1) {
          std::vector<Remat> rm(S, sp.modes[0]);
          std::vector<int> idx(S, 0);
          for (;;) {
            for (int k = 0; k < S; ++k) rm[k] = sp.modes[idx[k]];
            out.push_back(evaluate_candidate(c, f, P, v, M, cuts, rm, 0, in_place));
            int k = 0;
            while (k < S && ++idx[k] == static_cast<int>(sp.modes.size())) idx[k++] = 0;
            if (k == S) break;
          }
          return;
        }
        for (int e = a + 1; e <= n - (S - 1 - st); ++e) part(st + 1, e);
      };
      part(0, 0);
    }
  }
  return out;
}

SegmentCosts random_costs(std::mt19937& rng, int n) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  auto bytes = [&](int lo, int hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  SegmentCosts c;
  const int batches[] = {4, 6, 8, 12};
  c.batch = batches[rng() % 4];
  c.ref_microbatch = 1 + static_cast<int>(rng() % 2);
  c.link.latency = u(rng) < 0.5 ? 0.0 : 0.3 * u(rng);
  c.link.bandwidth = u(rng) < 0.5 ? 0.0 : 50.0 + 200.0 * u(rng);
  c.fused_factor = 0.6 + 0.6 * u(rng);
  c.task_overhead = u(rng) < 0.5 ? 0.4 * u(rng) : 0.0;
  for (int k = 0; k < n; ++k) {
    SegmentCost s;
    s.f = 0.2 + 2.0 * u(rng);
    s.b = s.f * (1.0 + 1.5 * u(rng));
    s.i = s.b * (0.4 + 0.4 * u(rng));
    s.w = s.b - s.i;
    s.overhead = u(rng) < 0.3 ? 0.1 * u(rng) : 0.0;
    s.update = u(rng) < 0.5 ? 0.5 * u(rng) : 0.0;
    s.act_bytes = bytes(1, 100);
    s.stash_bytes = bytes(50, 400);
    s.min_stash_bytes = bytes(5, 200);
    s.min_recompute = 0.5 * s.f * u(rng);
    s.wstash_bytes = bytes(0, 50);
    s.param_bytes = bytes(0, 500);
    s.opt_bytes = bytes(0, 500);
    s.temp_bytes = bytes(0, 100);
    // What a checkpointed unit rematerializes at once, in either order of size (a layer
    // that full remat checkpoints and min keeps whole, or the reverse).
    s.min_transient_bytes = u(rng) < 0.5 ? bytes(0, 300) : 0;
    s.full_transient_bytes = u(rng) < 0.5 ? bytes(0, 300) : 0;
    c.segments.push_back(s);
  }
  return c;
}

TEST(AutoplanSearch, MatchesBruteForce) {
  std::mt19937 rng(20261201);
  const std::vector<Remat> all_modes{Remat::Keep, Remat::Min, Remat::Full};
  int tight = 0, none_fit = 0;
  for (int inst = 0; inst < 200; ++inst) {
    const int P = 1 + static_cast<int>(rng() % 3);
    const int n = 1 + static_cast<int>(rng() % 7);
    const SegmentCosts c = random_costs(rng, n);
    Space sp;
    sp.families = schedule_names();
    for (int m = 1; m <= c.batch && m <= 2 * P + 2; ++m)
      if (c.batch % m == 0 && rng() % 3 != 0) sp.microbatches.push_back(m);
    if (sp.microbatches.empty()) sp.microbatches.push_back(1);
    // All three remat modes for small stage counts, two otherwise (brute force is 3^S).
    sp.modes = all_modes;
    std::shuffle(sp.modes.begin(), sp.modes.end(), rng);
    if (n >= 5 && P >= 2) sp.modes.resize(2);
    const bool in_place = rng() % 2 == 0;  // donated update, or new copies beside the old
    const std::vector<PlanCandidate> cands = enumerate_all(c, P, sp, in_place);
    if (cands.empty()) continue;
    // Budget: unlimited, a random candidate's peak (often tight), or below every peak.
    int64_t budget = 0;
    const int kind = static_cast<int>(rng() % 4);
    int64_t min_peak = std::numeric_limits<int64_t>::max();
    for (const auto& p : cands) min_peak = std::min(min_peak, p.max_memory());
    if (kind == 1 || kind == 2) {
      budget = cands[rng() % cands.size()].max_memory();
      ++tight;
    } else if (kind == 3) {
      budget = min_peak > 1 ? min_peak - 1 : 0;
    }
    double best = std::numeric_limits<double>::infinity();
    for (const auto& p : cands)
      if (budget == 0 || p.max_memory() <= budget) best = std::min(best, p.step_time);
    AutoplanOptions o;
    o.ranks = P;
    o.memory = budget;
    o.top = 1 + static_cast<int>(rng() % 3);
    o.families = sp.families;
    o.microbatches = sp.microbatches;
    o.remat_modes = sp.modes;
    o.update_in_place = in_place;
    SCOPED_TRACE(::testing::Message()
                 << "instance " << inst << " P=" << P << " n=" << n << " in_place=" << in_place
                 << " budget=" << budget << " costs=" << c.to_json());
    if (best == std::numeric_limits<double>::infinity()) {
      ++none_fit;
      try {
        autoplan(c, o);
        ADD_FAILURE() << "no candidate fits, but autoplan returned a plan";
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("no candidate fits"), std::string::npos) << e.what();
      }
      continue;
    }
    const AutoplanResult r = autoplan(c, o);
    ASSERT_FALSE(r.plans.empty());
    EXPECT_TRUE(r.stats.exact);
    EXPECT_NEAR(r.plans[0].step_time, best, 1e-9 * std::max(1.0, best));
    EXPECT_LE(static_cast<int>(r.plans.size()), o.top);
    for (size_t k = 0; k < r.plans.size(); ++k) {
      const PlanCandidate& p = r.plans[k];
      if (k > 0) {
        EXPECT_LE(r.plans[k - 1].step_time, p.step_time);
      }
      EXPECT_TRUE(p.fits);
      // The row is what evaluate_candidate (an independent simulation) says.
      const PlanCandidate q = evaluate_candidate(c, p.schedule, P, p.virtual_stages, p.microbatches,
                                                 p.cuts, p.remat, budget, in_place);
      EXPECT_EQ(q.step_time, p.step_time);
      EXPECT_EQ(q.peak_memory, p.peak_memory);
      EXPECT_TRUE(q.fits);
      EXPECT_TRUE(verify(lower(make_schedule(p.schedule, P, p.microbatches,
                                             p.schedule == "interleaved" ? 2 : 1)))
                      .ok());
    }
  }
  EXPECT_GT(tight, 20);
  EXPECT_GT(none_fit, 10);
}

// The offload rule of AutoplanOptions::offload, applied to one evaluated
// candidate: while some rank is over the budget, offload the stashes of its
// stages (all ranks over it at once), re-evaluated as the rank IR.
PlanCandidate with_offload(const SegmentCosts& c, int P, const PlanCandidate& p, int64_t budget,
                           bool in_place) {
  const Schedule s = make_schedule(p.schedule, P, p.microbatches,
                                   p.schedule == "interleaved" ? p.virtual_stages : 1);
  std::vector<Offload> off(s.num_stages, Offload::None);
  PlanCandidate q = p;
  while (!q.fits) {
    bool added = false;
    for (int st = 0; st < s.num_stages; ++st)
      if (q.peak_memory[s.stage_rank[st]] > budget && off[st] == Offload::None) {
        off[st] = Offload::Stash;
        added = true;
      }
    if (!added) break;
    q = evaluate_candidate(c, p.schedule, P, p.virtual_stages, p.microbatches, p.cuts, p.remat,
                           budget, in_place, off);
  }
  return q;
}

TEST(AutoplanSearch, OffloadMatchesBruteForce) {
  std::mt19937 rng(20261206);
  int offloaded = 0, rows = 0;
  for (int inst = 0; inst < 80; ++inst) {
    const int P = 2 + static_cast<int>(rng() % 2);
    const int n = P + static_cast<int>(rng() % 3);
    SegmentCosts c = random_costs(rng, n);
    // A host link from much faster than the compute to much slower.
    c.host_link_bandwidth = std::pow(10.0, 1.0 + 3.0 * std::uniform_real_distribution<>(0, 1)(rng));
    Space sp;
    sp.families = {"gpipe", "1f1b", "zbh1", "zbv", "vhalf", "interleaved"};
    for (int m = P; m <= c.batch && m <= 2 * P + 2; ++m)
      if (c.batch % m == 0) sp.microbatches.push_back(m);
    if (sp.microbatches.empty()) continue;
    sp.modes = {Remat::Keep, Remat::Full};
    const bool in_place = rng() % 2 == 0;
    const std::vector<PlanCandidate> cands = enumerate_all(c, P, sp, in_place);
    if (cands.empty()) continue;
    // Budget: between the smallest and the largest peak, so that some fit only offloaded.
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    for (const auto& p : cands) {
      lo = std::min(lo, p.max_memory());
      hi = std::max(hi, p.max_memory());
    }
    const int64_t budget = lo + static_cast<int64_t>((hi - lo) * 0.3);
    double best = std::numeric_limits<double>::infinity();
    for (const auto& p0 : cands) {
      PlanCandidate p = p0;
      p.fits = p.max_memory() <= budget;
      const PlanCandidate q = with_offload(c, P, p, budget, in_place);
      if (q.fits) best = std::min(best, q.step_time);
    }
    AutoplanOptions o;
    o.ranks = P;
    o.memory = budget;
    o.top = 3;
    o.families = sp.families;
    o.microbatches = sp.microbatches;
    o.remat_modes = sp.modes;
    o.update_in_place = in_place;
    o.offload = true;
    SCOPED_TRACE(::testing::Message() << "instance " << inst << " P=" << P << " n=" << n
                                      << " budget=" << budget << " costs=" << c.to_json());
    if (best == std::numeric_limits<double>::infinity()) {
      EXPECT_THROW(autoplan(c, o), ConfigError);
      continue;
    }
    const AutoplanResult r = autoplan(c, o);
    ASSERT_FALSE(r.plans.empty());
    EXPECT_NEAR(r.plans[0].step_time, best, 1e-9 * std::max(1.0, best));
    for (const PlanCandidate& p : r.plans) {
      ++rows;
      EXPECT_TRUE(p.fits);
      const bool off = !p.offload.empty();
      offloaded += off;
      EXPECT_EQ(off, !p.peak_host.empty());
      // The row is what evaluate_candidate says of the same choice.
      const PlanCandidate q = evaluate_candidate(c, p.schedule, P, p.virtual_stages,
                                                 p.microbatches, p.cuts, p.remat, budget,
                                                 in_place, p.offload);
      EXPECT_DOUBLE_EQ(q.step_time, p.step_time);
      EXPECT_EQ(q.peak_memory, p.peak_memory);
      EXPECT_EQ(q.peak_host, p.peak_host);
      EXPECT_TRUE(q.fits);
    }
  }
  EXPECT_GT(offloaded, 10) << "of " << rows << " rows";
}

TEST(AutoplanSearch, OffloadTradesHostLinkForRecompute) {
  // Two equal segments on two ranks under GPipe with 8 microbatches: keeping
  // every stash (8 x 1000 bytes per rank) does not fit; recomputing does, as
  // does offloading. A fast host link hides the copies (offload wins), a
  // slow one does not (recompute wins).
  SegmentCosts c;
  c.batch = 8;
  c.ref_microbatch = 1;
  for (int k = 0; k < 2; ++k) {
    SegmentCost s;
    s.f = 1.0;
    s.b = 2.0;
    s.i = 2.0;
    s.stash_bytes = 1000;
    s.min_stash_bytes = 1000;
    s.act_bytes = 10;
    c.segments.push_back(s);
  }
  AutoplanOptions o;
  o.ranks = 2;
  o.families = {"gpipe"};
  o.microbatches = {8};
  o.remat_modes = {Remat::Keep, Remat::Full};
  o.memory = 3500;  // offloaded, a rank holds about three stashes at once
  const std::string refused = error_of<ConfigError>([&] {
    AutoplanOptions x = o;
    x.offload = true;
    autoplan(c, x);
  });
  EXPECT_NE(refused.find("host_link_bandwidth"), std::string::npos) << refused;
  const AutoplanResult plain = autoplan(c, o);
  ASSERT_FALSE(plain.plans.empty());
  EXPECT_TRUE(plain.plans[0].offload.empty());
  EXPECT_EQ(plain.plans[0].remat, (std::vector<Remat>{Remat::Full, Remat::Full}));
  o.offload = true;
  c.host_link_bandwidth = 1e6;  // a 1000-byte stash copies in 0.001
  const AutoplanResult fast = autoplan(c, o);
  ASSERT_FALSE(fast.plans[0].offload.empty());
  EXPECT_LT(fast.plans[0].step_time, plain.plans[0].step_time);
  EXPECT_EQ(fast.plans[0].remat, (std::vector<Remat>{Remat::Keep, Remat::Keep}));
  EXPECT_EQ(fast.plans[0].offload, (std::vector<Offload>{Offload::Stash, Offload::Stash}));
  EXPECT_GE(fast.plans[0].peak_host[0], 5000);  // most of rank 0's eight stashes
  EXPECT_LE(fast.plans[0].max_memory(), o.memory);
  EXPECT_NE(autoplan_table(fast, o.memory).find("keep+offload"), std::string::npos);
  EXPECT_NE(fast.to_json().find("\"peak_host\""), std::string::npos);
  {
    AutoplanOptions x = o;
    x.host_memory = 4000;  // offloading needs more than this on rank 0's host
    const AutoplanResult capped = autoplan(c, x);
    EXPECT_TRUE(capped.plans[0].offload.empty());
    EXPECT_DOUBLE_EQ(capped.plans[0].step_time, plain.plans[0].step_time);
    x.host_memory = fast.plans[0].peak_host[0];
    EXPECT_FALSE(autoplan(c, x).plans[0].offload.empty());
  }
  c.host_link_bandwidth = 10;  // 100 time units per copy
  const AutoplanResult slow = autoplan(c, o);
  EXPECT_TRUE(slow.plans[0].offload.empty());
  EXPECT_DOUBLE_EQ(slow.plans[0].step_time, plain.plans[0].step_time);
}

TEST(AutoplanSearch, OffloadSearchStartsFromThePlainSearchsPlans) {
  // Eight segments on four ranks without a memory budget: keeping every stash
  // fits, so no offloaded plan can be faster. The offload search starts from
  // the plain search's rows as its threshold, so it simulates no offloaded
  // candidate and returns the same plans.
  SegmentCosts c;
  c.batch = 8;
  c.ref_microbatch = 1;
  c.host_link_bandwidth = 1e6;
  for (int k = 0; k < 8; ++k) {
    SegmentCost s;
    s.f = 1.0 + 0.1 * k;
    s.b = 2.0;
    s.i = 2.0;
    s.stash_bytes = 1000;
    s.min_stash_bytes = 400;
    s.min_recompute = 0.2;
    s.act_bytes = 10;
    c.segments.push_back(s);
  }
  AutoplanOptions o;
  o.ranks = 4;
  o.top = 3;
  const AutoplanResult plain = autoplan(c, o);
  o.offload = true;
  const AutoplanResult off = autoplan(c, o);
  ASSERT_EQ(off.plans.size(), plain.plans.size());
  for (size_t k = 0; k < plain.plans.size(); ++k) {
    EXPECT_TRUE(off.plans[k].offload.empty());
    EXPECT_DOUBLE_EQ(off.plans[k].step_time, plain.plans[k].step_time);
  }
  EXPECT_EQ(off.stats.offloaded, 0);
  // Both searches' work is counted; the seeded one adds less than the first.
  EXPECT_LT(off.stats.simulated, 2 * plain.stats.simulated);
}

TEST(AutoplanSearch, NothingFitsNamesPeakAndRank) {
  SegmentCosts c = sample_costs();
  AutoplanOptions o;
  o.ranks = 2;
  o.memory = 1000;  // below any stage's parameters + optimizer state
  const std::string msg = error_of<ConfigError>([&] { autoplan(c, o); });
  EXPECT_NE(msg.find("no candidate fits the memory budget"), std::string::npos) << msg;
  EXPECT_NE(msg.find("on rank "), std::string::npos) << msg;
  EXPECT_NE(msg.find("smallest peak"), std::string::npos) << msg;
}

TEST(AutoplanSearch, OptionsAndStats) {
  const SegmentCosts c = sample_costs();
  AutoplanOptions o;
  o.ranks = 2;
  o.families = {"1F1B", "zb-v"};
  o.microbatches = {2, 4, 8};
  const AutoplanResult r = autoplan(c, o);
  ASSERT_FALSE(r.plans.empty());
  EXPECT_TRUE(r.stats.exact);
  EXPECT_GT(r.stats.simulated, 0);
  EXPECT_EQ(r.stats.configurations, 6);
  for (const auto& p : r.plans) EXPECT_TRUE(p.schedule == "1f1b" || p.schedule == "zbv");
  EXPECT_NE(r.to_json().find("\"step_time\""), std::string::npos);
  EXPECT_NE(autoplan_table(r, 0).find("unlimited"), std::string::npos);
  o.microbatches = {3};
  EXPECT_THROW(autoplan(c, o), ConfigError);
  o.microbatches = {};
  o.families = {"nope"};
  EXPECT_THROW(autoplan(c, o), ConfigError);
}

}  // namespace
}  // namespace baton
