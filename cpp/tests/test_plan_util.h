// Helpers shared by the C++ tests: hand-built schedules (independent of the
// generators), instruction look-up, and exception-message capture.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "baton/plan.h"
#include "baton/schedule.h"

namespace baton::testing {

inline Task F(int s, int m) { return {TaskKind::F, s, m}; }
inline Task B(int s, int m) { return {TaskKind::B, s, m}; }
inline Task I(int s, int m) { return {TaskKind::I, s, m}; }
inline Task W(int s, int m) { return {TaskKind::W, s, m}; }
inline Action A(Task t) { return Action{t, Task{TaskKind::F, -1, -1}}; }
inline Action A(Task a, Task b) { return Action{a, b}; }

inline Schedule make(std::string name, int ranks, std::vector<int32_t> placement, int m,
                     std::vector<std::vector<Action>> rows) {
  Schedule s;
  s.name = std::move(name);
  s.num_ranks = ranks;
  s.num_stages = static_cast<int32_t>(placement.size());
  s.num_microbatches = m;
  s.stage_rank = std::move(placement);
  s.rank_actions = std::move(rows);
  return s;
}

// PipeDream-flush 1F1B on p ranks (stage r on rank r): p-r-1 warm-up forwards.
inline Schedule hand_1f1b(int p, int m, bool split = false) {
  std::vector<std::vector<Action>> rows(p);
  for (int r = 0; r < p; ++r) {
    const int warm = std::min(p - r - 1, m);
    int f = 0, b = 0;
    auto back = [&] {
      if (split) {
        rows[r].push_back(A(I(r, b)));
        rows[r].push_back(A(W(r, b)));
      } else {
        rows[r].push_back(A(B(r, b)));
      }
      ++b;
    };
    for (; f < warm; ++f) rows[r].push_back(A(F(r, f)));
    while (f < m) {
      rows[r].push_back(A(F(r, f++)));
      back();
    }
    while (b < m) back();
  }
  return make(split ? "1f1b-iw" : "1f1b", p, contiguous_placement(p), m, std::move(rows));
}

// GPipe on an interleaved placement: every F in stage order, then every B.
inline Schedule hand_gpipe_interleaved(int p, int v, int m) {
  std::vector<std::vector<Action>> rows(p);
  const int S = p * v;
  for (int s = 0; s < S; ++s)
    for (int mb = 0; mb < m; ++mb) rows[s % p].push_back(A(F(s, mb)));
  for (int s = S - 1; s >= 0; --s)
    for (int mb = 0; mb < m; ++mb) rows[s % p].push_back(A(B(s, mb)));
  return make("gpipe-interleaved", p, interleaved_placement(p, v), m, std::move(rows));
}

// Index of the first instruction of `rank` whose description (without the
// "rank R #I " prefix) equals `text`; -1 when absent.
inline int find_instr(const Plan& plan, int rank, const std::string& text) {
  for (int i = 0; i < static_cast<int>(plan.programs[rank].size()); ++i) {
    const std::string d = plan.describe(rank, i);
    const std::string prefix = "rank " + std::to_string(rank) + " #" + std::to_string(i) + " ";
    if (d.substr(prefix.size()) == text) return i;
  }
  return -1;
}

// Runs `fn`, expects exception E, returns its message.
template <typename E, typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected exception was not thrown";
  return "";
}

}  // namespace baton::testing
