// Tests of the schedule text format: round trips, the documented example,
// and error reports with line and column.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "baton/error.h"
#include "baton/generators.h"
#include "baton/text_format.h"

namespace baton {
namespace {

constexpr const char* kExample =
    "# comments start with '#'\n"
    "baton-schedule 1\n"
    "name 1f1b\n"
    "ranks 2\n"
    "stages 2\n"
    "microbatches 2\n"
    "placement 0 1            # rank of each stage, in stage order\n"
    "rank 0: F0.0 F0.1 B0.0 B0.1\n"
    "rank 1: F1.0 B1.0 F1.1 B1.1\n";

// Loads `text` and expects a FormatError at (line, col) whose message
// contains `needle`.
void expect_format_error(const std::string& text, int line, int col, const std::string& needle) {
  try {
    load_schedule(text);
    ADD_FAILURE() << "expected FormatError for:\n" << text;
  } catch (const FormatError& e) {
    EXPECT_EQ(e.line, line) << e.what();
    EXPECT_EQ(e.column, col) << e.what();
    const std::string what = e.what();
    EXPECT_EQ(
        what.rfind("line " + std::to_string(line) + ", column " + std::to_string(col) + ": ", 0),
        0u)
        << what;
    EXPECT_NE(what.find(needle), std::string::npos) << what;
  }
}

// Loads `text` and expects a ScheduleError starting with `prefix` and
// containing `needle`.
void expect_content_error(const std::string& text, const std::string& prefix,
                          const std::string& needle) {
  try {
    load_schedule(text);
    ADD_FAILURE() << "expected ScheduleError for:\n" << text;
  } catch (const FormatError& e) {
    ADD_FAILURE() << "expected ScheduleError, got FormatError: " << e.what();
  } catch (const ScheduleError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(prefix, 0), 0u) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << what;
  }
}

std::string header(int ranks, int stages, int mbs, const std::string& placement) {
  return "baton-schedule 1\nranks " + std::to_string(ranks) + "\nstages " + std::to_string(stages) +
         "\nmicrobatches " + std::to_string(mbs) + "\nplacement " + placement + "\n";
}

TEST(TextFormat, LoadsTheDocumentedExample) {
  const Schedule s = load_schedule(kExample);
  EXPECT_EQ(s, one_f_one_b(2, 2));
}

TEST(TextFormat, SaveMatchesTheDocumentedLayout) {
  const std::string expected =
      "baton-schedule 1\nname 1f1b\nranks 2\nstages 2\nmicrobatches 2\nplacement 0 1\n"
      "rank 0: F0.0 F0.1 B0.0 B0.1\nrank 1: F1.0 B1.0 F1.1 B1.1\n";
  EXPECT_EQ(save_schedule(one_f_one_b(2, 2)), expected);
  EXPECT_NE(save_schedule(dualpipe_v(2, 4)).find("F0.3+B3.1"), std::string::npos);
}

TEST(TextFormat, RoundTripsEveryGenerator) {
  for (const auto& n : schedule_names())
    for (int p : {1, 2, 3, 4})
      for (int m : {1, 3, 4, 8, 9}) {
        for (int v : {1, 2, 3}) {
          if (v > 1 && n != "interleaved") continue;
          if (n == "interleaved" && v > 1 && m % p && m > p) continue;
          if (n == "dualpipev" && m < 2 * p) continue;
          const Schedule s = make_schedule(n, p, m, v);
          EXPECT_EQ(load_schedule(save_schedule(s)), s)
              << n << " p=" << p << " m=" << m << " v=" << v;
        }
      }
}

TEST(TextFormat, AcceptsCommentsBlankLinesCrlfAndSpacedColon) {
  const std::string text =
      "\n# leading comment\n\nbaton-schedule 1   # version\r\n"
      "microbatches 1\r\nstages 1\nranks 1\n\tplacement 0\n"
      "rank 0 : F0.0   B0.0   # trailing\n";
  const Schedule s = load_schedule(text);
  EXPECT_EQ(s.name, "");
  EXPECT_EQ(s.num_ranks, 1);
  ASSERT_EQ(s.rank_actions.size(), 1u);
  EXPECT_EQ(s.rank_actions[0].size(), 2u);
  EXPECT_EQ(load_schedule(save_schedule(s)), s);
}

TEST(TextFormat, FusedActions) {
  const Schedule s = load_schedule(header(1, 2, 2, "0 0") +
                                   "rank 0: F0.0 F1.0 F0.1+B1.0 F1.1+B0.0 B1.1 I0.1 W0.1\n");
  EXPECT_TRUE(s.rank_actions[0][2].is_fused());
  EXPECT_EQ(to_string(s.rank_actions[0][3]), "F1.1+B0.0");
}

TEST(TextFormat, SyntaxErrors) {
  expect_format_error("", 1, 1, "empty schedule");
  expect_format_error("# only a comment\n", 1, 1, "empty schedule");
  expect_format_error("ranks 2\n", 1, 1,
                      "missing header: expected 'baton-schedule 1', got 'ranks'");
  expect_format_error("baton-schedule 2\n", 1, 16, "unsupported format version '2'");
  expect_format_error("baton-schedule 1\nranks 2\n  colour red\n", 3, 3, "unknown key 'colour'");
  expect_format_error("baton-schedule 1\nranks two\n", 2, 7, "expected an integer, got 'two'");
  expect_format_error("baton-schedule 1\nranks 2\nranks 3\n", 3, 1,
                      "duplicate 'ranks' (first given on line 2)");
  expect_format_error("baton-schedule 1\nranks 2000000\n", 2, 7, "larger than this reader accepts");
  expect_format_error("baton-schedule 1\nplacement 0 x\n", 2, 13,
                      "expected a rank number, got 'x'");
  expect_format_error("baton-schedule 1\nranks 1\nrank 0: F0.0\n", 3, 1,
                      "'rank' row before the header is complete (missing 'stages')");
  // Bad task tokens, at the token's column.
  const std::string h = header(2, 2, 2, "0 1");
  expect_format_error(h + "rank 0: F0.0 X0.1 B0.0 B0.1\n", 6, 14, "bad task token 'X0.1'");
  expect_format_error(h + "rank 0: F0.0 F0 B0.0 B0.1\n", 6, 14, "bad task token 'F0'");
  expect_format_error(h + "rank 0: F0.0 F0.1+ B0.0\n", 6, 14, "bad task token 'F0.1+'");
  expect_format_error(h + "rank 0: F0.0 F0.-1\n", 6, 14, "bad task token 'F0.-1'");
  expect_format_error(h + "rank 0: F0.0 F0.1+B0.0+B0.1\n", 6, 14, "bad task token");
  // Rank rows: count, duplicates, range, colon.
  expect_format_error(h + "rank 0: F0.0 F0.1 B0.0 B0.1\n", 7, 1,
                      "expected 2 'rank' rows, found 1 (first missing: rank 1)");
  expect_format_error(h, 6, 1, "expected 2 'rank' rows, found 0 (first missing: rank 0)");
  expect_format_error(h + "rank 1: F1.0 B1.0 F1.1 B1.1\nrank 1: F1.0\n", 7, 6,
                      "duplicate row for rank 1 (first given on line 6)");
  expect_format_error(h + "rank 2: F1.0\n", 6, 6, "rank 2 out of range 0..1");
  expect_format_error(h + "rank 0 F0.0\n", 6, 7, "expected ':' after the rank index");
  // Missing header keys are reported at the end of the text.
  expect_format_error("baton-schedule 1\nranks 1\nstages 1\nplacement 0\n", 5, 1,
                      "missing 'microbatches'");
}

TEST(TextFormat, ContentErrorsCarryTheLine) {
  const std::string h = header(2, 2, 2, "0 1");
  // A task on the wrong rank: line and column of its token.
  expect_content_error(
      h + "rank 0: F0.0 F0.1 B0.0 B0.1 F1.0\nrank 1: B1.0 F1.1 B1.1\n",
      "line 6, column 29: ", "rank 0 action 4 (F1.0) runs stage 1, which is placed on rank 1");
  // Out-of-range stage and microbatch.
  expect_content_error(h + "rank 0: F0.0 F0.1 B0.0 B0.1 F7.0\nrank 1: F1.0 B1.0 F1.1 B1.1\n",
                       "line 6, column 29: ", "stage 7 out of range 0..1");
  expect_content_error(h + "rank 0: F0.0 F0.1 B0.0 B0.1\nrank 1: F1.0 B1.0 F1.1 B1.1 F1.5\n",
                       "line 7, column 29: ", "microbatch 5 out of range 0..1");
  // A duplicate task.
  expect_content_error(h + "rank 0: F0.0 F0.1 B0.0 B0.1 B0.1\nrank 1: F1.0 B1.0 F1.1 B1.1\n",
                       "line 6, column 29: ", "B0.1 appears more than once");
  // A missing task: the line of the row that should hold it.
  expect_content_error(h + "rank 0: F0.0 F0.1 B0.0\nrank 1: F1.0 B1.0 F1.1 B1.1\n",
                       "line 6: ", "stage 0 microbatch 1 needs one B or one I and one W");
  // Header values and placement.
  expect_content_error(header(0, 1, 1, "0"), "line 2, column 7: ", "ranks must be >= 1 (got 0)");
  expect_content_error(header(2, 2, 2, "0 5") + "rank 0: F0.0\nrank 1: F1.0\n",
                       "line 5, column 13: ", "stage 1 is placed on rank 5");
  expect_content_error(header(2, 3, 1, "0 1") + "rank 0: F0.0\nrank 1: F1.0\n",
                       "line 5, column 1: ", "placement lists 2 stages but the schedule has 3");
}

// Random edits of valid files never crash the reader: it either loads a
// schedule that validates or throws a FormatError / ScheduleError.
TEST(TextFormat, MutatedInputsLoadOrThrowBatonErrors) {
  std::mt19937 rng(1234);
  const std::string alphabet = "FBIW0123456789.+:# \n-rankx";
  for (const auto& n : {"1f1b", "zbv", "dualpipev"}) {
    const std::string base = save_schedule(make_schedule(n, 2, 4));
    for (int trial = 0; trial < 300; ++trial) {
      std::string text = base;
      const int edits = 1 + static_cast<int>(rng() % 3);
      for (int e = 0; e < edits; ++e) {
        const size_t at = rng() % text.size();
        switch (rng() % 3) {
          case 0:
            text[at] = alphabet[rng() % alphabet.size()];
            break;
          case 1:
            text.erase(at, 1 + rng() % 4);
            break;
          default:
            text.insert(at, 1, alphabet[rng() % alphabet.size()]);
            break;
        }
      }
      try {
        const Schedule s = load_schedule(text);
        EXPECT_NO_THROW(s.validate());
      } catch (const FormatError& e) {
        EXPECT_GT(e.line, 0) << e.what();
      } catch (const ScheduleError& e) {
        EXPECT_EQ(std::string(e.what()).rfind("line ", 0), 0u) << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace baton
