// Verifier, deadlock check: the abstract execution of every rank under the
// blocking or the fifo pairing, and the report of where it stops (a wait-for
// cycle, or an op whose partner never comes).
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "verify_internal.h"

namespace baton::verify_detail {

void Verifier::execute(ExecState& st, const std::vector<int32_t>& partner,
                       const uint8_t* mismatch) const {
  // Only communication groups and RUNs lacking an input can block; FREE,
  // ACCUMULATE and other RUNs always complete, so a rank moves from group to
  // group. A rank that stops has st.pc at the blocking instruction.
  const int R = s_.num_ranks;
  st.pc.assign(R, 0);
  st.gcur.assign(R, 0);
  st.in_group.assign(R, 0);
  st.posted.assign(n_ops_, 0);
  st.done.assign(n_ops_, 0);
  st.pending.resize(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) st.pending[g] = groups_[g].n_ops;
  std::vector<int32_t> work;
  work.reserve(R);
  for (int r = R - 1; r >= 0; --r) work.push_back(r);
  while (!work.empty()) {
    const int r = work.back();
    work.pop_back();
    const int32_t bad = first_bad_run_[r];
    const int32_t g_end = rank_group_begin_[r + 1];
    for (;;) {
      const int32_t g = rank_group_begin_[r] + st.gcur[r];
      if (g == g_end) {
        st.pc[r] = std::min(bad, static_cast<int32_t>(plan_.programs[r].size()));
        break;
      }
      const Group& grp = groups_[g];
      if (bad < grp.begin) {
        st.pc[r] = bad;
        break;
      }
      if (!st.in_group[r]) {
        st.in_group[r] = 1;
        for (int32_t o = grp.first_op; o < grp.first_op + grp.n_ops; ++o) {
          st.posted[o] = 1;
          // A skip SEND is buffered: its group does not wait for the RECV.
          if (eager_[o]) --st.pending[g];
          const int32_t q = partner[o];
          if (q < 0 || !st.posted[q] || (mismatch && mismatch[o])) continue;
          st.done[o] = st.done[q] = 1;
          if (!eager_[o]) --st.pending[g];
          const int32_t gq = op_group_[q];
          if (!eager_[q] && --st.pending[gq] == 0) work.push_back(groups_[gq].rank);
        }
      }
      if (st.pending[g] > 0) {
        st.pc[r] = grp.begin;
        break;
      }
      st.in_group[r] = 0;
      ++st.gcur[r];
    }
  }
}

void Verifier::report_deadlock(const ExecState& st, const std::vector<int32_t>& partner,
                               const uint8_t* mismatch, const char* label) {
  const int R = s_.num_ranks;
  auto finished = [&](int r) { return st.pc[r] >= static_cast<int32_t>(plan_.programs[r].size()); };
  // Wait-for edges: rank -> (op it waits on, partner op not yet posted).
  struct Edge {
    int32_t op, target;
  };
  std::vector<std::vector<Edge>> edges(R);
  struct Terminal {
    int rank;
    int32_t op;  // -1: a RUN that lacks an input
  };
  std::vector<Terminal> terminals;
  for (int r = 0; r < R; ++r) {
    if (finished(r)) continue;
    const Instr& in = plan_.programs[r][st.pc[r]];
    if (in.op == OpCode::Run) {
      terminals.push_back({r, -1});
      continue;
    }
    const Group& g = groups_[rank_group_begin_[r] + st.gcur[r]];
    for (int32_t o = g.first_op; o < g.first_op + g.n_ops; ++o) {
      if (st.done[o] || eager_[o]) continue;
      const int32_t q = partner[o];
      if (q < 0 || (mismatch && mismatch[o])) {
        terminals.push_back({r, o});
        continue;
      }
      if (!st.posted[q]) edges[r].push_back({o, q});
    }
  }
  // Find one cycle among the ranks (iterative DFS, colors 0 new 1 open 2 done).
  std::vector<uint8_t> color(R, 0);
  std::vector<Edge> cycle;
  for (int root = 0; root < R && cycle.empty(); ++root) {
    if (color[root] || edges[root].empty()) continue;
    std::vector<std::pair<int, size_t>> stack{{root, 0}};
    std::vector<Edge> path;  // edge taken out of each open node but the top
    color[root] = 1;
    while (!stack.empty() && cycle.empty()) {
      auto& [u, ei] = stack.back();
      if (ei == edges[u].size()) {
        color[u] = 2;
        stack.pop_back();
        if (!path.empty()) path.pop_back();
        continue;
      }
      const Edge e = edges[u][ei++];
      const int v = op(e.target).rank;
      if (color[v] == 1) {
        // Cycle: from v along the path to u, then e back to v.
        path.push_back(e);
        size_t start = 0;
        while (op(path[start].op).rank != v) ++start;
        cycle.assign(path.begin() + static_cast<std::ptrdiff_t>(start), path.end());
      } else if (color[v] == 0) {
        color[v] = 1;
        path.push_back(e);
        stack.push_back({v, 0});
      }
    }
  }
  if (!cycle.empty() && !full()) {
    const CommOp o0 = op(cycle[0].op);
    const CommOp t0 = op(cycle[0].target);
    std::string msg = fmt::format("deadlock ({}): {} waits for {}", label, d(o0.rank, o0.instr),
                                  d(t0.rank, t0.instr));
    std::vector<int> ranks{o0.rank}, instrs{o0.instr};
    for (size_t i = 1; i < cycle.size(); ++i) {
      const CommOp o = op(cycle[i].op);
      const CommOp t = op(cycle[i].target);
      msg += fmt::format(", but rank {} is blocked at #{} {}, which waits for {}", o.rank, o.instr,
                         op_text(o.rank, o.instr), d(t.rank, t.instr));
      ranks.push_back(o.rank);
      instrs.push_back(o.instr);
    }
    msg += fmt::format(", but rank {} is blocked at #{}: a cycle", o0.rank, o0.instr);
    const BufferKey k = key(o0.buffer);
    add("deadlock", std::move(msg), std::move(ranks), std::move(instrs), k.stage, k.microbatch);
  }
  std::vector<uint8_t> reported_pair;  // mismatched pairs are reported once
  for (const Terminal& t : terminals) {
    if (full()) break;
    if (t.op >= 0 && partner[t.op] >= 0) {
      if (reported_pair.empty()) reported_pair.assign(n_ops_, 0);
      const int32_t lo = std::min(t.op, partner[t.op]);
      if (reported_pair[lo]) continue;
      reported_pair[lo] = 1;
    }
    if (t.op < 0) {
      const int i = st.pc[t.rank];
      const Action& a = action_at(t.rank, i);
      const auto it = missing_input_.find({t.rank, i});
      const std::string what = it != missing_input_.end() ? buf(it->second) : "an input";
      add("deadlock",
          fmt::format("deadlock ({}): {} can never run: {} is not present on rank {} when it is "
                      "reached (see data)",
                      label, d(t.rank, i), what, t.rank),
          {t.rank}, {i}, a.first.stage, a.first.microbatch);
      continue;
    }
    const CommOp o = op(t.op);
    const BufferKey k = key(o.buffer);
    const int32_t q = partner[t.op];
    if (q >= 0) {
      const CommOp p = op(q);
      const CommOp& s = o.send ? o : p;
      add("deadlock",
          fmt::format("deadlock ({}): {} is paired with {} as the {} {} message {}->{}, which is "
                      "a different buffer (head-of-line mismatch)",
                      label, d(o.rank, o.instr), d(p.rank, p.instr), ordinal(s.chan_k + 1),
                      kind_name(s.buffer), s.rank, s.peer),
          {o.rank, p.rank}, {o.instr, p.instr}, k.stage, k.microbatch);
      continue;
    }
    const char* other = o.send ? "receive" : "send";
    std::string why;
    if (finished(o.peer)) {
      why = fmt::format("rank {} finished", o.peer);
    } else {
      why = fmt::format("rank {} has no matching {} (it is blocked at {})", o.peer,
                        o.send ? "RECV" : "SEND", d(o.peer, st.pc[o.peer]));
    }
    add("deadlock",
        fmt::format("deadlock ({}): {} never gets its {}: {}", label, d(o.rank, o.instr), other,
                    why),
        {o.rank}, {o.instr}, k.stage, k.microbatch);
  }
  if (cycle.empty() && terminals.empty() && !full()) {
    // Not expected: every stuck rank either waits on a stuck rank (so a cycle
    // or a terminal exists) or is itself terminal. Report the stuck ranks.
    std::string msg = fmt::format("deadlock ({}): stuck at", label);
    std::vector<int> ranks, instrs;
    for (int r = 0; r < R; ++r) {
      if (finished(r)) continue;
      msg += " " + d(r, st.pc[r]) + ";";
      ranks.push_back(r);
      instrs.push_back(st.pc[r]);
    }
    add("deadlock", std::move(msg), std::move(ranks), std::move(instrs), -1, -1);
  }
}

void Verifier::check_model(bool fifo, const char* label) {
  const auto& partner = fifo && !fifo_same_ ? partner_fifo_ : partner_buf_;
  const uint8_t* mm = fifo && !mismatch_fifo_.empty() ? mismatch_fifo_.data() : nullptr;
  ExecState st;
  execute(st, partner, mm);
  for (int r = 0; r < s_.num_ranks; ++r) {
    if (st.pc[r] < static_cast<int32_t>(plan_.programs[r].size())) {
      report_deadlock(st, partner, mm, label);
      return;
    }
  }
}

}  // namespace baton::verify_detail
