// Automatic pipeline planning: exact branch and bound over (family, v, M,
// partition, remat). Method and the validity of each bound: autoplan.h.
#include "baton/autoplan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <nlohmann/json.hpp>

#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/sim.h"
#include "baton/verify.h"

namespace baton {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct TaskRef {
  TaskKind kind = TaskKind::F;
  int32_t stage = 0, mb = 0;
};

struct ActRef {
  TaskRef t[2];
  int n = 1;
};

// One remat option of one stage.
struct Option {
  Remat mode = Remat::Keep;
  double added = 0;   // added to b and i
  int64_t stash = 0;  // stash bytes per microbatch
  StageCost cost;     // stage_cost() of this mode
};

// Bounds are computed with prefix sums, the simulated costs with sequential
// sums: a bound may exceed its exact value by a few ulps, so a node is cut
// only when its bound clears the threshold by more than that.
// With a relative gap g > 0 a node is also cut when its bound is within a
// factor (1 + g) of the threshold: the result is then within (1 + g) of the
// optimum (bounded approximation).
bool cut(double lb, double T, double gap) { return lb * (1.0 - 1e-12) * (1.0 + gap) >= T; }

// A (family, v, M) configuration: its lowered plan, the coefficients of the
// bounds, and the scaled segment costs.
struct Config {
  std::string name;
  int v = 1, M = 1, S = 0, P = 0;
  Plan plan;
  std::vector<int> stage_rank;
  std::vector<std::vector<int>> rank_stages;
  std::vector<double> cf, cb, ci, cw;  // busy coefficients per stage
  std::vector<uint8_t> uses_b, uses_i;
  std::vector<uint8_t> rank_has_w;
  bool fused = false;
  double chain_c = 1;  // min(1, fused_factor) when the schedule fuses actions
  std::vector<std::vector<ActRef>> acts;
  // Structural memory rows per rank: action index and, per local stage,
  // (stash count, wstash count) live across that action.
  std::vector<std::vector<int32_t>> row_action;
  std::vector<std::vector<int32_t>> row_cnt;
  std::vector<int> local;  // stage -> index among its rank's stages
  SegmentCosts sc;         // scaled
  std::vector<double> pf, pb, pi, pw, prec;
  std::array<double, 4> saved{};  // sc.tasks_saved()
  std::vector<int64_t> pstash, pmin, pwstash, pstatic, pupdate;
  std::vector<int64_t> tmax;  // (n+1)*(n+1): max temp of [a, e)
  double root_lb = 0;
  std::vector<int> seed_cuts;
  double lower = kInf;  // certified lower bound on this configuration's best
  double best = kInf;
  PlanCandidate best_cand;
};

class Searcher {
 public:
  Searcher(const SegmentCosts& costs, const AutoplanOptions& o) : in_(costs), o_(o) {
    n_ = static_cast<int>(costs.segments.size());
    modes_ = o.remat_modes.empty() ? std::vector<Remat>{Remat::Keep, Remat::Min, Remat::Full}
                                   : o.remat_modes;
    budget_ = o.memory > 0 ? o.memory : std::numeric_limits<int64_t>::max();
    gap_ = o.gap;
    node_budget_ = o.node_budget;
  }
  AutoplanResult run();

 private:
  void add_config(const std::string& name, int v, int M);
  void prepare(Config& c);
  // Per-stage quantities over [a, e) of config c.
  double sum(const std::vector<double>& p, int a, int e) const { return p[e] - p[a]; }
  // A stage's f, b, i or w over [a, e) (k: 0..3): the prefix arrays hold each
  // segment's time less tasks_saved()[k], and the stage pays it once.
  double tsum(const Config& c, int k, int a, int e) const {
    const std::vector<double>* p[4] = {&c.pf, &c.pb, &c.pi, &c.pw};
    return (*p[k])[e] - (*p[k])[a] + c.saved[k];
  }
  double add_min(const Config& c, int a, int e) const;
  double stage_busy(const Config& c, int s, int a, int e, double add) const {
    return c.cf[s] * tsum(c, 0, a, e) + c.cb[s] * (tsum(c, 1, a, e) + add) +
           c.ci[s] * (tsum(c, 2, a, e) + add) + c.cw[s] * tsum(c, 3, a, e);
  }
  int64_t stage_mem(const Config& c, int a, int e) const { return c.pstatic[e] - c.pstatic[a]; }
  // The new parameters and optimizer state the update after the loop allocates
  // beside the old ones (0 when it writes them in place: update_in_place).
  int64_t stage_upd(const Config& c, int a, int e) const {
    return o_.update_in_place ? 0 : c.pupdate[e] - c.pupdate[a];
  }
  // A rank's peak: its static bytes plus the larger of the loop (transient +
  // pipeline buffers) and the update's new copies.
  int64_t rank_peak(int r, int64_t buffers) const {
    return static_[r] + std::max(temp_[r] + buffers, upd_[r]);
  }
  int64_t temp(const Config& c, int a, int e) const { return c.tmax[a * (n_ + 1) + e]; }
  double bi_min(const Config& c, int s, double b, double i) const {
    double v = kInf;
    if (c.uses_b[s]) v = std::min(v, b);
    if (c.uses_i[s]) v = std::min(v, i);
    return v == kInf ? 0 : v;
  }
  double hop(const Config& c, int s, int64_t bytes) const {
    if (c.stage_rank[s] == c.stage_rank[s + 1]) return 0;
    return in_.link.latency + (in_.link.bandwidth > 0 ? bytes / in_.link.bandwidth : 0.0);
  }
  bool remaining_feasible(const Config& c, int s, int a) const;
  double min_max_busy(const Config& c, std::vector<int>* cuts) const;
  void threshold(const Config& c);
  void dfs(Config& c, int s, int a, double node_lb);
  void leaf(Config& c);
  void build_options(const Config& c);
  // Zeroes the DFS state (cuts_, busy_, static_, temp_, hd_, td_) sized for c.
  void clear_dfs_state(const Config& c);
  void set_partition(const Config& c, const std::vector<int>& cuts);
  void probe_min_memory(const Config& c);
  void remat_dfs(Config& c, size_t k);
  void remat_leaf(Config& c);
  // Simulates c.plan at the current stage costs stc_ (counted in st_.simulated).
  SimResult simulate_stc(const Config& c);
  double relax(const Config& c) const;
  int64_t rank_stash_lb(const Config& c, int r) const;
  void note_peak(int64_t peak, int rank, const std::string& what, bool exact);

  const SegmentCosts& in_;
  const AutoplanOptions& o_;
  int n_ = 0;
  std::vector<Remat> modes_;
  int64_t budget_ = 0;
  double gap_ = 0;
  int64_t node_budget_ = 0;  // DFS nodes per configuration; 0: unlimited
  int64_t nodes_ = 0;
  double abandoned_lb_ = kInf;  // smallest bound of a subtree left unexplored
  double leaf_lb_ = 0;          // (B3) of the current partition at its fastest remat
  std::vector<Config> cfgs_;
  AutoplanStats st_;
  double T_ = kInf;    // current threshold
  double kth_ = kInf;  // K-th best of the other configurations
  // DFS state (per configuration).
  std::vector<int> cuts_;
  std::vector<double> busy_;  // per rank
  std::vector<int64_t> static_, temp_, upd_;
  std::vector<double> hd_, td_;
  // Leaf state.
  std::vector<StageCost> stc_;
  std::vector<StageCost> fast_;  // costs at every stage's fastest option
  std::vector<std::vector<Option>> opts_;
  std::vector<int> choice_;
  std::vector<int> order_;     // stages grouped by rank
  std::vector<int> rank_end_;  // order_ index after which rank r is complete (-1 if none)
  std::vector<std::vector<int>> feasible_;  // choice vectors that fit (this partition)
  mutable std::vector<double> fend_;
  // Smallest peak seen among candidates that do not fit.
  int64_t min_peak_ = std::numeric_limits<int64_t>::max();
  int min_peak_rank_ = -1;
  bool min_peak_exact_ = false;
  std::string min_peak_what_;
};

double Searcher::add_min(const Config& c, int a, int e) const {
  double v = kInf;
  for (Remat m : modes_) {
    if (m == Remat::Keep) v = std::min(v, 0.0);
    if (m == Remat::Min) v = std::min(v, sum(c.prec, a, e));
    if (m == Remat::Full) v = std::min(v, tsum(c, 0, a, e));
  }
  return v;
}

void Searcher::add_config(const std::string& name, int v, int M) {
  Config c;
  c.name = name;
  c.v = v;
  c.M = M;
  Schedule s;
  try {
    s = make_schedule(name, o_.ranks, M, name == "interleaved" ? v : 1);
  } catch (const ScheduleError&) {
    ++st_.refused;
    return;
  }
  if (s.num_stages > n_) {
    ++st_.refused;
    return;
  }
  c.plan = lower(s);
  c.S = s.num_stages;
  c.P = s.num_ranks;
  c.v = c.S / c.P;
  c.sc = in_.scaled(M);
  prepare(c);
  ++st_.configurations;
  cfgs_.push_back(std::move(c));
}

void Searcher::prepare(Config& c) {
  const Schedule& s = c.plan.schedule;
  const int S = c.S, P = c.P, M = c.M;
  const double ff = in_.fused_factor;
  c.stage_rank = s.stage_rank;
  c.rank_stages.assign(P, {});
  c.local.assign(S, 0);
  for (int st = 0; st < S; ++st) {
    c.local[st] = static_cast<int>(c.rank_stages[c.stage_rank[st]].size());
    c.rank_stages[c.stage_rank[st]].push_back(st);
  }
  c.cf.assign(S, 0);
  c.cb.assign(S, 0);
  c.ci.assign(S, 0);
  c.cw.assign(S, 0);
  c.uses_b.assign(S, 0);
  c.uses_i.assign(S, 0);
  c.rank_has_w.assign(P, 0);
  c.acts.assign(P, {});
  c.row_action.assign(P, {});
  c.row_cnt.assign(P, {});
  for (int r = 0; r < P; ++r) {
    const auto& acts = s.rank_actions[r];
    const int nloc = static_cast<int>(c.rank_stages[r].size());
    const int na = static_cast<int>(acts.size());
    // producer / consumer action of each stash and wstash of this rank.
    std::vector<int> fpos(static_cast<size_t>(S) * M, -1), ipos(static_cast<size_t>(S) * M, -1);
    std::vector<int32_t> diff(static_cast<size_t>(na + 1) * 2 * nloc, 0);
    auto add_interval = [&](int p, int q, int slot) {
      if (p < 0 || q < 0 || p == q) return;  // internal to one fused action
      diff[static_cast<size_t>(p) * 2 * nloc + slot] += 1;
      diff[static_cast<size_t>(q + 1) * 2 * nloc + slot] -= 1;
    };
    for (int k = 0; k < na; ++k) {
      const Action& a = acts[k];
      ActRef ar;
      ar.n = a.is_fused() ? 2 : 1;
      ar.t[0] = {a.first.kind, a.first.stage, a.first.microbatch};
      if (a.is_fused()) {
        c.fused = true;
        ar.t[1] = {a.second.kind, a.second.stage, a.second.microbatch};
      }
      const double w = a.is_fused() ? ff : 1.0;
      for (int j = 0; j < ar.n; ++j) {
        const TaskRef& t = ar.t[j];
        const size_t key = static_cast<size_t>(t.stage) * M + t.mb;
        const int l = c.local[t.stage];
        switch (t.kind) {
          case TaskKind::F:
            c.cf[t.stage] += w;
            fpos[key] = k;
            break;
          case TaskKind::B:
            c.cb[t.stage] += w;
            c.uses_b[t.stage] = 1;
            add_interval(fpos[key], k, 2 * l);
            break;
          case TaskKind::I:
            c.ci[t.stage] += w;
            c.uses_i[t.stage] = 1;
            add_interval(fpos[key], k, 2 * l);
            ipos[key] = k;
            break;
          case TaskKind::W:
            c.cw[t.stage] += w;
            c.rank_has_w[r] = 1;
            add_interval(ipos[key], k, 2 * l + 1);
            break;
        }
      }
      c.acts[r].push_back(ar);
    }
    std::vector<int32_t> cur(2 * nloc, 0);
    for (int k = 0; k < na; ++k) {
      for (int j = 0; j < 2 * nloc; ++j) cur[j] += diff[static_cast<size_t>(k) * 2 * nloc + j];
      c.row_action[r].push_back(k);
      c.row_cnt[r].insert(c.row_cnt[r].end(), cur.begin(), cur.end());
    }
  }
  c.chain_c = c.fused ? std::min(1.0, ff) : 1.0;
  const int n = n_;
  c.pf.assign(n + 1, 0);
  c.pb.assign(n + 1, 0);
  c.pi.assign(n + 1, 0);
  c.pw.assign(n + 1, 0);
  c.prec.assign(n + 1, 0);
  c.pstash.assign(n + 1, 0);
  c.pmin.assign(n + 1, 0);
  c.pwstash.assign(n + 1, 0);
  c.pstatic.assign(n + 1, 0);
  c.pupdate.assign(n + 1, 0);
  c.saved = c.sc.tasks_saved();
  for (int k = 0; k < n; ++k) {
    const SegmentCost& g = c.sc.segments[k];
    c.pf[k + 1] = c.pf[k] + g.f - c.saved[0];
    c.pb[k + 1] = c.pb[k] + g.b - c.saved[1];
    c.pi[k + 1] = c.pi[k] + g.i - c.saved[2];
    c.pw[k + 1] = c.pw[k] + g.w - c.saved[3];
    c.prec[k + 1] = c.prec[k] + g.min_recompute;
    c.pstash[k + 1] = c.pstash[k] + g.stash_bytes;
    c.pmin[k + 1] = c.pmin[k] + g.min_stash_bytes;
    c.pwstash[k + 1] = c.pwstash[k] + g.wstash_bytes;
    c.pstatic[k + 1] = c.pstatic[k] + 2 * g.param_bytes + g.opt_bytes;
    c.pupdate[k + 1] = c.pupdate[k] + g.param_bytes + g.opt_bytes;
  }
  const bool b_split = runs_b_as_i_then_w(s);
  c.tmax.assign(static_cast<size_t>(n + 1) * (n + 1), 0);
  for (int a = 0; a < n; ++a) {
    int64_t m = 0;
    int64_t sums = 0;
    for (int e = a + 1; e <= n; ++e) {
      m = std::max(m, c.sc.segments[e - 1].temp_bytes);
      sums += c.sc.segments[e - 1].param_bytes;
      if (b_split) sums += c.sc.segments[e - 1].wstash_bytes;
      c.tmax[static_cast<size_t>(a) * (n + 1) + e] = m + sums;  // = stage_temp_bytes
    }
  }
}

// (B4): can [a, n) be cut into stages s..S-1, each with busy < T_ and
// static + temp bytes within the budget?
bool Searcher::remaining_feasible(const Config& c, int s, int a) const {
  int pos = a;
  for (int k = s; k < c.S; ++k) {
    if (pos >= n_) return true;
    int e = pos + 1;
    auto ok = [&](int x) {
      return !cut(stage_busy(c, k, pos, x, add_min(c, pos, x)), T_, gap_) &&
             stage_mem(c, pos, x) + temp(c, pos, x) <= budget_;
    };
    if (!ok(e)) return false;
    while (e < n_ && ok(e + 1)) ++e;
    pos = e;
  }
  return pos >= n_;
}

// Smallest X such that the segments split into S stages each with busy <= X
// (and within the memory budget); fills `cuts` with such a split. kInf when
// the memory budget alone makes it impossible.
double Searcher::min_max_busy(const Config& c, std::vector<int>* cuts) const {
  auto split = [&](double X, std::vector<int>* out) {
    int pos = 0;
    if (out) out->clear();
    for (int k = 0; k < c.S; ++k) {
      if (out) out->push_back(pos);
      const int last = n_ - (c.S - 1 - k);  // leave a segment for each later stage
      if (pos >= last) return false;
      auto ok = [&](int x) {
        return stage_busy(c, k, pos, x, add_min(c, pos, x)) <= X &&
               stage_mem(c, pos, x) + temp(c, pos, x) <= budget_;
      };
      int e = pos + 1;
      if (!ok(e)) return false;
      while (e < last && ok(e + 1)) ++e;
      pos = e;
    }
    return pos >= n_;
  };
  double hi = 0;
  for (int k = 0; k < c.S; ++k) hi = std::max(hi, stage_busy(c, k, 0, n_, add_min(c, 0, n_)));
  hi = hi * 1.000001 + 1e-12;
  if (!split(hi, nullptr)) return kInf;
  double lo = 0;
  for (int it = 0; it < 60; ++it) {
    const double mid = 0.5 * (lo + hi);
    if (split(mid, nullptr))
      hi = mid;
    else
      lo = mid;
  }
  split(hi, cuts);
  // Two partition-free bounds: one microbatch's F and backward chain through
  // every segment (B3 with no contention), and the average rank busy time
  // (B1 summed over ranks, each segment at the smallest coefficient).
  double chain = 0, total = 0;
  double mf = kInf, mb = kInf, mi = kInf, mw = kInf;
  bool any_b = false, any_i = false;
  for (int k = 0; k < c.S; ++k) {
    mf = std::min(mf, c.cf[k]);
    mb = std::min(mb, c.cb[k]);
    mi = std::min(mi, c.ci[k]);
    mw = std::min(mw, c.cw[k]);
    any_b = any_b || c.uses_b[k];
    any_i = any_i || c.uses_i[k];
  }
  // Per segment its marginal time (less tasks_saved(): what it adds to a
  // stage); every one of the S stages pays the saving once.
  const std::array<double, 4>& sv = c.saved;
  for (int k = 0; k < n_; ++k) {
    double add = kInf;  // add_min over one segment, Full at its marginal f
    for (Remat m : modes_) {
      if (m == Remat::Keep) add = std::min(add, 0.0);
      if (m == Remat::Min) add = std::min(add, sum(c.prec, k, k + 1));
      if (m == Remat::Full) add = std::min(add, sum(c.pf, k, k + 1));
    }
    const double f = sum(c.pf, k, k + 1), b = sum(c.pb, k, k + 1);
    const double i = sum(c.pi, k, k + 1), w = sum(c.pw, k, k + 1);
    double bi = kInf;
    if (any_b) bi = std::min(bi, b);
    if (any_i) bi = std::min(bi, i);
    chain += c.chain_c * (f + (bi == kInf ? 0.0 : bi));
    total += mf * f + mb * (b + add) + mi * (i + add) + mw * w;
  }
  double bi_saved = kInf;
  if (any_b) bi_saved = std::min(bi_saved, sv[1]);
  if (any_i) bi_saved = std::min(bi_saved, sv[2]);
  chain += c.chain_c * c.S * (sv[0] + (bi_saved == kInf ? 0.0 : bi_saved));
  total += c.S * (mf * sv[0] + mb * sv[1] + mi * sv[2] + mw * sv[3]);
  return std::max({lo, chain, total / c.P});
}

void Searcher::threshold(const Config& c) {
  // K-th smallest best among the other configurations.
  std::vector<double> others;
  for (const Config& d : cfgs_)
    if (&d != &c && d.best < kInf) others.push_back(d.best);
  const size_t K = static_cast<size_t>(std::max(1, o_.top));
  kth_ = kInf;
  if (others.size() >= K) {
    std::nth_element(others.begin(), others.begin() + (K - 1), others.end());
    kth_ = others[K - 1];
  }
  T_ = std::min(c.best, kth_);
}

double Searcher::relax(const Config& c) const {
  const int S = c.S, M = c.M;
  const double cc = c.chain_c;
  const double ff = in_.fused_factor;
  std::vector<double> hp(S, 0), bi(S, 0), hd(S, 0), td(S, 0), up(S, 0);
  for (int s = 0; s < S; ++s) {
    bi[s] = bi_min(c, s, stc_[s].b, stc_[s].i);
    if (s + 1 < S) hp[s] = hop(c, s, stc_[s].act_bytes);
  }
  for (int s = 1; s < S; ++s) {
    hd[s] = hd[s - 1] + cc * stc_[s - 1].f + hp[s - 1];
    td[s] = td[s - 1] + cc * bi[s - 1] + hp[s - 1];
  }
  for (int s = S - 2; s >= 0; --s) up[s] = up[s + 1] + cc * (stc_[s + 1].f + bi[s + 1]) + 2 * hp[s];
  fend_.assign(static_cast<size_t>(S) * M, 0);
  double lb = 0;
  for (int r = 0; r < c.P; ++r) {
    double t = 0;
    for (const ActRef& a : c.acts[r]) {
      double rel = 0, dur = 0;
      for (int j = 0; j < a.n; ++j) {
        const TaskRef& x = a.t[j];
        const StageCost& sc = stc_[x.stage];
        dur += task_time(sc, x.kind);
        if (x.kind == TaskKind::F) {
          rel = std::max(rel, hd[x.stage]);
        } else if (x.kind == TaskKind::B || x.kind == TaskKind::I) {
          const bool internal = a.n == 2 && a.t[0].kind == TaskKind::F && a.t[0].stage == x.stage &&
                                a.t[0].mb == x.mb;
          if (!internal)
            rel = std::max(rel, fend_[static_cast<size_t>(x.stage) * M + x.mb] + up[x.stage]);
        }
      }
      if (a.n == 2) dur *= ff;
      const double end = std::max(t, rel) + dur;
      t = end;
      for (int j = 0; j < a.n; ++j) {
        const TaskRef& x = a.t[j];
        if (x.kind == TaskKind::F)
          fend_[static_cast<size_t>(x.stage) * M + x.mb] = end;
        else if (x.kind == TaskKind::B || x.kind == TaskKind::I)
          lb = std::max(lb, end + td[x.stage]);
      }
    }
    lb = std::max(lb, t);
  }
  return lb;
}

int64_t Searcher::rank_stash_lb(const Config& c, int r) const {
  const auto& st = c.rank_stages[r];
  const int nloc = static_cast<int>(st.size());
  int64_t best = 0;
  const auto& rows = c.row_action[r];
  for (size_t k = 0; k < rows.size(); ++k) {
    const ActRef& a = c.acts[r][rows[k]];
    double dur = 0;
    // Positive at the fastest options implies positive at every choice.
    for (int j = 0; j < a.n; ++j) dur += task_time(fast_[a.t[j].stage], a.t[j].kind);
    if (!(dur > 0)) continue;
    // The action's own activation, gradient and weight-gradient buffers are
    // live during its RUN too (inputs present before it, outputs allocated at
    // its start, all released after its end).
    int64_t v = 0;
    for (int j = 0; j < a.n; ++j) {
      const TaskRef& t = a.t[j];
      const StageCost& x = stc_[t.stage];
      switch (t.kind) {
        case TaskKind::F:
          if (t.stage > 0) v += x.grad_bytes;       // act(s-1) in
          if (t.stage < c.S - 1) v += x.act_bytes;  // act(s) out
          break;
        case TaskKind::B:
        case TaskKind::I:
          if (t.stage < c.S - 1) v += x.act_bytes;  // grad(s+1) in
          if (t.stage > 0) v += x.grad_bytes;       // grad(s) out
          if (t.kind == TaskKind::B) v += x.wgrad_bytes;
          break;
        case TaskKind::W:
          v += x.wgrad_bytes;
          break;
      }
    }
    const int32_t* cnt = &c.row_cnt[r][k * 2 * nloc];
    for (int l = 0; l < nloc; ++l)
      v += cnt[2 * l] * stc_[st[l]].stash_bytes + cnt[2 * l + 1] * stc_[st[l]].wstash_bytes;
    best = std::max(best, v);
  }
  return best;
}

void Searcher::note_peak(int64_t peak, int rank, const std::string& what, bool exact) {
  // Simulated peaks win over bounds (a bound only covers part of the space).
  const bool better =
      exact ? (!min_peak_exact_ || peak < min_peak_) : (!min_peak_exact_ && peak < min_peak_);
  if (better) {
    min_peak_ = peak;
    min_peak_rank_ = rank;
    min_peak_exact_ = exact;
    min_peak_what_ = what;
  }
}

std::string describe(const Config& c, const std::vector<int>& cuts) {
  std::string s = fmt::format("{} v={} M={} cuts=", c.name, c.v, c.M);
  for (size_t k = 0; k < cuts.size(); ++k) s += fmt::format("{}{}", k ? "," : "", cuts[k]);
  return s;
}

void Searcher::dfs(Config& c, int s, int a, double node_lb) {
  if (node_budget_ > 0 && ++nodes_ > node_budget_) {
    // Out of budget: this subtree is left unexplored; its bound limits what
    // it could hold (reported as the certified gap).
    abandoned_lb_ = std::min(abandoned_lb_, node_lb);
    return;
  }
  const int S = c.S;
  const int r = c.stage_rank[s];
  const int low = c.rank_stages[r][0];
  const int e_hi = s == S - 1 ? n_ : n_ - (S - 1 - s);
  const int e_lo = s == S - 1 ? n_ : a + 1;
  cuts_[s] = a;
  // Largest e whose bounds still pass (they grow with e).
  int e_max = e_lo - 1;
  for (int e = e_lo; e <= e_hi; ++e) {
    const double busy = busy_[r] + stage_busy(c, s, a, e, add_min(c, a, e));
    const double head = s == low ? hd_[s] : hd_[low];
    const double tail = c.rank_has_w[r] ? 0.0 : (s == low ? td_[s] : td_[low]);
    const int64_t mem = static_[r] + stage_mem(c, a, e) +
                        std::max(std::max(temp_[r], temp(c, a, e)), upd_[r] + stage_upd(c, a, e));
    if (mem > budget_) {
      ++st_.pruned;
      note_peak(mem, r, describe(c, cuts_), false);
      break;
    }
    if (cut(head + busy + tail, T_, gap_)) {
      ++st_.pruned;
      break;
    }
    e_max = e;
  }
  // Smallest e whose remaining segments can still be covered (B4; coverable
  // for e implies coverable for every larger e).
  int e_min = e_max + 1;
  while (e_min - 1 >= e_lo && (s + 1 == S || remaining_feasible(c, s + 1, e_min - 1))) --e_min;
  if (e_min > e_lo) ++st_.pruned;
  // Children nearest the seed partition's cut first.
  std::vector<int> es;
  for (int e = e_max; e >= e_min; --e) es.push_back(e);
  if (s + 1 < S) {
    const int target = c.seed_cuts.empty() ? e_max : c.seed_cuts[s + 1];
    std::stable_sort(es.begin(), es.end(),
                     [&](int x, int y) { return std::abs(x - target) < std::abs(y - target); });
  }
  for (int e : es) {
    const double add = add_min(c, a, e);
    const double sb = stage_busy(c, s, a, e, add);
    const double save_busy = busy_[r];
    const int64_t save_static = static_[r], save_temp = temp_[r], save_upd = upd_[r];
    busy_[r] += sb;
    static_[r] += stage_mem(c, a, e);
    upd_[r] += stage_upd(c, a, e);
    temp_[r] = std::max(temp_[r], temp(c, a, e));
    const double head = s == low ? hd_[s] : hd_[low];
    const double tail = c.rank_has_w[r] ? 0.0 : (s == low ? td_[s] : td_[low]);
    const double lb = std::max(node_lb, head + busy_[r] + tail);
    if (s + 1 < S) {
      const double f = tsum(c, 0, a, e);
      const double bi = bi_min(c, s, tsum(c, 1, a, e) + add, tsum(c, 2, a, e) + add);
      const double h = hop(c, s, c.sc.segments[e - 1].act_bytes);
      hd_[s + 1] = hd_[s] + c.chain_c * f + h;
      td_[s + 1] = td_[s] + c.chain_c * bi + h;
      dfs(c, s + 1, e, lb);
    } else {
      leaf(c);
    }
    busy_[r] = save_busy;
    static_[r] = save_static;
    upd_[r] = save_upd;
    temp_[r] = save_temp;
  }
}

void Searcher::build_options(const Config& c) {
  const int S = c.S;
  stc_.resize(S);
  opts_.assign(S, {});
  for (int s = 0; s < S; ++s) {
    const int a = cuts_[s], e = s + 1 < S ? cuts_[s + 1] : n_;
    stc_[s] = stage_cost(c.sc, a, e, Remat::Keep);
    double rec = 0;
    for (int k = a; k < e; ++k) rec += c.sc.segments[k].min_recompute;
    std::vector<Option> os;
    for (Remat m : modes_) {
      Option op{m, 0, 0, stage_cost(c.sc, a, e, m)};
      // stage_cost adds exactly these sums, so `added` orders b and i too.
      op.added = m == Remat::Keep ? 0.0 : m == Remat::Min ? rec : stc_[s].f;
      op.stash = op.cost.stash_bytes;
      os.push_back(op);
    }
    std::sort(os.begin(), os.end(), [](const Option& x, const Option& y) {
      return x.added != y.added ? x.added < y.added : x.stash < y.stash;
    });
    for (const Option& op : os)  // Pareto: keep an option only if it stashes less
      if (opts_[s].empty() || op.stash < opts_[s].back().stash) opts_[s].push_back(op);
  }
}

void Searcher::leaf(Config& c) {
  ++st_.partitions;
  const int S = c.S;
  build_options(c);
  // Base costs (keep) then apply option 0 (the fastest) everywhere.
  choice_.assign(S, 0);
  auto apply = [&](int s) { stc_[s] = opts_[s][choice_[s]].cost; };
  for (int s = 0; s < S; ++s) apply(s);
  fast_ = stc_;
  // Memory: least stash everywhere.
  for (int s = 0; s < S; ++s) {
    choice_[s] = static_cast<int>(opts_[s].size()) - 1;
    apply(s);
  }
  for (int r = 0; r < c.P; ++r) {
    const int64_t m = rank_peak(r, rank_stash_lb(c, r));
    if (m > budget_) {
      ++st_.pruned;
      note_peak(m, r, describe(c, cuts_), false);
      return;
    }
  }
  for (int s = 0; s < S; ++s) {
    choice_[s] = 0;
    apply(s);
  }
  leaf_lb_ = relax(c);
  if (cut(leaf_lb_, T_, gap_)) {
    ++st_.pruned;
    return;
  }
  order_.clear();
  rank_end_.assign(S, -1);
  for (int r = 0; r < c.P; ++r) {
    for (int s : c.rank_stages[r]) order_.push_back(s);
    if (!c.rank_stages[r].empty()) rank_end_[order_.size() - 1] = r;
  }
  feasible_.clear();
  remat_dfs(c, 0);
}

void Searcher::remat_dfs(Config& c, size_t k) {
  if (node_budget_ > 0 && ++nodes_ > node_budget_) {
    abandoned_lb_ = std::min(abandoned_lb_, leaf_lb_);  // (B3) at the fastest remat
    return;
  }
  if (k == order_.size()) {
    remat_leaf(c);
    return;
  }
  // (B5) on the whole subtree: every completion is componentwise at least as
  // slow as a vector that fits when that vector is at its fastest option on
  // every stage not yet chosen.
  for (const auto& f : feasible_) {
    bool dominated = true;
    for (size_t q = 0; q < order_.size() && dominated; ++q) {
      const int t = order_[q];
      dominated = q < k ? choice_[t] >= f[t] : f[t] == 0;
    }
    if (dominated) {
      ++st_.pruned;
      return;
    }
  }
  const int s = order_[k];
  for (int j = 0; j < static_cast<int>(opts_[s].size()); ++j) {
    choice_[s] = j;
    stc_[s] = opts_[s][j].cost;
    if (rank_end_[k] >= 0) {
      const int r = rank_end_[k];
      const int64_t m = rank_peak(r, rank_stash_lb(c, r));
      if (m > budget_) {
        ++st_.pruned;
        note_peak(m, r, describe(c, cuts_), false);
        continue;  // slower options stash less: try them
      }
    }
    if (j > 0) {
      // (B1)+(B2) with the choices so far (unchosen stages at their fastest).
      double lb = 0;
      for (int r = 0; r < c.P; ++r) {
        double busy = 0;
        for (int t : c.rank_stages[r]) {
          const StageCost& x = stc_[t];
          busy += c.cf[t] * x.f + c.cb[t] * x.b + c.ci[t] * x.i + c.cw[t] * x.w;
        }
        lb = std::max(lb, busy);
      }
      if (cut(lb, T_, gap_)) {
        ++st_.pruned;
        break;  // later options are slower still
      }
    }
    remat_dfs(c, k + 1);
  }
  choice_[s] = 0;
  stc_[s] = opts_[s][0].cost;
}

SimResult Searcher::simulate_stc(const Config& c) {
  CostModel cm;
  cm.link = in_.link;
  cm.fused_factor = in_.fused_factor;
  cm.stages = stc_;
  SimResult res = simulate(c.plan, cm);
  ++st_.simulated;
  return res;
}

void Searcher::remat_leaf(Config& c) {
  ++st_.candidates;
  const int S = c.S;
  for (const auto& f : feasible_) {
    bool dominated = true;
    for (int s = 0; s < S && dominated; ++s) dominated = choice_[s] >= f[s];
    if (dominated) {  // (B5): at least as slow as a vector that fits
      ++st_.pruned;
      return;
    }
  }
  // The update seconds outside the loop are exact for this partition, so
  // adding them keeps (B3) a lower bound on the candidate's step time.
  const std::vector<int> cuts(cuts_.begin(), cuts_.begin() + S);
  const double upd = update_time(c.sc, cuts, c.stage_rank, c.P);
  if (cut(relax(c) + upd, T_, gap_)) {
    ++st_.pruned;
    return;
  }
  const SimResult res = simulate_stc(c);
  PlanCandidate pc;
  pc.schedule = c.name;
  pc.virtual_stages = c.v;
  pc.microbatches = c.M;
  pc.cuts = cuts;
  pc.remat.resize(S);
  for (int s = 0; s < S; ++s) pc.remat[s] = opts_[s][choice_[s]].mode;
  pc.step_time = res.step_time + upd;
  pc.bubble_fraction = res.bubble_fraction;
  pc.peak_memory.resize(c.P);
  pc.fits = true;
  for (int r = 0; r < c.P; ++r) {
    pc.peak_memory[r] = rank_peak(r, res.peak_total[r]);
    if (pc.peak_memory[r] > budget_) pc.fits = false;
  }
  if (!pc.fits) {
    note_peak(pc.max_memory(), pc.max_memory_rank(), describe(c, pc.cuts), true);
    return;
  }
  feasible_.push_back(choice_);
  if (pc.step_time < c.best) {
    c.best = pc.step_time;
    c.best_cand = std::move(pc);
    T_ = std::min(c.best, kth_);
  }
}

void Searcher::clear_dfs_state(const Config& c) {
  cuts_.assign(c.S + 1, 0);
  busy_.assign(c.P, 0);
  static_.assign(c.P, 0);
  temp_.assign(c.P, 0);
  upd_.assign(c.P, 0);
  hd_.assign(c.S, 0);
  td_.assign(c.S, 0);
}

void Searcher::set_partition(const Config& c, const std::vector<int>& cuts) {
  clear_dfs_state(c);
  for (int s = 0; s < c.S; ++s) {
    const int a = cuts[s], e = s + 1 < c.S ? cuts[s + 1] : n_;
    const int r = c.stage_rank[s];
    cuts_[s] = a;
    busy_[r] += stage_busy(c, s, a, e, add_min(c, a, e));
    static_[r] += stage_mem(c, a, e);
    upd_[r] += stage_upd(c, a, e);
    temp_[r] = std::max(temp_[r], temp(c, a, e));
  }
}

// For the nothing-fits report: the partition minimising the largest
// static + temp bytes of a stage, every stage at its least-stash option,
// simulated.
void Searcher::probe_min_memory(const Config& c) {
  std::vector<int> cuts;
  auto split = [&](int64_t X, std::vector<int>* out) {
    int pos = 0;
    if (out) out->clear();
    for (int k = 0; k < c.S; ++k) {
      if (out) out->push_back(pos);
      const int last = n_ - (c.S - 1 - k);
      if (pos >= last) return false;
      auto ok = [&](int x) { return stage_mem(c, pos, x) + temp(c, pos, x) <= X; };
      int e = pos + 1;
      if (!ok(e)) return false;
      while (e < last && ok(e + 1)) ++e;
      pos = e;
    }
    return pos >= n_;
  };
  int64_t lo = 0, hi = stage_mem(c, 0, n_) + temp(c, 0, n_);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (split(mid, nullptr))
      hi = mid;
    else
      lo = mid + 1;
  }
  if (!split(hi, &cuts)) return;
  set_partition(c, cuts);
  build_options(c);
  choice_.assign(c.S, 0);
  for (int s = 0; s < c.S; ++s) {
    choice_[s] = static_cast<int>(opts_[s].size()) - 1;
    stc_[s] = opts_[s][choice_[s]].cost;
  }
  const SimResult res = simulate_stc(c);
  int64_t peak = -1;
  int rank = 0;
  for (int r = 0; r < c.P; ++r) {
    const int64_t m = rank_peak(r, res.peak_total[r]);
    if (m > peak) {
      peak = m;
      rank = r;
    }
  }
  std::vector<int> cc(cuts_.begin(), cuts_.begin() + c.S);
  note_peak(peak, rank, describe(c, cc) + " remat=least-stash", true);
}

AutoplanResult Searcher::run() {
  const auto t0 = std::chrono::steady_clock::now();
  in_.validate();
  if (o_.ranks < 1)
    throw ConfigError(fmt::format("autoplan: ranks must be >= 1 (got {})", o_.ranks));
  if (o_.memory < 0)
    throw ConfigError(fmt::format("autoplan: memory must be >= 0 (got {})", o_.memory));
  if (o_.top < 1) throw ConfigError(fmt::format("autoplan: top must be >= 1 (got {})", o_.top));
  // Families.
  std::vector<std::string> fams;
  const std::vector<std::string> all = schedule_names();
  if (o_.families.empty()) {
    fams = all;
  } else {
    for (const std::string& f : o_.families) {
      std::string key;
      for (char ch : f)
        if (ch != '-' && ch != '_')
          key += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      if (key == "interleaved1f1b") key = "interleaved";
      if (std::find(all.begin(), all.end(), key) == all.end())
        throw ConfigError(fmt::format("autoplan: unknown schedule family '{}' (families: {})", f,
                                      fmt::join(all, ", ")));
      if (std::find(fams.begin(), fams.end(), key) == fams.end()) fams.push_back(key);
    }
  }
  // Microbatch counts.
  std::vector<int> ms;
  if (!o_.microbatches.empty()) {
    for (int m : o_.microbatches) {
      if (m < 1 || in_.batch % m != 0)
        throw ConfigError(fmt::format(
            "autoplan: microbatches {} does not divide the batch of {} samples", m, in_.batch));
      if (std::find(ms.begin(), ms.end(), m) == ms.end()) ms.push_back(m);
    }
  } else {
    const int cap = o_.max_microbatches > 0 ? o_.max_microbatches : 4 * o_.ranks;
    for (int m = 1; m <= cap && m <= in_.batch; ++m)
      if (in_.batch % m == 0) ms.push_back(m);
  }
  for (Remat m : modes_) (void)remat_name(m);
  if (modes_.empty()) throw ConfigError("autoplan: no remat modes allowed");
  if (!std::isfinite(o_.gap) || o_.gap < 0)
    throw ConfigError(fmt::format("autoplan: gap must be finite and >= 0 (got {})", o_.gap));
  st_.exact = o_.gap == 0;
  if (o_.node_budget < 0)
    throw ConfigError(fmt::format("autoplan: node_budget must be >= 0 (got {})", o_.node_budget));
  for (const std::string& f : fams) {
    std::vector<int> vs{1};
    if (f == "interleaved") vs = o_.interleaved_v;
    for (int v : vs) {
      if (v < 1) throw ConfigError(fmt::format("autoplan: interleaved v must be >= 1 (got {})", v));
      for (int m : ms) add_config(f, v, m);
    }
  }
  // Seed every configuration with its min-max-busy partition.
  std::vector<size_t> order;
  for (size_t k = 0; k < cfgs_.size(); ++k) {
    Config& c = cfgs_[k];
    std::vector<int> cuts;
    c.root_lb = min_max_busy(c, &cuts);
    c.seed_cuts = cuts;
    c.lower = c.root_lb;
    order.push_back(k);
    if (c.root_lb == kInf) continue;
    threshold(c);
    // Evaluate the seed partition as a DFS path with every stage fixed.
    set_partition(c, cuts);
    nodes_ = 0;
    const int64_t save_partitions = st_.partitions;
    leaf(c);
    st_.partitions = save_partitions;  // counted again by the DFS
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return cfgs_[x].root_lb < cfgs_[y].root_lb; });
  for (size_t k : order) {
    Config& c = cfgs_[k];
    threshold(c);
    if (c.root_lb == kInf || cut(c.root_lb, T_, gap_)) {
      ++st_.pruned;
      continue;
    }
    clear_dfs_state(c);
    nodes_ = 0;
    abandoned_lb_ = kInf;
    if (remaining_feasible(c, 0, 0)) dfs(c, 0, 0, c.root_lb);
    // Explored: the best is exact (or within the gap); abandoned subtrees
    // hold nothing below their bound.
    c.lower = std::min(std::min(c.best, T_) / (1.0 + gap_), abandoned_lb_);
    if (abandoned_lb_ < kInf) st_.exact = false;
  }
  AutoplanResult out;
  std::vector<const Config*> done;
  for (const Config& c : cfgs_)
    if (c.best < kInf) done.push_back(&c);
  std::stable_sort(done.begin(), done.end(),
                   [](const Config* x, const Config* y) { return x->best < y->best; });
  if (done.empty()) {
    if (cfgs_.empty())
      throw ConfigError(fmt::format(
          "autoplan: no schedule configuration is possible for {} segments on {} ranks (every "
          "generator refused, or there are fewer segments than stages)",
          n_, o_.ranks));
    for (const Config& c : cfgs_) probe_min_memory(c);
    if (min_peak_rank_ < 0) throw ConfigError("autoplan: no candidate fits the memory budget");
    throw ConfigError(fmt::format(
        "autoplan: no candidate fits the memory budget of {} ({} bytes) per rank; the smallest "
        "peak {} {} ({} bytes) on rank {} ({})",
        format_bytes(o_.memory), o_.memory, min_peak_exact_ ? "found is" : "bound found is",
        format_bytes(min_peak_), min_peak_, min_peak_rank_, min_peak_what_));
  }
  // Certified gap of the best row: every configuration's optimum is >= its
  // `lower` (configurations cut at the root: >= root_lb >= the threshold).
  double lower = done.front()->best;
  for (const Config& c : cfgs_) lower = std::min(lower, c.lower);
  st_.gap = lower > 0 ? std::max(0.0, done.front()->best / lower - 1.0) : 0.0;
  if (st_.exact) st_.gap = 0;
  for (const Config* c : done) {
    if (static_cast<int>(out.plans.size()) >= o_.top) break;
    if (o_.verify) verify_or_throw(c->plan);
    out.plans.push_back(c->best_cand);
  }
  st_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.stats = st_;
  return out;
}

}  // namespace

int PlanCandidate::max_memory_rank() const {
  int best = 0;
  for (size_t r = 1; r < peak_memory.size(); ++r)
    if (peak_memory[r] > peak_memory[best]) best = static_cast<int>(r);
  return best;
}

int64_t PlanCandidate::max_memory() const {
  return peak_memory.empty() ? 0 : peak_memory[max_memory_rank()];
}

AutoplanResult autoplan(const SegmentCosts& costs, const AutoplanOptions& opts) {
  Searcher s(costs, opts);
  return s.run();
}

PlanCandidate evaluate_candidate(const SegmentCosts& costs, std::string_view schedule, int ranks,
                                 int virtual_stages, int microbatches, const std::vector<int>& cuts,
                                 const std::vector<Remat>& remat, int64_t memory,
                                 bool update_in_place) {
  const SegmentCosts sc = costs.scaled(microbatches);
  const Schedule s =
      make_schedule(schedule, ranks, microbatches,
                    std::string_view(schedule) == "interleaved" ? virtual_stages : 1);
  if (static_cast<int>(cuts.size()) != s.num_stages)
    throw ConfigError(
        fmt::format("{} cuts for a schedule of {} stages", cuts.size(), s.num_stages));
  const int n = static_cast<int>(costs.segments.size());
  for (size_t k = 1; k < cuts.size(); ++k)
    if (cuts[k] <= cuts[k - 1] || cuts[k] >= n)
      throw ConfigError(
          fmt::format("cuts must increase and stay below {} (cuts[{}] = {})", n, k, cuts[k]));
  const CostModel cm = stage_cost_model(sc, cuts, remat);
  const Plan plan = lower(s);
  const SimResult res = simulate(plan, cm);
  PlanCandidate pc;
  pc.schedule = s.name;
  pc.virtual_stages = s.num_stages / s.num_ranks;
  pc.microbatches = microbatches;
  pc.cuts = cuts;
  pc.remat = remat;
  pc.step_time = res.step_time + update_time(sc, cuts, s.stage_rank, ranks);
  pc.bubble_fraction = res.bubble_fraction;
  pc.peak_memory.assign(ranks, 0);
  std::vector<int64_t> tmp(ranks, 0), upd(ranks, 0);
  const bool b_split = runs_b_as_i_then_w(s);
  for (int st = 0; st < s.num_stages; ++st) {
    const int a = cuts[st], e = st + 1 < s.num_stages ? cuts[st + 1] : n;
    const int r = s.stage_rank[st];
    pc.peak_memory[r] += stage_static_bytes(sc, a, e);
    tmp[r] = std::max(tmp[r], stage_temp_bytes(sc, a, e, b_split));
    if (!update_in_place) upd[r] += stage_update_bytes(sc, a, e);
  }
  pc.fits = true;
  for (int r = 0; r < ranks; ++r) {
    pc.peak_memory[r] += std::max(tmp[r] + res.peak_total[r], upd[r]);
    if (memory > 0 && pc.peak_memory[r] > memory) pc.fits = false;
  }
  return pc;
}

std::string AutoplanResult::to_json() const {
  using nlohmann::json;
  json rows = json::array();
  for (const PlanCandidate& p : plans) {
    json remat = json::array();
    for (Remat r : p.remat) remat.push_back(remat_name(r));
    rows.push_back(json{{"schedule", p.schedule},
                        {"virtual_stages", p.virtual_stages},
                        {"microbatches", p.microbatches},
                        {"cuts", p.cuts},
                        {"remat", remat},
                        {"step_time", p.step_time},
                        {"bubble_fraction", p.bubble_fraction},
                        {"peak_memory", p.peak_memory},
                        {"fits", p.fits}});
  }
  json s{{"configurations", stats.configurations},
         {"refused", stats.refused},
         {"partitions", stats.partitions},
         {"candidates", stats.candidates},
         {"simulated", stats.simulated},
         {"pruned", stats.pruned},
         {"seconds", stats.seconds},
         {"exact", stats.exact},
         {"gap", stats.gap}};
  return json{{"plans", rows}, {"stats", s}}.dump(2);
}

std::string autoplan_table(const AutoplanResult& r, int64_t memory) {
  std::string out = fmt::format("{:>3}  {:<11} {:>2} {:>4} {:>12} {:>7} {:>11} {:>4}  {}  {}\n",
                                "#", "schedule", "v", "M", "step_time", "bubble", "max_peak",
                                "fits", "cuts", "remat / peak per rank");
  int k = 0;
  for (const PlanCandidate& p : r.plans) {
    std::string cuts, remat, peaks;
    for (size_t s = 0; s < p.cuts.size(); ++s) cuts += fmt::format("{}{}", s ? "," : "", p.cuts[s]);
    for (size_t s = 0; s < p.remat.size(); ++s)
      remat += fmt::format("{}{}", s ? "," : "", remat_name(p.remat[s]));
    for (size_t q = 0; q < p.peak_memory.size(); ++q)
      peaks += fmt::format("{}{}", q ? "," : "", format_bytes(p.peak_memory[q]));
    out += fmt::format("{:>3}  {:<11} {:>2} {:>4} {:>12.6g} {:>6.1f}% {:>11} {:>4}  {}  {} / {}\n",
                       ++k, p.schedule, p.virtual_stages, p.microbatches, p.step_time,
                       100.0 * p.bubble_fraction, format_bytes(p.max_memory()),
                       p.fits ? "yes" : "no", cuts, remat, peaks);
  }
  const AutoplanStats& s = r.stats;
  out += fmt::format(
      "budget {} per rank; search: {} configurations ({} refused), {} partitions, {} candidates, "
      "{} simulated, {} pruned, {:.3f} s, {}\n",
      memory > 0 ? format_bytes(memory) : std::string("unlimited"), s.configurations, s.refused,
      s.partitions, s.candidates, s.simulated, s.pruned, s.seconds,
      s.exact ? std::string("exact")
              : fmt::format("approximate: certified within {:.2f}% of the optimum", 100 * s.gap));
  return out;
}

}  // namespace baton
