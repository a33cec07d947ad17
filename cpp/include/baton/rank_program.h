// Rank programs: the per-rank execution IR built from a verified Plan. It is
// what a rank runs: its units (tasks), its transfers in groups with the point
// where each group is posted and where each receive is waited on, the slot of
// every buffer it holds, and which ranks can share one compiled program. It
// is verified (cpp/src/rankir/verify.cc), printed (text.cc), simulated
// (sim_rank_ir.cc) and handed to the Python emitter as records.
//
// Execution semantics of one rank's instruction list (in order):
//   POST g      post every transfer of group g: each SEND starts moving its
//               buffer to the peer, each RECV reserves its buffer's slot.
//               Never blocks.
//   WAIT t      block until receive t has arrived; its buffer is then present.
//   RUN u       run unit u; reads its input buffers (present), writes its
//               outputs into their slots.
//   FREE b      release buffer b; for a buffer that was sent, first wait
//               until its send has completed (the peer posted the matching
//               receive).
//   ACCUMULATE b   add weight gradient b into its stage's accumulator.
//   OFFLOAD b   start copying buffer b from its device slot to its host slot
//               (RankBuffer::host_slot). Never blocks. From here b is held in
//               the host slot and its device slot is released: the copy is
//               ordered before any later write of that device slot (one XLA
//               program, or a copy stream followed by an event).
//   FETCH b     start copying offloaded buffer b back into a device slot
//               (RankBuffer::fetch_slot, maybe another than `slot`). Never
//               blocks. From here b is held on the device again and its host
//               slot is released; a RUN (or a SEND's POST) that reads b waits
//               for the copy. Reading b between its OFFLOAD and its FETCH is
//               an error.
// Transfers travel in order per (sender, receiver, channel): the k-th SEND of
// rank a to rank b on channel c pairs with the k-th RECV of rank b from a on
// c (the FIFO model of verify.h; channels are Plan::channel, the one tag
// space). Receives are posted where Plan::receive_posts says (before the RUN
// that precedes the plan's RECV), in the group with the sends that precede
// that RUN; each receive is waited on just before the first RUN that reads it.
// Nothing waits earlier and nothing is posted later than in the Plan, so the
// program is deadlock-free whenever the plan is (the verifier checks it
// again on the IR).
//
// Slots are where the compiled program keeps buffers between the units that
// make and read them (the rings of a table program): a buffer is *held* from
// the instruction that puts it into its slot (the RUN writing it, the WAIT of
// its receive) to the last instruction on the rank that reads it (a RUN, or
// the POST of its send), both included. Every buffer of a row (one kind of
// one stage or skip edge) that some later instruction on the rank reads has
// a slot; the other rows (weight gradients, which the program adds to its
// sums where they are made; a fused unit's internal buffers; outputs only
// freed) have none. A transport's own copies of sent and received data are
// the transport's: the plan's lifetimes (live_from / live_to, to the FREE)
// describe them and the simulator's memory.
//
// Offload (RankIROptions::offload; placed by offload.cc): an offloaded
// buffer is held on the device over [held_from, offload] in slot `slot` and
// over [fetch, held_to] in slot `fetch_slot` (both of pool `pool`), and in
// host memory over [offload, fetch] in slot `host_slot` of host pool
// `host_pool`. Host pools are to host memory what pools are to the device:
// one per device pool label that has offloaded buffers, as many slots as the
// most of its buffers held in host memory at once.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "baton/plan.h"
#include "baton/verify.h"

namespace baton {

enum class RankOp : uint8_t {
  Post = 0,
  Wait = 1,
  Run = 2,
  Free = 3,
  Accumulate = 4,
  Offload = 5,
  Fetch = 6
};
// "POST", "WAIT", "RUN", "FREE", "ACCUMULATE", "OFFLOAD", "FETCH"
const char* rank_op_name(RankOp op);

enum class TransferDir : uint8_t { Send = 0, Recv = 1 };

// One instruction; the field its opcode names is set, the others are -1.
struct RankInstr {
  RankOp op = RankOp::Run;
  int32_t unit = -1;      // RUN
  int32_t group = -1;     // POST
  int32_t transfer = -1;  // WAIT (a receive)
  int32_t buffer = -1;    // FREE, ACCUMULATE, OFFLOAD, FETCH
  bool operator==(const RankInstr&) const = default;
};

// A buffer that exists on the rank: produced by one of its units or received.
struct RankBuffer {
  int32_t id = -1;  // the plan's buffer id
  BufferKey key;
  int32_t pool = -1;  // index into RankProgram::pools; -1: the buffer holds no slot
  int32_t slot = -1;  // slot in that pool
  int32_t live_from =
      -1;                // instruction that creates it (the RUN writing it, the POST receiving it)
  int32_t live_to = -1;  // its FREE (the plan's lifetime)
  int32_t held_from = -1;  // the RUN writing it, or the WAIT of its receive
  int32_t held_to = -1;    // the last RUN or POST on the rank reading it (>= held_from)
  // Offload (rank_program.h, top): its OFFLOAD and FETCH instructions (-1:
  // not offloaded), the device slot it is fetched into (in `pool`), and its
  // host slot (host_pool: index into RankProgram::host_pools; -1: none).
  int32_t offload = -1;
  int32_t fetch = -1;
  int32_t fetch_slot = -1;
  int32_t host_pool = -1;
  int32_t host_slot = -1;
  bool operator==(const RankBuffer&) const = default;
};

// Buffers that share slots: the plan rows (buffer id / microbatches: one
// kind of one stage or skip edge) listed in `rows`. A slot holds at most one
// held buffer at a time; `slots` is the most buffers of the pool held at once.
struct Pool {
  std::vector<int32_t> rows;
  int32_t slots = 0;
  bool operator==(const Pool&) const = default;
};

struct Unit {
  int32_t action = -1;          // index into schedule.rank_actions[rank]
  std::vector<Task> tasks;      // one task, or two for a fused action
  std::vector<int32_t> reads;   // RankProgram::buffers indices, in Plan::action_io input order
  std::vector<int32_t> writes;  // outputs (internal buffers of a fused action and wgrads included)
  int32_t instr = -1;           // its RUN
  bool operator==(const Unit&) const = default;
};

struct Transfer {
  TransferDir dir = TransferDir::Send;
  int32_t buffer = -1;   // RankProgram::buffers index
  int32_t peer = -1;     // the other rank
  int32_t channel = -1;  // Plan::channel of the buffer
  int32_t seq = -1;      // k: the k-th transfer of this direction with `peer` on `channel`
  int32_t group = -1;    // the group that posts it
  int32_t wait = -1;     // RECV: its WAIT; SEND: the FREE that waits for its completion
  bool operator==(const Transfer&) const = default;
};

struct TransferGroup {
  std::vector<int32_t> transfers;  // Transfer indices, in posting order
  int32_t post = -1;               // its POST instruction
  bool operator==(const TransferGroup&) const = default;
};

struct RankProgram {
  int32_t rank = -1;
  std::vector<int32_t> stages;  // stages the rank holds, ascending
  std::vector<RankInstr> instrs;
  std::vector<Unit> units;
  std::vector<Transfer> transfers;
  std::vector<TransferGroup> groups;
  std::vector<RankBuffer> buffers;
  std::vector<Pool> pools;
  std::vector<Pool> host_pools;  // host memory of offloaded buffers (empty: none offloaded)
  int32_t share_class = -1;      // index into RankIR::share_classes
  bool operator==(const RankProgram&) const = default;
};

struct RankIR {
  Plan plan;                          // what the programs were built from (names, costs, pictures)
  std::vector<RankProgram> programs;  // per rank
  // Ranks that can share one compiled program (see share_classes()), each
  // ascending, classes ordered by their first rank.
  std::vector<std::vector<int32_t>> share_classes;

  // "rank 1 #4 WAIT act(s0,m1)<-0" style description of one instruction.
  std::string describe(int rank, int instr) const;
  // The text form (text.cc): a header, the share classes, then per rank its
  // pools and instructions. Deterministic; golden tests compare it.
  std::string to_text() const;
};

// What a stage offloads to host memory between a microbatch's forward and
// its backward.
enum class Offload : uint8_t {
  None = 0,
  Stash = 1,  // its Stash buffers (F's residuals read by the B/I of the same microbatch)
};

struct RankIROptions {
  // Pool label of each plan row (buffer id / microbatches; Plan::num_buffer_ids
  // / microbatches entries): rows with equal labels share slots (e.g. kinds
  // whose buffers have equal shapes). Empty: one pool per row.
  std::vector<int32_t> pool_of;
  // Per stage (num_stages entries; empty: nothing offloaded). For a stage
  // with Offload::Stash, each of its Stash buffers with at least one other
  // RUN of its rank between the RUN writing it and the first RUN reading it
  // is offloaded: OFFLOAD just after the writer, FETCH just before the RUN
  // `fetch_lookahead` RUNs before that reader, but never before the first
  // RUN after the writer (offload.cc).
  std::vector<Offload> offload;
  int32_t fetch_lookahead = 1;  // >= 1
};

// The pass pipeline (one pass per file): verify the plan (VerifyError when it
// fails), build the instruction lists (build.cc), place offloads
// (offload.cc), assign slots (slots.cc), find the share classes (share.cc),
// then verify the result. Throws ConfigError naming the field for invalid
// options.
RankIR build_rank_ir(const Plan& plan, const RankIROptions& opts = {});
// The same passes for a plan the caller has verified already (build.h's
// build_step): no second verification of the plan.
RankIR build_rank_ir_of_verified(const Plan& plan, const RankIROptions& opts = {});

// Passes.
RankProgram lower_rank_program(const Plan& plan, int rank);  // build.cc (slots unset)
// Inserts the OFFLOAD / FETCH instructions opts.offload asks for (see
// RankIROptions) and renumbers every back-reference; sets RankBuffer::offload
// / fetch. Nothing changes when opts.offload is empty. (offload.cc)
void place_offloads(const Plan& plan, RankProgram& prog, const RankIROptions& opts);
void assign_slots(const Plan& plan, RankProgram& prog,
                  const RankIROptions& opts);  // slots.cc
// Two ranks share a class when they run the same units and the same
// transfers up to renaming: stages relative to the rank's first stage,
// peers relative to the rank, microbatches relative to the unit's task; what
// differs (which unit runs at which step, the microbatch, the slot) is data
// of the shared program. Sets RankProgram::share_class.
std::vector<std::vector<int32_t>> share_classes(const Plan& plan,
                                                std::vector<RankProgram>& programs);  // share.cc

// Verifier (cpp/src/rankir/verify.cc). Checks, each violation naming rank and
// instruction ("rank 1 #4 WAIT act(s0,m1)<-0: ..."):
//   structure: indices in range, back-references (unit.instr, group.post,
//     transfer.group, transfer.wait) agree with the instruction list;
//   post/wait: every receive is posted exactly once and waited on exactly
//     once, after its post; waits on one (peer, channel) come in post order;
//   data: every buffer a RUN reads is present (written by an earlier RUN or
//     received and waited on) and not yet freed; every sent buffer is present
//     when posted;
//   offload: an OFFLOAD of a present buffer that is not offloaded, a FETCH
//     of an offloaded one, every offloaded buffer fetched, nothing read
//     (RUN, SEND) between OFFLOAD and FETCH; buffer.offload / fetch agree
//     with the instructions (under structure and data);
//   slots: held_from / held_to are where the instructions put the buffer
//     into its slot and last read it; every buffer a later instruction reads
//     has a slot, in its pool's range, that holds no other buffer while it
//     is held, over both device intervals of an offloaded buffer; host slots
//     likewise in their host pools over [offload, fetch] (verify_slots.cc);
//   channels: every SEND pairs with the peer's RECV of the same buffer at the
//     same FIFO position on the same channel, and the channel is the plan's;
//   deadlock: the programs run to their ends under the semantics above with
//     FIFO pairing, where only a WAIT blocks (until the paired SEND is
//     posted); the stuck instructions are named.
VerifyReport verify_rank_ir(const RankIR& ir);
void verify_rank_ir_or_throw(const RankIR& ir);  // VerifyError with the report

}  // namespace baton
