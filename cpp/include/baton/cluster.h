// Planning a training run at cluster scale (docs/SCALE.md): an abstract
// model profile (per segment FLOPs, bytes, parameters, activations per
// sample, traced without allocating anything) and a hardware description
// give, for every pipeline x tensor x data (ZeRO-1 or FSDP) x expert degree
// tuple, the SegmentCosts of one pipeline replica; the same autoplan search
// that plans CPU runs then chooses cuts, schedule, microbatches and remat.
//
// Sharding model of one segment (per sample of `seq` tokens, counts from the
// profile; t = TP, e = EP, d = data-parallel replicas, z = the degree the
// optimizer state (ZeRO-1) or everything (FSDP) is sharded over):
//   compute      (fwd_flops / t) / achieved_flops   (bwd likewise)
//   TP           tp_collectives all-reduces of tp_bytes per sample in F and
//                as many in B (Megatron: 2 + 2 per layer), ring/tree over the
//                TP axis; not overlapped with compute.
//   EP           a2a_collectives all-to-alls of a2a_bytes / t per sample in F
//                and as many in B, over the EP axis; not overlapped.
//   FSDP         per microbatch: all-gather of the segment's parameters in F,
//                all-gather + reduce-scatter in B, over the data axis,
//                overlapped with compute (a task lasts max(compute, FSDP)).
//   params       dense / t + expert / (t e) parameters, 2 bytes each (bf16),
//                / d under FSDP (experts / (d / e)).
//   grads        as many bytes as params (autoplan's gradient accumulator).
//   optimizer    opt_bytes_per_param (fp32 master + Adam m, v: 12) / z, plus
//                grad_extra_bytes_per_param (fp32 main gradients: 2) unsharded.
//   activations  stash_{keep,min,full} / t per sample (sequence parallel),
//                wstash = stash_keep / t, temp = temp_bytes / t per sample
//                (+ the gathered parameters and gradients under FSDP).
//   update       once per step: the data-parallel gradient reduction of the
//                segment's gradients (ZeRO-1: reduce-scatter + all-gather =
//                one all-reduce's bytes; FSDP: none, its reduce-scatters run
//                per microbatch) + reading and writing params, grads and
//                optimizer state at HBM bandwidth.
//   p2p          stage-to-stage activations act_bytes / t per sample over the
//                pipeline axis link.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "baton/autoplan.h"
#include "baton/hardware.h"

namespace baton {

// One segment kind of the model, per sample (one sequence of `seq` tokens),
// unsharded. Repeated `repeat` times in a row.
struct ProfileSegment {
  std::string name;
  int repeat = 1;
  double fwd_flops = 0;            // hardware FLOPs of the forward
  double bwd_flops = 0;            // hardware FLOPs of the backward (incl. recompute inside)
  double wgrad_flops = 0;          // of bwd_flops: the weight-gradient part (W of a split B)
  double hbm_bytes = 0;            // bytes read + written by the forward's matmuls
  int64_t params = 0;              // parameters (count)
  int64_t expert_params = 0;       // of params: sharded over the expert axis
  int64_t act_bytes = 0;           // output activation
  int64_t stash_keep = 0;          // residuals F -> B, keeping everything
  int64_t stash_min = 0;           // residuals with only matmul outputs saved ...
  double min_recompute_flops = 0;  // ... and the FLOPs recomputing the rest costs
  int64_t stash_full = 0;          // the segment's input only
  int64_t temp_bytes = 0;          // largest transient
  int tp_collectives = 0;          // TP all-reduces in F (as many in B)
  int64_t tp_bytes = 0;            // bytes of each
  int a2a_collectives = 0;         // expert all-to-alls in F (as many in B)
  int64_t a2a_bytes = 0;           // bytes of each (before TP sharding)
  bool operator==(const ProfileSegment&) const = default;
};

struct ModelProfile {
  std::string name;
  int64_t seq = 1;
  double model_flops_per_sample = 0;  // training FLOPs of the model definition (MFU numerator)
  int max_tp = 8;                     // TP must divide this (heads, KV heads)
  int num_experts = 0;                // EP must divide this (0: dense)
  std::vector<ProfileSegment> segments;

  int64_t total_params() const;
  int num_layers() const;  // sum of repeats
  // Throws ConfigError naming the field ("segments[2].fwd_flops").
  void validate() const;
  // JSON with the same field names; FormatError names the key path.
  static ModelProfile from_json(const std::string& text);
  std::string to_json() const;
};

// Degrees of one candidate: gpus = pp * tp * dp; the expert axis lies inside
// the data axis (ep divides dp).
struct ClusterDegrees {
  int pp = 1, tp = 1, dp = 1, ep = 1;
  bool fsdp = false;  // false: ZeRO-1 (optimizer state sharded over dp)
  bool operator==(const ClusterDegrees&) const = default;
};

struct ClusterOptions {
  int gpus = 8;
  int64_t global_batch = 1;  // sequences per step
  bool fp8 = false;          // matmuls at peak_fp8
  double opt_bytes_per_param = 12;
  double grad_extra_bytes_per_param = 2;
  // Pipeline segments: layers are grouped into about this many segments
  // (never fewer than vmax * pp + 2, vmax the largest interleaved_v, so that
  // interleaving has stages to place).
  int max_segments = 24;
  int max_microbatch_choices = 1;  // largest microbatch counts tried per degree tuple
  int max_microbatches = 256;
  std::vector<std::string> families;  // empty: all of Baton's schedules
  std::vector<int> pp_choices, tp_choices;  // empty: all valid
  std::vector<int> ep_choices;
  int fsdp_mode = -1;  // -1 both, 0 ZeRO-1 only, 1 FSDP only
  int top = 10;
  double gap = 0.02;         // autoplan's relative gap per call
  int64_t node_budget = 500;  // autoplan's per-configuration budget
  std::vector<int> interleaved_v = {2, 4};  // virtual stages tried by the interleaved schedule
};

// Per-GPU bytes of the rank holding the largest peak, by component.
struct MemoryBreakdown {
  int64_t params = 0, grads = 0, optimizer = 0, activations = 0, total = 0;
};

struct ClusterPlan {
  ClusterDegrees degrees;
  PlanCandidate plan;      // over the segments of cluster_segment_costs
  std::vector<std::string> segment_names;
  std::vector<int> segment_layers;  // layers in each segment
  double step_time = 0;
  double tokens_per_second = 0;
  double mfu = 0;  // model_flops_per_sample * global_batch / step_time / (gpus * peak_bf16)
  double tflops_per_gpu = 0;  // model FLOPs / step_time / gpus / 1e12
  MemoryBreakdown memory;
};

struct ClusterSearchStats {
  int64_t degree_tuples = 0;  // tuples enumerated
  int64_t skipped_memory = 0;  // rejected by the static-memory bound
  int64_t searched = 0;        // autoplan calls
  int64_t infeasible = 0;      // autoplan found nothing that fits
  double seconds = 0;
};

struct ClusterResult {
  std::vector<ClusterPlan> plans;  // fastest first
  ClusterSearchStats stats;
  std::string to_json() const;
};

// The segments (and their layer counts) a pipeline of `pp` stages plans over.
struct ClusterSegments {
  SegmentCosts costs;
  std::vector<std::string> names;
  std::vector<int> layers;
};
// SegmentCosts of one pipeline replica at `microbatches` microbatches
// (batch = global_batch / dp, ref_microbatch = batch / microbatches).
// Throws ConfigError when the degrees do not fit the GPU count or the batch.
ClusterSegments cluster_segment_costs(const ModelProfile& model, const Hardware& hw,
                                      const ClusterDegrees& d, const ClusterOptions& o,
                                      int microbatches);

// Evaluates one given configuration (the published one): stages cut with
// layers spread as evenly as possible (the embedding with the first layer,
// the head with the last), every stage at `remat`.
ClusterPlan evaluate_cluster(const ModelProfile& model, const Hardware& hw,
                             const ClusterDegrees& d, const ClusterOptions& o,
                             const std::string& schedule, int virtual_stages, int microbatches,
                             Remat remat);

// Searches degrees x autoplan. Every (degree tuple, microbatch count) gets a
// lower bound on its step time (the average rank's F + min(B, I + W) times M
// plus its update seconds: every schedule runs each task once and remat only
// adds time); they are searched by increasing bound and the search stops once
// the bound reaches the top-th best tuple's step time, so no skipped tuple
// could enter the table (each row within the autoplan gap of its tuple's
// optimum over the coarsened segments). Throws ConfigError when nothing fits.
ClusterResult plan_cluster(const ModelProfile& model, const Hardware& hw, const ClusterOptions& o);

// Ranked table for the CLI.
std::string cluster_table(const ClusterResult& r, const Hardware& hw);

}  // namespace baton
