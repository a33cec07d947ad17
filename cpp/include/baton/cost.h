// Cost and memory model used by the simulator. Times are in arbitrary but
// consistent units (seconds when profiled); bytes are bytes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "baton/schedule.h"

namespace baton {

struct StageCost {
  double f = 1.0;            // forward time
  double b = 2.0;            // full backward time
  double i = 1.0;            // input-gradient backward time
  double w = 1.0;            // weight-gradient backward time
  int64_t stash_bytes = 1;   // kept from F to B/I (per microbatch)
  int64_t wstash_bytes = 0;  // kept from I to W (per microbatch)
  int64_t act_bytes = 1;     // activation sent forward (per microbatch)
  int64_t grad_bytes = 1;    // input gradient sent backward (per microbatch)
  int64_t wgrad_bytes = 0;   // weight gradient produced per microbatch
  // F and B of one microbatch fused into one action (fuse_forward_backward):
  // its time when > 0, else fused_factor * (f + b).
  double fb = 0.0;
  bool operator==(const StageCost&) const = default;
};

// The time of one task of kind k at stage costs c (c.f, c.b, c.i or c.w).
inline double task_time(const StageCost& c, TaskKind k) {
  switch (k) {
    case TaskKind::F:
      return c.f;
    case TaskKind::B:
      return c.b;
    case TaskKind::I:
      return c.i;
    case TaskKind::W:
      return c.w;
  }
  return 0;
}

struct LinkCost {
  double latency = 0.0;    // per message
  double bandwidth = 0.0;  // bytes per time unit; 0 means infinite
  bool operator==(const LinkCost&) const = default;
};

// Bytes per microbatch of a skip edge's transfers (plan.h: Skip / SkipGrad).
struct SkipCost {
  int32_t from = -1, to = -1;
  int64_t act_bytes = 0;   // values of stage `from` sent to stage `to`
  int64_t grad_bytes = 0;  // their cotangent contributions sent back
  bool operator==(const SkipCost&) const = default;
};

struct CostModel {
  StageCost default_stage;        // used for stages not listed
  std::vector<StageCost> stages;  // per stage overrides (may be empty)
  std::vector<SkipCost> skips;    // per skip edge (an edge not listed: 0 bytes)
  LinkCost link;                  // every rank pair
  // Each rank's device <-> host copies (a rank program's OFFLOAD / FETCH,
  // rank_program.h): bytes per time unit in each direction (one copy engine
  // per direction); 0 (the default) means instant.
  double host_link_bandwidth = 0.0;
  // Fused actions (DualPipe F&B) take fused_factor * (sum of both tasks);
  // 1.0 means no compute overlap inside the fused pair.
  double fused_factor = 1.0;

  // stages[s] when listed, default_stage otherwise.
  const StageCost& stage(int s) const;
  // The entry of edge from -> to, or a zero-byte one.
  const SkipCost& skip(int from, int to) const;
  // Validates (times and bytes non-negative, finite; fused_factor > 0);
  // throws ConfigError naming the field, e.g. "stages[3].f".
  void validate() const;
  // JSON: {"default": {...}, "stages": [{...}, ...], "link": {"latency": x,
  // "bandwidth": y}, "host_link_bandwidth": h, "fused_factor": z, "skips": [{"from": i, "to": j,
  // "act_bytes": a, "grad_bytes": g}, ...]}; every field optional. A stage entry
  // starts from "default" and overrides only the keys it names. Throws
  // FormatError on malformed JSON ("line L, column C: ..."), unknown keys and
  // wrong types (naming the key path, e.g. 'stages[2].f'); the parsed model
  // is then validate()d (ConfigError). to_json writes every field, and
  // from_json(to_json(c)) == c.
  static CostModel from_json(const std::string& text);
  std::string to_json() const;
  // Uniform stage costs (handy for tests).
  static CostModel uniform(double f, double b, double i, double w);
  bool operator==(const CostModel&) const = default;
};

}  // namespace baton
