// Description of a GPU cluster for planning at scale (docs/SCALE.md): per-GPU
// peak FLOP/s, HBM bandwidth and capacity, and the bandwidth and latency of
// the link inside a node (NVLink/NVSwitch) and across nodes (InfiniBand/RoCE),
// each per GPU. Presets ship as JSON files with the Python package
// (python/baton/scale/clusters/*.json), each figure citing its source.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace baton {

// One link class, as seen by one GPU: unidirectional bandwidth in bytes/s
// (for NVSwitch: the per-GPU NVLink bandwidth; across nodes: the GPU's NIC)
// and the latency of one message or collective step in seconds.
struct LinkSpec {
  double bandwidth = 0;
  double latency = 0;
  // What NCCL reaches on this link class (nccl-tests' "busbw" for large
  // messages), bytes/s; 0 = the link's `bandwidth`. Collectives use it: for a
  // ring, busbw is exactly the per-rank rate in (n-1)/n * bytes / B.
  double bus_bandwidth = 0;
  double collective_bandwidth() const { return bus_bandwidth > 0 ? bus_bandwidth : bandwidth; }
  bool operator==(const LinkSpec&) const = default;
};

// A measured table: points (x, y) with x increasing.
//  - at(x): y interpolated linearly in log x, the first point's y below it and
//    the last's above it, over the running maximum of the points (monotone).
//  - rate_at(x): for a throughput table (x = work per call, y = work per
//    second): x / time(x), where time is interpolated linearly in log-log
//    between the points' times x / y (y its running maximum), is the first
//    point's time below it (a call never takes less than the smallest measured
//    one: launch and tail) and x / the largest y above the last. Both the rate
//    and the time of a call are then non-decreasing in x (when no rate grows
//    faster than the work between two points), and the rate never exceeds the
//    largest measurement.
struct RateTable {
  std::vector<std::pair<double, double>> points;
  bool empty() const { return points.empty(); }
  double at(double x) const;
  double rate_at(double x) const;
  double max() const;
  bool operator==(const RateTable&) const = default;
};

// One fused-attention kernel: forward achieved fraction of peak_bf16 by sequence length
// (head dim 128, causal work counted) and the backward's rate relative to the forward's.
struct AttentionCurve {
  RateTable fwd;
  double bwd_ratio = 1.0;
  bool operator==(const AttentionCurve&) const = default;
};

struct Hardware {
  std::string name;
  int gpus_per_node = 8;
  double peak_bf16 = 0;      // dense bf16 FLOP/s per GPU
  double peak_fp8 = 0;       // dense fp8 FLOP/s per GPU (0: no fp8)
  double hbm_bandwidth = 0;  // bytes/s
  int64_t hbm_bytes = 0;     // capacity per GPU
  LinkSpec intra;            // inside a node
  LinkSpec inter;            // across nodes
  // Matmul rate by size (docs/SCALE.md, "Time from physical parts"): achieved
  // FLOP/s of one GEMM call as a function of its FLOPs, from public
  // measurements (cited in `sources`). fp8 empty: no fp8 table (fp8 runs use
  // the bf16 one scaled by peak_fp8 / peak_bf16).
  RateTable gemm_bf16, gemm_fp8;
  // Fused attention kernel: forward achieved fraction of peak_bf16 by
  // sequence length (head dim 128, causal work counted), and the backward's
  // rate relative to the forward's.
  RateTable attention_fwd;
  double attention_bwd_ratio = 1.0;
  // Other attention kernels a run may use instead, by name (ClusterOptions::
  // attention_kernel): e.g. "fa2", FlashAttention-2 as PyTorch's SDPA runs it.
  std::map<std::string, AttentionCurve> attention_kernels;
  // Fraction of hbm_bandwidth that memory-bound kernels reach.
  double hbm_efficiency = 1.0;
  // Seconds of launch and host work per non-matmul kernel.
  double kernel_overhead = 0;
  // Fraction of an overlapped collective's time that still slows the compute
  // it hides behind (the SMs NCCL's kernels occupy).
  double overlap_contention = 0;
  // Optional link between GPU and host memory (PCIe / C2C), per direction:
  // the copies of offloaded activations (ClusterOptions::offload).
  LinkSpec host_link;
  // Host memory per GPU that offloaded activations may hold (the node's
  // system memory / gpus_per_node); 0: unlimited.
  int64_t host_bytes = 0;
  // Sustained tensor-core clock of this card under its power limit over the
  // clock the gemm / attention measurements ran at (1.0: the same card and
  // limit). A power-capped part (an H100 SXM at 500 W instead of 700 W) runs
  // the same kernels at a lower clock; every compute rate scales with it, HBM
  // does not (its clock is separate). Cited in sources["clock_ratio"].
  double clock_ratio = 1.0;
  // Wave quantization of a GEMM call (optional; sms 0 = off): a call whose
  // output is tiled into tm x tn thread-block tiles, one tile per SM at a time
  // on `sms` SMs, runs ceil(tiles / sms) full waves; its useful fraction is
  // m n / (tm tn sms ceil(tiles / sms)), and the library is taken to pick the
  // best of `gemm_tiles` (each in both orientations). It scales the call's FLOP
  // rate. For a file whose gemm table is a best-shape (quantization-free) rate,
  // e.g. A100's maximum-achievable figure; tables measured at the shapes
  // themselves carry their quantization already.
  int sms = 0;
  std::vector<std::pair<double, double>> gemm_tiles;
  // Multiplier of every modelled compute rate; 1.0 = the cited measurements.
  // baton.scale.calibrate() fits it to a user's measured steps. Without a
  // gemm_bf16 table it is the achieved fraction of peak for all compute.
  double efficiency = 1.0;
  // Bytes of HBM not available to the program (CUDA context, allocator
  // fragmentation, NCCL buffers): the plan's budget is hbm_bytes - reserved.
  int64_t reserved_bytes = 0;
  std::string efficiency_note;                // how `efficiency` was obtained
  std::map<std::string, std::string> sources;  // field -> where the figure comes from

  // Multiplier of the measured compute rates: efficiency * clock_ratio.
  double compute_scale() const { return efficiency * clock_ratio; }
  // Usable bytes per GPU (hbm_bytes - reserved_bytes).
  int64_t memory_budget() const { return hbm_bytes - reserved_bytes; }
  // FLOP/s a matmul reaches: peak (fp8 when `fp8` and peak_fp8 > 0) * efficiency.
  // With a gemm table: the table's largest measured rate * efficiency.
  double achieved_flops(bool fp8 = false) const;
  // Seconds of one GEMM call of `flops` FLOPs moving `bytes` through HBM:
  // max(flops / table rate, bytes / (hbm_bandwidth * hbm_efficiency)).
  // With the output's rows x cols (and `calls` of them batched) and wave
  // quantization configured, the rate is scaled by wave_fraction().
  double gemm_seconds(double flops, double bytes, bool fp8, double rows = 0, double cols = 0,
                      double calls = 1) const;
  // The useful fraction of the SM waves an output of rows x cols (x calls)
  // occupies; 1 without wave quantization or without a shape.
  double wave_fraction(double rows, double cols, double calls = 1) const;
  // The attention curve of the named `kernel` of attention_kernels, or the
  // default one (attention_fwd, attention_bwd_ratio) for an empty name;
  // ConfigError naming the kernel when the file has none such.
  AttentionCurve attention_curve(const std::string& kernel) const;
  // Seconds of `flops` fused-attention FLOPs (forward, or backward when `bwd`)
  // at sequence length `seq`, by attention_curve(kernel).
  double attention_seconds(double flops, double seq, bool bwd,
                           const std::string& kernel = "") const;
  // Seconds of memory-bound work moving `bytes`.
  double memory_seconds(double bytes) const;

  // Throws ConfigError naming the field ("intra.bandwidth").
  void validate() const;
  // JSON: {"name": "...", "gpus_per_node": 8, "peak_bf16": 9.89e14, "peak_fp8":
  // ..., "hbm_bandwidth": ..., "hbm_bytes": ..., "reserved_bytes": ..., "intra":
  // {"bandwidth": ..., "latency": ...}, "inter": {...}, "efficiency": 0.5,
  // "efficiency_note": "...", "sources": {"peak_bf16": "url", ...}}.
  // Required: gpus_per_node, peak_bf16, hbm_bandwidth, hbm_bytes, intra, inter.
  // Throws FormatError on malformed JSON, unknown keys and wrong types
  // (naming the key path, e.g. 'intra.bandwidth'), then validate()s.
  // from_json(to_json(h)) == h.
  static Hardware from_json(const std::string& text);
  std::string to_json() const;
  bool operator==(const Hardware&) const = default;
};

}  // namespace baton
