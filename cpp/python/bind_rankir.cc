// Bindings of rank programs (rank_program.h): the records, the enums, the
// pass pipeline, the verifier and the simulator over them, and rolled rank
// programs (roll.h). Conversion only.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "baton/build.h"
#include "baton/rank_program.h"
#include "baton/roll.h"
#include "baton/sim.h"

namespace nb = nanobind;
using namespace nb::literals;

void init_rankir(nb::module_& m) {
  nb::enum_<baton::RankOp>(m, "RankOp")
      .value("POST", baton::RankOp::Post)
      .value("WAIT", baton::RankOp::Wait)
      .value("RUN", baton::RankOp::Run)
      .value("FREE", baton::RankOp::Free)
      .value("ACCUMULATE", baton::RankOp::Accumulate)
      .value("OFFLOAD", baton::RankOp::Offload)
      .value("FETCH", baton::RankOp::Fetch);
  // NONE, not None: `None` cannot be an attribute name in Python.
  nb::enum_<baton::Offload>(m, "Offload", "What a stage offloads to host memory (rank_program.h).")
      .value("NONE", baton::Offload::None)
      .value("STASH", baton::Offload::Stash);
  nb::enum_<baton::TransferDir>(m, "TransferDir")
      .value("SEND", baton::TransferDir::Send)
      .value("RECV", baton::TransferDir::Recv);

  nb::class_<baton::RankInstr>(m, "RankInstr", "One instruction of a rank program.")
      .def_ro("op", &baton::RankInstr::op)
      .def_ro("unit", &baton::RankInstr::unit)
      .def_ro("group", &baton::RankInstr::group)
      .def_ro("transfer", &baton::RankInstr::transfer)
      .def_ro("buffer", &baton::RankInstr::buffer)
      .def("__eq__", [](const baton::RankInstr& a, const baton::RankInstr& b) { return a == b; });
  nb::class_<baton::RankBuffer>(m, "RankBuffer", "A buffer of a rank and its slot.")
      .def_ro("id", &baton::RankBuffer::id)
      .def_ro("key", &baton::RankBuffer::key)
      .def_ro("pool", &baton::RankBuffer::pool)
      .def_ro("slot", &baton::RankBuffer::slot)
      .def_ro("live_from", &baton::RankBuffer::live_from)
      .def_ro("live_to", &baton::RankBuffer::live_to)
      .def_ro("held_from", &baton::RankBuffer::held_from)
      .def_ro("held_to", &baton::RankBuffer::held_to)
      .def_ro("offload", &baton::RankBuffer::offload)
      .def_ro("fetch", &baton::RankBuffer::fetch)
      .def_ro("fetch_slot", &baton::RankBuffer::fetch_slot)
      .def_ro("host_pool", &baton::RankBuffer::host_pool)
      .def_ro("host_slot", &baton::RankBuffer::host_slot);
  nb::class_<baton::Pool>(m, "Pool", "Plan rows that share slots, and the number of slots.")
      .def_ro("rows", &baton::Pool::rows)
      .def_ro("slots", &baton::Pool::slots);
  nb::class_<baton::Unit>(m, "Unit", "A task (or a fused pair) and its buffers.")
      .def_ro("action", &baton::Unit::action)
      .def_ro("tasks", &baton::Unit::tasks)
      .def_ro("reads", &baton::Unit::reads)
      .def_ro("writes", &baton::Unit::writes)
      .def_ro("instr", &baton::Unit::instr);
  nb::class_<baton::Transfer>(m, "Transfer", "A send or receive of a rank.")
      .def_ro("dir", &baton::Transfer::dir)
      .def_ro("buffer", &baton::Transfer::buffer)
      .def_ro("peer", &baton::Transfer::peer)
      .def_ro("channel", &baton::Transfer::channel)
      .def_ro("seq", &baton::Transfer::seq)
      .def_ro("group", &baton::Transfer::group)
      .def_ro("wait", &baton::Transfer::wait);
  nb::class_<baton::TransferGroup>(m, "TransferGroup", "Transfers posted together.")
      .def_ro("transfers", &baton::TransferGroup::transfers)
      .def_ro("post", &baton::TransferGroup::post);
  nb::class_<baton::RankProgram>(m, "RankProgram", "What one rank runs.")
      .def_ro("rank", &baton::RankProgram::rank)
      .def_ro("stages", &baton::RankProgram::stages)
      .def_ro("instrs", &baton::RankProgram::instrs)
      .def_ro("units", &baton::RankProgram::units)
      .def_ro("transfers", &baton::RankProgram::transfers)
      .def_ro("groups", &baton::RankProgram::groups)
      .def_ro("buffers", &baton::RankProgram::buffers)
      .def_ro("pools", &baton::RankProgram::pools)
      .def_ro("host_pools", &baton::RankProgram::host_pools)
      .def_ro("share_class", &baton::RankProgram::share_class)
      .def("__repr__", [](const baton::RankProgram& p) {
        return fmt::format("RankProgram(rank={}, units={}, transfers={}, instrs={})", p.rank,
                           p.units.size(), p.transfers.size(), p.instrs.size());
      });
  nb::class_<baton::RankIR>(m, "RankIR", "Every rank's program, built from a verified plan.")
      .def_ro("plan", &baton::RankIR::plan)
      .def_ro("programs", &baton::RankIR::programs)
      .def_ro("share_classes", &baton::RankIR::share_classes)
      .def("describe", &baton::RankIR::describe, "rank"_a, "instr"_a)
      .def("to_text", &baton::RankIR::to_text)
      .def("__str__", &baton::RankIR::to_text);

  nb::class_<baton::RankIROptions>(m, "RankIROptions", "Options of build_rank_ir.")
      .def(nb::init<>())
      .def_rw("pool_of", &baton::RankIROptions::pool_of)
      .def_rw("offload", &baton::RankIROptions::offload)
      .def_rw("fetch_lookahead", &baton::RankIROptions::fetch_lookahead);
  m.def(
      "build_rank_ir",
      [](const baton::Plan& plan, const std::vector<int32_t>& pool_of,
         const std::vector<baton::Offload>& offload, int32_t fetch_lookahead) {
        baton::RankIROptions o;
        o.pool_of = pool_of;
        o.offload = offload;
        o.fetch_lookahead = fetch_lookahead;
        return baton::build_rank_ir(plan, o);
      },
      "plan"_a, "pool_of"_a = std::vector<int32_t>{}, "offload"_a = std::vector<baton::Offload>{},
      "fetch_lookahead"_a = 1,
      "Rank programs of a plan (verifies the plan and the result). pool_of: per plan row "
      "(buffer id // microbatches), a label; rows of one label share slots. offload: per "
      "stage an Offload (empty: none); Offload.STASH moves the stage's stashes to host memory "
      "between their forward and backward, fetched fetch_lookahead RUNs ahead of their read.");
  m.def(
      "build_rank_ir",
      [](const baton::Plan& plan, const baton::RankIROptions& options) {
        return baton::build_rank_ir(plan, options);
      },
      "plan"_a, "options"_a, "Rank programs of a plan with the given options.");
  nb::class_<baton::StepBuild>(
      m, "StepBuild",
      "One step's plan built once (build_step): the lowered plan, the verifier's report "
      "and the rank programs.")
      .def_prop_ro("plan", [](const baton::StepBuild& b) { return b.plan(); })
      .def_ro("report", &baton::StepBuild::report)
      .def_ro("rank_ir", &baton::StepBuild::rank_ir);
  m.def(
      "build_step",
      [](const baton::Schedule& schedule, const std::vector<baton::SkipEdge>& skips,
         bool fuse_forward_backward, const std::vector<baton::Offload>& offload,
         int32_t fetch_lookahead, const std::vector<int32_t>& pool_of) {
        baton::StepOptions o;
        o.fuse_forward_backward = fuse_forward_backward;
        o.offload = offload;
        o.fetch_lookahead = fetch_lookahead;
        o.pool_of = pool_of;
        return baton::build_step(schedule, skips, o);
      },
      "schedule"_a, "skips"_a = std::vector<baton::SkipEdge>{},
      "fuse_forward_backward"_a = false, "offload"_a = std::vector<baton::Offload>{},
      "fetch_lookahead"_a = 1, "pool_of"_a = std::vector<int32_t>{},
      "One step's plan, each pass once: the schedule (F+B fused where adjacent when "
      "fuse_forward_backward and the backward is not split) lowered with the skip edges, "
      "verified (VerifyError with the report when it fails), and its rank programs built "
      "with offload / fetch_lookahead / pool_of as in build_rank_ir.");
  m.def("with_pools", &baton::with_pools, "ir"_a, "pool_of"_a,
        "The rank programs with their slots given again with pool labels (the slot pass "
        "only, then the rank-IR verifier; no lowering, no plan verification).");
  m.def(
      "build_counts",
      []() {
        const baton::BuildCounts c = baton::build_counts();
        nb::dict d;
        d["lower"] = c.lower;
        d["verify"] = c.verify;
        d["rank_ir"] = c.rank_ir;
        d["with_pools"] = c.with_pools;
        return d;
      },
      "Calls of lower, verify, the rank-IR builder and with_pools in this process so far.");
  m.def("verify_rank_ir", &baton::verify_rank_ir, "ir"_a);
  m.def("rank_op_name", [](baton::RankOp op) { return std::string(baton::rank_op_name(op)); });
  m.def(
      "simulate_rank_ir",
      [](const baton::RankIR& ir, const baton::CostModel& costs) {
        return baton::simulate(ir, costs);
      },
      "ir"_a, "costs"_a, "Runs the rank programs on the cost model (what runs).");

  nb::enum_<baton::ItemOp>(m, "ItemOp")
      .value("RUN", baton::ItemOp::Run)
      .value("SEND", baton::ItemOp::Send)
      .value("POST", baton::ItemOp::Post)
      .value("WAIT", baton::ItemOp::Wait)
      .value("OFFLOAD", baton::ItemOp::Offload)
      .value("FETCH", baton::ItemOp::Fetch);
  nb::class_<baton::RollItem>(m, "RollItem", "One item of a rank's program (roll.h).")
      .def_ro("op", &baton::RollItem::op)
      .def_ro("task", &baton::RollItem::task)
      .def_ro("fused", &baton::RollItem::fused)
      .def_ro("buffer", &baton::RollItem::buffer)
      .def_ro("stage", &baton::RollItem::stage)
      .def_ro("microbatch", &baton::RollItem::microbatch)
      .def_ro("peer", &baton::RollItem::peer)
      .def_ro("reads", &baton::RollItem::reads)
      .def_ro("writes", &baton::RollItem::writes)
      .def("__eq__", [](const baton::RollItem& a, const baton::RollItem& b) { return a == b; });
  nb::class_<baton::RollRun>(m, "RollRun", "A run of a repeating pattern of items.")
      .def_ro("first", &baton::RollRun::first)
      .def_ro("period", &baton::RollRun::period)
      .def_ro("repetitions", &baton::RollRun::repetitions)
      .def_ro("delta", &baton::RollRun::delta)
      .def_ro("slots", &baton::RollRun::slots)
      .def_ro("stacked", &baton::RollRun::stacked);
  nb::class_<baton::RollOptions>(m, "RollOptions", "Options of roll_rank.")
      .def(nb::init<>())
      .def_rw("max_period", &baton::RollOptions::max_period)
      .def_rw("stacked", &baton::RollOptions::stacked)
      .def_rw("fuse_fb", &baton::RollOptions::fuse_fb);
  nb::class_<baton::RolledRank>(m, "RolledRank", "A rank's items and their runs.")
      .def_ro("rank", &baton::RolledRank::rank)
      .def_ro("items", &baton::RolledRank::items)
      .def_ro("runs", &baton::RolledRank::runs)
      .def("to_text", &baton::RolledRank::to_text, "plan"_a);
  m.def("rank_items", &baton::rank_items, "plan"_a, "program"_a, "options"_a = baton::RollOptions(),
        "A rank program's items, in order (roll.h).");
  m.def("roll_rank", &baton::roll_rank, "plan"_a, "program"_a, "options"_a = baton::RollOptions(),
        "A rank program's items and their runs of a repeating pattern (roll.h).");
}
