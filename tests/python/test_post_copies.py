"""Small post-loop values that depend only on step inputs (Adam's step count and bias
corrections) are computed by every stage that reads them, so no stage's optimizer update waits
for another stage's: the post-loop segments of different stages exchange nothing, and the
results still equal plain JAX."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import baton  # noqa: E402
from mlp_step import make_train  # noqa: E402


def test_adam_bias_corrections_are_computed_on_every_stage():
    opt = optax.adam(1e-2)
    ps, params, st, batch = make_train(baton.OneFOneB(), 2, opt)
    got = ps(params, st, batch)
    c = ps.last
    segs = c.post_segments
    assert sorted(s.stage for s in segs) == [0, 1]
    made = {s.stage: set(s.outputs) for s in segs}
    for s in segs:  # no segment reads what another stage's segment makes
        assert not (set(s.inputs) & made[1 - s.stage]), s.stage
    # same step as plain jax.jit (where accumulate is a lax.scan)
    want = jax.jit(ps.fn)(params, st, batch)
    assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
