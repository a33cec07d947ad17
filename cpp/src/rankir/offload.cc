// Pass: activation offload (rank_program.h, RankIROptions::offload). For a
// stage with Offload::Stash, each Stash buffer of the rank that some later
// RUN reads, with at least one other RUN between the RUN writing it and the
// first RUN reading it, is offloaded:
//   OFFLOAD just after the RUN writing it;
//   FETCH just before the RUN `fetch_lookahead` RUNs before the first RUN
//     reading it (the copy overlaps that much compute), but never before the
//     first RUN after the writer.
// Instructions are inserted into the lowered list, then every back-reference
// (unit.instr, group.post, transfer.wait, the buffers' live / held ranges) is
// renumbered. At one position OFFLOADs come before FETCHes, each in buffer
// order.
#include <algorithm>
#include <tuple>
#include <vector>

#include "baton/rank_program.h"

namespace baton {

void place_offloads(const Plan& /*plan*/, RankProgram& prog, const RankIROptions& opts) {
  if (opts.offload.empty()) return;
  const int32_t n = static_cast<int32_t>(prog.instrs.size());
  const int32_t lookahead = std::max<int32_t>(1, opts.fetch_lookahead);
  // The RUNs in order, and per instruction the number of RUNs before it.
  std::vector<int32_t> runs, runs_before(n + 1, 0);
  for (int32_t i = 0; i < n; ++i) {
    runs_before[i + 1] = runs_before[i];
    if (prog.instrs[i].op == RankOp::Run) {
      runs.push_back(i);
      ++runs_before[i + 1];
    }
  }
  // The first RUN after each buffer's writer that reads it.
  const int32_t B = static_cast<int32_t>(prog.buffers.size());
  std::vector<int32_t> writer(B, -1), reader(B, -1);
  for (int32_t i : runs) {
    const Unit& u = prog.units[prog.instrs[i].unit];
    for (int32_t b : u.reads)
      if (writer[b] >= 0 && reader[b] < 0) reader[b] = i;
    for (int32_t b : u.writes)
      if (writer[b] < 0) writer[b] = i;
  }
  // (insert before old instruction, 0 OFFLOAD / 1 FETCH, buffer)
  std::vector<std::tuple<int32_t, int, int32_t>> inserts;
  for (int32_t b = 0; b < B; ++b) {
    const RankBuffer& rb = prog.buffers[b];
    if (rb.key.kind != BufKind::Stash || writer[b] < 0 || reader[b] < 0) continue;
    const int32_t s = rb.key.stage;
    if (s < 0 || s >= static_cast<int32_t>(opts.offload.size()) ||
        opts.offload[s] != Offload::Stash)
      continue;
    const int32_t w = runs_before[writer[b]];  // index of the writer among the RUNs
    const int32_t r = runs_before[reader[b]];  // of the reader
    if (r - w < 2) continue;                   // no other RUN in between
    const int32_t target = std::max(w + 1, r - lookahead);
    inserts.emplace_back(writer[b] + 1, 0, b);
    inserts.emplace_back(runs[target], 1, b);
  }
  if (inserts.empty()) return;
  std::sort(inserts.begin(), inserts.end());
  std::vector<RankInstr> out;
  out.reserve(prog.instrs.size() + inserts.size());
  std::vector<int32_t> moved(n + 1, -1);  // old index -> new index
  size_t k = 0;
  for (int32_t i = 0; i <= n; ++i) {
    for (; k < inserts.size() && std::get<0>(inserts[k]) == i; ++k) {
      const auto [at, what, b] = inserts[k];
      (what == 0 ? prog.buffers[b].offload : prog.buffers[b].fetch) =
          static_cast<int32_t>(out.size());
      out.push_back(RankInstr{what == 0 ? RankOp::Offload : RankOp::Fetch, -1, -1, -1, b});
    }
    moved[i] = static_cast<int32_t>(out.size());
    if (i < n) out.push_back(prog.instrs[i]);
  }
  prog.instrs = std::move(out);
  auto renumber = [&](int32_t& i) {
    if (i >= 0) i = moved[i];
  };
  for (Unit& u : prog.units) renumber(u.instr);
  for (TransferGroup& g : prog.groups) renumber(g.post);
  for (Transfer& t : prog.transfers) renumber(t.wait);
  for (RankBuffer& b : prog.buffers) {
    renumber(b.live_from);
    renumber(b.live_to);
    renumber(b.held_from);
    renumber(b.held_to);
  }
}

}  // namespace baton
