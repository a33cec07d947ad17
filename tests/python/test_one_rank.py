"""Baton with 1 rank: a model with no stage_boundary is a one-stage pipeline.

On a PipelineMesh of one rank, GPipe, 1F1B and ZB-H1 run one stage (F0 = the forward,
B0 or I0/W0 = the backward). Loss and gradients match jax.value_and_grad on the full batch
(rtol 1e-5) and plain jax.jit where accumulate is a lax.scan: bit for bit on the executor
(``engine="interpreter"``, every task its own jit), within an ulp-level tolerance as one
program (the default: XLA may fuse across task boundaries and round differently).
"""

import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import mlp  # noqa: E402

SCHEDULES = [
    ("gpipe", baton.GPipe(), "BF"),
    ("1f1b", baton.OneFOneB(), "BF"),
    ("zbh1", baton.ZBH1(), "FIW"),  # backward split into I and W
]


@pytest.mark.parametrize("single", [True, False], ids=["one-program", "executor"])
@pytest.mark.parametrize("schedule,kinds", [pytest.param(s, k, id=n) for n, s, k in SCHEDULES])
def test_one_rank_matches_jax(schedule, kinds, single):
    assert schedule.stages(1) == 1
    m = 4
    key = jax.random.PRNGKey(5)
    params = mlp.init_params(key, 1, layers_per_stage=2)  # one stage: no stage_boundary
    batch = mlp.synthetic_batch(key, 4 * m)
    vg = jax.value_and_grad(mlp.make_loss())

    def step(p, b):
        return baton.accumulate(vg, p, batch=b)

    mesh = baton.PipelineMesh(jax.devices()[:1], ranks=1)
    ps = baton.jit(step, mesh=mesh, schedule=schedule, microbatches=m,
                   engine="compiled" if single else "interpreter")
    got = ps(params, batch)
    step_info = ps.last
    program = single  # every schedule runs as one program (GPipe's forwards unrolled)
    assert ("single_program" in ps.last_run.stats) == program
    assert ("peak_bytes" in ps.last_run.stats) == (not program)
    assert step_info.num_stages == 1 and step_info.num_ranks == 1
    assert "".join(sorted(t.kind for t in step_info.partition.tasks)) == kinds
    f0 = [t for t in step_info.partition.tasks if t.kind == "F"][0]
    assert len(f0.mb_out) == 1 and f0.stash_out  # the loss; residuals for the backward

    # Versus the full batch: rtol 1e-5 (the mean of microbatch means rounds differently).
    loss, grads = got
    ref_loss, ref_grads = jax.jit(vg)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    la, lb = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(la) == len(lb) == 4
    for a, b in zip(la, lb):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)

    # Versus plain jax.jit, where accumulate is a lax.scan over the same microbatches: equal.
    want = jax.jit(lambda p, b: baton.accumulate(vg, p, batch=b, microbatches=m))(params, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if program:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("schedule,runs", [
    pytest.param(baton.OneFOneB(), "scan 4 x [FB0]", id="1f1b"),
    pytest.param(baton.ZBH1(), "scan 4 x [F0 I0 W0]", id="zbh1"),
])
def test_one_program_rolls_the_schedule_into_scans(schedule, runs):
    """The one-rank program follows the schedule's order, each repeating pattern one scan."""
    from mlp_step import make

    ps, params, batch = make(schedule, 1, 4)
    ps(params, batch)
    assert ps.last_run.stats["single_program"] == runs
    # a traced step runs the same program with its task markers: one RUN per task of the
    # plan, each its own span, in the schedule's order
    tr = baton.trace(ps, params, batch)
    assert ps.last_run.stats["single_program"] == runs
    plan_runs = [i for i in ps.last.programs[0] if i[0] == baton.OpCode.RUN]
    assert len(tr.runs) == len(plan_runs) > 0
    starts = [r["start"] for r in tr.runs]
    assert starts == sorted(starts)
    assert all(r["end"] >= r["start"] for r in tr.runs)
    assert all(b["end"] <= a["start"] + 1e-9 for b, a in zip(tr.runs, tr.runs[1:]))
    ps(params, batch)
    assert ps.last_run.stats["single_program"] == runs


def test_gpipe_runs_as_one_program_without_stacked_buffers():
    """GPipe's forwards would roll into a loop that hands the stashes on stacked (XLA
    zero-fills such outputs: slower than per-microbatch buffers), so the one program keeps
    them unrolled; its results equal the executor's within rounding."""
    from mlp_step import make

    ps, params, batch = make(baton.GPipe(), 1, 4)
    got = ps(params, batch)
    step = ps.last
    assert ps.last_run.stats["single_program"] == "[F0]; [F0]; [F0]; [F0]; [B0]; [B0]; [B0]; [B0]"
    assert step.engine.single.stacked_buffers() == []
    ps2, _, _ = make(baton.GPipe(), 1, 4, engine="interpreter")
    want = ps2(params, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("schedule", [baton.Interleaved1F1B(2), baton.ZBV(), baton.DualPipeV()],
                         ids=["interleaved", "zbv", "dualpipev"])
def test_one_program_several_stages_on_one_rank(schedule):
    """Two stages on one rank of two devices, AdamW after the loop, a stacked aux output: the
    step (one program where the schedule allows, else the executor) matches the reference
    step for two steps; the program itself (parts rolled, the rest in place, stacked buffers
    between loops) equals the executor within rounding."""
    from mlp_step import make
    from test_e2e import run_mlp

    from baton.emit.single_program import SingleProgram

    assert schedule.stages(1) == 2
    ps = run_mlp(schedule, 1, microbatches=4, steps=2, per_rank=2, aux=True)
    assert "single_program" in ps.last_run.stats

    ps2, params, batch = make(schedule, 1, 4, engine="interpreter")
    want = ps2(params, batch)
    sp = SingleProgram(ps2.last)
    assert len(sp.runs) > 1
    got = sp(jax.tree.leaves((params, batch)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


def test_one_program_that_fails_to_build_raises(monkeypatch):
    """No silent fallback: if tracing the one program fails, the step raises (the
    interpreter runs only when chosen: engine="interpreter")."""
    from mlp_step import make

    from baton.emit import single_program

    def broken(self, flat_args):
        raise RuntimeError("rolled wrong")

    monkeypatch.setattr(single_program.SingleProgram, "_program", broken)
    ps, params, batch = make(baton.OneFOneB(), 1, 4)
    with pytest.raises(RuntimeError, match="rolled wrong"):
        ps(params, batch)
