// Verifier over a lowered Plan (checks documented in verify.h).
//
// Everything on the success path is linear in the number of instructions and
// allocation-light: per-buffer state lives in a dense array indexed by buffer
// id (reset after each rank through a touched list), SEND/RECV matching walks
// short per-buffer chains, and the abstract execution is a worklist over ranks
// that moves from communication group to communication group, posting and
// completing every op once. Strings are only built when something is wrong.
#include "baton/verify.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>

#include "baton/error.h"

namespace baton {

namespace {

constexpr size_t kMaxViolations = 50;

bool is_comm(OpCode op) { return op == OpCode::Send || op == OpCode::Recv; }

const char* ordinal_suffix(int n) {
  if (n % 100 >= 11 && n % 100 <= 13) return "th";
  switch (n % 10) {
    case 1:
      return "st";
    case 2:
      return "nd";
    case 3:
      return "rd";
    default:
      return "th";
  }
}

std::string ordinal(int n) { return fmt::format("{}{}", n, ordinal_suffix(n)); }

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

bool Verifier::structure() {
  try {
    s_.validate();
  } catch (const ScheduleError& e) {
    add("structure", fmt::format("structure: {}", e.what()), {}, {}, -1, -1);
    return false;
  }
  const int R = s_.num_ranks;
  if (static_cast<int>(plan_.programs.size()) != R) {
    add("structure",
        fmt::format("structure: plan has programs for {} ranks but the schedule has {} ranks",
                    plan_.programs.size(), R),
        {}, {}, -1, -1);
    return false;
  }
  const int32_t nbuf = plan_.num_buffer_ids();
  bool ok = true;
  for (int r = 0; r < R; ++r) {
    const auto& prog = plan_.programs[r];
    const auto& row = s_.rank_actions[r];
    std::vector<int32_t> run_at(row.size(), -1);
    for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
      const Instr& in = prog[i];
      auto bad = [&](std::string why) {
        ok = false;
        add("structure", fmt::format("structure: rank {} #{}: {}", r, i, why), {r}, {i}, -1, -1);
      };
      switch (in.op) {
        case OpCode::Run:
          if (in.action < 0 || in.action >= static_cast<int32_t>(row.size())) {
            bad(fmt::format("RUN names action {}, but rank {} has actions 0..{}", in.action, r,
                            static_cast<int>(row.size()) - 1));
          } else if (run_at[in.action] >= 0) {
            const Action& a = row[in.action];
            ok = false;
            add("structure",
                fmt::format("structure: rank {} #{} runs action {} ({}) again (first at #{})", r, i,
                            in.action, to_string(a), run_at[in.action]),
                {r, r}, {run_at[in.action], i}, a.first.stage, a.first.microbatch);
          } else {
            run_at[in.action] = i;
          }
          break;
        case OpCode::Send:
        case OpCode::Recv:
          if (in.peer < 0 || in.peer >= R || in.peer == r) {
            bad(fmt::format("{} names peer rank {} (ranks 0..{}, not itself)", opcode_name(in.op),
                            in.peer, R - 1));
            break;
          }
          [[fallthrough]];
        case OpCode::Free:
        case OpCode::Accumulate:
          if (in.buffer < 0 || in.buffer >= nbuf) {
            bad(fmt::format("{} names buffer id {}, out of range 0..{}", opcode_name(in.op),
                            in.buffer, nbuf - 1));
          } else if (in.op == OpCode::Accumulate && !is_wgrad(in.buffer)) {
            bad(fmt::format("ACCUMULATE of {}, which is not a weight gradient", buf(in.buffer)));
          }
          break;
        default:
          bad(fmt::format("unknown opcode {}", static_cast<int>(in.op)));
      }
    }
    for (size_t k = 0; k < row.size(); ++k) {
      if (run_at[k] >= 0) continue;
      ok = false;
      add("structure",
          fmt::format("structure: rank {} action {} ({}) is never RUN", r, k, to_string(row[k])),
          {r}, {-1}, row[k].first.stage, row[k].first.microbatch);
    }
  }
  return ok;
}

std::string Verifier::later_or_never(int r, int i, int32_t b) const {
  const auto& prog = plan_.programs[r];
  for (int j = i + 1; j < static_cast<int>(prog.size()); ++j) {
    const Instr& in = prog[j];
    if (in.op == OpCode::Recv && in.buffer == b) return fmt::format("received later at #{}", j);
    if (in.op == OpCode::Run && run_produces(r, j, b))
      return fmt::format("produced later at #{} ({})", j, op_text(r, j));
  }
  const int pr = plan_.producer_rank(b);
  if (pr == r) return fmt::format("never produced on rank {}", r);
  const auto& pprog = plan_.programs[pr];
  for (int j = 0; j < static_cast<int>(pprog.size()); ++j) {
    const Instr& in = pprog[j];
    if (in.op == OpCode::Send && in.buffer == b && in.peer == r)
      return fmt::format("never received by rank {} (rank {} sends it at #{})", r, pr, j);
  }
  return fmt::format("never received by rank {} (its producer on rank {} never sends it there)", r,
                     pr);
}

void Verifier::static_pass(bool report) {
  const int R = s_.num_ranks;
  const int32_t nbuf = plan_.num_buffer_ids();
  bufs_.assign(nbuf, BufState{});
  BufState* bs = bufs_.data();
  std::vector<int32_t> touched;
  first_bad_run_.assign(R, std::numeric_limits<int32_t>::max());
  rank_group_begin_.assign(R + 1, 0);
  n_ops_ = 0;
  chan_k_.clear();
  groups_.clear();
  size_t n_instr = 0;
  for (const auto& prog : plan_.programs) n_instr += prog.size();
  op_group_.clear();
  opi_.clear();
  eager_.clear();
  // Lowered plans have about one SEND or RECV in four instructions.
  op_group_.reserve(n_instr / 3);
  opi_.reserve(n_instr / 3);
  groups_.reserve(n_instr / 5);

  for (int r = 0; r < R; ++r) {
    rank_group_begin_[r] = static_cast<int32_t>(groups_.size());
    const auto& prog = plan_.programs[r];
    const int n = static_cast<int>(prog.size());
    touched.clear();
    auto touch = [&](int32_t b) {
      if (bs[b].first_send == 0) return;
      bs[b].first_send = 0;
      touched.push_back(b);
    };
    auto mark_bad_run = [&](int i, int32_t b) {
      if (!missing_input_.count({r, i})) missing_input_[{r, i}] = b;
      first_bad_run_[r] = std::min(first_bad_run_[r], static_cast<int32_t>(i));
    };
    int group_start = -1;
    for (int i = 0; i < n; ++i) {
      const Instr& in = prog[i];
      if (is_comm(in.op)) {
        if (i == 0 || !is_comm(prog[i - 1].op)) {
          group_start = i;
          groups_.push_back(Group{r, i, i, n_ops_, 0});
        }
        Group& g = groups_.back();
        g.end = i + 1;
        ++g.n_ops;
        ++n_ops_;
        op_group_.push_back(static_cast<int32_t>(groups_.size()) - 1);
        opi_.push_back(OpInfo{in.buffer, in.peer, r, in.op == OpCode::Send});
        eager_.push_back(in.op == OpCode::Send && in.buffer >= 0 && in.buffer < nbuf &&
                         is_skip(in.buffer));
      }
      switch (in.op) {
        case OpCode::Run: {
          const Action& a = s_.rank_actions[r][in.action];
          const Plan::ActionIO io = plan_.action_io(a);
          for (int k = 0; k < io.n_in; ++k) {
            const int32_t b = io.in[k];
            touch(b);
            if (bs[b].have < 0) {
              mark_bad_run(i, b);
              if (report && !full()) {
                const BufferKey bk = key(b);
                add("data",
                    fmt::format("data: {} needs {}, which is {}", d(r, i), buf(b),
                                later_or_never(r, i, b)),
                    {r}, {i}, bk.stage, bk.microbatch);
              }
            } else if (bs[b].freed >= 0 && report && !full()) {
              const BufferKey bk = key(b);
              add("buffer",
                  fmt::format("buffer: {} uses {} after {} (freed before its last use)", d(r, i),
                              buf(b), d(r, bs[b].freed)),
                  {r, r}, {bs[b].freed, i}, bk.stage, bk.microbatch);
            }
          }
          for (int k = 0; k < io.n_out; ++k) {
            const int32_t b = io.out[k];
            touch(b);
            if (bs[b].have >= 0) {
              if (report && !full()) {
                add("data",
                    fmt::format("data: {} produces {}, which already exists on rank {} (since #{})",
                                d(r, i), buf(b), r, bs[b].have),
                    {r, r}, {bs[b].have, i}, key(b).stage, key(b).microbatch);
              }
            } else {
              bs[b].have = i;
            }
          }
          break;
        }
        case OpCode::Recv: {
          const int32_t b = in.buffer;
          touch(b);
          if (bs[b].have >= 0) {
            if (report && !full())
              add("data",
                  fmt::format("data: {} receives {}, which already exists on rank {} (since #{})",
                              d(r, i), buf(b), r, bs[b].have),
                  {r, r}, {bs[b].have, i}, key(b).stage, key(b).microbatch);
          } else {
            bs[b].have = i;
          }
          break;
        }
        case OpCode::Send: {
          const int32_t b = in.buffer;
          touch(b);
          if (!report || full()) break;
          if (bs[b].have < 0) {
            add("data",
                fmt::format("data: {} sends {}, which is {}", d(r, i), buf(b),
                            later_or_never(r, i, b)),
                {r}, {i}, key(b).stage, key(b).microbatch);
          } else if (bs[b].have >= group_start) {
            add("data",
                fmt::format("data: {} sends {}, which is only received in the same group at #{}",
                            d(r, i), buf(b), bs[b].have),
                {r, r}, {bs[b].have, i}, key(b).stage, key(b).microbatch);
          } else if (bs[b].freed >= 0) {
            add("buffer",
                fmt::format("buffer: {} sends {} after {} (freed before its last use)", d(r, i),
                            buf(b), d(r, bs[b].freed)),
                {r, r}, {bs[b].freed, i}, key(b).stage, key(b).microbatch);
          }
          break;
        }
        case OpCode::Free: {
          const int32_t b = in.buffer;
          touch(b);
          if (bs[b].have < 0) {
            if (report && !full())
              add("buffer",
                  fmt::format("buffer: {} frees {}, which does not exist on rank {} at that point",
                              d(r, i), buf(b), r),
                  {r}, {i}, key(b).stage, key(b).microbatch);
          } else if (bs[b].freed >= 0) {
            if (report && !full())
              add("buffer",
                  fmt::format("buffer: {} frees {} twice: it was already freed by {}", d(r, i),
                              buf(b), d(r, bs[b].freed)),
                  {r, r}, {bs[b].freed, i}, key(b).stage, key(b).microbatch);
          } else {
            bs[b].freed = i;
            if (is_wgrad(b) && bs[b].acc < 0 && report && !full())
              add("data",
                  fmt::format("data: {} frees weight gradient {} before it is ACCUMULATEd", d(r, i),
                              buf(b)),
                  {r}, {i}, key(b).stage, key(b).microbatch);
          }
          break;
        }
        case OpCode::Accumulate: {
          const int32_t b = in.buffer;
          touch(b);
          if (!report || full()) {
            bs[b].acc = i;
            break;
          }
          if (bs[b].have < 0) {
            add("data",
                fmt::format("data: {} accumulates {}, which is {}", d(r, i), buf(b),
                            later_or_never(r, i, b)),
                {r}, {i}, key(b).stage, key(b).microbatch);
          } else if (bs[b].freed >= 0) {
            add("buffer",
                fmt::format("buffer: {} accumulates {} after {} (freed before its last use)",
                            d(r, i), buf(b), d(r, bs[b].freed)),
                {r, r}, {bs[b].freed, i}, key(b).stage, key(b).microbatch);
          } else if (bs[b].acc >= 0) {
            add("data",
                fmt::format("data: {} accumulates {} a second time (first at #{})", d(r, i), buf(b),
                            bs[b].acc),
                {r, r}, {bs[b].acc, i}, key(b).stage, key(b).microbatch);
          }
          bs[b].acc = i;
          break;
        }
      }
    }
    for (int32_t b : touched) {
      if (!report || full()) break;
      if (bs[b].have >= 0 && bs[b].freed < 0) {
        add("buffer",
            fmt::format("buffer: rank {}: {} (created by {}) is never freed", r, buf(b),
                        d(r, bs[b].have)),
            {r}, {bs[b].have}, key(b).stage, key(b).microbatch);
      }
      if (bs[b].have >= 0 && is_wgrad(b) && bs[b].acc < 0 && bs[b].freed < 0) {
        add("data",
            fmt::format("data: rank {}: weight gradient {} (from {}) is never ACCUMULATEd", r,
                        buf(b), d(r, bs[b].have)),
            {r}, {bs[b].have}, key(b).stage, key(b).microbatch);
      }
    }
    for (int32_t b : touched) bs[b] = BufState{};
  }
  rank_group_begin_[R] = static_cast<int32_t>(groups_.size());
}

void Verifier::match_by_buffer(bool report) {
  const int32_t n = n_ops_;
  const OpInfo* ops = opi_.data();
  // Channel positions for the fifo model: the k-th SEND a->b of a buffer
  // kind, the k-th RECV b<-a of that kind.
  chan_k_.resize(n);
  {
    std::vector<int32_t> send_cnt(num_channels(), 0), recv_cnt(send_cnt.size(), 0);
    for (int32_t o = 0; o < n; ++o) {
      const OpInfo& c = ops[o];
      chan_k_[o] = c.send ? send_cnt[channel(c.rank, c.peer, c.buffer)]++
                          : recv_cnt[channel(c.peer, c.rank, c.buffer)]++;
    }
  }
  // bufs_[b].first_send heads the chain of SENDs of b in program order,
  // linked through next.
  BufState* bs = bufs_.data();
  std::vector<int32_t> next(n, -1);
  for (int32_t o = n - 1; o >= 0; --o) {
    const OpInfo& c = ops[o];
    if (!c.send) continue;
    BufState& h = bs[c.buffer];
    next[o] = h.first_send;
    h.first_send = o;
    h.have = c.rank;     // head's rank
    h.freed = c.peer;    // head's peer
    h.acc = chan_k_[o];  // head's channel position
  }
  partner_buf_.assign(n, -1);
  int32_t matched = 0;
  positions_agree_ = true;
  for (int32_t o = 0; o < n; ++o) {
    const OpInfo& rv = ops[o];
    if (rv.send) continue;
    const BufState& h = bs[rv.buffer];
    int32_t q = h.first_send;
    if (q >= 0 && partner_buf_[q] < 0 && h.have == rv.peer && h.freed == rv.rank) {
      positions_agree_ &= h.acc == chan_k_[o];
    } else {
      for (q = q >= 0 ? next[q] : -1; q >= 0; q = next[q])
        if (partner_buf_[q] < 0 && ops[q].rank == rv.peer && ops[q].peer == rv.rank) break;
      if (q < 0) continue;
      positions_agree_ &= chan_k_[q] == chan_k_[o];
    }
    partner_buf_[q] = o;
    partner_buf_[o] = q;
    matched += 2;
  }
  positions_agree_ &= matched == n;
  if (!report) return;
  for (int32_t o = 0; o < n && !full(); ++o) {
    if (partner_buf_[o] >= 0) continue;
    const CommOp c = op(o);
    const BufferKey k = key(c.buffer);
    add("comm",
        fmt::format("comm: {} has no matching {} on rank {}", d(c.rank, c.instr),
                    c.send ? "RECV" : "SEND", c.peer),
        {c.rank}, {c.instr}, k.stage, k.microbatch);
  }
}

bool Verifier::fifo_pairing(bool report) {
  const int32_t n = n_ops_;
  // Every op matched by buffer at its channel position: same pairing.
  fifo_same_ = positions_agree_;
  if (fifo_same_) {
    partner_fifo_.clear();   // empty: same as partner_buf_
    mismatch_fifo_.clear();  // empty: no mismatch
    return true;
  }
  std::vector<std::vector<int32_t>> sends(num_channels()), recvs(sends.size());
  // Slow path: pair the k-th SEND a->b with the k-th RECV b<-a of each kind.
  for (int32_t o = 0; o < n; ++o) {
    const CommOp c = op(o);
    if (c.send)
      sends[channel(c.rank, c.peer, c.buffer)].push_back(o);
    else
      recvs[channel(c.peer, c.rank, c.buffer)].push_back(o);
  }
  partner_fifo_.assign(n, -1);
  mismatch_fifo_.assign(n, 0);
  for (size_t c = 0; c < sends.size(); ++c) {
    const size_t paired = std::min(sends[c].size(), recvs[c].size());
    bool reported = false;
    for (size_t k = 0; k < paired; ++k) {
      const int32_t so = sends[c][k], ro = recvs[c][k];
      partner_fifo_[so] = ro;
      partner_fifo_[ro] = so;
      if (op(so).buffer == op(ro).buffer) continue;
      mismatch_fifo_[so] = mismatch_fifo_[ro] = 1;
      if (!report || reported || full()) continue;
      reported = true;  // the first mismatch per channel explains the rest
      const CommOp s = op(so);
      const CommOp r = op(ro);
      const BufferKey bk = key(r.buffer);
      add("comm",
          fmt::format("comm (fifo model): head-of-line mismatch on the {} channel {}->{}: the {} "
                      "message is {}, but {} expects {}",
                      kind_name(s.buffer), s.rank, s.peer, ordinal(static_cast<int>(k) + 1),
                      d(s.rank, s.instr), d(r.rank, r.instr), buf(r.buffer)),
          {s.rank, r.rank}, {s.instr, r.instr}, bk.stage, bk.microbatch);
    }
  }
  // Same pairing after all (e.g. only unmatched ops): same execution.
  if (std::find(mismatch_fifo_.begin(), mismatch_fifo_.end(), 1) == mismatch_fifo_.end())
    mismatch_fifo_.clear();
  fifo_same_ = partner_fifo_ == partner_buf_ && mismatch_fifo_.empty();
  return fifo_same_;
}

void Verifier::execute(ExecState& st, const std::vector<int32_t>& partner,
                       const uint8_t* mismatch) const {
  // Only communication groups and RUNs lacking an input can block; FREE,
  // ACCUMULATE and other RUNs always complete, so a rank moves from group to
  // group. A rank that stops has st.pc at the blocking instruction.
  const int R = s_.num_ranks;
  st.pc.assign(R, 0);
  st.gcur.assign(R, 0);
  st.in_group.assign(R, 0);
  st.posted.assign(n_ops_, 0);
  st.done.assign(n_ops_, 0);
  st.pending.resize(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) st.pending[g] = groups_[g].n_ops;
  std::vector<int32_t> work;
  work.reserve(R);
  for (int r = R - 1; r >= 0; --r) work.push_back(r);
  while (!work.empty()) {
    const int r = work.back();
    work.pop_back();
    const int32_t bad = first_bad_run_[r];
    const int32_t g_end = rank_group_begin_[r + 1];
    for (;;) {
      const int32_t g = rank_group_begin_[r] + st.gcur[r];
      if (g == g_end) {
        st.pc[r] = std::min(bad, static_cast<int32_t>(plan_.programs[r].size()));
        break;
      }
      const Group& grp = groups_[g];
      if (bad < grp.begin) {
        st.pc[r] = bad;
        break;
      }
      if (!st.in_group[r]) {
        st.in_group[r] = 1;
        for (int32_t o = grp.first_op; o < grp.first_op + grp.n_ops; ++o) {
          st.posted[o] = 1;
          // A skip SEND is buffered: its group does not wait for the RECV.
          if (eager_[o]) --st.pending[g];
          const int32_t q = partner[o];
          if (q < 0 || !st.posted[q] || (mismatch && mismatch[o])) continue;
          st.done[o] = st.done[q] = 1;
          if (!eager_[o]) --st.pending[g];
          const int32_t gq = op_group_[q];
          if (!eager_[q] && --st.pending[gq] == 0) work.push_back(groups_[gq].rank);
        }
      }
      if (st.pending[g] > 0) {
        st.pc[r] = grp.begin;
        break;
      }
      st.in_group[r] = 0;
      ++st.gcur[r];
    }
  }
}

void Verifier::report_deadlock(const ExecState& st, const std::vector<int32_t>& partner,
                               const uint8_t* mismatch, const char* label) {
  const int R = s_.num_ranks;
  auto finished = [&](int r) { return st.pc[r] >= static_cast<int32_t>(plan_.programs[r].size()); };
  // Wait-for edges: rank -> (op it waits on, partner op not yet posted).
  struct Edge {
    int32_t op, target;
  };
  std::vector<std::vector<Edge>> edges(R);
  struct Terminal {
    int rank;
    int32_t op;  // -1: a RUN that lacks an input
  };
  std::vector<Terminal> terminals;
  for (int r = 0; r < R; ++r) {
    if (finished(r)) continue;
    const Instr& in = plan_.programs[r][st.pc[r]];
    if (in.op == OpCode::Run) {
      terminals.push_back({r, -1});
      continue;
    }
    const Group& g = groups_[rank_group_begin_[r] + st.gcur[r]];
    for (int32_t o = g.first_op; o < g.first_op + g.n_ops; ++o) {
      if (st.done[o] || eager_[o]) continue;
      const int32_t q = partner[o];
      if (q < 0 || (mismatch && mismatch[o])) {
        terminals.push_back({r, o});
        continue;
      }
      if (!st.posted[q]) edges[r].push_back({o, q});
    }
  }
  // Find one cycle among the ranks (iterative DFS, colors 0 new 1 open 2 done).
  std::vector<uint8_t> color(R, 0);
  std::vector<Edge> cycle;
  for (int root = 0; root < R && cycle.empty(); ++root) {
    if (color[root] || edges[root].empty()) continue;
    std::vector<std::pair<int, size_t>> stack{{root, 0}};
    std::vector<Edge> path;  // edge taken out of each open node but the top
    color[root] = 1;
    while (!stack.empty() && cycle.empty()) {
      auto& [u, ei] = stack.back();
      if (ei == edges[u].size()) {
        color[u] = 2;
        stack.pop_back();
        if (!path.empty()) path.pop_back();
        continue;
      }
      const Edge e = edges[u][ei++];
      const int v = op(e.target).rank;
      if (color[v] == 1) {
        // Cycle: from v along the path to u, then e back to v.
        path.push_back(e);
        size_t start = 0;
        while (op(path[start].op).rank != v) ++start;
        cycle.assign(path.begin() + static_cast<std::ptrdiff_t>(start), path.end());
      } else if (color[v] == 0) {
        color[v] = 1;
        path.push_back(e);
        stack.push_back({v, 0});
      }
    }
  }
  if (!cycle.empty() && !full()) {
    const CommOp o0 = op(cycle[0].op);
    const CommOp t0 = op(cycle[0].target);
    std::string msg = fmt::format("deadlock ({}): {} waits for {}", label, d(o0.rank, o0.instr),
                                  d(t0.rank, t0.instr));
    std::vector<int> ranks{o0.rank}, instrs{o0.instr};
    for (size_t i = 1; i < cycle.size(); ++i) {
      const CommOp o = op(cycle[i].op);
      const CommOp t = op(cycle[i].target);
      msg += fmt::format(", but rank {} is blocked at #{} {}, which waits for {}", o.rank, o.instr,
                         op_text(o.rank, o.instr), d(t.rank, t.instr));
      ranks.push_back(o.rank);
      instrs.push_back(o.instr);
    }
    msg += fmt::format(", but rank {} is blocked at #{}: a cycle", o0.rank, o0.instr);
    const BufferKey k = key(o0.buffer);
    add("deadlock", std::move(msg), std::move(ranks), std::move(instrs), k.stage, k.microbatch);
  }
  std::vector<uint8_t> reported_pair;  // mismatched pairs are reported once
  for (const Terminal& t : terminals) {
    if (full()) break;
    if (t.op >= 0 && partner[t.op] >= 0) {
      if (reported_pair.empty()) reported_pair.assign(n_ops_, 0);
      const int32_t lo = std::min(t.op, partner[t.op]);
      if (reported_pair[lo]) continue;
      reported_pair[lo] = 1;
    }
    if (t.op < 0) {
      const int i = st.pc[t.rank];
      const Action& a = action_at(t.rank, i);
      const auto it = missing_input_.find({t.rank, i});
      const std::string what = it != missing_input_.end() ? buf(it->second) : "an input";
      add("deadlock",
          fmt::format("deadlock ({}): {} can never run: {} is not present on rank {} when it is "
                      "reached (see data)",
                      label, d(t.rank, i), what, t.rank),
          {t.rank}, {i}, a.first.stage, a.first.microbatch);
      continue;
    }
    const CommOp o = op(t.op);
    const BufferKey k = key(o.buffer);
    const int32_t q = partner[t.op];
    if (q >= 0) {
      const CommOp p = op(q);
      const CommOp& s = o.send ? o : p;
      add("deadlock",
          fmt::format("deadlock ({}): {} is paired with {} as the {} {} message {}->{}, which is "
                      "a different buffer (head-of-line mismatch)",
                      label, d(o.rank, o.instr), d(p.rank, p.instr), ordinal(s.chan_k + 1),
                      kind_name(s.buffer), s.rank, s.peer),
          {o.rank, p.rank}, {o.instr, p.instr}, k.stage, k.microbatch);
      continue;
    }
    const char* other = o.send ? "receive" : "send";
    std::string why;
    if (finished(o.peer)) {
      why = fmt::format("rank {} finished", o.peer);
    } else {
      why = fmt::format("rank {} has no matching {} (it is blocked at {})", o.peer,
                        o.send ? "RECV" : "SEND", d(o.peer, st.pc[o.peer]));
    }
    add("deadlock",
        fmt::format("deadlock ({}): {} never gets its {}: {}", label, d(o.rank, o.instr), other,
                    why),
        {o.rank}, {o.instr}, k.stage, k.microbatch);
  }
  if (cycle.empty() && terminals.empty() && !full()) {
    // Not expected: every stuck rank either waits on a stuck rank (so a cycle
    // or a terminal exists) or is itself terminal. Report the stuck ranks.
    std::string msg = fmt::format("deadlock ({}): stuck at", label);
    std::vector<int> ranks, instrs;
    for (int r = 0; r < R; ++r) {
      if (finished(r)) continue;
      msg += " " + d(r, st.pc[r]) + ";";
      ranks.push_back(r);
      instrs.push_back(st.pc[r]);
    }
    add("deadlock", std::move(msg), std::move(ranks), std::move(instrs), -1, -1);
  }
}

void Verifier::check_model(bool fifo, const char* label) {
  const auto& partner = fifo && !fifo_same_ ? partner_fifo_ : partner_buf_;
  const uint8_t* mm = fifo && !mismatch_fifo_.empty() ? mismatch_fifo_.data() : nullptr;
  ExecState st;
  execute(st, partner, mm);
  for (int r = 0; r < s_.num_ranks; ++r) {
    if (st.pc[r] < static_cast<int32_t>(plan_.programs[r].size())) {
      report_deadlock(st, partner, mm, label);
      return;
    }
  }
}

}  // namespace

std::string VerifyReport::to_string() const {
  if (violations.empty()) return "OK";
  std::string out;
  for (size_t i = 0; i < violations.size(); ++i) {
    if (i) out += '\n';
    out += violations[i].message;
  }
  return out;
}

VerifyReport verify(const Plan& plan) {
  VerifyReport rep;
  {
    Verifier v(plan, rep);
    if (!v.structure()) return rep;
    v.static_pass(true);
    v.match_by_buffer(true);
    if (v.fifo_pairing(true)) {
      v.check_model(false, "blocking and fifo models");
    } else {
      v.check_model(false, "blocking model");
      v.check_model(true, "fifo model");
    }
  }
  return rep;
}

VerifyReport check_deadlock(const Plan& plan, CommModel model) {
  VerifyReport rep;
  {
    Verifier v(plan, rep);
    if (!v.structure()) return rep;
    v.static_pass(false);
    v.match_by_buffer(true);
    if (model == CommModel::Fifo) {
      v.fifo_pairing(true);
      v.check_model(true, "fifo model");
    } else {
      v.check_model(false, "blocking model");
    }
  }
  return rep;
}

void verify_or_throw(const Plan& plan) {
  VerifyReport rep = verify(plan);
  if (!rep.ok()) throw VerifyError(rep.to_string());
}

}  // namespace baton
