// Discrete-event simulator. It executes the lowered Plan itself (the same
// instruction streams the runtime runs), with the asynchronous semantics of
// plan.h: SEND/RECV post and return, RUN waits for its inputs, a transfer
// starts when the SEND is posted and the link is free (links are FIFO per
// ordered rank pair), takes latency + bytes/bandwidth, and completes no
// earlier than its RECV is posted.
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
  double posted = 0;     // SEND posted
  double start = 0;      // transfer began on the link
  double end = 0;        // arrived
  int64_t bytes = 0;
};

struct MemorySample {
  double time = 0;
  int64_t activation = 0;  // live Stash + WStash bytes
  int64_t total = 0;       // all live buffers on the rank
};

struct CriticalStep {
  int rank = 0;
  int instr = 0;
  double start = 0, end = 0;
  std::string what;  // "RUN F0.1", "transfer act(s0,m1) 0->1"
};

struct SimResult {
  double step_time = 0;                  // makespan
  std::vector<double> busy;              // per rank: time spent in RUN
  std::vector<double> bubble;            // per rank: 1 - busy/step_time
  double bubble_fraction = 0;            // 1 - sum(busy)/(ranks*step_time)
  std::vector<RunEvent> runs;            // sorted by (rank, start)
  std::vector<TransferEvent> transfers;
  std::vector<int64_t> peak_activation;  // per rank, bytes
  std::vector<int64_t> peak_total;       // per rank, bytes
  std::vector<std::vector<MemorySample>> memory;  // per rank timeline
  std::vector<CriticalStep> critical_path;        // from start to end
};

// Throws VerifyError if the program cannot complete (call verify first for
// a precise report).
SimResult simulate(const Plan& plan, const CostModel& costs);

}  // namespace baton
