// Bindings of the cost model and the simulator: stage, link and skip costs,
// CostModel, simulate and its result, and the renderers. Thin: conversion only.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "baton/cost.h"
#include "baton/render.h"
#include "baton/sim.h"
#include "baton/verify.h"
#include "bind_planner.h"

namespace baton::python {

using namespace nb::literals;

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
      .def_rw("host_link_bandwidth", &baton::CostModel::host_link_bandwidth)
      .def_rw("fused_factor", &baton::CostModel::fused_factor)
      .def(
          "stage", [](const baton::CostModel& c, int s) { return c.stage(s); }, "stage"_a)
      .def("validate", &baton::CostModel::validate)
      .def_static("from_json", &baton::CostModel::from_json, "text"_a)
      .def("to_json", &baton::CostModel::to_json)
      .def_static("uniform", &baton::CostModel::uniform, "f"_a, "b"_a, "i"_a, "w"_a)
      .def("__repr__", [](const baton::CostModel& c) { return "CostModel(" + c.to_json() + ")"; });
}

namespace {

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

}  // namespace

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
      .def_ro("total", &baton::MemorySample::total)
      .def_ro("host", &baton::MemorySample::host);

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
                 .def_ro("peak_host_bytes", &baton::SimResult::peak_host_bytes)
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

}  // namespace baton::python
