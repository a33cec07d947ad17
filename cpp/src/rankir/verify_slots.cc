// Verifier check "slots" (rank_program.h): where each buffer is put into its
// slot and last read is recomputed from the instructions and compared with
// held_from / held_to; then the instructions are walked in order and no
// buffer may be put into a slot whose previous buffer is still held. An
// offloaded buffer (its OFFLOAD and the FETCH after it, from the
// instructions) is held on the device over [put, OFFLOAD] in `slot` and
// [FETCH, last read] in `fetch_slot`, and in host memory over [OFFLOAD,
// FETCH] in `host_slot` of `host_pool`; each residency is checked the same
// way in its pools.
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
  // The first OFFLOAD of each buffer after it is put into its slot, and the
  // FETCH after that (the data check reports the others).
  std::vector<int32_t> off(B, -1), fet(B, -1);
  for (int i = 0; i < n; ++i) {
    const RankInstr& in = p.instrs[i];
    if (in.op == RankOp::Offload && in_range(p.buffers, in.buffer) && off[in.buffer] < 0 &&
        put[in.buffer] >= 0 && put[in.buffer] < i)
      off[in.buffer] = i;
    if (in.op == RankOp::Fetch && in_range(p.buffers, in.buffer) && off[in.buffer] >= 0 &&
        fet[in.buffer] < 0)
      fet[in.buffer] = i;
  }
  // One residency: [start, end] of buffer b in slot `slot` of pool `pool`.
  struct Span {
    int32_t start, end, b, pool, slot;
    bool host;
  };
  std::vector<Span> spans;
  auto in_pool = [&](const std::vector<Pool>& pools, int32_t pool, int32_t slot) {
    return in_range(pools, pool) && slot >= 0 && slot < pools[pool].slots;
  };
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
    if (!in_pool(p.pools, rb.pool, rb.slot)) {
      add("slots",
          fmt::format("{} puts {} into slot p{}.{}, which its pool does not have", d(r, put[b]),
                      buf(r, b), rb.pool, rb.slot),
          {r}, {put[b]}, rb.key);
      continue;
    }
    const bool offloaded = off[b] >= 0 && fet[b] >= 0;
    spans.push_back({put[b], offloaded ? off[b] : last[b], b, rb.pool, rb.slot, false});
    if (!offloaded) continue;
    if (!in_pool(p.pools, rb.pool, rb.fetch_slot))
      add("slots",
          fmt::format("{} fetches {} into slot p{}.{}, which its pool does not have", d(r, fet[b]),
                      buf(r, b), rb.pool, rb.fetch_slot),
          {r}, {fet[b]}, rb.key);
    else
      spans.push_back({fet[b], last[b], b, rb.pool, rb.fetch_slot, false});
    if (!in_pool(p.host_pools, rb.host_pool, rb.host_slot))
      add("slots",
          fmt::format("{} offloads {} into host slot h{}.{}, which its host pool does not have",
                      d(r, off[b]), buf(r, b), rb.host_pool, rb.host_slot),
          {r}, {off[b]}, rb.key);
    else
      spans.push_back({off[b], fet[b], b, rb.host_pool, rb.host_slot, true});
  }
  std::stable_sort(spans.begin(), spans.end(),
                   [](const Span& a, const Span& b) { return a.start < b.start; });
  // Per pool and slot, the residency that last took it.
  std::vector<std::vector<int32_t>> occupant(p.pools.size()), host_occupant(p.host_pools.size());
  for (size_t k = 0; k < p.pools.size(); ++k) occupant[k].assign(std::max(0, p.pools[k].slots), -1);
  for (size_t k = 0; k < p.host_pools.size(); ++k)
    host_occupant[k].assign(std::max(0, p.host_pools[k].slots), -1);
  for (int32_t k = 0; k < static_cast<int32_t>(spans.size()); ++k) {
    const Span& x = spans[k];
    int32_t& occ = (x.host ? host_occupant : occupant)[x.pool][x.slot];
    if (occ >= 0 && spans[occ].end >= x.start) {
      const Span& o = spans[occ];
      const RankBuffer& rb = p.buffers[x.b];
      if (x.host)
        add("slots",
            fmt::format("{} puts {} into host slot h{}.{}, which still holds {} (offloaded at "
                        "#{}, fetched at #{})",
                        d(r, x.start), buf(r, x.b), x.pool, x.slot, buf(r, o.b), o.start, o.end),
            {r, r}, {o.start, x.start}, rb.key);
      else
        add("slots",
            fmt::format("{} puts {} into slot p{}.{}, which still holds {} (held since #{}, {} "
                        "#{})",
                        d(r, x.start), buf(r, x.b), x.pool, x.slot, buf(r, o.b), o.start,
                        o.end == off[o.b] && o.start == put[o.b] ? "offloaded at" : "read until",
                        o.end),
            {r, r}, {o.start, x.start}, rb.key);
    }
    occ = k;
  }
}

}  // namespace baton::rankir_verify
