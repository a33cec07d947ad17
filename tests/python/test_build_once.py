"""One step build lowers its plan, verifies it and builds its rank programs exactly once each
(``_core.build_step``), counted in C++ (``_core.build_counts``: every call of ``lower``,
``verify`` and the rank-IR builder in this process, whoever makes it)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import baton
from baton import _core

import mlp_step
from test_planner import DEADLOCK  # a valid schedule that deadlocks
from test_stage_graph import init_skip, skip_batch, skip_loss


def _delta(before: dict, keys=("lower", "verify", "rank_ir")) -> dict:
    now = _core.build_counts()
    return {k: now[k] - before[k] for k in keys}


ONCE = {"lower": 1, "verify": 1, "rank_ir": 1}


def test_counters_count_every_call():
    """The counts are the C++ calls themselves: a direct call of each is seen."""
    s = baton.OneFOneB().build(2, 4)
    before = _core.build_counts()
    p = _core.lower(s)
    assert _delta(before) == {"lower": 1, "verify": 0, "rank_ir": 0}
    _core.verify(p)
    assert _delta(before) == {"lower": 1, "verify": 1, "rank_ir": 0}
    _core.build_rank_ir(p)  # (verifies the plan itself)
    assert _delta(before) == {"lower": 1, "verify": 2, "rank_ir": 1}
    _core.build_step(s)
    assert _delta(before) == {"lower": 2, "verify": 3, "rank_ir": 2}


def _first_call_counts(ps, *args):
    """The C++ calls of building the step: its first call (trace, plan, rank programs, the
    compiled programs, one run); then a second call, which builds nothing."""
    before = _core.build_counts()
    out = ps(*args)
    jax.block_until_ready(out)
    first = _delta(before)
    # a table program's rings run the slot pass alone again with its pools (with_pools),
    # at most once per rank: no lowering, no verification, no second build
    assert _delta(before, ("with_pools",))["with_pools"] <= ps.last.num_ranks
    before = _core.build_counts()
    jax.block_until_ready(ps(*args))
    assert _delta(before, ("lower", "verify", "rank_ir", "with_pools")) == {
        "lower": 0, "verify": 0, "rank_ir": 0, "with_pools": 0}
    return first, out


@pytest.mark.parametrize("schedule,ranks", [(baton.OneFOneB(), 4), (baton.GPipe(), 2)],
                         ids=["1f1b", "gpipe"])
def test_one_build_per_step(schedule, ranks):
    ps, params, batch = mlp_step.make(schedule, ranks, 4)
    counts, (loss, _) = _first_call_counts(ps, params, batch)
    assert counts == ONCE
    step = ps.last
    # what the step asks of its plan comes from that one build
    assert step.rank_ir() is step.rank_ir()
    assert step.plan.verify().ok and step.plan.rank_ir().to_text() == step.rank_ir().to_text()
    assert _delta(_core.build_counts()) == {"lower": 0, "verify": 0, "rank_ir": 0}
    ref = baton.accumulate(jax.value_and_grad(mlp_step.mlp.make_loss()), params, batch=batch,
                           microbatches=4)[0]
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def test_one_build_with_skip_edges_and_split_backward():
    """ZB-H1 (I and W split) of a model whose stage 0 and 1 outputs reach stage 3: the skip
    edges are lowered in the one build, not in a second lowering after a first without."""
    key = jax.random.PRNGKey(1)
    vg = jax.value_and_grad(skip_loss)
    ps = baton.jit(lambda p, b: baton.accumulate(vg, p, batch=b),
                   mesh=baton.PipelineMesh(jax.devices()[:4], ranks=4),
                   schedule=baton.ZBH1(), microbatches=4)
    params, batch = init_skip(key), skip_batch(key, 16)
    counts, (loss, _) = _first_call_counts(ps, params, batch)
    assert counts == ONCE
    step = ps.last
    assert [(e.src, e.dst) for e in step.core_plan.skips] == [(0, 3), (1, 3)]
    assert step.core_plan.schedule.split_backward()
    # the one build is what lowering with the edges and building the rank IR give
    before = _core.build_counts()
    again = _core.build_rank_ir(_core.lower(step.core_plan.schedule,
                                            list(step.partition.skips)))
    assert _delta(before) == ONCE | {"verify": 1}
    assert again.to_text() == step.rank_ir().to_text()
    ref = baton.accumulate(vg, params, batch=batch, microbatches=4)[0]
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_one_build_with_or_without_fused_forward_backward(fuse):
    ps, params, batch = mlp_step.make(baton.OneFOneB(), 2, 4, fuse_forward_backward=fuse)
    counts, _ = _first_call_counts(ps, params, batch)
    assert counts == ONCE
    actions = [a for r in range(2) for a in ps.last.core_plan.schedule.actions(r)]
    # the plan built is the fused one when asked (rank 1 runs F1.m and B1.m back to back)
    assert any("+" in a for a in actions) == fuse, actions


def test_a_failing_plan_is_refused_with_its_report():
    """A schedule that deadlocks: the step build stops at the verifier, with its report,
    and builds no rank programs."""
    sched = baton.ScheduleFile(DEADLOCK).build()
    # (baton.jit fuses F1.1 B1.1, adjacent on rank 1, by default)
    want = _core.verify(_core.lower(_core.fuse_forward_backward(sched))).to_string()
    assert "deadlock" in want
    ps, params, batch = mlp_step.make(baton.ScheduleFile(DEADLOCK), 2, 2)
    before = _core.build_counts()
    with pytest.raises(baton.VerifyError) as exc:
        ps(params, batch)
    assert str(exc.value) == want
    assert _delta(before) == {"lower": 1, "verify": 1, "rank_ir": 0}
