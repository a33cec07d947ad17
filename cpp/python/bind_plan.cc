// Bindings of lowering and verification: buffer kinds and keys, instructions,
// Plan (lower), and the verifier with its report. Thin: conversion only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "baton/plan.h"
#include "baton/verify.h"
#include "bind_planner.h"

namespace baton::python {

using namespace nb::literals;

namespace {

using InstrTuple = std::tuple<std::string, int, int, int>;

}  // namespace

void bind_plan(nb::module_& m) {
  // Arithmetic: ordered as the plan numbers kinds (Act < Grad < ... < SkipGrad), so
  // buffer keys (kind, stage, microbatch) sort, and key the pytrees of the traced loop.
  nb::enum_<baton::BufKind>(m, "BufKind", nb::is_arithmetic(),
                            "A plan buffer's kind (plan.h), ordered as the plan numbers them.")
      .value("Act", baton::BufKind::Act)
      .value("Grad", baton::BufKind::Grad)
      .value("Stash", baton::BufKind::Stash)
      .value("WStash", baton::BufKind::WStash)
      .value("WGrad", baton::BufKind::WGrad)
      .value("Skip", baton::BufKind::Skip)
      .value("SkipGrad", baton::BufKind::SkipGrad);

  nb::class_<baton::SkipEdge>(m, "SkipEdge", "A transfer from stage src to stage dst > src + 1.")
      .def(
          "__init__",
          [](baton::SkipEdge* e, int from, int to, bool forward, bool backward) {
            new (e) baton::SkipEdge{from, to, forward, backward};
          },
          "src"_a, "dst"_a, "forward"_a = true, "backward"_a = true)
      .def_rw("src", &baton::SkipEdge::from)
      .def_rw("dst", &baton::SkipEdge::to)
      .def_rw("forward", &baton::SkipEdge::forward)
      .def_rw("backward", &baton::SkipEdge::backward)
      .def(
          "__eq__", [](const baton::SkipEdge& a, const baton::SkipEdge& b) { return a == b; },
          nb::is_operator())
      .def("__repr__", [](const baton::SkipEdge& e) {
        return "SkipEdge(" + std::to_string(e.from) + ", " + std::to_string(e.to) +
               (e.forward && e.backward ? ""
                : e.forward             ? ", forward only"
                                        : ", backward only") +
               ")";
      });

  nb::enum_<baton::OpCode>(m, "OpCode")
      .value("RUN", baton::OpCode::Run)
      .value("SEND", baton::OpCode::Send)
      .value("RECV", baton::OpCode::Recv)
      .value("FREE", baton::OpCode::Free)
      .value("ACCUMULATE", baton::OpCode::Accumulate);

  nb::class_<baton::BufferKey>(m, "BufferKey")
      .def(nb::init<>())
      .def(
          "__init__",
          [](baton::BufferKey* k, baton::BufKind kind, int stage, int microbatch) {
            new (k) baton::BufferKey{kind, stage, microbatch};
          },
          "kind"_a, "stage"_a, "microbatch"_a)
      .def_rw("kind", &baton::BufferKey::kind)
      .def_rw("stage", &baton::BufferKey::stage)
      .def_rw("microbatch", &baton::BufferKey::microbatch)
      .def(
          "__eq__", [](const baton::BufferKey& a, const baton::BufferKey& b) { return a == b; },
          nb::is_operator())
      .def("__repr__", [](const baton::BufferKey& k) {
        return std::string("BufferKey(") + baton::buf_kind_name(k.kind) +
               ", stage=" + std::to_string(k.stage) +
               ", microbatch=" + std::to_string(k.microbatch) + ")";
      });

  nb::class_<baton::Instr>(m, "Instr", "One instruction of a rank's program.")
      .def(nb::init<>())
      .def_rw("op", &baton::Instr::op)
      .def_rw("action", &baton::Instr::action)
      .def_rw("buffer", &baton::Instr::buffer)
      .def_rw("peer", &baton::Instr::peer)
      .def_prop_ro("opcode",
                   [](const baton::Instr& i) { return std::string(baton::opcode_name(i.op)); })
      .def("astuple",
           [](const baton::Instr& i) {
             return InstrTuple{baton::opcode_name(i.op), i.action, i.buffer, i.peer};
           })
      .def(
          "__eq__", [](const baton::Instr& a, const baton::Instr& b) { return a == b; },
          nb::is_operator())
      .def("__repr__", [](const baton::Instr& i) {
        return std::string("Instr(") + baton::opcode_name(i.op) +
               ", action=" + std::to_string(i.action) + ", buffer=" + std::to_string(i.buffer) +
               ", peer=" + std::to_string(i.peer) + ")";
      });

  nb::class_<baton::Plan>(m, "Plan", "A schedule lowered to per-rank instruction streams.")
      .def_ro("schedule", &baton::Plan::schedule)
      .def_ro("skips", &baton::Plan::skips)
      .def_ro("programs", &baton::Plan::programs)
      .def_prop_ro("num_ranks",
                   [](const baton::Plan& p) { return static_cast<int>(p.programs.size()); })
      .def(
          "program",
          [](const baton::Plan& p, int rank) {
            check_rank(p.schedule, rank);
            std::vector<InstrTuple> out;
            out.reserve(p.programs[rank].size());
            for (const auto& i : p.programs[rank]) {
              out.emplace_back(baton::opcode_name(i.op), i.action, i.buffer, i.peer);
            }
            return out;
          },
          "rank"_a, "The rank's program as (opcode, action, buffer, peer) tuples.")
      .def("buffer_id", &baton::Plan::buffer_id, "key"_a)
      .def(
          "buffer_id",
          [](const baton::Plan& p, baton::BufKind kind, int stage, int microbatch) {
            return p.buffer_id(baton::BufferKey{kind, stage, microbatch});
          },
          "kind"_a, "stage"_a, "microbatch"_a)
      .def("buffer_key", &baton::Plan::buffer_key, "id"_a)
      .def("num_buffer_ids", &baton::Plan::num_buffer_ids)
      // Rows of the dense buffer ids (plan.h: id = row * M + microbatch, one row per
      // (kind, stage or skip edge)): the unit of rank-IR pools and ring layouts.
      .def(
          "num_buffer_rows",
          [](const baton::Plan& p) {
            return p.schedule.num_microbatches > 0
                       ? p.num_buffer_ids() / p.schedule.num_microbatches
                       : 0;
          },
          "The number of buffer rows (one per kind and stage or skip edge).")
      .def(
          "buffer_row",
          [](const baton::Plan& p, int32_t id) {
            p.buffer_key(id);  // range check, with the error naming the id
            return id / p.schedule.num_microbatches;
          },
          "id"_a, "The row of buffer `id` (its kind and stage, every microbatch).")
      .def(
          "row_key",
          [](const baton::Plan& p, int32_t row) {
            return p.buffer_key(row * p.schedule.num_microbatches);
          },
          "row"_a, "The key of a row's microbatch-0 buffer (its kind and stage).")
      .def("channel", &baton::Plan::channel, "id"_a,
           "The ordered channel a transfer of buffer `id` travels on (its kind for act .. "
           "wgrad, 5 + e for skip edge e, 5 + E + e for its gradient).")
      .def("producer_rank", &baton::Plan::producer_rank, "id"_a)
      .def("consumer_rank", &baton::Plan::consumer_rank, "id"_a)
      .def("task_inputs", &baton::Plan::task_inputs, "task"_a)
      .def("task_outputs", &baton::Plan::task_outputs, "task"_a)
      .def("action_inputs", &baton::Plan::action_inputs, "action"_a)
      .def("action_outputs", &baton::Plan::action_outputs, "action"_a)
      .def(
          "receive_posts",
          [](const baton::Plan& p, int rank) {
            check_rank(p.schedule, rank);
            return p.receive_posts(rank);
          },
          "rank"_a,
          "Per instruction of the rank's program: for a RECV, the index of the "
          "instruction before which it is posted (the last RUN before it); -1 otherwise.")
      .def(
          "describe",
          [](const baton::Plan& p, int rank, int index) {
            check_rank(p.schedule, rank);
            if (index < 0 || index >= static_cast<int>(p.programs[rank].size())) {
              throw nb::index_error(("instruction " + std::to_string(index) +
                                     " out of range on rank " + std::to_string(rank))
                                        .c_str());
            }
            return p.describe(rank, index);
          },
          "rank"_a, "index"_a)
      .def("describe_buffer", &baton::Plan::describe_buffer, "id"_a)
      .def("to_text", &baton::Plan::to_text)
      .def("fingerprint", &baton::Plan::fingerprint)
      .def("__repr__", [](const baton::Plan& p) {
        return "Plan(schedule='" + p.schedule.name +
               "', ranks=" + std::to_string(p.programs.size()) +
               ", fingerprint=" + p.fingerprint() + ")";
      });

  m.def("lower", &baton::lower, "schedule"_a, "skips"_a = std::vector<baton::SkipEdge>{});
  m.def("buf_kind_name", [](baton::BufKind k) { return std::string(baton::buf_kind_name(k)); });
  m.def("opcode_name", [](baton::OpCode op) { return std::string(baton::opcode_name(op)); });
}

void bind_verify(nb::module_& m) {
  nb::enum_<baton::CommModel>(m, "CommModel")
      .value("Blocking", baton::CommModel::Blocking)
      .value("Fifo", baton::CommModel::Fifo);

  nb::class_<baton::Violation>(m, "Violation", "One failed check of the verifier.")
      .def(nb::init<>())
      .def_rw("check", &baton::Violation::check)
      .def_rw("message", &baton::Violation::message)
      .def_rw("ranks", &baton::Violation::ranks)
      .def_rw("instrs", &baton::Violation::instrs)
      .def_rw("stage", &baton::Violation::stage)
      .def_rw("microbatch", &baton::Violation::microbatch)
      .def("__repr__", [](const baton::Violation& v) {
        return "Violation(" + v.check + ": " + v.message + ")";
      });

  nb::class_<baton::VerifyReport>(m, "VerifyReport", "Result of verifying a plan.")
      .def(nb::init<>())
      .def_rw("violations", &baton::VerifyReport::violations)
      .def_prop_ro("ok", &baton::VerifyReport::ok)
      .def("to_string", &baton::VerifyReport::to_string)
      .def("__bool__", &baton::VerifyReport::ok)
      .def("__str__", &baton::VerifyReport::to_string)
      .def("__repr__", [](const baton::VerifyReport& r) {
        return "VerifyReport(ok=" + std::string(r.ok() ? "True" : "False") +
               ", violations=" + std::to_string(r.violations.size()) + ")";
      });

  m.def("verify", &baton::verify, "plan"_a);
  m.def("check_deadlock", &baton::check_deadlock, "plan"_a, "model"_a);
  m.def("verify_or_throw", &baton::verify_or_throw, "plan"_a);
}

}  // namespace baton::python
