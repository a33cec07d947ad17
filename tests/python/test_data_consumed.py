"""Data read where it is consumed (``baton.data``) and a Grain pipeline's state in the
checkpoint. (Across processes, the middle stages never calling the reader:
``test_init_stages.test_launched_memory_stays_per_stage``.)"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton import checkpoint as ckpt  # noqa: E402

import grain  # noqa: E402  (in scripts/setup.sh's requirements)

from test_init_stages import make  # noqa: E402

W = 8


def pipeline():
    """64 records, batches of 8 rows: {"x", "y"} float32."""
    rows = np.arange(64 * W, dtype=np.float32).reshape(64, W) / 100.0
    ds = grain.MapDataset.source(rows).map(lambda r: {"x": r, "y": np.cos(r)})
    return ds.batch(8, drop_remainder=True)


def compiled():
    init, step, spec = make(W)
    fn = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:4], ranks=4), microbatches=4)
    key = jax.random.PRNGKey(0)
    fn.compile(*baton.abstract_state(init, key), spec)
    return fn, baton.init_stages(fn, init, key)


def test_consumers_and_feed_checks():
    fn, _ = compiled()
    homes = baton.data.consumers(fn, 2)
    assert [(h.path, h.stages) for h in homes] == [("['x']", (0,)), ("['y']", (3,))]
    with pytest.raises(baton.ConfigError, match=r"batch leaf \['x'\] is float32\[4, 8\]"):
        baton.data.feed(fn, 2, lambda: {"x": jnp.zeros((4, W)), "y": jnp.zeros((8, W))})
    with pytest.raises(baton.ConfigError, match="argnum must name one of the step's 3"):
        baton.data.consumers(fn, 5)


def test_grain_state_restores_the_same_batches(tmp_path):
    fn, state = compiled()
    feed = baton.data.GrainFeed(fn, 2, pipeline())
    for i in range(2):
        *state, _ = fn(*state, next(feed))
    ckpt.save(tmp_path, 2, tuple(state), fn, data=feed.get_state(), wait=True)
    after = [next(feed) for _ in range(3)]
    again = baton.data.GrainFeed(fn, 2, pipeline())
    again.set_state(ckpt.restore_data(tmp_path, fn=fn))
    for want in after:
        got = next(again)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(after[0]["x"]), np.asarray(pipeline()[0]["x"]))
