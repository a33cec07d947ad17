// Cluster planning: segment costs per degree tuple, the degree search over
// autoplan, and its outputs (cluster.h).
#include "baton/cluster.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>

#include "baton/collectives.h"
#include "baton/error.h"
#include "baton/generators.h"

namespace baton {

namespace {

struct Shard {
  double flops;  // achieved FLOP/s
  int t, e, d;
  const LinkSpec *tp_link, *ep_link, *dp_link;
};

int64_t round_bytes(double v) { return static_cast<int64_t>(std::llround(v)); }

// Parameters one GPU holds of a segment when replicated over data (TP / EP
// shards only) and when sharded over data too (FSDP / ZeRO shard).
double params_local(const ProfileSegment& s, const Shard& sh) {
  return static_cast<double>(s.params - s.expert_params) / sh.t +
         static_cast<double>(s.expert_params) / (sh.t * sh.e);
}
double params_sharded(const ProfileSegment& s, const Shard& sh) {
  return static_cast<double>(s.params - s.expert_params) / sh.t / sh.d +
         static_cast<double>(s.expert_params) / (sh.t * sh.e) / std::max(1, sh.d / sh.e);
}

SegmentCost instance_cost(const ProfileSegment& s, const Shard& sh, double mb,
                          const ClusterOptions& o, const ClusterDegrees& d, const Hardware& hw) {
  SegmentCost c;
  c.name = s.name;
  const double comp_f = mb * s.fwd_flops / sh.t / sh.flops;
  const double comp_b = mb * s.bwd_flops / sh.t / sh.flops;
  const double comp_w = mb * s.wgrad_flops / sh.t / sh.flops;
  const double comp_i = comp_b - comp_w;
  const double tp = s.tp_collectives * all_reduce_time(mb * s.tp_bytes, sh.t, *sh.tp_link);
  const double a2a =
      s.a2a_collectives * all_to_all_time(mb * s.a2a_bytes / sh.t, sh.e, *sh.ep_link);
  const double p_loc = params_local(s, sh);
  const double p_store = d.fsdp ? params_sharded(s, sh) : p_loc;
  const double gather = d.fsdp ? all_gather_time(2.0 * p_loc, sh.d, *sh.dp_link) : 0.0;
  const double scatter = d.fsdp ? reduce_scatter_time(2.0 * p_loc, sh.d, *sh.dp_link) : 0.0;
  c.f = std::max(comp_f, gather) + tp + a2a;
  c.b = std::max(comp_b, gather + scatter) + tp + a2a;
  c.i = std::max(comp_i, gather) + tp + a2a;
  c.w = std::max(comp_w, scatter);
  c.min_recompute = mb * s.min_recompute_flops / sh.t / sh.flops;
  c.act_bytes = round_bytes(mb * s.act_bytes / sh.t);
  c.stash_bytes = round_bytes(mb * s.stash_keep / sh.t);
  c.min_stash_bytes = round_bytes(mb * s.stash_min / sh.t);
  c.wstash_bytes = c.stash_bytes;
  c.param_bytes = round_bytes(2.0 * p_store);
  const double opt_params = d.fsdp ? p_store : params_sharded(s, sh);
  c.opt_bytes =
      round_bytes(o.opt_bytes_per_param * opt_params + o.grad_extra_bytes_per_param * p_store);
  c.temp_bytes = round_bytes(mb * s.temp_bytes / sh.t + (d.fsdp ? 4.0 * p_loc : 0.0));
  const double reduce =
      d.fsdp ? 0.0
             : all_reduce_time((2.0 + o.grad_extra_bytes_per_param) * p_loc, sh.d, *sh.dp_link);
  const double state = 2.0 * static_cast<double>(2 * c.param_bytes + c.opt_bytes);
  c.update = reduce + state / hw.hbm_bandwidth;
  return c;
}

void add_into(SegmentCost& g, const SegmentCost& c) {
  g.f += c.f;
  g.b += c.b;
  g.i += c.i;
  g.w += c.w;
  g.update += c.update;
  g.min_recompute += c.min_recompute;
  g.act_bytes = c.act_bytes;
  g.stash_bytes += c.stash_bytes;
  g.min_stash_bytes += c.min_stash_bytes;
  g.wstash_bytes += c.wstash_bytes;
  g.param_bytes += c.param_bytes;
  g.opt_bytes += c.opt_bytes;
  g.temp_bytes = std::max(g.temp_bytes, c.temp_bytes);
}

void check_degrees(const ModelProfile& m, const ClusterDegrees& d, const ClusterOptions& o) {
  if (d.pp < 1 || d.tp < 1 || d.dp < 1 || d.ep < 1)
    throw ConfigError(fmt::format("cluster: degrees must be >= 1 (pp {} tp {} dp {} ep {})", d.pp,
                                  d.tp, d.dp, d.ep));
  if (static_cast<int64_t>(d.pp) * d.tp * d.dp != o.gpus)
    throw ConfigError(fmt::format("cluster: pp {} x tp {} x dp {} != {} GPUs", d.pp, d.tp, d.dp,
                                  o.gpus));
  if (m.max_tp % d.tp != 0)
    throw ConfigError(fmt::format("cluster: tp {} does not divide the model's {} (heads)", d.tp,
                                  m.max_tp));
  if (d.dp % d.ep != 0 || (d.ep > 1 && (m.num_experts == 0 || m.num_experts % d.ep != 0)))
    throw ConfigError(fmt::format("cluster: ep {} must divide dp {} and the {} experts", d.ep,
                                  d.dp, m.num_experts));
  if (o.global_batch % d.dp != 0)
    throw ConfigError(fmt::format("cluster: global batch {} is not divisible by dp {}",
                                  o.global_batch, d.dp));
}

// Layer instances [begin, end) of each of `groups` groups, as even as possible.
std::vector<int> group_bounds(int n, int groups) {
  std::vector<int> b(groups + 1);
  for (int k = 0; k <= groups; ++k) b[k] = static_cast<int>(static_cast<int64_t>(k) * n / groups);
  return b;
}

ClusterSegments build_segments(const ModelProfile& m, const Hardware& hw, const ClusterDegrees& d,
                               const ClusterOptions& o, int microbatches, int groups) {
  check_degrees(m, d, o);
  const int64_t batch = o.global_batch / d.dp;
  if (microbatches < 1 || batch % microbatches != 0)
    throw ConfigError(fmt::format("cluster: {} microbatches do not divide the {} samples per "
                                  "data-parallel replica",
                                  microbatches, batch));
  const double mb = static_cast<double>(batch / microbatches);
  const Shard sh{hw.achieved_flops(o.fp8), d.tp, d.ep, d.dp, &axis_link(hw, 1, d.tp),
                 &axis_link(hw, d.tp, d.ep), &axis_link(hw, d.tp, d.dp)};
  std::vector<const ProfileSegment*> inst;
  for (const ProfileSegment& s : m.segments)
    for (int r = 0; r < s.repeat; ++r) inst.push_back(&s);
  const int n = static_cast<int>(inst.size());
  groups = std::clamp(groups, 1, n);
  const std::vector<int> bounds = group_bounds(n, groups);
  ClusterSegments out;
  out.costs.batch = batch;
  out.costs.ref_microbatch = batch / microbatches;
  const LinkSpec& pl = axis_link(hw, d.tp * d.dp, d.pp);
  out.costs.link = LinkCost{pl.latency, pl.bandwidth};
  std::vector<SegmentCost> cache(m.segments.size());
  std::vector<bool> have(m.segments.size(), false);
  for (int g = 0; g < groups; ++g) {
    SegmentCost sum;
    std::string name;
    for (int k = bounds[g]; k < bounds[g + 1]; ++k) {
      const size_t idx = static_cast<size_t>(inst[k] - m.segments.data());
      if (!have[idx]) cache[idx] = instance_cost(*inst[k], sh, mb, o, d, hw), have[idx] = true;
      add_into(sum, cache[idx]);
      if (name.empty() || name.rfind(inst[k]->name, 0) != 0)
        name += (name.empty() ? "" : "+") + inst[k]->name;
    }
    sum.name = fmt::format("{}x{}", name, bounds[g + 1] - bounds[g]);
    out.costs.segments.push_back(sum);
    out.names.push_back(sum.name);
    out.layers.push_back(bounds[g + 1] - bounds[g]);
  }
  out.costs.validate();
  return out;
}

int search_groups(const ModelProfile& m, const ClusterOptions& o, int pp) {
  int vmax = 2;
  for (int v : o.interleaved_v) vmax = std::max(vmax, v);
  return std::min(m.num_layers(), std::max(o.max_segments, vmax * pp + 2));
}

int64_t static_lower_bound(const ModelProfile& m, const Hardware& hw, const ClusterDegrees& d,
                           const ClusterOptions& o) {
  const Shard sh{1.0, d.tp, d.ep, d.dp, &hw.intra, &hw.intra, &hw.intra};
  double total = 0;
  for (const ProfileSegment& s : m.segments) {
    const double p_loc = params_local(s, sh);
    const double p_store = d.fsdp ? params_sharded(s, sh) : p_loc;
    const double opt_params = d.fsdp ? p_store : params_sharded(s, sh);
    total += s.repeat * (4.0 * p_store + o.opt_bytes_per_param * opt_params +
                         o.grad_extra_bytes_per_param * p_store);
  }
  return round_bytes(total / d.pp);
}

ClusterPlan finish(const ModelProfile& m, const Hardware& hw, const ClusterOptions& o,
                   const ClusterDegrees& d, const ClusterSegments& segs, PlanCandidate pc) {
  ClusterPlan cp;
  cp.degrees = d;
  cp.segment_names = segs.names;
  cp.segment_layers = segs.layers;
  cp.step_time = pc.step_time;
  cp.tokens_per_second = static_cast<double>(o.global_batch * m.seq) / pc.step_time;
  const double model_flops = m.model_flops_per_sample * static_cast<double>(o.global_batch);
  cp.tflops_per_gpu = model_flops / pc.step_time / o.gpus / 1e12;
  cp.mfu = model_flops / pc.step_time / (static_cast<double>(o.gpus) * hw.peak_bf16);
  // Memory of the rank with the largest peak, by component.
  const int rank = pc.max_memory_rank();
  const Schedule s = make_schedule(pc.schedule, d.pp, pc.microbatches,
                                   pc.schedule == "interleaved" ? pc.virtual_stages : 1);
  MemoryBreakdown mem;
  for (int st : s.stages_of_rank(rank)) {
    const int begin = pc.cuts[st];
    const int end = st + 1 < pc.num_stages() ? pc.cuts[st + 1]
                                             : static_cast<int>(segs.costs.segments.size());
    for (int k = begin; k < end; ++k) {
      mem.params += segs.costs.segments[k].param_bytes;
      mem.grads += segs.costs.segments[k].param_bytes;
      mem.optimizer += segs.costs.segments[k].opt_bytes;
    }
  }
  mem.total = pc.max_memory();
  mem.activations = std::max<int64_t>(0, mem.total - mem.params - mem.grads - mem.optimizer);
  cp.memory = mem;
  cp.plan = std::move(pc);
  return cp;
}

std::vector<int> divisors(int64_t n, int64_t cap) {
  std::vector<int> out;
  for (int64_t k = 1; k <= n && k <= cap; ++k)
    if (n % k == 0) out.push_back(static_cast<int>(k));
  return out;
}

bool allowed(const std::vector<int>& choices, int v) {
  return choices.empty() || std::find(choices.begin(), choices.end(), v) != choices.end();
}

}  // namespace

ClusterSegments cluster_segment_costs(const ModelProfile& model, const Hardware& hw,
                                      const ClusterDegrees& d, const ClusterOptions& o,
                                      int microbatches) {
  return build_segments(model, hw, d, o, microbatches, search_groups(model, o, d.pp));
}

ClusterPlan evaluate_cluster(const ModelProfile& model, const Hardware& hw,
                             const ClusterDegrees& d, const ClusterOptions& o,
                             const std::string& schedule, int virtual_stages, int microbatches,
                             Remat remat) {
  model.validate();
  hw.validate();
  const ClusterSegments segs =
      build_segments(model, hw, d, o, microbatches, model.num_layers());
  const int n = static_cast<int>(segs.costs.segments.size());
  const std::string key = schedule;
  const int v = (key == "zbv" || key == "dualpipev") ? 2 : (key == "interleaved" ? virtual_stages : 1);
  const int stages = d.pp * v;
  // Layers spread evenly; a leading embedding joins the first stage and a trailing head
  // the last (as Megatron places them).
  const int lead = model.segments.front().repeat == 1 && model.segments.front().name == "embed";
  const int tail = model.segments.size() > 1 && model.segments.back().repeat == 1 &&
                   model.segments.back().name == "head";
  const int body = n - lead - tail;
  if (stages > body)
    throw ConfigError(fmt::format("cluster: {} stages need at least as many layers (have {})",
                                  stages, body));
  std::vector<int> cuts(stages, 0);
  for (int s = 1; s < stages; ++s)
    cuts[s] = lead + static_cast<int>(static_cast<int64_t>(s) * body / stages);
  const std::vector<Remat> rem(stages, remat);
  PlanCandidate pc = evaluate_candidate(segs.costs, schedule, d.pp, virtual_stages, microbatches,
                                        cuts, rem, hw.memory_budget());
  return finish(model, hw, o, d, segs, std::move(pc));
}

ClusterResult plan_cluster(const ModelProfile& model, const Hardware& hw,
                           const ClusterOptions& o) {
  model.validate();
  hw.validate();
  if (o.gpus < 1) throw ConfigError(fmt::format("cluster: gpus must be >= 1 (got {})", o.gpus));
  if (o.global_batch < 1)
    throw ConfigError(
        fmt::format("cluster: global_batch must be >= 1 (got {})", o.global_batch));
  const auto t0 = std::chrono::steady_clock::now();
  ClusterResult res;
  // Every (degree tuple, M) with a lower bound on its step time: the average rank's busy
  // time (each rank runs its stages' F and B, or F, I and W, for every microbatch; remat
  // only adds time) plus the average rank's update. The search visits them by increasing
  // bound and stops when the bound reaches the top-th best tuple found (their step times
  // can only be larger).
  struct Job {
    ClusterDegrees d;
    int microbatches;
    double bound;
    int tuple;
  };
  std::vector<Job> jobs;
  const int layers = model.num_layers();
  int tuples = 0;
  for (int pp : divisors(o.gpus, layers)) {
    if (!allowed(o.pp_choices, pp)) continue;
    for (int tp : divisors(o.gpus / pp, std::min(hw.gpus_per_node, model.max_tp))) {
      if (!allowed(o.tp_choices, tp) || model.max_tp % tp != 0) continue;
      const int dp = o.gpus / pp / tp;
      if (o.global_batch % dp != 0) continue;
      const int max_ep = model.num_experts > 0 ? model.num_experts : 1;
      for (int ep : divisors(dp, max_ep)) {
        if (!allowed(o.ep_choices, ep) || (ep > 1 && model.num_experts % ep != 0)) continue;
        for (int fs = 0; fs < 2; ++fs) {
          if (o.fsdp_mode >= 0 && fs != o.fsdp_mode) continue;
          if (fs == 1 && dp == 1) continue;
          const ClusterDegrees d{pp, tp, dp, ep, fs == 1};
          ++res.stats.degree_tuples;
          if (static_lower_bound(model, hw, d, o) > hw.memory_budget()) {
            ++res.stats.skipped_memory;
            continue;
          }
          std::vector<int> ms = divisors(o.global_batch / dp, o.max_microbatches);
          if (static_cast<int>(ms.size()) > o.max_microbatch_choices)
            ms.erase(ms.begin(), ms.end() - o.max_microbatch_choices);
          for (int m : ms) {
            const ClusterSegments segs = build_segments(model, hw, d, o, m, model.num_layers());
            double busy = 0, upd = 0;
            for (const SegmentCost& c : segs.costs.segments) {
              busy += c.f + std::min(c.b, c.i + c.w);
              upd += c.update;
            }
            jobs.push_back({d, m, (m * busy + upd) / pp, tuples});
          }
          ++tuples;
        }
      }
    }
  }
  std::stable_sort(jobs.begin(), jobs.end(),
                   [](const Job& a, const Job& b) { return a.bound < b.bound; });
  std::vector<std::optional<ClusterPlan>> best(tuples);
  std::vector<double> found;  // best step time of each tuple that has one
  auto kth_best = [&]() {
    if (static_cast<int>(found.size()) < o.top) return std::numeric_limits<double>::infinity();
    std::vector<double> f = found;
    std::nth_element(f.begin(), f.begin() + (o.top - 1), f.end());
    return f[o.top - 1];
  };
  for (const Job& job : jobs) {
    if (job.bound >= kth_best()) break;
    const ClusterDegrees& d = job.d;
    const ClusterSegments segs =
        build_segments(model, hw, d, o, job.microbatches, search_groups(model, o, d.pp));
    AutoplanOptions ao;
    ao.ranks = d.pp;
    ao.memory = hw.memory_budget();
    ao.top = 1;
    ao.families = o.families;
    ao.microbatches = {job.microbatches};
    ao.gap = o.gap;
    ao.node_budget = o.node_budget;
    ao.interleaved_v = o.interleaved_v;
    ao.verify = false;
    ++res.stats.searched;
    try {
      AutoplanResult ar = autoplan(segs.costs, ao);
      if (ar.plans.empty() || !ar.plans[0].fits) continue;
      std::optional<ClusterPlan>& b = best[job.tuple];
      if (!b) {
        b = finish(model, hw, o, d, segs, std::move(ar.plans[0]));
        found.push_back(b->step_time);
      } else if (ar.plans[0].step_time < b->step_time) {
        const double old = b->step_time;
        b = finish(model, hw, o, d, segs, std::move(ar.plans[0]));
        *std::find(found.begin(), found.end(), old) = b->step_time;
      }
    } catch (const ConfigError&) {
      ++res.stats.infeasible;
    }
  }
  for (auto& b : best)
    if (b) res.plans.push_back(std::move(*b));
  std::sort(res.plans.begin(), res.plans.end(),
            [](const ClusterPlan& a, const ClusterPlan& b) { return a.step_time < b.step_time; });
  if (static_cast<int>(res.plans.size()) > o.top) res.plans.resize(o.top);
  res.stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (res.plans.empty())
    throw ConfigError(fmt::format(
        "cluster: no plan fits {} per GPU ({} degree tuples, {} over memory by parameters and "
        "optimizer state alone, {} searched without a fit)",
        format_bytes(hw.memory_budget()), res.stats.degree_tuples, res.stats.skipped_memory,
        res.stats.searched));
  return res;
}

std::string ClusterResult::to_json() const {
  nlohmann::json plans_j = nlohmann::json::array();
  for (const ClusterPlan& p : plans) {
    std::vector<std::string> remat;
    for (Remat r : p.plan.remat) remat.push_back(remat_name(r));
    plans_j.push_back({{"pp", p.degrees.pp},
                       {"tp", p.degrees.tp},
                       {"dp", p.degrees.dp},
                       {"ep", p.degrees.ep},
                       {"fsdp", p.degrees.fsdp},
                       {"schedule", p.plan.schedule},
                       {"virtual_stages", p.plan.virtual_stages},
                       {"microbatches", p.plan.microbatches},
                       {"cuts", p.plan.cuts},
                       {"remat", remat},
                       {"segment_names", p.segment_names},
                       {"segment_layers", p.segment_layers},
                       {"step_time", p.step_time},
                       {"tokens_per_second", p.tokens_per_second},
                       {"mfu", p.mfu},
                       {"tflops_per_gpu", p.tflops_per_gpu},
                       {"bubble", p.plan.bubble_fraction},
                       {"fits", p.plan.fits},
                       {"memory",
                        {{"params", p.memory.params},
                         {"grads", p.memory.grads},
                         {"optimizer", p.memory.optimizer},
                         {"activations", p.memory.activations},
                         {"total", p.memory.total}}}});
  }
  nlohmann::json j{{"plans", plans_j},
                   {"stats",
                    {{"degree_tuples", stats.degree_tuples},
                     {"skipped_memory", stats.skipped_memory},
                     {"searched", stats.searched},
                     {"infeasible", stats.infeasible},
                     {"seconds", stats.seconds}}}};
  return j.dump(1);
}

std::string cluster_table(const ClusterResult& r, const Hardware& hw) {
  std::string out = fmt::format(
      "{:>3} {:>4} {:>3} {:>5} {:>3} {:>5} {:>11} {:>2} {:>4} {:>9} {:>11} {:>6} {:>7} "
      "{:>9} {:>9} {:>9} {:>9} {:>9}\n",
      "#", "pp", "tp", "dp", "ep", "fsdp", "schedule", "v", "M", "step(s)", "tokens/s", "MFU",
      "bubble", "params", "grads", "optim", "activ", "total");
  int k = 0;
  for (const ClusterPlan& p : r.plans) {
    out += fmt::format(
        "{:>3} {:>4} {:>3} {:>5} {:>3} {:>5} {:>11} {:>2} {:>4} {:>9.3f} {:>11.0f} {:>5.1f}% "
        "{:>6.1f}% {:>9} {:>9} {:>9} {:>9} {:>9}\n",
        ++k, p.degrees.pp, p.degrees.tp, p.degrees.dp, p.degrees.ep, p.degrees.fsdp ? "yes" : "no",
        p.plan.schedule, p.plan.virtual_stages, p.plan.microbatches, p.step_time,
        p.tokens_per_second, 100 * p.mfu, 100 * p.plan.bubble_fraction,
        format_bytes(p.memory.params), format_bytes(p.memory.grads),
        format_bytes(p.memory.optimizer), format_bytes(p.memory.activations),
        format_bytes(p.memory.total));
  }
  out += fmt::format(
      "{} degree tuples, {} over memory by static bytes, {} searches ({} without a fit), "
      "{:.2f} s; memory budget {} per GPU ({}), MFU = model FLOPs / step time / (GPUs x {:.0f} "
      "TFLOP/s)\n",
      r.stats.degree_tuples, r.stats.skipped_memory, r.stats.searched, r.stats.infeasible,
      r.stats.seconds, format_bytes(hw.memory_budget()), hw.name, hw.peak_bf16 / 1e12);
  return out;
}

}  // namespace baton
