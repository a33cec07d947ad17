// Partition step 5: the tasks of each stage (F, and B or I and W), the values
// they exchange with other stages and keep for their backward, and the ops
// each runs (dead code eliminated).
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "baton/graph.h"
#include "partition_internal.h"

namespace baton::partition_detail {

namespace {

struct TaskWork {
  TaskBody body;
  std::vector<int> candidates;  // ops that may run in this task (program order)
  std::set<int> needed;         // values this task must output
};

// Step 5a: values that cross stages without a marker. A value of stage i
// read by stage i + 1 travels with the activations (appended to act_out of
// F(i) and act_in of F(i+1)); one read by a later stage j > i + 1 (a skip
// connection: an encoder output read by every decoder stage, a U-Net skip)
// goes on the skip edge (i, j): its own buffer sent straight from rank(i) to
// rank(j) (skip_out of F(i), skip_in of F(j)); stage j's backward then finds
// it in its stash like any activation. Cotangent contributions travel back
// the same way: to the neighbour with the input gradients (grad_out of
// B(i+1), grad_in of B(i)), from farther away on the edge (skip_grad_out of
// B(j), skip_grad_in of B(i)), to where JAX sums them. Forward markers consume
// values of their own stage k and backward markers values of stage k+1, so a
// marker that reads a value from farther away is a reader of that stage.
// Returns the edges, sorted (the plan's Plan::skips).
std::vector<SkipEdge> add_skips(const Ctx& c, std::vector<std::array<TaskWork, 3>>& work) {
  const Program& p = c.p;
  const int S = c.S;
  std::vector<std::set<int>> fwd(S), bwd(S);  // [k]: values crossing boundary k
  std::map<std::pair<int, int>, std::pair<std::set<int>, std::set<int>>> edges;  // fwd, bwd
  auto route = [&](int v, int user_pos, int user_stage) {
    int q = c.pos[v];
    if (q == kUnplaced) return;
    int i = c.stage_of(q);
    if (c.is_fwd(q)) {
      if (user_stage == i + 1) fwd[i].insert(v);
      if (user_stage > i + 1) edges[{i, user_stage}].first.insert(v);
    } else if (!c.is_fwd(user_pos)) {
      if (i == user_stage + 1) bwd[user_stage].insert(v);
      if (i > user_stage + 1) edges[{user_stage, i}].second.insert(v);
    }
  };
  for (int u = 0; u < static_cast<int>(p.ops.size()); ++u) {
    const Op& op = p.ops[u];
    if (op.region != Region::Loop || !c.staged_op[u]) continue;
    if (op.kind == OpKind::Boundary) {
      int k = op.boundary;
      int user_pos = op.backward ? c.b_pos(k + 1) : c.f_pos(k);
      for (int32_t v : op.inputs) route(v, user_pos, c.stage_of(user_pos));
      continue;
    }
    if (op.outputs.empty()) continue;
    int position = c.pos[op.outputs[0]];
    for (int32_t v : op.inputs) route(v, position, c.stage_of(position));
  }
  for (int k = 0; k + 1 < S; ++k) {
    for (int v : fwd[k]) {
      work[k][0].body.act_out.push_back(v);
      work[k + 1][0].body.act_in.push_back(v);
    }
    for (int v : bwd[k]) {
      work[k + 1][1].body.grad_out.push_back(v);
      work[k][1].body.grad_in.push_back(v);
    }
  }
  if (static_cast<int>(edges.size()) > kMaxSkipEdges) {
    std::string list;
    for (const auto& [e, vals] : edges) list += fmt::format(" {}->{}", e.first, e.second);
    throw TraceError(
        fmt::format("values cross between {} pairs of non-neighbouring stages ({}); at most {} are "
                    "supported: move the stage boundaries so fewer stages skip over others",
                    edges.size(), list, kMaxSkipEdges));
  }
  std::vector<SkipEdge> out;
  for (const auto& [e, vals] : edges) {
    const int32_t idx = static_cast<int32_t>(out.size());
    out.push_back({e.first, e.second, !vals.first.empty(), !vals.second.empty()});
    const std::vector<int32_t> f(vals.first.begin(), vals.first.end());
    const std::vector<int32_t> g(vals.second.begin(), vals.second.end());
    if (!f.empty()) {
      work[e.first][0].body.skip_out.push_back({idx, f});
      work[e.second][0].body.skip_in.push_back({idx, f});
    }
    if (!g.empty()) {
      work[e.second][1].body.skip_grad_out.push_back({idx, g});
      work[e.first][1].body.skip_grad_in.push_back({idx, g});
    }
  }
  return out;
}

void append_skips(std::vector<int>& out, const std::vector<SkipValues>& skips) {
  for (const SkipValues& e : skips) out.insert(out.end(), e.values.begin(), e.values.end());
}

// Work items indexed [stage][0=F,1=B|I,2=W].
using Work = std::vector<std::array<TaskWork, 3>>;

// Position -> task slot. Slots: F_s, and B_s (or I_s and W_s).
int slot_of(const Ctx& c, int position) { return c.is_fwd(position) ? 0 : 1; }

// The task slots of every stage, each with the loop ops that may run in it.
Work seed_work(const Ctx& c) {
  const Program& p = c.p;
  const int S = c.S;
  const int nops = static_cast<int>(p.ops.size());
  Work work(S);
  for (int s = 0; s < S; ++s) {
    work[s][0].body.kind = TaskKind::F;
    work[s][1].body.kind = c.split ? TaskKind::I : TaskKind::B;
    work[s][2].body.kind = TaskKind::W;
    for (auto& w : work[s]) w.body.stage = s;
  }
  for (int i = 0; i < nops; ++i) {
    const Op& op = p.ops[i];
    if (op.region != Region::Loop || op.kind == OpKind::Boundary) continue;
    if (c.staged_op[i]) {
      int position = c.pos[op.outputs.empty() ? -1 : op.outputs[0]];
      if (op.outputs.empty()) continue;
      work[c.stage_of(position)][slot_of(c, position)].candidates.push_back(i);
    } else {
      for (auto [s, position] : c.upos[i]) work[s][slot_of(c, position)].candidates.push_back(i);
    }
  }
  return work;
}

// Required outputs: what the stage markers carry between neighbours.
void add_marker_interfaces(const Ctx& c, Work& work) {
  const Program& p = c.p;
  const int S = c.S;
  for (int s = 0; s < S; ++s) {
    if (s < S - 1) {
      const Op& m = p.ops[c.fwd_marker[s]];
      work[s][0].body.act_out.assign(m.inputs.begin(), m.inputs.end());
    }
    if (s > 0) {
      work[s][0].body.act_in.assign(p.ops[c.fwd_marker[s - 1]].outputs.begin(),
                                    p.ops[c.fwd_marker[s - 1]].outputs.end());
      if (c.bwd_marker[s - 1] >= 0) {
        work[s][1].body.grad_out.assign(p.ops[c.bwd_marker[s - 1]].inputs.begin(),
                                        p.ops[c.bwd_marker[s - 1]].inputs.end());
      }
    }
    if (s < S - 1 && c.bwd_marker[s] >= 0) {
      work[s][1].body.grad_in.assign(p.ops[c.bwd_marker[s]].outputs.begin(),
                                     p.ops[c.bwd_marker[s]].outputs.end());
    }
  }
}

// Values that reach stage s with its activations / input gradients (from
// the neighbour or on a skip edge).
struct Arrivals {
  std::vector<std::set<int>> act_in, grad_in;
};

Arrivals arrivals(const Work& work) {
  const int S = static_cast<int>(work.size());
  Arrivals a{std::vector<std::set<int>>(S), std::vector<std::set<int>>(S)};
  for (int s = 0; s < S; ++s) {
    a.act_in[s].insert(work[s][0].body.act_in.begin(), work[s][0].body.act_in.end());
    a.grad_in[s].insert(work[s][1].body.grad_in.begin(), work[s][1].body.grad_in.end());
    for (const SkipValues& e : work[s][0].body.skip_in)
      a.act_in[s].insert(e.values.begin(), e.values.end());
    for (const SkipValues& e : work[s][1].body.skip_grad_in)
      a.grad_in[s].insert(e.values.begin(), e.values.end());
  }
  return a;
}

// Each loop output part goes out of the task that computes it.
void assign_parts(const std::vector<OutputPart>& parts, Work& work) {
  for (int i = 0; i < static_cast<int>(parts.size()); ++i) {
    const OutputPart& part = parts[i];
    int slot = part.task == TaskKind::F ? 0 : part.task == TaskKind::W ? 2 : 1;
    if (slot == 0) {
      work[part.stage][0].body.mb_out.push_back(i);
    } else {
      work[part.stage][slot].body.wgrad_out.push_back(i);
    }
  }
}

// Keeps the candidates of `w` that `outs` depend on (as w.body.ops, also
// added to `kept_ops`) and returns the values they read but do not produce.
std::vector<int> dce(const Program& p, TaskWork& w, const std::vector<int>& outs,
                     std::set<int>& kept_ops) {
  std::set<int> live(outs.begin(), outs.end());
  std::vector<int> kept;
  for (auto it = w.candidates.rbegin(); it != w.candidates.rend(); ++it) {
    const Op& op = p.ops[*it];
    bool use = false;
    for (int32_t v : op.outputs) use = use || live.count(v);
    if (!use) continue;
    kept.push_back(*it);
    for (int32_t v : op.inputs) live.insert(v);
  }
  std::reverse(kept.begin(), kept.end());
  kept_ops.insert(kept.begin(), kept.end());
  w.body.ops = kept;
  std::set<int> produced;
  for (int o : kept) produced.insert(p.ops[o].outputs.begin(), p.ops[o].outputs.end());
  std::vector<int> ins;
  for (int v : live) {
    if (!produced.count(v)) ins.push_back(v);
  }
  return ins;
}

// Classifies the inputs of task (s, slot) and returns values the earlier
// task of the same stage must provide (stash from F, or wstash from I).
void classify(const Ctx& c, const Arrivals& a, TaskWork& w, int s, int slot,
              const std::vector<int>& ins, const std::set<int>& f_ops, const std::set<int>& i_ops,
              std::set<int>& from_f, std::set<int>& from_i) {
  const Program& p = c.p;
  for (int v : ins) {
    ValueKind k = p.values[v].kind;
    if (k == ValueKind::Literal) continue;
    if (k == ValueKind::LoopInvariant) {
      w.body.invariant_in.push_back(v);
      continue;
    }
    if (k == ValueKind::LoopMicrobatch) {
      w.body.microbatch_in.push_back(v);
      continue;
    }
    // Values that reach stage s with its activations (marker outputs,
    // values sent to the neighbour or on a skip edge) are F's inputs and, for the backward, F's
    // stash; those that reach it with the input gradients are I's inputs and, for W, I's wstash.
    if (a.act_in[s].count(v)) {
      if (slot > 0) from_f.insert(v);
      continue;
    }
    if (slot > 0 && a.grad_in[s].count(v)) {
      if (slot == 2) from_i.insert(v);
      continue;
    }
    int op = c.producer[v];
    if (op < 0) {
      throw TraceError(fmt::format("value {} used by stage {} has no producer", c.val_label(v), s));
    }
    const Op& o = p.ops[op];
    int src_stage = -1, src_slot = -1;
    if (o.kind == OpKind::Boundary) {
      src_stage = o.backward ? o.boundary : o.boundary + 1;
      src_slot = o.backward ? 1 : 0;
    } else if (f_ops.count(op)) {
      src_stage = s;
      src_slot = 0;
    } else if (i_ops.count(op)) {
      src_stage = s;
      src_slot = 1;
    } else if (c.staged_op[op]) {
      int position = c.pos[v];
      src_stage = c.stage_of(position);
      src_slot = slot_of(c, position);
    }
    bool ok = src_stage == s && src_slot >= 0 && src_slot < slot;
    if (!ok) {
      std::string where =
          src_stage < 0 ? std::string("outside any stage") : fmt::format("stage {}", src_stage);
      throw TraceError(fmt::format(
          "value {} produced by {} in {} is used by the {} task of stage {}, which cannot "
          "receive it (a value flows forward to later stages and its gradient backward; a "
          "backward computation that reads a forward value of a later stage is not supported)",
          c.val_label(v), c.op_label(op), where, task_kind_char(w.body.kind), s));
    }
    if (src_slot == 0) {
      from_f.insert(v);
    } else {
      from_i.insert(v);
    }
  }
}

// One backward task B of stage s computing `b_grads` (the input gradients)
// and its weight gradients. Returns the values it needs from F.
std::set<int> form_full_backward(const Ctx& c, const Arrivals& a,
                                 const std::vector<OutputPart>& parts, int s, TaskWork& B,
                                 const std::set<int>& f_ops_all, const std::vector<int>& b_grads) {
  std::vector<int> b_outs = b_grads;
  for (int i : B.body.wgrad_out) b_outs.push_back(parts[i].body);
  std::set<int> from_f;
  std::set<int> kept_b;
  std::vector<int> b_ins = dce(c.p, B, b_outs, kept_b);
  std::set<int> bi;
  classify(c, a, B, s, 1, b_ins, f_ops_all, {}, from_f, bi);
  return from_f;
}

// A split backward of stage s: I (in B's slot) computes `b_grads` (the input
// gradients) and the wstash W reads; W the weight gradients. Returns the
// values I needs from F.
std::set<int> form_split_backward(const Ctx& c, const Arrivals& a,
                                  const std::vector<OutputPart>& parts, int s, TaskWork& B,
                                  TaskWork& W, const std::set<int>& f_ops_all,
                                  const std::vector<int>& b_grads) {
  const Program& p = c.p;
  // I: ancestors of the input gradient.
  std::set<int> kept_b;
  dce(p, B, b_grads, kept_b);
  // W: the remaining backward ops needed for the weight gradients.
  W.candidates.clear();
  for (int o : B.candidates) {
    if (!kept_b.count(o)) W.candidates.push_back(o);
  }
  std::vector<int> w_outs;
  for (int i : W.body.wgrad_out) w_outs.push_back(parts[i].body);
  std::set<int> kept_w;
  std::vector<int> w_ins = dce(p, W, w_outs, kept_w);
  std::set<int> wf, wi;
  // W reads only WStash: everything it needs comes through I.
  classify(c, a, W, s, 2, w_ins, f_ops_all, kept_b, wf, wi);
  W.body.invariant_in.clear();
  W.body.microbatch_in.clear();
  // W may read invariants / microbatch slices directly (they are inputs
  // of the step, not buffers).
  for (int v : w_ins) {
    ValueKind k = p.values[v].kind;
    if (k == ValueKind::LoopInvariant) W.body.invariant_in.push_back(v);
    if (k == ValueKind::LoopMicrobatch) W.body.microbatch_in.push_back(v);
  }
  std::set<int> wstash;
  wstash.insert(wf.begin(), wf.end());
  wstash.insert(wi.begin(), wi.end());
  W.body.wstash_in.assign(wstash.begin(), wstash.end());
  // I: outputs grad_out + wstash.
  std::vector<int> i_outs = b_grads;
  i_outs.insert(i_outs.end(), wstash.begin(), wstash.end());
  std::set<int> kept_i2;
  std::vector<int> i_ins = dce(p, B, i_outs, kept_i2);
  B.body.wstash_out.assign(wstash.begin(), wstash.end());
  std::set<int> bf, bi;
  classify(c, a, B, s, 1, i_ins, f_ops_all, {}, bf, bi);
  // Values of F that W needs go through I's inputs as stash.
  for (int v : wf) bf.insert(v);
  // Values that I reads from its own grad_in but W needs are forwarded
  // already (they are in wstash and I has them as grad_in).
  return bf;
}

// Stash less: the backward task (B, or I) recomputes cheap forward ops;
// `from_f` becomes what F still stashes for it.
void recompute_cheap(const Ctx& c, TaskWork& B, const std::set<int>& f_ops_all,
                     std::set<int>& from_f) {
  if (!c.remat || from_f.empty()) return;
  const Program& p = c.p;
  Remat r = min_stash(p, c.producer, f_ops_all, from_f);
  if (r.recompute.empty()) return;
  std::set<int> ops(B.body.ops.begin(), B.body.ops.end());
  ops.insert(r.recompute.begin(), r.recompute.end());
  B.body.ops.assign(ops.begin(), ops.end());
  for (int o : r.recompute) {
    for (int32_t v : p.ops[o].inputs) {
      ValueKind k = p.values[v].kind;
      if (k == ValueKind::LoopInvariant) B.body.invariant_in.push_back(v);
      if (k == ValueKind::LoopMicrobatch) B.body.microbatch_in.push_back(v);
    }
  }
  from_f = std::set<int>(r.stash.begin(), r.stash.end());
}

// F of stage s: act_out + stash (`from_f`) + per-microbatch outputs.
void form_forward(const Ctx& c, const Arrivals& a, const std::vector<OutputPart>& parts, int s,
                  TaskWork& F, const std::set<int>& from_f) {
  std::vector<int> f_outs = F.body.act_out;
  append_skips(f_outs, F.body.skip_out);
  f_outs.insert(f_outs.end(), from_f.begin(), from_f.end());
  for (int i : F.body.mb_out) f_outs.push_back(parts[i].body);
  std::set<int> kept_f;
  std::vector<int> f_ins = dce(c.p, F, f_outs, kept_f);
  std::set<int> ff, fi;
  classify(c, a, F, s, 0, f_ins, {}, {}, ff, fi);
  F.body.stash_out.assign(from_f.begin(), from_f.end());
  if (F.body.ops.empty()) {
    const int S = c.S;
    throw TraceError(fmt::format(
        "stage {} has no work: no operation between {} (two stage_boundary calls in a row, or "
        "a boundary on the loop inputs?)",
        s,
        s == 0 ? std::string("the loop start and stage_boundary 0")
               : fmt::format("stage_boundary {} and {}", s - 1,
                             s == S - 1 ? std::string("the loop end") : std::to_string(s))));
  }
}

// Sorted, unique step inputs and the task's cost.
void finish_task(const Program& p, TaskWork& w) {
  for (auto* in : {&w.body.invariant_in, &w.body.microbatch_in}) {
    std::sort(in->begin(), in->end());
    in->erase(std::unique(in->begin(), in->end()), in->end());
  }
  double cost = 0;
  for (int o : w.body.ops) cost += p.ops[o].cost;
  w.body.cost = cost;
}

// The tasks of stage s, appended to `out` in order F, B (or I, W).
void form_stage(const Ctx& c, const Arrivals& a, const std::vector<OutputPart>& parts, int s,
                std::array<TaskWork, 3>& work, std::vector<TaskBody>& out) {
  TaskWork& F = work[0];
  TaskWork& B = work[1];
  TaskWork& W = work[2];
  const std::set<int> f_ops_all(F.candidates.begin(), F.candidates.end());
  // Input gradients: to the previous stage and on skip edges.
  std::vector<int> b_grads = B.body.grad_out;
  append_skips(b_grads, B.body.skip_grad_out);
  std::set<int> from_f = c.split ? form_split_backward(c, a, parts, s, B, W, f_ops_all, b_grads)
                                 : form_full_backward(c, a, parts, s, B, f_ops_all, b_grads);
  recompute_cheap(c, B, f_ops_all, from_f);
  B.body.stash_in.assign(from_f.begin(), from_f.end());
  form_forward(c, a, parts, s, F, from_f);
  finish_task(c.p, F);
  finish_task(c.p, B);
  if (c.split) finish_task(c.p, W);
  out.push_back(F.body);
  out.push_back(B.body);
  if (c.split) out.push_back(W.body);
}

}  // namespace

std::vector<TaskBody> form_tasks(Ctx& c, const std::vector<OutputPart>& parts,
                                 std::vector<SkipEdge>& skips) {
  Work work = seed_work(c);
  add_marker_interfaces(c, work);
  skips = add_skips(c, work);
  const Arrivals a = arrivals(work);
  assign_parts(parts, work);
  std::vector<TaskBody> out;
  for (int s = 0; s < c.S; ++s) form_stage(c, a, parts, s, work[s], out);
  return out;
}

}  // namespace baton::partition_detail
