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


def _ancestors(ops, vals) -> set[int]:
    """The ops (indices) that the values ``vals`` are computed from, within ``ops``."""
    maker = {v: i for i, op in enumerate(ops) for v in op.outputs}
    seen, todo = set(), [maker[v] for v in vals if v in maker]
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo += [maker[v] for v in ops[i].inputs if v in maker]
    return seen


def test_only_what_other_stages_read_runs_before_a_stages_last_segment():
    """With global-norm clipping the stages exchange partial sums after the loop. A stage's
    segments before its last hold only the ops those exchanged values are computed from: Adam's
    moment decays (``b1 * mu``, ``b2 * nu``), which read nothing from another stage, wait in the
    last segment with the update that reads them (one kernel there instead of two)."""
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))
    ps, params, st, batch = make_train(baton.OneFOneB(), 2, opt)
    got = ps(params, st, batch)
    segs = ps.last.post_segments
    ops = ps.last.traced.ops
    last = {s.stage: j for j, s in enumerate(segs)}
    assert len(segs) > len(last), "clipping makes at least one stage exchange a value"
    made = {v: s.stage for s in segs for v in s.outputs}
    crossing = {v for s in segs for v in s.inputs if made.get(v, s.stage) != s.stage}
    assert crossing
    early_ops = set(_ancestors(ops, crossing))
    for j, s in enumerate(segs):
        if j != last[s.stage]:
            for v in s.outputs:  # every value an early segment makes feeds an exchange
                assert _ancestors(ops, [v]) <= early_ops, (s.stage, v)
    want = jax.jit(ps.fn)(params, st, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
