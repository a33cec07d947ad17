// Discrete-event simulator over a lowered Plan (semantics in sim.h).
//
// Every rank's timeline depends only on its own earlier instructions and on
// the arrival times of the buffers it receives, and an arrival time is fixed
// as soon as both the SEND and the RECV are posted (links are FIFO per
// sender, so a link's free time is known when the sender posts). So the
// simulation is a dataflow evaluation: each rank runs ahead until a RUN waits
// for an input whose arrival is not yet known; resolving that transfer wakes
// the rank again. Every instruction is processed once (a blocked RUN is
// re-evaluated once), so the main loop is O(N). Buffer records are recycled
// when freed, so the working set stays the size of the live buffers; RUN and
// transfer records are written straight into the result. Only the releases
// that wait for a send are sorted (memory timeline).
//
// This file holds the event loop (step, resolve) and the bookkeeping of buffer
// lives and transfers; the state is declared in sim_internal.h.
#include "baton/sim.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "baton/error.h"
#include "sim_internal.h"

namespace baton {

namespace sim_detail {

int32_t Simulator::materialize(int32_t rank, int32_t id, double ready) {
  int32_t l;
  if (!free_lives_.empty()) {
    l = free_lives_.back();
    free_lives_.pop_back();
  } else {
    l = static_cast<int32_t>(lives_.size());
    lives_.emplace_back();
  }
  const BufInfo& bi = info(id);
  Life& L = lives_[l];
  L = Life{};
  L.rank = rank;
  L.buffer = id;
  L.bytes = bi.bytes;
  L.activation = bi.activation;
  L.ready = ready;
  *live_[rank].find(id) = l;
  return l;
}

int32_t Simulator::new_life(int32_t rank, int32_t id, double alloc, int pc) {
  claim(rank, id, kLocal, pc);
  const int32_t l = materialize(rank, id, alloc);
  // Allocation times follow program order, so each rank's timeline is
  // appended in time order.
  const BufInfo& bi = info(id);
  mem_event(rank, alloc, bi.activation ? bi.bytes : 0, bi.bytes);
  return l;
}

void Simulator::release(int32_t l, double time, bool late) {
  Life& L = lives_[l];
  const int64_t act = L.activation ? -L.bytes : 0;
  if (late)
    late_[L.rank].push_back({time, act, -L.bytes});
  else
    mem_event(L.rank, time, act, -L.bytes);
  live_[L.rank].erase(L.buffer);
  free_lives_.push_back(l);
}

int32_t Simulator::open_transfer(int32_t src, int32_t dst, int32_t id, bool want_send) {
  const int32_t head = open_[dst].get(id);
  for (int32_t t = head; t >= 0; t = xs_[t].next_open) {
    const TransferEvent& e = res_.transfers[t];
    if (e.src == src && e.dst == dst && (want_send ? !xs_[t].has_send : !xs_[t].has_recv)) return t;
  }
  TransferEvent e;
  e.src = src;
  e.dst = dst;
  e.buffer = id;
  e.send_instr = e.recv_instr = -1;
  e.bytes = info(id).bytes;
  res_.transfers.push_back(e);
  xs_.emplace_back();
  const int32_t t = static_cast<int32_t>(xs_.size() - 1);
  xs_[t].next_open = head;
  if (head >= 0)
    *open_[dst].find(id) = t;
  else
    open_[dst].insert(id, t);
  return t;
}

// Both sides are posted: take the transfer off its buffer's open chain.
void Simulator::close_transfer(int32_t t) {
  const TransferEvent& e = res_.transfers[t];
  int32_t* head = open_[e.dst].find(e.buffer);
  if (*head == t) {
    if (xs_[t].next_open >= 0)
      *head = xs_[t].next_open;
    else
      open_[e.dst].erase(e.buffer);
    return;
  }
  int32_t link = *head;
  while (xs_[link].next_open != t) link = xs_[link].next_open;
  xs_[link].next_open = xs_[t].next_open;
}

void Simulator::check_instr(int rank, int index, const Instr& in) const {
  switch (in.op) {
    case OpCode::Run:
      if (in.action < 0 || in.action >= static_cast<int>(plan_.schedule.rank_actions[rank].size()))
        fail(rank, index, fmt::format("action index {} out of range", in.action));
      return;
    case OpCode::Send:
    case OpCode::Recv:
      if (in.peer < 0 || in.peer >= P_ || in.peer == rank)
        fail(rank, index, fmt::format("bad peer rank {}", in.peer));
      [[fallthrough]];
    case OpCode::Free:
    case OpCode::Accumulate:
      if (in.buffer < 0 || in.buffer >= nids_)
        fail(rank, index, fmt::format("buffer id {} out of range", in.buffer));
      return;
  }
  fail(rank, index, "unknown opcode");
}

void Simulator::resolve(int32_t t) {
  TransferEvent& e = res_.transfers[t];
  XferState& x = xs_[t];
  close_transfer(t);
  const double arrive = e.start + x.dur;
  if (x.recv_posted > arrive) {
    e.end = x.recv_posted;
    x.end_pred = XferPred::RecvPost;
  } else {
    e.end = arrive;
    x.end_pred = x.start_pred;
  }
  x.resolved = true;
  Life& rl = lives_[x.recv_life];
  rl.ready = e.end;
  rl.ready_known = true;
  if (rl.freed && rl.pending_sends == 0) release(x.recv_life, rl.free_post, true);
  Life& sl = lives_[x.send_life];
  sl.send_end = std::max(sl.send_end, e.end);
  if (--sl.pending_sends == 0 && sl.freed && sl.ready_known)
    release(x.send_life, std::max(sl.free_post, sl.send_end), true);
  if (x.waited) {
    RankState& st = ranks_[e.dst];
    if (st.status == Status::Blocked && --st.missing == 0) {
      st.status = Status::Ready;
      push(e.dst);
    }
  }
}

void Simulator::step(int32_t rank) {
  RankState& st = ranks_[rank];
  const auto& prog = plan_.programs[rank];
  const auto& acts = plan_.schedule.rank_actions[rank];
  const int32_t n = static_cast<int32_t>(prog.size());
  while (st.pc < n) {
    const int32_t pc = st.pc;
    const Instr& in = prog[pc];
    // Ranks take turns in short bursts, so hardware prefetching of each
    // rank's program and action streams does not get going; help it.
    if (pc + 16 < n) __builtin_prefetch(&prog[pc + 16]);
    check_instr(rank, pc, in);
    switch (in.op) {
      case OpCode::Run: {
        if (opts_.early_receives && st.ahead <= pc) {  // first time here: post ahead
          int32_t j = pc + 1;
          for (; j < n && prog[j].op != OpCode::Run; ++j)
            if (prog[j].op == OpCode::Recv) early_post_[rank][j] = st.time;
          st.ahead = j;
        }
        const Action& a = acts[in.action];
        if (in.action + 4 < static_cast<int32_t>(acts.size()))
          __builtin_prefetch(&acts[in.action + 4]);
        const bool fused = a.is_fused();
        IdList ins, outs;
        ins.dedupe = outs.dedupe = fused;
        task_io(ids_, a.first, ins, outs);
        double dur = task_time(costs_.stage(a.first.stage), a.first.kind);
        if (fused) {
          task_io(ids_, a.second, ins, outs);
          const StageCost& c2 = costs_.stage(a.second.stage);
          if (c2.fb > 0 && a.first.kind == TaskKind::F && a.second.kind == TaskKind::B &&
              a.first.stage == a.second.stage && a.first.microbatch == a.second.microbatch) {
            dur = c2.fb;
          } else {
            dur += task_time(c2, a.second.kind);
            dur *= costs_.fused_factor;
          }
        }
        double ready = st.time;
        int32_t ready_xfer = -1;
        double ready_xfer_end = -kInf;
        int32_t missing = 0;
        for (int k = 0; k < ins.n; ++k) {
          const int32_t b = ins.v[k];
          if (fused && outs.contains(b)) continue;  // produced inside the fused pair
          const int32_t l = find_life(rank, b);
          if (l == kLocal || l == kInternal) continue;  // produced here earlier: present
          if (l == kNoLife)
            fail(rank, pc,
                 fmt::format("input {} is not on rank {} (not produced earlier on the "
                             "rank nor received by an earlier RECV, or already freed)",
                             buf_name(b), rank));
          const Life& L = lives_[l];
          if (L.freed)  // freed, release pending on a send
            fail(rank, pc, fmt::format("input {} was already freed", buf_name(b)));
          if (!L.ready_known) {
            xs_[L.transfer].waited = true;
            ++missing;
            continue;
          }
          if (L.transfer >= 0 && L.ready > ready_xfer_end) {
            ready_xfer = L.transfer;
            ready_xfer_end = L.ready;
          }
          ready = std::max(ready, L.ready);
        }
        if (missing > 0) {
          st.missing = missing;
          st.status = Status::Blocked;
          return;
        }
        const int32_t slot = st.next_run++;
        RunEvent& r = res_.runs[slot];
        r = RunEvent{rank, pc, in.action, ready, ready + dur};
        // What set the start: the latest input's arrival when it came after
        // the rank was free (or the rank has not run anything yet), else the
        // rank's previous RUN.
        RunPred& pred = run_pred_[slot];
        if (ready_xfer >= 0 && (ready_xfer_end > st.time || st.last_run < 0))
          pred = {Pred::Transfer, ready_xfer};
        else if (st.last_run >= 0)
          pred = {Pred::Run, st.last_run};
        for (int k = 0; k < outs.n; ++k) {
          const int32_t b = outs.v[k];
          if (fused && ins.contains(b)) {  // made and used inside the action
            claim(rank, b, kInternal, pc);
            continue;
          }
          claim(rank, b, kLocal, pc);
          const BufInfo& bi = info_[outs.ks[k]];
          mem_event(rank, r.start, bi.activation ? bi.bytes : 0, bi.bytes);
        }
        st.last_run = slot;
        st.time = r.end;
        break;
      }
      case OpCode::Send: {
        int32_t l = find_life(rank, in.buffer);
        if (l == kInternal)
          fail(rank, pc,
               fmt::format("sends {}, which lives inside a fused action", buf_name(in.buffer)));
        if (l == kLocal) l = materialize(rank, in.buffer, st.time);
        if (l == kNoLife || lives_[l].freed)
          fail(rank, pc,
               fmt::format("sends {}, which is not on rank {}", buf_name(in.buffer), rank));
        const int32_t t = open_transfer(rank, in.peer, in.buffer, true);
        const int32_t link = rank * P_ + in.peer;
        TransferEvent& e = res_.transfers[t];
        XferState& x = xs_[t];
        x.has_send = true;
        e.send_instr = pc;
        x.send_life = l;
        ++lives_[l].pending_sends;
        x.send_run = st.last_run;
        e.posted = st.time;
        x.dur = costs_.link.latency + (costs_.link.bandwidth > 0
                                           ? static_cast<double>(e.bytes) / costs_.link.bandwidth
                                           : 0.0);
        if (link_free_[link] > st.time) {
          e.start = link_free_[link];
          x.start_pred = XferPred::LinkBusy;
        } else {
          e.start = st.time;
          x.start_pred = XferPred::SendPost;
        }
        x.link_prev = link_last_[link];
        link_free_[link] = e.start + x.dur;
        link_last_[link] = t;
        if (x.has_recv) resolve(t);
        break;
      }
      case OpCode::Recv: {
        const int32_t t = open_transfer(in.peer, rank, in.buffer, false);
        double post = st.time;
        if (opts_.early_receives && early_post_[rank][pc] >= 0) post = early_post_[rank][pc];
        int32_t l;
        if (post < st.time) {  // posted ahead: counted from then (merged at the end)
          claim(rank, in.buffer, kLocal, pc);
          l = materialize(rank, in.buffer, post);
          const BufInfo& bi = info(in.buffer);
          late_[rank].push_back({post, bi.activation ? bi.bytes : 0, bi.bytes});
        } else {
          l = new_life(rank, in.buffer, st.time, pc);
        }
        XferState& x = xs_[t];
        x.has_recv = true;
        res_.transfers[t].recv_instr = pc;
        x.recv_life = l;
        x.recv_run = st.last_run;
        x.recv_posted = post;
        Life& L = lives_[l];
        L.transfer = t;
        L.ready_known = false;
        if (x.has_send) resolve(t);
        break;
      }
      case OpCode::Free: {
        const int32_t l = find_life(rank, in.buffer);
        if (l == kInternal) {
          live_[rank].erase(in.buffer);
          break;
        }
        if (l == kLocal) {
          const BufInfo& bi = info(in.buffer);
          mem_event(rank, st.time, bi.activation ? -bi.bytes : 0, -bi.bytes);
          live_[rank].erase(in.buffer);
          break;
        }
        if (l == kNoLife || lives_[l].freed)
          fail(rank, pc,
               fmt::format("frees {}, which is not live on rank {}", buf_name(in.buffer), rank));
        Life& L = lives_[l];
        L.freed = true;
        L.free_post = st.time;
        // Released now, or when its sends (or its own arrival) complete.
        if (L.pending_sends == 0 && L.ready_known) {
          if (L.send_end <= st.time)
            release(l, st.time, false);
          else
            release(l, L.send_end, true);
        }
        break;
      }
      case OpCode::Accumulate: {
        const int32_t l = find_life(rank, in.buffer);
        if (l == kNoLife || (l >= 0 && lives_[l].freed))
          fail(rank, pc,
               fmt::format("accumulates {}, which is not live on rank {}", buf_name(in.buffer),
                           rank));
        break;
      }
    }
    ++st.pc;
  }
  st.status = Status::Done;
}

SimResult Simulator::run() {
  costs_.validate();
  const Schedule& s = plan_.schedule;
  if (P_ <= 0 || ids_.S <= 0 || ids_.M <= 0)
    throw VerifyError(fmt::format("simulate: empty schedule (ranks={}, stages={}, microbatches={})",
                                  P_, ids_.S, ids_.M));
  if ((int64_t{kNumBufKinds} * ids_.S + 2 * static_cast<int64_t>(plan_.skips.size())) * ids_.M >
      std::numeric_limits<int32_t>::max())
    throw VerifyError(
        fmt::format("simulate: too many buffers (stages={}, microbatches={})", ids_.S, ids_.M));
  if (static_cast<int32_t>(plan_.programs.size()) != P_ ||
      static_cast<int32_t>(s.rank_actions.size()) != P_)
    throw VerifyError(fmt::format("simulate: plan has {} programs and {} action lists for {} ranks",
                                  plan_.programs.size(), s.rank_actions.size(), P_));
  for (int32_t r = 0; r < P_; ++r)
    for (const Action& a : s.rank_actions[r])
      for (const Task* t : {&a.first, &a.second}) {
        if (t == &a.second && !a.is_fused()) continue;
        if (t->stage < 0 || t->stage >= ids_.S || t->microbatch < 0 || t->microbatch >= ids_.M)
          throw VerifyError(
              fmt::format("simulate: rank {} has task {} out of range", r, to_string(*t)));
      }

  // Pre-count to size every table once; each rank's RUNs get a contiguous
  // range of result.runs, which is therefore sorted by (rank, start).
  const int32_t E = static_cast<int32_t>(plan_.skips.size());
  info_.resize(static_cast<size_t>(kNumBufKinds) * ids_.S + 2 * static_cast<size_t>(E));
  for (int32_t e = 0; e < E; ++e) {  // skip edges: bytes from the cost model (in flight only)
    const SkipCost& c = costs_.skip(plan_.skips[e].from, plan_.skips[e].to);
    info_[kNumBufKinds * ids_.S + e] = {c.act_bytes, false};
    info_[kNumBufKinds * ids_.S + E + e] = {c.grad_bytes, false};
  }
  for (int32_t st = 0; st < ids_.S; ++st) {
    const StageCost& c = costs_.stage(st);
    const int64_t bytes[kNumBufKinds] = {c.act_bytes, c.grad_bytes, c.stash_bytes, c.wstash_bytes,
                                         c.wgrad_bytes};
    for (int k = 0; k < kNumBufKinds; ++k)
      info_[k * ids_.S + st] = {bytes[k], k == static_cast<int>(BufKind::Stash) ||
                                              k == static_cast<int>(BufKind::WStash)};
  }
  ranks_.assign(P_, {});
  res_.memory.assign(P_, {});
  late_.assign(P_, {});
  early_post_.assign(opts_.early_receives ? P_ : 0, {});
  for (size_t r = 0; r < early_post_.size(); ++r)
    early_post_[r].assign(plan_.programs[r].size(), -1.0);
  size_t n_runs = 0, n_sends = 0;
  for (int32_t r = 0; r < P_; ++r) {
    size_t runs = 0, recvs = 0, sends = 0;
    for (const Instr& in : plan_.programs[r]) {
      runs += in.op == OpCode::Run;
      recvs += in.op == OpCode::Recv;
      sends += in.op == OpCode::Send;
    }
    ranks_[r].next_run = static_cast<int32_t>(n_runs);
    n_runs += runs;
    n_sends += sends;
    res_.memory[r].reserve(2 * runs + recvs + 1);
  }
  res_.runs.resize(n_runs);
  run_pred_.assign(n_runs, RunPred{});
  res_.transfers.reserve(n_sends);
  xs_.reserve(n_sends);
  live_.assign(P_, LiveMap{});
  open_.assign(P_, LiveMap{});
  link_free_.assign(static_cast<size_t>(P_) * P_, -kInf);
  link_last_.assign(static_cast<size_t>(P_) * P_, -1);

  for (int32_t r = P_ - 1; r >= 0; --r) push(r);
  while (!work_.empty()) {
    const int32_t r = work_.back();
    work_.pop_back();
    ranks_[r].queued = false;
    if (ranks_[r].status == Status::Ready) step(r);
  }
  for (const RankState& st : ranks_)
    if (st.status != Status::Done) report_stuck();
  for (const XferState& x : xs_)
    if (!x.has_send || !x.has_recv) report_stuck();

  res_.busy.assign(P_, 0.0);
  res_.span_start.assign(P_, 0.0);
  res_.span_end.assign(P_, 0.0);
  double step_time = 0;
  for (size_t k = 0; k < res_.runs.size(); ++k) {
    const RunEvent& r = res_.runs[k];
    res_.busy[r.rank] += r.end - r.start;
    if (k == 0 || res_.runs[k - 1].rank != r.rank) res_.span_start[r.rank] = r.start;
    res_.span_end[r.rank] = r.end;
    step_time = std::max(step_time, r.end);
  }
  for (const TransferEvent& e : res_.transfers) step_time = std::max(step_time, e.end);
  res_.step_time = step_time;
  res_.bubble.assign(P_, 0.0);
  double total_busy = 0;
  for (int32_t r = 0; r < P_; ++r) {
    total_busy += res_.busy[r];
    res_.bubble[r] = step_time > 0 ? 1.0 - res_.busy[r] / step_time : 0.0;
  }
  res_.bubble_fraction = step_time > 0 ? 1.0 - total_busy / (P_ * step_time) : 0.0;
  finish_memory();
  build_critical_path();
  return std::move(res_);
}

}  // namespace sim_detail

double SimResult::idle_inside_span(int rank) const {
  if (rank < 0 || static_cast<size_t>(rank) >= busy.size()) return 0.0;
  return std::max(0.0, span_end[rank] - span_start[rank] - busy[rank]);
}

SimResult simulate(const Plan& plan, const CostModel& costs, SimOptions opts) {
  sim_detail::Simulator sim(plan, costs, opts);
  return sim.run();
}

}  // namespace baton
