"""The C++ rank programs (docs/RANK_IR.md) as Python sees them: the bound records and enums,
the text form (the C++ golden files), the simulator over them, and a compiled step's rank
programs, which its per-rank loop programs read (``program.rank_items``)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import pytest  # noqa: E402

import baton  # noqa: E402
from baton import _core  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[2] / "cpp" / "tests" / "golden"


@pytest.mark.parametrize("name,ranks,mbs,golden", [
    ("1f1b", 4, 8, "rank_ir_1f1b_p4_m8.txt"), ("zbv", 2, 4, "rank_ir_zbv_p2_m4.txt")])
def test_text_is_the_golden_text(name, ranks, mbs, golden):
    ir = baton.plan(name, ranks, mbs).rank_ir()
    assert ir.to_text() == (GOLDEN / golden).read_text()


def test_records_and_enums():
    plan = baton.plan("1f1b", 4, 8)
    ir = plan.rank_ir()
    assert plan.rank_ir() is ir  # built once per plan
    assert ir.share_classes == [[0], [1, 2], [3]]
    p1 = ir.programs[1]
    assert p1.rank == 1 and p1.stages == [1] and p1.share_class == 1
    first = p1.instrs[0]
    assert first.op == _core.RankOp.POST and first.group == 0 and first.unit == -1
    recv = p1.transfers[p1.groups[0].transfers[0]]
    assert recv.dir == _core.TransferDir.RECV and recv.peer == 0
    assert recv.channel == plan.core.channel(p1.buffers[recv.buffer].id)
    assert p1.instrs[recv.wait].op == _core.RankOp.WAIT
    unit = p1.units[0]
    assert [str(t) for t in unit.tasks] == ["F1.0"]
    assert [p1.buffers[b].key.kind for b in unit.reads] == [_core.BufKind.Act]
    assert [p1.buffers[b].key.stage for b in unit.reads] == [0]
    assert ir.describe(1, 1) == "rank 1 #1 WAIT act(s0,m0)<-0"
    assert _core.rank_op_name(_core.RankOp.ACCUMULATE) == "ACCUMULATE"
    assert _core.verify_rank_ir(ir).ok
    # rank 1 keeps 3 stashes in flight: its stash pool has 3 slots
    stash = {p1.buffers[b].pool for b in range(len(p1.buffers))
             if p1.buffers[b].key.kind == _core.BufKind.Stash}
    assert len(stash) == 1 and p1.pools[stash.pop()].slots == 3


def test_pools_shared_and_checked():
    plan = baton.plan("zbh1", 3, 6)
    rows = plan.core.num_buffer_ids() // 6
    one = _core.build_rank_ir(plan.core, [0] * rows)
    assert all(len(p.pools) == 1 for p in one.programs)
    with pytest.raises(baton.ConfigError, match="pool_of has 2 entries"):
        _core.build_rank_ir(plan.core, [0, 1])


@pytest.mark.parametrize("name", ["1f1b", "zbh1", "interleaved", "dualpipev"])
def test_simulated_as_the_plan(name):
    plan = baton.plan(name, 2, 4)
    a, b = plan.simulate(), plan.simulate_rank_ir()
    assert a.step_time == b.step_time
    assert a.peak_total == b.peak_total
    assert [(r.rank, r.action, r.start) for r in a.runs] == \
        [(r.rank, r.action, r.start) for r in b.runs]
    assert plan.to_svg().count('<rect class="action') == len(b.runs)


def test_step_rank_programs_are_what_its_loops_run():
    """A compiled step's rank programs: one per rank, built from the step's plan; the items
    of each rank's loop program are the rank program's instructions in order."""
    from mlp_step import make

    from baton.emit.rolling import rank_items

    ps, params, batch = make(baton.OneFOneB(), 2, 4)
    cs = ps.compile(params, batch)
    ir = cs.rank_ir()
    assert ps.rank_ir() is ir
    assert len(cs.rank_programs()) == 2
    assert ir.plan.fingerprint() == cs.core_plan.fingerprint()
    for r, prog in enumerate(cs.rank_programs()):
        items = rank_items(cs, r)
        ops = {"POST": 0, "WAIT": 0, "RUN": 0}
        for ins in prog.instrs:
            name = _core.rank_op_name(ins.op)
            if name == "POST":
                ops[name] += len(prog.groups[ins.group].transfers)
            elif name in ops:
                ops[name] += 1
        kinds = [it[0] for it in items]
        assert kinds.count(_core.ItemOp.RUN) == ops["RUN"]
        assert kinds.count(_core.ItemOp.WAIT) == ops["WAIT"]
        assert kinds.count(_core.ItemOp.SEND) + kinds.count(_core.ItemOp.POST) == ops["POST"]


@pytest.mark.parametrize("name,ranks,mbs,rank,golden", [
    ("1f1b", 4, 8, 1, "roll_1f1b_p4_m8_rank1.txt"), ("zbh1", 4, 8, 0, "roll_zbh1_p4_m8_rank0.txt")])
def test_rolled_text_is_the_golden_text(name, ranks, mbs, rank, golden):
    """``_core.roll_rank``: a rank program's items and their runs (cpp/include/baton/roll.h)
    as records, printed as the C++ golden files."""
    plan = baton.plan(name, ranks, mbs)
    rolled = _core.roll_rank(plan.core, plan.rank_ir().programs[rank], _core.RollOptions())
    assert rolled.to_text(plan.core) == (GOLDEN / golden).read_text()
    assert sum(r.period * r.repetitions for r in rolled.runs) == len(rolled.items)
    I = _core.ItemOp  # every item kind but offload's, which this plan has none of
    assert {it.op for it in rolled.items} == {I.RUN, I.SEND, I.POST, I.WAIT}


@pytest.mark.parametrize("fused", [True, False])
def test_one_rank_loop_items_are_its_tasks(fused):
    """A one-rank step's loop program (``SingleProgram``) runs the rank program's items: its
    tasks in the schedule's order (``task_list``), no transfers; fused F+B as one ``FB``."""
    from mlp_step import make

    from baton.emit.loop_program import _LoopProgram
    from baton.emit.rolling import task_list
    from baton.planning.tasks import FUSED_FB

    ps, params, batch = make(baton.OneFOneB(), 1, 4, fuse_forward_backward=fused)
    cs = ps.compile(params, batch)
    prog = _LoopProgram(cs, 0, stacked=False)
    assert [it[1:4] for it in prog.items] == task_list(cs)
    assert {it.op for it in prog.items} == {_core.ItemOp.RUN}
    assert any(it.kind == FUSED_FB for it in prog.items) == fused
    assert prog.describe() == ("scan 4 x [FB0]" if fused else "scan 4 x [F0 B0]")
