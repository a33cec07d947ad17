"""Stage boundaries proposed by Baton for a model written without any (``baton.auto_stage``).

The model: an embedding, 8 residual layers (with a batch mask every layer reads) and a head,
no ``stage_boundary``. Baton finds the cut points between the layers, picks the 3 that balance
4 stages, and the pipelined step matches plain JAX (loss, gradients, parameters; rtol 1e-5).
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402

D = 16
OPT = optax.adamw(1e-2, eps=1e-6, weight_decay=0.01)


def loss_fn(params, batch):
    x = batch["x"] @ params["emb"]
    mask = batch["m"] > 0  # cheap batch-only work: recomputed, not a cut
    for w in params["layers"]:
        x = x + jnp.tanh(x @ w) * mask
    return ((x @ params["head"] - batch["y"]) ** 2).mean()


def init():
    ks = jax.random.split(jax.random.PRNGKey(0), 10)
    return {"emb": jax.random.normal(ks[0], (D, D)) / 4,
            "layers": [jax.random.normal(k, (D, D)) / 4 for k in ks[1:9]],
            "head": jax.random.normal(ks[9], (D, 1)) / 4}


def batch_of(n=16):
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    return {"x": jax.random.normal(ks[0], (n, D)), "y": jax.random.normal(ks[1], (n, 1)),
            "m": jax.random.normal(ks[2], (n, D))}


def test_cut_points_are_between_the_layers():
    params, batch = init(), batch_of()
    every = baton.auto_stage(loss_fn)
    np.testing.assert_allclose(every(params, batch), loss_fn(params, batch), rtol=1e-6)
    assert len(every.cuts) == 9  # after the embedding and after each of the 8 layers
    assert all(c.shape == (16, D) and c.after == "add" for c in every.cuts[1:])
    four = baton.auto_stage(loss_fn, stages=4)
    four(params, batch)
    assert len(four.cuts) == 3
    assert {c.position for c in four.cuts} <= {c.position for c in every.cuts}
    assert "test_autostage.py" in str(four.cuts[0])
    with pytest.raises(baton.TraceError, match="cut points"):
        baton.auto_stage(loss_fn, stages=12)(params, batch)


@pytest.mark.parametrize("schedule", [baton.OneFOneB(), baton.ZBH1()], ids=["1f1b", "zbh1"])
def test_auto_staged_model_trains_like_plain_jax(schedule):
    staged = baton.auto_stage(loss_fn, stages=4)

    def step(fn, pipelined):
        vg = jax.value_and_grad(fn)

        def s(params, opt_state, batch):
            loss, grads = (baton.accumulate(vg, params, batch=batch) if pipelined
                           else vg(params, batch))
            updates, opt_state = OPT.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, grads
        return s

    mesh = baton.PipelineMesh(jax.devices()[:4], ranks=4)
    ps = baton.jit(step(staged, True), mesh=mesh, schedule=schedule, microbatches=4)
    ref = jax.jit(step(loss_fn, False))
    params, batch = init(), batch_of()
    p1 = p2 = params
    s1 = s2 = OPT.init(params)
    for _ in range(2):
        p1, s1, l1, g1 = ps(p1, s1, batch)
        p2, s2, l2, g2 = ref(p2, s2, batch)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        for a, b in zip(jax.tree.leaves((g1, p1)), jax.tree.leaves((g2, p2)), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert ps.last.num_stages == 4
