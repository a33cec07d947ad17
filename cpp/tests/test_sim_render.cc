// Render: Chrome trace JSON, SVG, text grid and summary table of simulated
// runs.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "baton/cost.h"
#include "baton/plan.h"
#include "baton/render.h"
#include "baton/sim.h"
#include "baton/verify.h"
#include "test_plan_util.h"

namespace baton {
namespace {

using testing::hand_1f1b;

Action A(TaskKind k, int s, int m) { return Action{Task{k, s, m}}; }


// One rank holding two stages (local hand-off), with I/W split and a fused
// action, so that every category shows up.
Schedule mixed_single_rank() {
  Schedule s;
  s.name = "mixed";
  s.num_ranks = 1;
  s.num_stages = 2;
  s.num_microbatches = 2;
  s.stage_rank = {0, 0};
  s.rank_actions = {{A(TaskKind::F, 0, 0), A(TaskKind::F, 1, 0),
                     Action{Task{TaskKind::F, 0, 1}, Task{TaskKind::B, 1, 0}}, A(TaskKind::I, 0, 0),
                     A(TaskKind::W, 0, 0), A(TaskKind::F, 1, 1), A(TaskKind::B, 1, 1),
                     A(TaskKind::B, 0, 1)}};
  return s;
}

size_t count(const std::string& s, const std::string& part) {
  size_t n = 0;
  for (size_t k = s.find(part); k != std::string::npos; k = s.find(part, k + 1)) ++n;
  return n;
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

TEST(SimRender, ChromeTraceParsesWithOneXEventPerRun) {
  Plan p = lower(hand_1f1b(3, 4));
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.link.latency = 0.25;
  SimResult r = simulate(p, c);
  const auto j = nlohmann::json::parse(to_chrome_trace(p, r, 1000.0));
  ASSERT_TRUE(j.contains("traceEvents"));
  EXPECT_EQ(j["displayTimeUnit"], "ms");
  size_t run_x = 0, xfer_x = 0, flow_s = 0, flow_f = 0, counters = 0;
  std::set<std::string> thread_names;
  for (const auto& e : j["traceEvents"]) {
    const std::string ph = e["ph"];
    if (ph == "X" && e["cat"] == "transfer") {
      ++xfer_x;
      EXPECT_GE(e["tid"].get<int>(), 3);
    } else if (ph == "X") {
      ++run_x;
      const int tid = e["tid"];
      ASSERT_LT(tid, 3);
      EXPECT_EQ(e["args"]["stage"].get<int>(), tid);  // contiguous placement
      EXPECT_TRUE(e["args"].contains("microbatch"));
      EXPECT_TRUE(e["args"].contains("instr"));
      const std::string name = e["name"];
      EXPECT_EQ(std::string(1, name[0]), e["cat"].get<std::string>());
      EXPECT_GT(e["dur"].get<double>(), 0);
    } else if (ph == "s") {
      ++flow_s;
    } else if (ph == "f") {
      ++flow_f;
    } else if (ph == "C") {
      ++counters;
      EXPECT_TRUE(e["args"].contains("activation"));
      EXPECT_TRUE(e["args"].contains("total"));
    } else if (ph == "M" && e["name"] == "thread_name") {
      thread_names.insert(e["args"]["name"].get<std::string>());
    }
  }
  EXPECT_EQ(run_x, r.runs.size());
  EXPECT_EQ(run_x, 24u);
  EXPECT_EQ(xfer_x, r.transfers.size());
  EXPECT_EQ(flow_s, r.transfers.size());
  EXPECT_EQ(flow_f, r.transfers.size());
  size_t samples = 0;
  for (const auto& m : r.memory) samples += m.size();
  EXPECT_EQ(counters, samples);
  for (const char* n : {"rank 0", "rank 1", "rank 2", "link 0->1", "link 1->0", "link 2->1"})
    EXPECT_EQ(thread_names.count(n), 1u) << n;
  // Microsecond timestamps: the last RUN ends at step_time * 1000.
  double last = 0;
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "X") last = std::max(last, e["ts"].get<double>() + e["dur"].get<double>());
  EXPECT_NEAR(last, r.step_time * 1000.0, 1e-6);
}

TEST(SimRender, ChromeTraceFusedCategory) {
  Plan p = lower(mixed_single_rank());
  SimResult r = simulate(p, CostModel::uniform(1, 2, 1, 1));
  const auto j = nlohmann::json::parse(to_chrome_trace(p, r));
  std::map<std::string, int> cats;
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "X") cats[e["cat"]]++;
  EXPECT_EQ(cats["F"], 3);
  EXPECT_EQ(cats["B"], 2);
  EXPECT_EQ(cats["I"], 1);
  EXPECT_EQ(cats["W"], 1);
  EXPECT_EQ(cats["fused"], 1);
}

TEST(SimRender, SvgHasOneRectPerAction) {
  Plan p = lower(hand_1f1b(3, 5));
  SimResult r = simulate(p, CostModel::uniform(1, 2, 1, 1));
  const std::string svg = to_svg(p, r);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_EQ(count(svg, "<rect class=\"action "), r.runs.size());
  EXPECT_EQ(count(svg, "class=\"action kind-F\""), 15u);
  EXPECT_EQ(count(svg, "class=\"action kind-B\""), 15u);
  EXPECT_EQ(count(svg, "class=\"lane\""), 3u);  // one row per rank
  EXPECT_GE(count(svg, "class=\"legend\""), 5u);
  EXPECT_NE(svg.find(">rank 2</text>"), std::string::npos);
  EXPECT_GE(count(svg, "class=\"tick\""), 2u);
  // Multi-stage ranks label microbatch/stage.
  Plan q = lower(mixed_single_rank());
  const std::string svg2 = to_svg(q, simulate(q, CostModel::uniform(1, 2, 1, 1)));
  EXPECT_EQ(count(svg2, "<rect class=\"action "), 8u);
  EXPECT_EQ(count(svg2, "class=\"action kind-fused\""), 1u);
  EXPECT_NE(svg2.find(">1/0</text>"), std::string::npos);  // F0.1 -> "1/0"
}

TEST(SimRender, TextGridShapeAndContent) {
  Plan p = lower(hand_1f1b(2, 2));
  SimResult r = simulate(p, CostModel::uniform(1, 1, 1, 1));
  // step = (2+1)*2 = 6; the shortest RUN is 1 -> 6 columns.
  const auto lines = lines_of(to_text_grid(p, r));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[1], "rank 0 | F0 F1 .  B0 .  B1");
  EXPECT_EQ(lines[2], "rank 1 | .  F0 B0 F1 B1 . ");
  // Explicit width: every row has the same length and `width` cells.
  const auto wide = lines_of(to_text_grid(p, r, 12));
  ASSERT_EQ(wide.size(), 3u);
  EXPECT_EQ(wide[1].size(), wide[2].size());
  EXPECT_EQ(wide[1].size(), std::string("rank 0 |").size() + 12 * 3);
  EXPECT_EQ(wide[1].substr(8, 6), " F0 F0");
}

TEST(SimRender, TextGridFusedAndWideMicrobatchNumbers) {
  Plan p = lower(mixed_single_rank());
  SimResult r = simulate(p, CostModel::uniform(1, 1, 1, 1));
  const auto lines = lines_of(to_text_grid(p, r));
  ASSERT_EQ(lines.size(), 2u);
  // Fused action takes 2 units: two 'X1' cells.
  EXPECT_EQ(lines[1], "rank 0 | F0 F0 X1 X1 I0 W0 F1 B1 B1");
  Plan q = lower(hand_1f1b(2, 12));
  const auto l2 = lines_of(to_text_grid(q, simulate(q, CostModel::uniform(1, 1, 1, 1))));
  EXPECT_EQ(l2[1].size(), l2[2].size());
  EXPECT_NE(l2[1].find("F11"), std::string::npos);
  EXPECT_NE(l2[1].find(" .   "), std::string::npos);  // idle cells padded to width 3
}

TEST(SimRender, SummaryTable) {
  Plan p = lower(hand_1f1b(2, 4));
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.default_stage.stash_bytes = 3 << 20;
  SimResult r = simulate(p, c);
  const std::string none = summary_table(p, r, nullptr);
  EXPECT_NE(none.find("schedule      1f1b"), std::string::npos) << none;
  EXPECT_NE(none.find("ranks         2"), std::string::npos);
  EXPECT_NE(none.find("microbatches  4"), std::string::npos);
  EXPECT_NE(none.find("step time     15"), std::string::npos);
  EXPECT_NE(none.find("bubble        20.00%"), std::string::npos);
  EXPECT_NE(none.find("6.00 MiB"), std::string::npos);  // rank 0 holds 2 stashes
  EXPECT_NE(none.find("verification: not run"), std::string::npos);
  const auto lines = lines_of(none);
  ASSERT_EQ(lines.size(), 6u + 1 + 2 + 1);
  EXPECT_EQ(lines[7].size(), lines[8].size());  // fixed-width rows
  VerifyReport ok;
  EXPECT_NE(summary_table(p, r, &ok).find("verification: OK"), std::string::npos);
  VerifyReport bad;
  bad.violations.push_back(Violation{"deadlock", "rank 0 #1 waits for rank 1 #2", {0, 1}, {1, 2}});
  const std::string failed = summary_table(p, r, &bad);
  EXPECT_NE(failed.find("verification: FAILED (1 violation)"), std::string::npos) << failed;
  EXPECT_NE(failed.find("deadlock: rank 0 #1 waits for rank 1 #2"), std::string::npos);
}

}  // namespace
}  // namespace baton
