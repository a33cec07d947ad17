// Automatic pipeline planning: choose stage boundaries, schedule family,
// microbatch count and per-stage rematerialisation from measured segment
// costs, minimising the simulated step time under a per-rank memory budget.
//
// Inputs are *segments*: the pieces of a model between consecutive candidate
// cut points. A stage is a contiguous, non-empty run of segments.
//
// Search space (per call): schedule family x virtual stages v (interleaved:
// the values of AutoplanOptions::interleaved_v; ZB-V and DualPipeV: 2) x
// microbatch count M (dividing `batch`) x contiguous partition of the
// segments into ranks*v stages x a remat mode per stage. A generator that
// refuses a (family, ranks, M, v) drops that configuration. The candidate's
// step time is simulate(lower(schedule), stage_cost_model(...)).step_time
// plus update_time(...) (the optimizer update after the loop: the slowest
// rank's sum of its segments' `update` seconds; 0 when costs give none) plus
// step_overhead;
// its peak memory on rank r is the static bytes of its stages (params +
// optimizer state + gradient accumulator) + the larger of the loop's part,
// the largest transient of its stages (stage_temp_bytes: XLA temporaries and
// the new gradient sums a task writes while the old ones are held) +
// simulate(...).peak_total[r], and the update's part (stage_update_bytes
// summed over its stages: new parameters and optimizer state beside the old;
// 0 with update_in_place). It fits when every rank's peak <= budget (budget
// 0: unlimited).
//
// Method (exact on that space). For each configuration (family, v, M) the
// schedule is generated and lowered once. Candidates are then searched by
// depth-first branch and bound over the cut points (stage 0 first), and at
// each complete partition over the remat modes, against a threshold T (the
// best feasible step time of this configuration found so far, or the K-th
// best of the other configurations when the result holds K rows, whichever
// is smaller; configurations are visited in increasing order of a cheap lower
// bound, after seeding each with the min-max-busy partition). A node is
// pruned when a lower bound >= T, so what is pruned cannot beat what is kept,
// and every remaining leaf is simulated: the best row is the minimum over all
// feasible candidates (tested against brute force in test_plan_autoplan.cc).
//
// Bounds on the step time and why each is valid (all times on the simulated
// plan; every task/transfer duration is >= 0):
//  (B1) busy: the step time is >= the time rank r spends in RUN, which is
//       exactly sum over its actions of the action's duration: a linear
//       function sum_s cf_s*f_s + cb_s*b_s + ci_s*i_s + cw_s*w_s over the
//       stages s on r, the coefficients counted from the schedule (a fused
//       action contributes fused_factor to each of its tasks).
//  (B2) fill/drain: the first action on rank r is an F of one of its stages
//       s, which needs F(0..s-1) of the same microbatch and the transfers
//       between them first: head(s) = sum_{s'<s} c*f_{s'} + hops, where c =
//       min(1, fused_factor) if the schedule fuses actions (a fused action
//       lasts fused_factor*(t1+t2) >= c*t of each of its tasks), else 1, and
//       a hop (latency + bytes/bandwidth) is counted where consecutive
//       stages are on different ranks. In a schedule without I/W the last
//       action on r is a backward of some stage s on r, after which
//       B(s-1..0) of that microbatch still run: tail(s) = sum_{s'<s} c*b_{s'}
//       + hops. head and tail grow with s, so using r's lowest stage is
//       valid: step >= head + busy_r + tail.
//  (B3) rank relaxation (at a complete partition and remat vector): rank
//       r's actions in order, each starting at max(previous end, release),
//       where the release of F(s,m) is head(s), of B/I(s,m) the end of
//       F(s,m) on r plus the single-microbatch chain F(s+1..S-1),
//       B/I(S-1..s+1) with hops (each element >= c times its cost; other
//       ranks' contention and r's own other tasks in that chain ignored),
//       W none; step >= end of each B/I + tail. The real simulation only
//       adds waiting (link FIFO, late receives, contention), so every start
//       is >= the relaxed start. This bound is usually within a few percent.
//  (B4) partition feasibility (at a partial partition): each remaining stage
//       alone needs busy < T (B1 for one stage), so the remaining segments
//       must be coverable by the remaining stages greedily taking the
//       longest prefix with busy < T and static+temp bytes <= budget; the
//       greedy is exact for "every part's cost < T" because a part's cost
//       grows with the part.
//  (B5) remat monotonicity: remat only adds time to b and i, and the
//       simulation is a max-plus system with fixed per-rank order and fixed
//       per-link FIFO order, so step times are monotone in task durations.
//       Hence the all-keep bound is a bound for every remat vector of the
//       partition, and once a remat vector fits, every vector that is
//       componentwise at least as slow is pruned.
// Bounds on memory (static and temp bytes are exact; pipeline buffers by a
// structural bound): for each action k on rank r with positive duration,
// the stash (F..B/I) and wstash (I..W) buffers produced by an action <= k
// and consumed by an action >= k (not inside one fused action), and action
// k's own act/grad inputs and outputs and weight gradient, are all live
// during RUN k (inputs are present before it starts, outputs are allocated
// at its start, and everything is freed at or after its consumer's end), so
// peak_total[r] >= their bytes. With the remat mode of
// least stash bytes for every stage this prunes partitions; with the chosen
// modes it prunes remat vectors.
//
// Every returned plan is verified (verify(), both communication models).
#pragma once
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "baton/cost.h"
#include "baton/rank_program.h"
#include "baton/schedule.h"

namespace baton {

// Rematerialisation of one stage.
//   Keep: stash every residual (stash = sum stash_bytes).
//   Min:  stash the minimum-bytes set (sum min_stash_bytes); b and i +=
//         sum min_recompute.
//   Full: stash only the stage's input activation (or, when every segment
//         gives full_stash_bytes, their sum: each layer's input); b and i += f.
enum class Remat : uint8_t { Keep = 0, Min = 1, Full = 2 };
const char* remat_name(Remat r);           // "keep", "min", "full"
Remat parse_remat(std::string_view name);  // throws ConfigError

// Costs of one segment at the reference microbatch size (seconds, bytes).
struct SegmentCost {
  std::string name;             // optional
  double f = 0, b = 0;          // forward, full backward
  double i = 0, w = 0;          // input-grad / weight-grad backward (JSON default: i = b, w = 0)
  double overhead = 0;          // fixed seconds per task that do not scale with the microbatch
  double update = 0;            // seconds per step outside the microbatch loop (its optimizer
                                // update), independent of the microbatch count
  double update_comm = 0;       // the part of `update` that is overlapped data-parallel
                                // communication (ZeRO's gradient reduce-scatter) left after
                                // its own segment's last backward: the last backwards of
                                // shallower stages on the rank hide it (update_time)
  int64_t act_bytes = 0;        // output sent forward if a cut follows (the gradient has as many)
  int64_t stash_bytes = 0;      // residuals kept F->B (keep-all)
  int64_t min_stash_bytes = 0;  // minimum-bytes stash ...
  double min_recompute = 0;     // ... and the extra backward seconds it costs
  int64_t wstash_bytes = 0;     // kept I->W
  // Residuals under full remat when each layer is checkpointed on its own (Megatron's and
  // torchtitan's full recomputation, baton.scale's checkpoint_stages): every layer's input.
  // < 0: the stage is checkpointed as a whole and keeps only its input.
  int64_t full_stash_bytes = -1;
  int64_t param_bytes = 0;
  int64_t opt_bytes = 0;   // optimizer state
  int64_t temp_bytes = 0;  // XLA temporaries of its tasks
  // Bytes the backward of one checkpointed unit rematerializes at once under min / full
  // remat (its recomputed residuals beyond what the remat keeps), held while that unit's
  // backward runs: the stage's temporaries grow by the largest (stage_transient_bytes).
  // 0: none beyond temp_bytes (traced costs measure their tasks' temporaries whole).
  int64_t min_transient_bytes = 0, full_transient_bytes = 0;
  bool operator==(const SegmentCost&) const = default;
};

struct SegmentCosts {
  int64_t batch = 1;           // samples per step
  int64_t ref_microbatch = 1;  // samples per microbatch at which costs were measured
  LinkCost link;
  double fused_factor = 1.0;
  // Seconds of every task that merging segments into one stage saves (a
  // task's own dispatch and bookkeeping, which each segment's times include
  // once because they were measured as separate tasks): a stage of n
  // segments costs the sum of their times minus (n - 1) * task_overhead, for
  // each task kind clamped to the smallest time of that kind (tasks_saved()),
  // so adding a segment never makes a stage cheaper.
  double task_overhead = 0;
  // Seconds of every step outside the loop that no rank's stages account for
  // (the step's own dispatch, exchanges between processes): added to every
  // candidate's step time, so it changes predictions, never the ranking.
  double step_overhead = 0;
  // Each rank's copies between device and host memory (activation offload):
  // bytes per time unit in each direction, one copy engine per direction;
  // 0: unknown (autoplan with offload refuses it).
  double host_link_bandwidth = 0;
  std::vector<SegmentCost> segments;

  // task_overhead clamped per kind (f, b, i, w) to the smallest segment time
  // of that kind.
  std::array<double, 4> tasks_saved() const;

  // Throws ConfigError naming the field ("segments[3].f", "batch").
  void validate() const;
  // JSON: {"batch": 64, "ref_microbatch": 8, "link": {"latency": x,
  // "bandwidth": y}, "fused_factor": 1.0, "segments": [{"name": "emb", "f":
  // ..., "b": ..., "i": ..., "w": ..., "overhead": ..., "act_bytes": ...,
  // "stash_bytes": ..., "min_stash_bytes": ..., "min_recompute": ...,
  // "wstash_bytes": ..., "param_bytes": ..., "opt_bytes": ..., "temp_bytes":
  // ...}, ...], "host_link_bandwidth": h}. "segments" is required; every other key is optional (i
  // defaults to b; everything else to 0, batch and ref_microbatch to 1,
  // fused_factor to 1). Throws FormatError on malformed JSON ("line L,
  // column C: ..."), unknown keys and wrong types (naming the key path, e.g.
  // 'segments[3].f'), then validate()s. from_json(to_json(c)) == c.
  static SegmentCosts from_json(const std::string& text);
  std::string to_json() const;

  // The costs at M microbatches per step (batch / M samples each): with k =
  // (batch / M) / ref_microbatch, a time t becomes min(t, overhead) +
  // max(0, t - overhead) * k, min_recompute * k, and act/stash/min_stash/
  // wstash/temp bytes * k (rounded); param/opt bytes are unchanged; batch is
  // unchanged and ref_microbatch becomes batch / M. Throws ConfigError when
  // M < 1 or M does not divide batch.
  SegmentCosts scaled(int microbatches) const;
};

// One stage [begin, end) of segments, as the simulator sees it (costs of the
// SegmentCosts given, i.e. already scaled). f, b, i, w summed less (n - 1)
// times tasks_saved() of their kind (b, i plus the
// remat's recompute), act_bytes = last segment's act_bytes, grad_bytes =
// act_bytes of segment begin-1 (0 when begin == 0), stash_bytes per remat,
// wstash_bytes summed, wgrad_bytes = sum param_bytes, fb = 0.
StageCost stage_cost(const SegmentCosts& c, int begin, int end, Remat remat);
// params + optimizer state + gradient accumulator (= params) of the stage.
int64_t stage_static_bytes(const SegmentCosts& c, int begin, int end);
// Seconds outside the microbatch loop: step_overhead + the max over ranks of
// the update seconds of the segments of that rank's stages (ranks update
// their stages in parallel, after their loop). stage_rank[s]: the rank of
// stage s. The overlapped communication (update_comm) of a rank's stages is a
// queue: a stage's is ready once its last backward is done, and on a rank of
// several stages (interleaved, V) the deeper ones finish first, the shallower
// ones still running the backwards of their final group of min(microbatches,
// ranks) microbatches; what the queue has left when the rank's last stage ends
// is exposed.
double update_time(const SegmentCosts& c, const std::vector<int>& cuts,
                   const std::vector<int>& stage_rank, int ranks, int microbatches = 1);
// Per rank, the seconds of its stages' update_comm that update_time counts as exposed.
std::vector<double> update_comm_exposed(const SegmentCosts& c, const std::vector<int>& cuts,
                                        const std::vector<int>& stage_rank, int ranks,
                                        int microbatches);
// A stage's transient bytes while one of its tasks runs: the largest
// temp_bytes of its segments (XLA temporaries) plus the new gradient sums the
// task writes while the old ones are still held (the sum of the segments'
// param_bytes; step.memory's "transient" counts the same). `b_split`: the
// schedule runs B tasks of a split partition (runs_b_as_i_then_w), each as I
// then W, so I's weight stash (wstash_bytes) is held while W runs.
int64_t stage_temp_bytes(const SegmentCosts& c, int begin, int end, bool b_split = false);
// What the stage's backward rematerializes at once under `remat` beyond its stash: the
// largest min_transient_bytes / full_transient_bytes of its segments (0 under keep).
int64_t stage_transient_bytes(const SegmentCosts& c, int begin, int end, Remat remat);
// Whether the schedule has B tasks while its partition is split into I and W
// (DualPipeV: B in its overlapped pairs, I and W at the end): such a B runs as
// I then W.
bool runs_b_as_i_then_w(const Schedule& s);
// The bytes the optimizer update after the loop allocates for a stage's new
// parameters and optimizer state (param_bytes + opt_bytes of its segments),
// beside the old ones unless the step donates them (update_in_place).
int64_t stage_update_bytes(const SegmentCosts& c, int begin, int end);
// Cost model of a partition: cuts[s] = first segment of stage s (cuts[0] ==
// 0, increasing, < number of segments), remat[s] per stage.
CostModel stage_cost_model(const SegmentCosts& c, const std::vector<int>& cuts,
                           const std::vector<Remat>& remat);

struct AutoplanOptions {
  int ranks = 1;
  int64_t memory = 0;  // bytes per rank; 0: unlimited
  int top = 10;        // rows returned (best plan of each configuration, best first)
  // Schedule names (make_schedule's); empty: all of schedule_names().
  std::vector<std::string> families;
  // Microbatch counts to try; empty: every divisor of batch <= max_microbatches.
  std::vector<int> microbatches;
  int max_microbatches = 0;  // 0: 4 * ranks
  std::vector<int> interleaved_v = {2};
  // Remat modes allowed per stage (empty: all three).
  std::vector<Remat> remat_modes;
  bool verify = true;  // verify() every returned plan (throws VerifyError if one fails)
  // Relative optimality gap: 0 searches exactly; g > 0 also cuts every node
  // whose lower bound is within a factor (1 + g) of the threshold, so the
  // best plan returned is within (1 + g) of the optimum (and each row within
  // (1 + g) of the best plan of its configuration).
  double gap = 0;
  // Depth-first nodes explored per configuration before the rest of its
  // partitions are left unexplored (0: no limit, exact). Beyond the budget
  // the result is an approximation whose certified gap (the best row over
  // the smallest bound of anything left unexplored) is AutoplanStats::gap.
  // The default keeps 64 segments x 8 ranks x every family near 2 s; the
  // property-test sizes never reach it.
  int64_t node_budget = 20000;
  // Whether the update after the loop writes the new parameters and optimizer
  // state in place of the old ones (baton.jit(donate_argnums=...)). When not,
  // a rank's peak is static + max(loop, its stages' stage_update_bytes): the
  // new copies exist beside the old after the loop's buffers are gone.
  bool update_in_place = false;
  // Activation offload (rank_program.h, Offload): a candidate that does not
  // fit may offload the stashes of the stages of every rank over the budget
  // to host memory between forward and backward (ranks added until every
  // rank fits or none is left to add). Such a candidate is built as its rank
  // IR with those OFFLOAD / FETCH instructions (build_rank_ir, verified) and
  // simulated as that program (simulate(RankIR), the copies on the host link
  // of SegmentCosts::host_link_bandwidth, which must be > 0): its step time
  // includes every fetch the compute does not hide, its peaks are the
  // device bytes the program holds. Offload only adds waiting, so the
  // bounds on time stay valid; the memory bounds count, for every stage, a
  // stash only during the actions that write or read it.
  // An offloaded candidate fits only when every rank's host bytes are at
  // most host_memory (bytes per rank; 0: unlimited).
  bool offload = false;
  int64_t host_memory = 0;
  int32_t fetch_lookahead = 1;  // RankIROptions::fetch_lookahead of offloaded candidates
  // Only plans faster than this are wanted (a caller's incumbent, e.g. the
  // cluster search's K-th best so far): it bounds the threshold from the
  // start, and a search that finds nothing below it returns no plans instead
  // of throwing. Infinity (the default): no bound.
  double upper_bound = std::numeric_limits<double>::infinity();
};

// One evaluated candidate.
struct PlanCandidate {
  std::string schedule;  // generator name
  int virtual_stages = 1;
  int microbatches = 1;
  std::vector<int> cuts;  // first segment of each stage
  std::vector<Remat> remat;
  double step_time = 0;
  double bubble_fraction = 0;
  std::vector<int64_t> peak_memory;  // per rank, bytes (device)
  // Per stage what it offloads to host memory (empty: nothing), and per rank
  // the most host bytes it holds at once (empty when nothing is offloaded).
  std::vector<Offload> offload;
  std::vector<int64_t> peak_host;
  bool fits = true;
  int num_stages() const { return static_cast<int>(cuts.size()); }
  // The rank with the largest peak, and that peak.
  int max_memory_rank() const;
  int64_t max_memory() const;
};

struct AutoplanStats {
  int64_t configurations = 0;  // (family, v, M) generated and lowered
  int64_t refused = 0;         // refused by their generator or with too few segments
  int64_t partitions = 0;      // complete partitions reached
  int64_t candidates = 0;      // complete (partition, remat) vectors reached
  int64_t simulated = 0;       // candidates simulated
  int64_t offloaded = 0;       // of those, simulated as rank programs with offloads
  int64_t pruned = 0;          // subtrees / candidates cut off by a bound
  double seconds = 0;
  // True when the best row is the optimum of the space (gap == 0 and no
  // configuration ran out of node_budget).
  bool exact = true;
  // Otherwise the certified relative gap: best row <= (1 + gap) * optimum.
  double gap = 0;
};

struct AutoplanResult {
  std::vector<PlanCandidate> plans;  // best first; plans[0] is the optimum
  AutoplanStats stats;
  std::string to_json() const;
};

// Runs the search. Throws ConfigError on bad options/costs, and when no
// candidate fits the budget (the message names the smallest peak found and
// the rank holding it).
AutoplanResult autoplan(const SegmentCosts& costs, const AutoplanOptions& opts);

// Evaluates one candidate by simulation (unscaled costs; M must divide
// batch). fits is computed against `memory` (0: unlimited). With `offload`
// (one entry per stage; empty: none) the candidate is simulated as its rank
// IR with those offloads (host_link_bandwidth of the costs, > 0).
PlanCandidate evaluate_candidate(const SegmentCosts& costs, std::string_view schedule, int ranks,
                                 int virtual_stages, int microbatches, const std::vector<int>& cuts,
                                 const std::vector<Remat>& remat, int64_t memory = 0,
                                 bool update_in_place = false,
                                 const std::vector<Offload>& offload = {},
                                 int32_t fetch_lookahead = 1);

// The ranked table (one row per plan), for the CLI.
std::string autoplan_table(const AutoplanResult& r, int64_t memory);

// "20GiB", "1.5GB", "512MiB", "1e9", "123" -> bytes (KB/MB/GB/TB are powers
// of 1000, KiB/MiB/GiB/TiB of 1024, B optional). Throws ConfigError.
int64_t parse_bytes(std::string_view text);
// Human-readable bytes ("19.5GiB").
std::string format_bytes(int64_t bytes);

}  // namespace baton
