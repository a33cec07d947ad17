// Program IR of a traced training step, and the passes that cut its
// microbatch loop into pipeline tasks. JAX-free: the frontend exports one Op
// per jaxpr equation (inputs/outputs as value ids, avals, a cost estimate),
// the passes decide which task runs which op, and the frontend rebuilds one
// executable per task from the op lists.
//
// Regions. A step is `pre` ops (before the loop), the loop body (one
// microbatch; traced once), and `post` ops (after the loop: optimizer). Loop
// inputs are body values bound to outer values: loop-invariant (parameters,
// closed-over values) or per-microbatch (one slice of the batch). Loop outputs
// are body values reduced over microbatches (sum, mean) or stacked.
//
// Markers. `stage_boundary` appears as Boundary ops: forward marker k ends
// stage k (inputs: stage k; outputs: stage k+1); its transpose, a backward
// marker k, carries the input gradient from stage k+1 back to stage k.
//
// Passes (run by partition()):
//  1. classify ops: free (depends only on literals / loop-invariant inputs,
//     or also on per-microbatch inputs: "unstaged"), staged otherwise;
//  2. stage inference: a staged op's position in the chain
//     F0 < F1 < ... < F(S-1) < B(S-1) < ... < B0 is the max over its inputs;
//     ops that come after the last primal loop output in program order
//     (the backward pass of the last stage) are at least B(S-1); with no
//     markers (one stage) the per-microbatch inputs seed F0;
//  3. split tied sums: a summed loop output computed as add_any of
//     contributions from different stages becomes one partial output per
//     stage, summed after the loop (linearity);
//  4. unstaged ops are placed, per stage that consumes them, at their
//     earliest consumer in that stage (so a value used by F and B of one stage
//     is stashed, and one used by two stages is recomputed by each);
//  5. task formation: F/B, or I/W (I = ancestors of the input gradient sent
//     upstream, W = the rest of B); each task's inputs and outputs are
//     classified as the plan's buffers (Act, Grad, Stash, WStash, WGrad),
//     loop-invariant and per-microbatch inputs, and per-microbatch outputs;
//     DCE keeps only ops that feed a task output; with `remat` the stash is
//     shrunk by min_stash (below);
//  6. pre/post placement: post ops go to the stage of their largest staged
//     input (ties: the smallest stage; none: their first consumer, else stage
//     0); pre ops to their first consumer.
// Errors are TraceError naming the op (program index and primitive), stage
// and value.
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "baton/error.h"
#include "baton/plan.h"
#include "baton/schedule.h"

namespace baton {

// The traced step cannot be pipelined as written (Python: baton.TraceError).
class TraceError : public Error {
 public:
  using Error::Error;
};

enum class ValueKind : uint8_t {
  Intermediate = 0,   // produced by an op
  StepInput = 1,      // an input of the whole step (outer)
  Literal = 2,        // a constant known to the frontend; available everywhere
  LoopInvariant = 3,  // body input, same for every microbatch
  LoopMicrobatch = 4  // body input, one slice per microbatch
};

struct Value {
  ValueKind kind = ValueKind::Intermediate;
  std::vector<int64_t> shape;
  std::string dtype;  // "float32", ...
  int64_t bytes = 0;
};

enum class Region : uint8_t { Pre = 0, Loop = 1, Post = 2 };
enum class OpKind : uint8_t {
  Compute = 0,   // any equation
  Boundary = 1,  // stage_boundary marker (Loop region only)
  AddAny = 2,    // cotangent sum (add_any): candidate for the tied-sum split
};

struct Op {
  OpKind kind = OpKind::Compute;
  Region region = Region::Loop;
  std::string name;              // primitive name, for messages
  std::vector<int32_t> inputs;   // value ids
  std::vector<int32_t> outputs;  // value ids
  double cost = 0;               // estimated flops (or any consistent unit)
  int32_t boundary = -1;         // Boundary: index k (0-based, forward order)
  bool backward = false;         // Boundary: backward marker
};

enum class Reduce : uint8_t { Sum = 0, Mean = 1, Stack = 2 };

struct LoopInput {
  int32_t body = -1;   // body value (kind LoopInvariant or LoopMicrobatch)
  int32_t outer = -1;  // value it is bound to outside the loop
};

struct LoopOutput {
  int32_t body = -1;   // body value (any kind)
  int32_t outer = -1;  // outer value it defines (output of the LoopCall op)
  Reduce reduce = Reduce::Sum;
};

struct Program {
  std::vector<Value> values;
  // In program order: pre ops, body ops, post ops. The loop itself is not an
  // op: loop_inputs/loop_outputs bind body values to outer values, and an
  // outer value defined by a loop output has no producing op.
  std::vector<Op> ops;
  std::vector<LoopInput> loop_inputs;
  std::vector<LoopOutput> loop_outputs;
  std::vector<int32_t> step_outputs;  // outer values returned by the step
  // How many leading loop outputs are primal (the loss and aux of a
  // value_and_grad), when the frontend knows it from the loop function's
  // output tree; -1 when unknown. Known, the last stage's forward is what the
  // primal outputs depend on (data flow, whatever the op order); unknown, the
  // primal outputs are the shortest prefix produced before the rest in program
  // order (JAX emits a VJP's forward before its transpose).
  int32_t num_primal_outputs = -1;

  int32_t add_value(Value v);
  int32_t add_op(Op op);
  // Checks ids, single assignment, def-before-use, region order, marker
  // indices 0..n-1 each with one forward marker. Throws TraceError.
  void validate() const;
  // One line per op: "%3 = dot_general %1 %2  [loop]".
  std::string to_text() const;
};

// A loop output as produced by the tasks: after the tied-sum split one outer
// value may be the sum of several partials from different stages.
struct OutputPart {
  int32_t body = -1;   // body value holding this part per microbatch
  int32_t outer = -1;  // outer value it contributes to
  Reduce reduce = Reduce::Sum;
  int32_t stage = -1;           // stage whose task produces it
  TaskKind task = TaskKind::F;  // task kind producing it (F: per-mb output;
                                // B/W: part of WGrad)
};

// One task body: ops (program order) plus its interface. Every list holds body
// value ids; a buffer's value list is in the same order on both sides (the
// producer's *_out list and the consumer's *_in list have equal length and
// correspond position by position).
// The values of one skip edge as one task sees them (see Partition::skips).
struct SkipValues {
  int32_t edge = -1;  // index into Partition::skips
  std::vector<int32_t> values;
};

struct TaskBody {
  TaskKind kind = TaskKind::F;
  int32_t stage = -1;
  std::vector<int32_t> ops;
  std::vector<int32_t> act_in, grad_in, stash_in, wstash_in;
  std::vector<int32_t> invariant_in, microbatch_in;
  std::vector<int32_t> act_out, grad_out, stash_out, wstash_out;
  // Skip edges (in edge order): F(i) skip_out / F(j) skip_in carry values of
  // stage i that stage j > i + 1 reads; B or I (j) skip_grad_out / B or I (i)
  // skip_grad_in their cotangent contributions. Each is its own buffer
  // (plan.h Skip / SkipGrad), sent straight between the two stages' ranks.
  std::vector<SkipValues> skip_in, skip_out, skip_grad_in, skip_grad_out;
  std::vector<int32_t> wgrad_out;  // indices into Partition::parts
  std::vector<int32_t> mb_out;     // indices into Partition::parts
  double cost = 0;
  int64_t bytes(const Program& p, const std::vector<int32_t>& vals) const;
};

struct Partition {
  int32_t num_stages = 0;
  bool split_backward = false;
  // Pairs of stages (from, to > from + 1) with values to transfer directly,
  // sorted; pass them to lower() so the plan has their buffers.
  std::vector<SkipEdge> skips;
  // tasks[task_index(kind, stage)]
  std::vector<TaskBody> tasks;
  std::vector<OutputPart> parts;
  // For every op: its stage if in the Pre/Post region, else -1.
  std::vector<int32_t> op_stage;
  // Index of the task in `tasks`; throws TraceError if absent.
  int32_t task_index(TaskKind kind, int32_t stage) const;
  const TaskBody& task(TaskKind kind, int32_t stage) const;
  // Multi-line description of every task and its interface.
  std::string to_text(const Program& p) const;
};

// Runs all passes. `split_backward`: form I/W instead of B. `remat`: shrink
// each stage's stash with min_stash() (the backward task recomputes cheap ops).
Partition partition(const Program& program, bool split_backward, bool remat = true);

// Stash rematerialization (run inside task formation when `remat` is on).
// The backward task of a stage needs `needed`, values the forward task
// computes. Instead of stashing all of them it may recompute the cheap ones
// (is_recomputable: one-output elementwise, comparison, select, cast, shape
// ops) from other stashed values and free inputs (literals, loop inputs).
// min_stash chooses the values to stash with the fewest bytes: a minimum s-t
// cut where each value costs its bytes, values from other ops or from
// outside `forward_ops` must be stashed if needed, and a recomputed value
// needs its inputs; among minimum cuts it takes the one closest to the
// needed values (fewest recomputed ops). `producer`: value -> op or -1.
struct Remat {
  std::vector<int32_t> stash;      // values to stash (sorted)
  std::vector<int32_t> recompute;  // forward ops the backward task reruns (program order)
};
bool is_recomputable(const Op& op);
Remat min_stash(const Program& p, const std::vector<int32_t>& producer,
                const std::set<int32_t>& forward_ops, const std::set<int32_t>& needed);

// Number of stages the program defines (forward markers + 1); 0 if no loop.
int32_t count_stages(const Program& program);

}  // namespace baton
