// Internal (not installed): the branch-and-bound search's configurations and
// its Searcher, shared by autoplan.cc (driver), autoplan_config.cc,
// autoplan_partition.cc and autoplan_remat.cc (see each file's comment).
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "baton/autoplan.h"
#include "baton/plan.h"
#include "baton/rank_program.h"
#include "baton/sim.h"

namespace baton::autoplan_detail {

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
  int64_t transient = 0;  // stage_transient_bytes() of this mode
};

// Bounds are computed with prefix sums, the simulated costs with sequential
// sums: a bound may exceed its exact value by a few ulps, so a node is cut
// only when its bound clears the threshold by more than that.
// With a relative gap g > 0 a node is also cut when its bound is within a
// factor (1 + g) of the threshold: the result is then within (1 + g) of the
// optimum (bounded approximation).
inline bool cut(double lb, double T, double gap) { return lb * (1.0 - 1e-12) * (1.0 + gap) >= T; }

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
  // Per rank, action and local stage: the stashes on the device during that
  // action when the stage offloads them (AutoplanOptions::offload).
  std::vector<std::vector<int32_t>> row_off;
  std::vector<int> local;  // stage -> index among its rank's stages
  SegmentCosts sc;         // scaled
  std::vector<double> pf, pb, pi, pw, prec;
  std::array<double, 4> saved{};  // sc.tasks_saved()
  std::vector<int64_t> pstash, pmin, pwstash, pstatic, pupdate;
  std::vector<int64_t> tmax;  // (n+1)*(n+1): max temp of [a, e)
  // Offload tries (offload_fit): the plan's rank programs after the build
  // pass (lower_rank_program), made on the first try; `ir` holds them with
  // the offload pass applied to the ranks a try offloads on.
  std::shared_ptr<RankIR> ir;
  std::vector<RankProgram> base_programs;
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
    offload_ = o.offload;
  }
  AutoplanResult run();
  // Plans another search already found (the search without offload): a row of
  // this search that is not faster than the K-th of them, or than the seed of
  // its own configuration, cannot change the merged top K, so both bound the
  // threshold from the start. With seeds, finding nothing returns no rows
  // instead of throwing.
  void seed(std::vector<PlanCandidate> known) { seeds_ = std::move(known); }

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
  // A rank's peak at the current remat choices: its static bytes plus the larger of the
  // loop (the largest stage transient: temporaries plus what the chosen remat
  // rematerializes at once; + pipeline buffers) and the update's new copies.
  int64_t rank_peak(const Config& c, int r, int64_t buffers) const {
    int64_t t = temp_[r];
    for (int s : c.rank_stages[r]) {
      int64_t x = opts_[s][choice_[s]].transient;
      if (least_transient_)
        for (const Option& op : opts_[s]) x = std::min(x, op.transient);
      t = std::max(t, stage_temp_[s] + x);
    }
    return static_[r] + std::max(t + buffers, upd_[r]);
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
  int least_stash(int s) const;  // the option of stage s (opts_) that stashes least
  // Zeroes the DFS state (cuts_, busy_, static_, temp_, hd_, td_) sized for c.
  void clear_dfs_state(const Config& c);
  void set_partition(const Config& c, const std::vector<int>& cuts);
  void probe_min_memory(const Config& c);
  // Simulates one remat vector the memory bound lets fit (a primal heuristic)
  // before the descent; leaves choice_ and stc_ at the fastest options.
  void greedy_leaf(Config& c);
  void remat_dfs(Config& c, size_t k);
  void remat_leaf(Config& c);
  // Simulates c.plan at the current stage costs stc_ (counted in st_.simulated).
  SimResult simulate_stc(const Config& c);
  // The cost model of the current stage costs stc_.
  CostModel cost_model_stc() const;
  // For a candidate pc that does not fit (o_.offload): offloads the stashes of
  // the stages of every rank over the budget, as its rank IR, until every
  // rank fits (pc updated: offload, step_time, peaks; true) or no rank over
  // the budget has a stage left to offload (false).
  bool offload_fit(Config& c, PlanCandidate& pc, double upd);
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
  bool offload_ = false;     // candidates may offload stashes (AutoplanOptions::offload)
  int64_t nodes_ = 0;
  double abandoned_lb_ = kInf;  // smallest bound of a subtree left unexplored
  double leaf_lb_ = 0;          // (B3) of the current partition at its fastest remat
  std::vector<Config> cfgs_;
  AutoplanStats st_;
  double T_ = kInf;    // current threshold
  double kth_ = kInf;  // K-th best of the other configurations
  std::vector<PlanCandidate> seeds_;
  // DFS state (per configuration).
  std::vector<int> cuts_;
  std::vector<double> busy_;  // per rank
  std::vector<int64_t> static_, temp_, upd_;
  std::vector<double> hd_, td_;
  // Leaf state.
  std::vector<StageCost> stc_;
  std::vector<StageCost> fast_;  // costs at every stage's fastest option
  std::vector<std::vector<Option>> opts_;
  std::vector<int64_t> stage_temp_;  // temp(c, a, e) of each stage of the leaf
  // rank_peak takes each stage's least transient over its options, not its chosen
  // one's: with every stash at its least, a lower bound on every remat vector's peak
  // (the option that stashes least need not rematerialize least).
  bool least_transient_ = false;
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

// "<family> v=<v> M=<M> cuts=<a,b,...>", for the nothing-fits report.
std::string describe(const Config& c, const std::vector<int>& cuts);

}  // namespace baton::autoplan_detail
