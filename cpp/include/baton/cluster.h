// Planning a training run at cluster scale (docs/SCALE.md): an abstract
// model profile (per segment FLOPs, bytes, parameters, activations per
// sample, traced without allocating anything) and a hardware description
// give, for every pipeline x tensor x data (ZeRO-1 or FSDP) x expert degree
// tuple, the SegmentCosts of one pipeline replica; the same autoplan search
// that plans CPU runs then chooses cuts, schedule, microbatches and remat.
//
// Cost of one segment (docs/SCALE.md, "Time from physical parts", "Communication as
// runs overlap it", "Memory"; per microbatch of mb samples, t = TP, e = EP, d = data-
// parallel replicas):
//   compute      each forward matmul at the hardware file's GEMM rate for its size
//                (max with its HBM bytes), attention at the fused-kernel rate (causal
//                work halved), memory-bound bytes at HBM speed, kernel launches; the
//                backward twice the matmuls, 2.5x the attention FLOPs, twice the bytes;
//                fp8 only on linear layers, with their casts.
//   TP           sequence-parallel all-gather + reduce-scatter per collective point,
//                exposed, or hidden behind the pass's GEMMs with tp_overlap.
//   EP           all-to-alls, exposed; DualPipeV's fused F&B hides them (fused_factor).
//   FSDP         per microbatch gathers and scatters, prefetched under compute.
//   ZeRO-1       per step: reduce-scatter of the gradients (grad_reduce_bytes) and
//                all-gather of the parameters; with dp_overlap behind the last backward
//                and the next forward, the last bucket exposed (step_overhead).
//   memory       params 2 B, grads 2 B, optimizer 12 B / z + 2 B, stash per remat mode.
//   p2p          activations over the pipeline link, asynchronous.
//   offload      a plan over the memory budget may offload its ranks' stashes to host
//                memory over host_link (AutoplanOptions::offload): simulated as the rank
//                program with its copies, fetches the compute does not hide in the bubble.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "baton/autoplan.h"
#include "baton/hardware.h"

namespace baton {

// One forward matmul of a segment, per sample: `count` calls of an
// (m x k) @ (k x n) product; m is the rows per sample (tokens, or tokens per
// expert for expert matmuls). `linear`: one operand is a parameter (a linear
// layer: fp8 applies, its weight gradient is W work). `tp_dim`: the dimension
// tensor parallelism shards (0 none, 1 n: column-parallel, 2 k: row-parallel).
// `expert`: one of the experts' matmuls (count = experts; expert parallelism
// puts count / ep of them on a GPU, each with ep times the rows).
struct MatmulShape {
  double m = 0;
  int64_t n = 0, k = 0;
  int count = 1;
  bool linear = true;
  int tp_dim = 0;
  bool expert = false;
  // Index of the first matmul of the segment that reads the same activation (q, k and v;
  // an MLP's gate and up): a split backward keeps that input for the weight gradients
  // once. -1: its own input.
  int input = -1;
  bool operator==(const MatmulShape&) const = default;
};

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
  int64_t a2a_bytes = 0;           // bytes of each (before TP sharding), bf16
  int a2a_top_k = 0;               // experts each token goes to (0: not given; the
                                   // node limit of ClusterOptions then does not apply)
  // Physical parts (docs/SCALE.md, "Time from physical parts"); a profile
  // without `matmuls` is costed from fwd_flops at the largest GEMM rate.
  std::vector<MatmulShape> matmuls;  // forward matmuls outside attention's core
  double attn_flops = 0;             // attention core forward FLOPs (QK^T, PV; full square)
  double attn_scores = 0;            // elements of its score matrices (heads x seq x seq)
  bool attn_causal = true;           // causal masking: half of attn_flops is done
  double mem_bytes = 0;              // HBM bytes of the forward's memory-bound work
  double mem_bytes_replicated = 0;   // the part of mem_bytes outside the TP regions (norms,
                                     // residual adds): split over TP ranks only under
                                     // sequence parallelism (ClusterOptions)
  int kernels = 0;                   // forward non-matmul kernels per instance
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
  // Overlap settings of the plan (searched like the degrees):
  bool tp_overlap = false;  // sequence-parallel all-gather / reduce-scatter split against the GEMMs
  bool dp_overlap = false;  // bucketed gradient reduce-scatter in the backward, parameter
                            // all-gather in the next forward (ZeRO-1)
  bool operator==(const ClusterDegrees&) const = default;
};

struct ClusterOptions {
  int gpus = 8;
  int64_t global_batch = 1;  // sequences per step
  bool fp8 = false;          // linear layers at the fp8 GEMM rates, casts counted
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
  int tp_overlap = -1;  // -1 search both, 0 off, 1 on
  int dp_overlap = -1;
  double grad_reduce_bytes = 4;   // bytes per gradient element in the data-parallel reduction
  double bucket_params = 40e6;    // gradient bucket (Megatron's default: 40M parameters)
  // fp8 recipe: bytes moved per element cast to fp8 (read bf16 + write fp8),
  // for inputs, weights and output gradients of every fp8 linear layer.
  double fp8_cast_bytes = 3;
  // Expert all-to-alls (docs/SCALE.md, "Communication as runs overlap it"). Of each pass's
  // two all-to-alls (forward: dispatch, combine; backward: the combine's gradient sent the
  // dispatch way, the dispatch's gradient sent the combine way) the dispatch-way one moves
  // `dispatch_bytes` per element (2: bf16; DeepSeek-V3's fp8 with one fp32 scale per 1x128
  // tile: 1 + 4/128), the other bf16.
  double dispatch_bytes = 2;
  // Bytes per element of the activations kept from F to B (2: bf16). DeepSeek-V3 caches
  // them in fp8 with one fp32 scale per 1x128 tile (report sec. 3.3.3: the linear layers'
  // inputs and the MoE SwiGLU's input): 1 + 4/128. Every stash (keep, min, full) scales
  // by stash_bytes / 2.
  double stash_bytes = 2;
  // Node-limited routing (DeepSeek-V3 report sec. 2.1.2 / 3.2.2): when > 0 and the expert
  // group spans nodes, each token crosses the inter-node link once per target node, to at
  // most this many nodes, and is forwarded to its top_k experts over the intra-node link;
  // the two run at once (the time is the larger). 0: every copy goes directly to its
  // expert's GPU over the expert axis's link (an all-to-all over all ep ranks).
  int ep_node_limit = 0;
  // Fused (flash) attention; false: the score matrices go through HBM (two batched GEMMs
  // and a fused scale-mask-softmax + dropout moving 13 bytes per score in the forward,
  // twice that in the backward), as Megatron-LM did before FlashAttention (2022).
  bool flash_attention = true;
  // The fused attention kernel by name among the hardware file's attention_kernels ("fa2":
  // FlashAttention-2, PyTorch SDPA's flash backend); empty: the file's default curve.
  std::string attention_kernel;
  // Megatron's sequence parallelism (Korthikanti et al. 2022): the norms and residual adds
  // outside the TP regions are split over the TP ranks. false: each TP rank runs them on
  // the whole s x h activation (Megatron-LM before 2022), mem_bytes_replicated not split.
  bool sequence_parallel = true;
  // Activation offload (AutoplanOptions::offload) over the hardware's host_link: -1 searched
  // when the hardware file has one, 0 never, 1 searched (refused without a host link).
  int offload = -1;
  int32_t fetch_lookahead = 1;  // RUNs a fetch runs ahead of its read (RankIROptions)
  // The optimizer writes the new parameters and its state over the old ones (PyTorch's and
  // Megatron's optimizers, optax under baton.jit(donate_argnums=...)): a rank's peak is its
  // static bytes plus the loop's. false: the update's new copies exist beside the old ones
  // (AutoplanOptions::update_in_place), as in a step that donates nothing.
  bool update_in_place = true;
};

// Where the predicted time of one step goes, on the average pipeline rank
// (seconds per step; sums over its microbatches), and the bubble.
struct TimeBreakdown {
  double gemm = 0, attention = 0, memory = 0, launch = 0;  // compute by kind, F + B
  double recompute = 0;     // extra backward work the plan's remat adds
  double tp_comm = 0;       // exposed TP collectives (incl. contention under overlap)
  double ep_comm = 0;       // exposed expert all-to-alls
  double fsdp_comm = 0;     // exposed FSDP gathers / scatters
  double dp_comm = 0;       // exposed data-parallel reduction (+ its tail bucket)
  double optimizer = 0;     // optimizer update at HBM speed
  double bubble = 0;        // step time not covered by the above on that rank
};

// Per-GPU bytes of the rank holding the largest peak, by component.
// `host`: the bytes that rank holds in host memory at once (offloaded stashes).
struct MemoryBreakdown {
  int64_t params = 0, grads = 0, optimizer = 0, activations = 0, total = 0;
  int64_t host = 0;
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
  TimeBreakdown time;
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
  // Per microbatch over all segments (F + B) and per step, for the breakdown.
  TimeBreakdown per_microbatch, per_step;
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
