// The search over per-stage remat options of one partition: the bounds that
// need stage costs (B3 relaxation, stash rows, B5 dominance), the options'
// depth-first search, and the simulation of each surviving candidate.
#include <algorithm>

#include "autoplan_internal.h"

namespace baton::autoplan_detail {

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
    if (offload_) {
      // Any stage may offload: its stashes count only where they are on the
      // device offloaded (fewer than kept), the weight stashes as they are.
      const int32_t* off = &c.row_off[r][k * nloc];
      for (int l = 0; l < nloc; ++l)
        v += off[l] * stc_[st[l]].stash_bytes + cnt[2 * l + 1] * stc_[st[l]].wstash_bytes;
    } else {
      for (int l = 0; l < nloc; ++l)
        v += cnt[2 * l] * stc_[st[l]].stash_bytes + cnt[2 * l + 1] * stc_[st[l]].wstash_bytes;
    }
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

void Searcher::build_options(const Config& c) {
  const int S = c.S;
  stc_.resize(S);
  opts_.assign(S, {});
  stage_temp_.assign(S, 0);
  for (int s = 0; s < S; ++s) {
    const int a = cuts_[s], e = s + 1 < S ? cuts_[s + 1] : n_;
    stc_[s] = stage_cost(c.sc, a, e, Remat::Keep);
    stage_temp_[s] = temp(c, a, e);
    double rec = 0;
    for (int k = a; k < e; ++k) rec += c.sc.segments[k].min_recompute;
    std::vector<Option> os;
    for (Remat m : modes_) {
      Option op{m, 0, 0, stage_cost(c.sc, a, e, m)};
      // stage_cost adds exactly these sums, so `added` orders b and i too.
      op.added = m == Remat::Keep ? 0.0 : m == Remat::Min ? rec : stc_[s].f;
      op.stash = op.cost.stash_bytes;
      op.transient = stage_transient_bytes(c.sc, a, e, m);
      os.push_back(op);
    }
    std::sort(os.begin(), os.end(), [](const Option& x, const Option& y) {
      return x.added != y.added ? x.added < y.added : x.stash < y.stash;
    });
    // Pareto: a slower option stays only if no faster one stashes and rematerializes at
    // most as much.
    for (const Option& op : os)
      if (std::none_of(opts_[s].begin(), opts_[s].end(), [&](const Option& q) {
            return q.stash <= op.stash && q.transient <= op.transient;
          }))
        opts_[s].push_back(op);
  }
}

int Searcher::least_stash(int s) const {
  int j = 0;
  for (int k = 1; k < static_cast<int>(opts_[s].size()); ++k)
    if (opts_[s][k].stash < opts_[s][j].stash) j = k;
  return j;
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
  // Memory: least stash (and least rematerialized at once) everywhere.
  for (int s = 0; s < S; ++s) {
    choice_[s] = least_stash(s);
    apply(s);
  }
  least_transient_ = true;
  for (int r = 0; r < c.P; ++r) {
    const int64_t m = rank_peak(c, r, rank_stash_lb(c, r));
    if (m > budget_) {
      least_transient_ = false;
      ++st_.pruned;
      note_peak(m, r, describe(c, cuts_), false);
      return;
    }
  }
  least_transient_ = false;
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
  greedy_leaf(c);
  remat_dfs(c, 0);
}

void Searcher::greedy_leaf(Config& c) {
  // A primal heuristic: one remat vector that the structural memory bound lets
  // fit, simulated before the depth-first descent so that a search cut short
  // by its node budget still holds a fitting plan, and so that (B5) and the
  // incumbent prune from the start. A rank's bound reads only its own stages,
  // so each rank is settled on its own: from the fastest options, advance the
  // stage whose next option saves the most stash per second it adds, until the
  // rank's bound fits. The search stays exact: the descent still visits every
  // vector the bounds do not exclude. The bound is the one without offload
  // (every stash on the device), so the vector fits without offloading too.
  const bool offload = offload_;
  offload_ = false;
  for (int r = 0; r < c.P; ++r) {
    while (rank_peak(c, r, rank_stash_lb(c, r)) > budget_) {
      int best = -1;
      double best_ratio = -1;
      for (int s : c.rank_stages[r]) {
        const int j = choice_[s];
        if (j + 1 >= static_cast<int>(opts_[s].size())) continue;
        const Option& a = opts_[s][j];
        const Option& b = opts_[s][j + 1];
        const double saved = static_cast<double>(a.stash - b.stash);
        const double ratio = saved / std::max(b.added - a.added, 1e-12);
        if (ratio > best_ratio) {
          best_ratio = ratio;
          best = s;
        }
      }
      if (best < 0) break;  // no slower option left that saves: the descent decides
      stc_[best] = opts_[best][++choice_[best]].cost;
    }
  }
  offload_ = offload;
  remat_leaf(c);
  for (int s = 0; s < c.S; ++s) {
    choice_[s] = 0;
    stc_[s] = opts_[s][0].cost;
  }
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
      const int64_t m = rank_peak(c, r, rank_stash_lb(c, r));
      if (m > budget_) {
        ++st_.pruned;
        note_peak(m, r, describe(c, cuts_), false);
        continue;  // a slower option may stash or rematerialize less: try them
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

CostModel Searcher::cost_model_stc() const {
  CostModel cm;
  cm.link = in_.link;
  cm.host_link_bandwidth = in_.host_link_bandwidth;
  cm.fused_factor = in_.fused_factor;
  cm.stages = stc_;
  return cm;
}

SimResult Searcher::simulate_stc(const Config& c) {
  SimResult res = simulate(c.plan, cost_model_stc());
  ++st_.simulated;
  return res;
}

bool Searcher::offload_fit(Config& c, PlanCandidate& pc, double upd) {
  // The offload pass on the build pass's programs, as build_rank_ir runs them
  // (slot assignment and sharing, which it runs next, change nothing the
  // simulator reads; the returned plan's rank IR is built in full and verified).
  if (!c.ir) {
    c.ir = std::make_shared<RankIR>();
    c.ir->plan = c.plan;
    for (int r = 0; r < c.P; ++r) c.base_programs.push_back(lower_rank_program(c.ir->plan, r));
    c.ir->programs = c.base_programs;
  }
  RankIROptions ro;
  ro.offload.assign(c.S, Offload::None);
  ro.fetch_lookahead = o_.fetch_lookahead;
  std::vector<int64_t> peaks = pc.peak_memory;
  std::vector<uint8_t> changed(c.P, 0);
  const CostModel cm = cost_model_stc();
  bool fits = false;
  for (;;) {
    bool added = false;
    for (int r = 0; r < c.P; ++r) {
      if (peaks[r] <= budget_) continue;
      for (int s : c.rank_stages[r])
        if (ro.offload[s] == Offload::None) {
          ro.offload[s] = Offload::Stash;
          added = true;
          changed[r] = 1;
        }
      if (changed[r] == 1) {
        c.ir->programs[r] = c.base_programs[r];
        place_offloads(c.ir->plan, c.ir->programs[r], ro);
        changed[r] = 2;
      }
    }
    if (!added) break;
    const SimResult res = simulate(*c.ir, cm);
    ++st_.simulated;
    ++st_.offloaded;
    fits = true;
    bool host_over = false;
    for (int r = 0; r < c.P; ++r) {
      peaks[r] = rank_peak(c, r, res.peak_total[r]);
      fits = fits && peaks[r] <= budget_;
      host_over = host_over || (o_.host_memory > 0 && res.peak_host_bytes[r] > o_.host_memory);
    }
    if (host_over) {  // offloading more only holds more on the host
      fits = false;
      break;
    }
    if (fits) {
      pc.step_time = res.step_time + upd;
      pc.bubble_fraction = res.bubble_fraction;
      pc.peak_memory = peaks;
      pc.offload = ro.offload;
      pc.peak_host = res.peak_host_bytes;
      pc.fits = true;
      break;
    }
  }
  for (int r = 0; r < c.P; ++r)
    if (changed[r]) c.ir->programs[r] = c.base_programs[r];
  return fits;
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
  const double upd = update_time(c.sc, cuts, c.stage_rank, c.P, c.M);
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
    pc.peak_memory[r] = rank_peak(c, r, res.peak_total[r]);
    if (pc.peak_memory[r] > budget_) pc.fits = false;
  }
  if (!pc.fits) {
    note_peak(pc.max_memory(), pc.max_memory_rank(), describe(c, pc.cuts), true);
    // Offloading only adds waiting: a candidate already too slow stays so.
    if (!offload_ || cut(pc.step_time, T_, gap_) || !offload_fit(c, pc, upd)) return;
  } else {
    // (B5) holds for vectors that fit without offload: their time is the
    // plan's simulated time, which slower vectors cannot beat.
    feasible_.push_back(choice_);
  }
  if (pc.step_time < c.best) {
    c.best = pc.step_time;
    c.best_cand = std::move(pc);
    T_ = std::min(c.best, kth_);
  }
}

}  // namespace baton::autoplan_detail
