// One (family, v, M) configuration of the search: its lowered schedule, the
// busy coefficients of every stage, the memory rows of every rank, and the
// prefix sums of the scaled segment costs that the bounds read.
#include "autoplan_internal.h"
#include "baton/error.h"
#include "baton/generators.h"

namespace baton::autoplan_detail {

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
  c.row_off.assign(P, {});
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
    // Stashes on the device when their stage offloads them (offload.cc, one
    // RUN per action): at the writer and from the fetch (fetch_lookahead
    // actions before the reader, never before the action after the writer)
    // to the reader; throughout when no other action lies between the two.
    std::vector<int32_t> doff(static_cast<size_t>(na + 1) * nloc, 0);
    const int look = std::max(1, o_.fetch_lookahead);
    auto add_off = [&](int p, int q, int l) {
      if (p < 0 || q < 0 || p == q) return;
      auto span = [&](int x, int y) {
        doff[static_cast<size_t>(x) * nloc + l] += 1;
        doff[static_cast<size_t>(y + 1) * nloc + l] -= 1;
      };
      if (q - p < 2) {
        span(p, q);
      } else {
        span(p, p);
        span(std::max(p + 1, q - look), q);
      }
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
            add_off(fpos[key], k, l);
            break;
          case TaskKind::I:
            c.ci[t.stage] += w;
            c.uses_i[t.stage] = 1;
            add_interval(fpos[key], k, 2 * l);
            add_off(fpos[key], k, l);
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
    std::vector<int32_t> cur(2 * nloc, 0), off(nloc, 0);
    for (int k = 0; k < na; ++k) {
      for (int j = 0; j < 2 * nloc; ++j) cur[j] += diff[static_cast<size_t>(k) * 2 * nloc + j];
      for (int j = 0; j < nloc; ++j) off[j] += doff[static_cast<size_t>(k) * nloc + j];
      c.row_action[r].push_back(k);
      c.row_cnt[r].insert(c.row_cnt[r].end(), cur.begin(), cur.end());
      c.row_off[r].insert(c.row_off[r].end(), off.begin(), off.end());
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

}  // namespace baton::autoplan_detail
