// The rank-program verifier's class, shared by its files: verify.cc
// (structure, post/wait, data, channels, deadlock) and verify_slots.cc.
#pragma once
#include <fmt/format.h>

#include <string>
#include <vector>

#include "baton/rank_program.h"

namespace baton::rankir_verify {

constexpr size_t kMaxViolations = 50;

template <class T>
bool in_range(const std::vector<T>& v, int32_t i) {
  return i >= 0 && i < static_cast<int32_t>(v.size());
}

// Per rank, what the scan of its instructions found.
struct RankScan {
  std::vector<int32_t> posted;  // per transfer: its POST instr, -1 when never posted
  std::vector<int32_t> seq;     // per transfer: FIFO position recomputed from post order
  std::vector<int32_t> freed;   // per buffer: its FREE instr, -1
};

class IRVerifier {
 public:
  IRVerifier(const RankIR& ir, VerifyReport& rep) : ir_(ir), plan_(ir.plan), rep_(rep) {}

  bool structure();
  void scan(int r);
  void slots(int r);  // verify_slots.cc
  void channels();
  void deadlock();
  bool clean() const { return rep_.violations.empty(); }
  void finish() {
    if (dropped_) {
      Violation v;
      v.check = "summary";
      v.message =
          fmt::format("... further violations not listed (the report stops at {})", kMaxViolations);
      rep_.violations.push_back(std::move(v));
    }
  }

 private:
  void add(const char* check, std::string msg, std::vector<int> ranks, std::vector<int> instrs,
           BufferKey k = {}) {
    if (rep_.violations.size() >= kMaxViolations) {
      dropped_ = true;
      return;
    }
    Violation v;
    v.check = check;
    v.message = fmt::format("{}: {}", check, msg);
    v.ranks = std::move(ranks);
    v.instrs = std::move(instrs);
    v.stage = k.stage;
    v.microbatch = k.microbatch;
    rep_.violations.push_back(std::move(v));
  }
  std::string d(int r, int i) const { return ir_.describe(r, i); }
  const RankProgram& prog(int r) const { return ir_.programs[r]; }
  std::string buf(int r, int32_t b) const { return plan_.describe_buffer(prog(r).buffers[b].id); }
  BufferKey key(int r, int32_t b) const { return prog(r).buffers[b].key; }
  // "SEND act(s0,m1)->1" / "RECV act(s0,m1)<-0"
  std::string tname(int r, int32_t t) const {
    const Transfer& x = prog(r).transfers[t];
    return fmt::format("{} {}{}{}", x.dir == TransferDir::Send ? "SEND" : "RECV", buf(r, x.buffer),
                       x.dir == TransferDir::Send ? "->" : "<-", x.peer);
  }
  // "rank 1 #0 POST g0: RECV act(s0,m0)<-0" (where it is posted), or
  // "rank 1: RECV act(s0,m0)<-0" for a transfer that is not posted.
  std::string at(int r, int32_t t) const {
    const int32_t i = scans_[r].posted[t];
    if (i < 0) return fmt::format("rank {}: {}", r, tname(r, t));
    return fmt::format("rank {} #{} POST g{}: {}", r, i, prog(r).instrs[i].group, tname(r, t));
  }
  // The instruction that best names transfer t: its POST, else its WAIT/FREE.
  int anchor(int r, int32_t t) const {
    if (scans_[r].posted[t] >= 0) return scans_[r].posted[t];
    return prog(r).transfers[t].wait;
  }

  const RankIR& ir_;
  const Plan& plan_;
  VerifyReport& rep_;
  bool dropped_ = false;
  std::vector<RankScan> scans_;
};

}  // namespace baton::rankir_verify
