// The simulator's error messages: an instruction described for a message, and
// the report of a program that cannot make progress (stuck ranks, unmatched
// sends and receives).
#include <fmt/format.h>

#include <string>
#include <vector>

#include "baton/error.h"
#include "sim_internal.h"

namespace baton::sim_detail {

std::string Simulator::describe(int rank, int index) const {
  const auto& prog = plan_.programs[rank];
  if (index < 0 || index >= static_cast<int>(prog.size()))
    return fmt::format("rank {} #{}", rank, index);
  const Instr& in = prog[index];
  std::string head = fmt::format("rank {} #{} {}", rank, index, opcode_name(in.op));
  const bool buf_ok = in.buffer >= 0 && in.buffer < ids_.count();
  switch (in.op) {
    case OpCode::Run: {
      const auto& acts = plan_.schedule.rank_actions[rank];
      if (in.action >= 0 && in.action < static_cast<int>(acts.size()))
        return head + " " + to_string(acts[in.action]);
      return fmt::format("{} <action {}>", head, in.action);
    }
    case OpCode::Send:
      return fmt::format("{} {}->{}", head, buf_ok ? buf_name(in.buffer) : "<bad buffer>", in.peer);
    case OpCode::Recv:
      return fmt::format("{} {}<-{}", head, buf_ok ? buf_name(in.buffer) : "<bad buffer>", in.peer);
    case OpCode::Free:
    case OpCode::Accumulate:
      return fmt::format("{} {}", head, buf_ok ? buf_name(in.buffer) : "<bad buffer>");
  }
  return head;
}

void Simulator::report_stuck() const {
  std::vector<std::string> lines;
  std::vector<int> stuck;
  for (int32_t r = 0; r < P_; ++r) {
    const RankState& st = ranks_[r];
    if (st.status == Status::Done) continue;
    stuck.push_back(r);
    std::string line = describe(r, st.pc) + " waits for";
    const Instr& in = plan_.programs[r][st.pc];
    const Action& a = plan_.schedule.rank_actions[r][in.action];
    IdList ins, outs;
    ins.dedupe = outs.dedupe = true;
    task_io(ids_, a.first, ins, outs);
    if (a.is_fused()) task_io(ids_, a.second, ins, outs);
    bool first = true;
    for (int k = 0; k < ins.n; ++k) {
      const int32_t l = find_life(r, ins.v[k]);
      if (l < 0 || lives_[l].ready_known) continue;
      const int32_t src = res_.transfers[lives_[l].transfer].src;
      line += fmt::format("{} {} from rank {} (rank {} ", first ? "" : ",", buf_name(ins.v[k]), src,
                          src);
      const RankState& ss = ranks_[src];
      if (ss.status == Status::Done)
        line += "finished without sending it)";
      else
        line += fmt::format("is stuck at #{})", ss.pc);
      first = false;
    }
    lines.push_back(std::move(line));
  }
  std::string msg;
  if (!stuck.empty()) {
    msg = "simulate: the program cannot make progress; stuck ranks:";
    for (int r : stuck) msg += fmt::format(" {}", r);
    msg += "\n";
    for (const auto& l : lines) msg += "  " + l + "\n";
  } else {
    msg = "simulate: communication never completes\n";
  }
  int shown = 0, more = 0;
  for (size_t t = 0; t < xs_.size(); ++t) {
    const XferState& x = xs_[t];
    const TransferEvent& e = res_.transfers[t];
    if (x.has_send && x.has_recv) continue;
    if (shown >= 8) {
      ++more;
      continue;
    }
    ++shown;
    if (x.has_send)
      msg += fmt::format("  {} is never received\n", describe(e.src, e.send_instr));
    else
      msg += fmt::format("  {} never gets its send\n", describe(e.dst, e.recv_instr));
  }
  if (more) msg += fmt::format("  ... and {} more unmatched sends/receives\n", more);
  msg.pop_back();
  throw VerifyError(msg);
}

}  // namespace baton::sim_detail
