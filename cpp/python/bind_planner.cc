// Bindings of the planner: error translation, schedule IR, generators and text
// format here; cost model and simulator (bind_sim.cc), lowering and verifier
// (bind_plan.cc), automatic and cluster planning (bind_autoplan.cc). Thin:
// conversion only.
#include "bind_planner.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <exception>
#include <string>
#include <vector>

#include "baton/error.h"
#include "baton/generators.h"
#include "baton/schedule.h"
#include "baton/text_format.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace baton::python {

void check_rank(const baton::Schedule& s, int rank) {
  if (rank < 0 || rank >= s.num_ranks) {
    throw nb::index_error(("rank " + std::to_string(rank) + " out of range (schedule has " +
                           std::to_string(s.num_ranks) + " ranks)")
                              .c_str());
  }
}

}  // namespace baton::python

namespace {

using baton::python::check_rank;

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

}  // namespace

void init_planner(nb::module_& m) {
  nb::register_exception_translator(&translate_baton_error);
  bind_schedule(m);
  baton::python::bind_cost(m);
  baton::python::bind_plan(m);
  baton::python::bind_verify(m);
  baton::python::bind_sim(m);
  baton::python::bind_autoplan(m);
  baton::python::bind_cluster(m);
}
