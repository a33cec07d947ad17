// The search over stage cuts: the partition bounds (B4, the min-max-busy seed
// and root bound) and the depth-first search over cut positions, which hands
// each complete partition to leaf() (autoplan_remat.cc).
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "autoplan_internal.h"

namespace baton::autoplan_detail {

double Searcher::add_min(const Config& c, int a, int e) const {
  double v = kInf;
  for (Remat m : modes_) {
    if (m == Remat::Keep) v = std::min(v, 0.0);
    if (m == Remat::Min) v = std::min(v, sum(c.prec, a, e));
    if (m == Remat::Full) v = std::min(v, tsum(c, 0, a, e));
  }
  return v;
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

}  // namespace baton::autoplan_detail
