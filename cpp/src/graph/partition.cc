// Passes that cut the microbatch loop of a Program into pipeline tasks (see
// graph.h for the algorithm, in six steps).
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "baton/graph.h"

namespace baton {

namespace {

constexpr int kUnplaced = std::numeric_limits<int>::min();

struct Ctx {
  const Program& p;
  int S = 0;  // stages
  bool split = false;
  bool remat = true;
  std::vector<int> producer;                // value -> op or -1
  std::vector<std::vector<int>> consumers;  // value -> ops
  std::vector<int> pos;                     // staged value -> chain position
  std::vector<bool> staged_op;              // body op is staged
  std::vector<std::map<int, int>> upos;     // unstaged op -> stage -> position
  std::vector<int> fwd_marker, bwd_marker;  // k -> op index
  explicit Ctx(const Program& prog) : p(prog) {}

  int stage_of(int position) const { return position < S ? position : 2 * S - 1 - position; }
  bool is_fwd(int position) const { return position < S; }
  int f_pos(int s) const { return s; }
  int b_pos(int s) const { return 2 * S - 1 - s; }
  std::string op_label(int i) const { return fmt::format("op #{} ({})", i, p.ops[i].name); }
  std::string val_label(int v) const {
    const Value& val = p.values[v];
    std::string shape;
    for (size_t i = 0; i < val.shape.size(); ++i)
      shape += fmt::format("{}{}", i ? "," : "", val.shape[i]);
    return fmt::format("%{} ({}[{}])", v, val.dtype, shape);
  }
  std::string pos_label(int position) const {
    return fmt::format("{}{}", is_fwd(position) ? 'F' : 'B', stage_of(position));
  }
};

// Sinking (part of step 2). Positions are the earliest stage an op can run
// in; a forward op whose outputs only later forward stages read (the keys and
// values a decoder stage projects from the encoder output) moves to the
// earliest of its readers, when its staged inputs are no larger than its
// outputs: what crosses the stages is then the inputs (often sent anyway)
// instead of the outputs, and the work runs where the model's code put it.
// Reverse program order, so chains sink together. Values read by a backward
// op do not hold an op back (the backward op follows the residual); loop
// outputs and values a backward marker reads stay.
void sink_forward(Ctx& c, const std::vector<char>& after_cut) {
  const Program& p = c.p;
  std::vector<char> loop_out(p.values.size(), 0);
  for (const LoopOutput& o : p.loop_outputs) loop_out[o.body] = 1;
  for (int i = static_cast<int>(p.ops.size()) - 1; i >= 0; --i) {
    const Op& op = p.ops[i];
    if (op.region != Region::Loop || op.kind == OpKind::Boundary || !c.staged_op[i] ||
        after_cut[i] || op.outputs.empty())
      continue;
    const int from = c.pos[op.outputs[0]];
    if (!c.is_fwd(from)) continue;
    int to = std::numeric_limits<int>::max();
    bool movable = true;
    int64_t out_bytes = 0, in_bytes = 0;
    for (int32_t v : op.outputs) {
      out_bytes += p.values[v].bytes;
      if (loop_out[v]) movable = false;
      for (int u : c.consumers[v]) {
        const Op& reader = p.ops[u];
        if (reader.region != Region::Loop || (reader.kind == OpKind::Boundary && reader.backward)) {
          movable = false;
        } else if (reader.kind == OpKind::Boundary) {
          to = std::min(to, c.f_pos(reader.boundary));
        } else if (!after_cut[u] && c.staged_op[u] && !reader.outputs.empty()) {
          to = std::min(to, c.pos[reader.outputs[0]]);
        } else if (!after_cut[u]) {
          movable = false;
        }
      }
    }
    for (int32_t v : op.inputs) {
      if (c.pos[v] != kUnplaced) in_bytes += p.values[v].bytes;
    }
    if (!movable || to == std::numeric_limits<int>::max() || to <= from || !c.is_fwd(to) ||
        in_bytes > out_bytes)
      continue;
    for (int32_t v : op.outputs) c.pos[v] = to;
  }
}

// Steps 1 and 2: which body ops are staged, and their chain positions.
void infer_stages(Ctx& c) {
  const Program& p = c.p;
  const int nops = static_cast<int>(p.ops.size());
  // Which loop ops are backward (a forward residual they read maps to the
  // backward of its stage). Nothing marks where the last stage's backward
  // starts (the cotangent seed is a literal), so the primal loop outputs
  // decide: with their count known (num_primal_outputs >= 0), every loop op
  // that no primal output depends on is backward: pure data flow, the same for
  // any topological order of the ops. Unknown, the primal outputs are the
  // shortest prefix of the loop outputs all produced before the rest, and the
  // ops after the last of them are backward.
  std::vector<char> after_cut(static_cast<size_t>(nops), 0);
  const int n = static_cast<int>(p.loop_outputs.size());
  if (p.num_primal_outputs > n)
    throw TraceError(
        fmt::format("internal: {} primal loop outputs of {}", p.num_primal_outputs, n));
  if (p.num_primal_outputs > 0 && p.num_primal_outputs < n) {
    std::vector<char> needed(p.values.size(), 0);
    std::vector<int32_t> stack;
    for (int k = 0; k < p.num_primal_outputs; ++k) stack.push_back(p.loop_outputs[k].body);
    while (!stack.empty()) {
      const int32_t v = stack.back();
      stack.pop_back();
      if (v < 0 || needed[v]) continue;
      needed[v] = 1;
      const int op = c.producer[v];
      if (op >= 0)
        for (int32_t in : p.ops[op].inputs) stack.push_back(in);
    }
    for (int i = 0; i < nops; ++i) {
      const Op& op = p.ops[i];
      bool feeds_primal = false;
      for (int32_t v : op.outputs) feeds_primal = feeds_primal || needed[v];
      after_cut[i] = op.region == Region::Loop && !feeds_primal;
    }
  } else if (p.num_primal_outputs < 0) {
    std::vector<int> prod_idx;
    for (const LoopOutput& o : p.loop_outputs) prod_idx.push_back(c.producer[o.body]);
    int cut = nops;
    for (int k = 1; k <= n; ++k) {
      int max_pre = -1, min_post = nops;
      for (int i = 0; i < k; ++i) max_pre = std::max(max_pre, prod_idx[i]);
      for (int i = k; i < n; ++i) {
        if (prod_idx[i] >= 0) min_post = std::min(min_post, prod_idx[i]);
      }
      if (max_pre < min_post) {
        cut = k == n ? nops : max_pre + 1;
        break;
      }
    }
    for (int i = cut; i < nops; ++i) after_cut[i] = 1;
  }  // 0 primal outputs or only primal ones: no cut (the backward runs in the forward task)
  c.pos.assign(p.values.size(), kUnplaced);
  c.staged_op.assign(nops, false);
  if (c.S == 1) {
    // One stage (no stage_boundary): nothing seeds the chain, so the
    // per-microbatch inputs do. Whatever depends on them is F0 before the cut
    // and B0 after it; ops reading only invariants and literals stay unstaged
    // as usual. (With several stages batch-only values stay unstaged so that
    // each stage recomputes them instead of receiving them.)
    for (const LoopInput& in : p.loop_inputs) {
      if (p.values[in.body].kind == ValueKind::LoopMicrobatch) c.pos[in.body] = c.f_pos(0);
    }
  }
  // With several stages, values computed from the batch alone are left
  // unstaged (each stage that reads them recomputes them: positions, masks),
  // except the expensive ones that stage 0 computes on the way to its
  // boundary (embeddings, its layers): those are stage 0's work, and a later
  // stage that reads them receives them (a skip edge) instead of rerunning them.
  std::vector<char> seed(static_cast<size_t>(nops), 0);
  if (c.S > 1 && c.fwd_marker[0] >= 0) {
    std::vector<char> batch(p.values.size(), 0);
    for (const LoopInput& in : p.loop_inputs) {
      if (p.values[in.body].kind == ValueKind::LoopMicrobatch) batch[in.body] = 1;
    }
    for (int i = 0; i < nops; ++i) {
      const Op& op = p.ops[i];
      if (op.region != Region::Loop) continue;
      bool any = false;
      for (int32_t v : op.inputs) any = any || batch[v];
      for (int32_t v : op.outputs) batch[v] = any;
    }
    std::vector<char> seen(p.values.size(), 0);
    std::vector<int32_t> stack(p.ops[c.fwd_marker[0]].inputs.begin(),
                               p.ops[c.fwd_marker[0]].inputs.end());
    while (!stack.empty()) {
      const int32_t v = stack.back();
      stack.pop_back();
      if (seen[v]) continue;
      seen[v] = 1;
      const int op = c.producer[v];
      if (op < 0 || p.ops[op].region != Region::Loop || p.ops[op].kind == OpKind::Boundary)
        continue;
      if (batch[v] && !is_recomputable(p.ops[op])) seed[op] = 1;
      for (int32_t u : p.ops[op].inputs) stack.push_back(u);
    }
  }
  auto place = [&](int i) {
    const Op& op = p.ops[i];
    if (op.region != Region::Loop) return;
    if (op.kind == OpKind::Boundary) {
      int k = op.boundary;
      int limit = op.backward ? c.b_pos(k + 1) : c.f_pos(k);
      for (int32_t v : op.inputs) {
        if (c.pos[v] != kUnplaced && c.pos[v] > limit) {
          throw TraceError(fmt::format(
              "{}: {} stage_boundary {} consumes {} computed in {}, which comes after the "
              "boundary (are the boundaries in order along the data flow?)",
              c.op_label(i), op.backward ? "backward" : "forward", k, c.val_label(v),
              c.pos_label(c.pos[v])));
        }
      }
      int out = op.backward ? c.b_pos(k) : c.f_pos(k + 1);
      for (int32_t v : op.outputs) c.pos[v] = out;
      c.staged_op[i] = true;
      return;
    }
    // In the backward part of the program a residual of F_s is read by B_s,
    // unless the op also reads cotangents of a later stage j > s: then it runs
    // in B_j and the residual is sent forward to stage j and stashed there
    // (an encoder output read by a decoder stage's backward).
    int lb = kUnplaced, res = kUnplaced;
    for (int32_t v : op.inputs) {
      int q = c.pos[v];
      if (after_cut[i] && q != kUnplaced && c.is_fwd(q)) {
        res = std::max(res, c.b_pos(q));
      } else {
        lb = std::max(lb, q);
      }
    }
    if (lb == kUnplaced) lb = res;
    if (lb == kUnplaced && seed[i]) lb = c.f_pos(0);
    if (lb == kUnplaced) return;  // unstaged: placed by its consumers
    c.staged_op[i] = true;
    for (int32_t v : op.outputs) c.pos[v] = lb;
  };
  // Forward ops first (no forward op reads a backward one), then forward ops
  // sink towards their readers, then the backward ops, whose residuals are
  // read where the forward values finally are.
  for (int i = 0; i < nops; ++i) {
    if (!after_cut[i]) place(i);
  }
  sink_forward(c, after_cut);
  for (int i = 0; i < nops; ++i) {
    if (after_cut[i]) place(i);
  }
}

// Step 3: split summed loop outputs that add contributions of several stages.
void split_tied_sums(Ctx& c, std::vector<OutputPart>& parts) {
  const Program& p = c.p;
  auto stage_of_value = [&](int v) { return c.pos[v] == kUnplaced ? -1 : c.stage_of(c.pos[v]); };
  std::function<void(int, std::vector<int>&)> expand = [&](int v, std::vector<int>& acc) {
    int op = c.producer[v];
    if (op >= 0 && p.ops[op].kind == OpKind::AddAny && c.staged_op[op]) {
      std::set<int> stages;
      for (int32_t in : p.ops[op].inputs) stages.insert(stage_of_value(in));
      if (stages.size() > 1) {
        for (int32_t in : p.ops[op].inputs) expand(in, acc);
        return;
      }
    }
    acc.push_back(v);
  };
  for (const LoopOutput& o : p.loop_outputs) {
    std::vector<int> vals;
    if (o.reduce == Reduce::Stack) {
      vals.push_back(o.body);
    } else {
      expand(o.body, vals);
    }
    for (int v : vals) {
      OutputPart part;
      part.body = v;
      part.outer = o.outer;
      part.reduce = o.reduce;
      if (c.pos[v] == kUnplaced) {
        part.stage = 0;  // unstaged: computed by the first stage's forward
        part.task = TaskKind::F;
      } else {
        part.stage = c.stage_of(c.pos[v]);
        part.task = c.is_fwd(c.pos[v]) ? TaskKind::F : (c.split ? TaskKind::W : TaskKind::B);
      }
      parts.push_back(part);
    }
  }
}

// Step 4: place unstaged ops at their earliest consumer, per consuming stage.
void place_unstaged(Ctx& c, const std::vector<OutputPart>& parts) {
  const Program& p = c.p;
  const int nops = static_cast<int>(p.ops.size());
  c.upos.assign(nops, {});
  // Extra consumers: loop output parts.
  std::vector<std::vector<std::pair<int, int>>> extra(p.values.size());
  for (const OutputPart& part : parts) {
    int position = part.task == TaskKind::F ? c.f_pos(part.stage) : c.b_pos(part.stage);
    extra[part.body].push_back({part.stage, position});
  }
  auto note = [](std::map<int, int>& m, int stage, int position) {
    auto it = m.find(stage);
    if (it == m.end() || position < it->second) m[stage] = position;
  };
  for (int i = nops - 1; i >= 0; --i) {
    const Op& op = p.ops[i];
    if (op.region != Region::Loop || c.staged_op[i]) continue;
    std::map<int, int>& m = c.upos[i];
    for (int32_t v : op.outputs) {
      for (auto [s, position] : extra[v]) note(m, s, position);
      for (int u : c.consumers[v]) {
        const Op& cop = p.ops[u];
        if (cop.kind == OpKind::Boundary) {
          int k = cop.boundary;
          if (cop.backward) {
            note(m, k + 1, c.b_pos(k + 1));
          } else {
            note(m, k, c.f_pos(k));
          }
        } else if (c.staged_op[u]) {
          int position = c.pos[cop.outputs.empty() ? -1 : cop.outputs[0]];
          if (cop.outputs.empty()) continue;
          note(m, c.stage_of(position), position);
        } else {
          for (auto [s, position] : c.upos[u]) note(m, s, position);
        }
      }
    }
  }
}

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
    throw TraceError(fmt::format(
        "values cross between {} pairs of non-neighbouring stages ({}); at most {} are "
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

// Step 5: task formation, interfaces and DCE.
std::vector<TaskBody> form_tasks(Ctx& c, const std::vector<OutputPart>& parts,
                                 std::vector<SkipEdge>& skips) {
  const Program& p = c.p;
  const int S = c.S;
  const int nops = static_cast<int>(p.ops.size());
  // Position -> task slot. Slots: F_s, and B_s (or I_s and W_s).
  // Work items indexed [stage][0=F,1=B|I,2=W].
  std::vector<std::array<TaskWork, 3>> work(S);
  for (int s = 0; s < S; ++s) {
    work[s][0].body.kind = TaskKind::F;
    work[s][1].body.kind = c.split ? TaskKind::I : TaskKind::B;
    work[s][2].body.kind = TaskKind::W;
    for (auto& w : work[s]) w.body.stage = s;
  }
  auto slot_of = [&](int position) { return c.is_fwd(position) ? 0 : 1; };
  for (int i = 0; i < nops; ++i) {
    const Op& op = p.ops[i];
    if (op.region != Region::Loop || op.kind == OpKind::Boundary) continue;
    if (c.staged_op[i]) {
      int position = c.pos[op.outputs.empty() ? -1 : op.outputs[0]];
      if (op.outputs.empty()) continue;
      work[c.stage_of(position)][slot_of(position)].candidates.push_back(i);
    } else {
      for (auto [s, position] : c.upos[i]) work[s][slot_of(position)].candidates.push_back(i);
    }
  }
  // Required outputs.
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
  skips = add_skips(c, work);
  // Values that reach stage s with its activations / input gradients (from
  // the neighbour or on a skip edge).
  std::vector<std::set<int>> act_in(S), grad_in(S);
  for (int s = 0; s < S; ++s) {
    act_in[s].insert(work[s][0].body.act_in.begin(), work[s][0].body.act_in.end());
    grad_in[s].insert(work[s][1].body.grad_in.begin(), work[s][1].body.grad_in.end());
    for (const SkipValues& e : work[s][0].body.skip_in)
      act_in[s].insert(e.values.begin(), e.values.end());
    for (const SkipValues& e : work[s][1].body.skip_grad_in)
      grad_in[s].insert(e.values.begin(), e.values.end());
  }
  for (int i = 0; i < static_cast<int>(parts.size()); ++i) {
    const OutputPart& part = parts[i];
    int slot = part.task == TaskKind::F ? 0 : part.task == TaskKind::W ? 2 : 1;
    if (slot == 0) {
      work[part.stage][0].body.mb_out.push_back(i);
    } else {
      work[part.stage][slot].body.wgrad_out.push_back(i);
    }
  }
  auto dce = [&](TaskWork& w, const std::vector<int>& outs, std::set<int>& kept_ops) {
    std::set<int> live(outs.begin(), outs.end());
    std::set<int> cand(w.candidates.begin(), w.candidates.end());
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
  };

  // Classifies the inputs of task (s, slot) and returns values the earlier
  // task of the same stage must provide (stash from F, or wstash from I).
  auto classify = [&](TaskWork& w, int s, int slot, const std::vector<int>& ins,
                      const std::set<int>& f_ops, const std::set<int>& i_ops, std::set<int>& from_f,
                      std::set<int>& from_i) {
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
      // values sent to the neighbour or on a skip edge) are F's inputs and, for the backward, F's stash;
      // those that reach it with the input gradients are I's inputs and, for
      // W, I's wstash.
      if (act_in[s].count(v)) {
        if (slot > 0) from_f.insert(v);
        continue;
      }
      if (slot > 0 && grad_in[s].count(v)) {
        if (slot == 2) from_i.insert(v);
        continue;
      }
      int op = c.producer[v];
      if (op < 0) {
        throw TraceError(
            fmt::format("value {} used by stage {} has no producer", c.val_label(v), s));
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
        src_slot = slot_of(position);
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
  };

  std::vector<TaskBody> out;
  for (int s = 0; s < S; ++s) {
    TaskWork& F = work[s][0];
    TaskWork& B = work[s][1];
    TaskWork& W = work[s][2];
    std::set<int> f_ops_all(F.candidates.begin(), F.candidates.end());
    std::set<int> b_ops_all(B.candidates.begin(), B.candidates.end());
    // Input gradients: to the previous stage and on skip edges.
    std::vector<int> b_grads = B.body.grad_out;
    append_skips(b_grads, B.body.skip_grad_out);
    std::vector<int> b_outs = b_grads;
    for (int i : B.body.wgrad_out) b_outs.push_back(parts[i].body);
    std::set<int> from_f;
    if (c.split) {
      // I: ancestors of the input gradient.
      std::set<int> kept_b;
      dce(B, b_grads, kept_b);
      // W: the remaining backward ops needed for the weight gradients.
      W.candidates.clear();
      for (int o : B.candidates) {
        if (!kept_b.count(o)) W.candidates.push_back(o);
      }
      std::vector<int> w_outs;
      for (int i : W.body.wgrad_out) w_outs.push_back(parts[i].body);
      std::set<int> kept_w;
      std::vector<int> w_ins = dce(W, w_outs, kept_w);
      std::set<int> wf, wi;
      // W reads only WStash: everything it needs comes through I.
      classify(W, s, 2, w_ins, f_ops_all, kept_b, wf, wi);
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
      std::vector<int> i_ins = dce(B, i_outs, kept_i2);
      B.body.wstash_out.assign(wstash.begin(), wstash.end());
      std::set<int> bf, bi;
      classify(B, s, 1, i_ins, f_ops_all, {}, bf, bi);
      // Values of F that W needs go through I's inputs as stash.
      for (int v : wf) bf.insert(v);
      // Values that I reads from its own grad_in but W needs are forwarded
      // already (they are in wstash and I has them as grad_in).
      from_f = bf;
    } else {
      std::set<int> kept_b;
      std::vector<int> b_ins = dce(B, b_outs, kept_b);
      std::set<int> bi;
      classify(B, s, 1, b_ins, f_ops_all, {}, from_f, bi);
    }
    if (c.remat && !from_f.empty()) {
      // Stash less: the backward task (B, or I) recomputes cheap forward ops.
      Remat r = min_stash(p, c.producer, f_ops_all, from_f);
      if (!r.recompute.empty()) {
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
    }
    B.body.stash_in.assign(from_f.begin(), from_f.end());
    // F: act_out + stash + per-microbatch outputs.
    std::vector<int> f_outs = F.body.act_out;
    append_skips(f_outs, F.body.skip_out);
    f_outs.insert(f_outs.end(), from_f.begin(), from_f.end());
    for (int i : F.body.mb_out) f_outs.push_back(parts[i].body);
    std::set<int> kept_f;
    std::vector<int> f_ins = dce(F, f_outs, kept_f);
    std::set<int> ff, fi;
    classify(F, s, 0, f_ins, {}, {}, ff, fi);
    F.body.stash_out.assign(from_f.begin(), from_f.end());
    if (F.body.ops.empty()) {
      throw TraceError(fmt::format(
          "stage {} has no work: no operation between {} (two stage_boundary calls in a row, or "
          "a boundary on the loop inputs?)",
          s,
          s == 0 ? std::string("the loop start and stage_boundary 0")
                 : fmt::format("stage_boundary {} and {}", s - 1,
                               s == S - 1 ? std::string("the loop end") : std::to_string(s))));
    }
    for (auto* w : {&F, &B, &W}) {
      if (w == &W && !c.split) continue;
      for (auto* in : {&w->body.invariant_in, &w->body.microbatch_in}) {
        std::sort(in->begin(), in->end());
        in->erase(std::unique(in->begin(), in->end()), in->end());
      }
      double cost = 0;
      for (int o : w->body.ops) cost += p.ops[o].cost;
      w->body.cost = cost;
    }
    out.push_back(F.body);
    out.push_back(B.body);
    if (c.split) out.push_back(W.body);
  }
  return out;
}

// Step 6: stages of pre and post ops.
std::vector<int32_t> place_outer(const Ctx& c, const std::vector<TaskBody>& tasks,
                                 const std::vector<OutputPart>& parts) {
  const Program& p = c.p;
  const int nops = static_cast<int>(p.ops.size());
  std::vector<int32_t> op_stage(nops, -1);
  std::vector<int> vstage(p.values.size(), -1);
  auto lower = [](int& a, int b) {
    if (b >= 0 && (a < 0 || b < a)) a = b;
  };
  for (const OutputPart& part : parts) lower(vstage[part.outer], part.stage);
  // Outer value -> stage of the first task that reads its loop input.
  std::vector<int> loop_use(p.values.size(), -1);
  std::vector<int> body_use(p.values.size(), -1);
  for (const TaskBody& t : tasks) {
    for (int v : t.invariant_in) lower(body_use[v], t.stage);
    for (int v : t.microbatch_in) lower(body_use[v], t.stage);
  }
  for (const LoopInput& in : p.loop_inputs) lower(loop_use[in.outer], body_use[in.body]);
  // Post: forward from staged inputs, to the stage of the largest one (ties:
  // the smallest stage). A stage's optimizer update scaled by a global value
  // (the clip factor of a global-norm gradient clipping, computed from every
  // stage) stays on that stage: the scalar moves, not the parameters.
  for (int i = 0; i < nops; ++i) {
    const Op& op = p.ops[i];
    if (op.region != Region::Post) continue;
    int s = -1;
    int64_t most = -1;
    for (int32_t v : op.inputs) {
      if (vstage[v] < 0) continue;
      const int64_t b = p.values[v].bytes;
      if (b > most || (b == most && vstage[v] < s)) {
        most = b;
        s = vstage[v];
      }
    }
    op_stage[i] = s;
    for (int32_t v : op.outputs) vstage[v] = s;
  }
  // Pre and unplaced post ops: backward from consumers.
  std::vector<int> want(p.values.size(), -1);
  for (int v = 0; v < static_cast<int>(p.values.size()); ++v) want[v] = loop_use[v];
  for (int i = nops - 1; i >= 0; --i) {
    const Op& op = p.ops[i];
    if (op.region == Region::Loop) continue;
    if (op_stage[i] < 0) {
      int s = -1;
      for (int32_t v : op.outputs) lower(s, want[v]);
      op_stage[i] = s < 0 ? 0 : s;
    }
    for (int32_t v : op.inputs) lower(want[v], op_stage[i]);
  }
  return op_stage;
}

}  // namespace

int64_t TaskBody::bytes(const Program& p, const std::vector<int32_t>& vals) const {
  int64_t b = 0;
  for (int32_t v : vals) b += p.values[v].bytes;
  return b;
}

int32_t Partition::task_index(TaskKind kind, int32_t stage) const {
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (tasks[i].kind == kind && tasks[i].stage == stage) return static_cast<int32_t>(i);
  }
  throw TraceError(fmt::format("no {} task for stage {} in this partition ({} backward)",
                               task_kind_char(kind), stage, split_backward ? "split" : "full"));
}

const TaskBody& Partition::task(TaskKind kind, int32_t stage) const {
  return tasks[task_index(kind, stage)];
}

std::string Partition::to_text(const Program& p) const {
  auto vals = [](const std::vector<int32_t>& vs) {
    std::string s;
    for (size_t i = 0; i < vs.size(); ++i) s += fmt::format("{}%{}", i ? " " : "", vs[i]);
    return s;
  };
  std::string out = fmt::format("partition: {} stages, {} backward\n", num_stages,
                                split_backward ? "split (I/W)" : "full (B)");
  for (const TaskBody& t : tasks) {
    out += fmt::format("{}{}: {} ops, cost {}\n", task_kind_char(t.kind), t.stage, t.ops.size(),
                       t.cost);
    auto line = [&](const char* what, const std::vector<int32_t>& vs) {
      if (!vs.empty()) {
        out += fmt::format("  {}: {} ({} bytes)\n", what, vals(vs), t.bytes(p, vs));
      }
    };
    line("act_in", t.act_in);
    line("grad_in", t.grad_in);
    line("stash_in", t.stash_in);
    line("wstash_in", t.wstash_in);
    line("invariant_in", t.invariant_in);
    line("microbatch_in", t.microbatch_in);
    line("act_out", t.act_out);
    line("grad_out", t.grad_out);
    line("stash_out", t.stash_out);
    line("wstash_out", t.wstash_out);
    auto skip_lines = [&](const char* what, const std::vector<SkipValues>& es, bool from) {
      for (const SkipValues& e : es) {
        const SkipEdge& edge = skips[e.edge];
        line(fmt::format("{} {} s{}", what, from ? "from" : "to", from ? edge.from : edge.to)
                 .c_str(),
             e.values);
      }
    };
    skip_lines("skip_in", t.skip_in, true);
    skip_lines("skip_out", t.skip_out, false);
    // cotangents travel from stage `to` back to stage `from`
    for (const SkipValues& e : t.skip_grad_in)
      line(fmt::format("skip_grad_in from s{}", skips[e.edge].to).c_str(), e.values);
    for (const SkipValues& e : t.skip_grad_out)
      line(fmt::format("skip_grad_out to s{}", skips[e.edge].from).c_str(), e.values);
    std::vector<int32_t> wg, mo;
    for (int i : t.wgrad_out) wg.push_back(parts[i].body);
    for (int i : t.mb_out) mo.push_back(parts[i].body);
    line("wgrad_out", wg);
    line("mb_out", mo);
  }
  return out;
}

Partition partition(const Program& program, bool split_backward, bool remat) {
  program.validate();
  Ctx c(program);
  c.split = split_backward;
  c.remat = remat;
  const int nv = static_cast<int>(program.values.size());
  const int nops = static_cast<int>(program.ops.size());
  c.producer.assign(nv, -1);
  c.consumers.assign(nv, {});
  int n_markers = 0;
  bool any_loop = !program.loop_inputs.empty() || !program.loop_outputs.empty();
  for (int i = 0; i < nops; ++i) {
    const Op& op = program.ops[i];
    for (int32_t v : op.outputs) c.producer[v] = i;
    for (int32_t v : op.inputs) c.consumers[v].push_back(i);
    if (op.kind == OpKind::Boundary && !op.backward) ++n_markers;
    if (op.region == Region::Loop) any_loop = true;
  }
  if (!any_loop) {
    throw TraceError("the step has no microbatch loop: call baton.accumulate inside the step");
  }
  // No stage_boundary: a one-stage pipeline (F0 = forward, B0 = backward).
  // Whether the schedule can run it is checked against schedule.stages(ranks)
  // by the caller.
  c.S = n_markers + 1;
  c.fwd_marker.assign(n_markers, -1);
  c.bwd_marker.assign(n_markers, -1);
  for (int i = 0; i < nops; ++i) {
    const Op& op = program.ops[i];
    if (op.kind != OpKind::Boundary) continue;
    if (op.boundary < 0 || op.boundary >= n_markers) {
      throw TraceError(fmt::format("{}: boundary index {} out of range [0, {})", c.op_label(i),
                                   op.boundary, n_markers));
    }
    auto& slot = op.backward ? c.bwd_marker[op.boundary] : c.fwd_marker[op.boundary];
    if (slot >= 0) {
      throw TraceError(fmt::format(
          "{}: stage_boundary {} appears twice ({} direction); each boundary must be crossed "
          "once per microbatch",
          c.op_label(i), op.boundary, op.backward ? "backward" : "forward"));
    }
    slot = i;
  }
  for (int s = 0; s + 1 < n_markers; ++s) {
    if ((c.bwd_marker[s] < 0) != (c.bwd_marker[s + 1] < 0)) {
      throw TraceError(fmt::format(
          "stage_boundary {} has {} backward marker but boundary {} has {}: the loss must "
          "depend on every stage",
          s, c.bwd_marker[s] < 0 ? "no" : "a", s + 1, c.bwd_marker[s + 1] < 0 ? "none" : "one"));
    }
  }
  infer_stages(c);
  Partition part;
  part.num_stages = c.S;
  part.split_backward = split_backward;
  split_tied_sums(c, part.parts);
  place_unstaged(c, part.parts);
  part.tasks = form_tasks(c, part.parts, part.skips);
  part.op_stage = place_outer(c, part.tasks, part.parts);
  return part;
}

}  // namespace baton
