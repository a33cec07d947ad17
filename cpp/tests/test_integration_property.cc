// Property sweep over the schedule generators: every (name, ranks, v,
// microbatches) either is refused with a ScheduleError that names the values,
// or lowers to a plan that verifies under both communication models; the text
// format round-trips to the same fingerprint.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>

#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/text_format.h"
#include "baton/verify.h"

namespace baton {
namespace {

struct Case {
  std::string name;
  int p, v, m;
  bool operator<(const Case& o) const {
    return std::tie(name, p, v, m) < std::tie(o.name, o.p, o.v, o.m);
  }
};

std::string label(const Case& c) {
  return c.name + " p=" + std::to_string(c.p) + " v=" + std::to_string(c.v) +
         " m=" + std::to_string(c.m);
}

bool mentions(const std::string& msg, int value) {
  const std::string v = std::to_string(value);
  for (size_t at = msg.find(v); at != std::string::npos; at = msg.find(v, at + 1)) {
    const bool left = at == 0 || !std::isdigit(static_cast<unsigned char>(msg[at - 1]));
    const size_t end = at + v.size();
    const bool right = end == msg.size() || !std::isdigit(static_cast<unsigned char>(msg[end]));
    if (left && right) return true;
  }
  return false;
}

// All ranks 1..16 with a stride on m (and every v for interleaved), plus
// random picks from the full grid with a fixed seed.
std::set<Case> sample_grid() {
  std::set<Case> cases;
  const std::vector<int> ms = {1, 2, 3, 4, 5, 6, 8, 11, 16, 24, 32, 47, 64};
  std::mt19937 rng(20261130);
  for (const std::string& name : schedule_names()) {
    const int max_v = name == "interleaved" ? 4 : 1;
    for (int p = 1; p <= 16; ++p)
      for (int v = 1; v <= max_v; ++v)
        for (int m : ms)
          if ((p + m + v) % 2 == 0 || m <= 8) cases.insert({name, p, v, m});
    for (int k = 0; k < 40; ++k) {
      cases.insert({name, 1 + static_cast<int>(rng() % 16), 1 + static_cast<int>(rng() % max_v),
                    1 + static_cast<int>(rng() % 64)});
    }
  }
  return cases;
}

TEST(IntegrationProperty, EveryScheduleIsRefusedOrVerifies) {
  const std::set<Case> cases = sample_grid();
  std::map<std::string, int> built, refused;
  for (const Case& c : cases) {
    SCOPED_TRACE(label(c));
    Schedule s;
    try {
      s = make_schedule(c.name, c.p, c.m, c.v);
    } catch (const ScheduleError& e) {
      const std::string msg = e.what();
      EXPECT_FALSE(msg.empty());
      EXPECT_TRUE(mentions(msg, c.p) || mentions(msg, c.m) || mentions(msg, c.v))
          << "refusal names none of the values: " << msg;
      ++refused[c.name];
      continue;
    }
    ++built[c.name];
    EXPECT_EQ(s.num_ranks, c.p);
    EXPECT_EQ(s.num_microbatches, c.m);
    Plan plan;
    ASSERT_NO_THROW(plan = lower(s));
    const VerifyReport rep = verify(plan);
    ASSERT_TRUE(rep.ok()) << rep.to_string();
    // Round trip through the text format: same schedule, same plan.
    const std::string text = save_schedule(s);
    Schedule back;
    ASSERT_NO_THROW(back = load_schedule(text)) << text;
    EXPECT_EQ(back, s);
    EXPECT_EQ(lower(back).fingerprint(), plan.fingerprint());
  }
  for (const std::string& name : schedule_names()) {
    EXPECT_GT(built[name], 0) << name << " never built a schedule";
    SCOPED_TRACE(name);
  }
  // The same request is deterministic (same fingerprint twice).
  EXPECT_EQ(lower(make_schedule("1f1b", 4, 8)).fingerprint(),
            lower(make_schedule("1f1b", 4, 8)).fingerprint());
}

TEST(IntegrationProperty, NamesAreCaseAndSeparatorInsensitive) {
  EXPECT_EQ(lower(make_schedule("ZB-H1", 4, 8)).fingerprint(),
            lower(make_schedule("zbh1", 4, 8)).fingerprint());
  EXPECT_THROW(make_schedule("no-such-schedule", 4, 8), ScheduleError);
}

}  // namespace
}  // namespace baton
