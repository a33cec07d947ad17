// Discrete-event simulator. It executes the lowered Plan itself (the same
// instruction streams the runtime runs), with the asynchronous semantics of
// plan.h: SEND/RECV post and return, RUN waits for its inputs, a transfer
// starts when the SEND is posted and the link is free (links are FIFO per
// ordered rank pair), takes latency + bytes/bandwidth, and completes no
// earlier than its RECV is posted.
//
// Details of the model:
//  * A rank executes its program in order. SEND/RECV/FREE/ACCUMULATE take no
//    time; RUN starts when the rank is free and every input buffer is present
//    on the rank, and lasts the task cost (F/B/I/W of the task's stage; a
//    fused action lasts fused_factor * (sum of both tasks)).
//  * Transfer duration = link.latency + bytes / link.bandwidth (bandwidth 0:
//    infinite). Bytes: act_bytes for Act, grad_bytes for Grad (of the stage
//    that produced the buffer), stash/wstash/wgrad_bytes for the others.
//    The link a->b is busy for that duration from the transfer's start;
//    transfers on it start in SEND order (FIFO). end = max(start + duration,
//    RECV posted). Sends and receives pair up by buffer id and rank pair.
//  * Memory per rank: a RUN allocates its outputs at its start; a RECV
//    allocates its buffer when posted; FREE releases at its time, or, for a
//    buffer with sends from this rank, when the last of them completes.
//    Buffers never freed stay live to the end. "activation" = Stash + WStash,
//    "total" = every live buffer. At equal times releases are applied before
//    allocations (program order: FREEs follow the RUN they belong to).
//  * Cost: O(N log N) in instructions (the memory timeline is sorted).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "baton/cost.h"
#include "baton/plan.h"

namespace baton {

struct RunEvent {
  int rank = 0;
  int instr = 0;   // index in the rank's program
  int action = 0;  // index in schedule.rank_actions[rank]
  double start = 0, end = 0;
};

struct TransferEvent {
  int src = 0, dst = 0;
  int buffer = 0;
  int send_instr = 0, recv_instr = 0;
  double posted = 0;  // SEND posted
  double start = 0;   // transfer began on the link
  double end = 0;     // arrived
  int64_t bytes = 0;
};

struct MemorySample {
  double time = 0;
  int64_t activation = 0;  // live Stash + WStash bytes
  int64_t total = 0;       // all live buffers on the rank
  int64_t host = 0;        // buffers held in host memory (rank programs' OFFLOAD)
};

struct CriticalStep {
  int rank = 0;
  int instr = 0;
  double start = 0, end = 0;
  std::string what;  // "RUN F0.1", "transfer act(s0,m1) 0->1"
};

struct SimResult {
  double step_time = 0;        // makespan
  std::vector<double> busy;    // per rank: time spent in RUN
  std::vector<double> bubble;  // per rank: 1 - busy/step_time
  double bubble_fraction = 0;  // 1 - sum(busy)/(ranks*step_time)
  std::vector<RunEvent> runs;  // sorted by (rank, start)
  std::vector<TransferEvent> transfers;
  std::vector<double> span_start;                 // per rank: first RUN start (0 if none)
  std::vector<double> span_end;                   // per rank: last RUN end (0 if none)
  std::vector<int64_t> peak_activation;           // per rank, bytes
  std::vector<int64_t> peak_total;                // per rank, bytes (device)
  std::vector<int64_t> peak_host_bytes;           // per rank, bytes in host memory (offload)
  std::vector<std::vector<MemorySample>> memory;  // per rank timeline
  // Backtracked from the event that ends last, through whichever dependency
  // set each start: the rank's previous RUN, the latest input's arrival, a
  // busy link, or a late RECV. Transfers appear as steps with rank = src,
  // instr = the SEND's index, spanning [start, end] of the transfer. Each
  // step starts where its predecessor ends, except after a busy link (the
  // step starts when the previous transfer left the wire, which may be
  // before that transfer's end) and at a late RECV (the transfer ends when
  // the receiving rank's previous RUN ends).
  std::vector<CriticalStep> critical_path;  // from start to end

  // Idle time of `rank` between its first RUN start and its last RUN end.
  double idle_inside_span(int rank) const;
};

// Throws ConfigError for an invalid cost model, VerifyError if the program
// is malformed (bad ids, a RUN input that is never on its rank, a SEND of an
// absent buffer) or cannot complete (the message names the stuck ranks and
// their instructions, and sends/receives that never pair up). Call verify
// first for a precise report.
struct SimOptions {
  // As the rank IR's POST placement does (Plan::receive_posts; not for NCCL):
  // the RECVs between a RUN and the next RUN are posted when the rank reaches
  // that RUN, so their buffers count from then (transfers already start at the
  // send: a posted receive never delays data here).
  bool early_receives = true;
};
SimResult simulate(const Plan& plan, const CostModel& costs, SimOptions opts = {});

// The same model over rank programs (sim_rank_ir.cc), i.e. over what runs: a
// POST starts its sends (on the link in post order) and reserves its
// receives' buffers, a WAIT advances the rank to the arrival, a RUN lasts its
// unit's cost, a FREE releases its buffer (a sent one once its send has
// completed). RunEvent::instr and the transfer instrs index the rank
// program's instructions (recv_instr: the POST of the receive); the critical
// path is not computed (empty). For a plan with early receives the result
// equals simulate(ir.plan, costs) in step time, runs, transfers and memory.
// Offload: each rank has two copy engines, device->host and host->device,
// each FIFO in program order; a copy takes bytes / host_link_bandwidth
// (CostModel; 0: instant). An OFFLOAD does not block the rank; its copy
// starts when the engine is free and the buffer's device bytes are released
// when it completes (its host bytes are held from the OFFLOAD). A FETCH does
// not block either: it reserves the device bytes at once, its copy starts
// when the engine is free and the OFFLOAD's copy has completed, and the host
// bytes are released when it completes; a RUN (or a send) reading the buffer
// waits for that (idle time, as at a WAIT). peak_host_bytes is the most host
// memory held at once, after every event in program order (at equal times an
// OFFLOAD's bytes count before a later FETCH's instant copy frees others).
struct RankIR;
SimResult simulate(const RankIR& ir, const CostModel& costs);

}  // namespace baton
