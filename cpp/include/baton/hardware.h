// Description of a GPU cluster for planning at scale (docs/SCALE.md): per-GPU
// peak FLOP/s, HBM bandwidth and capacity, and the bandwidth and latency of
// the link inside a node (NVLink/NVSwitch) and across nodes (InfiniBand/RoCE),
// each per GPU. Presets ship as JSON files with the Python package
// (python/baton/scale/clusters/*.json), each figure citing its source.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace baton {

// One link class, as seen by one GPU: unidirectional bandwidth in bytes/s
// (for NVSwitch: the per-GPU NVLink bandwidth; across nodes: the GPU's NIC)
// and the latency of one message or collective step in seconds.
struct LinkSpec {
  double bandwidth = 0;
  double latency = 0;
  bool operator==(const LinkSpec&) const = default;
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
  // The one fitted constant: achieved fraction of peak FLOP/s for the
  // model's compute (matmuls and what XLA fuses into them). 1.0 = peak.
  double efficiency = 1.0;
  // Bytes of HBM not available to the program (CUDA context, allocator
  // fragmentation, NCCL buffers): the plan's budget is hbm_bytes - reserved.
  int64_t reserved_bytes = 0;
  std::string efficiency_note;                // how `efficiency` was obtained
  std::map<std::string, std::string> sources;  // field -> where the figure comes from

  // Usable bytes per GPU (hbm_bytes - reserved_bytes).
  int64_t memory_budget() const { return hbm_bytes - reserved_bytes; }
  // FLOP/s a matmul reaches: peak (fp8 when `fp8` and peak_fp8 > 0) * efficiency.
  double achieved_flops(bool fp8 = false) const;

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
