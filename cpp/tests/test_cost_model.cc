// The cluster cost model's physical parts (docs/SCALE.md, "Time from physical
// parts"): the GEMM rate lookup, overlap's exposed time, fp8 on linear layers
// only, and a whole plan's step time in closed form.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "baton/cluster.h"
#include "baton/collectives.h"
#include "baton/error.h"
#include "baton/hardware.h"

namespace {

// Points of OpenXLA's sm_90 (H100) bf16 table, as h100.json carries them.
baton::RateTable h100_bf16() {
  baton::RateTable t;
  t.points = {{3.3554432e7, 6.452775384615e12},   {2.68435456e8, 4.0721398058252e13},
              {2.147483648e9, 2.36298816901408e14}, {1.7179869184e10, 6.3198459329017e14},
              {1.37438953472e11, 7.83328793548203e14}, {2.74877906944e11, 8.0767101419194e14},
              {5.49755813888e11, 7.93131337247852e14}};
  return t;
}

baton::Hardware physical() {
  baton::Hardware h;
  h.name = "test-physical";
  h.gpus_per_node = 8;
  h.peak_bf16 = 989e12;
  h.peak_fp8 = 1979e12;
  h.hbm_bandwidth = 3.35e12;
  h.hbm_bytes = int64_t{80} << 30;
  h.intra = {450e9, 0, 360e9};
  h.inter = {50e9, 0, 45e9};
  h.gemm_bf16 = h100_bf16();
  h.hbm_efficiency = 0.85;
  return h;
}

TEST(GemmRate, ClockRatioScalesComputeButNotMemory) {
  // A power-capped card (clock_ratio < 1) runs every compute rate slower by the
  // ratio; memory-bound work keeps the HBM speed.
  baton::Hardware hw = physical();
  hw.attention_fwd.points = {{512, 0.3}, {8192, 0.56}};
  hw.attention_bwd_ratio = 0.8;
  baton::Hardware capped = hw;
  capped.clock_ratio = 0.894;
  capped.validate();
  const double flops = 1e12;
  EXPECT_NEAR(capped.gemm_seconds(flops, 0, false), hw.gemm_seconds(flops, 0, false) / 0.894,
              1e-15);
  EXPECT_NEAR(capped.attention_seconds(flops, 8192, true),
              hw.attention_seconds(flops, 8192, true) / 0.894, 1e-15);
  EXPECT_DOUBLE_EQ(capped.achieved_flops(true), hw.achieved_flops(true) * 0.894);
  EXPECT_DOUBLE_EQ(capped.memory_seconds(1e9), hw.memory_seconds(1e9));
  // A memory-bound GEMM call is not slowed.
  EXPECT_DOUBLE_EQ(capped.gemm_seconds(1e9, 1e9, false), hw.gemm_seconds(1e9, 1e9, false));
  for (double bad : {0.0, -0.5, 1.2}) {
    capped.clock_ratio = bad;
    EXPECT_THROW(capped.validate(), baton::ConfigError) << bad;
  }
}

TEST(GemmRate, WaveQuantizationFromTheOutputShape) {
  // 108 SMs, 256x128 and 128x128 tiles (A100, NVIDIA's matrix-multiplication guide).
  baton::Hardware hw = physical();
  EXPECT_DOUBLE_EQ(hw.wave_fraction(2048, 4608), 1.0);  // off by default
  hw.sms = 108;
  hw.gemm_tiles = {{256, 128}};
  hw.validate();
  // 2048 x 4608: 8 x 36 = 288 tiles of 256x128 = 2.67 waves -> 3 waves, 8/9 useful.
  EXPECT_NEAR(hw.wave_fraction(2048, 4608), 288.0 / 324.0, 1e-12);
  // A whole number of waves (MAMF's best A100 shape: 54 x 64 = 3456 tiles = 32 waves).
  EXPECT_DOUBLE_EQ(hw.wave_fraction(6912, 16384), 1.0);
  // The better orientation: 2048 x 2304 as 8 x 18 = 144 tiles (2 waves, 0.667) or
  // 16 x 9 = 144 tiles as well; with 128x128 tiles added: 16 x 18 = 288 (3 waves, 0.889).
  EXPECT_NEAR(hw.wave_fraction(2048, 2304), 144.0 / 216.0, 1e-12);
  hw.gemm_tiles = {{256, 128}, {128, 128}};
  EXPECT_NEAR(hw.wave_fraction(2048, 2304), 288.0 / 324.0, 1e-12);
  // Tile quantization: a partial tile still costs a whole one.
  EXPECT_NEAR(hw.wave_fraction(100, 100), 100.0 * 100.0 / (128.0 * 128.0 * 108.0), 1e-12);
  // The rate of a call scales by the fraction; without a shape it does not.
  const double flops = 2.0 * 2048 * 4608 * 12288;
  baton::Hardware plain = physical();
  EXPECT_NEAR(hw.gemm_seconds(flops, 0, false, 2048, 4608),
              plain.gemm_seconds(flops, 0, false) / hw.wave_fraction(2048, 4608), 1e-15);
  EXPECT_DOUBLE_EQ(hw.gemm_seconds(flops, 0, false), plain.gemm_seconds(flops, 0, false));
  // A file with SMs but no tiles (or tiles without SMs) is refused.
  hw.gemm_tiles.clear();
  EXPECT_THROW(hw.validate(), baton::ConfigError);
  hw.sms = 0;
  hw.gemm_tiles = {{256, 0}};
  EXPECT_THROW(hw.validate(), baton::ConfigError);
}

TEST(GemmRate, MonotoneInSizeAndBoundedByTheMeasuredMaximum) {
  const baton::Hardware hw = physical();
  const double top = hw.gemm_bf16.max();
  EXPECT_DOUBLE_EQ(top, 8.0767101419194e14);  // b=2 4096^3, the table's largest measurement
  EXPECT_LE(top, 0.82 * hw.peak_bf16);        // below the datasheet peak: 0.817
  double prev = 0;
  for (double flops = 1e6; flops < 1e15; flops *= 1.37) {
    const double rate = hw.gemm_bf16.rate_at(flops);
    EXPECT_GE(rate, prev * (1 - 1e-12)) << flops;  // (within rounding)
    EXPECT_LE(rate, top * (1 + 1e-12)) << flops;
    prev = rate;
    // The seconds of a call never shrink as it grows.
    EXPECT_GE(hw.gemm_seconds(flops * 1.37, 0, false),
              hw.gemm_seconds(flops, 0, false) * (1 - 1e-12));
  }
  // Exact at a measured point; between two points the time is interpolated in log-log,
  // so at the geometric mean of two sizes the rate is the geometric mean of theirs.
  EXPECT_NEAR(hw.gemm_bf16.rate_at(2.147483648e9), 2.36298816901408e14, 1e3);
  const double mid = hw.gemm_bf16.rate_at(std::sqrt(2.147483648e9 * 1.7179869184e10));
  EXPECT_NEAR(mid, std::sqrt(2.36298816901408e14 * 6.3198459329017e14), 1e3);
  // Below the smallest measurement a call takes that measurement's time.
  EXPECT_DOUBLE_EQ(hw.gemm_seconds(1e6, 0, false), 3.3554432e7 / 6.452775384615e12);
  // A skinny call that moves more bytes than it computes runs at HBM speed.
  const double bytes = 1e9;
  EXPECT_DOUBLE_EQ(hw.gemm_seconds(1e9, bytes, false), bytes / (3.35e12 * 0.85));
  // A table above the peak is refused.
  baton::Hardware bad = hw;
  bad.gemm_bf16.points.back().second = 2e15;
  EXPECT_THROW(bad.validate(), baton::ConfigError);
}

TEST(Overlap, ExposedTimeIsWhatComputeCannotHide) {
  // Hand cases: comm 3 s behind 5 s of compute is hidden; 5 s behind 3 s leaves 2 s;
  // contention 0.1 adds a tenth of the overlapped part.
  EXPECT_DOUBLE_EQ(baton::overlap_exposed(3, 5, 0), 0);
  EXPECT_DOUBLE_EQ(baton::overlap_exposed(5, 3, 0), 2);
  EXPECT_DOUBLE_EQ(baton::overlap_exposed(3, 5, 0.1), 0.3);
  EXPECT_DOUBLE_EQ(baton::overlap_exposed(5, 3, 0.1), 2.3);
  EXPECT_DOUBLE_EQ(baton::overlap_exposed(0, 5, 0.1), 0);
  EXPECT_THROW(baton::overlap_exposed(-1, 1, 0), baton::ConfigError);
  EXPECT_THROW(baton::overlap_exposed(1, 1, 1.0), baton::ConfigError);
}

// One layer: a linear matmul (fp8-eligible) and a matmul of two activations.
baton::ModelProfile two_matmuls(double linear_flops_scale = 1) {
  baton::ModelProfile m;
  m.name = "two";
  m.seq = 4096;
  m.max_tp = 8;
  baton::ProfileSegment s;
  s.name = "layer";
  s.repeat = 4;
  s.params = 8192 * 8192;
  baton::MatmulShape lin;
  lin.m = 4096 * linear_flops_scale;
  lin.n = 8192;
  lin.k = 8192;
  lin.tp_dim = 1;
  baton::MatmulShape act = lin;
  act.linear = false;
  act.tp_dim = 0;
  s.matmuls = {lin, act};
  s.fwd_flops = 4.0 * 4096 * 8192 * 8192;
  s.bwd_flops = 2 * s.fwd_flops;
  s.wgrad_flops = s.fwd_flops / 2;
  s.act_bytes = 2 * 4096 * 8192;
  s.stash_keep = s.stash_min = s.stash_full = s.act_bytes;
  m.segments = {s};
  m.model_flops_per_sample = 3 * 4 * s.fwd_flops;
  return m;
}

TEST(Fp8, AppliesToLinearLayersOnly) {
  const baton::Hardware hw = physical();  // no fp8 table: bf16 rates x peak ratio
  baton::ClusterOptions o;
  o.gpus = 1;
  o.global_batch = 1;
  o.fp8_cast_bytes = 0;  // compare the matmuls alone
  const baton::ClusterDegrees d{1, 1, 1, 1, false};
  const baton::ModelProfile m = two_matmuls();
  const double flops = 2.0 * 4096 * 8192 * 8192;
  const double bf16_one = flops / hw.gemm_bf16.rate_at(flops);
  const double fp8_one = flops / (hw.gemm_bf16.rate_at(flops) * hw.peak_fp8 / hw.peak_bf16);
  const double f_bf16 = baton::cluster_segment_costs(m, hw, d, o, 1).costs.segments[0].f;
  o.fp8 = true;
  const double f_fp8 = baton::cluster_segment_costs(m, hw, d, o, 1).costs.segments[0].f;
  // Only the linear matmul got faster; the activation matmul is unchanged.
  EXPECT_NEAR(f_bf16, 2 * bf16_one, 1e-12);
  EXPECT_NEAR(f_fp8, bf16_one + fp8_one, 1e-12);
  // The casts cost HBM traffic: with them the fp8 layer is slower than without.
  o.fp8_cast_bytes = 3;
  const double f_cast = baton::cluster_segment_costs(m, hw, d, o, 1).costs.segments[0].f;
  const double cast_bytes = 3.0 * (4096.0 * 8192 + 8192.0 * 8192);
  EXPECT_NEAR(f_cast - f_fp8, cast_bytes / (hw.hbm_bandwidth * hw.hbm_efficiency), 1e-12);
}

// A uniform stack without shapes (every FLOP at one rate) on pp x dp with a
// non-zero link latency: GPipe's step is (M + p - 1)(F + B) plus the transfers
// of the last forward and the first backward along the pipeline (the others
// overlap compute), plus the data-parallel reduce-scatter + all-gather after
// the loop.
TEST(WholePlan, PipelineTimesDataParallelClosedForm) {
  baton::ModelProfile m;
  m.name = "uniform";
  m.seq = 1024;
  m.max_tp = 1;
  baton::ProfileSegment s;
  s.name = "layer";
  s.repeat = 4;
  s.params = 1 << 20;
  s.fwd_flops = 1e12;
  s.bwd_flops = 2e12;
  s.wgrad_flops = 1e12;
  s.act_bytes = 1 << 20;
  s.stash_keep = s.stash_min = s.stash_full = s.act_bytes;
  m.segments = {s};
  m.model_flops_per_sample = 3e12 * 4;
  baton::Hardware hw;
  hw.name = "closed-form";
  hw.gpus_per_node = 2;  // the data axis inside a node, the pipeline axis across nodes
  hw.peak_bf16 = 1e14;
  hw.hbm_bandwidth = 1e30;  // the optimizer's HBM time vanishes
  hw.hbm_bytes = int64_t{80} << 30;
  hw.intra = {1e11, 5e-6};
  hw.inter = {1e10, 2e-5};
  hw.efficiency = 0.5;
  baton::ClusterOptions o;
  o.gpus = 4;
  o.global_batch = 16;
  o.opt_bytes_per_param = 0;
  o.grad_extra_bytes_per_param = 0;
  const int p = 2, M = 8;
  const baton::ClusterDegrees d{p, 1, 2, 1, false};
  const baton::ClusterPlan plan =
      baton::evaluate_cluster(m, hw, d, o, "gpipe", 1, M, baton::Remat::Keep);
  const double mb = 16.0 / 2 / M;
  const double rate = 5e13;
  const double F = 2 * mb * 1e12 / rate, B = 2 * mb * 2e12 / rate;  // two layers per stage
  const double hop = (mb * (1 << 20)) / 1e10 + 2e-5;                  // one activation transfer
  // One reduce-scatter and one all-gather per layer (two layers per stage).
  const double params_layer = 1 << 20;
  const double rs = 2 * (0.5 * 4 * params_layer / 1e11 + 5e-6);  // 4-byte gradients over dp 2
  const double ag = 2 * (0.5 * 2 * params_layer / 1e11 + 5e-6);  // bf16 parameters back
  const double expect = (M + p - 1) * (F + B) + 2 * (p - 1) * hop + rs + ag;
  EXPECT_NEAR(plan.step_time, expect, 1e-9 * expect);
  // Its breakdown adds up to the step.
  const baton::TimeBreakdown& t = plan.time;
  EXPECT_NEAR(t.gemm + t.attention + t.memory + t.launch + t.recompute + t.tp_comm + t.ep_comm +
                  t.fsdp_comm + t.dp_comm + t.optimizer + t.bubble,
              plan.step_time, 1e-9 * plan.step_time);
  EXPECT_NEAR(t.dp_comm, rs + ag, 1e-12);
}

}  // namespace
