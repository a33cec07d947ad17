// Activation offload in rank programs (rank_program.h, offload.cc): golden
// text, placement on every generator, mutations the verifier must catch, the
// options' errors, slots and the simulator's copy engines.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/rank_program.h"
#include "baton/sim.h"
#include "baton/verify.h"
#include "test_golden_util.h"

namespace baton {
namespace {

RankIROptions offload_all(const Schedule& s, int32_t lookahead = 1) {
  RankIROptions o;
  o.offload.assign(s.num_stages, Offload::Stash);
  o.fetch_lookahead = lookahead;
  return o;
}

RankIR offload_ir(const Schedule& s, int32_t lookahead = 1) {
  return build_rank_ir(lower(s), offload_all(s, lookahead));
}

std::string report(const RankIR& ir) { return verify_rank_ir(ir).to_string(); }

// Reorders rank r's instructions so that old instruction k goes to new[k]
// and renumbers every back-reference, as an editing pass would: the verifier
// must then judge the order alone.
void permute(RankProgram& p, const std::vector<int>& to) {
  std::vector<RankInstr> out(to.size());
  for (size_t k = 0; k < to.size(); ++k) out[to[k]] = p.instrs[k];
  p.instrs = std::move(out);
  auto fix = [&](int32_t& i) {
    if (i >= 0 && i < static_cast<int32_t>(to.size())) i = to[i];
  };
  for (Unit& u : p.units) fix(u.instr);
  for (TransferGroup& g : p.groups) fix(g.post);
  for (Transfer& t : p.transfers) fix(t.wait);
  for (RankBuffer& b : p.buffers)
    for (int32_t* f : {&b.live_from, &b.live_to, &b.held_from, &b.held_to, &b.offload, &b.fetch})
      fix(*f);
}

// Moves instruction `from` to just after instruction `after`.
void move_after(RankProgram& p, int from, int after) {
  std::vector<int> order(p.instrs.size());  // new position -> old index
  std::iota(order.begin(), order.end(), 0);
  order.erase(order.begin() + from);
  order.insert(std::find(order.begin(), order.end(), after) + 1, from);
  std::vector<int> to(order.size());
  for (size_t k = 0; k < order.size(); ++k) to[order[k]] = static_cast<int>(k);
  permute(p, to);
}

// Inserts `in` before instruction `at`.
void insert_at(RankProgram& p, int at, const RankInstr& in) {
  std::vector<int> to(p.instrs.size());
  for (size_t k = 0; k < to.size(); ++k) to[k] = static_cast<int>(k) + (k >= size_t(at) ? 1 : 0);
  p.instrs.push_back(RankInstr{});
  to.push_back(at);  // the placeholder lands at `at`
  permute(p, to);
  p.instrs[at] = in;
}

int find_buffer(const RankProgram& p, const BufferKey& key) {
  for (int b = 0; b < static_cast<int>(p.buffers.size()); ++b)
    if (p.buffers[b].key == key) return b;
  return -1;
}

// Per buffer of the rank: the RUN writing it and the first later RUN reading it.
struct RunsOf {
  std::vector<int> runs;  // instruction indices of the RUNs
  std::vector<int> writer, reader;
};
RunsOf runs_of(const RankProgram& p) {
  RunsOf o;
  o.writer.assign(p.buffers.size(), -1);
  o.reader.assign(p.buffers.size(), -1);
  for (int i = 0; i < static_cast<int>(p.instrs.size()); ++i) {
    if (p.instrs[i].op != RankOp::Run) continue;
    const int k = static_cast<int>(o.runs.size());
    o.runs.push_back(i);
    const Unit& u = p.units[p.instrs[i].unit];
    for (int32_t b : u.reads)
      if (o.writer[b] >= 0 && o.reader[b] < 0) o.reader[b] = k;
    for (int32_t b : u.writes)
      if (o.writer[b] < 0) o.writer[b] = k;
  }
  return o;
}

TEST(RankIROffload, Golden1F1B) {
  testing::expect_golden("rank_ir_1f1b_offload_p2_m4.txt", offload_ir(one_f_one_b(2, 4)).to_text(),
                         "rank IR text");
}

TEST(RankIROffload, GoldenZBH1) {
  testing::expect_golden("rank_ir_zbh1_offload_p2_m4.txt", offload_ir(zb_h1(2, 4)).to_text(),
                         "rank IR text");
}

TEST(RankIROffload, NamesAndDescriptions) {
  EXPECT_STREQ(rank_op_name(RankOp::Offload), "OFFLOAD");
  EXPECT_STREQ(rank_op_name(RankOp::Fetch), "FETCH");
  const RankIR ir = offload_ir(one_f_one_b(2, 4));
  const RankProgram& p = ir.programs[0];
  const int b = find_buffer(p, {BufKind::Stash, 0, 1});
  ASSERT_GE(b, 0);
  ASSERT_GE(p.buffers[b].offload, 0);
  EXPECT_EQ(ir.describe(0, p.buffers[b].offload),
            "rank 0 #" + std::to_string(p.buffers[b].offload) + " OFFLOAD stash(s0,m1)");
  EXPECT_EQ(ir.describe(0, p.buffers[b].fetch),
            "rank 0 #" + std::to_string(p.buffers[b].fetch) + " FETCH stash(s0,m1)");
}

// Every generator: clean, and exactly the Stash buffers with another RUN
// between writer and first reader are offloaded, where the rule says.
TEST(RankIROffload, PlacementOnEveryGenerator) {
  int checked = 0, offloaded = 0;
  for (const std::string& name : schedule_names()) {
    for (int p : {1, 2, 4}) {
      for (int m : {1, 4, 8}) {
        Schedule s;
        try {
          s = make_schedule(name, p, m, name == "interleaved" ? 2 : 1);
        } catch (const ScheduleError&) {
          continue;
        }
        for (const Schedule& sched : {s, fuse_forward_backward(s)}) {
          for (int32_t look : {1, 2, 3}) {
            SCOPED_TRACE(name + " p" + std::to_string(p) + " m" + std::to_string(m) +
                         " lookahead " + std::to_string(look));
            const RankIR ir = offload_ir(sched, look);
            ASSERT_TRUE(verify_rank_ir(ir).ok()) << report(ir);
            for (const RankProgram& prog : ir.programs) {
              const RunsOf o = runs_of(prog);
              for (int b = 0; b < static_cast<int>(prog.buffers.size()); ++b) {
                const RankBuffer& rb = prog.buffers[b];
                const bool want = rb.key.kind == BufKind::Stash && o.writer[b] >= 0 &&
                                  o.reader[b] >= 0 && o.reader[b] - o.writer[b] >= 2;
                ASSERT_EQ(rb.offload >= 0, want) << prog.rank << " " << b;
                if (!want) {
                  EXPECT_EQ(rb.fetch, -1);
                  EXPECT_EQ(rb.host_slot, -1);
                  continue;
                }
                ++offloaded;
                EXPECT_EQ(prog.instrs[rb.offload].op, RankOp::Offload);
                EXPECT_EQ(prog.instrs[rb.fetch].op, RankOp::Fetch);
                // OFFLOAD right after the writer (only OFFLOADs between).
                for (int i = o.runs[o.writer[b]] + 1; i < rb.offload; ++i)
                  EXPECT_EQ(prog.instrs[i].op, RankOp::Offload);
                // FETCH just before the RUN `look` RUNs ahead of the reader
                // (only OFFLOADs / FETCHes in between), not before the first
                // RUN after the writer.
                const int target = o.runs[std::max(o.writer[b] + 1, o.reader[b] - look)];
                ASSERT_LT(rb.fetch, target);
                for (int i = rb.fetch + 1; i < target; ++i)
                  EXPECT_TRUE(prog.instrs[i].op == RankOp::Fetch) << i;
                EXPECT_GE(rb.host_slot, 0);
                EXPECT_GE(rb.fetch_slot, 0);
              }
            }
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
  EXPECT_GT(offloaded, 100);
}

TEST(RankIROffload, NoOffloadChangesNothing) {
  const Plan plan = lower(zb_h1(4, 8));
  RankIROptions none;
  none.offload.assign(4, Offload::None);
  EXPECT_EQ(build_rank_ir(plan).to_text(), build_rank_ir(plan, none).to_text());
  // Offload of stage 1 only: stage 0's stashes stay on the device.
  RankIROptions one = none;
  one.offload[1] = Offload::Stash;
  const RankIR ir = build_rank_ir(plan, one);
  EXPECT_TRUE(verify_rank_ir(ir).ok()) << report(ir);
  for (const RankBuffer& b : ir.programs[0].buffers) EXPECT_EQ(b.offload, -1);
  EXPECT_TRUE(ir.programs[0].host_pools.empty());
  EXPECT_FALSE(ir.programs[1].host_pools.empty());
}

TEST(RankIROffload, OptionsErrorsNameTheField) {
  const Plan plan = lower(one_f_one_b(2, 4));
  RankIROptions o;
  o.offload.assign(3, Offload::Stash);
  try {
    build_rank_ir(plan, o);
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("offload has 3 entries; the plan has 2 stages"),
              std::string::npos)
        << e.what();
  }
  o.offload.assign(2, Offload::Stash);
  o.fetch_lookahead = 0;
  try {
    build_rank_ir(plan, o);
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fetch_lookahead must be >= 1"), std::string::npos)
        << e.what();
  }
}

// ---- mutations: each is caught, naming rank, instruction and buffer ----

TEST(RankIROffloadMutation, FetchMovedAfterItsRead) {
  RankIR ir = offload_ir(one_f_one_b(4, 8));
  RankProgram& p = ir.programs[0];
  ASSERT_TRUE(verify_rank_ir(ir).ok()) << report(ir);
  const int b = find_buffer(p, {BufKind::Stash, 0, 1});
  ASSERT_GE(p.buffers[b].fetch, 0);
  const int read = p.buffers[b].held_to;  // B0.1
  move_after(p, p.buffers[b].fetch, read);
  const RankBuffer& rb = p.buffers[b];
  ASSERT_EQ(rb.fetch, read);  // the read moved up by one
  const std::string rep = report(ir);
  EXPECT_NE(rep.find("data: rank 0 #" + std::to_string(read - 1) +
                     " RUN B0.1 reads stash(s0,m1) while it is offloaded (OFFLOAD at #" +
                     std::to_string(rb.offload) + ", FETCH at #" + std::to_string(rb.fetch) + ")"),
            std::string::npos)
      << rep;
}

TEST(RankIROffloadMutation, HostSlotReusedWhileLive) {
  RankIR ir = offload_ir(one_f_one_b(4, 8));
  RankProgram& p = ir.programs[0];
  // Two stashes in host memory at once: give the later one the earlier's slot.
  int first = -1, second = -1;
  for (int a = 0; a < static_cast<int>(p.buffers.size()) && second < 0; ++a)
    for (int b = 0; b < static_cast<int>(p.buffers.size()); ++b) {
      const RankBuffer &x = p.buffers[a], &y = p.buffers[b];
      if (x.offload >= 0 && y.offload > x.offload && y.offload < x.fetch) {
        first = a;
        second = b;
        break;
      }
    }
  ASSERT_GE(second, 0) << "no two stashes in host memory at once";
  ASSERT_NE(p.buffers[first].host_slot, p.buffers[second].host_slot);
  p.buffers[second].host_slot = p.buffers[first].host_slot;
  const RankBuffer &x = p.buffers[first], &y = p.buffers[second];
  const std::string rep = report(ir);
  EXPECT_NE(rep.find("slots: " + ir.describe(0, y.offload) + " puts " +
                     ir.plan.describe_buffer(y.id) + " into host slot h" +
                     std::to_string(x.host_pool) + "." + std::to_string(x.host_slot) +
                     ", which still holds " + ir.plan.describe_buffer(x.id) + " (offloaded at #" +
                     std::to_string(x.offload) + ", fetched at #" + std::to_string(x.fetch) + ")"),
            std::string::npos)
      << rep;
}

TEST(RankIROffloadMutation, OffloadOfABufferNotYetWritten) {
  RankIR ir = offload_ir(one_f_one_b(2, 4));
  RankProgram& p = ir.programs[0];
  const int b = find_buffer(p, {BufKind::Stash, 0, 3});
  ASSERT_GE(b, 0);
  insert_at(p, 0, RankInstr{RankOp::Offload, -1, -1, -1, b});
  const std::string rep = report(ir);
  EXPECT_NE(rep.find("data: rank 0 #0 OFFLOAD stash(s0,m3) offloads a buffer that is not "
                     "present: no earlier instruction writes it"),
            std::string::npos)
      << rep;
  // Its back-reference names the real OFFLOAD, not this one.
  EXPECT_NE(rep.find("structure: rank 0 #0: stash(s0,m3) is offloaded here but records its "
                     "OFFLOAD at #" +
                     std::to_string(p.buffers[b].offload)),
            std::string::npos)
      << rep;
}

TEST(RankIROffloadMutation, FetchOfABufferNotOffloadedAndOffloadNeverFetched) {
  RankIR ir = offload_ir(one_f_one_b(2, 4));
  RankProgram& p = ir.programs[0];
  const int b = find_buffer(p, {BufKind::Stash, 0, 2});
  ASSERT_GE(p.buffers[b].fetch, 0);
  // Drop the FETCH: the read sees an offloaded buffer that is never fetched.
  const int fetch = p.buffers[b].fetch;
  std::vector<int> to(p.instrs.size());
  std::iota(to.begin(), to.end(), 0);
  to[fetch] = static_cast<int>(p.instrs.size()) - 1;
  for (size_t k = fetch + 1; k < to.size(); ++k) to[k] = static_cast<int>(k) - 1;
  permute(p, to);
  p.instrs.pop_back();
  p.buffers[b].fetch = -1;
  const std::string rep = report(ir);
  EXPECT_NE(rep.find("reads stash(s0,m2) while it is offloaded (OFFLOAD at #" +
                     std::to_string(p.buffers[b].offload) + ", never fetched)"),
            std::string::npos)
      << rep;
  EXPECT_NE(rep.find("offloads stash(s0,m2), which is never fetched"), std::string::npos) << rep;
  // A FETCH of a buffer that is on the device.
  RankIR ir2 = offload_ir(one_f_one_b(2, 4));
  RankProgram& q = ir2.programs[1];
  const int act = find_buffer(q, {BufKind::Act, 0, 0});  // received, waited on at held_from
  ASSERT_GE(act, 0);
  insert_at(q, q.buffers[act].held_from + 1, RankInstr{RankOp::Fetch, -1, -1, -1, act});
  const std::string rep2 = report(ir2);
  EXPECT_NE(rep2.find("data: rank 1 #" + std::to_string(q.buffers[act].held_from + 1) +
                      " FETCH act(s0,m0) fetches act(s0,m0), which is not offloaded"),
            std::string::npos)
      << rep2;
}

// ---- slots: offload lowers the device-held stashes, not their total ----

struct Peaks {
  int device = 0, host = 0, total = 0;
};

// The most Stash buffers of rank `r` held at once on the device, in host
// memory and in both, per instruction: on the device over [held_from,
// offload) and [fetch, held_to], in host memory over [offload, fetch).
Peaks stash_peaks(const RankProgram& p) {
  Peaks pk;
  for (int i = 0; i < static_cast<int>(p.instrs.size()); ++i) {
    int dev = 0, host = 0;
    for (const RankBuffer& b : p.buffers) {
      if (b.key.kind != BufKind::Stash || b.pool < 0 || i < b.held_from || i > b.held_to) continue;
      if (b.offload >= 0 && i >= b.offload && i < b.fetch)
        ++host;
      else
        ++dev;
    }
    pk.device = std::max(pk.device, dev);
    pk.host = std::max(pk.host, host);
    pk.total = std::max(pk.total, dev + host);
  }
  return pk;
}

TEST(RankIROffload, LowersTheDevicePeakOfStashesNotTheTotal) {
  const Schedule s = one_f_one_b(4, 8);
  const RankIR plain = build_rank_ir(lower(s));
  const RankIR off = offload_ir(s);
  const Peaks a = stash_peaks(plain.programs[0]), b = stash_peaks(off.programs[0]);
  EXPECT_EQ(a.device, 4);
  EXPECT_EQ(a.host, 0);
  EXPECT_LT(b.device, a.device);
  EXPECT_GT(b.host, 0);
  EXPECT_EQ(b.total, a.total);
  // The slots follow: fewer device slots for the stash pool, host slots for it.
  auto stash_slots = [](const RankProgram& p, const std::vector<Pool>& pools) {
    for (const RankBuffer& x : p.buffers)
      if (x.key.kind == BufKind::Stash) {
        const int32_t k = &pools == &p.pools ? x.pool : x.host_pool;
        if (k >= 0) return pools[k].slots;
      }
    return 0;
  };
  const RankProgram &p0 = plain.programs[0], &q0 = off.programs[0];
  EXPECT_EQ(stash_slots(p0, p0.pools), 4);
  EXPECT_LT(stash_slots(q0, q0.pools), 4);
  EXPECT_GT(stash_slots(q0, q0.host_pools), 0);
  EXPECT_EQ(q0.host_pools.size(), 1u);
}

// ---- the simulator: copy engines, device and host peaks ----

CostModel offload_costs(double host_bw) {
  CostModel c = CostModel::uniform(1, 2, 1, 1);
  c.default_stage.stash_bytes = 100;
  c.host_link_bandwidth = host_bw;
  return c;
}

TEST(RankIROffloadSim, InstantCopiesCostNoTime) {
  const Schedule s = one_f_one_b(4, 8);
  const RankIR plain = build_rank_ir(lower(s)), off = offload_ir(s);
  const SimResult a = simulate(plain, offload_costs(0)), b = simulate(off, offload_costs(0));
  EXPECT_DOUBLE_EQ(a.step_time, b.step_time);
  EXPECT_LT(b.peak_total[0], a.peak_total[0]);
  EXPECT_EQ(a.peak_host_bytes, std::vector<int64_t>(4, 0));
  EXPECT_GT(b.peak_host_bytes[0], 0);
  // The last rank runs each B right after its F: nothing offloaded.
  EXPECT_EQ(b.peak_host_bytes[3], 0);
}

TEST(RankIROffloadSim, HostPeakCountsAnOffloadBeforeALaterInstantFetch) {
  // GPipe's last rank offloads microbatch 6's stash and then fetches 0's for
  // its first backward (FIFO order) at the same instant: for a moment the
  // host holds both, as the runtime, which copies in program order, does.
  const Schedule s = gpipe(2, 8);
  const SimResult b = simulate(offload_ir(s), offload_costs(0));
  EXPECT_EQ(b.peak_host_bytes[1], 7 * 100);
}

TEST(RankIROffloadSim, HiddenCopiesLowerTheDevicePeak) {
  const Schedule s = one_f_one_b(4, 8);
  const RankIR plain = build_rank_ir(lower(s)), off = offload_ir(s);
  // A copy of a stash takes 0.25: hidden under the RUN before its reader.
  const SimResult a = simulate(plain, offload_costs(400)), b = simulate(off, offload_costs(400));
  EXPECT_LT(b.peak_total[0], a.peak_total[0]);
  EXPECT_LT(b.peak_activation[0], a.peak_activation[0]);
  EXPECT_GT(b.peak_host_bytes[0], 0);
  EXPECT_DOUBLE_EQ(b.step_time, a.step_time);
  // A copy takes 10 (longer than any RUN): the fetches cannot be hidden.
  const SimResult slow = simulate(off, offload_costs(10));
  EXPECT_GT(slow.step_time, a.step_time);
  EXPECT_EQ(simulate(plain, offload_costs(10)).step_time, a.step_time);
}

TEST(RankIROffloadSim, HostBandwidthIsValidatedAndInTheJson) {
  CostModel c = offload_costs(123.5);
  EXPECT_EQ(CostModel::from_json(c.to_json()), c);
  c.host_link_bandwidth = -1;
  try {
    c.validate();
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("host_link_bandwidth"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace baton
