// Bindings of the program IR and the graph passes (graph.h). Conversion only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <exception>
#include <string>
#include <vector>

#include "baton/graph.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

void translate_trace_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const baton::TraceError& e) {
    nb::object cls = nb::module_::import_("baton.errors").attr("TraceError");
    PyErr_SetString(cls.ptr(), e.what());
  }
}

std::string kind_str(baton::TaskKind k) { return std::string(1, baton::task_kind_char(k)); }

std::vector<std::pair<int32_t, std::vector<int32_t>>> skip_pairs(
    const std::vector<baton::SkipValues>& es) {
  std::vector<std::pair<int32_t, std::vector<int32_t>>> out;
  for (const auto& e : es) out.emplace_back(e.edge, e.values);
  return out;
}

}  // namespace

void init_graph(nb::module_& m) {
  nb::module_ g = m.def_submodule("graph", "Program IR of a traced step and its passes");
  nb::enum_<baton::ValueKind>(g, "ValueKind")
      .value("Intermediate", baton::ValueKind::Intermediate)
      .value("StepInput", baton::ValueKind::StepInput)
      .value("Literal", baton::ValueKind::Literal)
      .value("LoopInvariant", baton::ValueKind::LoopInvariant)
      .value("LoopMicrobatch", baton::ValueKind::LoopMicrobatch);
  nb::enum_<baton::Region>(g, "Region")
      .value("Pre", baton::Region::Pre)
      .value("Loop", baton::Region::Loop)
      .value("Post", baton::Region::Post);
  nb::enum_<baton::OpKind>(g, "OpKind")
      .value("Compute", baton::OpKind::Compute)
      .value("Boundary", baton::OpKind::Boundary)
      .value("AddAny", baton::OpKind::AddAny);
  nb::enum_<baton::Reduce>(g, "Reduce")
      .value("Sum", baton::Reduce::Sum)
      .value("Mean", baton::Reduce::Mean)
      .value("Stack", baton::Reduce::Stack);

  nb::class_<baton::Program>(g, "Program")
      .def(nb::init<>())
      .def(
          "add_value",
          [](baton::Program& p, baton::ValueKind kind, std::vector<int64_t> shape,
             std::string dtype, int64_t bytes) {
            baton::Value v;
            v.kind = kind;
            v.shape = std::move(shape);
            v.dtype = std::move(dtype);
            v.bytes = bytes;
            return p.add_value(std::move(v));
          },
          "kind"_a, "shape"_a, "dtype"_a, "bytes"_a)
      .def(
          "add_op",
          [](baton::Program& p, baton::OpKind kind, baton::Region region, std::string name,
             std::vector<int32_t> inputs, std::vector<int32_t> outputs, double cost,
             int32_t boundary, bool backward) {
            baton::Op op;
            op.kind = kind;
            op.region = region;
            op.name = std::move(name);
            op.inputs = std::move(inputs);
            op.outputs = std::move(outputs);
            op.cost = cost;
            op.boundary = boundary;
            op.backward = backward;
            return p.add_op(std::move(op));
          },
          "kind"_a, "region"_a, "name"_a, "inputs"_a, "outputs"_a, "cost"_a = 0.0,
          "boundary"_a = -1, "backward"_a = false)
      .def(
          "add_loop_input",
          [](baton::Program& p, int32_t body, int32_t outer) {
            p.loop_inputs.push_back({body, outer});
          },
          "body"_a, "outer"_a)
      .def(
          "add_loop_output",
          [](baton::Program& p, int32_t body, int32_t outer, baton::Reduce r) {
            p.loop_outputs.push_back({body, outer, r});
          },
          "body"_a, "outer"_a, "reduce"_a)
      .def_rw("step_outputs", &baton::Program::step_outputs)
      .def_rw("num_primal_outputs", &baton::Program::num_primal_outputs,
              "Leading loop outputs that are primal (loss, aux); -1 when unknown.")
      .def_prop_ro("num_values", [](const baton::Program& p) { return p.values.size(); })
      .def_prop_ro("num_ops", [](const baton::Program& p) { return p.ops.size(); })
      .def("value_bytes", [](const baton::Program& p, int v) { return p.values.at(v).bytes; })
      .def("validate", &baton::Program::validate)
      .def("to_text", &baton::Program::to_text);

  nb::class_<baton::OutputPart>(g, "OutputPart")
      .def_ro("body", &baton::OutputPart::body)
      .def_ro("outer", &baton::OutputPart::outer)
      .def_ro("reduce", &baton::OutputPart::reduce)
      .def_ro("stage", &baton::OutputPart::stage)
      .def_prop_ro("task", [](const baton::OutputPart& o) { return kind_str(o.task); });

  nb::class_<baton::TaskBody>(g, "TaskBody")
      .def_prop_ro("kind", [](const baton::TaskBody& t) { return kind_str(t.kind); })
      .def_ro("stage", &baton::TaskBody::stage)
      .def_ro("ops", &baton::TaskBody::ops)
      .def_ro("act_in", &baton::TaskBody::act_in)
      .def_ro("grad_in", &baton::TaskBody::grad_in)
      .def_ro("stash_in", &baton::TaskBody::stash_in)
      .def_ro("wstash_in", &baton::TaskBody::wstash_in)
      .def_ro("invariant_in", &baton::TaskBody::invariant_in)
      .def_ro("microbatch_in", &baton::TaskBody::microbatch_in)
      .def_ro("act_out", &baton::TaskBody::act_out)
      .def_ro("grad_out", &baton::TaskBody::grad_out)
      .def_ro("stash_out", &baton::TaskBody::stash_out)
      .def_ro("wstash_out", &baton::TaskBody::wstash_out)
      .def_ro("wgrad_out", &baton::TaskBody::wgrad_out)
      .def_ro("mb_out", &baton::TaskBody::mb_out)
      // skip edges as [(edge index, value ids)], see Partition.skips
      .def_prop_ro("skip_in", [](const baton::TaskBody& t) { return skip_pairs(t.skip_in); })
      .def_prop_ro("skip_out", [](const baton::TaskBody& t) { return skip_pairs(t.skip_out); })
      .def_prop_ro("skip_grad_in",
                   [](const baton::TaskBody& t) { return skip_pairs(t.skip_grad_in); })
      .def_prop_ro("skip_grad_out",
                   [](const baton::TaskBody& t) { return skip_pairs(t.skip_grad_out); })
      .def_ro("cost", &baton::TaskBody::cost);

  nb::class_<baton::Partition>(g, "Partition")
      .def_ro("num_stages", &baton::Partition::num_stages)
      .def_ro("split_backward", &baton::Partition::split_backward)
      .def_ro("skips", &baton::Partition::skips)
      .def_ro("tasks", &baton::Partition::tasks)
      .def_ro("parts", &baton::Partition::parts)
      .def_ro("op_stage", &baton::Partition::op_stage)
      .def("to_text", &baton::Partition::to_text, "program"_a);

  g.def("partition", &baton::partition, "program"_a, "split_backward"_a, "remat"_a = true);
  g.def("count_stages", &baton::count_stages, "program"_a);
  g.def(
      "is_cheap",
      [](const std::string& name) {
        baton::Op op;
        op.name = name;
        op.outputs = {0};
        return baton::is_recomputable(op);
      },
      "primitive"_a,
      "Whether a one-output equation of this primitive is cheap elementwise/shape work (what "
      "the stash rematerialization may recompute).");
  nb::register_exception_translator(&translate_trace_error);
}
