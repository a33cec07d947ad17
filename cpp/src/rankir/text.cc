// Text form of rank programs (rank_program.h): RankIR::describe and to_text.
//
//   rank-ir 1f1b: ranks 4, stages 4, microbatches 8, channels 5
//   share classes: {0} {1,2} {3}
//   rank 1: stages [1], class 1, 12 units, 20 transfers, 61 instructions
//     pools: p0 act(s0) x2, p1 act(s1) x1, ...
//     #0 POST g0: RECV act(s0,m0)<-0 ch0.0 @p0.0, RECV act(s0,m1)<-0 ch0.1 @p0.1
//     #1 WAIT act(s0,m0)<-0
//     #2 RUN F1.0 reads act(s0,m0)@p0.0 writes act(s1,m0)@p1.0 stash(s1,m0)@p2.0
//   ("reads -": none.)
//     #3 FREE act(s0,m0)
// A transfer reads "SEND buffer->peer" or "RECV buffer<-peer", then its
// channel and FIFO position ("ch0.1": the second on channel 0 with that
// peer), and for a receive its slot. A buffer's slot reads "@p<pool>.<slot>";
// a buffer that holds none (rank_program.h) shows none. With offload, the
// host pools follow the pools ("host pools: h0 stash(s0) x2", only when
// there are any), a host slot reads "@h<pool>.<slot>", and
//     #5 OFFLOAD stash(s0,m1) @p2.1->@h0.0
//     #9 FETCH stash(s0,m1) @h0.0->@p2.0
// an offloaded buffer read after its FETCH shows its fetch slot.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/rank_program.h"

namespace baton {

namespace {

std::string row_name(const Plan& plan, int32_t row) {
  const BufferKey k = plan.buffer_key(row * plan.schedule.num_microbatches);
  if (k.kind == BufKind::Skip || k.kind == BufKind::SkipGrad) {
    const SkipEdge& e = plan.skips[k.stage];
    return k.kind == BufKind::Skip ? fmt::format("skip(s{}->s{})", e.from, e.to)
                                   : fmt::format("skipgrad(s{}->s{})", e.to, e.from);
  }
  return fmt::format("{}(s{})", buf_kind_name(k.kind), k.stage);
}

bool valid(const RankIR& ir, int rank, int instr) {
  return rank >= 0 && rank < static_cast<int>(ir.programs.size()) && instr >= 0 &&
         instr < static_cast<int>(ir.programs[rank].instrs.size());
}

template <class T>
bool in_range(const std::vector<T>& v, int32_t i) {
  return i >= 0 && i < static_cast<int32_t>(v.size());
}

std::string buf_name(const RankIR& ir, const RankProgram& p, int32_t b) {
  return in_range(p.buffers, b) ? ir.plan.describe_buffer(p.buffers[b].id)
                                : fmt::format("buffer#{}?", b);
}

std::string transfer_name(const RankIR& ir, const RankProgram& p, int32_t t) {
  if (!in_range(p.transfers, t)) return fmt::format("transfer#{}?", t);
  const Transfer& x = p.transfers[t];
  return fmt::format("{} {}{}{}", x.dir == TransferDir::Send ? "SEND" : "RECV",
                     buf_name(ir, p, x.buffer), x.dir == TransferDir::Send ? "->" : "<-", x.peer);
}

// "@p<pool>.<slot>" of buffer b at instruction `at` (its fetch slot from its
// FETCH on), or nothing for a buffer that holds no slot.
std::string slot_of(const RankProgram& p, int32_t b, int at = -1) {
  if (!in_range(p.buffers, b) || p.buffers[b].pool < 0) return "";
  const RankBuffer& rb = p.buffers[b];
  const bool fetched = rb.fetch >= 0 && at >= rb.fetch;
  return fmt::format("@p{}.{}", rb.pool, fetched ? rb.fetch_slot : rb.slot);
}

std::string host_slot_of(const RankProgram& p, int32_t b) {
  if (!in_range(p.buffers, b)) return "";
  return fmt::format("@h{}.{}", p.buffers[b].host_pool, p.buffers[b].host_slot);
}

std::string with_slot(const RankIR& ir, const RankProgram& p, int32_t b, int at = -1) {
  return fmt::format("{}{}", buf_name(ir, p, b), slot_of(p, b, at));
}

std::string pool_list(const Plan& plan, const std::vector<Pool>& pools, char prefix) {
  std::string out;
  for (size_t k = 0; k < pools.size(); ++k) {
    out += fmt::format("{} {}{} ", k ? "," : "", prefix, k);
    for (size_t j = 0; j < pools[k].rows.size(); ++j)
      out += fmt::format("{}{}", j ? "+" : "", row_name(plan, pools[k].rows[j]));
    out += fmt::format(" x{}", pools[k].slots);
  }
  return out;
}

std::string instr_text(const RankIR& ir, const RankProgram& p, const RankInstr& in, bool full,
                       int at) {
  switch (in.op) {
    case RankOp::Post: {
      if (!in_range(p.groups, in.group)) return fmt::format("POST group#{}?", in.group);
      std::string out = fmt::format("POST g{}:", in.group);
      const auto& ts = p.groups[in.group].transfers;
      for (size_t k = 0; k < ts.size(); ++k) {
        out += k ? ", " : " ";
        out += transfer_name(ir, p, ts[k]);
        if (full && in_range(p.transfers, ts[k])) {
          const Transfer& t = p.transfers[ts[k]];
          out += fmt::format(" ch{}.{}", t.channel, t.seq);
          if (t.dir == TransferDir::Recv) out += fmt::format(" {}", slot_of(p, t.buffer, at));
        }
      }
      return out;
    }
    case RankOp::Wait:
      if (!in_range(p.transfers, in.transfer)) return fmt::format("WAIT transfer#{}?", in.transfer);
      return fmt::format("WAIT {}", transfer_name(ir, p, in.transfer).substr(5));
    case RankOp::Run: {
      if (!in_range(p.units, in.unit)) return fmt::format("RUN unit#{}?", in.unit);
      const Unit& u = p.units[in.unit];
      std::string out = "RUN ";
      for (size_t k = 0; k < u.tasks.size(); ++k)
        out += fmt::format("{}{}", k ? "+" : "", to_string(u.tasks[k]));
      if (!full) return out;
      out += " reads";
      if (u.reads.empty()) out += " -";
      for (int32_t b : u.reads) out += fmt::format(" {}", with_slot(ir, p, b, at));
      out += " writes";
      if (u.writes.empty()) out += " -";
      for (int32_t b : u.writes) out += fmt::format(" {}", with_slot(ir, p, b));
      return out;
    }
    case RankOp::Free:
      return fmt::format("FREE {}", buf_name(ir, p, in.buffer));
    case RankOp::Accumulate:
      return fmt::format("ACCUMULATE {}", buf_name(ir, p, in.buffer));
    case RankOp::Offload: {
      std::string out = fmt::format("OFFLOAD {}", buf_name(ir, p, in.buffer));
      if (full) out += fmt::format(" {}->{}", slot_of(p, in.buffer), host_slot_of(p, in.buffer));
      return out;
    }
    case RankOp::Fetch: {
      std::string out = fmt::format("FETCH {}", buf_name(ir, p, in.buffer));
      if (full)
        out += fmt::format(" {}->{}", host_slot_of(p, in.buffer), slot_of(p, in.buffer, at));
      return out;
    }
  }
  return fmt::format("op#{}?", static_cast<int>(in.op));
}

}  // namespace

std::string RankIR::describe(int rank, int instr) const {
  if (!valid(*this, rank, instr))
    return fmt::format("rank {} #{} (no such instruction)", rank, instr);
  const RankProgram& p = programs[rank];
  return fmt::format("rank {} #{} {}", rank, instr,
                     instr_text(*this, p, p.instrs[instr], false, instr));
}

std::string RankIR::to_text() const {
  const Schedule& s = plan.schedule;
  std::string out =
      fmt::format("rank-ir {}: ranks {}, stages {}, microbatches {}, channels {}\n", s.name,
                  s.num_ranks, s.num_stages, s.num_microbatches, plan.num_channels());
  out += "share classes:";
  for (const auto& c : share_classes) {
    out += " {";
    for (size_t k = 0; k < c.size(); ++k) out += fmt::format("{}{}", k ? "," : "", c[k]);
    out += "}";
  }
  out += "\n";
  for (const RankProgram& p : programs) {
    out += fmt::format("rank {}: stages [{}], class {}, {} units, {} transfers, {} instructions\n",
                       p.rank, fmt::join(p.stages, ","), p.share_class, p.units.size(),
                       p.transfers.size(), p.instrs.size());
    out += "  pools:" + pool_list(plan, p.pools, 'p') + "\n";
    if (!p.host_pools.empty()) out += "  host pools:" + pool_list(plan, p.host_pools, 'h') + "\n";
    for (size_t i = 0; i < p.instrs.size(); ++i)
      out += fmt::format("  #{} {}\n", i,
                         instr_text(*this, p, p.instrs[i], true, static_cast<int>(i)));
  }
  return out;
}

}  // namespace baton
