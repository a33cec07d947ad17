"""Baton with 1 rank: a model with no stage_boundary is a one-stage pipeline.

On a PipelineMesh of one rank, GPipe, 1F1B and ZB-H1 run one stage (F0 = the forward,
B0 or I0/W0 = the backward). Loss and gradients match jax.value_and_grad on the full batch
(rtol 1e-5) and equal, bit for bit, plain jax.jit where accumulate is a lax.scan.
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


@pytest.mark.parametrize("schedule,kinds", [pytest.param(s, k, id=n) for n, s, k in SCHEDULES])
def test_one_rank_matches_jax(schedule, kinds):
    assert schedule.stages(1) == 1
    m = 4
    key = jax.random.PRNGKey(5)
    params = mlp.init_params(key, 1, layers_per_stage=2)  # one stage: no stage_boundary
    batch = mlp.synthetic_batch(key, 4 * m)
    vg = jax.value_and_grad(mlp.make_loss())

    def step(p, b):
        return baton.accumulate(vg, p, batch=b)

    mesh = baton.PipelineMesh(jax.devices()[:1], ranks=1)
    ps = baton.jit(step, mesh=mesh, schedule=schedule, microbatches=m)
    got = ps(params, batch)
    step_info = ps.last
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
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
