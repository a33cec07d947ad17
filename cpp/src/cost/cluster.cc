// Cluster planning: segment costs per degree tuple and the degree search over
// autoplan (cluster.h); its outputs as JSON and a table are in cluster_report.cc.
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
  const Hardware* hw;
  bool fp8;
  int t, e, d;
  const LinkSpec *tp_link, *ep_link, *dp_link;
  int64_t seq;
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

// Compute of one segment instance at one microbatch of `mb` samples, by kind.
struct Parts {
  double gemm_f = 0, gemm_b = 0, gemm_w = 0;
  double attn_f = 0, attn_b = 0;
  double mem_f = 0, mem_b = 0;
  double launch_f = 0, launch_b = 0;
  double legacy_recompute = 0;
  // Bytes a split backward keeps from I to W: each linear layer's input (once for the
  // layers that read the same one) and its output's gradient (dW = x^T dy), as the
  // weight-gradient GEMM reads them (fp8 casts under fp8);
  // < 0 without matmul shapes (then the whole stash).
  double wstash = -1;
  double f() const { return gemm_f + attn_f + mem_f + launch_f; }
  double b() const { return gemm_b + attn_b + mem_b + launch_b; }
};

Parts compute_parts(const ProfileSegment& s, const Shard& sh, double mb, const ClusterOptions& o) {
  const Hardware& hw = *sh.hw;
  Parts p;
  if (s.matmuls.empty()) {
    // A profile without shapes: every FLOP at the largest GEMM rate.
    const double rate = hw.achieved_flops(sh.fp8);
    p.gemm_f = mb * s.fwd_flops / sh.t / rate;
    p.gemm_b = mb * s.bwd_flops / sh.t / rate;
    p.gemm_w = mb * s.wgrad_flops / sh.t / rate;
    p.legacy_recompute = mb * s.min_recompute_flops / sh.t / rate;
  } else {
    double cast_f = 0, cast_b = 0;
    p.wstash = 0;
    for (const MatmulShape& m : s.matmuls) {
      double rows = mb * m.m;
      double n = static_cast<double>(m.n), k = static_cast<double>(m.k);
      double count = m.count;
      if (m.tp_dim == 1) n = std::max(1.0, n / sh.t);
      if (m.tp_dim == 2) k = std::max(1.0, k / sh.t);
      if (m.expert) {
        count = std::max(1.0, count / sh.e);  // experts on this GPU ...
        rows *= std::min<double>(sh.e, m.count);  // ... each with tokens from the EP group
      }
      const bool f8 = sh.fp8 && m.linear && hw.peak_fp8 > 0;
      const double in_bytes = f8 ? 1.0 : 2.0;
      const double flops = 2.0 * rows * n * k;
      const double bytes = in_bytes * (rows * k + k * n) + 2.0 * rows * n;
      // Forward output rows x n; the input gradient's rows x k and the weight gradient's
      // k x n (their shapes matter only under wave quantization).
      const double one = hw.gemm_seconds(flops, bytes, f8, rows, n);
      const double dgrad = hw.gemm_seconds(flops, bytes, f8, rows, k);
      const double wgrad = hw.gemm_seconds(flops, bytes, f8, k, n);
      p.gemm_f += count * one;
      p.gemm_b += count * (dgrad + wgrad);  // input gradient and weight (or operand) gradient
      if (m.linear) {
        p.gemm_w += count * wgrad;
        // The output's gradient, and the input unless an earlier matmul keeps it.
        p.wstash += count * in_bytes * rows * (m.input < 0 ? k + n : n);
      }
      if (f8) {
        // fp8 recipe: the input and the weight are cast in the forward, the output
        // gradient and the transposed weight in the backward.
        cast_f += count * o.fp8_cast_bytes * (rows * k + k * n);
        cast_b += count * o.fp8_cast_bytes * (rows * n + k * n);
      }
    }
    if (o.flash_attention) {
      const double attn = mb * s.attn_flops / sh.t * (s.attn_causal ? 0.5 : 1.0);
      p.attn_f =
          hw.attention_seconds(attn, static_cast<double>(sh.seq), false, o.attention_kernel);
      // Fused backward: dQ, dK, dV and the recomputed scores, 2.5x the forward's FLOPs.
      p.attn_b =
          hw.attention_seconds(2.5 * attn, static_cast<double>(sh.seq), true, o.attention_kernel);
    } else if (s.attn_flops > 0) {
      // Unfused: QK^T and PV as two batched GEMMs over the full square, the scores
      // through HBM (written, softmax read + write, dropout read + write + mask, read by
      // PV: 13 bytes each); the backward runs four GEMMs and twice the traffic.
      const double half = mb * s.attn_flops / sh.t / 2;
      const double scores = mb * s.attn_scores / sh.t;
      const double g = hw.gemm_seconds(half, 2.0 * scores, false);
      p.attn_f = 2 * g + hw.memory_seconds(13.0 * scores);
      p.attn_b = 4 * g + hw.memory_seconds(26.0 * scores);
    }
    // Outside the TP regions (norms, residual adds) each TP rank works on the whole
    // activation unless sequence parallelism splits it.
    const double rep = o.sequence_parallel ? 0.0 : s.mem_bytes_replicated;
    const double mem = mb * (s.mem_bytes - rep) / sh.t + mb * rep;
    p.mem_f = hw.memory_seconds(mem + cast_f);
    p.mem_b = hw.memory_seconds(2.0 * mem + cast_b);
  }
  p.launch_f = s.kernels * hw.kernel_overhead;
  p.launch_b = 2.0 * p.launch_f;
  return p;
}

// One expert all-to-all of a pass, averaged over its dispatch-way and combine-way halves
// (ClusterOptions::dispatch_bytes, ep_node_limit). `bytes` per copy direction: bf16.
double expert_all_to_all_time(const ProfileSegment& s, const Shard& sh, double mb,
                              const ClusterOptions& o, const Hardware& hw) {
  if (s.a2a_collectives == 0 || sh.e == 1) return 0.0;
  const double bf16 = mb * static_cast<double>(s.a2a_bytes) / sh.t;  // top_k copies, bf16
  auto one = [&](double bytes) {
    // The expert group spans nodes when its t x e GPUs exceed a node (axis_link's rule).
    const int64_t span = static_cast<int64_t>(sh.t) * sh.e;
    if (o.ep_node_limit <= 0 || s.a2a_top_k <= 0 || span <= hw.gpus_per_node)
      return all_to_all_time(bytes, sh.e, *sh.ep_link);
    // Node-limited: one copy per target node over the inter-node link (to at most
    // ep_node_limit of the group's nodes), forwarded to the top_k experts' GPUs inside
    // the node; the two overlap (DeepSeek-V3 sec. 3.2.2), so the larger one counts.
    const int nodes = static_cast<int>((span + hw.gpus_per_node - 1) / hw.gpus_per_node);
    const int per_node = std::max(1, hw.gpus_per_node / sh.t);  // expert ranks in a node
    const double copies = std::min({s.a2a_top_k, o.ep_node_limit, nodes});
    const double inter = all_to_all_time(bytes * copies / s.a2a_top_k, nodes, hw.inter);
    const double intra = all_to_all_time(bytes, per_node, hw.intra);
    return std::max(inter, intra);
  };
  return 0.5 * (one(bf16 * o.dispatch_bytes / 2.0) + one(bf16));
}

double exposed(double comm, double compute, double contention) {
  return overlap_exposed(comm, compute, contention);
}

struct InstanceCost {
  SegmentCost c;
  TimeBreakdown per_mb;    // F + B of one microbatch
  TimeBreakdown per_step;  // once per step
};

InstanceCost instance_cost(const ProfileSegment& s, const Shard& sh, double mb,
                           const ClusterOptions& o, const ClusterDegrees& d, const Hardware& hw) {
  InstanceCost out;
  SegmentCost& c = out.c;
  c.name = s.name;
  const Parts p = compute_parts(s, sh, mb, o);
  const double comp_f = p.f(), comp_b = p.b(), comp_w = p.gemm_w;
  const double comp_i = comp_b - comp_w;
  // Sequence-parallel TP: all-gather + reduce-scatter per collective point.
  const double tp_one = all_gather_time(mb * s.tp_bytes, sh.t, *sh.tp_link) +
                        reduce_scatter_time(mb * s.tp_bytes, sh.t, *sh.tp_link);
  const double tp_raw = s.tp_collectives * tp_one;
  const double tp_f = d.tp_overlap ? exposed(tp_raw, p.gemm_f, hw.overlap_contention) : tp_raw;
  const double tp_b = d.tp_overlap ? exposed(tp_raw, p.gemm_b, hw.overlap_contention) : tp_raw;
  const double a2a = s.a2a_collectives * expert_all_to_all_time(s, sh, mb, o, hw);
  const double p_loc = params_local(s, sh);
  const double p_store = d.fsdp ? params_sharded(s, sh) : p_loc;
  const double gather = d.fsdp ? all_gather_time(2.0 * p_loc, sh.d, *sh.dp_link) : 0.0;
  const double scatter =
      d.fsdp ? reduce_scatter_time(o.grad_reduce_bytes * p_loc, sh.d, *sh.dp_link) : 0.0;
  c.f = std::max(comp_f, gather) + tp_f + a2a;
  c.b = std::max(comp_b, gather + scatter) + tp_b + a2a;
  c.i = std::max(comp_i, gather) + tp_b + a2a;
  c.w = std::max(comp_w, scatter);
  // "min" remat keeps the outputs of the matmuls without batch dimensions (the linear
  // layers) and recomputes the rest: the memory-bound work and the attention core, whose
  // score matmuls carry batch dimensions (Megatron's selective recomputation).
  c.min_recompute = p.mem_f + p.launch_f + p.attn_f + p.legacy_recompute;
  c.act_bytes = round_bytes(mb * s.act_bytes / sh.t);
  const double kept = o.stash_bytes / 2.0;  // the stashes' element size against bf16
  c.stash_bytes = round_bytes(kept * mb * s.stash_keep / sh.t);
  c.min_stash_bytes = round_bytes(kept * mb * s.stash_min / sh.t);
  c.wstash_bytes = p.wstash < 0 ? c.stash_bytes : round_bytes(p.wstash);
  // Full remat checkpoints each layer on its own (Megatron's and torchtitan's full
  // recomputation; the plan's checkpoint_stages): each layer keeps its input.
  c.full_stash_bytes = round_bytes(kept * mb * s.stash_full / sh.t);
  // Each layer is its own checkpointed unit: its backward first rematerializes what the
  // remat dropped, live until that backward ends (Megatron's, torchtitan's and JAX's
  // per-layer checkpoints alike).
  c.min_transient_bytes = std::max<int64_t>(0, c.stash_bytes - c.min_stash_bytes);
  c.full_transient_bytes = std::max<int64_t>(0, c.stash_bytes - c.full_stash_bytes);
  c.param_bytes = round_bytes(2.0 * p_store);
  const double opt_params = d.fsdp ? p_store : params_sharded(s, sh);
  c.opt_bytes =
      round_bytes(o.opt_bytes_per_param * opt_params + o.grad_extra_bytes_per_param * p_store);
  c.temp_bytes = round_bytes(mb * s.temp_bytes / sh.t + (d.fsdp ? 4.0 * p_loc : 0.0));
  // ZeRO-1 / distributed optimizer: reduce-scatter of the gradients in their reduction
  // precision, all-gather of the updated bf16 parameters. With overlap the reduce-scatter
  // runs bucket by bucket during this segment's last backward and the all-gather during
  // the next step's first forward.
  double reduce = 0, reduce_rs = 0;
  if (!d.fsdp) {
    const double rs = reduce_scatter_time(o.grad_reduce_bytes * p_loc, sh.d, *sh.dp_link);
    const double ag = all_gather_time(2.0 * p_loc, sh.d, *sh.dp_link);
    reduce_rs = d.dp_overlap ? exposed(rs, comp_b, hw.overlap_contention) : rs;
    reduce = reduce_rs + (d.dp_overlap ? exposed(ag, comp_f, hw.overlap_contention) : ag);
  }
  const double state = 2.0 * static_cast<double>(2 * c.param_bytes + c.opt_bytes);
  const double opt = hw.memory_seconds(state);
  c.update = reduce + opt;
  // Overlapped, what this segment's own last backward leaves of its gradients'
  // reduce-scatter can still hide behind the last backwards of the shallower stages on
  // its rank (update_time); the all-gather keeps its own first forward only.
  c.update_comm = d.dp_overlap ? reduce_rs : 0.0;
  TimeBreakdown& m = out.per_mb;
  m.gemm = p.gemm_f + p.gemm_b;
  m.attention = p.attn_f + p.attn_b;
  m.memory = p.mem_f + p.mem_b;
  m.launch = p.launch_f + p.launch_b;
  m.tp_comm = tp_f + tp_b;
  m.ep_comm = 2 * a2a;
  m.fsdp_comm = (c.f - comp_f - tp_f - a2a) + (c.b - comp_b - tp_b - a2a);
  out.per_step.dp_comm = reduce;
  out.per_step.optimizer = opt;
  return out;
}

void add_breakdown(TimeBreakdown& a, const TimeBreakdown& b) {
  a.gemm += b.gemm;
  a.attention += b.attention;
  a.memory += b.memory;
  a.launch += b.launch;
  a.recompute += b.recompute;
  a.tp_comm += b.tp_comm;
  a.ep_comm += b.ep_comm;
  a.fsdp_comm += b.fsdp_comm;
  a.dp_comm += b.dp_comm;
  a.optimizer += b.optimizer;
  a.bubble += b.bubble;
}

void add_into(SegmentCost& g, const SegmentCost& c) {
  g.f += c.f;
  g.b += c.b;
  g.i += c.i;
  g.w += c.w;
  g.update += c.update;
  g.update_comm += c.update_comm;
  g.min_recompute += c.min_recompute;
  g.act_bytes = c.act_bytes;
  g.stash_bytes += c.stash_bytes;
  g.min_stash_bytes += c.min_stash_bytes;
  g.wstash_bytes += c.wstash_bytes;
  g.full_stash_bytes = std::max<int64_t>(g.full_stash_bytes, 0) + c.full_stash_bytes;
  g.param_bytes += c.param_bytes;
  g.opt_bytes += c.opt_bytes;
  g.temp_bytes = std::max(g.temp_bytes, c.temp_bytes);
  g.min_transient_bytes = std::max(g.min_transient_bytes, c.min_transient_bytes);
  g.full_transient_bytes = std::max(g.full_transient_bytes, c.full_transient_bytes);
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
  if (!(o.dispatch_bytes > 0 && o.dispatch_bytes <= 4) || o.ep_node_limit < 0)
    throw ConfigError(fmt::format("cluster: dispatch_bytes must be in (0, 4] and ep_node_limit "
                                  ">= 0 (got {} and {})",
                                  o.dispatch_bytes, o.ep_node_limit));
  if (!(o.stash_bytes > 0 && o.stash_bytes <= 4))
    throw ConfigError(
        fmt::format("cluster: stash_bytes must be in (0, 4] (got {})", o.stash_bytes));
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
  if ((d.tp_overlap && d.tp == 1) || (d.dp_overlap && (d.dp == 1 || d.fsdp)))
    throw ConfigError(fmt::format(
        "cluster: tp_overlap needs tp > 1 and dp_overlap needs ZeRO-1 with dp > 1 (tp {} dp {} "
        "fsdp {})",
        d.tp, d.dp, d.fsdp));
  const Shard sh{&hw, o.fp8, d.tp, d.ep, d.dp, &axis_link(hw, 1, d.tp),
                 &axis_link(hw, d.tp, d.ep), &axis_link(hw, d.tp, d.dp), m.seq};
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
  out.costs.host_link_bandwidth = hw.host_link.bandwidth;
  std::vector<InstanceCost> cache(m.segments.size());
  std::vector<bool> have(m.segments.size(), false);
  for (int g = 0; g < groups; ++g) {
    SegmentCost sum;
    std::string name;
    for (int k = bounds[g]; k < bounds[g + 1]; ++k) {
      const size_t idx = static_cast<size_t>(inst[k] - m.segments.data());
      if (!have[idx]) cache[idx] = instance_cost(*inst[k], sh, mb, o, d, hw), have[idx] = true;
      add_into(sum, cache[idx].c);
      add_breakdown(out.per_microbatch, cache[idx].per_mb);
      add_breakdown(out.per_step, cache[idx].per_step);
      if (name.empty() || name.rfind(inst[k]->name, 0) != 0)
        name += (name.empty() ? "" : "+") + inst[k]->name;
    }
    sum.name = fmt::format("{}x{}", name, bounds[g + 1] - bounds[g]);
    out.costs.segments.push_back(sum);
    out.names.push_back(sum.name);
    out.layers.push_back(bounds[g + 1] - bounds[g]);
  }
  // DualPipeV's fused F&B pairs hide one microbatch's expert all-to-alls behind the other's
  // compute: the fused action lasts (F + B - (1 - c) hidden) / (F + B) of the two tasks,
  // the hidden part still slowing the compute by the hardware's overlap_contention c, as
  // overlap_exposed counts it (DeepSeek-V3 sec. 3.2.2: its all-to-all kernels hold 20 of
  // the H800's 132 SMs while the paired chunk computes).
  {
    double fb = 0;
    for (const SegmentCost& c : out.costs.segments) fb += c.f + c.b;
    const double a2a = out.per_microbatch.ep_comm;
    if (a2a > 0 && fb > a2a)
      out.costs.fused_factor =
          (fb - (1 - hw.overlap_contention) * std::min(a2a, fb - a2a)) / fb;
  }
  // The last gradient bucket's reduce-scatter has no backward left to hide behind.
  if (d.dp_overlap) {
    double local = 0;
    for (const ProfileSegment& s : m.segments) local += s.repeat * params_local(s, sh);
    const double bucket = std::min(o.bucket_params, local / d.pp);
    out.costs.step_overhead =
        reduce_scatter_time(o.grad_reduce_bytes * bucket, d.dp, *sh.dp_link);
    out.per_step.dp_comm += out.costs.step_overhead * d.pp;
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
  const Shard sh{&hw, false, d.tp, d.ep, d.dp, &hw.intra, &hw.intra, &hw.intra, m.seq};
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
  if (!pc.peak_host.empty()) mem.host = pc.peak_host[rank];
  mem.activations = std::max<int64_t>(0, mem.total - mem.params - mem.grads - mem.optimizer);
  cp.memory = mem;
  // Time breakdown of the average rank: the loop's work over M microbatches and the
  // per-step work, each divided over the pp ranks; remat's extra work from the stages'
  // modes; the bubble is what the step has beyond them.
  const double per_rank = static_cast<double>(pc.microbatches) / d.pp;
  TimeBreakdown t;
  const TimeBreakdown& a = segs.per_microbatch;
  t.gemm = a.gemm * per_rank;
  t.attention = a.attention * per_rank;
  t.memory = a.memory * per_rank;
  t.launch = a.launch * per_rank;
  t.tp_comm = a.tp_comm * per_rank;
  t.ep_comm = a.ep_comm * per_rank;
  if (pc.schedule == "dualpipev" && segs.costs.fused_factor < 1) {
    // The fused F&B pairs hide all-to-alls: (1 - fused_factor) of their F + B (what is
    // left of ep_comm: the part not hidden and the contention of the hidden part).
    double fb = 0;
    for (const SegmentCost& c : segs.costs.segments) fb += c.f + c.b;
    t.ep_comm = std::max(0.0, t.ep_comm - (1 - segs.costs.fused_factor) * fb * per_rank);
  }
  t.fsdp_comm = a.fsdp_comm * per_rank;
  // The overlapped reduce-scatter's exposed part as update_time counts it, per rank.
  {
    double comm = 0;
    for (const SegmentCost& c : segs.costs.segments) comm += c.update_comm;
    double left = 0;
    for (double v : update_comm_exposed(segs.costs, pc.cuts, s.stage_rank, d.pp, pc.microbatches))
      left += v;
    t.dp_comm = (segs.per_step.dp_comm - comm + left) / d.pp;
  }
  t.optimizer = segs.per_step.optimizer / d.pp;
  double rec = 0;
  const int nseg = static_cast<int>(segs.costs.segments.size());
  for (int st = 0; st < pc.num_stages(); ++st) {
    const int begin = pc.cuts[st];
    const int end = st + 1 < pc.num_stages() ? pc.cuts[st + 1] : nseg;
    for (int k = begin; k < end; ++k) {
      const SegmentCost& c = segs.costs.segments[k];
      if (pc.remat[st] == Remat::Full) rec += c.f;
      if (pc.remat[st] == Remat::Min) rec += c.min_recompute;
    }
  }
  t.recompute = rec * per_rank;
  t.bubble = std::max(0.0, pc.step_time - (t.gemm + t.attention + t.memory + t.launch +
                                           t.recompute + t.tp_comm + t.ep_comm + t.fsdp_comm +
                                           t.dp_comm + t.optimizer));
  cp.time = t;
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
  hw.attention_curve(o.attention_kernel);  // refuses an unknown kernel by name
  const ClusterSegments segs =
      build_segments(model, hw, d, o, microbatches, model.num_layers());
  const int n = static_cast<int>(segs.costs.segments.size());
  const std::string key = schedule;
  const bool vshape = key == "zbv" || key == "vmin" || key == "vhalf" || key == "dualpipev";
  const int v = vshape ? 2 : (key == "interleaved" ? virtual_stages : 1);
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
                                        cuts, rem, hw.memory_budget(), o.update_in_place);
  return finish(model, hw, o, d, segs, std::move(pc));
}

ClusterResult plan_cluster(const ModelProfile& model, const Hardware& hw,
                           const ClusterOptions& o) {
  model.validate();
  hw.validate();
  hw.attention_curve(o.attention_kernel);  // refuses an unknown kernel by name
  if (o.gpus < 1) throw ConfigError(fmt::format("cluster: gpus must be >= 1 (got {})", o.gpus));
  if (o.global_batch < 1)
    throw ConfigError(
        fmt::format("cluster: global_batch must be >= 1 (got {})", o.global_batch));
  if (o.offload == 1 && !(hw.host_link.bandwidth > 0))
    throw ConfigError(fmt::format(
        "cluster: offload needs the hardware's host_link bandwidth ({} has none)", hw.name));
  const bool offload = o.offload != 0 && hw.host_link.bandwidth > 0;
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
        for (int combo = 0; combo < 8; ++combo) {
          const int fs = combo & 1, tpo = (combo >> 1) & 1, dpo = (combo >> 2) & 1;
          if (o.fsdp_mode >= 0 && fs != o.fsdp_mode) continue;
          if (fs == 1 && dp == 1) continue;
          if (o.tp_overlap >= 0 && tpo != o.tp_overlap && tp > 1) continue;
          if (tpo == 1 && tp == 1) continue;
          if (o.dp_overlap >= 0 && dpo != o.dp_overlap && dp > 1 && fs == 0) continue;
          if (dpo == 1 && (dp == 1 || fs == 1)) continue;
          const ClusterDegrees d{pp, tp, dp, ep, fs == 1, tpo == 1, dpo == 1};
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
  // Without offload first, every job, then with it: the first pass's plans
  // bound the second's searches (AutoplanOptions::upper_bound), where the
  // weaker memory bounds with offload would otherwise explore far more. An
  // exact search (no node budget) returns the same plans either way; under a
  // node budget the bound lets each search reach further.
  for (const bool with_offload : {false, true}) {
    if (with_offload && !offload) break;
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
      ao.offload = with_offload;
      ao.host_memory = hw.host_bytes;
      ao.fetch_lookahead = o.fetch_lookahead;
      ao.update_in_place = o.update_in_place;
      ao.verify = false;
      // Only a plan that enters the top K, or improves this tuple's row, matters.
      ao.upper_bound = kth_best();
      if (best[job.tuple])
        ao.upper_bound = std::min(ao.upper_bound, best[job.tuple]->step_time);
      if (!with_offload) ++res.stats.searched;
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
        if (!with_offload) ++res.stats.infeasible;
      }
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

}  // namespace baton
