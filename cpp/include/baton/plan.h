// Lowering of a Schedule to per-rank instruction streams. The Plan is the
// single source of truth: the same instruction streams are verified,
// simulated, drawn and executed.
//
// Data model. Every task reads and writes buffers identified by
// (kind, stage, microbatch):
//   F(s,m): reads Act(s-1,m) (s>0);             writes Act(s,m) (s<S-1), Stash(s,m)
//   B(s,m): reads Stash(s,m), Grad(s+1,m) (s<S-1); writes Grad(s,m) (s>0), WGrad(s,m)
//   I(s,m): reads Stash(s,m), Grad(s+1,m) (s<S-1); writes Grad(s,m) (s>0), WStash(s,m)
//   W(s,m): reads WStash(s,m);                  writes WGrad(s,m)
//   with skip edges e = (i, j), j > i + 1 (Plan::skips):
//   F(i,m) also writes Skip(e,m); F(j,m) also reads it;
//   B/I(j,m) also write SkipGrad(e,m); B/I(i,m) also read it.
// Act is the activation sent forward, Grad the input-gradient sent backward,
// Stash the residuals kept from F for the backward, WStash what I keeps for
// W, WGrad a weight gradient that is ACCUMULATEd into its stage's
// accumulator. Skip carries values of stage i that stage j reads (an encoder
// output read by a decoder stage, a long skip connection) straight from
// rank(i) to rank(j), and SkipGrad their cotangent contributions back; they
// are transfers like Act and Grad (a local hand-off when both stages are on
// one rank). A fused action reads and writes the union of its two tasks.
//
// Instruction semantics (what the executor does, and what the verifier and
// simulator model):
//   RUN a      run action a of this rank; waits until its inputs are present.
//   SEND b,r   post an asynchronous send of buffer b to rank r.
//   RECV b,r   post an asynchronous receive of buffer b from rank r; the
//              buffer exists on this rank once the transfer completes.
//   FREE b     release b on this rank (after any pending send of b completes).
//   ACCUMULATE b   add weight gradient b into its stage's accumulator.
// Lowering places, for each action in order: RECVs of its remote inputs,
// RUN, FREEs of inputs whose last use it was, ACCUMULATE+FREE of WGrad, SENDs
// of outputs with a remote consumer. Consecutive SEND/RECV instructions form
// one communication group (like ncclGroupStart/End); FREEs of sent buffers
// follow the group.
// Details: every buffer has one producer task and at most one consumer task,
// so an action is the last local use of each of its inputs, which it frees
// in input order (then buffers internal to a fused action). A local hand-off
// (producer and consumer stage on one rank) has no SEND/RECV; the consumer
// frees it. The group after action k holds k's SENDs and action k+1's RECVs,
// so k's sent buffers are freed just before RUN k+1 (or at the program end).
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "baton/schedule.h"

namespace baton {

enum class BufKind : uint8_t {
  Act = 0,
  Grad = 1,
  Stash = 2,
  WStash = 3,
  WGrad = 4,
  Skip = 5,
  SkipGrad = 6
};
// Kinds with one buffer per (stage, microbatch): Act .. WGrad.
constexpr int kNumBufKinds = 5;
// "act", "grad", "stash", "wstash", "wgrad", "skip", "skipgrad"
const char* buf_kind_name(BufKind k);

// A transfer from stage `from` to stage `to` > from + 1 (see Skip above).
// `forward`: values go from -> to (Skip buffers); `backward`: cotangents go
// to -> from (SkipGrad buffers). JAX often sums a skip's cotangent
// contributions along the chain of stages, so an edge may be forward only.
struct SkipEdge {
  int32_t from = -1;
  int32_t to = -1;
  bool forward = true;
  bool backward = true;
  bool operator==(const SkipEdge&) const = default;
};
// Largest number of skip edges a plan may have (its channels must fit the
// runtime's 64 transfer channels: 5 + 2 * 29 <= 64).
constexpr int kMaxSkipEdges = 29;

// For Skip / SkipGrad, `stage` is the edge index (Plan::skips).
struct BufferKey {
  BufKind kind = BufKind::Act;
  int32_t stage = -1;
  int32_t microbatch = -1;
  bool operator==(const BufferKey&) const = default;
};

enum class OpCode : uint8_t { Run = 0, Send = 1, Recv = 2, Free = 3, Accumulate = 4 };
const char* opcode_name(OpCode op);  // "RUN", "SEND", ...

struct Instr {
  OpCode op = OpCode::Run;
  int32_t action = -1;  // RUN: index into schedule.rank_actions[rank]
  int32_t buffer = -1;  // SEND/RECV/FREE/ACCUMULATE: buffer id
  int32_t peer = -1;    // SEND/RECV: the other rank
  bool operator==(const Instr&) const = default;
};

struct Plan {
  Schedule schedule;
  // Direct transfers between non-neighbouring stages, sorted by (from, to),
  // each pair at most once; empty for a chain of stages.
  std::vector<SkipEdge> skips;
  std::vector<std::vector<Instr>> programs;  // per rank

  // Dense buffer ids: id = (kind * S + stage) * M + microbatch for Act ..
  // WGrad; then Skip(e, m) = (5 * S + e) * M + m and SkipGrad(e, m) =
  // (5 * S + E + e) * M + m for E = skips.size(). So id / M indexes a
  // per-(kind, stage or edge) table of 5 * S + 2 * E entries.
  int32_t buffer_id(BufferKey k) const;
  BufferKey buffer_key(int32_t id) const;
  int32_t num_buffer_ids() const;
  // The ordered channel a transfer of buffer `id` travels on between two
  // ranks (the verifier's FIFO model and the runtime's tags): its kind for
  // Act .. WGrad, 5 + e for Skip(e), 5 + E + e for SkipGrad(e).
  int channel(int32_t id) const;
  int num_channels() const { return kNumBufKinds + 2 * static_cast<int>(skips.size()); }
  // Act, Grad, Skip, SkipGrad: buffers that may cross ranks.
  static bool is_transfer(BufKind k) {
    return k == BufKind::Act || k == BufKind::Grad || k == BufKind::Skip ||
           k == BufKind::SkipGrad;
  }

  // Inputs and outputs of a task / of an action (union for fused), as ids.
  // Order: as listed in the data model above (F: act; B/I: stash, grad).
  std::vector<int32_t> task_inputs(const Task& t) const;
  std::vector<int32_t> task_outputs(const Task& t) const;
  // For a fused action, a buffer that one of its tasks produces and the other
  // consumes (e.g. stash of F3.0+B3.0 on the last stage) is internal: it is
  // among the outputs, not among the inputs, and it is freed after the RUN.
  std::vector<int32_t> action_inputs(const Action& a) const;
  std::vector<int32_t> action_outputs(const Action& a) const;
  // Allocation-free form of the above for hot loops (lowering, verifier,
  // simulator). Capacities suffice for any (fused) action: a task touches at
  // most 3 + kMaxSkipEdges buffers.
  static constexpr int kMaxIO = 2 * (3 + kMaxSkipEdges);
  struct ActionIO {
    int32_t in[kMaxIO] = {};
    int32_t out[kMaxIO] = {};
    int32_t internal[kMaxIO] = {};
    int n_in = 0, n_out = 0, n_internal = 0;
  };
  ActionIO action_io(const Action& a) const;
  // Allocation-free task_inputs / task_outputs (kMaxIO ids each; no checks).
  void task_io(const Task& t, int32_t* in, int& n_in, int32_t* out, int& n_out) const;
  // Rank holding the task that writes / reads buffer `id`; -1 when there is
  // none (a wgrad is only ACCUMULATEd). Every buffer has exactly one producer
  // task and at most one consumer task.
  int producer_stage(int32_t id) const;
  int consumer_stage(int32_t id) const;  // -1 when none
  int producer_rank(int32_t id) const;
  int consumer_rank(int32_t id) const;

  // "rank 0 #5 RUN F0.1" style description of one instruction.
  std::string describe(int rank, int index) const;
  // Where `rank`'s receives are posted: for each instruction of its program,
  // for a RECV the index of the instruction before which the runtime posts it
  // (the last RUN before it: the receive is in flight while that task
  // computes; the RECV itself when no RUN precedes it), -1 for the others.
  // The executor and the compiled rank programs both post here, so the
  // simulator's receive-buffer lifetimes hold for both.
  std::vector<int32_t> receive_posts(int rank) const;
  std::string describe_buffer(int32_t id) const;  // e.g. "act(s0,m1)"
  // Full text listing of every rank's program.
  std::string to_text() const;
  // Deterministic hex digest over schedule and programs (FNV-1a 64 over a
  // canonical serialization). Equal plans have equal fingerprints. 16 lower
  // case hex digits. Serialization (little-endian): the string "baton-plan 1",
  // the schedule name (strings as u32 length + bytes), ranks, stages and
  // microbatches (i32), the placement (u32 count + i32 each), per rank its
  // actions (u32 count; per action both task slots as u8 kind, i32 stage, i32
  // microbatch), then per rank its program (u32 count; per instruction a u8
  // opcode, then RUN: i32 action; SEND/RECV: i32 buffer, i32 peer;
  // FREE/ACCUMULATE: i32 buffer); with skip edges, then the string "skips",
  // u32 count and i32 from, to, u8 forward | backward << 1 of each (a plan
  // without skips hashes as before).
  std::string fingerprint() const;
};

// Calls of lower(), verify() and the rank-IR builder in this process (read
// through build.h's build_counts(): one step build calls each once).
struct BuildCounters {
  std::atomic<uint64_t> lower{0}, verify{0}, rank_ir{0}, with_pools{0};
};
BuildCounters& build_counters();

// Lowers and returns the plan. Calls schedule.validate() first; `skips` must
// be sorted, distinct, with 0 <= from, from + 1 < to < stages and at most
// kMaxSkipEdges of them (ScheduleError naming the edge otherwise).
Plan lower(const Schedule& s, const std::vector<SkipEdge>& skips = {});

}  // namespace baton
