// Verifier over rank programs (checks listed in rank_program.h). It reads
// the instruction lists, not the derived fields: lifetimes and FIFO positions
// are recomputed from the order of the instructions and compared.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "baton/error.h"
#include "baton/rank_program.h"
#include "ir_verifier.h"

namespace baton {

namespace rankir_verify {

bool IRVerifier::structure() {
  const int R = plan_.schedule.num_ranks;
  if (static_cast<int>(ir_.programs.size()) != R) {
    add("structure", fmt::format("{} rank programs for a plan of {} ranks", ir_.programs.size(), R),
        {}, {});
    return false;
  }
  bool ok = true;
  scans_.assign(R, {});
  for (int r = 0; r < R; ++r) {
    const RankProgram& p = prog(r);
    if (p.rank != r) {
      add("structure", fmt::format("program {} says it is rank {}", r, p.rank), {r}, {});
      ok = false;
    }
    std::vector<int> unit_runs(p.units.size(), 0), group_posts(p.groups.size(), 0);
    for (int i = 0; i < static_cast<int>(p.instrs.size()); ++i) {
      const RankInstr& in = p.instrs[i];
      auto bad = [&](std::string why) {
        ok = false;
        add("structure", fmt::format("rank {} #{}: {}", r, i, why), {r}, {i});
      };
      switch (in.op) {
        case RankOp::Run:
          if (!in_range(p.units, in.unit))
            bad(fmt::format("RUN of unit {}, out of range", in.unit));
          else if (p.units[in.unit].instr != i || unit_runs[in.unit]++)
            bad(fmt::format("unit {} is run here but records its RUN at #{}", in.unit,
                            p.units[in.unit].instr));
          break;
        case RankOp::Post:
          if (!in_range(p.groups, in.group))
            bad(fmt::format("POST of group {}, out of range", in.group));
          else if (p.groups[in.group].post != i || group_posts[in.group]++)
            bad(fmt::format("group {} is posted here but records its POST at #{}", in.group,
                            p.groups[in.group].post));
          break;
        case RankOp::Wait:
          if (!in_range(p.transfers, in.transfer) ||
              p.transfers[in.transfer].dir != TransferDir::Recv)
            bad(fmt::format("WAIT of transfer {}, which is not a receive of the rank",
                            in.transfer));
          else if (p.transfers[in.transfer].wait != i)
            bad(fmt::format("receive {} is waited here but records its WAIT at #{}", in.transfer,
                            p.transfers[in.transfer].wait));
          break;
        case RankOp::Free:
        case RankOp::Accumulate:
          if (!in_range(p.buffers, in.buffer))
            bad(fmt::format("{} of buffer {}, out of range", rank_op_name(in.op), in.buffer));
          break;
        case RankOp::Offload:
        case RankOp::Fetch: {
          if (!in_range(p.buffers, in.buffer)) {
            bad(fmt::format("{} of buffer {}, out of range", rank_op_name(in.op), in.buffer));
            break;
          }
          // A back-reference that disagrees is reported, but the checks
          // below read the instructions, not these fields: they go on.
          const RankBuffer& rb = p.buffers[in.buffer];
          const int32_t said = in.op == RankOp::Offload ? rb.offload : rb.fetch;
          if (said != i)
            add("structure",
                fmt::format("rank {} #{}: {} is {} here but records its {} at #{}", r, i,
                            rb.id >= 0 && rb.id < plan_.num_buffer_ids()
                                ? buf(r, in.buffer)
                                : fmt::format("buffer {}", in.buffer),
                            in.op == RankOp::Offload ? "offloaded" : "fetched", rank_op_name(in.op),
                            said),
                {r}, {i}, rb.key);
          break;
        }
        default:
          bad(fmt::format("unknown opcode {}", static_cast<int>(in.op)));
      }
    }
    for (const Unit& u : p.units)
      for (const auto* list : {&u.reads, &u.writes})
        for (int32_t b : *list)
          if (!in_range(p.buffers, b)) {
            ok = false;
            add("structure",
                fmt::format("rank {} #{}: unit names buffer {}, out of range", r, u.instr, b), {r},
                {u.instr});
          }
    for (const Transfer& t : p.transfers)
      if (!in_range(p.buffers, t.buffer) || t.peer < 0 || t.peer >= R || t.peer == r) {
        ok = false;
        add("structure",
            fmt::format("rank {}: a transfer names buffer {} and peer {}", r, t.buffer, t.peer),
            {r}, {});
      }
    for (const RankBuffer& b : p.buffers)
      if (b.id < 0 || b.id >= plan_.num_buffer_ids()) {
        ok = false;
        add("structure", fmt::format("rank {}: buffer id {} out of range", r, b.id), {r}, {});
      }
    for (int32_t b = 0; b < static_cast<int32_t>(p.buffers.size()); ++b) {
      const RankBuffer& rb = p.buffers[b];
      if (rb.id < 0 || rb.id >= plan_.num_buffer_ids()) continue;
      for (const auto& [at, op] :
           {std::pair{rb.offload, RankOp::Offload}, {rb.fetch, RankOp::Fetch}})
        if (at >= 0 &&
            (!in_range(p.instrs, at) || p.instrs[at].op != op || p.instrs[at].buffer != b))
          add("structure",
              fmt::format("rank {}: {} records its {} at #{}, but {}", r, buf(r, b),
                          rank_op_name(op), at,
                          in_range(p.instrs, at) ? d(r, at) + " is not one"
                                                 : std::string("there is no such instruction")),
              {r}, {at}, rb.key);
    }
    for (size_t g = 0; g < p.groups.size(); ++g)
      for (int32_t t : p.groups[g].transfers)
        if (!in_range(p.transfers, t)) {
          ok = false;
          add("structure",
              fmt::format("rank {}: group {} names transfer {}, out of range", r, g, t), {r},
              {p.groups[g].post});
        }
  }
  return ok;
}

void IRVerifier::scan(int r) {
  const RankProgram& p = prog(r);
  RankScan& sc = scans_[r];
  const int n = static_cast<int>(p.instrs.size());
  sc.posted.assign(p.transfers.size(), -1);
  sc.seq.assign(p.transfers.size(), -1);
  sc.freed.assign(p.buffers.size(), -1);
  std::vector<int32_t> created(p.buffers.size(), -1), present(p.buffers.size(), 0);
  std::vector<int32_t> waited(p.transfers.size(), -1), send_of(p.buffers.size(), -1);
  std::vector<int32_t> recv_of(p.buffers.size(), -1);
  // Offload: per buffer the OFFLOAD it is offloaded by (-1: on the device),
  // and where its FETCHes are.
  std::vector<int32_t> offloaded(p.buffers.size(), -1);
  std::vector<std::vector<int32_t>> fetches(p.buffers.size());
  for (int i = 0; i < n; ++i)
    if (p.instrs[i].op == RankOp::Fetch) fetches[p.instrs[i].buffer].push_back(i);
  // "(OFFLOAD at #3, FETCH at #9)": the buffer's OFFLOAD and its next FETCH.
  auto offload_span = [&](int32_t b, int i) {
    const auto& f = fetches[b];
    const auto it = std::upper_bound(f.begin(), f.end(), i);
    return fmt::format(
        "(OFFLOAD at #{}, {})", offloaded[b],
        it == f.end() ? std::string("never fetched") : fmt::format("FETCH at #{}", *it));
  };
  for (int32_t t = 0; t < static_cast<int32_t>(p.transfers.size()); ++t)
    (p.transfers[t].dir == TransferDir::Send ? send_of : recv_of)[p.transfers[t].buffer] = t;
  std::map<std::tuple<int, int, int>, int32_t> count;  // (dir, peer, channel) -> next seq
  std::map<std::pair<int, int>, int32_t> next_wait;    // (peer, channel) -> next seq to wait
  auto create = [&](int i, int32_t b) {
    const RankBuffer& rb = p.buffers[b];
    if (created[b] >= 0) {
      add("data", fmt::format("{} creates {} again (first at #{})", d(r, i), buf(r, b), created[b]),
          {r, r}, {created[b], i}, rb.key);
      return;
    }
    created[b] = i;
  };
  for (int i = 0; i < n; ++i) {
    const RankInstr& in = p.instrs[i];
    switch (in.op) {
      case RankOp::Post:
        for (int32_t t : p.groups[in.group].transfers) {
          const Transfer& x = p.transfers[t];
          if (sc.posted[t] >= 0) {
            add("post/wait",
                fmt::format("rank {} #{} POST g{} posts {} again (first at #{})", r, i, in.group,
                            tname(r, t), sc.posted[t]),
                {r, r}, {sc.posted[t], i}, key(r, x.buffer));
            continue;
          }
          sc.posted[t] = i;
          sc.seq[t] = count[{static_cast<int>(x.dir), x.peer, x.channel}]++;
          if (x.seq != sc.seq[t])
            add("channels",
                fmt::format("{} records FIFO position {} on channel {}, but it is "
                            "number {} posted there",
                            at(r, t), x.seq, x.channel, sc.seq[t]),
                {r}, {i}, key(r, x.buffer));
          const int want = plan_.channel(p.buffers[x.buffer].id);
          if (x.channel != want)
            add("channels",
                fmt::format("{} travels on channel {}, but the plan's channel of "
                            "the buffer is {}",
                            at(r, t), x.channel, want),
                {r}, {i}, key(r, x.buffer));
          if (x.dir == TransferDir::Recv) {
            create(i, x.buffer);
          } else if (!present[x.buffer] || sc.freed[x.buffer] >= 0) {
            add("data",
                fmt::format("{} sends a buffer that is {}", at(r, t),
                            sc.freed[x.buffer] >= 0 ? "already freed" : "not present"),
                {r}, {i}, key(r, x.buffer));
          } else if (offloaded[x.buffer] >= 0) {
            add("data",
                fmt::format("{} sends {} while it is offloaded {}", at(r, t), buf(r, x.buffer),
                            offload_span(x.buffer, i)),
                {r, r}, {offloaded[x.buffer], i}, key(r, x.buffer));
          }
        }
        break;
      case RankOp::Wait: {
        const Transfer& x = p.transfers[in.transfer];
        if (waited[in.transfer] >= 0)
          add("post/wait",
              fmt::format("{} waits a second time (first at #{})", d(r, i), waited[in.transfer]),
              {r, r}, {waited[in.transfer], i}, key(r, x.buffer));
        waited[in.transfer] = i;
        if (sc.posted[in.transfer] < 0) {
          const int32_t g = x.group;
          const bool in_group =
              in_range(p.groups, g) &&
              std::find(p.groups[g].transfers.begin(), p.groups[g].transfers.end(), in.transfer) !=
                  p.groups[g].transfers.end();
          add("post/wait",
              in_group && p.groups[g].post > i
                  ? fmt::format("{} waits before its receive is posted (at #{})", d(r, i),
                                p.groups[g].post)
                  : fmt::format("{} waits for a receive that no POST posts", d(r, i)),
              {r}, {i}, key(r, x.buffer));
          break;
        }
        int32_t& nw = next_wait[{x.peer, x.channel}];
        if (sc.seq[in.transfer] != nw)
          add("post/wait",
              fmt::format("{} waits for receive {} on channel {} from rank {}, "
                          "but receive {} is not yet waited on (receives are taken in "
                          "post order)",
                          d(r, i), sc.seq[in.transfer] + 1, x.channel, x.peer, nw + 1),
              {r}, {i}, key(r, x.buffer));
        nw = sc.seq[in.transfer] + 1;
        present[x.buffer] = 1;
        break;
      }
      case RankOp::Run: {
        const Unit& u = p.units[in.unit];
        for (int32_t b : u.reads) {
          if (present[b] && sc.freed[b] < 0) {
            if (offloaded[b] >= 0)
              add("data",
                  fmt::format("{} reads {} while it is offloaded {}", d(r, i), buf(r, b),
                              offload_span(b, i)),
                  {r, r}, {offloaded[b], i}, key(r, b));
            continue;
          }
          std::string why;
          if (sc.freed[b] >= 0)
            why = fmt::format("it was freed at #{}", sc.freed[b]);
          else if (recv_of[b] >= 0) {
            const int32_t t = recv_of[b];
            why = waited[t] < 0 && p.transfers[t].wait > i
                      ? fmt::format("its receive is waited on only later, at #{}",
                                    p.transfers[t].wait)
                      : "its receive is not waited on before";
          } else {
            why = "no earlier instruction writes it";
          }
          add("data", fmt::format("{} reads {}, which is not present: {}", d(r, i), buf(r, b), why),
              {r}, {i}, key(r, b));
        }
        for (int32_t b : u.writes) {
          create(i, b);
          present[b] = 1;
        }
        break;
      }
      case RankOp::Free: {
        const int32_t b = in.buffer;
        if (created[b] < 0 || sc.freed[b] >= 0) {
          add("data",
              fmt::format("{} frees a buffer that {}", d(r, i),
                          created[b] < 0 ? "does not exist yet"
                                         : fmt::format("was freed at #{}", sc.freed[b])),
              {r}, {i}, key(r, b));
          break;
        }
        if (send_of[b] >= 0 && sc.posted[send_of[b]] < 0)
          add("post/wait",
              fmt::format("{} waits for the completion of {}, which is not posted", d(r, i),
                          tname(r, send_of[b])),
              {r}, {i}, key(r, b));
        sc.freed[b] = i;
        break;
      }
      case RankOp::Accumulate:
        if (!present[in.buffer] || sc.freed[in.buffer] >= 0 || offloaded[in.buffer] >= 0 ||
            p.buffers[in.buffer].key.kind != BufKind::WGrad)
          add("data", fmt::format("{}: not a present weight gradient", d(r, i)), {r}, {i},
              key(r, in.buffer));
        break;
      case RankOp::Offload: {
        const int32_t b = in.buffer;
        if (!present[b] || sc.freed[b] >= 0) {
          add("data",
              fmt::format("{} offloads a buffer that is not present: {}", d(r, i),
                          sc.freed[b] >= 0  ? fmt::format("it was freed at #{}", sc.freed[b])
                          : created[b] >= 0 ? std::string("its receive is not waited on before")
                                            : std::string("no earlier instruction writes it")),
              {r}, {i}, key(r, b));
        } else if (offloaded[b] >= 0) {
          add("data",
              fmt::format("{} offloads {} again: it is offloaded since #{}", d(r, i), buf(r, b),
                          offloaded[b]),
              {r, r}, {offloaded[b], i}, key(r, b));
        } else {
          offloaded[b] = i;
        }
        break;
      }
      case RankOp::Fetch: {
        const int32_t b = in.buffer;
        if (offloaded[b] < 0) {
          add("data", fmt::format("{} fetches {}, which is not offloaded", d(r, i), buf(r, b)), {r},
              {i}, key(r, b));
          break;
        }
        offloaded[b] = -1;
        break;
      }
    }
  }
  for (int32_t b = 0; b < static_cast<int32_t>(p.buffers.size()); ++b)
    if (offloaded[b] >= 0)
      add("data",
          fmt::format("{} offloads {}, which is never fetched", d(r, offloaded[b]), buf(r, b)), {r},
          {offloaded[b]}, key(r, b));
  for (int32_t t = 0; t < static_cast<int32_t>(p.transfers.size()); ++t) {
    const Transfer& x = p.transfers[t];
    if (sc.posted[t] < 0 && (x.dir == TransferDir::Send || x.wait < 0))
      add("post/wait",
          fmt::format("rank {}: {} is never posted (no POST holds it{})", r, tname(r, t),
                      x.wait >= 0 ? fmt::format("; see #{}", x.wait) : ""),
          {r}, {x.wait}, key(r, x.buffer));
    if (x.dir == TransferDir::Recv && sc.posted[t] >= 0 && waited[t] < 0)
      add("post/wait", fmt::format("{} is never waited on", at(r, t)), {r}, {sc.posted[t]},
          key(r, x.buffer));
  }
  for (int32_t b = 0; b < static_cast<int32_t>(p.buffers.size()); ++b)
    if (created[b] >= 0 && sc.freed[b] < 0)
      add("data",
          fmt::format("rank {}: {} (created at #{}) is never freed", r, buf(r, b), created[b]), {r},
          {created[b]}, key(r, b));
}

void IRVerifier::channels() {
  // FIFO pairing: (src, dst, channel, k) of the posted transfers.
  using Key = std::tuple<int, int, int, int>;
  std::map<Key, std::pair<int, int32_t>> sends, recvs;
  std::map<int32_t, std::pair<int, int32_t>> send_by_buffer;
  const int R = static_cast<int>(ir_.programs.size());
  for (int r = 0; r < R; ++r) {
    const RankProgram& p = prog(r);
    for (int32_t t = 0; t < static_cast<int32_t>(p.transfers.size()); ++t) {
      if (scans_[r].posted[t] < 0) continue;
      const Transfer& x = p.transfers[t];
      if (x.dir == TransferDir::Send) {
        sends[{r, x.peer, x.channel, scans_[r].seq[t]}] = {r, t};
        send_by_buffer[p.buffers[x.buffer].id] = {r, t};
      } else {
        recvs[{x.peer, r, x.channel, scans_[r].seq[t]}] = {r, t};
      }
    }
  }
  for (const auto& [k, rt] : recvs) {
    const auto [r, t] = rt;
    const Transfer& x = prog(r).transfers[t];
    const int32_t id = prog(r).buffers[x.buffer].id;
    const auto sb = send_by_buffer.find(id);
    if (sb == send_by_buffer.end() || sb->second.first != x.peer) {
      add("channels",
          fmt::format("{}: rank {} never sends {}", at(r, t), x.peer, plan_.describe_buffer(id)),
          {r}, {anchor(r, t)}, key(r, x.buffer));
      continue;
    }
    const auto [sr, st] = sb->second;
    const Transfer& s = prog(sr).transfers[st];
    if (s.channel != x.channel)
      add("channels",
          fmt::format("{} arrives on channel {}, but {} sends it on channel {}", at(r, t),
                      x.channel, at(sr, st), s.channel),
          {r, sr}, {anchor(r, t), anchor(sr, st)}, key(r, x.buffer));
  }
  for (const auto& [k, rt] : sends) {
    const auto [r, t] = rt;
    const auto it = recvs.find(k);
    const int pos = std::get<3>(k);
    if (it == recvs.end()) {
      add("channels",
          fmt::format("{} is message {} on channel {} from rank {} to rank {}, "
                      "which rank {} never receives",
                      at(r, t), pos + 1, std::get<2>(k), r, std::get<1>(k), std::get<1>(k)),
          {r}, {anchor(r, t)}, key(r, prog(r).transfers[t].buffer));
      continue;
    }
    const auto [rr, rt2] = it->second;
    const int32_t sid = prog(r).buffers[prog(r).transfers[t].buffer].id;
    const int32_t rid = prog(rr).buffers[prog(rr).transfers[rt2].buffer].id;
    if (sid != rid)
      add("channels",
          fmt::format("head-of-line mismatch on channel {} from rank {} to rank {}: "
                      "message {} is {} ({}), but {} expects {}",
                      std::get<2>(k), r, rr, pos + 1, plan_.describe_buffer(sid), at(r, t),
                      at(rr, rt2), plan_.describe_buffer(rid)),
          {r, rr}, {anchor(r, t), anchor(rr, rt2)}, key(rr, prog(rr).transfers[rt2].buffer));
  }
  for (const auto& [k, rt] : recvs)
    if (!sends.count(k)) {
      const auto [r, t] = rt;
      add("channels",
          fmt::format("{} has no matching SEND on rank {} (message {} on channel {})", at(r, t),
                      std::get<0>(k), std::get<3>(k) + 1, std::get<2>(k)),
          {r}, {anchor(r, t)}, key(r, prog(r).transfers[t].buffer));
    }
}

void IRVerifier::deadlock() {
  // Abstract execution: a WAIT blocks until the paired SEND is posted;
  // nothing else blocks (sends are buffered: a FREE of a sent buffer defers
  // the release of its slot, not the rank).
  // Pairing is the FIFO one (checked consistent by channels()).
  const int R = static_cast<int>(ir_.programs.size());
  using Key = std::tuple<int, int, int, int>;
  // Per rank and transfer: the partner's rank and the instruction of its POST.
  std::map<Key, std::pair<int, int32_t>> posts;  // (rank, peer, channel, dir + 2 * seq)
  for (int r = 0; r < R; ++r) {
    const RankProgram& p = prog(r);
    for (int32_t t = 0; t < static_cast<int32_t>(p.transfers.size()); ++t) {
      const Transfer& x = p.transfers[t];
      posts[{r, x.peer, x.channel, static_cast<int>(x.dir) + 2 * scans_[r].seq[t]}] = {
          r, scans_[r].posted[t]};
    }
  }
  std::vector<std::vector<std::pair<int, int32_t>>> partner(R);
  for (int r = 0; r < R; ++r) {
    const RankProgram& p = prog(r);
    for (int32_t t = 0; t < static_cast<int32_t>(p.transfers.size()); ++t) {
      const Transfer& x = p.transfers[t];
      const int other = 1 - static_cast<int>(x.dir);
      const auto it = posts.find({x.peer, r, x.channel, other + 2 * scans_[r].seq[t]});
      partner[r].push_back(it == posts.end() ? std::pair<int, int32_t>{x.peer, -1} : it->second);
    }
  }
  auto partner_post = [&](int r, int32_t t) { return partner[r][t]; };
  std::vector<int32_t> pc(R, 0);
  // What blocks rank r at pc (peer, its POST instr), or {-1, -1}.
  auto blocker = [&](int r) -> std::pair<int, int32_t> {
    const RankInstr& in = prog(r).instrs[pc[r]];
    int32_t t = -1;
    if (in.op == RankOp::Wait) t = in.transfer;
    if (t < 0) return {-1, -1};
    return partner_post(r, t);
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < R; ++r) {
      const int n = static_cast<int>(prog(r).instrs.size());
      while (pc[r] < n) {
        const auto [peer, at] = blocker(r);
        if (peer >= 0 && (at < 0 || pc[peer] <= at)) break;
        ++pc[r];
        progress = true;
      }
    }
  }
  std::string msg;
  std::vector<int> ranks, instrs;
  for (int r = 0; r < R; ++r) {
    if (pc[r] >= static_cast<int>(prog(r).instrs.size())) continue;
    const auto [peer, at] = blocker(r);
    msg += msg.empty() ? "" : "; ";
    msg += fmt::format("{} waits for rank {} {}", d(r, pc[r]), peer,
                       at < 0 ? std::string("(no matching transfer)")
                              : fmt::format("to reach #{} (it is blocked at #{})", at, pc[peer]));
    ranks.push_back(r);
    instrs.push_back(pc[r]);
  }
  if (!ranks.empty()) add("deadlock", msg, ranks, instrs);
}

}  // namespace rankir_verify

VerifyReport verify_rank_ir(const RankIR& ir) {
  VerifyReport rep;
  rankir_verify::IRVerifier v(ir, rep);
  if (v.structure()) {
    for (int r = 0; r < static_cast<int>(ir.programs.size()); ++r) {
      v.scan(r);
      v.slots(r);
    }
    v.channels();
    if (v.clean()) v.deadlock();
  }
  v.finish();
  return rep;
}

void verify_rank_ir_or_throw(const RankIR& ir) {
  VerifyReport rep = verify_rank_ir(ir);
  if (!rep.ok()) throw VerifyError("rank programs: " + rep.to_string());
}

}  // namespace baton
