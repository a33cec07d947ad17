// Program IR: construction helpers, validation, printing.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "baton/graph.h"

namespace baton {

namespace {

const char* region_name(Region r) {
  switch (r) {
    case Region::Pre:
      return "pre";
    case Region::Loop:
      return "loop";
    case Region::Post:
      return "post";
  }
  return "?";
}

std::string op_label(const Program& p, int i) {
  return fmt::format("op #{} ({})", i, p.ops[i].name);
}

}  // namespace

int32_t Program::add_value(Value v) {
  values.push_back(std::move(v));
  return static_cast<int32_t>(values.size()) - 1;
}

int32_t Program::add_op(Op op) {
  ops.push_back(std::move(op));
  return static_cast<int32_t>(ops.size()) - 1;
}

void Program::validate() const {
  const int nv = static_cast<int>(values.size());
  // 0: undefined, 1: outer, 2: body
  std::vector<int> defined(nv, 0);
  auto check_id = [&](int32_t v, const std::string& where) {
    if (v < 0 || v >= nv) {
      throw TraceError(fmt::format("{}: value id {} out of range [0, {})", where, v, nv));
    }
  };
  for (int v = 0; v < nv; ++v) {
    switch (values[v].kind) {
      case ValueKind::StepInput:
        defined[v] = 1;
        break;
      case ValueKind::Literal:
        defined[v] = 3;
        break;  // usable anywhere
      case ValueKind::LoopInvariant:
      case ValueKind::LoopMicrobatch:
        defined[v] = 2;
        break;
      case ValueKind::Intermediate:
        break;
    }
  }
  for (const LoopInput& in : loop_inputs) {
    check_id(in.body, "loop input");
    check_id(in.outer, "loop input");
    ValueKind k = values[in.body].kind;
    if (k != ValueKind::LoopInvariant && k != ValueKind::LoopMicrobatch) {
      throw TraceError(
          fmt::format("loop input %{} is not a loop-invariant or per-microbatch value", in.body));
    }
  }
  Region last = Region::Pre;
  std::vector<int> fwd_markers;
  for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
    const Op& op = ops[i];
    if (static_cast<int>(op.region) < static_cast<int>(last)) {
      throw TraceError(fmt::format("{}: {} op after a {} op", op_label(*this, i),
                                   region_name(op.region), region_name(last)));
    }
    if (op.region == Region::Post && last != Region::Post) {
      // Loop outputs become defined when the loop ends.
      for (const LoopOutput& out : loop_outputs) {
        check_id(out.outer, "loop output");
        check_id(out.body, "loop output");
        if (defined[out.body] == 0) {
          throw TraceError(fmt::format("loop output %{} is never defined in the loop", out.body));
        }
        defined[out.outer] = 1;
      }
    }
    last = op.region;
    const int want = op.region == Region::Loop ? 2 : 1;
    for (int32_t v : op.inputs) {
      check_id(v, op_label(*this, i));
      if (defined[v] != want && defined[v] != 3) {
        throw TraceError(fmt::format("{}: input %{} is not defined before use in the {} region",
                                     op_label(*this, i), v, region_name(op.region)));
      }
    }
    for (int32_t v : op.outputs) {
      check_id(v, op_label(*this, i));
      if (defined[v] != 0 || values[v].kind != ValueKind::Intermediate) {
        throw TraceError(fmt::format("{}: output %{} assigned twice", op_label(*this, i), v));
      }
      defined[v] = want;
    }
    if (op.kind == OpKind::Boundary) {
      if (op.region != Region::Loop) {
        throw TraceError(fmt::format(
            "{}: stage_boundary outside baton.accumulate; boundaries must be inside the "
            "microbatch loop",
            op_label(*this, i)));
      }
      if (op.inputs.size() != op.outputs.size()) {
        throw TraceError(fmt::format("{}: boundary with {} inputs and {} outputs",
                                     op_label(*this, i), op.inputs.size(), op.outputs.size()));
      }
      if (!op.backward) fwd_markers.push_back(op.boundary);
    }
  }
  if (last != Region::Post) {
    for (const LoopOutput& out : loop_outputs) {
      check_id(out.outer, "loop output");
      check_id(out.body, "loop output");
      defined[out.outer] = 1;
    }
  }
  for (int k = 0; k < static_cast<int>(fwd_markers.size()); ++k) {
    if (fwd_markers[k] != k) {
      throw TraceError(fmt::format(
          "forward stage_boundary markers must be numbered 0..{} in program order; marker {} "
          "has index {}",
          fwd_markers.size() - 1, k, fwd_markers[k]));
    }
  }
  for (int32_t v : step_outputs) {
    check_id(v, "step output");
    if (defined[v] != 1 && defined[v] != 3) {
      throw TraceError(fmt::format("step output %{} is not an outer value", v));
    }
  }
}

std::string Program::to_text() const {
  std::string out;
  auto vals = [](const std::vector<int32_t>& vs) {
    std::string s;
    for (size_t i = 0; i < vs.size(); ++i) s += fmt::format("{}%{}", i ? " " : "", vs[i]);
    return s;
  };
  for (const LoopInput& in : loop_inputs) {
    out +=
        fmt::format("loop input %{} <- %{} ({})\n", in.body, in.outer,
                    values[in.body].kind == ValueKind::LoopInvariant ? "invariant" : "microbatch");
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    std::string name = op.name;
    if (op.kind == OpKind::Boundary) {
      name = fmt::format("{}[{}{}]", op.name, op.backward ? "bwd " : "", op.boundary);
    }
    out += fmt::format("#{} {} = {} {}  [{}]\n", i, vals(op.outputs), name, vals(op.inputs),
                       region_name(op.region));
  }
  for (const LoopOutput& o : loop_outputs) {
    const char* r = o.reduce == Reduce::Sum ? "sum" : o.reduce == Reduce::Mean ? "mean" : "stack";
    out += fmt::format("loop output %{} -> %{} ({})\n", o.body, o.outer, r);
  }
  out += fmt::format("step outputs {}\n", vals(step_outputs));
  return out;
}

int32_t count_stages(const Program& program) {
  int32_t n = 0;
  for (const Op& op : program.ops) {
    if (op.kind == OpKind::Boundary && !op.backward) ++n;
  }
  return program.loop_outputs.empty() && program.loop_inputs.empty() ? 0 : n + 1;
}

}  // namespace baton
