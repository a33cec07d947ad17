// Pass: slots of a rank's buffers. A buffer is held in its slot from the
// instruction that puts it there to the last one reading it, both included
// (held_from / held_to, set by build.cc; semantics in rank_program.h). Rows
// that no later instruction on the rank reads hold no slots. Buffers of one
// pool (RankIROptions::pool_of) share slots. Slots are given in order of
// held_from, each buffer the lowest slot whose previous buffer was last read
// before it is put there: for intervals this is optimal, so a pool has
// exactly as many slots as the most of its buffers held at once.
#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "baton/rank_program.h"

namespace baton {

void assign_slots(const Plan& plan, RankProgram& prog, const RankIROptions& opts) {
  const int32_t M = plan.schedule.num_microbatches;
  std::set<int32_t> read_rows;  // rows with a buffer some later instruction reads
  for (const RankBuffer& b : prog.buffers)
    if (b.held_to > b.held_from) read_rows.insert(b.id / M);
  std::vector<int32_t> order(prog.buffers.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return prog.buffers[a].held_from < prog.buffers[b].held_from;
  });
  std::map<int32_t, int32_t> pool_index;       // label -> prog.pools index
  std::vector<std::vector<int32_t>> slot_end;  // per pool, per slot: last read of its buffer
  prog.pools.clear();
  for (int32_t k : order) {
    RankBuffer& b = prog.buffers[k];
    b.pool = b.slot = -1;
    const int32_t row = b.id / M;
    if (!read_rows.count(row) || b.held_from < 0) continue;
    const int32_t label = opts.pool_of.empty() ? row : opts.pool_of[row];
    auto [it, fresh] = pool_index.try_emplace(label, static_cast<int32_t>(prog.pools.size()));
    if (fresh) {
      prog.pools.push_back(Pool{});
      slot_end.emplace_back();
    }
    Pool& pool = prog.pools[it->second];
    if (std::find(pool.rows.begin(), pool.rows.end(), row) == pool.rows.end())
      pool.rows.push_back(row);
    auto& ends = slot_end[it->second];
    int32_t s = 0;
    while (s < static_cast<int32_t>(ends.size()) && ends[s] >= b.held_from) ++s;
    if (s == static_cast<int32_t>(ends.size()))
      ends.push_back(b.held_to);
    else
      ends[s] = b.held_to;
    b.pool = it->second;
    b.slot = s;
    pool.slots = static_cast<int32_t>(ends.size());
  }
}

}  // namespace baton
