// Verifier over a lowered Plan (checks documented in verify.h).
//
// Everything on the success path is linear in the number of instructions and
// allocation-light: per-buffer state lives in a dense array indexed by buffer
// id (reset after each rank through a touched list), SEND/RECV matching walks
// short per-buffer chains, and the abstract execution is a worklist over ranks
// that moves from communication group to communication group, posting and
// completing every op once. Strings are only built when something is wrong.
//
// This file: the structure check and the entry points (verify,
// check_deadlock); the other checks are in verify_data.cc, verify_comm.cc and
// verify_deadlock.cc.
#include "baton/verify.h"

#include <fmt/format.h>

#include "baton/error.h"
#include "verify_internal.h"

namespace baton {

namespace verify_detail {

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

}  // namespace verify_detail

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
  build_counters().verify.fetch_add(1, std::memory_order_relaxed);
  VerifyReport rep;
  {
    verify_detail::Verifier v(plan, rep);
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
    verify_detail::Verifier v(plan, rep);
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
