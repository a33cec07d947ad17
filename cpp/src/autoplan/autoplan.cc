// Automatic pipeline planning: exact branch and bound over (family, v, M,
// partition, remat). Method and the validity of each bound: autoplan.h.
//
// This file: the search driver (families, microbatch counts, seeding, the
// order of configurations, the certified gap) and the public entry points.
#include "baton/autoplan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <optional>

#include "autoplan_internal.h"
#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/sim.h"
#include "baton/verify.h"

namespace baton {

namespace autoplan_detail {

void Searcher::threshold(const Config& c) {
  // K-th smallest best among the other configurations.
  std::vector<double> others;
  for (const Config& d : cfgs_)
    if (&d != &c && d.best < kInf) others.push_back(d.best);
  double own = kInf;
  for (const PlanCandidate& p : seeds_) {
    if (p.schedule == c.name && p.virtual_stages == c.v && p.microbatches == c.M)
      own = std::min(own, p.step_time);
    else
      others.push_back(p.step_time);
  }
  const size_t K = static_cast<size_t>(std::max(1, o_.top));
  kth_ = kInf;
  if (others.size() >= K) {
    std::nth_element(others.begin(), others.begin() + (K - 1), others.end());
    kth_ = others[K - 1];
  }
  T_ = std::min({c.best, kth_, own, o_.upper_bound});
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
    choice_[s] = least_stash(s);
    stc_[s] = opts_[s][choice_[s]].cost;
  }
  const SimResult res = simulate_stc(c);
  int64_t peak = -1;
  int rank = 0;
  for (int r = 0; r < c.P; ++r) {
    const int64_t m = rank_peak(c, r, res.peak_total[r]);
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
  if (done.empty() && (!seeds_.empty() || o_.upper_bound < kInf)) {  // nothing beats them
    st_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.stats = st_;
    return out;
  }
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
    if (o_.verify) {
      verify_or_throw(c->plan);
      if (!c->best_cand.offload.empty()) {  // its rank IR with the offloads, verified
        RankIROptions ro;
        ro.offload = c->best_cand.offload;
        ro.fetch_lookahead = o_.fetch_lookahead;
        (void)build_rank_ir(c->plan, ro);
      }
    }
    out.plans.push_back(c->best_cand);
  }
  st_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.stats = st_;
  return out;
}

}  // namespace autoplan_detail

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
  if (opts.offload && !(costs.host_link_bandwidth > 0))
    throw ConfigError(
        "autoplan: offload needs the host link's bandwidth (segment costs' "
        "host_link_bandwidth, bytes per time unit in each direction; got 0)");
  if (opts.host_memory < 0)
    throw ConfigError(
        fmt::format("autoplan: host_memory must be >= 0 (got {})", opts.host_memory));
  if (!(opts.upper_bound > 0))
    throw ConfigError(
        fmt::format("autoplan: upper_bound must be > 0 (got {})", opts.upper_bound));
  if (opts.fetch_lookahead < 1)
    throw ConfigError(fmt::format("autoplan: fetch_lookahead must be >= 1 (got {})",
                                  opts.fetch_lookahead));
  if (!opts.offload) {
    autoplan_detail::Searcher s(costs, opts);
    return s.run();
  }
  // With offload the memory bounds are weaker, so a search cut short by its
  // node budget may stop before plans the search without offload finds: run
  // that one first and keep, per configuration, the faster row of the two
  // (the stats count both searches' work over the same configurations).
  AutoplanOptions plain = opts;
  plain.offload = false;
  std::optional<AutoplanResult> a;
  try {
    a = autoplan_detail::Searcher(costs, plain).run();
  } catch (const ConfigError&) {  // nothing fits without offload
  }
  AutoplanResult b;
  try {
    autoplan_detail::Searcher s(costs, opts);
    if (a) s.seed(a->plans);
    b = s.run();
  } catch (const ConfigError&) {
    if (a) return *a;
    throw;
  }
  if (!a) return b;
  AutoplanResult out = b;
  auto same = [](const PlanCandidate& x, const PlanCandidate& y) {
    return x.schedule == y.schedule && x.virtual_stages == y.virtual_stages &&
           x.microbatches == y.microbatches;
  };
  for (const PlanCandidate& p : a->plans) {
    auto it = std::find_if(out.plans.begin(), out.plans.end(),
                           [&](const PlanCandidate& q) { return same(p, q); });
    if (it == out.plans.end())
      out.plans.push_back(p);
    else if (p.step_time < it->step_time)
      *it = p;
  }
  std::stable_sort(out.plans.begin(), out.plans.end(),
                   [](const PlanCandidate& x, const PlanCandidate& y) {
                     return x.step_time < y.step_time;
                   });
  if (static_cast<int>(out.plans.size()) > opts.top) out.plans.resize(opts.top);
  AutoplanStats& st = out.stats;
  const AutoplanStats& sa = a->stats;
  st.partitions += sa.partitions;
  st.candidates += sa.candidates;
  st.simulated += sa.simulated;
  st.pruned += sa.pruned;
  st.seconds += sa.seconds;
  return out;
}

PlanCandidate evaluate_candidate(const SegmentCosts& costs, std::string_view schedule, int ranks,
                                 int virtual_stages, int microbatches, const std::vector<int>& cuts,
                                 const std::vector<Remat>& remat, int64_t memory,
                                 bool update_in_place, const std::vector<Offload>& offload,
                                 int32_t fetch_lookahead) {
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
  const bool offloads =
      std::any_of(offload.begin(), offload.end(), [](Offload x) { return x != Offload::None; });
  if (offloads && !(sc.host_link_bandwidth > 0))
    throw ConfigError(
        "evaluate_candidate: offload needs the host link's bandwidth (segment costs' "
        "host_link_bandwidth; got 0)");
  RankIROptions ro;
  ro.offload = offload;
  ro.fetch_lookahead = fetch_lookahead;
  const SimResult res = offloads ? simulate(build_rank_ir(plan, ro), cm) : simulate(plan, cm);
  PlanCandidate pc;
  pc.schedule = s.name;
  pc.virtual_stages = s.num_stages / s.num_ranks;
  pc.microbatches = microbatches;
  pc.cuts = cuts;
  pc.remat = remat;
  if (offloads) {
    pc.offload = offload;
    pc.peak_host = res.peak_host_bytes;
  }
  pc.step_time = res.step_time + update_time(sc, cuts, s.stage_rank, ranks, microbatches);
  pc.bubble_fraction = res.bubble_fraction;
  pc.peak_memory.assign(ranks, 0);
  std::vector<int64_t> tmp(ranks, 0), upd(ranks, 0);
  const bool b_split = runs_b_as_i_then_w(s);
  for (int st = 0; st < s.num_stages; ++st) {
    const int a = cuts[st], e = st + 1 < s.num_stages ? cuts[st + 1] : n;
    const int r = s.stage_rank[st];
    pc.peak_memory[r] += stage_static_bytes(sc, a, e);
    tmp[r] = std::max(tmp[r], stage_temp_bytes(sc, a, e, b_split) +
                                  stage_transient_bytes(sc, a, e, remat[st]));
    if (!update_in_place) upd[r] += stage_update_bytes(sc, a, e);
  }
  pc.fits = true;
  for (int r = 0; r < ranks; ++r) {
    pc.peak_memory[r] += std::max(tmp[r] + res.peak_total[r], upd[r]);
    if (memory > 0 && pc.peak_memory[r] > memory) pc.fits = false;
  }
  return pc;
}

}  // namespace baton
