// Verifier over a lowered Plan. Checks:
//  * structure: exactly one F and one B or (one I and one W) per
//    (stage, microbatch), each on the rank owning the stage;
//  * data: every RUN's inputs exist on its rank when it runs (produced
//    earlier on the rank, or RECVed earlier), I before W, own F before B/I;
//  * buffers: every buffer that exists on a rank is freed exactly once, after
//    its last use; nothing is used after its FREE; nothing leaks;
//  * communication: every SEND has its matching RECV and vice versa;
//  * deadlock freedom under two models (see CommModel). A deadlock report
//    names the cycle of waiting ranks and instructions.
#pragma once
#include <string>
#include <vector>

#include "baton/plan.h"

namespace baton {

enum class CommModel {
  // Each communication group blocks the rank until every SEND in it has been
  // matched by the peer's RECV (rendezvous) and every RECV by its SEND.
  // Matching is by buffer (tagged). Any async executor that posts no later
  // and waits no earlier is deadlock-free if this model is. Exception: a SEND
  // of a skip buffer (plan.h Skip / SkipGrad) completes when posted, as every
  // Baton runtime buffers sends (the in-process hub hands the value over,
  // RankComm copies it into a transport-owned tensor, NCCL queues it on a
  // per-(link, channel) stream the compute never waits on); only its RECV
  // waits. A skip joins stages far apart in the schedule, so a rendezvous
  // send would wait on a receiver busy with earlier microbatches' work.
  Blocking,
  // Blocking, and additionally traffic from rank a to rank b travels in order
  // over one channel PER BUFFER KIND (activations and gradients on separate
  // channels; the runtime opens one communicator or tag class per kind): the
  // k-th SEND a->b of kind K matches the k-th RECV b<-a of kind K (as NCCL
  // point-to-point does within one communicator). A different buffer there is
  // a head-of-line mismatch. Traffic of different kinds is not ordered.
  Fifo,
};

struct Violation {
  std::string check;        // "structure", "data", "buffer", "comm", "deadlock", "summary"
  std::string message;      // full sentence naming ranks, instrs, stage, mb
  std::vector<int> ranks;   // ranks involved
  std::vector<int> instrs;  // instruction indices, parallel to `ranks`
  int stage = -1;
  int microbatch = -1;
};

// Messages start with their check ("data: ...", "buffer: ...", "comm: ...",
// "comm (fifo model): ...", "deadlock (blocking model): ...", "deadlock (fifo
// model): ...", or "deadlock (blocking and fifo models): ..." when both models
// stall the same way). A deadlock is reported as the cycle of blocked
// instructions ("rank 0 #4 SEND act(s0,m1)->1 waits for rank 1 #9 RECV
// act(s0,m1)<-0, but rank 1 is blocked at #7 ..., but rank 0 is blocked at #4:
// a cycle") and/or as the operations that can never complete ("... never gets
// its send: rank 0 finished"). At most 50 violations are listed; a final
// violation with check "summary" then says that more were left out.
struct VerifyReport {
  std::vector<Violation> violations;
  bool ok() const { return violations.empty(); }
  std::string to_string() const;  // "OK" or one line per violation
};

// Runs every check under both models.
VerifyReport verify(const Plan& plan);
// Deadlock check under one model only (also reports unmatched comm).
VerifyReport check_deadlock(const Plan& plan, CommModel model);
// Throws VerifyError with report.to_string() when not ok.
void verify_or_throw(const Plan& plan);

}  // namespace baton
