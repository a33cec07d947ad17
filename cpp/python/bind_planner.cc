// Bindings of the planner: schedule IR, generators, text format, cost model,
// lowering (Plan), verifier, simulator and renderers. Thin: conversion only.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "baton/autoplan.h"
#include "baton/cluster.h"
#include "baton/collectives.h"
#include "baton/hardware.h"
#include "baton/cost.h"
#include "baton/error.h"
#include "baton/generators.h"
#include "baton/plan.h"
#include "baton/render.h"
#include "baton/schedule.h"
#include "baton/sim.h"
#include "baton/text_format.h"
#include "baton/verify.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// Raises `cls_name` from baton.errors with `msg`; falls back to `fallback`
// when baton.errors cannot be imported (e.g. _core used on its own).
void raise_baton_error(const char* cls_name, PyObject* fallback, const char* msg, int line = 0,
                       int column = 0) {
  PyObject* errors = PyImport_ImportModule("baton.errors");
  PyObject* cls = errors ? PyObject_GetAttrString(errors, cls_name) : nullptr;
  Py_XDECREF(errors);
  if (cls == nullptr) {
    PyErr_Clear();
    PyErr_SetString(fallback, msg);
    return;
  }
  PyObject* exc = PyObject_CallFunction(cls, "s", msg);
  if (exc == nullptr) {  // constructor failed: report that error instead
    Py_DECREF(cls);
    return;
  }
  if (line > 0 || column > 0) {
    PyObject* l = PyLong_FromLong(line);
    PyObject* c = PyLong_FromLong(column);
    PyObject_SetAttrString(exc, "line", l);
    PyObject_SetAttrString(exc, "column", c);
    Py_XDECREF(l);
    Py_XDECREF(c);
    PyErr_Clear();  // attributes are best effort
  }
  PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
  Py_DECREF(cls);
}

void translate_baton_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const baton::ScheduleError& e) {
    raise_baton_error("ScheduleError", PyExc_ValueError, e.what());
  } catch (const baton::FormatError& e) {
    raise_baton_error("FormatError", PyExc_ValueError, e.what(), e.line, e.column);
  } catch (const baton::VerifyError& e) {
    raise_baton_error("VerifyError", PyExc_RuntimeError, e.what());
  } catch (const baton::ConfigError& e) {
    raise_baton_error("ConfigError", PyExc_ValueError, e.what());
  } catch (const baton::Error& e) {
    raise_baton_error("BatonError", PyExc_RuntimeError, e.what());
  }
  // Anything else propagates to the next translator.
}

std::string task_repr(const baton::Task& t) { return "Task(" + baton::to_string(t) + ")"; }

std::string action_repr(const baton::Action& a) { return "Action(" + baton::to_string(a) + ")"; }

void check_rank(const baton::Schedule& s, int rank) {
  if (rank < 0 || rank >= s.num_ranks) {
    throw nb::index_error(("rank " + std::to_string(rank) + " out of range (schedule has " +
                           std::to_string(s.num_ranks) + " ranks)")
                              .c_str());
  }
}

using InstrTuple = std::tuple<std::string, int, int, int>;

void bind_schedule(nb::module_& m) {
  nb::enum_<baton::TaskKind>(m, "TaskKind")
      .value("F", baton::TaskKind::F)
      .value("B", baton::TaskKind::B)
      .value("I", baton::TaskKind::I)
      .value("W", baton::TaskKind::W);

  nb::class_<baton::Task>(m, "Task", "One task: kind, stage, microbatch.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](baton::Task* t, baton::TaskKind kind, int stage, int microbatch) {
            new (t) baton::Task{kind, stage, microbatch};
          },
          "kind"_a, "stage"_a, "microbatch"_a)
      .def_rw("kind", &baton::Task::kind)
      .def_rw("stage", &baton::Task::stage)
      .def_rw("microbatch", &baton::Task::microbatch)
      .def("__str__", [](const baton::Task& t) { return baton::to_string(t); })
      .def("__repr__", &task_repr)
      .def(
          "__eq__", [](const baton::Task& a, const baton::Task& b) { return a == b; },
          nb::is_operator())
      .def("__hash__", [](const baton::Task& t) {
        return nb::hash(nb::make_tuple(static_cast<int>(t.kind), t.stage, t.microbatch));
      });

  nb::class_<baton::Action>(m, "Action", "A task, or two tasks fused into one unit.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](baton::Action* a, const baton::Task& first, const baton::Task* second) {
            new (a) baton::Action{};
            a->first = first;
            if (second != nullptr) a->second = *second;
          },
          "first"_a, "second"_a = nb::none())
      .def_rw("first", &baton::Action::first)
      .def_rw("second", &baton::Action::second)
      .def_prop_ro("is_fused", &baton::Action::is_fused)
      .def_prop_ro("tasks",
                   [](const baton::Action& a) {
                     std::vector<baton::Task> ts{a.first};
                     if (a.is_fused()) ts.push_back(a.second);
                     return ts;
                   })
      .def("__str__", [](const baton::Action& a) { return baton::to_string(a); })
      .def("__repr__", &action_repr)
      .def(
          "__eq__", [](const baton::Action& a, const baton::Action& b) { return a == b; },
          nb::is_operator());

  nb::class_<baton::Schedule>(m, "Schedule",
                              "Pipeline schedule: per-rank ordered actions and stage placement.")
      .def(nb::init<>())
      .def_rw("name", &baton::Schedule::name)
      .def_rw("num_ranks", &baton::Schedule::num_ranks)
      .def_rw("num_stages", &baton::Schedule::num_stages)
      .def_rw("num_microbatches", &baton::Schedule::num_microbatches)
      .def_rw("stage_rank", &baton::Schedule::stage_rank)
      .def_rw("rank_actions", &baton::Schedule::rank_actions)
      .def(
          "actions",
          [](const baton::Schedule& s, int rank) {
            check_rank(s, rank);
            std::vector<std::string> out;
            out.reserve(s.rank_actions[rank].size());
            for (const auto& a : s.rank_actions[rank]) out.push_back(baton::to_string(a));
            return out;
          },
          "rank"_a, "The rank's actions as strings, e.g. ['F0.0', 'F0.3+B7.1'].")
      .def("split_backward", &baton::Schedule::split_backward)
      .def(
          "stages_of_rank",
          [](const baton::Schedule& s, int rank) {
            check_rank(s, rank);
            return s.stages_of_rank(rank);
          },
          "rank"_a)
      .def("validate", &baton::Schedule::validate)
      .def(
          "__eq__", [](const baton::Schedule& a, const baton::Schedule& b) { return a == b; },
          nb::is_operator())
      .def("__repr__", [](const baton::Schedule& s) {
        return "Schedule(name='" + s.name + "', ranks=" + std::to_string(s.num_ranks) +
               ", stages=" + std::to_string(s.num_stages) +
               ", microbatches=" + std::to_string(s.num_microbatches) + ")";
      });

  m.def("task_kind_char",
        [](baton::TaskKind k) { return std::string(1, baton::task_kind_char(k)); });
  m.def("contiguous_placement", &baton::contiguous_placement, "ranks"_a);
  m.def("interleaved_placement", &baton::interleaved_placement, "ranks"_a, "virtual_stages"_a);
  m.def("v_placement", &baton::v_placement, "ranks"_a);

  // Generators.
  m.def("make_schedule", &baton::make_schedule, "name"_a, "ranks"_a, "microbatches"_a,
        "virtual_stages"_a = 1);
  m.def("schedule_names", &baton::schedule_names);
  m.def("gpipe", &baton::gpipe, "ranks"_a, "microbatches"_a);
  m.def("one_f_one_b", &baton::one_f_one_b, "ranks"_a, "microbatches"_a);
  m.def("eager_one_f_one_b", &baton::eager_one_f_one_b, "ranks"_a, "microbatches"_a);
  m.def("interleaved_one_f_one_b", &baton::interleaved_one_f_one_b, "ranks"_a, "microbatches"_a,
        "virtual_stages"_a);
  m.def("zb_h1", &baton::zb_h1, "ranks"_a, "microbatches"_a);
  m.def("zb_h2", &baton::zb_h2, "ranks"_a, "microbatches"_a);
  m.def("zb_v", &baton::zb_v, "ranks"_a, "microbatches"_a);
  m.def("dualpipe_v", &baton::dualpipe_v, "ranks"_a, "microbatches"_a);
  m.def("fuse_forward_backward", &baton::fuse_forward_backward, "schedule"_a,
        "The schedule with each last-stage F(s,m) directly followed by B(s,m) on its rank "
        "fused into one action F+B (its stash then lives inside the action).");

  // Text format.
  m.def("save_schedule", &baton::save_schedule, "schedule"_a);
  m.def("load_schedule", &baton::load_schedule, "text"_a);
}

void bind_cost(nb::module_& m) {
  const baton::StageCost dflt;
  nb::class_<baton::StageCost>(m, "StageCost", "Per-stage time and memory costs.")
      .def(
          "__init__",
          [](baton::StageCost* c, double f, double b, double i, double w, int64_t stash_bytes,
             int64_t wstash_bytes, int64_t act_bytes, int64_t grad_bytes, int64_t wgrad_bytes,
             double fb) {
            new (c) baton::StageCost{};
            c->f = f;
            c->b = b;
            c->i = i;
            c->w = w;
            c->fb = fb;
            c->stash_bytes = stash_bytes;
            c->wstash_bytes = wstash_bytes;
            c->act_bytes = act_bytes;
            c->grad_bytes = grad_bytes;
            c->wgrad_bytes = wgrad_bytes;
          },
          "f"_a = dflt.f, "b"_a = dflt.b, "i"_a = dflt.i, "w"_a = dflt.w,
          "stash_bytes"_a = dflt.stash_bytes, "wstash_bytes"_a = dflt.wstash_bytes,
          "act_bytes"_a = dflt.act_bytes, "grad_bytes"_a = dflt.grad_bytes,
          "wgrad_bytes"_a = dflt.wgrad_bytes, "fb"_a = dflt.fb)
      .def_rw("fb", &baton::StageCost::fb)
      .def_rw("f", &baton::StageCost::f)
      .def_rw("b", &baton::StageCost::b)
      .def_rw("i", &baton::StageCost::i)
      .def_rw("w", &baton::StageCost::w)
      .def_rw("stash_bytes", &baton::StageCost::stash_bytes)
      .def_rw("wstash_bytes", &baton::StageCost::wstash_bytes)
      .def_rw("act_bytes", &baton::StageCost::act_bytes)
      .def_rw("grad_bytes", &baton::StageCost::grad_bytes)
      .def_rw("wgrad_bytes", &baton::StageCost::wgrad_bytes)
      .def(
          "__eq__", [](const baton::StageCost& a, const baton::StageCost& b) { return a == b; },
          nb::is_operator())
      .def("__repr__", [](const baton::StageCost& c) {
        return "StageCost(f=" + fmt::format("{}", c.f) + ", b=" + fmt::format("{}", c.b) +
               ", i=" + fmt::format("{}", c.i) + ", w=" + fmt::format("{}", c.w) + ")";
      });

  nb::class_<baton::LinkCost>(m, "LinkCost", "Latency and bandwidth of every rank pair.")
      .def(
          "__init__",
          [](baton::LinkCost* l, double latency, double bandwidth) {
            new (l) baton::LinkCost{latency, bandwidth};
          },
          "latency"_a = 0.0, "bandwidth"_a = 0.0)
      .def_rw("latency", &baton::LinkCost::latency)
      .def_rw("bandwidth", &baton::LinkCost::bandwidth)
      .def(
          "__eq__", [](const baton::LinkCost& a, const baton::LinkCost& b) { return a == b; },
          nb::is_operator());

  nb::class_<baton::SkipCost>(m, "SkipCost", "Bytes per microbatch of a skip edge's transfers.")
      .def(
          "__init__",
          [](baton::SkipCost* c, int from, int to, int64_t act_bytes, int64_t grad_bytes) {
            new (c) baton::SkipCost{from, to, act_bytes, grad_bytes};
          },
          "src"_a, "dst"_a, "act_bytes"_a = 0, "grad_bytes"_a = 0)
      .def_rw("src", &baton::SkipCost::from)
      .def_rw("dst", &baton::SkipCost::to)
      .def_rw("act_bytes", &baton::SkipCost::act_bytes)
      .def_rw("grad_bytes", &baton::SkipCost::grad_bytes)
      .def(
          "__eq__", [](const baton::SkipCost& a, const baton::SkipCost& b) { return a == b; },
          nb::is_operator());

  nb::class_<baton::CostModel>(m, "CostModel", "Cost and memory model used by the simulator.")
      .def(nb::init<>())
      .def_rw("default_stage", &baton::CostModel::default_stage)
      .def_rw("stages", &baton::CostModel::stages)
      .def_rw("skips", &baton::CostModel::skips)
      .def_rw("link", &baton::CostModel::link)
      .def_rw("fused_factor", &baton::CostModel::fused_factor)
      .def(
          "stage", [](const baton::CostModel& c, int s) { return c.stage(s); }, "stage"_a)
      .def("validate", &baton::CostModel::validate)
      .def_static("from_json", &baton::CostModel::from_json, "text"_a)
      .def("to_json", &baton::CostModel::to_json)
      .def_static("uniform", &baton::CostModel::uniform, "f"_a, "b"_a, "i"_a, "w"_a)
      .def("__repr__", [](const baton::CostModel& c) { return "CostModel(" + c.to_json() + ")"; });
}

void bind_plan(nb::module_& m) {
  nb::enum_<baton::BufKind>(m, "BufKind")
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

// Per-rank first start / last end, bound when the simulator layer has them.
template <class R>
void bind_spans(nb::class_<R>& cls) {
  if constexpr (requires(R r) {
                  r.span_start;
                  r.span_end;
                }) {
    cls.def_ro("span_start", &R::span_start).def_ro("span_end", &R::span_end);
  }
}

void bind_sim(nb::module_& m) {
  nb::class_<baton::RunEvent>(m, "RunEvent")
      .def_ro("rank", &baton::RunEvent::rank)
      .def_ro("instr", &baton::RunEvent::instr)
      .def_ro("action", &baton::RunEvent::action)
      .def_ro("start", &baton::RunEvent::start)
      .def_ro("end", &baton::RunEvent::end)
      .def("__repr__", [](const baton::RunEvent& e) {
        return "RunEvent(rank=" + std::to_string(e.rank) + ", instr=" + std::to_string(e.instr) +
               ", action=" + std::to_string(e.action) + ", start=" + std::to_string(e.start) +
               ", end=" + std::to_string(e.end) + ")";
      });

  nb::class_<baton::TransferEvent>(m, "TransferEvent")
      .def_ro("src", &baton::TransferEvent::src)
      .def_ro("dst", &baton::TransferEvent::dst)
      .def_ro("buffer", &baton::TransferEvent::buffer)
      .def_ro("send_instr", &baton::TransferEvent::send_instr)
      .def_ro("recv_instr", &baton::TransferEvent::recv_instr)
      .def_ro("posted", &baton::TransferEvent::posted)
      .def_ro("start", &baton::TransferEvent::start)
      .def_ro("end", &baton::TransferEvent::end)
      .def_ro("bytes", &baton::TransferEvent::bytes);

  nb::class_<baton::MemorySample>(m, "MemorySample")
      .def_ro("time", &baton::MemorySample::time)
      .def_ro("activation", &baton::MemorySample::activation)
      .def_ro("total", &baton::MemorySample::total);

  nb::class_<baton::CriticalStep>(m, "CriticalStep")
      .def_ro("rank", &baton::CriticalStep::rank)
      .def_ro("instr", &baton::CriticalStep::instr)
      .def_ro("start", &baton::CriticalStep::start)
      .def_ro("end", &baton::CriticalStep::end)
      .def_ro("what", &baton::CriticalStep::what)
      .def("__repr__", [](const baton::CriticalStep& c) {
        return "CriticalStep(" + c.what + ", rank=" + std::to_string(c.rank) + ")";
      });

  auto sim = nb::class_<baton::SimResult>(m, "SimResult", "Result of simulating a plan.")
                 .def_ro("step_time", &baton::SimResult::step_time)
                 .def_ro("busy", &baton::SimResult::busy)
                 .def_ro("bubble", &baton::SimResult::bubble)
                 .def_ro("bubble_fraction", &baton::SimResult::bubble_fraction)
                 .def_ro("runs", &baton::SimResult::runs)
                 .def_ro("transfers", &baton::SimResult::transfers)
                 .def_ro("peak_activation", &baton::SimResult::peak_activation)
                 .def_ro("peak_total", &baton::SimResult::peak_total)
                 .def_ro("memory", &baton::SimResult::memory)
                 .def_ro("critical_path", &baton::SimResult::critical_path);
  bind_spans(sim);
  sim.def("__repr__", [](const baton::SimResult& r) {
    return "SimResult(step_time=" + fmt::format("{}", r.step_time) +
           ", bubble_fraction=" + fmt::format("{}", r.bubble_fraction) + ")";
  });

  m.def(
      "simulate",
      [](const baton::Plan& plan, const baton::CostModel& costs, bool early_receives) {
        baton::SimOptions o;
        o.early_receives = early_receives;
        return baton::simulate(plan, costs, o);
      },
      "plan"_a, "costs"_a, "early_receives"_a = true,
      "Runs the plan's programs on the cost model. early_receives: post each RECV when its "
      "rank reaches the RUN before it, as the runtime does (False: at the RECV, as NCCL).");

  m.def("to_chrome_trace", &baton::to_chrome_trace, "plan"_a, "result"_a,
        "time_unit_us"_a = 1000.0);
  m.def("to_svg", &baton::to_svg, "plan"_a, "result"_a);
  m.def("to_text_grid", &baton::to_text_grid, "plan"_a, "result"_a, "width"_a = 0);
  m.def(
      "summary_table",
      [](const baton::Plan& p, const baton::SimResult& r, const baton::VerifyReport* report) {
        return baton::summary_table(p, r, report);
      },
      "plan"_a, "result"_a, "report"_a = nb::none());
}

// Automatic planning: JSON in, plain dicts out (the Python side formats them).
nb::dict candidate_dict(const baton::PlanCandidate& p) {
  nb::dict d;
  d["schedule"] = p.schedule;
  d["virtual_stages"] = p.virtual_stages;
  d["microbatches"] = p.microbatches;
  d["cuts"] = p.cuts;
  std::vector<std::string> rm;
  for (baton::Remat x : p.remat) rm.emplace_back(baton::remat_name(x));
  d["remat"] = rm;
  d["step_time"] = p.step_time;
  d["bubble_fraction"] = p.bubble_fraction;
  d["peak_memory"] = p.peak_memory;
  d["fits"] = p.fits;
  return d;
}

void bind_autoplan(nb::module_& m) {
  m.def(
      "autoplan",
      [](const std::string& segments_json, int ranks, int64_t memory, int top,
         std::optional<std::vector<std::string>> families,
         std::optional<std::vector<int>> microbatches,
         std::optional<std::vector<std::string>> remat,
         std::optional<std::vector<int>> interleaved_v, int max_microbatches, double gap,
         int64_t node_budget, bool update_in_place) {
        baton::SegmentCosts costs = baton::SegmentCosts::from_json(segments_json);
        baton::AutoplanOptions o;
        o.ranks = ranks;
        o.memory = memory;
        o.top = top;
        if (families) o.families = *families;
        if (microbatches) o.microbatches = *microbatches;
        if (remat)
          for (const auto& r : *remat) o.remat_modes.push_back(baton::parse_remat(r));
        if (interleaved_v) o.interleaved_v = *interleaved_v;
        o.max_microbatches = max_microbatches;
        o.gap = gap;
        o.node_budget = node_budget;
        o.update_in_place = update_in_place;
        baton::AutoplanResult r;
        {
          nb::gil_scoped_release release;
          r = baton::autoplan(costs, o);
        }
        nb::list plans;
        for (const baton::PlanCandidate& p : r.plans) plans.append(candidate_dict(p));
        nb::dict stats;
        stats["configurations"] = r.stats.configurations;
        stats["refused"] = r.stats.refused;
        stats["partitions"] = r.stats.partitions;
        stats["candidates"] = r.stats.candidates;
        stats["simulated"] = r.stats.simulated;
        stats["pruned"] = r.stats.pruned;
        stats["seconds"] = r.stats.seconds;
        stats["exact"] = r.stats.exact;
        stats["gap"] = r.stats.gap;
        return nb::make_tuple(plans, stats);
      },
      "segments_json"_a, "ranks"_a, "memory"_a = 0, "top"_a = 10, "families"_a = nb::none(),
      "microbatches"_a = nb::none(), "remat"_a = nb::none(), "interleaved_v"_a = nb::none(),
      "max_microbatches"_a = 0, "gap"_a = 0.0, "node_budget"_a = 20000, "update_in_place"_a = false,
      "Searches stage cuts x schedule x microbatches x per-stage remat for the segment costs "
      "(JSON, autoplan.h). Returns (plans, stats): plans best first, each a dict with schedule, "
      "virtual_stages, microbatches, cuts, remat, step_time, bubble_fraction, peak_memory, fits. "
      "memory: bytes per rank (0: unlimited). node_budget: DFS nodes per configuration (0: no "
      "limit, exact); stats says whether the result is exact, else its certified gap. "
      "update_in_place: the update after the loop writes the new parameters and optimizer "
      "state in place (a donating step); otherwise they count beside the old ones. Raises "
      "ConfigError when nothing fits.");
  m.def(
      "autoplan_evaluate",
      [](const std::string& segments_json, const std::string& schedule, int ranks,
         int virtual_stages, int microbatches, const std::vector<int>& cuts,
         const std::vector<std::string>& remat, int64_t memory, bool update_in_place) {
        baton::SegmentCosts costs = baton::SegmentCosts::from_json(segments_json);
        std::vector<baton::Remat> rm;
        for (const auto& r : remat) rm.push_back(baton::parse_remat(r));
        return candidate_dict(baton::evaluate_candidate(costs, schedule, ranks, virtual_stages,
                                                        microbatches, cuts, rm, memory,
                                                        update_in_place));
      },
      "segments_json"_a, "schedule"_a, "ranks"_a, "virtual_stages"_a, "microbatches"_a, "cuts"_a,
      "remat"_a, "memory"_a = 0, "update_in_place"_a = false,
      "One candidate (given cuts and remat per stage) simulated: the dict autoplan returns.");
  m.def("parse_bytes", &baton::parse_bytes, "text"_a);
}

// Cluster planning (cluster.h): JSON texts in, the result's JSON text out.
void bind_cluster(nb::module_& m) {
  m.def(
      "hardware_normalize",
      [](const std::string& text) { return baton::Hardware::from_json(text).to_json(); },
      "text"_a, "Parses and validates a hardware JSON; returns it with every field written.");
  m.def(
      "profile_normalize",
      [](const std::string& text) { return baton::ModelProfile::from_json(text).to_json(); },
      "text"_a, "Parses and validates a model profile JSON; returns it with every field written.");
  m.def(
      "plan_cluster",
      [](const std::string& profile, const std::string& hardware, int gpus, int64_t global_batch,
         bool fp8, const std::vector<int>& pp, const std::vector<int>& tp,
         const std::vector<int>& ep, int fsdp_mode, const std::vector<std::string>& families,
         int top, int max_segments, int max_microbatch_choices, double gap,
         int64_t node_budget, const std::vector<int>& interleaved_v) {
        baton::ClusterOptions o;
        o.gpus = gpus;
        o.global_batch = global_batch;
        o.fp8 = fp8;
        o.pp_choices = pp;
        o.tp_choices = tp;
        o.ep_choices = ep;
        o.fsdp_mode = fsdp_mode;
        o.families = families;
        o.top = top;
        o.max_segments = max_segments;
        o.max_microbatch_choices = max_microbatch_choices;
        o.gap = gap;
        o.node_budget = node_budget;
        if (!interleaved_v.empty()) o.interleaved_v = interleaved_v;
        nb::gil_scoped_release release;
        return baton::plan_cluster(baton::ModelProfile::from_json(profile),
                                   baton::Hardware::from_json(hardware), o)
            .to_json();
      },
      "profile"_a, "hardware"_a, "gpus"_a, "global_batch"_a, "fp8"_a = false,
      "pp"_a = std::vector<int>{}, "tp"_a = std::vector<int>{}, "ep"_a = std::vector<int>{},
      "fsdp_mode"_a = -1, "families"_a = std::vector<std::string>{}, "top"_a = 10,
      "max_segments"_a = 24, "max_microbatch_choices"_a = 1, "gap"_a = 0.02,
      "node_budget"_a = 500, "interleaved_v"_a = std::vector<int>{},
      "Searches degrees x cuts x schedule x microbatches x remat; returns the ranked result "
      "as JSON. Raises ConfigError when nothing fits.");
  m.def(
      "evaluate_cluster",
      [](const std::string& profile, const std::string& hardware, int pp, int tp, int dp, int ep,
         bool fsdp, int64_t global_batch, bool fp8, const std::string& schedule,
         int virtual_stages, int microbatches, const std::string& remat) {
        baton::ClusterOptions o;
        o.gpus = pp * tp * dp;
        o.global_batch = global_batch;
        o.fp8 = fp8;
        baton::ClusterResult r;
        r.plans.push_back(baton::evaluate_cluster(
            baton::ModelProfile::from_json(profile), baton::Hardware::from_json(hardware),
            baton::ClusterDegrees{pp, tp, dp, ep, fsdp}, o, schedule, virtual_stages,
            microbatches, baton::parse_remat(remat)));
        return r.to_json();
      },
      "profile"_a, "hardware"_a, "pp"_a, "tp"_a, "dp"_a, "ep"_a, "fsdp"_a, "global_batch"_a,
      "fp8"_a, "schedule"_a, "virtual_stages"_a, "microbatches"_a, "remat"_a,
      "One given configuration (even layer cuts, one remat mode) simulated; JSON like "
      "plan_cluster's with one plan.");
  m.def(
      "collective_time",
      [](const std::string& kind, double bytes, int n, double bandwidth, double latency) {
        const baton::LinkSpec l{bandwidth, latency};
        if (kind == "all_reduce") return baton::all_reduce_time(bytes, n, l);
        if (kind == "ring_all_reduce") return baton::ring_all_reduce_time(bytes, n, l);
        if (kind == "all_gather") return baton::all_gather_time(bytes, n, l);
        if (kind == "reduce_scatter") return baton::reduce_scatter_time(bytes, n, l);
        if (kind == "all_to_all") return baton::all_to_all_time(bytes, n, l);
        if (kind == "p2p") return baton::p2p_time(bytes, l);
        throw baton::ConfigError(fmt::format(
            "collective_time: unknown kind '{}' (all_reduce, ring_all_reduce, all_gather, "
            "reduce_scatter, all_to_all, p2p)",
            kind));
      },
      "kind"_a, "bytes"_a, "n"_a, "bandwidth"_a, "latency"_a,
      "Seconds of one collective (collectives.h formulas).");
}

}  // namespace

void init_planner(nb::module_& m) {
  nb::register_exception_translator(&translate_baton_error);
  bind_schedule(m);
  bind_cost(m);
  bind_plan(m);
  bind_verify(m);
  bind_sim(m);
  bind_autoplan(m);
  bind_cluster(m);
}
