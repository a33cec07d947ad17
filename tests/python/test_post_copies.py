"""Small post-loop values that depend only on step inputs (Adam's step count and bias
corrections) are computed by every stage that reads them, so no stage's optimizer update waits
for another stage's: the post-loop segments of different stages exchange nothing, and the
results still equal plain JAX."""

import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import baton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import mlp  # noqa: E402


def test_adam_bias_corrections_are_computed_on_every_stage():
    key = jax.random.PRNGKey(1)
    params = mlp.init_params(key, 2)
    batch = mlp.synthetic_batch(key, 16)
    opt = optax.adam(1e-2)
    vg = jax.value_and_grad(mlp.make_loss())

    def step(p, st, b):
        loss, g = baton.accumulate(vg, p, batch=b)
        upd, st = opt.update(g, st, p)
        return optax.apply_updates(p, upd), st, loss

    ps = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2),
                   schedule=baton.OneFOneB(), microbatches=4)
    st = opt.init(params)
    got = ps(params, st, batch)
    c = ps.last
    segs = c.post_segments
    assert sorted(s.stage for s in segs) == [0, 1]
    made = {s.stage: set(s.outputs) for s in segs}
    for s in segs:  # no segment reads what another stage's segment makes
        assert not (set(s.inputs) & made[1 - s.stage]), s.stage
    # same step as plain jax.jit (where accumulate is a lax.scan)
    want = jax.jit(step)(params, st, batch)
    assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
