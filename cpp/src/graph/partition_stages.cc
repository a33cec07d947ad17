// Partition steps 1-4 and 6: which stage (and forward or backward position)
// every op of the Program runs on.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "baton/graph.h"
#include "partition_internal.h"

namespace baton::partition_detail {

namespace {

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

// Step 1, with the count of primal loop outputs known (0 < num_primal_outputs
// < loop outputs): every loop op that no primal output depends on is backward.
std::vector<char> backward_by_data_flow(const Ctx& c) {
  const Program& p = c.p;
  const int nops = static_cast<int>(p.ops.size());
  std::vector<char> after_cut(static_cast<size_t>(nops), 0);
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
  return after_cut;
}

// Step 1, with the count of primal loop outputs unknown: the primal outputs
// are the shortest prefix of the loop outputs all produced before the rest,
// and the ops after the last of them are backward.
std::vector<char> backward_by_order(const Ctx& c) {
  const Program& p = c.p;
  const int nops = static_cast<int>(p.ops.size());
  const int n = static_cast<int>(p.loop_outputs.size());
  std::vector<char> after_cut(static_cast<size_t>(nops), 0);
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
  return after_cut;
}

// Step 1: which loop ops are backward (a forward residual they read maps to
// the backward of its stage). Nothing marks where the last stage's backward
// starts (the cotangent seed is a literal), so the primal loop outputs
// decide: with their count known (num_primal_outputs >= 0), every loop op
// that no primal output depends on is backward: pure data flow, the same for
// any topological order of the ops. Unknown, the primal outputs are the
// shortest prefix of the loop outputs all produced before the rest, and the
// ops after the last of them are backward.
std::vector<char> backward_ops(const Ctx& c) {
  const Program& p = c.p;
  const int n = static_cast<int>(p.loop_outputs.size());
  if (p.num_primal_outputs > n)
    throw TraceError(
        fmt::format("internal: {} primal loop outputs of {}", p.num_primal_outputs, n));
  if (p.num_primal_outputs > 0 && p.num_primal_outputs < n) return backward_by_data_flow(c);
  if (p.num_primal_outputs < 0) return backward_by_order(c);
  // 0 primal outputs or only primal ones: no cut (the backward runs in the forward task)
  return std::vector<char>(p.ops.size(), 0);
}

// With several stages, values computed from the batch alone are left
// unstaged (each stage that reads them recomputes them: positions, masks),
// except the expensive ones that stage 0 computes on the way to its
// boundary (embeddings, its layers): those are stage 0's work, and a later
// stage that reads them receives them (a skip edge) instead of rerunning them.
// Returns, per op, whether it is such a seed of stage 0.
std::vector<char> stage0_seeds(const Ctx& c) {
  const Program& p = c.p;
  const int nops = static_cast<int>(p.ops.size());
  std::vector<char> seed(static_cast<size_t>(nops), 0);
  if (c.S <= 1 || c.fwd_marker[0] < 0) return seed;
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
    if (op < 0 || p.ops[op].region != Region::Loop || p.ops[op].kind == OpKind::Boundary) continue;
    if (batch[v] && !is_recomputable(p.ops[op])) seed[op] = 1;
    for (int32_t u : p.ops[op].inputs) stack.push_back(u);
  }
  return seed;
}

// Step 2 for one op: a marker's outputs go to the position after its
// boundary (checking that none of its inputs comes later); any other loop op
// runs at the latest position of its inputs.
void place_op(Ctx& c, int i, const std::vector<char>& after_cut, const std::vector<char>& seed) {
  const Program& p = c.p;
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
}

}  // namespace

// Steps 1 and 2: which body ops are staged, and their chain positions.
void infer_stages(Ctx& c) {
  const Program& p = c.p;
  const int nops = static_cast<int>(p.ops.size());
  const std::vector<char> after_cut = backward_ops(c);
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
  const std::vector<char> seed = stage0_seeds(c);
  // Forward ops first (no forward op reads a backward one), then forward ops
  // sink towards their readers, then the backward ops, whose residuals are
  // read where the forward values finally are.
  for (int i = 0; i < nops; ++i) {
    if (!after_cut[i]) place_op(c, i, after_cut, seed);
  }
  sink_forward(c, after_cut);
  for (int i = 0; i < nops; ++i) {
    if (after_cut[i]) place_op(c, i, after_cut, seed);
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

}  // namespace baton::partition_detail
