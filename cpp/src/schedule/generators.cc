// Schedule generators (docs/SCHEDULES.md describes each order, its bubble and
// memory, and why the orders look the way they do).
//
// Every order here must be deadlock-free when lowered as plan.h describes:
// RECVs of an action's remote inputs just before its RUN, SENDs of its outputs
// just after, consecutive SEND/RECVs forming one blocking group, and all
// traffic from rank a to rank b in one FIFO channel. The last rule means that
// two neighbours must agree on the interleaving of the two kinds of traffic
// they exchange; the orders below are built so that they do.
#include "baton/generators.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <deque>
#include <limits>

#include "baton/error.h"

namespace baton {

namespace {

Action act(TaskKind k, int32_t stage, int32_t mb) { return Action{Task{k, stage, mb}}; }
Action fused(Task a, Task b) { return Action{a, b}; }

// Upper bound on stages * microbatches (every generator builds O(that) actions).
constexpr int64_t kMaxTaskSlots = int64_t{1} << 22;

void check_common(const char* name, int p, int m, int64_t chunks = 1) {
  if (p < 1) throw ScheduleError(fmt::format("{} needs ranks >= 1 (got ranks={})", name, p));
  if (m < 1)
    throw ScheduleError(fmt::format("{} needs microbatches >= 1 (got microbatches={})", name, m));
  const int64_t slots = int64_t{p} * chunks * m;
  if (slots > kMaxTaskSlots)
    throw ScheduleError(fmt::format(
        "{} is too large: stages*microbatches = {} (ranks={}, microbatches={}) exceeds {}", name,
        slots, p, m, kMaxTaskSlots));
}

Schedule make_base(const char* name, int p, int m, std::vector<int32_t> placement) {
  Schedule s;
  s.name = name;
  s.num_ranks = p;
  s.num_stages = static_cast<int32_t>(placement.size());
  s.num_microbatches = m;
  s.stage_rank = std::move(placement);
  s.rank_actions.resize(p);
  return s;
}

// A small unit-time list scheduler shared by the zero-bubble generators
// (ZB-H2, ZB-V): every task takes one tick, a task may start once its
// producers finished, and each rank picks among its ready tasks by a fixed
// rule. The rule, not the clock, is what the schedule keeps: the result is
// the per-rank order. Cost O(ticks * ranks * stages per rank).
struct UnitClock {
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::max() / 4;
  int S, M;
  std::vector<int64_t> f_end, i_end;  // [stage * M + mb]
  UnitClock(int stages, int mbs)
      : S(stages),
        M(mbs),
        f_end(static_cast<size_t>(stages) * mbs, kNever),
        i_end(static_cast<size_t>(stages) * mbs, kNever) {}
  int64_t& f(int s, int mb) { return f_end[static_cast<size_t>(s) * M + mb]; }
  int64_t& i(int s, int mb) { return i_end[static_cast<size_t>(s) * M + mb]; }
  bool f_ready(int s, int mb, int64_t t) { return s == 0 || f(s - 1, mb) <= t; }
  bool i_ready(int s, int mb, int64_t t) {
    return f(s, mb) <= t && (s == S - 1 || i(s + 1, mb) <= t);
  }
};

}  // namespace

// ---------------------------------------------------------------- GPipe / 1F1B

Schedule gpipe(int p, int m) {
  check_common("gpipe", p, m);
  Schedule s = make_base("gpipe", p, m, contiguous_placement(p));
  for (int r = 0; r < p; ++r) {
    auto& row = s.rank_actions[r];
    row.reserve(2 * m);
    for (int k = 0; k < m; ++k) row.push_back(act(TaskKind::F, r, k));
    for (int k = 0; k < m; ++k) row.push_back(act(TaskKind::B, r, k));
  }
  return s;
}

namespace {
// Rank r: `warm(r)` forwards, then one forward and one backward alternately
// (backward first when `backward_first`), then the remaining backwards.
Schedule one_f_one_b_like(const char* name, int p, int m, bool backward_first, auto warm) {
  Schedule s = make_base(name, p, m, contiguous_placement(p));
  for (int r = 0; r < p; ++r) {
    auto& row = s.rank_actions[r];
    row.reserve(2 * m);
    const int w = std::min(warm(r), m);
    int f = 0, b = 0;
    for (; f < w; ++f) row.push_back(act(TaskKind::F, r, f));
    while (f < m) {
      if (backward_first) row.push_back(act(TaskKind::B, r, b++));
      row.push_back(act(TaskKind::F, r, f++));
      if (!backward_first) row.push_back(act(TaskKind::B, r, b++));
    }
    while (b < m) row.push_back(act(TaskKind::B, r, b++));
  }
  return s;
}
}  // namespace

Schedule one_f_one_b(int p, int m) {
  check_common("1f1b", p, m);
  return one_f_one_b_like("1f1b", p, m, false, [p](int r) { return p - r - 1; });
}

Schedule eager_one_f_one_b(int p, int m) {
  check_common("eager1f1b", p, m);
  return one_f_one_b_like("eager1f1b", p, m, true, [p](int r) { return 2 * (p - r) - 1; });
}

// ------------------------------------------------------------- Interleaved 1F1B

Schedule interleaved_one_f_one_b(int p, int m, int v) {
  check_common("interleaved", p, m);
  if (v < 1)
    throw ScheduleError(fmt::format("interleaved needs virtual stages >= 1 (got v={})", v));
  check_common("interleaved", p, m, v);
  if (v == 1) {
    Schedule s = one_f_one_b(p, m);
    s.name = "interleaved";
    return s;
  }
  if (m % p != 0 && m > p)
    throw ScheduleError(
        fmt::format("interleaved needs microbatches to be a multiple of ranks, or at most ranks "
                    "(got ranks={}, microbatches={}, v={})",
                    p, m, v));
  // Microbatches go in rounds of g = min(p, m): a rank runs chunk 0 of the
  // round's microbatches, then chunk 1, ... (Megatron order). Backwards
  // visit the chunks in reverse.
  const int g = std::min(p, m);
  const int64_t total = static_cast<int64_t>(m) * v;
  auto chunk_of = [&](int64_t k, bool backward) {
    const int c = static_cast<int>((k / g) % v);
    return backward ? v - 1 - c : c;
  };
  auto mb_of = [&](int64_t k) {
    return static_cast<int32_t>((k / (static_cast<int64_t>(g) * v)) * g + k % g);
  };
  Schedule s = make_base("interleaved", p, m, interleaved_placement(p, v));
  for (int r = 0; r < p; ++r) {
    auto& row = s.rank_actions[r];
    row.reserve(static_cast<size_t>(total) + 8);
    auto F = [&](int64_t k) { return Task{TaskKind::F, chunk_of(k, false) * p + r, mb_of(k)}; };
    auto B = [&](int64_t k) { return Task{TaskKind::B, chunk_of(k, true) * p + r, mb_of(k)}; };
    const int64_t warm =
        std::min<int64_t>(2 * (p - r - 1) + static_cast<int64_t>(v - 1) * g, total);
    int64_t f = 0, b = 0;
    for (; f < warm; ++f) row.push_back(Action{F(f)});
    // Steady state: the forward and the backward of one step form one fused
    // action, so their receives are posted together before and their sends
    // together after (Megatron's send_forward_backward_recv_forward_backward).
    // Without this the looped placement deadlocks under blocking groups.
    for (; f < total; ++f, ++b) {
      const Task tf = F(f), tb = B(b);
      if (tf.stage == tb.stage && tf.microbatch == tb.microbatch) {
        row.push_back(Action{tf});
        row.push_back(Action{tb});
      } else {
        row.push_back(fused(tf, tb));
      }
    }
    for (; b < total; ++b) row.push_back(Action{B(b)});
  }
  return s;
}

// ---------------------------------------------------------------------- ZB-H1

Schedule zb_h1(int p, int m) {
  check_common("zbh1", p, m);
  Schedule s = make_base("zbh1", p, m, contiguous_placement(p));
  for (int r = 0; r < p; ++r) {
    auto& row = s.rank_actions[r];
    row.reserve(3 * m);
    const int w = std::min(p - r, m);
    int f = 0, wq = 0;
    for (; f < w; ++f) row.push_back(act(TaskKind::F, r, f));
    // Rank r starts its W passes r microbatches late; the deferred W fill the
    // tail that 1F1B leaves idle.
    for (int k = 0; k < m; ++k) {
      row.push_back(act(TaskKind::I, r, k));
      if (k >= r) row.push_back(act(TaskKind::W, r, wq++));
      if (f < m) row.push_back(act(TaskKind::F, r, f++));
    }
    while (wq < m) row.push_back(act(TaskKind::W, r, wq++));
  }
  return s;
}

// ---------------------------------------------------------------------- ZB-H2

Schedule zb_h2(int p, int m) {
  check_common("zbh2", p, m);
  Schedule s = make_base("zbh2", p, m, contiguous_placement(p));
  // Unit-time list scheduling: I before F before W; a rank keeps at most
  // 2p-1 microbatches between F and W.
  UnitClock clk(p, m);
  const int cap = 2 * p - 1;
  std::vector<int> nf(p, 0), ni(p, 0), nw(p, 0);
  std::vector<int64_t> busy(p, 0);
  int64_t left = 3LL * p * m;
  for (auto& row : s.rank_actions) row.reserve(3 * m);
  for (int64_t t = 0; left > 0; ++t) {
    for (int r = 0; r < p; ++r) {
      if (busy[r] > t) continue;
      TaskKind k;
      int mb;
      if (ni[r] < nf[r] && clk.i_ready(r, ni[r], t)) {
        k = TaskKind::I, mb = ni[r]++;
        clk.i(r, mb) = t + 1;
      } else if (nf[r] < m && nf[r] - nw[r] < cap && clk.f_ready(r, nf[r], t)) {
        k = TaskKind::F, mb = nf[r]++;
        clk.f(r, mb) = t + 1;
      } else if (nw[r] < ni[r] && clk.i(r, nw[r]) <= t) {
        k = TaskKind::W, mb = nw[r]++;
      } else {
        continue;
      }
      s.rank_actions[r].push_back(act(k, r, mb));
      busy[r] = t + 1;
      --left;
    }
  }
  return s;
}

// ----------------------------------------------------------------------- ZB-V

Schedule zb_v(int p, int m) {
  check_common("zbv", p, m, 2);
  Schedule s = make_base("zbv", p, m, v_placement(p));
  const int S = 2 * p;
  // Channel r -> r+1 carries F outputs of stage r and I outputs of stage
  // 2p-1-r; channel r+1 -> r the other two. FIFO channels therefore need
  // every rank to interleave "F of its down-chunk" with "I of its up-chunk"
  // in the same pattern, and likewise for the other pair. The common
  // patterns are: k of the first kind, then alternate, then k of the
  // second kind, k = min(p, m).
  const int kk = std::min(p, m);
  auto pattern_at = [&](int pos) {  // true: first kind (F), false: second (I)
    if (pos < kk) return true;
    if (pos >= 2 * m - kk) return false;
    return ((pos - kk) % 2) == 1;
  };
  UnitClock clk(S, m);
  std::vector<int> nf(S, 0), ni(S, 0), nw(S, 0);
  std::vector<int> pos_down(p, 0), pos_up(p, 0);  // positions in the two patterns
  std::vector<int64_t> busy(p, 0);
  int64_t left = 3LL * S * m;
  for (auto& row : s.rank_actions) row.reserve(6 * m);
  for (int64_t t = 0; left > 0; ++t) {
    for (int r = 0; r < p; ++r) {
      if (busy[r] > t) continue;
      const int c0 = r, c1 = S - 1 - r;
      // Pattern "down" holds F(c0) [first] and I(c1) [second]; "up" holds
      // F(c1) [first] and I(c0) [second].
      auto allowed = [&](TaskKind k, int st) {
        if (k == TaskKind::W) return true;
        const bool first = k == TaskKind::F;
        const bool down = (k == TaskKind::F) == (st == c0);
        return pattern_at(down ? pos_down[r] : pos_up[r]) == first;
      };
      // Priority F > I > W; forwards prefer the later stage, I the earlier.
      // W therefore runs when nothing else may, in practice at the rank's end:
      // placing W passes inside the steady state splits communication groups,
      // and every placement tried deadlocks under blocking groups.
      Task pick{TaskKind::F, -1, -1};
      for (int st : {c1, c0}) {
        if (nf[st] < m && clk.f_ready(st, nf[st], t) && allowed(TaskKind::F, st)) {
          pick = Task{TaskKind::F, st, nf[st]};
          break;
        }
      }
      if (pick.stage < 0)
        for (int st : {c0, c1}) {
          if (ni[st] < nf[st] && clk.i_ready(st, ni[st], t) && allowed(TaskKind::I, st)) {
            pick = Task{TaskKind::I, st, ni[st]};
            break;
          }
        }
      if (pick.stage < 0)
        for (int st : {c0, c1}) {
          if (nw[st] < ni[st] && clk.i(st, nw[st]) <= t) {
            pick = Task{TaskKind::W, st, nw[st]};
            break;
          }
        }
      if (pick.stage < 0) continue;
      const int st = pick.stage;
      if (pick.kind == TaskKind::F) {
        clk.f(st, nf[st]++) = t + 1;
        ++(st == c0 ? pos_down[r] : pos_up[r]);
      } else if (pick.kind == TaskKind::I) {
        clk.i(st, ni[st]++) = t + 1;
        ++(st == c1 ? pos_down[r] : pos_up[r]);
      } else {
        ++nw[st];
      }
      s.rank_actions[r].push_back(Action{pick});
      busy[r] = t + 1;
      --left;
    }
  }
  return s;
}

// ------------------------------------------------------------------ DualPipeV

Schedule dualpipe_v(int p, int m) {
  check_common("dualpipev", p, m, 2);
  if (m < 2 * p)
    throw ScheduleError(fmt::format(
        "dualpipev needs microbatches >= 2*ranks (got ranks={}, microbatches={})", p, m));
  Schedule s = make_base("dualpipev", p, m, v_placement(p));
  for (int r = 0; r < p; ++r) {
    auto& row = s.rank_actions[r];
    row.reserve(8 * m);
    const std::array<int32_t, 2> st = {r, 2 * p - 1 - r};
    std::array<int32_t, 2> fc = {0, 0}, bc = {0, 0};
    std::deque<Task> wq;  // W passes owed by earlier I passes, oldest first
    auto F = [&](int c) { return Task{TaskKind::F, st[c], fc[c]++}; };
    auto B = [&](int c, bool zb) {
      const int32_t k = bc[c]++;
      if (!zb) return Task{TaskKind::B, st[c], k};
      wq.push_back(Task{TaskKind::W, st[c], k});
      return Task{TaskKind::I, st[c], k};
    };
    auto W = [&] {
      const Task w = wq.front();
      wq.pop_front();
      return w;
    };
    auto one = [&](Task t) { row.push_back(Action{t}); };
    // Ranks r < p-2 move p-r-2 of their warm-up forwards into step 3 so that
    // every rank interleaves chunk-0 forwards with chunk-1 backwards in the
    // same pattern (needed by FIFO channels; see docs/SCHEDULES.md).
    const int moved = std::max(0, p - r - 2);
    // 1: chunk-0 forwards.
    for (int i = 0; i < 2 * (p - r - 1) - moved; ++i) one(F(0));
    // 2: chunk-0 and chunk-1 forwards alternately.
    for (int i = 0; i < r + 1; ++i) {
      one(F(0));
      one(F(1));
    }
    // 3: zero-bubble warm-up: F1, I1, W1 (+ one moved F0).
    for (int j = 0; j < p - r - 1; ++j) {
      one(F(1));
      one(B(1, true));
      one(W());
      if (j < moved) one(F(0));
    }
    // 4: main phase, fused F0&B1 then fused F1&B0.
    for (int i = 0; i < m - 2 * p + r + 1; ++i) {
      if (i == 0 && r == p - 1) {  // the turn of the V: no overlap possible
        one(F(0));
        one(B(1, false));
      } else {
        const Task f = F(0);
        row.push_back(fused(f, B(1, false)));
      }
      const Task f = F(1);
      row.push_back(fused(f, B(0, false)));
    }
    // 5: B1, then fused F1&B0.
    for (int i = 0; i < p - r - 1; ++i) {
      one(B(1, false));
      const Task f = F(1);
      row.push_back(fused(f, B(0, false)));
    }
    // 6: B1 and B0 alternately; from the middle on as I passes (W deferred).
    bool zb = false;
    const int n6 = r + 1;
    for (int i = 0; i < n6; ++i) {
      if (i == n6 / 2 && r % 2 == 1) zb = true;
      one(B(1, zb));
      if (i == n6 / 2 && r % 2 == 0) zb = true;
      one(B(0, zb));
    }
    // 7: W then I0.
    for (int i = 0; i < p - r - 1; ++i) {
      one(W());
      one(B(0, true));
    }
    // 8: the remaining W passes.
    while (!wq.empty()) one(W());
  }
  return s;
}

// ------------------------------------------------------------------- dispatch

std::vector<std::string> schedule_names() {
  return {"gpipe", "1f1b", "eager1f1b", "interleaved", "zbh1", "zbh2", "zbv", "dualpipev"};
}

Schedule make_schedule(std::string_view name, int p, int m, int v) {
  std::string key;
  for (char c : name) {
    if (c == '-' || c == '_') continue;
    key.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  if (key == "interleaved" || key == "interleaved1f1b") return interleaved_one_f_one_b(p, m, v);
  using Gen = Schedule (*)(int, int);
  static const std::pair<const char*, Gen> kGens[] = {
      {"gpipe", gpipe}, {"1f1b", one_f_one_b}, {"eager1f1b", eager_one_f_one_b}, {"zbh1", zb_h1},
      {"zbh2", zb_h2},  {"zbv", zb_v},         {"dualpipev", dualpipe_v},
  };
  for (const auto& [n, gen] : kGens) {
    if (key != n) continue;
    if (v != 1)
      throw ScheduleError(fmt::format(
          "schedule '{}' takes no virtual stages (got v={}); only 'interleaved' does", n, v));
    return gen(p, m);
  }
  std::string known;
  for (const auto& n : schedule_names()) known += (known.empty() ? "" : ", ") + n;
  throw ScheduleError(fmt::format("unknown schedule '{}' (known: {})", name, known));
}

}  // namespace baton
