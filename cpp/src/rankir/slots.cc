// Pass: slots of a rank's buffers from the plan's lifetimes. A buffer lives
// from the instruction that creates it (the RUN writing it, the POST of its
// receive) to its FREE, both included; buffers of one pool (RankIROptions::
// pool_of) share slots. Slots are given in order of creation, each buffer the
// lowest slot whose previous buffer was freed before it is created: for
// intervals this is optimal, so a pool has exactly as many slots as the most
// of its buffers live at once.
#include <map>

#include "baton/rank_program.h"

namespace baton {

void assign_slots(const Plan& plan, RankProgram& prog, const RankIROptions& opts) {
  const int32_t M = plan.schedule.num_microbatches;
  const int32_t end = static_cast<int32_t>(prog.instrs.size());
  std::map<int32_t, int32_t> pool_index;       // label -> prog.pools index
  std::vector<std::vector<int32_t>> slot_end;  // per pool, per slot: last instr of its buffer
  prog.pools.clear();
  // Buffers are numbered in order of creation (build.cc), so this walk is
  // in order of live_from.
  for (RankBuffer& b : prog.buffers) {
    const int32_t row = b.id / M;
    const int32_t label = opts.pool_of.empty() ? row : opts.pool_of[row];
    auto [it, fresh] = pool_index.try_emplace(label, static_cast<int32_t>(prog.pools.size()));
    if (fresh) {
      prog.pools.push_back(Pool{});
      slot_end.emplace_back();
    }
    Pool& pool = prog.pools[it->second];
    bool listed = false;
    for (int32_t r : pool.rows) listed |= r == row;
    if (!listed) pool.rows.push_back(row);
    auto& ends = slot_end[it->second];
    const int32_t last = b.live_to >= 0 ? b.live_to : end;
    int32_t s = 0;
    while (s < static_cast<int32_t>(ends.size()) && ends[s] >= b.live_from) ++s;
    if (s == static_cast<int32_t>(ends.size()))
      ends.push_back(last);
    else
      ends[s] = last;
    b.pool = it->second;
    b.slot = s;
    pool.slots = static_cast<int32_t>(ends.size());
  }
}

}  // namespace baton
