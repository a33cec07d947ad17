// The per-rank executor: interprets one rank's program of the rank IR.
#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <sstream>
#include <tuple>

#include "baton/runtime.h"

namespace baton::runtime {

namespace {
std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep)) out.push_back(cur);
  return out;
}
double seconds(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }

// Key of a plan instruction: its opcode, the action of a RUN or the buffer of
// the others, and the peer of a transfer.
struct PlanKey {
  OpCode op;
  int32_t what;
  int32_t peer;
  bool operator<(const PlanKey& o) const {
    return std::tie(op, what, peer) < std::tie(o.op, o.what, o.peer);
  }
};
}  // namespace

Executor::Executor(const RankIR& ir, int rank, Transport& transport, Tasks& tasks,
                   ExecutorOptions opts)
    : ir_(ir),
      plan_(ir.plan),
      prog_(rank >= 0 && rank < static_cast<int>(ir.programs.size())
                ? ir.programs[static_cast<size_t>(rank)]
                : throw ConfigError(
                      fmt::format("executor rank {} is out of range: the rank IR has {} ranks",
                                  rank, ir.programs.size()))),
      rank_(rank),
      transport_(transport),
      tasks_(tasks),
      opts_(opts) {
  if (transport.world_size() != static_cast<int>(ir.programs.size()))
    throw ConfigError(fmt::format("the {} transport has {} ranks but the rank IR has {}",
                                  transport.kind(), transport.world_size(), ir.programs.size()));
  if (transport.rank() != rank)
    throw ConfigError(
        fmt::format("executor rank {} runs on a transport of rank {}", rank, transport.rank()));
  for (size_t i = 0; i < prog_.instrs.size(); ++i) {
    const RankOp op = prog_.instrs[i].op;
    if (op == RankOp::Offload || op == RankOp::Fetch)
      throw ConfigError(
          fmt::format("the interpreter does not offload: {} (build the rank IR without "
                      "RankIROptions::offload, or run the compiled engine)",
                      ir.describe(rank, static_cast<int>(i))));
  }
  slots_.resize(prog_.buffers.size());
  // NCCL issues a group's sends and receives as one ncclGroupStart/End.
  defer_recvs_ = transport.kind() != "nccl";
  // The in-process transport moves value handles: it needs no layouts.
  if (transport.kind() != "local") layouts_.resize(slots_.size());
  for (const Unit& u : prog_.units) {
    std::vector<int32_t> in, out;
    for (int32_t b : u.reads) in.push_back(prog_.buffers[static_cast<size_t>(b)].id);
    for (int32_t b : u.writes) out.push_back(prog_.buffers[static_cast<size_t>(b)].id);
    unit_in_.push_back(std::move(in));
    unit_out_.push_back(std::move(out));
  }
  // Each plan instruction becomes one RUN, transfer, FREE or ACCUMULATE of
  // the rank program: match them by key, in order.
  std::map<PlanKey, std::deque<int32_t>> of;
  const auto& src = plan_.programs[static_cast<size_t>(rank)];
  for (size_t j = 0; j < src.size(); ++j) {
    const Instr& in = src[j];
    const bool transfer = in.op == OpCode::Send || in.op == OpCode::Recv;
    of[{in.op, in.op == OpCode::Run ? in.action : in.buffer, transfer ? in.peer : -1}].push_back(
        static_cast<int32_t>(j));
  }
  auto take = [&](PlanKey k) {
    auto it = of.find(k);
    if (it == of.end() || it->second.empty()) return -1;
    const int32_t j = it->second.front();
    it->second.pop_front();
    return j;
  };
  auto unmatched = [&](const std::string& what) {
    return ConfigError(fmt::format("rank {}: {} has no instruction in the plan", rank, what));
  };
  instr_plan_.assign(prog_.instrs.size(), -1);
  for (size_t i = 0; i < prog_.instrs.size(); ++i) {
    const RankInstr& in = prog_.instrs[i];
    int32_t j = 0;
    if (in.op == RankOp::Run)
      j = take({OpCode::Run, prog_.units[static_cast<size_t>(in.unit)].action, -1});
    else if (in.op == RankOp::Free || in.op == RankOp::Accumulate)
      j = take({in.op == RankOp::Free ? OpCode::Free : OpCode::Accumulate,
                prog_.buffers[static_cast<size_t>(in.buffer)].id, -1});
    else
      continue;
    if (j < 0) throw unmatched(ir.describe(rank, static_cast<int>(i)));
    instr_plan_[i] = j;
  }
  for (const Transfer& t : prog_.transfers) {
    const bool send = t.dir == TransferDir::Send;
    const int32_t j = take({send ? OpCode::Send : OpCode::Recv,
                            prog_.buffers[static_cast<size_t>(t.buffer)].id, t.peer});
    if (j < 0)
      throw unmatched(fmt::format("the {} of {} {} rank {}", send ? "send" : "receive",
                                  name(t.buffer), send ? "to" : "from", t.peer));
    transfer_plan_.push_back(j);
  }
}

Executor::~Executor() {
  slots_.clear();
  deferred_.clear();
  transport_.release(&tasks_);
}

uint64_t Executor::tag(int32_t b) const {
  return static_cast<uint64_t>(step_) * static_cast<uint64_t>(plan_.num_buffer_ids()) +
         static_cast<uint64_t>(prog_.buffers[static_cast<size_t>(b)].id);
}

std::string Executor::where(int index) const { return ir_.describe(rank_, index); }

std::string Executor::name(int32_t b) const {
  return plan_.describe_buffer(prog_.buffers[static_cast<size_t>(b)].id);
}

void Executor::fail(int index, const std::string& msg, int failed_rank) {
  const std::string text = index >= 0 ? fmt::format("{}: {}", where(index), msg)
                                      : fmt::format("rank {}: {}", rank_, msg);
  transport_.abort(text, failed_rank >= 0 ? failed_rank : -1);
  throw ExecutionError(text, failed_rank >= 0 ? failed_rank : rank_);
}

void Executor::add_live(const Value& v) {
  ++live_buffers_;
  live_bytes_ += v ? static_cast<int64_t>(v->nbytes()) : 0;
  stats_.peak_live_buffers = std::max(stats_.peak_live_buffers, live_buffers_);
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, live_bytes_);
}

void Executor::drop_live(const Value& v) {
  --live_buffers_;
  live_bytes_ -= v ? static_cast<int64_t>(v->nbytes()) : 0;
}

void Executor::wait(int index, const RequestPtr& r, const char* doing) {
  if (!r->done()) {
    const auto t0 = Clock::now();
    const bool ok = r->wait_until(t0 + opts_.timeout);
    stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    if (!ok) {
      if (auto f = transport_.failure())
        fail(index, fmt::format("stopped: rank {} failed: {}", f->first, f->second), f->first);
      const TimeoutBlame b = blame_silence(&transport_, r->peer, -1);
      fail(index,
           fmt::format("timed out after {:g} s waiting to {} {} {} rank {} (no progress){}",
                       seconds(opts_.timeout), doing, r->what, r->is_send ? "to" : "from", r->peer,
                       b.note),
           b.origin);
    }
  }
  try {
    r->check();
  } catch (const ExecutionError& e) {
    fail(index,
         fmt::format("while waiting to {} {} {} rank {}: {}", doing, r->what,
                     r->is_send ? "to" : "from", r->peer, e.what()),
         e.failed_rank);
  } catch (const std::exception& e) {
    fail(index,
         fmt::format("transfer of {} {} rank {} failed: {}", r->what, r->is_send ? "to" : "from",
                     r->peer, e.what()),
         -1);
  }
}

Value Executor::present(int index, int32_t b, const char* doing) {
  const Slot& s = slots_[static_cast<size_t>(b)];
  if (!s.present)
    fail(index, fmt::format("{} {}, which is not present on this rank{}", doing, name(b),
                            s.recv ? " (received, not yet waited on)" : ""));
  return s.value;
}

void Executor::reap(bool wait_all, int index) {
  for (size_t i = 0; i < deferred_.size();) {
    auto& [r, v] = deferred_[i];
    if (wait_all || r->done()) {
      RequestPtr req = r;
      Value val = std::move(v);
      deferred_.erase(deferred_.begin() + static_cast<std::ptrdiff_t>(i));
      wait(index, req, "send");
      if (val) drop_live(val);
    } else {
      ++i;
    }
  }
}

void Executor::record(int32_t plan_instr, Clock::time_point posted, Clock::time_point started) {
  const Instr& in = plan_.programs[static_cast<size_t>(rank_)][static_cast<size_t>(plan_instr)];
  Event e;
  e.instr = plan_instr;
  e.op = in.op;
  e.buffer = in.buffer;
  e.peer = in.peer;
  e.posted = posted;
  e.started = started;
  e.completed = Clock::now();
  events_.push_back(e);
}

void Executor::post(int index, const TransferGroup& g) {
  bool posted = false;
  for (int32_t ti : g.transfers) {
    const Transfer& t = prog_.transfers[static_cast<size_t>(ti)];
    if (t.dir == TransferDir::Recv) {
      if (defer_recvs_)
        recv_queue_.emplace_back(index, ti);
      else
        post_recv(index, ti);
      posted |= !defer_recvs_;
      continue;
    }
    const auto now = Clock::now();  // before posting: it may complete at once
    Value v = present(index, t.buffer, "sends");
    RequestPtr r = transport_.isend(t.peer, tag(t.buffer), std::move(v), name(t.buffer), &tasks_,
                                    t.channel, layout_of(index, t.buffer, t.peer));
    slots_[static_cast<size_t>(t.buffer)].sends.push_back(r);
    if (opts_.record_events) {
      record(transfer_plan_[static_cast<size_t>(ti)], now, now);
      pending_events_.emplace_back(events_.size() - 1, std::move(r));
    }
    posted = true;
  }
  if (posted) transport_.flush();
}

void Executor::post_recv(int index, int32_t ti) {
  const Transfer& t = prog_.transfers[static_cast<size_t>(ti)];
  Slot& s = slots_[static_cast<size_t>(t.buffer)];
  if (s.present || s.recv)
    fail(index, fmt::format("buffer {} is received while already present", name(t.buffer)));
  const auto now = Clock::now();  // before posting: it may complete at once
  s.recv = transport_.irecv(t.peer, tag(t.buffer), name(t.buffer), &tasks_, t.channel,
                            layout_of(index, t.buffer, rank_));
  if (opts_.record_events) {
    record(transfer_plan_[static_cast<size_t>(ti)], now, now);
    pending_events_.emplace_back(events_.size() - 1, s.recv);
  }
}

void Executor::post_queued_recvs() {
  for (const auto& [index, ti] : recv_queue_) post_recv(index, ti);
  recv_queue_.clear();
  transport_.flush();
}

void Executor::exec(int index, const RankInstr& in) {
  switch (in.op) {
    case RankOp::Post:
      post(index, prog_.groups[static_cast<size_t>(in.group)]);
      break;
    case RankOp::Wait: {
      const Transfer& t = prog_.transfers[static_cast<size_t>(in.transfer)];
      Slot& s = slots_[static_cast<size_t>(t.buffer)];
      if (!s.recv) fail(index, fmt::format("waits for {}, which was not posted", name(t.buffer)));
      RequestPtr r = std::move(s.recv);
      s.recv.reset();
      wait(index, r, "receive");
      Value v = r->take_value();
      if (!v) fail(index, fmt::format("received an empty value for {}", name(t.buffer)));
      s.value =
          tasks_.received(rank_, prog_.buffers[static_cast<size_t>(t.buffer)].id, std::move(v));
      s.present = true;
      add_live(s.value);
      break;
    }
    case RankOp::Run: {
      const auto u = static_cast<size_t>(in.unit);
      const Unit& unit = prog_.units[u];
      TaskCall call;
      call.rank = rank_;
      call.instr = instr_plan_[static_cast<size_t>(index)];
      call.action = unit.action;
      call.act = &plan_.schedule
                      .rank_actions[static_cast<size_t>(rank_)][static_cast<size_t>(unit.action)];
      call.input_ids = &unit_in_[u];
      call.output_ids = &unit_out_[u];
      call.inputs.reserve(unit.reads.size());
      for (int32_t b : unit.reads) call.inputs.push_back(present(index, b, "reads"));
      const auto started = Clock::now();
      std::vector<Value> outs;
      try {
        outs = tasks_.run(call);
      } catch (const ExecutionError& e) {
        fail(index, e.what());
      } catch (const std::exception& e) {
        fail(index, fmt::format("task raised: {}", e.what()));
      }
      if (outs.size() != unit.writes.size())
        fail(index, fmt::format("task returned {} values, the plan expects {}", outs.size(),
                                unit.writes.size()));
      for (size_t i = 0; i < outs.size(); ++i) {
        const int32_t b = unit.writes[i];
        if (!outs[i]) fail(index, fmt::format("task returned no value for {}", name(b)));
        Slot& s = slots_[static_cast<size_t>(b)];
        if (s.present || s.recv) fail(index, fmt::format("buffer {} is written twice", name(b)));
        s.value = std::move(outs[i]);
        s.present = true;
        add_live(s.value);
      }
      if (opts_.record_events) record(call.instr, reached_, started);
      break;
    }
    case RankOp::Free: {
      Slot& s = slots_[static_cast<size_t>(in.buffer)];
      const auto t0 = Clock::now();
      if (!s.present) fail(index, fmt::format("FREE of {} which is not present", name(in.buffer)));
      // The value stays live until its last send completes (FREE never blocks).
      Value v = std::move(s.value);
      std::vector<RequestPtr> pending;
      for (RequestPtr& r : s.sends) {
        if (r->done())
          wait(index, r, "send");  // done: surfaces a failed send
        else
          pending.push_back(std::move(r));
      }
      if (pending.empty()) drop_live(v);
      for (size_t k = 0; k < pending.size(); ++k)
        deferred_.emplace_back(std::move(pending[k]), k + 1 == pending.size() ? v : nullptr);
      s.sends.clear();
      s.present = false;
      if (opts_.record_events) record(instr_plan_[static_cast<size_t>(index)], t0, t0);
      break;
    }
    case RankOp::Accumulate: {
      const auto t0 = Clock::now();
      Value v = present(index, in.buffer, "accumulates");
      try {
        tasks_.accumulate(rank_, prog_.buffers[static_cast<size_t>(in.buffer)].id, v);
      } catch (const ExecutionError& e) {
        fail(index, e.what());
      } catch (const std::exception& e) {
        fail(index, fmt::format("accumulate raised: {}", e.what()));
      }
      if (opts_.record_events) record(instr_plan_[static_cast<size_t>(index)], t0, t0);
      break;
    }
    case RankOp::Offload:
    case RankOp::Fetch:
      fail(index, "the interpreter does not offload");  // refused at construction
  }
}

const Layout& Executor::layout_of(int index, int32_t b, int receiver) {
  static const Layout kNone;
  if (layouts_.empty()) return kNone;
  auto& l = layouts_[static_cast<size_t>(b)];
  if (!l) {
    try {
      l = tasks_.recv_layout(receiver, prog_.buffers[static_cast<size_t>(b)].id);
    } catch (const std::exception& e) {
      fail(index, fmt::format("the layout of {} could not be found: {}", name(b), e.what()));
    }
  }
  return *l;
}

void Executor::run() {
  if (auto f = transport_.failure())
    fail(-1, fmt::format("not started: rank {} failed: {}", f->first, f->second), f->first);
  events_.clear();
  pending_events_.clear();
  deferred_.clear();
  recv_queue_.clear();
  live_buffers_ = live_bytes_ = 0;
  const int n = static_cast<int>(prog_.instrs.size());
  if (opts_.record_events) events_.reserve(plan_.programs[static_cast<size_t>(rank_)].size());
  bool waiting = false;  // inside a stretch of WAITs (before a RUN)
  for (int i = 0; i < n; ++i) {
    const RankInstr& in = prog_.instrs[static_cast<size_t>(i)];
    // A RUN is reached at the first WAIT just before it (where the plan's
    // executor started waiting for its inputs).
    if (!waiting) reached_ = Clock::now();
    waiting = in.op == RankOp::Wait;
    if (!recv_queue_.empty() && (in.op == RankOp::Wait || in.op == RankOp::Run))
      post_queued_recvs();
    exec(i, in);
    if (!deferred_.empty()) reap(false, i);
    ++stats_.instructions;
  }
  if (!recv_queue_.empty()) post_queued_recvs();
  // Everything must have been freed (the verifier guarantees it for verified
  // programs); pending sends are waited for so that the next step starts clean.
  reap(true, n - 1);
  for (size_t b = 0; b < slots_.size(); ++b) {
    Slot& s = slots_[b];
    for (RequestPtr& r : s.sends) wait(n - 1, r, "send");
    s.sends.clear();
    if (s.present || s.recv)
      fail(-1, fmt::format("buffer {} is still live at the end of the step",
                           name(static_cast<int32_t>(b))));
  }
  for (auto& [idx, r] : pending_events_) {
    events_[idx].started = r->started_at();
    events_[idx].completed = r->completed_at();
  }
  pending_events_.clear();
  std::stable_sort(events_.begin(), events_.end(),
                   [](const Event& a, const Event& b) { return a.instr < b.instr; });
  ++step_;
}

void Executor::handshake(std::chrono::milliseconds timeout) {
  const std::string mine = handshake_blob(plan_, transport_.world_size());
  std::vector<std::string> all;
  try {
    all = transport_.exchange(mine, timeout);
  } catch (const ExecutionError&) {
    throw;
  } catch (const std::exception& e) {
    fail(-1, fmt::format("start-up handshake failed: {}", e.what()));
  }
  const auto my_fields = split(mine, '|');
  std::string diffs;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] == mine) continue;
    const auto theirs = split(all[r], '|');
    for (size_t k = 0; k < std::max(theirs.size(), my_fields.size()); ++k) {
      const std::string a = k < my_fields.size() ? my_fields[k] : "";
      const std::string b = k < theirs.size() ? theirs[k] : "";
      if (a != b)
        diffs += fmt::format("{}rank {} has {} but rank {} has {}", diffs.empty() ? "" : "; ", r, b,
                             rank_, a);
    }
  }
  if (!diffs.empty())
    throw ExecutionError(fmt::format("start-up handshake: ranks disagree: {}", diffs), -1);
}

}  // namespace baton::runtime
