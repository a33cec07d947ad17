// Pass: slots of a rank's buffers. A buffer is held in its slot from the
// instruction that puts it there to the last one reading it, both included
// (held_from / held_to, set by build.cc; semantics in rank_program.h). Rows
// that no later instruction on the rank reads hold no slots. Buffers of one
// pool (RankIROptions::pool_of) share slots. An offloaded buffer (offload.cc)
// is held on the device over two intervals, [held_from, offload] in `slot`
// and [fetch, held_to] in `fetch_slot`, and in host memory over [offload,
// fetch], in a host pool (one per pool label). Slots are given per pool in
// order of the intervals' starts, each interval the lowest slot whose
// previous interval ended before it starts: for intervals this is optimal, so
// a pool has exactly as many slots as the most of its intervals at once.
#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "baton/rank_program.h"

namespace baton {

namespace {

// One residency of a buffer: on the device (its first or, after a FETCH, its
// second interval) or in host memory.
enum class Where { Device, Fetched, Host };

struct Interval {
  int32_t start, end, buffer;
  Where where;
};

// Greedy interval colouring per pool: `pools` / `ends` grow as labels appear.
struct SlotGiver {
  std::vector<Pool>& pools;
  std::map<int32_t, int32_t> index;            // label -> pools index
  std::vector<std::vector<int32_t>> slot_end;  // per pool, per slot: end of its last interval

  explicit SlotGiver(std::vector<Pool>& p) : pools(p) { pools.clear(); }

  // (pool, slot) for [start, end] of a buffer of `row` in pool `label`.
  std::pair<int32_t, int32_t> give(int32_t label, int32_t row, int32_t start, int32_t end) {
    auto [it, fresh] = index.try_emplace(label, static_cast<int32_t>(pools.size()));
    if (fresh) {
      pools.push_back(Pool{});
      slot_end.emplace_back();
    }
    Pool& pool = pools[it->second];
    if (std::find(pool.rows.begin(), pool.rows.end(), row) == pool.rows.end())
      pool.rows.push_back(row);
    auto& ends = slot_end[it->second];
    int32_t s = 0;
    while (s < static_cast<int32_t>(ends.size()) && ends[s] >= start) ++s;
    if (s == static_cast<int32_t>(ends.size()))
      ends.push_back(end);
    else
      ends[s] = end;
    pool.slots = static_cast<int32_t>(ends.size());
    return {it->second, s};
  }
};

}  // namespace

void assign_slots(const Plan& plan, RankProgram& prog, const RankIROptions& opts) {
  const int32_t M = plan.schedule.num_microbatches;
  std::set<int32_t> read_rows;  // rows with a buffer some later instruction reads
  for (const RankBuffer& b : prog.buffers)
    if (b.held_to > b.held_from) read_rows.insert(b.id / M);
  std::vector<Interval> device, host;
  for (int32_t k = 0; k < static_cast<int32_t>(prog.buffers.size()); ++k) {
    RankBuffer& b = prog.buffers[k];
    b.pool = b.slot = b.fetch_slot = b.host_pool = b.host_slot = -1;
    if (!read_rows.count(b.id / M) || b.held_from < 0) continue;
    const bool off = b.offload >= 0 && b.fetch >= b.offload;
    device.push_back({b.held_from, off ? b.offload : b.held_to, k, Where::Device});
    if (!off) continue;
    device.push_back({b.fetch, b.held_to, k, Where::Fetched});
    host.push_back({b.offload, b.fetch, k, Where::Host});
  }
  auto by_start = [](const Interval& a, const Interval& b) { return a.start < b.start; };
  std::stable_sort(device.begin(), device.end(), by_start);
  std::stable_sort(host.begin(), host.end(), by_start);
  SlotGiver dev(prog.pools), hst(prog.host_pools);
  for (const std::vector<Interval>* list : {&device, &host}) {
    for (const Interval& iv : *list) {
      RankBuffer& b = prog.buffers[iv.buffer];
      const int32_t row = b.id / M;
      const int32_t label = opts.pool_of.empty() ? row : opts.pool_of[row];
      const auto [pool, slot] =
          (iv.where == Where::Host ? hst : dev).give(label, row, iv.start, iv.end);
      switch (iv.where) {
        case Where::Device:
          b.pool = pool;
          b.slot = slot;
          break;
        case Where::Fetched:
          b.fetch_slot = slot;
          break;
        case Where::Host:
          b.host_pool = pool;
          b.host_slot = slot;
          break;
      }
    }
  }
}

}  // namespace baton
