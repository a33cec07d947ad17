// Pass: one rank's Plan instruction stream -> its RankProgram (semantics in
// rank_program.h). Slots and share classes are later passes; build_rank_ir
// runs the pipeline.
#include <fmt/format.h>

#include <algorithm>
#include <unordered_map>

#include "baton/error.h"
#include "baton/rank_program.h"

namespace baton {

namespace {

struct Builder {
  const Plan& plan;
  int rank;
  RankProgram prog;
  std::unordered_map<int32_t, int32_t> local;         // plan buffer id -> prog.buffers index
  std::unordered_map<int32_t, int32_t> pending_recv;  // buffer -> receive posted, not waited
  std::unordered_map<int32_t, int32_t> last_send;     // buffer -> its latest SEND transfer
  std::vector<int32_t> open;  // transfers of the group being collected (plan SEND / RECV ids)
  std::vector<Instr> open_instrs;
  std::vector<std::vector<int32_t>> hoisted;  // RUN instr -> RECV instrs posted before it
  std::vector<int32_t> seq_count;             // per (dir, peer, channel)

  Builder(const Plan& p, int r) : plan(p), rank(r) {
    prog.rank = r;
    prog.stages = plan.schedule.stages_of_rank(r);
    seq_count.assign(static_cast<size_t>(2) * plan.schedule.num_ranks * plan.num_channels(), 0);
  }

  int32_t n_instrs() const { return static_cast<int32_t>(prog.instrs.size()); }

  int32_t buffer(int32_t id) {
    auto [it, fresh] = local.try_emplace(id, static_cast<int32_t>(prog.buffers.size()));
    if (fresh) {
      RankBuffer b;
      b.id = id;
      b.key = plan.buffer_key(id);
      b.live_from = n_instrs();
      prog.buffers.push_back(b);
    }
    return it->second;
  }

  // Instruction `at` reads buffer b: it stays held in its slot until then.
  void read(int32_t b, int32_t at) {
    RankBuffer& rb = prog.buffers[b];
    rb.held_to = std::max(rb.held_to, at);
  }

  void flush(int32_t next_run) {
    if (next_run >= 0) {
      for (int32_t j : hoisted[next_run]) open_instrs.push_back(plan.programs[rank][j]);
      hoisted[next_run].clear();
    }
    if (open_instrs.empty()) return;
    const int32_t g = static_cast<int32_t>(prog.groups.size());
    TransferGroup grp;
    grp.post = n_instrs();
    for (const Instr& in : open_instrs) {
      Transfer t;
      t.dir = in.op == OpCode::Send ? TransferDir::Send : TransferDir::Recv;
      t.peer = in.peer;
      t.channel = plan.channel(in.buffer);
      t.group = g;
      const size_t c =
          (static_cast<size_t>(t.dir) * plan.schedule.num_ranks + t.peer) * plan.num_channels() +
          t.channel;
      t.seq = seq_count[c]++;
      const int32_t ti = static_cast<int32_t>(prog.transfers.size());
      if (t.dir == TransferDir::Send) {
        const auto it = local.find(in.buffer);
        if (it == local.end())
          throw VerifyError(fmt::format("rank {}: {} sends a buffer the rank never has", rank,
                                        plan.describe_buffer(in.buffer)));
        t.buffer = it->second;
        read(t.buffer, grp.post);
        last_send[in.buffer] = ti;
      } else {
        t.buffer = buffer(in.buffer);
        pending_recv[in.buffer] = ti;
      }
      prog.transfers.push_back(t);
      grp.transfers.push_back(ti);
    }
    open_instrs.clear();
    prog.groups.push_back(std::move(grp));
    prog.instrs.push_back(RankInstr{RankOp::Post, -1, g, -1, -1});
  }

  void run(int32_t j, const Instr& in) {
    flush(j);
    const Action& a = plan.schedule.rank_actions[rank][in.action];
    const Plan::ActionIO io = plan.action_io(a);
    Unit u;
    u.action = in.action;
    u.tasks.push_back(a.first);
    if (a.is_fused()) u.tasks.push_back(a.second);
    for (int i = 0; i < io.n_in; ++i) {
      const int32_t b = io.in[i];
      const auto it = pending_recv.find(b);
      if (it != pending_recv.end()) {
        prog.transfers[it->second].wait = n_instrs();
        RankBuffer& rb = prog.buffers[prog.transfers[it->second].buffer];
        rb.held_from = rb.held_to = n_instrs();
        prog.instrs.push_back(RankInstr{RankOp::Wait, -1, -1, it->second, -1});
        pending_recv.erase(it);
      }
      const auto lb = local.find(b);
      if (lb == local.end())
        throw VerifyError(fmt::format("{} reads {}, which the rank never has",
                                      plan.describe(rank, j), plan.describe_buffer(b)));
      u.reads.push_back(lb->second);
    }
    const int32_t ui = static_cast<int32_t>(prog.units.size());
    u.instr = n_instrs();
    for (int32_t b : u.reads) read(b, u.instr);
    for (int i = 0; i < io.n_out; ++i) {
      const int32_t b = buffer(io.out[i]);
      prog.buffers[b].held_from = prog.buffers[b].held_to = u.instr;
      u.writes.push_back(b);
    }
    prog.units.push_back(std::move(u));
    prog.instrs.push_back(RankInstr{RankOp::Run, ui, -1, -1, -1});
  }

  void release(const Instr& in) {
    const auto it = local.find(in.buffer);
    if (it == local.end())
      throw VerifyError(fmt::format("rank {}: {} of {}, which the rank never has", rank,
                                    opcode_name(in.op), plan.describe_buffer(in.buffer)));
    const int32_t b = it->second;
    if (in.op == OpCode::Accumulate) {
      prog.instrs.push_back(RankInstr{RankOp::Accumulate, -1, -1, -1, b});
      return;
    }
    const auto s = last_send.find(in.buffer);
    if (s != last_send.end()) prog.transfers[s->second].wait = n_instrs();
    prog.buffers[b].live_to = n_instrs();
    prog.instrs.push_back(RankInstr{RankOp::Free, -1, -1, -1, b});
  }

  RankProgram lower() {
    const auto& src = plan.programs[rank];
    const int32_t n = static_cast<int32_t>(src.size());
    const std::vector<int32_t> posts = plan.receive_posts(rank);
    hoisted.assign(n, {});
    std::vector<int32_t> next_run(n + 1, -1);
    for (int32_t j = n - 1; j >= 0; --j)
      next_run[j] = src[j].op == OpCode::Run ? j : next_run[j + 1];
    for (int32_t j = 0; j < n; ++j)
      if (src[j].op == OpCode::Recv && posts[j] != j) hoisted[posts[j]].push_back(j);
    for (int32_t j = 0; j < n; ++j) {
      const Instr& in = src[j];
      switch (in.op) {
        case OpCode::Send:
          open_instrs.push_back(in);
          break;
        case OpCode::Recv:
          if (posts[j] == j) open_instrs.push_back(in);
          break;
        case OpCode::Run:
          run(j, in);
          break;
        case OpCode::Free:
        case OpCode::Accumulate:
          // A stretch of transfers ends here; the receives posted before the
          // next RUN join it (else they are posted just before that RUN).
          if (!open_instrs.empty()) flush(next_run[j]);
          release(in);
          break;
      }
    }
    flush(-1);
    if (!pending_recv.empty())
      throw VerifyError(fmt::format("rank {}: {} is received but never read", rank,
                                    plan.describe_buffer(pending_recv.begin()->first)));
    return std::move(prog);
  }
};

}  // namespace

const char* rank_op_name(RankOp op) {
  switch (op) {
    case RankOp::Post:
      return "POST";
    case RankOp::Wait:
      return "WAIT";
    case RankOp::Run:
      return "RUN";
    case RankOp::Free:
      return "FREE";
    case RankOp::Accumulate:
      return "ACCUMULATE";
    case RankOp::Offload:
      return "OFFLOAD";
    case RankOp::Fetch:
      return "FETCH";
  }
  return "?";
}

RankProgram lower_rank_program(const Plan& plan, int rank) {
  if (rank < 0 || rank >= static_cast<int>(plan.programs.size()))
    throw ScheduleError(fmt::format("rank {} is out of range (0..{})", rank,
                                    static_cast<int>(plan.programs.size()) - 1));
  return Builder(plan, rank).lower();
}

RankIR build_rank_ir(const Plan& plan, const RankIROptions& opts) {
  verify_or_throw(plan);
  return build_rank_ir_of_verified(plan, opts);
}

RankIR build_rank_ir_of_verified(const Plan& plan, const RankIROptions& opts) {
  build_counters().rank_ir.fetch_add(1, std::memory_order_relaxed);
  const int32_t rows = plan.num_buffer_ids() / std::max(1, plan.schedule.num_microbatches);
  if (!opts.pool_of.empty() && static_cast<int32_t>(opts.pool_of.size()) != rows)
    throw ConfigError(
        fmt::format("pool_of has {} entries; the plan has {} buffer rows "
                    "(5 kinds x {} stages + 2 x {} skip edges)",
                    opts.pool_of.size(), rows, plan.schedule.num_stages, plan.skips.size()));
  if (!opts.offload.empty() &&
      static_cast<int32_t>(opts.offload.size()) != plan.schedule.num_stages)
    throw ConfigError(fmt::format("offload has {} entries; the plan has {} stages",
                                  opts.offload.size(), plan.schedule.num_stages));
  for (size_t s = 0; s < opts.offload.size(); ++s)
    if (opts.offload[s] != Offload::None && opts.offload[s] != Offload::Stash)
      throw ConfigError(fmt::format("offload[{}] is {}, not an Offload value (0 None, 1 Stash)", s,
                                    static_cast<int>(opts.offload[s])));
  if (opts.fetch_lookahead < 1)
    throw ConfigError(fmt::format("fetch_lookahead must be >= 1 (RUNs ahead of the read; got {})",
                                  opts.fetch_lookahead));
  RankIR ir;
  ir.plan = plan;
  for (int r = 0; r < plan.schedule.num_ranks; ++r) {
    ir.programs.push_back(lower_rank_program(ir.plan, r));
    place_offloads(ir.plan, ir.programs.back(), opts);
    assign_slots(ir.plan, ir.programs.back(), opts);
  }
  ir.share_classes = share_classes(ir.plan, ir.programs);
  verify_rank_ir_or_throw(ir);
  return ir;
}

}  // namespace baton
