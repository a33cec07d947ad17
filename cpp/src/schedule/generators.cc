// Schedule generators (docs/SCHEDULES.md describes each order, its bubble and
// memory, and why the orders look the way they do).
//
// Every order here must be deadlock-free when lowered as plan.h describes:
// RECVs of an action's remote inputs just before its RUN, SENDs of its outputs
// just after, consecutive SEND/RECVs forming one blocking group, and traffic
// from rank a to rank b in one FIFO channel per buffer kind (activations and
// gradients travel separately). Blocking groups are the binding rule: a rank
// whose send waits for a receive its peer only posts after a send of its own
// deadlocks, so neighbours must exchange in compatible orders.
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

// A small unit-time list scheduler used by the ZB-H2 generator: every task
// takes one tick, a task may start once its producers finished, and each rank
// picks among its ready tasks by a fixed rule. The rule, not the clock, is
// what the schedule keeps: the result is the per-rank order.
// Cost O(ticks * ranks * stages per rank).
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

// Checkerboard lanes. Every task takes one tick. Rank r works on "down-flow"
// tasks (F of stage r, I of stage 2p-1-r: input from rank r-1, output to rank
// r+1) at ticks t with t-r even and on "up-flow" tasks (F of stage 2p-1-r, I
// of stage r: input from r+1, output to r-1) at ticks with t-r odd. A down
// task at (r, t) therefore feeds the down slot (r+1, t+1) and an up task at
// (r+1, t) the up slot (r, t+1): a chain started by rank 0 (F0 or I of stage
// 2p-1) runs down the ranks one tick apart, and a chain started by rank p-1
// (F of stage p or I of stage p-1, both fed locally at the turn of the V) runs
// up. Every transfer is consumed the tick after it is produced, so each
// communication group meets its peer group at the same tick: the plan is
// deadlock-free under blocking groups whatever a rank does in the slots no
// chain uses, in particular W passes that split a group. (FIFO holds too:
// each stage's tasks run in microbatch order and chains keep their order.)
//
// Policy at the two chain-starting slots: start no chain while the rank owes
// more than p W passes (that slot, on every rank, is then free for W); else
// prefer a forward (rank 0: at most p+1 microbatches between F and I of stage
// 0) over an input gradient. Every other free slot runs the rank's oldest W.
// Measured with f = i = w (docs/SCHEDULES.md): bubble (p-1)f for m = p and
// every m >= 2p; peak stash independent of m.
namespace {
// The lane machinery shared by the V-shape zero-bubble family. Only rank 0's
// choice to start a forward chain (F of stage 0) is a policy knob; every
// other slot follows the lanes, so every setting stays deadlock-free:
//   cap_f: microbatches between F and I of stage 0 (hence in flight anywhere);
//   cap_w: W passes a chain-starting rank may owe before it starts no chain;
//   gap:   ticks between consecutive stage-0 forwards once `burst` have run
//          (0: none; the down slots of rank 0 come every 2 ticks).
Schedule v_lanes(const char* name, int p, int m, int cap_f, int cap_w, int gap = 0,
                 int burst = 0) {
  check_common(name, p, m, 2);
  Schedule s = make_base(name, p, m, v_placement(p));
  const int S = 2 * p;
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max() / 4;
  std::vector<int64_t> f_end(static_cast<size_t>(S) * m, kNever), i_end(f_end.size(), kNever);
  auto fe = [&](int st, int mb) -> int64_t& { return f_end[static_cast<size_t>(st) * m + mb]; };
  auto ie = [&](int st, int mb) -> int64_t& { return i_end[static_cast<size_t>(st) * m + mb]; };
  std::vector<int> nf(S, 0), ni(S, 0), nw(S, 0);
  // Chain started at tick t by rank 0 (down) / rank p-1 (up); stage < 0: none.
  const Task none{TaskKind::F, -1, -1};
  std::vector<Task> down_start, up_start;
  const size_t ticks = static_cast<size_t>(6) * m + 4 * static_cast<size_t>(p) + 8;
  down_start.reserve(ticks);
  up_start.reserve(ticks);
  for (auto& row : s.rank_actions) row.reserve(static_cast<size_t>(6) * m);
  int64_t left = int64_t{6} * p * m;
  int64_t last_f0 = -int64_t{gap};
  for (int64_t t = 0; left > 0; ++t) {
    if (t > static_cast<int64_t>(2 * ticks))  // every task runs within ~6m + 4p ticks
      throw ScheduleError(fmt::format(
          "{} generator did not finish (ranks={}, microbatches={}): internal error", name, p, m));
    down_start.push_back(none);
    up_start.push_back(none);
    for (int r = 0; r < p; ++r) {
      const int c0 = r, c1 = S - 1 - r;
      const bool down = ((t - r) & 1) == 0;
      Task task = none;
      // A chain passing through this slot.
      if (down && t - r >= 0) {
        const Task& c = down_start[static_cast<size_t>(t - r)];
        if (c.stage >= 0) task = Task{c.kind, c.kind == TaskKind::F ? c0 : c1, c.microbatch};
      } else if (!down && t - (p - 1 - r) >= 0) {
        const Task& c = up_start[static_cast<size_t>(t - (p - 1 - r))];
        if (c.stage >= 0) task = Task{c.kind, c.kind == TaskKind::F ? c1 : c0, c.microbatch};
      }
      // A chain starting here.
      const bool starts = down ? r == 0 : r == p - 1;
      if (task.stage < 0 && starts && (ni[c0] - nw[c0]) + (ni[c1] - nw[c1]) <= cap_w - 1) {
        if (down) {
          if (nf[0] < m && nf[0] - ni[0] < cap_f && (nf[0] < burst || t >= last_f0 + gap)) {
            task = Task{TaskKind::F, 0, nf[0]};
            last_f0 = t;
          }
          else if (ni[S - 1] < nf[S - 1] && fe(S - 1, ni[S - 1]) <= t)
            task = Task{TaskKind::I, S - 1, ni[S - 1]};
          down_start.back() = task;
        } else {
          if (nf[p] < nf[p - 1] && fe(p - 1, nf[p]) <= t)
            task = Task{TaskKind::F, p, nf[p]};
          else if (ni[p - 1] < ni[p] && ie(p, ni[p - 1]) <= t)
            task = Task{TaskKind::I, p - 1, ni[p - 1]};
          up_start.back() = task;
        }
      }
      // Otherwise the oldest W pass that is due.
      if (task.stage < 0) {
        for (int st : {c0, c1}) {
          if (nw[st] < ni[st] && ie(st, nw[st]) <= t) {
            task = Task{TaskKind::W, st, nw[st]};
            break;
          }
        }
      }
      if (task.stage < 0) continue;
      if (task.kind == TaskKind::F)
        fe(task.stage, nf[task.stage]++) = t + 1;
      else if (task.kind == TaskKind::I)
        ie(task.stage, ni[task.stage]++) = t + 1;
      else
        ++nw[task.stage];
      s.rank_actions[r].push_back(Action{task});
      --left;
    }
  }
  return s;
}
}  // namespace

Schedule zb_v(int p, int m) { return v_lanes("zbv", p, m, p + 1, p + 1); }

// ------------------------------------------------------------ V-Min / V-Half

// Controllable-memory V schedules (Qi et al., NeurIPS 2024). A rank does six
// chunk tasks per microbatch (F, I, W of two stages), so in the steady state
// a new microbatch can enter every 6 ticks. V-Min starts stage-0 forwards
// exactly that far apart: a microbatch's stash then lives only along its own
// chain (4p ticks on stage 0), and a rank holds about 4p/6 = 2p/3 chunks, a
// third of 1F1B's 2p. V-Half first runs ceil(p/3) forwards back to back,
// spending about p/3 more chunks (about p, half of 1F1B's) to fill the
// pipeline sooner. Neither caps F-I any further than the spacing does.
Schedule v_min(int p, int m) { return v_lanes("vmin", p, m, m, p + 1, 6, 0); }

Schedule v_half(int p, int m) { return v_lanes("vhalf", p, m, m, p + 1, 6, (p + 2) / 3); }

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
  return {"gpipe", "1f1b", "eager1f1b", "interleaved", "zbh1", "zbh2",
          "zbv",   "vmin", "vhalf",     "dualpipev"};
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
      {"zbh2", zb_h2},  {"zbv", zb_v},         {"vmin", v_min},       {"vhalf", v_half},
      {"dualpipev", dualpipe_v},
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

Schedule fuse_forward_backward(const Schedule& s) {
  Schedule out = s;
  for (auto& acts : out.rank_actions) {
    std::vector<Action> fused;
    fused.reserve(acts.size());
    for (size_t k = 0; k < acts.size(); ++k) {
      const Action& a = acts[k];
      if (k + 1 < acts.size() && !a.is_fused() && !acts[k + 1].is_fused() &&
          a.first.kind == TaskKind::F && acts[k + 1].first.kind == TaskKind::B &&
          a.first.stage == s.num_stages - 1 && acts[k + 1].first.stage == a.first.stage &&
          acts[k + 1].first.microbatch == a.first.microbatch) {
        fused.push_back(Action{a.first, acts[k + 1].first});
        ++k;
      } else {
        fused.push_back(a);
      }
    }
    acts = std::move(fused);
  }
  return out;
}

}  // namespace baton
