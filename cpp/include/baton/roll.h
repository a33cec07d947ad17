// Rolled rank programs: a rank program (rank_program.h) as a list of items,
// split into runs of a repeating pattern that the straight lowering traces as
// one lax.scan each (docs/ARCHITECTURE.md, "The rolled lowering").
//
// An item is one thing a rank's loop does: a task it runs, a send posted, a
// receive posted or a receive waited on. The items of a rank program, in
// order: for POST g one SEND / POST item per transfer of g (posting order),
// for WAIT t a WAIT item, for RUN u one RUN item per task of u's action (F
// and B of one stage and microbatch as one fused FB item when the step has
// such a function, RollOptions::fuse_fb); FREE and ACCUMULATE have none.
// What an item reads and makes are the plan's buffers (Plan::action_inputs /
// action_outputs of its task): a SEND reads its buffer, a WAIT makes it, a
// task makes its outputs but its weight gradients (the program adds them to
// its sums where they are made).
//
// A run repeats the pattern items[first, first + period) `repetitions`
// times, repetition t at microbatch m + t * delta. It is rolled only when
// every buffer a repetition reads is made earlier in the same repetition or
// in the previous one: the latter is a carry slot, (kind, stage, m) in the
// pattern's microbatches, made at m and read by the next repetition (there at
// m - delta). Runs are chosen greedily from the front: among the (period,
// delta) of at least two repetitions, the one whose slots are all updated in
// place (a slot read after its new value is made is a copy), then the one
// covering the most items, then the shortest period and the smallest delta.
// A run whose pattern starts and ends with transfers is rotated so that the
// transfers between two repetitions stay together: its leading transfers run
// once in place, the pattern starting at its first task for one repetition
// fewer, then the last repetition's rest in place.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "baton/plan.h"
#include "baton/rank_program.h"

namespace baton {

// OFFLOAD / FETCH: the rank program's instructions of an offloaded buffer (rank_program.h):
// its copy to host memory (reads the buffer), its copy back to the device (makes it again).
enum class ItemOp : uint8_t { Run = 0, Send = 1, Post = 2, Wait = 3, Offload = 4, Fetch = 5 };
// "run", "send", "post", "wait", "offload", "fetch"
const char* item_op_name(ItemOp op);

struct RollItem {
  ItemOp op = ItemOp::Run;
  TaskKind task = TaskKind::F;    // RUN: the task's kind
  bool fused = false;             // RUN: F and B of the microbatch as one FB function
  BufKind buffer = BufKind::Act;  // SEND / POST / WAIT / OFFLOAD / FETCH: the buffer's kind
  int32_t stage = -1;  // the task's stage, or the buffer's (its skip edge for Skip, SkipGrad)
  int32_t microbatch = -1;
  int32_t peer = -1;              // transfers: the other rank; RUN, OFFLOAD, FETCH: -1
  std::vector<BufferKey> reads;   // what it reads (a task: the plan's inputs, in order)
  std::vector<BufferKey> writes;  // what it makes (a task: its outputs but weight gradients)
  // Equal up to the microbatch shifted by `d` (what a repetition repeats).
  bool same_shifted(const RollItem& o, int32_t d) const;
  bool operator==(const RollItem&) const = default;
};

struct RollRun {
  int32_t first = 0;        // its first item
  int32_t period = 1;       // the pattern: items[first, first + period)
  int32_t repetitions = 1;  // 1: the items are traced in place
  int32_t delta = 1;        // microbatches per repetition
  // Carry slots, in the pattern's microbatches, sorted (kind, stage, m).
  std::vector<BufferKey> slots;
  // Buffers of the pattern (its microbatches) that items after the run read:
  // they leave the scan stacked over its repetitions, but for the last
  // repetition's value of a carry slot (the final carry). Sorted.
  std::vector<BufferKey> stacked;
  bool operator==(const RollRun&) const = default;
};

struct RollOptions {
  int32_t max_period = 0;  // the longest pattern; <= 0: 4 items per stage of the plan
  // false: no run hands stacked buffers to later items (runs that would stay
  // unrolled: XLA zero-fills a stacked output before the loop writes it).
  bool stacked = true;
  // A fused F+B action is one FB item (the step has a fused function); false:
  // its two tasks are two items.
  bool fuse_fb = true;
};

struct RolledRank {
  int32_t rank = -1;
  std::vector<RollItem> items;
  std::vector<RollRun> runs;  // covering the items in order
  // The text form (golden tests): a header, then per run "#<first item>"
  // and its items ("F1.2", "FB0.3"; ">act(s1,m2)->2" a send, "+act(s0,m3)<-0"
  // a receive posted, "<act(s0,m3)<-0" one waited on), a run of several
  // repetitions as "scan <repetitions> x [<pattern>] +<delta>" followed by
  // its "slots:" and "stacked:" lines when it has any.
  std::string to_text(const Plan& plan) const;
};

// The items of a rank program (see above).
std::vector<RollItem> rank_items(const Plan& plan, const RankProgram& prog,
                                 const RollOptions& opts = {});
// The runs of a rank program (roll.cc).
RolledRank roll_rank(const Plan& plan, const RankProgram& prog, const RollOptions& opts = {});

}  // namespace baton
