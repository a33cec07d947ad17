// Internal (not installed): the verifier's state, shared by verify.cc
// (structure, entry points), verify_data.cc (static pass), verify_comm.cc
// (SEND/RECV matching) and verify_deadlock.cc (abstract execution).
#pragma once
#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "baton/plan.h"
#include "baton/verify.h"

namespace baton::verify_detail {

inline constexpr size_t kMaxViolations = 50;

inline bool is_comm(OpCode op) { return op == OpCode::Send || op == OpCode::Recv; }

// "1st", "2nd", "3rd", "4th", ..., "11th", ...
std::string ordinal(int n);

// One SEND or RECV, as materialized by Verifier::op() (off the hot paths).
struct CommOp {
  int32_t rank = 0, instr = 0, buffer = 0, peer = 0;
  int32_t group = 0;
  int32_t chan_k = 0;  // position among this direction's ops on channel (src, dst, kind)
  bool send = false;
};

// A maximal run of consecutive SEND/RECV instructions on one rank.
struct Group {
  int32_t rank = 0, begin = 0, end = 0;  // instruction range [begin, end)
  int32_t first_op = 0, n_ops = 0;       // range in ops
};

// Dense copy of what the matching passes read of each SEND/RECV (reading it
// from the programs instead touches one cache line per op).
struct OpInfo {
  int32_t buffer = 0, peer = 0, rank = 0;
  bool send = false;
};

// Per-buffer state of the rank being scanned (static pass): instruction
// indices where the buffer appeared, was freed, was accumulated; first_send
// marks the entries touched by this rank (they are reset after the rank).
// Matching then reuses the fields for the first SEND of the buffer: its op,
// rank, peer and channel position, so that the common case -- one SEND and
// one RECV per buffer -- needs one lookup.
struct BufState {
  int32_t have = -1, freed = -1, acc = -1;
  int32_t first_send = -1;
};

struct ExecState {
  std::vector<int32_t> pc;            // per rank: next instruction
  std::vector<int32_t> gcur;          // per rank: index of the next group among its groups
  std::vector<uint8_t> in_group;      // per rank: posted the ops of its current group
  std::vector<uint8_t> posted, done;  // per op
  std::vector<int32_t> pending;       // per group: ops not yet complete
};

class Verifier {
 public:
  Verifier(const Plan& plan, VerifyReport& rep) : plan_(plan), s_(plan.schedule), rep_(rep) {}

  ~Verifier() {
    if (dropped_ > 0) {
      Violation v;
      v.check = "summary";
      v.message =
          fmt::format("... further violations not listed (the report stops at {})", kMaxViolations);
      rep_.violations.push_back(std::move(v));
    }
  }

  bool structure();
  void static_pass(bool report);
  void match_by_buffer(bool report);
  // Pairs ops positionally per channel; returns true when that pairing is the
  // same as the pairing by buffer (then the fifo execution equals the
  // blocking one).
  bool fifo_pairing(bool report);
  void check_model(bool fifo, const char* label);

 private:
  void add(const char* check, std::string message, std::vector<int> ranks, std::vector<int> instrs,
           int stage, int microbatch) {
    if (full()) return;
    Violation v;
    v.check = check;
    v.message = std::move(message);
    v.ranks = std::move(ranks);
    v.instrs = std::move(instrs);
    v.stage = stage;
    v.microbatch = microbatch;
    rep_.violations.push_back(std::move(v));
  }
  // True once the report is full; remembers that something was left out.
  bool full() {
    if (rep_.violations.size() < kMaxViolations) return false;
    dropped_ = 1;
    return true;
  }
  std::string d(int rank, int instr) const { return plan_.describe(rank, instr); }
  // The instruction without its "rank R #I " prefix, e.g. "RECV act(s0,m1)<-0".
  std::string op_text(int rank, int instr) const {
    return d(rank, instr).substr(fmt::formatted_size("rank {} #{} ", rank, instr));
  }
  std::string buf(int32_t b) const { return plan_.describe_buffer(b); }
  BufferKey key(int32_t b) const { return plan_.buffer_key(b); }
  const Action& action_at(int rank, int instr) const {
    return s_.rank_actions[rank][plan_.programs[rank][instr].action];
  }
  bool run_produces(int rank, int instr, int32_t b) const {
    const Plan::ActionIO io = plan_.action_io(action_at(rank, instr));
    for (int i = 0; i < io.n_out; ++i)
      if (io.out[i] == b) return true;
    return false;
  }
  // Where buffer b appears on rank r after instruction i (RUN producing it or
  // RECV of it): "received later at #6" / "produced later at #6 (RUN I0.1)".
  std::string later_or_never(int r, int i, int32_t b) const;
  void report_deadlock(const ExecState& st, const std::vector<int32_t>& partner,
                       const uint8_t* mismatch, const char* label);
  void execute(ExecState& st, const std::vector<int32_t>& partner, const uint8_t* mismatch) const;

  const Plan& plan_;
  const Schedule& s_;
  VerifyReport& rep_;
  size_t dropped_ = 0;

  CommOp op(int32_t o) const {
    CommOp c;
    c.group = op_group_[o];
    const Group& g = groups_[c.group];
    c.rank = g.rank;
    c.instr = g.begin + (o - g.first_op);
    const Instr& in = plan_.programs[g.rank][c.instr];
    c.buffer = in.buffer;
    c.peer = in.peer;
    c.send = in.op == OpCode::Send;
    c.chan_k = chan_k_.empty() ? -1 : chan_k_[o];
    return c;
  }
  int kind_of(int32_t b) const {  // buffer kind, or its Plan::channel for skip edges
    return plan_.channel(b);
  }
  bool is_wgrad(int32_t b) const { return kind_of(b) == static_cast<int>(BufKind::WGrad); }
  bool is_skip(int32_t b) const { return kind_of(b) >= kNumBufKinds; }
  const char* kind_name(int32_t b) const { return buf_kind_name(plan_.buffer_key(b).kind); }
  // Fifo model: one ordered channel per (sender, receiver, Plan::channel):
  // per buffer kind, and per skip edge and direction.
  size_t channel(int src, int dst, int32_t b) const {
    return (static_cast<size_t>(src) * s_.num_ranks + dst) * plan_.num_channels() + kind_of(b);
  }
  size_t num_channels() const {
    return static_cast<size_t>(s_.num_ranks) * s_.num_ranks * plan_.num_channels();
  }

  std::vector<BufState> bufs_;
  // Communication ops are numbered densely in program order (rank by rank);
  // the ops of a group are its instructions. op() rebuilds the full record.
  int32_t n_ops_ = 0;
  std::vector<int32_t> op_group_;
  std::vector<OpInfo> opi_;
  // Per op: a SEND of a skip buffer, which completes when posted (see
  // execute: the runtimes buffer sends; only receives wait).
  std::vector<uint8_t> eager_;
  std::vector<int32_t> chan_k_;  // per op, set by match_by_buffer
  std::vector<Group> groups_;
  std::vector<int32_t> rank_group_begin_;  // per rank + 1
  // Per rank: the first RUN that lacks an input (it never runs), or INT32_MAX.
  std::vector<int32_t> first_bad_run_;
  std::map<std::pair<int, int>, int32_t> missing_input_;  // (rank, instr) -> buffer
  std::vector<int32_t> partner_buf_, partner_fifo_;
  std::vector<uint8_t> mismatch_fifo_;
  bool fifo_same_ = true;
  bool positions_agree_ = true;  // set by match_by_buffer
};

}  // namespace baton::verify_detail
