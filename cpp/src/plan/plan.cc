// Plan methods: buffer ids, task inputs/outputs, text forms, fingerprint.
#include "baton/plan.h"

#include <fmt/format.h>

#include <cstring>

#include "baton/error.h"

namespace baton {

BuildCounters& build_counters() {
  static BuildCounters counters;
  return counters;
}

const char* buf_kind_name(BufKind k) {
  switch (k) {
    case BufKind::Act:
      return "act";
    case BufKind::Grad:
      return "grad";
    case BufKind::Stash:
      return "stash";
    case BufKind::WStash:
      return "wstash";
    case BufKind::WGrad:
      return "wgrad";
    case BufKind::Skip:
      return "skip";
    case BufKind::SkipGrad:
      return "skipgrad";
  }
  return "?";
}

const char* opcode_name(OpCode op) {
  switch (op) {
    case OpCode::Run:
      return "RUN";
    case OpCode::Send:
      return "SEND";
    case OpCode::Recv:
      return "RECV";
    case OpCode::Free:
      return "FREE";
    case OpCode::Accumulate:
      return "ACCUMULATE";
  }
  return "?";
}

int32_t Plan::buffer_id(BufferKey k) const {
  const int32_t S = schedule.num_stages, M = schedule.num_microbatches;
  const int32_t E = static_cast<int32_t>(skips.size());
  const int kind = static_cast<int>(k.kind);
  const bool skip = k.kind == BufKind::Skip || k.kind == BufKind::SkipGrad;
  const int32_t n = skip ? E : S;
  if (kind < 0 || kind > static_cast<int>(BufKind::SkipGrad) || k.stage < 0 || k.stage >= n ||
      k.microbatch < 0 || k.microbatch >= M) {
    throw ScheduleError(fmt::format(
        "buffer {}({}{},m{}) is out of range ({} 0..{}, microbatches 0..{})",
        buf_kind_name(k.kind), skip ? "e" : "s", k.stage, k.microbatch,
        skip ? "skip edges" : "stages", n - 1, M - 1));
  }
  if (!skip) return (kind * S + k.stage) * M + k.microbatch;
  const int32_t row = kNumBufKinds * S + (k.kind == BufKind::SkipGrad ? E : 0) + k.stage;
  return row * M + k.microbatch;
}

BufferKey Plan::buffer_key(int32_t id) const {
  const int32_t S = schedule.num_stages, M = schedule.num_microbatches;
  const int32_t E = static_cast<int32_t>(skips.size());
  if (id < 0 || id >= num_buffer_ids()) {
    throw ScheduleError(
        fmt::format("buffer id {} is out of range 0..{}", id, num_buffer_ids() - 1));
  }
  BufferKey k;
  k.microbatch = id % M;
  const int32_t row = id / M;
  if (row < kNumBufKinds * S) {
    k.stage = row % S;
    k.kind = static_cast<BufKind>(row / S);
  } else {
    const int32_t e = row - kNumBufKinds * S;
    k.kind = e < E ? BufKind::Skip : BufKind::SkipGrad;
    k.stage = e < E ? e : e - E;
  }
  return k;
}

int32_t Plan::num_buffer_ids() const {
  if (schedule.num_stages <= 0 || schedule.num_microbatches <= 0) return 0;
  return (kNumBufKinds * schedule.num_stages + 2 * static_cast<int32_t>(skips.size())) *
         schedule.num_microbatches;
}

int Plan::channel(int32_t id) const {
  const int32_t row = id / schedule.num_microbatches;
  const int32_t S = schedule.num_stages;
  return row < kNumBufKinds * S ? row / S : kNumBufKinds + (row - kNumBufKinds * S);
}

namespace {

// Appends the ids of one task's inputs / outputs. No validation beyond what
// the id formula needs (callers validate the schedule first).
int task_in(const Plan& p, const Task& t, int32_t* out) {
  const int32_t S = p.schedule.num_stages, M = p.schedule.num_microbatches;
  const int32_t E = static_cast<int32_t>(p.skips.size());
  auto id = [&](BufKind k, int32_t s) { return (static_cast<int>(k) * S + s) * M + t.microbatch; };
  auto skip = [&](bool grad, int32_t e) {
    return (kNumBufKinds * S + (grad ? E : 0) + e) * M + t.microbatch;
  };
  int n = 0;
  switch (t.kind) {
    case TaskKind::F:
      if (t.stage > 0) out[n++] = id(BufKind::Act, t.stage - 1);
      for (int32_t e = 0; e < E; ++e)
        if (p.skips[e].to == t.stage && p.skips[e].forward) out[n++] = skip(false, e);
      break;
    case TaskKind::B:
    case TaskKind::I:
      out[n++] = id(BufKind::Stash, t.stage);
      if (t.stage < S - 1) out[n++] = id(BufKind::Grad, t.stage + 1);
      for (int32_t e = 0; e < E; ++e)
        if (p.skips[e].from == t.stage && p.skips[e].backward) out[n++] = skip(true, e);
      break;
    case TaskKind::W:
      out[n++] = id(BufKind::WStash, t.stage);
      break;
  }
  return n;
}

int task_out(const Plan& p, const Task& t, int32_t* out) {
  const int32_t S = p.schedule.num_stages, M = p.schedule.num_microbatches;
  const int32_t E = static_cast<int32_t>(p.skips.size());
  auto id = [&](BufKind k, int32_t s) { return (static_cast<int>(k) * S + s) * M + t.microbatch; };
  auto skip = [&](bool grad, int32_t e) {
    return (kNumBufKinds * S + (grad ? E : 0) + e) * M + t.microbatch;
  };
  int n = 0;
  switch (t.kind) {
    case TaskKind::F:
      if (t.stage < S - 1) out[n++] = id(BufKind::Act, t.stage);
      for (int32_t e = 0; e < E; ++e)
        if (p.skips[e].from == t.stage && p.skips[e].forward) out[n++] = skip(false, e);
      out[n++] = id(BufKind::Stash, t.stage);
      break;
    case TaskKind::B:
      if (t.stage > 0) out[n++] = id(BufKind::Grad, t.stage);
      for (int32_t e = 0; e < E; ++e)
        if (p.skips[e].to == t.stage && p.skips[e].backward) out[n++] = skip(true, e);
      out[n++] = id(BufKind::WGrad, t.stage);
      break;
    case TaskKind::I:
      if (t.stage > 0) out[n++] = id(BufKind::Grad, t.stage);
      for (int32_t e = 0; e < E; ++e)
        if (p.skips[e].to == t.stage && p.skips[e].backward) out[n++] = skip(true, e);
      out[n++] = id(BufKind::WStash, t.stage);
      break;
    case TaskKind::W:
      out[n++] = id(BufKind::WGrad, t.stage);
      break;
  }
  return n;
}

void check_task(const Plan& p, const Task& t) {
  const int k = static_cast<int>(t.kind);
  if (k < 0 || k > 3 || t.stage < 0 || t.stage >= p.schedule.num_stages || t.microbatch < 0 ||
      t.microbatch >= p.schedule.num_microbatches) {
    throw ScheduleError(fmt::format("task {} is out of range (stages 0..{}, microbatches 0..{})",
                                    to_string(t), p.schedule.num_stages - 1,
                                    p.schedule.num_microbatches - 1));
  }
}

}  // namespace

std::vector<int32_t> Plan::task_inputs(const Task& t) const {
  check_task(*this, t);
  int32_t buf[kMaxIO];
  const int n = task_in(*this, t, buf);
  return {buf, buf + n};
}

std::vector<int32_t> Plan::task_outputs(const Task& t) const {
  check_task(*this, t);
  int32_t buf[kMaxIO];
  const int n = task_out(*this, t, buf);
  return {buf, buf + n};
}

std::vector<int32_t> Plan::receive_posts(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(programs.size()))
    throw ScheduleError(fmt::format("rank {} is out of range (0..{})", rank, programs.size() - 1));
  const auto& prog = programs[static_cast<size_t>(rank)];
  std::vector<int32_t> out(prog.size(), -1);
  int32_t last_run = -1;
  for (size_t j = 0; j < prog.size(); ++j) {
    if (prog[j].op == OpCode::Run) last_run = static_cast<int32_t>(j);
    else if (prog[j].op == OpCode::Recv)
      out[j] = last_run >= 0 ? last_run : static_cast<int32_t>(j);
  }
  return out;
}

void Plan::task_io(const Task& t, int32_t* in, int& n_in, int32_t* out, int& n_out) const {
  n_in = task_in(*this, t, in);
  n_out = task_out(*this, t, out);
}

Plan::ActionIO Plan::action_io(const Action& a) const {
  ActionIO io;
  io.n_in = task_in(*this, a.first, io.in);
  io.n_out = task_out(*this, a.first, io.out);
  if (!a.is_fused()) return io;
  int32_t in2[kMaxIO], out2[kMaxIO];
  const int n_in2 = task_in(*this, a.second, in2);
  const int n_out2 = task_out(*this, a.second, out2);
  auto contains = [](const int32_t* xs, int n, int32_t x) {
    for (int i = 0; i < n; ++i)
      if (xs[i] == x) return true;
    return false;
  };
  // Inputs of the first task produced by the second (or vice versa) are
  // internal to the action.
  int keep = 0;
  for (int i = 0; i < io.n_in; ++i) {
    if (contains(out2, n_out2, io.in[i])) {
      io.internal[io.n_internal++] = io.in[i];
    } else {
      io.in[keep++] = io.in[i];
    }
  }
  io.n_in = keep;
  for (int i = 0; i < n_in2; ++i) {
    const int32_t b = in2[i];
    if (contains(io.out, io.n_out, b)) {
      if (!contains(io.internal, io.n_internal, b)) io.internal[io.n_internal++] = b;
    } else if (!contains(io.in, io.n_in, b)) {
      io.in[io.n_in++] = b;
    }
  }
  for (int i = 0; i < n_out2; ++i)
    if (!contains(io.out, io.n_out, out2[i])) io.out[io.n_out++] = out2[i];
  return io;
}

std::vector<int32_t> Plan::action_inputs(const Action& a) const {
  check_task(*this, a.first);
  if (a.is_fused()) check_task(*this, a.second);
  const ActionIO io = action_io(a);
  return {io.in, io.in + io.n_in};
}

std::vector<int32_t> Plan::action_outputs(const Action& a) const {
  check_task(*this, a.first);
  if (a.is_fused()) check_task(*this, a.second);
  const ActionIO io = action_io(a);
  return {io.out, io.out + io.n_out};
}

int Plan::producer_stage(int32_t id) const {
  const BufferKey k = buffer_key(id);
  switch (k.kind) {
    case BufKind::Skip:
      return skips[k.stage].from;
    case BufKind::SkipGrad:
      return skips[k.stage].to;
    default:
      return k.stage;
  }
}

int Plan::consumer_stage(int32_t id) const {
  const BufferKey k = buffer_key(id);
  switch (k.kind) {
    case BufKind::Act:
      return k.stage + 1 < schedule.num_stages ? k.stage + 1 : -1;
    case BufKind::Grad:
      return k.stage > 0 ? k.stage - 1 : -1;
    case BufKind::Stash:
    case BufKind::WStash:
      return k.stage;
    case BufKind::WGrad:
      return -1;
    case BufKind::Skip:
      return skips[k.stage].to;
    case BufKind::SkipGrad:
      return skips[k.stage].from;
  }
  return -1;
}

int Plan::producer_rank(int32_t id) const { return schedule.stage_rank[producer_stage(id)]; }

int Plan::consumer_rank(int32_t id) const {
  const int s = consumer_stage(id);
  return s < 0 ? -1 : schedule.stage_rank[s];
}

std::string Plan::describe_buffer(int32_t id) const {
  if (id < 0 || id >= num_buffer_ids()) return fmt::format("buffer#{}?", id);
  const BufferKey k = buffer_key(id);
  if (k.kind == BufKind::Skip || k.kind == BufKind::SkipGrad) {
    const SkipEdge& e = skips[k.stage];
    return k.kind == BufKind::Skip
               ? fmt::format("skip(s{}->s{},m{})", e.from, e.to, k.microbatch)
               : fmt::format("skipgrad(s{}->s{},m{})", e.to, e.from, k.microbatch);
  }
  return fmt::format("{}(s{},m{})", buf_kind_name(k.kind), k.stage, k.microbatch);
}

namespace {

std::string describe_instr(const Plan& p, int rank, const Instr& in) {
  switch (in.op) {
    case OpCode::Run: {
      const bool ok = rank >= 0 && rank < static_cast<int>(p.schedule.rank_actions.size()) &&
                      in.action >= 0 &&
                      in.action < static_cast<int>(p.schedule.rank_actions[rank].size());
      return ok ? fmt::format("RUN {}", to_string(p.schedule.rank_actions[rank][in.action]))
                : fmt::format("RUN action#{}?", in.action);
    }
    case OpCode::Send:
      return fmt::format("SEND {}->{}", p.describe_buffer(in.buffer), in.peer);
    case OpCode::Recv:
      return fmt::format("RECV {}<-{}", p.describe_buffer(in.buffer), in.peer);
    case OpCode::Free:
      return fmt::format("FREE {}", p.describe_buffer(in.buffer));
    case OpCode::Accumulate:
      return fmt::format("ACCUMULATE {}", p.describe_buffer(in.buffer));
  }
  return fmt::format("op#{}?", static_cast<int>(in.op));
}

}  // namespace

std::string Plan::describe(int rank, int index) const {
  if (rank < 0 || rank >= static_cast<int>(programs.size()) || index < 0 ||
      index >= static_cast<int>(programs[rank].size())) {
    return fmt::format("rank {} #{} (no such instruction)", rank, index);
  }
  return fmt::format("rank {} #{} {}", rank, index,
                     describe_instr(*this, rank, programs[rank][index]));
}

std::string Plan::to_text() const {
  std::string out = fmt::format("plan {}: ranks {}, stages {}, microbatches {}\n", schedule.name,
                                schedule.num_ranks, schedule.num_stages, schedule.num_microbatches);
  if (!skips.empty()) {
    out += "skips:";
    for (const SkipEdge& e : skips)
      out += fmt::format(" s{}->s{}{}", e.from, e.to,
                         e.forward && e.backward ? "" : e.forward ? "(fwd)" : "(bwd)");
    out += "\n";
  }
  for (size_t r = 0; r < programs.size(); ++r) {
    out += fmt::format("rank {}: {} instructions\n", r, programs[r].size());
    for (size_t i = 0; i < programs[r].size(); ++i) {
      out +=
          fmt::format("  #{} {}\n", i, describe_instr(*this, static_cast<int>(r), programs[r][i]));
    }
  }
  return out;
}

namespace {

// FNV-1a 64 over a canonical little-endian serialization: a format tag, the
// schedule (name, sizes, placement, every action as kind/stage/microbatch of
// both task slots) and each rank's program (opcode byte, then the fields that
// opcode uses: RUN action; SEND/RECV buffer, peer; FREE/ACCUMULATE buffer).
class Fnv {
 public:
  void byte(uint8_t b) {
    h_ ^= b;
    h_ *= 1099511628211ULL;
  }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) byte(static_cast<uint8_t>(v >> (8 * i)));
  }
  void i32(int32_t v) { u32(static_cast<uint32_t>(v)); }
  void str(const std::string& s) {
    u32(static_cast<uint32_t>(s.size()));
    for (char c : s) byte(static_cast<uint8_t>(c));
  }
  void task(const Task& t) {
    byte(static_cast<uint8_t>(t.kind));
    i32(t.stage);
    i32(t.microbatch);
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 14695981039346656037ULL;
};

}  // namespace

std::string Plan::fingerprint() const {
  Fnv h;
  h.str("baton-plan 1");
  const Schedule& s = schedule;
  h.str(s.name);
  h.i32(s.num_ranks);
  h.i32(s.num_stages);
  h.i32(s.num_microbatches);
  h.u32(static_cast<uint32_t>(s.stage_rank.size()));
  for (int32_t r : s.stage_rank) h.i32(r);
  h.u32(static_cast<uint32_t>(s.rank_actions.size()));
  for (const auto& row : s.rank_actions) {
    h.u32(static_cast<uint32_t>(row.size()));
    for (const Action& a : row) {
      h.task(a.first);
      h.task(a.second);
    }
  }
  h.u32(static_cast<uint32_t>(programs.size()));
  for (const auto& prog : programs) {
    h.u32(static_cast<uint32_t>(prog.size()));
    // Only the fields an opcode uses are part of its canonical form.
    for (const Instr& in : prog) {
      h.byte(static_cast<uint8_t>(in.op));
      switch (in.op) {
        case OpCode::Run:
          h.i32(in.action);
          break;
        case OpCode::Send:
        case OpCode::Recv:
          h.i32(in.buffer);
          h.i32(in.peer);
          break;
        case OpCode::Free:
        case OpCode::Accumulate:
          h.i32(in.buffer);
          break;
        default:
          h.i32(in.action);
          h.i32(in.buffer);
          h.i32(in.peer);
      }
    }
  }
  if (!skips.empty()) {
    h.str("skips");
    h.u32(static_cast<uint32_t>(skips.size()));
    for (const SkipEdge& e : skips) {
      h.i32(e.from);
      h.i32(e.to);
      h.byte(static_cast<uint8_t>(e.forward) | static_cast<uint8_t>(e.backward << 1));
    }
  }
  return fmt::format("{:016x}", h.value());
}

}  // namespace baton
