// Verifier check "slots" (rank_program.h): where each buffer is put into its
// slot and last read is recomputed from the instructions and compared with
// held_from / held_to; then the instructions are walked in order and no
// buffer may be put into a slot whose previous buffer is still held.
#include <algorithm>
#include <vector>

#include "ir_verifier.h"

namespace baton::rankir_verify {

void IRVerifier::slots(int r) {
  const RankProgram& p = prog(r);
  const int n = static_cast<int>(p.instrs.size());
  const size_t B = p.buffers.size();
  std::vector<int32_t> put(B, -1), last(B, -1);
  auto read = [&](int32_t b, int i) {
    if (in_range(p.buffers, b) && put[b] >= 0) last[b] = std::max(last[b], i);
  };
  for (int i = 0; i < n; ++i) {
    const RankInstr& in = p.instrs[i];
    if (in.op == RankOp::Run) {
      for (int32_t b : p.units[in.unit].reads) read(b, i);
      for (int32_t b : p.units[in.unit].writes)
        if (in_range(p.buffers, b) && put[b] < 0) put[b] = last[b] = i;
    } else if (in.op == RankOp::Wait) {
      const int32_t b = p.transfers[in.transfer].buffer;
      if (in_range(p.buffers, b) && put[b] < 0) put[b] = last[b] = i;
    } else if (in.op == RankOp::Post) {
      for (int32_t t : p.groups[in.group].transfers)
        if (p.transfers[t].dir == TransferDir::Send) read(p.transfers[t].buffer, i);
    }
  }
  std::vector<int32_t> order;
  for (int32_t b = 0; b < static_cast<int32_t>(B); ++b) {
    const RankBuffer& rb = p.buffers[b];
    if (put[b] < 0) continue;  // never made on the rank: the data check names it
    if (rb.held_from != put[b] || rb.held_to != last[b]) {
      add("slots",
          fmt::format("rank {}: {} records that it is held from #{} to #{}, but the "
                      "instructions put it into its slot at #{} and last read it at #{}",
                      r, buf(r, b), rb.held_from, rb.held_to, put[b], last[b]),
          {r}, {put[b]}, rb.key);
    }
    if (rb.pool < 0 && last[b] > put[b]) {
      add("slots",
          fmt::format("{} puts {} into no slot, but #{} reads it", d(r, put[b]), buf(r, b),
                      last[b]),
          {r, r}, {put[b], last[b]}, rb.key);
      continue;
    }
    if (rb.pool < 0) continue;
    if (!in_range(p.pools, rb.pool) || rb.slot < 0 || rb.slot >= p.pools[rb.pool].slots) {
      add("slots",
          fmt::format("{} puts {} into slot p{}.{}, which its pool does not have", d(r, put[b]),
                      buf(r, b), rb.pool, rb.slot),
          {r}, {put[b]}, rb.key);
      continue;
    }
    order.push_back(b);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return put[a] < put[b]; });
  std::vector<std::vector<int32_t>> occupant(p.pools.size());
  for (size_t k = 0; k < p.pools.size(); ++k) occupant[k].assign(std::max(0, p.pools[k].slots), -1);
  for (int32_t b : order) {
    const RankBuffer& rb = p.buffers[b];
    int32_t& occ = occupant[rb.pool][rb.slot];
    if (occ >= 0 && last[occ] >= put[b])
      add("slots",
          fmt::format("{} puts {} into slot p{}.{}, which still holds {} (held since #{}, "
                      "read until #{})",
                      d(r, put[b]), buf(r, b), rb.pool, rb.slot, buf(r, occ), put[occ], last[occ]),
          {r, r}, {put[occ], put[b]}, rb.key);
    occ = b;
  }
}

}  // namespace baton::rankir_verify
