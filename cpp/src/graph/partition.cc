// Cuts the microbatch loop of a Program into pipeline tasks (see graph.h for
// the algorithm, in six steps): the driver, which checks the stage markers and
// runs the passes of partition_stages.cc and partition_tasks.cc, and
// Partition's methods.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "baton/graph.h"
#include "partition_internal.h"

namespace baton {

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
  partition_detail::Ctx c(program);
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
  partition_detail::infer_stages(c);
  Partition part;
  part.num_stages = c.S;
  part.split_backward = split_backward;
  partition_detail::split_tied_sums(c, part.parts);
  partition_detail::place_unstaged(c, part.parts);
  part.tasks = partition_detail::form_tasks(c, part.parts, part.skips);
  part.op_stage = partition_detail::place_outer(c, part.tasks, part.parts);
  return part;
}

}  // namespace baton
