// Rolling a rank program's items into runs of a repeating pattern (roll.h).
#include "baton/roll.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "baton/error.h"

namespace baton {

namespace {

constexpr int kMaxPeriodPerStage = 4;

using Row = std::pair<int, int32_t>;  // (kind, stage)

auto order(const BufferKey& k) {
  return std::make_tuple(static_cast<int>(k.kind), k.stage, k.microbatch);
}

struct KeyLess {
  bool operator()(const BufferKey& a, const BufferKey& b) const { return order(a) < order(b); }
};

struct PairKeyLess {
  bool operator()(const std::pair<BufferKey, int>& a, const std::pair<BufferKey, int>& b) const {
    return std::pair(order(a.first), a.second) < std::pair(order(b.first), b.second);
  }
};

BufferKey shifted(BufferKey k, int32_t d) {
  k.microbatch += d;
  return k;
}

std::vector<BufferKey> keys(const Plan& plan, const std::vector<int32_t>& ids) {
  std::vector<BufferKey> out;
  out.reserve(ids.size());
  for (int32_t id : ids) out.push_back(plan.buffer_key(id));
  return out;
}

RollItem task_item(const Plan& plan, const Action& a, bool fused) {
  RollItem it;
  it.op = ItemOp::Run;
  it.task = a.first.kind;
  it.fused = fused;
  it.stage = a.first.stage;
  it.microbatch = a.first.microbatch;
  it.reads = keys(plan, plan.action_inputs(a));
  for (const BufferKey& k : keys(plan, plan.action_outputs(a)))
    if (k.kind != BufKind::WGrad) it.writes.push_back(k);
  return it;
}

// The carry slots of `pattern` (items[first, first + period)) as a scan body
// advancing `delta` microbatches per repetition and the number of reads of a
// slot after its new value is made; nullopt when it cannot be one.
struct Slots {
  std::set<BufferKey, KeyLess> keys;
  int copies = 0;
};

std::optional<Slots> analyze(const std::vector<RollItem>& items, int first, int period,
                             int32_t delta) {
  std::map<Row, std::map<int32_t, int>> makers;
  for (int j = 0; j < period; ++j) {
    for (const BufferKey& k : items[first + j].writes) {
      auto& mk = makers[{static_cast<int>(k.kind), k.stage}];
      if (!mk.emplace(k.microbatch, j).second) return std::nullopt;
    }
  }
  Slots slots;
  for (int j = 0; j < period; ++j) {
    for (const BufferKey& k : items[first + j].reads) {
      auto row = makers.find({static_cast<int>(k.kind), k.stage});
      // made before the run: the scan would read it from a stack of the buffers
      if (row == makers.end()) return std::nullopt;
      const auto& mk = row->second;
      auto here = mk.find(k.microbatch);
      if (here != mk.end() && here->second < j) continue;  // made earlier in this repetition
      auto next = mk.find(k.microbatch + delta);
      if (next == mk.end()) return std::nullopt;
      slots.keys.insert(shifted(k, delta));
      if (next->second < j) ++slots.copies;  // overwritten before this read: both live at once
    }
  }
  return slots;
}

// The last item reading each value of a buffer: (key, the item that made that
// value) -> position. A buffer is made twice when it is offloaded: by its task,
// then by its FETCH, and the reads after the FETCH read the second value.
using LastRead = std::map<std::pair<BufferKey, int>, int, PairKeyLess>;

LastRead last_reads(const std::vector<RollItem>& items) {
  LastRead last;
  std::map<BufferKey, int, KeyLess> maker;
  for (int pos = 0; pos < static_cast<int>(items.size()); ++pos) {
    for (const BufferKey& k : items[pos].reads) {
      auto m = maker.find(k);
      last[{k, m == maker.end() ? -1 : m->second}] = pos;
    }
    for (const BufferKey& k : items[pos].writes) maker[k] = pos;
  }
  return last;
}

std::vector<BufferKey> stacked_out(const std::vector<RollItem>& items, const LastRead& last,
                                   int first, int period, int reps, int32_t delta,
                                   const std::set<BufferKey, KeyLess>& slots) {
  std::map<BufferKey, int, KeyLess> made;  // key -> its position in the pattern
  for (int j = 0; j < period; ++j)
    for (const BufferKey& k : items[first + j].writes) made[k] = j;
  const int end = first + period * reps;
  std::vector<BufferKey> out;
  for (const auto& [k, j] : made) {
    std::vector<int> later;
    for (int t = 0; t < reps; ++t) {
      auto it = last.find({shifted(k, t * delta), first + t * period + j});
      if (it != last.end() && it->second >= end) later.push_back(t);
    }
    if (!later.empty() && !(slots.count(k) && later == std::vector<int>{reps - 1}))
      out.push_back(k);
  }
  return out;
}

bool is_task(const RollItem& it) { return it.op == ItemOp::Run; }

RollRun single(int pos) {
  RollRun r;
  r.first = pos;
  return r;
}

}  // namespace

const char* item_op_name(ItemOp op) {
  switch (op) {
    case ItemOp::Run:
      return "run";
    case ItemOp::Send:
      return "send";
    case ItemOp::Post:
      return "post";
    case ItemOp::Wait:
      return "wait";
    case ItemOp::Offload:
      return "offload";
    case ItemOp::Fetch:
      return "fetch";
  }
  return "?";
}

bool RollItem::same_shifted(const RollItem& o, int32_t d) const {
  return op == o.op && task == o.task && fused == o.fused && buffer == o.buffer &&
         stage == o.stage && microbatch == o.microbatch + d && peer == o.peer;
}

std::vector<RollItem> rank_items(const Plan& plan, const RankProgram& prog,
                                 const RollOptions& opts) {
  const auto& actions = plan.schedule.rank_actions.at(prog.rank);
  std::vector<RollItem> items;
  auto transfer_item = [&](const Transfer& x, ItemOp op) {
    RollItem it;
    it.op = op;
    const BufferKey k = prog.buffers.at(x.buffer).key;
    it.buffer = k.kind;
    it.stage = k.stage;
    it.microbatch = k.microbatch;
    it.peer = x.peer;
    if (op == ItemOp::Send) it.reads = {k};
    if (op == ItemOp::Wait) it.writes = {k};
    items.push_back(std::move(it));
  };
  for (const RankInstr& ins : prog.instrs) {
    switch (ins.op) {
      case RankOp::Post:
        for (int32_t t : prog.groups.at(ins.group).transfers) {
          const Transfer& x = prog.transfers.at(t);
          transfer_item(x, x.dir == TransferDir::Send ? ItemOp::Send : ItemOp::Post);
        }
        break;
      case RankOp::Wait:
        transfer_item(prog.transfers.at(ins.transfer), ItemOp::Wait);
        break;
      case RankOp::Run: {
        const Action& a = actions.at(prog.units.at(ins.unit).action);
        if (!a.is_fused()) {
          items.push_back(task_item(plan, a, false));
        } else if (opts.fuse_fb && a.first.kind == TaskKind::F && a.second.kind == TaskKind::B &&
                   a.first.stage == a.second.stage && a.first.microbatch == a.second.microbatch) {
          items.push_back(task_item(plan, a, true));
        } else {
          items.push_back(task_item(plan, Action{a.first}, false));
          items.push_back(task_item(plan, Action{a.second}, false));
        }
        break;
      }
      case RankOp::Offload:
      case RankOp::Fetch: {
        // OFFLOAD reads the buffer (its device copy is dead after it); FETCH makes it
        // again on the device, so the backward reading it reads the FETCH's value and no
        // carry slot holds it on the device from its forward to its backward
        RollItem it;
        it.op = ins.op == RankOp::Offload ? ItemOp::Offload : ItemOp::Fetch;
        const BufferKey k = prog.buffers.at(ins.buffer).key;
        it.buffer = k.kind;
        it.stage = k.stage;
        it.microbatch = k.microbatch;
        if (ins.op == RankOp::Offload) {
          it.reads = {k};
        } else {
          it.writes = {k};
        }
        items.push_back(std::move(it));
        break;
      }
      case RankOp::Free:
      case RankOp::Accumulate:
        break;
    }
  }
  return items;
}

RolledRank roll_rank(const Plan& plan, const RankProgram& prog, const RollOptions& opts) {
  RolledRank out;
  out.rank = prog.rank;
  out.items = rank_items(plan, prog, opts);
  const std::vector<RollItem>& items = out.items;
  const int n = static_cast<int>(items.size());
  const int M = plan.schedule.num_microbatches;
  const int max_p = std::max(
      1, opts.max_period > 0 ? opts.max_period : kMaxPeriodPerStage * plan.schedule.num_stages);
  const LastRead last = last_reads(items);

  // Greedy from the front: (period, repetitions, delta) of the best key
  // (-slot copies, items covered), the first of equal keys.
  struct Pick {
    int p = 1, r = 1;
    int32_t d = 1;
  };
  std::vector<Pick> picks;
  for (int i = 0; i < n;) {
    Pick best;
    // A copy costs every repetition; rolling only saves compile time, so no
    // coverage pays for a copy.
    std::pair<long, long> best_key{-(1L << 30), 1};
    for (int p = 1; p <= std::min(max_p, (n - i) / 2); ++p) {
      for (int32_t d = 1; d <= std::min(p, M); ++d) {
        int r = 1;
        while (i + (r + 1) * p <= n) {
          bool same = true;
          for (int j = 0; j < p && same; ++j)
            same = items[i + r * p + j].same_shifted(items[i + j], r * d);
          if (!same) break;
          ++r;
        }
        if (r < 2 || std::pair<long, long>{0, r * p} <= best_key) continue;
        const auto slots = analyze(items, i, p, d);
        if (!slots) continue;
        const std::pair<long, long> key{-slots->copies, r * p};
        if (key > best_key &&
            (opts.stacked || stacked_out(items, last, i, p, r, d, slots->keys).empty())) {
          best = {p, r, d};
          best_key = key;
        }
      }
    }
    picks.push_back(best);
    i += best.p * best.r;
  }

  // Rotation: a run whose pattern starts and ends with transfers becomes its
  // leading transfers in place, the pattern from its first task for one
  // repetition fewer, and the last repetition's rest in place.
  int pos = 0;
  for (const Pick& pk : picks) {
    const int i = pos;
    pos += pk.p * pk.r;
    int k = 0;
    while (k < pk.p && !is_task(items[i + k])) ++k;
    if (pk.r > 2 && k > 0 && k < pk.p && !is_task(items[i + pk.p - 1]) &&
        analyze(items, i + k, pk.p, pk.d)) {
      for (int j = 0; j < k; ++j) out.runs.push_back(single(i + j));
      RollRun run;
      run.first = i + k;
      run.period = pk.p;
      run.repetitions = pk.r - 1;
      run.delta = pk.d;
      out.runs.push_back(run);
      for (int j = i + k + (pk.r - 1) * pk.p; j < i + pk.p * pk.r; ++j)
        out.runs.push_back(single(j));
      continue;
    }
    RollRun run;
    run.first = i;
    run.period = pk.p;
    run.repetitions = pk.r;
    run.delta = pk.d;
    out.runs.push_back(run);
  }

  // What the lowering needs of each run of several repetitions.
  for (RollRun& run : out.runs) {
    if (run.repetitions < 2) continue;
    const auto slots = analyze(items, run.first, run.period, run.delta);
    if (!slots) {
      throw Error(
          fmt::format("rank {}: internal: the run at item {} (period {}) has no carry "
                      "slots after rotation",
                      prog.rank, run.first, run.period));
    }
    run.slots.assign(slots->keys.begin(), slots->keys.end());
    run.stacked =
        stacked_out(items, last, run.first, run.period, run.repetitions, run.delta, slots->keys);
  }
  return out;
}

namespace {

std::string item_name(const Plan& plan, const RollItem& it) {
  if (it.op == ItemOp::Run) {
    return it.fused ? fmt::format("FB{}.{}", it.stage, it.microbatch)
                    : fmt::format("{}{}.{}", task_kind_char(it.task), it.stage, it.microbatch);
  }
  const std::string buf =
      plan.describe_buffer(plan.buffer_id(BufferKey{it.buffer, it.stage, it.microbatch}));
  if (it.op == ItemOp::Offload || it.op == ItemOp::Fetch)
    return fmt::format("{}{}", it.op == ItemOp::Offload ? "^" : "v", buf);
  const char* sym = it.op == ItemOp::Send ? ">" : it.op == ItemOp::Post ? "+" : "<";
  return fmt::format("{}{}{}{}", sym, buf, it.op == ItemOp::Send ? "->" : "<-", it.peer);
}

std::string buffer_list(const Plan& plan, const std::vector<BufferKey>& ks) {
  std::string s;
  for (const BufferKey& k : ks) {
    s += ' ';
    s += plan.describe_buffer(plan.buffer_id(k));
  }
  return s;
}

}  // namespace

std::string RolledRank::to_text(const Plan& plan) const {
  std::string s =
      fmt::format("rolled rank {}: {} items, {} runs\n", rank, items.size(), runs.size());
  for (const RollRun& r : runs) {
    std::string pat;
    for (int j = 0; j < r.period; ++j) {
      if (j) pat += ' ';
      pat += item_name(plan, items.at(r.first + j));
    }
    if (r.repetitions < 2) {
      s += fmt::format("  #{} {}\n", r.first, pat);
      continue;
    }
    s += fmt::format("  #{} scan {} x [{}] +{}\n", r.first, r.repetitions, pat, r.delta);
    if (!r.slots.empty()) s += fmt::format("    slots:{}\n", buffer_list(plan, r.slots));
    if (!r.stacked.empty()) s += fmt::format("    stacked:{}\n", buffer_list(plan, r.stacked));
  }
  return s;
}

}  // namespace baton
