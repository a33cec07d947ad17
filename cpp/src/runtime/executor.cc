// The per-rank executor: interprets one rank's instruction stream.
#include <fmt/format.h>

#include <algorithm>
#include <sstream>

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
}  // namespace

Executor::Executor(const Plan& plan, int rank, Transport& transport, Tasks& tasks,
                   ExecutorOptions opts)
    : plan_(plan), rank_(rank), transport_(transport), tasks_(tasks), opts_(opts) {
  if (rank < 0 || rank >= static_cast<int>(plan.programs.size()))
    throw ConfigError(fmt::format("executor rank {} is out of range: the plan has {} ranks", rank,
                                  plan.programs.size()));
  if (transport.world_size() != static_cast<int>(plan.programs.size()))
    throw ConfigError(fmt::format("the {} transport has {} ranks but the plan has {}",
                                  transport.kind(), transport.world_size(), plan.programs.size()));
  if (transport.rank() != rank)
    throw ConfigError(
        fmt::format("executor rank {} runs on a transport of rank {}", rank, transport.rank()));
  slots_.resize(static_cast<size_t>(plan.num_buffer_ids()));
  // The in-process transport moves value handles: it needs no layouts.
  if (transport.kind() != "local") layouts_.resize(slots_.size());
  const auto& acts = plan.schedule.rank_actions[static_cast<size_t>(rank)];
  for (const Action& a : acts) {
    action_in_.push_back(plan.action_inputs(a));
    action_out_.push_back(plan.action_outputs(a));
  }
}

Executor::~Executor() {
  slots_.clear();
  deferred_.clear();
  transport_.release(&tasks_);
}

uint64_t Executor::tag(int32_t buffer) const {
  return static_cast<uint64_t>(step_) * static_cast<uint64_t>(plan_.num_buffer_ids()) +
         static_cast<uint64_t>(buffer);
}

std::string Executor::where(int index) const { return plan_.describe(rank_, index); }

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

Value Executor::need(int index, int32_t buffer) {
  Slot& s = slots_[static_cast<size_t>(buffer)];
  if (!s.present && s.recv) {
    RequestPtr r = std::move(s.recv);
    s.recv.reset();
    wait(index, r, "receive");
    Value v = r->take_value();
    if (!v)
      fail(index, fmt::format("received an empty value for {}", plan_.describe_buffer(buffer)));
    s.value = tasks_.received(rank_, buffer, std::move(v));
    s.present = true;
    add_live(s.value);
  }
  if (!s.present)
    fail(index,
         fmt::format("buffer {} is not present on this rank", plan_.describe_buffer(buffer)));
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
      drop_live(val);
    } else {
      ++i;
    }
  }
}

void Executor::exec(int index, const Instr& in) {
  switch (in.op) {
    case OpCode::Run: {
      const auto a = static_cast<size_t>(in.action);
      TaskCall call;
      call.rank = rank_;
      call.instr = index;
      call.action = in.action;
      call.act = &plan_.schedule.rank_actions[static_cast<size_t>(rank_)][a];
      call.input_ids = &action_in_[a];
      call.output_ids = &action_out_[a];
      call.inputs.reserve(action_in_[a].size());
      for (int32_t b : action_in_[a]) call.inputs.push_back(need(index, b));
      if (opts_.record_events) events_.back().started = Clock::now();
      std::vector<Value> outs;
      try {
        outs = tasks_.run(call);
      } catch (const ExecutionError& e) {
        fail(index, e.what());
      } catch (const std::exception& e) {
        fail(index, fmt::format("task raised: {}", e.what()));
      }
      if (outs.size() != action_out_[a].size())
        fail(index, fmt::format("task returned {} values, the plan expects {}", outs.size(),
                                action_out_[a].size()));
      for (size_t i = 0; i < outs.size(); ++i) {
        const int32_t b = action_out_[a][i];
        if (!outs[i])
          fail(index, fmt::format("task returned no value for {}", plan_.describe_buffer(b)));
        Slot& s = slots_[static_cast<size_t>(b)];
        if (s.present || s.recv)
          fail(index, fmt::format("buffer {} is written twice", plan_.describe_buffer(b)));
        s.value = std::move(outs[i]);
        s.present = true;
        add_live(s.value);
      }
      break;
    }
    case OpCode::Send: {
      Value v = need(index, in.buffer);
      Slot& s = slots_[static_cast<size_t>(in.buffer)];
      s.send = transport_.isend(in.peer, tag(in.buffer), std::move(v),
                                plan_.describe_buffer(in.buffer), &tasks_,
                                plan_.channel(in.buffer),
                                layout_of(index, in.buffer, in.peer));
      if (opts_.record_events) pending_events_.emplace_back(events_.size() - 1, s.send);
      break;
    }
    case OpCode::Recv: {
      if (!early_.empty() && early_[static_cast<size_t>(index)].first) {  // see post_ahead
        auto& early = early_[static_cast<size_t>(index)];
        Slot& s = slots_[static_cast<size_t>(in.buffer)];
        s.recv = std::move(early.first);
        if (opts_.record_events) {  // posted when it really was (the simulator agrees)
          events_.back().posted = early.second;
          pending_events_.emplace_back(events_.size() - 1, s.recv);
        }
        break;
      }
      post_recv(index, in);
      if (opts_.record_events)
        pending_events_.emplace_back(events_.size() - 1,
                                     slots_[static_cast<size_t>(in.buffer)].recv);
      break;
    }
    case OpCode::Free: {
      Slot& s = slots_[static_cast<size_t>(in.buffer)];
      if (s.recv) need(index, in.buffer);  // received but never used: still wait for it
      if (!s.present)
        fail(index,
             fmt::format("FREE of {} which is not present", plan_.describe_buffer(in.buffer)));
      if (s.send && !s.send->done()) {
        deferred_.emplace_back(std::move(s.send), std::move(s.value));
      } else {
        if (s.send) wait(index, s.send, "send");  // done: surfaces a failed send
        drop_live(s.value);
      }
      s.send.reset();
      s.value.reset();
      s.present = false;
      break;
    }
    case OpCode::Accumulate: {
      Value v = need(index, in.buffer);
      try {
        tasks_.accumulate(rank_, in.buffer, v);
      } catch (const ExecutionError& e) {
        fail(index, e.what());
      } catch (const std::exception& e) {
        fail(index, fmt::format("accumulate raised: {}", e.what()));
      }
      break;
    }
  }
}

void Executor::post_recv(int index, const Instr& in) {
  Slot& s = slots_[static_cast<size_t>(in.buffer)];
  if (s.present || s.recv)
    fail(index, fmt::format("buffer {} is received while already present",
                            plan_.describe_buffer(in.buffer)));
  s.recv = transport_.irecv(
      in.peer, tag(in.buffer), plan_.describe_buffer(in.buffer), &tasks_,
      plan_.channel(in.buffer), layout_of(index, in.buffer, rank_));
}

const Layout& Executor::layout_of(int index, int32_t buffer, int receiver) {
  static const Layout kNone;
  if (layouts_.empty()) return kNone;
  auto& l = layouts_[static_cast<size_t>(buffer)];
  if (!l) {
    try {
      l = tasks_.recv_layout(receiver, buffer);
    } catch (const std::exception& e) {
      fail(index, fmt::format("the layout of {} could not be found: {}",
                              plan_.describe_buffer(buffer), e.what()));
    }
  }
  return *l;
}

void Executor::post_ahead(int index) {
  // The RECVs the plan posts before RUN `index` (Plan::receive_posts): they
  // follow it, before the next RUN.
  const auto& prog = plan_.programs[static_cast<size_t>(rank_)];
  bool posted = false;
  for (size_t j = static_cast<size_t>(index) + 1; j < prog.size(); ++j) {
    if (posts_[j] < 0) continue;
    if (posts_[j] != index) break;
    const Instr& in = prog[j];
    const Slot& s = slots_[static_cast<size_t>(in.buffer)];
    // A buffer still held (not yet freed before this point) is received later.
    if (s.present || s.recv) break;
    const auto now = Clock::now();  // before posting: it may complete at once
    post_recv(static_cast<int>(j), in);
    early_[j] = {std::move(slots_[static_cast<size_t>(in.buffer)].recv), now};
    posted = true;
  }
  if (posted) transport_.flush();
}

void Executor::run() {
  const auto& prog = plan_.programs[static_cast<size_t>(rank_)];
  if (auto f = transport_.failure())
    fail(-1, fmt::format("not started: rank {} failed: {}", f->first, f->second), f->first);
  events_.clear();
  pending_events_.clear();
  deferred_.clear();
  live_buffers_ = live_bytes_ = 0;
  if (opts_.record_events) events_.reserve(prog.size());
  const bool ahead = opts_.early_receives && transport_.kind() != "nccl";
  early_.assign(ahead ? prog.size() : 0, {});
  if (ahead && posts_.size() != prog.size()) posts_ = plan_.receive_posts(rank_);
  for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
    const Instr& in = prog[static_cast<size_t>(i)];
    if (ahead && in.op == OpCode::Run) post_ahead(i);
    if (opts_.record_events) {
      Event e;
      e.instr = i;
      e.op = in.op;
      e.buffer = in.buffer;
      e.peer = in.peer;
      e.posted = Clock::now();
      events_.push_back(e);
    }
    exec(i, in);
    if (!deferred_.empty()) reap(false, i);
    if ((in.op == OpCode::Send || in.op == OpCode::Recv) &&
        (i + 1 == static_cast<int>(prog.size()) ||
         (prog[static_cast<size_t>(i) + 1].op != OpCode::Send &&
          prog[static_cast<size_t>(i) + 1].op != OpCode::Recv)))
      transport_.flush();
    if (opts_.record_events && in.op != OpCode::Send && in.op != OpCode::Recv) {
      Event& e = events_.back();
      if (e.started == Clock::time_point{}) e.started = e.posted;
      e.completed = Clock::now();
    }
    ++stats_.instructions;
  }
  // Everything must have been freed (the verifier guarantees it for verified
  // plans); pending sends are waited for so that the next step starts clean.
  reap(true, static_cast<int>(prog.size()) - 1);
  for (size_t b = 0; b < slots_.size(); ++b) {
    Slot& s = slots_[b];
    if (s.send) {
      RequestPtr r = std::move(s.send);
      s.send.reset();
      wait(static_cast<int>(prog.size()) - 1, r, "send");
    }
    if (s.present || s.recv)
      fail(-1, fmt::format("buffer {} is still live at the end of the step",
                           plan_.describe_buffer(static_cast<int32_t>(b))));
  }
  for (auto& [idx, r] : pending_events_) {
    events_[idx].started = r->started_at();
    events_[idx].completed = r->completed_at();
  }
  pending_events_.clear();
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
