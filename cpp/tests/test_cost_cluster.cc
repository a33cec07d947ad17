// Cluster planning: model profile JSON, segment costs against hand formulas
// for a plain MLP stack (memory per GPU and collective bytes for several
// (PP, TP, DP, FSDP) choices), and the degree search.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "baton/cluster.h"
#include "baton/collectives.h"
#include "baton/error.h"
#include "baton/hardware.h"

namespace {

// An MLP layer of hidden h, ffn f over s tokens per sample: two matmuls
// (h x f, f x h), Megatron TP (column then row parallel: one all-reduce of
// the s x h output in F, one in B).
constexpr double kH = 1024, kF = 4096, kS = 512;
constexpr int kLayers = 8;

baton::ModelProfile mlp_stack() {
  baton::ModelProfile m;
  m.name = "mlp";
  m.seq = static_cast<int64_t>(kS);
  m.max_tp = 8;
  baton::ProfileSegment l;
  l.name = "mlp";
  l.repeat = kLayers;
  l.params = static_cast<int64_t>(2 * kH * kF);
  l.fwd_flops = 2 * kS * l.params;
  l.bwd_flops = 2 * l.fwd_flops;
  l.wgrad_flops = l.fwd_flops;
  l.act_bytes = static_cast<int64_t>(2 * kS * kH);
  l.stash_keep = static_cast<int64_t>(2 * kS * (kH + kF));
  l.stash_min = l.stash_keep;
  l.stash_full = l.act_bytes;
  l.tp_collectives = 1;
  l.tp_bytes = static_cast<int64_t>(2 * kS * kH);
  m.segments = {l};
  m.model_flops_per_sample = kLayers * 3 * l.fwd_flops;
  return m;
}

baton::Hardware hardware() {
  baton::Hardware h;
  h.name = "test";
  h.gpus_per_node = 4;
  h.peak_bf16 = 1e14;
  h.hbm_bandwidth = 1e12;
  h.hbm_bytes = int64_t{80} << 30;
  h.intra = {1e11, 0};
  h.inter = {1e10, 0};
  h.efficiency = 0.5;
  return h;
}

struct Case {
  int pp, tp, dp;
  bool fsdp;
};

TEST(ClusterCosts, MlpStackMatchesHandFormulas) {
  const baton::ModelProfile m = mlp_stack();
  const baton::Hardware hw = hardware();
  const double P = 2 * kH * kF;
  for (const Case c : {Case{1, 1, 8, false}, Case{2, 2, 2, false}, Case{2, 4, 1, false},
                       Case{4, 1, 2, true}, Case{1, 2, 4, true}, Case{8, 1, 1, false},
                       Case{2, 1, 4, true}}) {
    SCOPED_TRACE(testing::Message() << "pp " << c.pp << " tp " << c.tp << " dp " << c.dp
                                    << " fsdp " << c.fsdp);
    baton::ClusterOptions o;
    o.gpus = c.pp * c.tp * c.dp;
    o.global_batch = 16 * c.dp;
    const int M = 8;
    const double mb = 16.0 / M;
    const baton::ClusterDegrees d{c.pp, c.tp, c.dp, 1, c.fsdp};
    const baton::ClusterSegments segs = baton::cluster_segment_costs(m, hw, d, o, M);
    const double F = hw.peak_bf16 * hw.efficiency;
    const auto& tp_link = baton::axis_link(hw, 1, c.tp);
    const auto& dp_link = baton::axis_link(hw, c.tp, c.dp);
    // Bytes on the wire: TP all-reduce of the microbatch's s x h output.
    const double tp_wire = c.tp == 1 ? 0 : 2.0 * (c.tp - 1) / c.tp * (mb * 2 * kS * kH);
    const double fsdp_wire = c.fsdp ? (c.dp - 1.0) / c.dp * 2 * P / c.tp : 0;
    double f_sum = 0, params = 0, opt = 0, update = 0;
    for (const baton::SegmentCost& s : segs.costs.segments) {
      f_sum += s.f;
      params += s.param_bytes;
      opt += s.opt_bytes;
      update += s.update;
    }
    const double comp_f = mb * 2 * kS * P / c.tp / F;
    EXPECT_NEAR(f_sum, kLayers * (std::max(comp_f, fsdp_wire / dp_link.bandwidth) +
                                  tp_wire / tp_link.bandwidth),
                1e-12);
    const double p_gpu = c.fsdp ? P / c.tp / c.dp : P / c.tp;
    EXPECT_NEAR(params, kLayers * 2 * p_gpu, 1.0 * kLayers);
    const double opt_gpu = c.fsdp ? 14 * P / c.tp / c.dp : 12 * P / c.tp / c.dp + 2 * P / c.tp;
    EXPECT_NEAR(opt, kLayers * opt_gpu, 1.0 * kLayers);
    // Per step: ZeRO-1 reduce-scatters 4-byte gradients and all-gathers bf16 parameters
    // over dp; plus the state (params, grads, optimizer) read and written once at HBM
    // bandwidth.
    const double dp_wire = c.fsdp || c.dp == 1 ? 0 : (c.dp - 1.0) / c.dp * (4 + 2) * P / c.tp;
    const double state = 2 * (4 * p_gpu + opt_gpu);
    EXPECT_NEAR(update, kLayers * (dp_wire / dp_link.bandwidth + state / hw.hbm_bandwidth),
                1e-9);
    // The configuration as a whole: static memory per GPU of the first rank
    // (pp even stages of layers) and activations at least the 1F1B stash.
    const baton::ClusterPlan p =
        baton::evaluate_cluster(m, hw, d, o, "1f1b", 1, M, baton::Remat::Keep);
    const double layers_rank = static_cast<double>(kLayers) / c.pp;
    EXPECT_NEAR(p.memory.params, layers_rank * 2 * p_gpu, 2.0 * kLayers);
    EXPECT_EQ(p.memory.grads, p.memory.params);
    EXPECT_NEAR(p.memory.optimizer, layers_rank * opt_gpu, 2.0 * kLayers);
    const double stash_mb = layers_rank * mb * 2 * kS * (kH + kF) / c.tp;
    EXPECT_GE(p.memory.activations, std::min(M, c.pp) * stash_mb - 1);
    EXPECT_EQ(p.memory.total,
              p.memory.params + p.memory.grads + p.memory.optimizer + p.memory.activations);
    EXPECT_GT(p.step_time, 0);
    EXPECT_NEAR(p.mfu, m.model_flops_per_sample * o.global_batch / p.step_time /
                           (o.gpus * hw.peak_bf16),
                1e-12);
  }
}

TEST(ClusterCosts, RejectsBadDegrees) {
  const baton::ModelProfile m = mlp_stack();
  const baton::Hardware hw = hardware();
  baton::ClusterOptions o;
  o.gpus = 8;
  o.global_batch = 16;
  EXPECT_THROW(baton::cluster_segment_costs(m, hw, {2, 2, 4, 1, false}, o, 1),
               baton::ConfigError);  // 16 GPUs != 8
  EXPECT_THROW(baton::cluster_segment_costs(m, hw, {1, 16, 1, 1, false}, o, 1),
               baton::ConfigError);  // tp does not divide max_tp... and gpus
  EXPECT_THROW(baton::cluster_segment_costs(m, hw, {1, 1, 8, 2, false}, o, 1),
               baton::ConfigError);  // ep on a dense model
  EXPECT_THROW(baton::cluster_segment_costs(m, hw, {1, 1, 8, 1, false}, o, 3),
               baton::ConfigError);  // 3 microbatches of 2 samples
}

TEST(ClusterProfile, JsonRoundTripAndErrors) {
  const baton::ModelProfile m = mlp_stack();
  const baton::ModelProfile back = baton::ModelProfile::from_json(m.to_json());
  EXPECT_EQ(back.segments, m.segments);
  EXPECT_EQ(back.total_params(), kLayers * static_cast<int64_t>(2 * kH * kF));
  try {
    baton::ModelProfile::from_json(R"({"segments": [{"fwd_flops": "x"}]})");
    FAIL() << "no error";
  } catch (const baton::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("'segments[0].fwd_flops'"), std::string::npos);
  }
  try {
    baton::ModelProfile::from_json(R"({"segments": [{"wgrad_flops": 2, "bwd_flops": 1}]})");
    FAIL() << "no error";
  } catch (const baton::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("segments[0].wgrad_flops"), std::string::npos);
  }
}

TEST(ClusterSearch, FindsAPlanAtLeastAsFastAsAGivenOne) {
  const baton::ModelProfile m = mlp_stack();
  const baton::Hardware hw = hardware();
  baton::ClusterOptions o;
  o.gpus = 16;
  o.global_batch = 64;
  const baton::ClusterResult r = baton::plan_cluster(m, hw, o);
  ASSERT_FALSE(r.plans.empty());
  for (size_t k = 1; k < r.plans.size(); ++k)
    EXPECT_LE(r.plans[k - 1].step_time, r.plans[k].step_time);
  const baton::ClusterPlan given =
      baton::evaluate_cluster(m, hw, {2, 2, 4, 1, false}, o, "1f1b", 1, 8, baton::Remat::Keep);
  // The search covers that tuple (with its own cuts, schedule and M within
  // the gap); its best is no slower than the given one beyond the 2% gap.
  EXPECT_LE(r.plans[0].step_time, given.step_time * 1.02);
  EXPECT_GT(r.stats.degree_tuples, 4);
  // Too little memory for anything: a clear error.
  baton::Hardware tiny = hw;
  tiny.hbm_bytes = 1 << 20;
  EXPECT_THROW(baton::plan_cluster(m, tiny, o), baton::ConfigError);
}

}  // namespace

namespace {

// Four one-segment stages of F 1 s, B 2 s; each segment's update is 0.2 s of optimizer
// plus `comm` s of overlapped data-parallel communication left after its own backward.
baton::SegmentCosts dp_costs(double comm) {
  baton::SegmentCosts c;
  for (int k = 0; k < 4; ++k) {
    baton::SegmentCost s;
    s.f = 1, s.b = 2, s.i = 2;
    s.update = 0.2 + comm;
    s.update_comm = comm;
    c.segments.push_back(s);
  }
  c.step_overhead = 0.05;
  c.validate();
  return c;
}

}  // namespace

TEST(DpOverlap, ShallowerStagesOfARankHideTheDeeperStagesReduce) {
  const std::vector<int> cuts{0, 1, 2, 3};
  // One stage per rank (stages 0+1 and 2+3 as two stages of two segments): nothing more
  // is hidden, the update is the sum as before.
  {
    const baton::SegmentCosts c = dp_costs(0.8);
    EXPECT_NEAR(baton::update_time(c, {0, 2}, {0, 1}, 2, 4), 0.05 + 2 * 1.0, 1e-12);
  }
  // Interleaved, rank 0 holds stages 0 and 2: stage 2's communication is ready when its
  // final group of min(M, ranks) = 2 microbatches is done, 2 x B of stage 0 = 4 s before
  // the rank's end, so it is hidden; stage 0's 0.8 s stays exposed.
  {
    const baton::SegmentCosts c = dp_costs(0.8);
    EXPECT_NEAR(baton::update_time(c, cuts, {0, 1, 0, 1}, 2, 4), 0.05 + 0.4 + 0.8, 1e-12);
    // With one microbatch the window is one B (2 s): still hidden.
    EXPECT_NEAR(baton::update_time(c, cuts, {0, 1, 0, 1}, 2, 1), 0.05 + 0.4 + 0.8, 1e-12);
  }
  // More communication than the window: the queue carries over into stage 0's.
  {
    const baton::SegmentCosts c = dp_costs(5.0);
    // M 4: stage 2 runs -4 .. 1, stage 0 then 1 .. 6: 6 s exposed.
    EXPECT_NEAR(baton::update_time(c, cuts, {0, 1, 0, 1}, 2, 4), 0.05 + 0.4 + 6.0, 1e-12);
    // M 1: stage 2 runs -2 .. 3, stage 0 then 3 .. 8: 8 s exposed.
    EXPECT_NEAR(baton::update_time(c, cuts, {0, 1, 0, 1}, 2, 1), 0.05 + 0.4 + 8.0, 1e-12);
    const std::vector<double> left = baton::update_comm_exposed(c, cuts, {0, 1, 0, 1}, 2, 1);
    ASSERT_EQ(left.size(), 2u);
    EXPECT_NEAR(left[0], 8.0, 1e-12);
    EXPECT_NEAR(left[1], 8.0, 1e-12);
  }
  // update_comm cannot exceed update.
  baton::SegmentCosts bad = dp_costs(0.8);
  bad.segments[1].update_comm = 2.0;
  EXPECT_THROW(bad.validate(), baton::ConfigError);
}

TEST(ClusterMemory, StashesFollowTheRematAndTheUpdateWritesInPlace) {
  // The MLP stack with its two linear matmuls: column-parallel s x h @ h x f, then
  // row-parallel s x f @ f x h; TP 2, microbatches of 2 samples.
  baton::ModelProfile m = mlp_stack();
  const auto H = static_cast<int64_t>(kH), F = static_cast<int64_t>(kF);
  m.segments[0].matmuls = {baton::MatmulShape{kS, F, H, 1, true, 1, false},
                           baton::MatmulShape{kS, H, F, 1, true, 2, false}};
  const baton::Hardware hw = hardware();
  baton::ClusterOptions o;
  o.gpus = 8;
  o.global_batch = 64;
  const baton::ClusterDegrees d{1, 2, 4, 1, false};
  const int M = 8;
  const double mb = 2, t = 2;
  int64_t wstash = 0, full = 0;
  for (const baton::SegmentCost& s : baton::cluster_segment_costs(m, hw, d, o, M).costs.segments) {
    wstash += s.wstash_bytes;
    full += s.full_stash_bytes;
  }
  // I -> W keeps each linear layer's input and its output's gradient (bf16): s x h and
  // s x f/t for the first, s x f/t and s x h for the second.
  EXPECT_NEAR(static_cast<double>(wstash), kLayers * mb * 2 * (2 * kS * kH + 2 * kS * kF / t),
              kLayers);
  // Full remat checkpoints each layer: its s x h input, split over TP like the stash.
  EXPECT_NEAR(static_cast<double>(full), kLayers * mb * 2 * kS * kH / t, kLayers);
  // The update in place: the peak is the static bytes plus the loop's; otherwise the new
  // parameters and optimizer state (P + O) sit beside the static 2P + O after the loop.
  const baton::ClusterPlan in_place =
      baton::evaluate_cluster(m, hw, d, o, "1f1b", 1, M, baton::Remat::Full);
  o.update_in_place = false;
  const baton::ClusterPlan copies =
      baton::evaluate_cluster(m, hw, d, o, "1f1b", 1, M, baton::Remat::Full);
  const int64_t P = in_place.memory.params, O = in_place.memory.optimizer;
  EXPECT_GT(3 * P + 2 * O, in_place.memory.total);  // this case: the copies are the peak
  EXPECT_EQ(copies.memory.total, std::max(in_place.memory.total, 3 * P + 2 * O));
  // Full remat keeps every layer's input of the microbatches in flight (one pipeline
  // rank: one at a time), beyond the transient of one segment's backward.
  EXPECT_GE(in_place.memory.activations, full - kLayers);
  // Stashes kept in fp8 with scales (stash_bytes 1.03125): every stash by 1.03125 / 2; under
  // fp8 the weight-gradient GEMM reads fp8 casts, one byte per element of both operands.
  o.update_in_place = true;
  o.stash_bytes = 1.03125;
  o.fp8 = true;
  baton::Hardware hw8 = hw;
  hw8.peak_fp8 = 2 * hw.peak_bf16;
  int64_t wstash8 = 0, full8 = 0, min8 = 0, min16 = 0;
  for (const baton::SegmentCost& s :
       baton::cluster_segment_costs(m, hw8, d, o, M).costs.segments) {
    wstash8 += s.wstash_bytes;
    full8 += s.full_stash_bytes;
    min8 += s.min_stash_bytes;
  }
  o.stash_bytes = 2;
  for (const baton::SegmentCost& s :
       baton::cluster_segment_costs(m, hw8, d, o, M).costs.segments)
    min16 += s.min_stash_bytes;
  EXPECT_NEAR(static_cast<double>(full8), full * 1.03125 / 2, kLayers);
  EXPECT_NEAR(static_cast<double>(min8), min16 * 1.03125 / 2, kLayers);
  EXPECT_NEAR(static_cast<double>(wstash8), wstash / 2.0, kLayers);
  o.stash_bytes = 0;
  EXPECT_THROW(baton::cluster_segment_costs(m, hw8, d, o, M), baton::ConfigError);
}

TEST(ClusterMemory, WeightStashKeepsASharedInputOnce) {
  // A gate and an up projection reading the same s x h activation (SwiGLU), then the
  // row-parallel down projection; TP 2, microbatches of 2 samples.
  baton::ModelProfile m = mlp_stack();
  const auto H = static_cast<int64_t>(kH), F = static_cast<int64_t>(kF);
  baton::MatmulShape gate{kS, F, H, 1, true, 1, false};
  baton::MatmulShape up = gate, down{kS, H, F, 1, true, 2, false};
  up.input = 0;
  m.segments[0].matmuls = {gate, up, down};
  const baton::Hardware hw = hardware();
  baton::ClusterOptions o;
  o.gpus = 8;
  o.global_batch = 64;
  const baton::ClusterDegrees d{1, 2, 4, 1, false};
  const double mb = 2, t = 2;
  auto wstash = [&](const baton::ModelProfile& p) {
    int64_t w = 0;
    for (const auto& s : baton::cluster_segment_costs(p, hw, d, o, 8).costs.segments)
      w += s.wstash_bytes;
    return static_cast<double>(w);
  };
  // bf16: the shared s x h input once, the gradients of the two s x f/t outputs, then the
  // down projection's s x f/t input and s x h output gradient.
  const double once = kLayers * mb * 2 * (kS * kH + 2 * kS * kF / t + kS * kF / t + kS * kH);
  EXPECT_NEAR(wstash(m), once, kLayers);
  baton::ModelProfile apart = m;
  apart.segments[0].matmuls[1].input = -1;  // read apart: each keeps its own copy
  EXPECT_NEAR(wstash(apart), once + kLayers * mb * 2 * kS * kH, kLayers);
  // The field round-trips through JSON; a reference that cannot be the same activation is
  // refused by name.
  EXPECT_EQ(baton::ModelProfile::from_json(m.to_json()).segments, m.segments);
  for (int bad : {1, 2, -2}) {
    baton::ModelProfile b = m;
    b.segments[0].matmuls[1].input = bad;  // itself, a later matmul, not an index
    EXPECT_THROW(baton::ModelProfile::from_json(b.to_json()), baton::ConfigError) << bad;
  }
  baton::ModelProfile other = m;
  other.segments[0].matmuls[2].input = 0;  // the down projection reads s x f/t, not s x h
  try {
    baton::ModelProfile::from_json(other.to_json());
    ADD_FAILURE() << "a different activation was accepted";
  } catch (const baton::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("matmuls[2].input"), std::string::npos) << e.what();
  }
}

TEST(SequenceParallel, NormsAndResidualsRunUnsplitWithoutIt) {
  // 8 layers of one column-parallel matmul and 1 MB of memory-bound bytes per sample, of
  // which 0.4 MB are norms and residual adds (outside the TP regions).
  baton::ModelProfile m = mlp_stack();
  baton::ProfileSegment& l = m.segments[0];
  l.matmuls = {baton::MatmulShape{kS, static_cast<int64_t>(kF), static_cast<int64_t>(kH), 1, true,
                                  1, false}};
  l.mem_bytes = 1e6;
  l.mem_bytes_replicated = 4e5;
  const baton::Hardware hw = hardware();
  baton::ClusterOptions o;
  o.gpus = 4;
  o.global_batch = 8;
  const baton::ClusterDegrees d{1, 4, 1, 1, false, false, false};
  const double with_sp =
      baton::cluster_segment_costs(m, hw, d, o, 8).per_microbatch.memory;  // mb = 1
  o.sequence_parallel = false;
  const double without =
      baton::cluster_segment_costs(m, hw, d, o, 8).per_microbatch.memory;
  // F + B move 3x the forward's bytes: split over 4 TP ranks, or 0.6 MB split and 0.4 MB
  // whole on every rank.
  const double hbm = hw.hbm_bandwidth * hw.hbm_efficiency;
  EXPECT_NEAR(with_sp, kLayers * 3 * 1e6 / 4 / hbm, 1e-15);
  EXPECT_NEAR(without, kLayers * 3 * (6e5 / 4 + 4e5) / hbm, 1e-15);
  // The profile JSON carries the field and refuses more replicated bytes than bytes.
  const baton::ModelProfile back = baton::ModelProfile::from_json(m.to_json());
  EXPECT_DOUBLE_EQ(back.segments[0].mem_bytes_replicated, 4e5);
  l.mem_bytes_replicated = 2e6;
  EXPECT_THROW(baton::ModelProfile::from_json(m.to_json()), baton::ConfigError);
}

namespace {

// The MLP stack as MoE layers: each token's s x h activation goes to top_k experts, two
// all-to-alls per pass (dispatch, combine) of top_k x s x h bf16.
constexpr int kTopK = 4;

baton::ModelProfile moe_stack() {
  baton::ModelProfile m = mlp_stack();
  m.num_experts = 16;
  baton::ProfileSegment& l = m.segments[0];
  l.a2a_collectives = 2;
  l.a2a_bytes = static_cast<int64_t>(kTopK * 2 * kS * kH);
  l.a2a_top_k = kTopK;
  return m;
}

// Expert all-to-all seconds of one microbatch (F + B) on ep 16 over 4 nodes of 4.
double ep_comm(const baton::ModelProfile& m, const baton::Hardware& hw, baton::ClusterOptions o,
               int ep, double dispatch_bytes, int node_limit) {
  o.gpus = 16;
  o.global_batch = 16;
  o.dispatch_bytes = dispatch_bytes;
  o.ep_node_limit = node_limit;
  return baton::cluster_segment_costs(m, hw, {1, 1, 16, ep, false}, o, 1)
      .per_microbatch.ep_comm;  // mb = 1
}

}  // namespace

TEST(ExpertAllToAll, NodeLimitedRoutingAndFp8Dispatch) {
  const baton::ModelProfile m = moe_stack();
  baton::Hardware hw = hardware();  // 4 GPUs per node; NVLink 1e11, IB 1e10 bytes/s
  const baton::ClusterOptions o;
  const double bytes = kTopK * 2 * kS * kH;  // one all-to-all, bf16
  // Per microbatch: F and B, each a dispatch-way and a combine-way all-to-all.
  auto per_mb = [](double dispatch, double combine) { return kLayers * 2 * (dispatch + combine); };
  // No limit: every copy to its expert's GPU over IB, pairwise over the 16 ranks.
  const double flat = 15.0 / 16 * bytes / hw.inter.bandwidth;
  EXPECT_NEAR(ep_comm(m, hw, o, 16, 2, 0), per_mb(flat, flat), 1e-12);
  // At most 2 of the 4 nodes per token: 2 of the 4 copies cross IB (pairwise over the 4
  // nodes), all 4 go on over NVLink (pairwise over a node's 4 GPUs) at the same time.
  const double ib = 3.0 / 4 * bytes * 2 / kTopK / hw.inter.bandwidth;
  const double nvl = 3.0 / 4 * bytes / hw.intra.bandwidth;
  ASSERT_GT(ib, nvl);
  EXPECT_NEAR(ep_comm(m, hw, o, 16, 2, 2), per_mb(ib, ib), 1e-12);
  // fp8 dispatch (1 byte per element): the dispatch-way half moves half the bytes.
  EXPECT_NEAR(ep_comm(m, hw, o, 16, 1, 2), per_mb(ib / 2, ib), 1e-12);
  // A limit above top_k: one IB copy per expert still, but only across nodes.
  EXPECT_NEAR(ep_comm(m, hw, o, 16, 2, 8), per_mb(2 * ib, 2 * ib), 1e-12);
  // With IB as fast as NVLink the NVLink forward is the larger part.
  hw.inter = hw.intra;
  EXPECT_NEAR(ep_comm(m, hw, o, 16, 2, 2), per_mb(nvl, nvl), 1e-12);
  // An expert group inside one node (ep 4) ignores the limit: NVLink all-to-all.
  hw = hardware();
  const double node = 3.0 / 4 * bytes / hw.intra.bandwidth;
  EXPECT_NEAR(ep_comm(m, hw, o, 4, 2, 2), per_mb(node, node), 1e-12);
  EXPECT_NEAR(ep_comm(m, hw, o, 4, 2, 0), per_mb(node, node), 1e-12);
  // A profile without a2a_top_k keeps the flat all-to-all; bad options are refused.
  baton::ModelProfile plain = m;
  plain.segments[0].a2a_top_k = 0;
  EXPECT_NEAR(ep_comm(plain, hw, o, 16, 2, 2), per_mb(flat, flat), 1e-12);
  EXPECT_THROW(ep_comm(m, hw, o, 16, 0, 2), baton::ConfigError);
  EXPECT_THROW(ep_comm(m, hw, o, 16, 2, -1), baton::ConfigError);
  const baton::ModelProfile back = baton::ModelProfile::from_json(m.to_json());
  EXPECT_EQ(back.segments[0].a2a_top_k, kTopK);
}

TEST(ExpertAllToAll, DualPipeVPairsHideItWithContention) {
  const baton::ModelProfile m = moe_stack();
  baton::Hardware hw = hardware();
  hw.overlap_contention = 0.1;
  baton::ClusterOptions o;
  o.gpus = 16;
  o.global_batch = 16;
  const baton::ClusterSegments segs =
      baton::cluster_segment_costs(m, hw, {1, 1, 16, 16, false}, o, 1);
  double fb = 0;
  for (const baton::SegmentCost& c : segs.costs.segments) fb += c.f + c.b;
  const double a2a = segs.per_microbatch.ep_comm;
  ASSERT_GT(a2a, 0);
  ASSERT_GT(fb, a2a);
  // The fused F&B pair: what the other microbatch's compute hides of one microbatch's
  // all-to-alls is gone but for the contention (overlap_exposed).
  const double hidden = std::min(a2a, fb - a2a);
  EXPECT_NEAR(segs.costs.fused_factor * fb,
              fb - hidden + baton::overlap_exposed(hidden, fb - a2a, 0.1), 1e-12);
  EXPECT_NEAR(segs.costs.fused_factor, (fb - 0.9 * hidden) / fb, 1e-12);
}
