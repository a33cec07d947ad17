// Simulator over rank programs (sim.h: simulate(const RankIR&, ...)). Same
// cost and link model as the plan simulator, applied to what runs: a POST
// starts each of its sends on the link (FIFO per ordered rank pair, in post
// order) and reserves each receive's buffer; a WAIT advances the rank to the
// arrival (no earlier than the receive's post); a RUN lasts its task cost; a
// FREE releases its buffer then, or when its send completes. OFFLOAD and
// FETCH start copies on the rank's copy engines (one per direction, FIFO;
// sim.h) and never block; what reads a fetched buffer waits for its copy.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

#include "baton/error.h"
#include "baton/rank_program.h"
#include "baton/sim.h"

namespace baton {

namespace {

struct MemEv {
  double time;
  int64_t act, total, host;
};

struct SendInfo {
  double posted = 0, start = 0, dur = 0;
  int src = 0, instr = 0;
  int32_t buffer = 0;
  int64_t bytes = 0;
};

class IRSim {
 public:
  IRSim(const RankIR& ir, const CostModel& costs) : ir_(ir), plan_(ir.plan), costs_(costs) {}
  SimResult run();

 private:
  int64_t bytes_of(int32_t id, bool* activation) const {
    const BufferKey k = plan_.buffer_key(id);
    *activation = k.kind == BufKind::Stash || k.kind == BufKind::WStash;
    if (k.kind == BufKind::Skip || k.kind == BufKind::SkipGrad) {
      const SkipEdge& e = plan_.skips[k.stage];
      const SkipCost& c = costs_.skip(e.from, e.to);
      return k.kind == BufKind::Skip ? c.act_bytes : c.grad_bytes;
    }
    const StageCost& c = costs_.stage(k.stage);
    switch (k.kind) {
      case BufKind::Act:
        return c.act_bytes;
      case BufKind::Grad:
        return c.grad_bytes;
      case BufKind::Stash:
        return c.stash_bytes;
      case BufKind::WStash:
        return c.wstash_bytes;
      default:
        return c.wgrad_bytes;
    }
  }
  void mem(int r, double t, int32_t id, int sign) {
    bool act = false;
    const int64_t b = bytes_of(id, &act) * sign;
    mem_[r].push_back({t, act ? b : 0, b, 0});
  }
  void host_mem(int r, double t, int32_t id, int sign) {
    bool act = false;
    mem_[r].push_back({t, 0, 0, bytes_of(id, &act) * sign});
  }
  // A device <-> host copy of buffer `id` on an engine free from `free`, not
  // before `ready`: its end (the engine's next free time).
  double copy(double& free, double ready, int32_t id) const {
    bool act = false;
    const double bytes = static_cast<double>(bytes_of(id, &act));
    const double bw = costs_.host_link_bandwidth;
    free = std::max(free, ready) + (bw > 0 ? bytes / bw : 0.0);
    return free;
  }
  double unit_time(const Unit& u) const {
    const Task& a = u.tasks.front();
    double dur = task_time(costs_.stage(a.stage), a.kind);
    if (u.tasks.size() < 2) return dur;
    const Task& b = u.tasks[1];
    const StageCost& c2 = costs_.stage(b.stage);
    if (c2.fb > 0 && a.kind == TaskKind::F && b.kind == TaskKind::B && a.stage == b.stage &&
        a.microbatch == b.microbatch)
      return c2.fb;
    return (dur + task_time(c2, b.kind)) * costs_.fused_factor;
  }
  // Key of a transfer: (src, dst, channel, FIFO position).
  using Key = std::tuple<int, int, int, int>;
  static Key key_of(int r, const Transfer& t) {
    return t.dir == TransferDir::Send ? Key{r, t.peer, t.channel, t.seq}
                                      : Key{t.peer, r, t.channel, t.seq};
  }
  bool step(int r);

  const RankIR& ir_;
  const Plan& plan_;
  const CostModel& costs_;
  SimResult res_;
  std::vector<int32_t> pc_;
  std::vector<double> time_;
  std::vector<std::vector<MemEv>> mem_;
  std::map<Key, SendInfo> sends_;
  std::map<Key, std::pair<double, int>> recv_post_;  // post time, WAIT rank-local instr
  std::vector<double> link_free_;
  // Releases of sent buffers that wait for their send: (rank, key, free time, buffer id).
  std::vector<std::tuple<int, Key, double, int32_t>> pending_release_;
  std::vector<std::vector<uint8_t>> internal_;  // per rank, per buffer: inside a fused action
  std::vector<std::vector<int32_t>> send_of_;   // per rank, per buffer: its SEND transfer or -1
  // Offload: per rank the free time of its copy engines (device->host,
  // host->device), per rank and buffer when its OFFLOAD's copy and its
  // FETCH's copy complete (-1: none).
  std::vector<double> d2h_free_, h2d_free_;
  std::vector<std::vector<double>> offload_end_, fetch_end_;
};

bool IRSim::step(int r) {
  const RankProgram& p = ir_.programs[r];
  const int n = static_cast<int>(p.instrs.size());
  bool moved = false;
  while (pc_[r] < n) {
    const int i = pc_[r];
    const RankInstr& in = p.instrs[i];
    double& now = time_[r];
    switch (in.op) {
      case RankOp::Post:
        for (int32_t ti : p.groups[in.group].transfers) {
          const Transfer& t = p.transfers[ti];
          const int32_t id = p.buffers[t.buffer].id;
          if (t.dir == TransferDir::Recv) {
            recv_post_[key_of(r, t)] = {now, i};
            mem(r, now, id, +1);
            continue;
          }
          SendInfo s;
          bool act = false;
          s.bytes = bytes_of(id, &act);
          s.dur = costs_.link.latency + (costs_.link.bandwidth > 0
                                             ? static_cast<double>(s.bytes) / costs_.link.bandwidth
                                             : 0.0);
          double& lf = link_free_[static_cast<size_t>(r) * plan_.schedule.num_ranks + t.peer];
          s.posted = now;
          s.start = std::max({now, lf, fetch_end_[r][t.buffer]});
          lf = s.start + s.dur;
          s.src = r;
          s.instr = i;
          s.buffer = id;
          sends_[key_of(r, t)] = s;
        }
        break;
      case RankOp::Wait: {
        const Transfer& t = p.transfers[in.transfer];
        const auto s = sends_.find(key_of(r, t));
        if (s == sends_.end()) return moved;  // the peer has not posted the send yet
        const double post = recv_post_.at(key_of(r, t)).first;
        now = std::max(now, std::max(s->second.start + s->second.dur, post));
        break;
      }
      case RankOp::Run: {
        const Unit& u = p.units[in.unit];
        for (int32_t b : u.reads) now = std::max(now, fetch_end_[r][b]);  // fetched: arrived
        const double dur = unit_time(u);
        res_.runs.push_back(RunEvent{r, i, u.action, now, now + dur});
        for (int32_t b : u.writes)
          if (!internal_[r][b]) mem(r, now, p.buffers[b].id, +1);
        res_.busy[r] += dur;
        now += dur;
        break;
      }
      case RankOp::Free: {
        const RankBuffer& b = p.buffers[in.buffer];
        if (internal_[r][in.buffer]) break;  // inside a fused action: not counted
        const int32_t send = send_of_[r][in.buffer];
        if (send < 0)
          mem(r, now, b.id, -1);
        else
          pending_release_.emplace_back(r, key_of(r, p.transfers[send]), now, b.id);
        break;
      }
      case RankOp::Accumulate:
        break;
      case RankOp::Offload: {
        const int32_t id = p.buffers[in.buffer].id;
        const double end = copy(d2h_free_[r], now, id);
        offload_end_[r][in.buffer] = end;
        host_mem(r, now, id, +1);
        if (!internal_[r][in.buffer]) mem(r, end, id, -1);
        break;
      }
      case RankOp::Fetch: {
        const int32_t id = p.buffers[in.buffer].id;
        if (!internal_[r][in.buffer]) mem(r, now, id, +1);
        const double end = copy(h2d_free_[r], std::max(now, offload_end_[r][in.buffer]), id);
        fetch_end_[r][in.buffer] = end;
        host_mem(r, end, id, -1);
        break;
      }
    }
    ++pc_[r];
    moved = true;
  }
  return moved;
}

SimResult IRSim::run() {
  costs_.validate();
  const int R = plan_.schedule.num_ranks;
  pc_.assign(R, 0);
  time_.assign(R, 0.0);
  mem_.assign(R, {});
  link_free_.assign(static_cast<size_t>(R) * R, 0.0);
  res_.busy.assign(R, 0.0);
  internal_.assign(R, {});
  send_of_.assign(R, {});
  d2h_free_.assign(R, 0.0);
  h2d_free_.assign(R, 0.0);
  offload_end_.assign(R, {});
  fetch_end_.assign(R, {});
  for (int r = 0; r < R; ++r) {
    const RankProgram& p = ir_.programs[r];
    internal_[r].assign(p.buffers.size(), 0);
    offload_end_[r].assign(p.buffers.size(), -1.0);
    fetch_end_[r].assign(p.buffers.size(), -1.0);
    send_of_[r].assign(p.buffers.size(), -1);
    for (int32_t t = 0; t < static_cast<int32_t>(p.transfers.size()); ++t)
      if (p.transfers[t].dir == TransferDir::Send) send_of_[r][p.transfers[t].buffer] = t;
    for (const Unit& u : p.units) {
      if (u.tasks.size() < 2) continue;
      const Plan::ActionIO io = plan_.action_io(Action{u.tasks[0], u.tasks[1]});
      for (int32_t b : u.writes)
        for (int k = 0; k < io.n_internal; ++k)
          if (io.internal[k] == p.buffers[b].id) internal_[r][b] = 1;
    }
  }
  bool moved = true;
  while (moved) {
    moved = false;
    for (int r = 0; r < R; ++r) moved |= step(r);
  }
  std::string stuck;
  for (int r = 0; r < R; ++r)
    if (pc_[r] < static_cast<int>(ir_.programs[r].instrs.size()))
      stuck += fmt::format("{}{}", stuck.empty() ? "" : "; ", ir_.describe(r, pc_[r]));
  if (!stuck.empty()) throw VerifyError("simulate (rank programs): cannot complete: " + stuck);
  for (const auto& [r, k, t, id] : pending_release_) {
    const SendInfo& s = sends_.at(k);
    const auto rp = recv_post_.find(k);
    const double end = std::max(s.start + s.dur, rp == recv_post_.end() ? 0.0 : rp->second.first);
    mem(r, std::max(t, end), id, -1);
  }
  for (int r = 0; r < R; ++r)  // the copies may end after the rank's last RUN
    res_.step_time = std::max({res_.step_time, d2h_free_[r], h2d_free_[r]});
  for (const auto& [k, s] : sends_) {
    const auto& [post, wait_instr] = recv_post_.at(k);
    TransferEvent e;
    e.src = s.src;
    e.dst = std::get<1>(k);
    e.buffer = s.buffer;
    e.send_instr = s.instr;
    e.recv_instr = wait_instr;
    e.posted = s.posted;
    e.start = s.start;
    e.end = std::max(s.start + s.dur, post);
    e.bytes = s.bytes;
    res_.transfers.push_back(e);
  }
  std::sort(res_.runs.begin(), res_.runs.end(), [](const RunEvent& a, const RunEvent& b) {
    return std::tie(a.rank, a.start) < std::tie(b.rank, b.start);
  });
  res_.span_start.assign(R, 0.0);
  res_.span_end.assign(R, 0.0);
  std::vector<bool> seen(R, false);
  for (const RunEvent& e : res_.runs) {
    if (!seen[e.rank]) res_.span_start[e.rank] = e.start;
    seen[e.rank] = true;
    res_.span_end[e.rank] = e.end;
    res_.step_time = std::max(res_.step_time, e.end);
  }
  for (const TransferEvent& e : res_.transfers) res_.step_time = std::max(res_.step_time, e.end);
  double busy = 0;
  res_.bubble.assign(R, 0.0);
  for (int r = 0; r < R; ++r) {
    busy += res_.busy[r];
    res_.bubble[r] = res_.step_time > 0 ? 1.0 - res_.busy[r] / res_.step_time : 0.0;
  }
  res_.bubble_fraction = res_.step_time > 0 ? 1.0 - busy / (R * res_.step_time) : 0.0;
  // Memory: per time, the value after every event at that time.
  res_.memory.assign(R, {});
  res_.peak_activation.assign(R, 0);
  res_.peak_total.assign(R, 0);
  res_.peak_host_bytes.assign(R, 0);
  for (int r = 0; r < R; ++r) {
    auto& ev = mem_[r];
    std::stable_sort(ev.begin(), ev.end(),
                     [](const MemEv& a, const MemEv& b) { return a.time < b.time; });
    auto& out = res_.memory[r];
    out.push_back({0.0, 0, 0, 0});
    int64_t act = 0, total = 0, host = 0;
    for (const MemEv& e : ev) {
      act += e.act;
      total += e.total;
      host += e.host;
      // Host bytes peak after every event, in program order at equal times: an
      // OFFLOAD's slot is taken before a later FETCH's copy frees another, even
      // when that copy takes no time (the runtime copies in that order).
      res_.peak_host_bytes[r] = std::max(res_.peak_host_bytes[r], host);
      if (out.back().time == e.time)
        out.back() = {e.time, act, total, host};
      else
        out.push_back({e.time, act, total, host});
    }
    for (const MemorySample& m : out) {
      res_.peak_activation[r] = std::max(res_.peak_activation[r], m.activation);
      res_.peak_total[r] = std::max(res_.peak_total[r], m.total);
    }
  }
  return std::move(res_);
}

}  // namespace

SimResult simulate(const RankIR& ir, const CostModel& costs) { return IRSim(ir, costs).run(); }

}  // namespace baton
