"""Python's garbage collector held back while a step builds (``running/gc_hold.py``)."""

from __future__ import annotations

import gc
import os
import threading

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton.running.gc_hold import BUILD_THRESHOLD, held  # noqa: E402


@pytest.fixture
def default_threshold():
    old = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*old)


def test_held_raises_gen0_threshold_and_restores_it(default_threshold):
    with held():
        assert gc.get_threshold() == (BUILD_THRESHOLD, 10, 10)
        with held():  # nested: the outer one restores
            assert gc.get_threshold()[0] == BUILD_THRESHOLD
        assert gc.get_threshold()[0] == BUILD_THRESHOLD
    assert gc.get_threshold() == (700, 10, 10)
    with held(False):
        assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(RuntimeError):
        with held():
            raise RuntimeError("a failed build")
    assert gc.get_threshold() == (700, 10, 10)


def test_held_leaves_a_disabled_or_higher_threshold(default_threshold):
    gc.set_threshold(0)  # automatic collection off: stays off
    with held():
        assert gc.get_threshold()[0] == 0
    gc.set_threshold(10 * BUILD_THRESHOLD, 10, 10)
    with held():
        assert gc.get_threshold()[0] == 10 * BUILD_THRESHOLD
    assert gc.get_threshold()[0] == 10 * BUILD_THRESHOLD


def test_overlapping_holds_on_threads_restore_the_first_threshold(default_threshold):
    """Two builds on two threads whose holds overlap but do not nest: the threshold stays
    raised until both end, then is the one found before the first."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with held():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with held():
            b_in.set()
            a_out.wait(10)
            seen["after a"] = gc.get_threshold()[0]

    ts = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert seen["after a"] == BUILD_THRESHOLD
    assert gc.get_threshold() == (700, 10, 10)


def _step(seen):
    def loss_fn(params, batch):
        seen.append(gc.get_threshold()[0])  # (runs while the step is traced)
        h = jnp.tanh(batch @ params[0])
        h = baton.stage_boundary(h)
        return jnp.mean(jnp.tanh(h @ params[1]) ** 2)

    def step(params, batch):
        loss, grads = baton.accumulate(jax.value_and_grad(loss_fn), params, batch=batch)
        return [p - 0.1 * g for p, g in zip(params, grads)], loss

    return step


@pytest.mark.parametrize("hold", [True, False])
def test_first_call_builds_with_the_collector_held(default_threshold, monkeypatch, hold):
    """The trace (the model's code runs) and the rank programs' lowering (the first run)
    see the raised threshold; the call ends with it restored."""
    from baton.emit.rank_program import RankProgram

    seen, lowered = [], []
    lower = RankProgram.lower

    def recording(self, vals):
        lowered.append(gc.get_threshold()[0])
        return lower(self, vals)

    monkeypatch.setattr(RankProgram, "lower", recording)
    k = jax.random.PRNGKey(0)
    params = [jax.random.normal(k, (8, 8)) * 0.1, jax.random.normal(k, (8, 8)) * 0.1]
    batch = jnp.ones((8, 8))
    mesh = baton.PipelineMesh(jax.devices()[:2], ranks=2)
    fn = baton.jit(_step(seen), mesh=mesh, schedule=baton.OneFOneB(), microbatches=2,
                   hold_gc=hold)
    new, loss = fn(params, batch)
    assert seen and set(seen) == {BUILD_THRESHOLD if hold else 700}
    assert len(lowered) == 2 and set(lowered) == {BUILD_THRESHOLD if hold else 700}
    assert gc.get_threshold() == (700, 10, 10)
    assert fn.last.runs == 1
    fn(params, batch)
    assert fn.last.runs == 2 and gc.get_threshold() == (700, 10, 10)
    want_loss = jnp.mean(jnp.tanh(jnp.tanh(batch @ params[0]) @ params[1]) ** 2)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
