"""Layer stacks under lax.scan cut into pipeline stages (``baton.scan_stages``).

An 8-layer stack (stacked weights, one ``lax.scan``) cut into 4 stages matches the unrolled
plain-JAX model: losses, gradients and parameters over 2 AdamW steps, rtol 1e-5. With
``split_stacks`` each rank holds only its own layers; with plain stacked arrays the stages
read their layers from the whole stack.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402

D, L = 16, 8
OPT = optax.adamw(1e-2, eps=1e-6, weight_decay=0.01)


def init():
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    return {"emb": jax.random.normal(ks[0], (D, D)) / 4,
            "layers": {"w": jax.random.normal(ks[1], (L, D, D)) / 4,
                       "b": jax.random.normal(ks[2], (L, D)) / 10},
            "head": jax.random.normal(ks[3], (D, 1)) / 4}


def block(x, layer):
    return x + jnp.tanh(x @ layer["w"] + layer["b"])


def scanned_loss(params, batch):
    x = batch["x"] @ params["emb"]
    x = baton.scan_stages(block, x, params["layers"], stages=4)
    return ((x @ params["head"] - batch["y"]) ** 2).mean()


def unrolled_loss(params, batch):
    """The same model written without scan: a Python loop over the layers."""
    x = batch["x"] @ params["emb"]
    for i in range(L):
        x = block(x, jax.tree.map(lambda a: a[i], params["layers"]))
    return ((x @ params["head"] - batch["y"]) ** 2).mean()


def batch_of(n=16):
    k1, k2 = jax.random.split(jax.random.PRNGKey(4))
    return {"x": jax.random.normal(k1, (n, D)), "y": jax.random.normal(k2, (n, 1))}


def step_of(loss_fn, pipelined):
    vg = jax.value_and_grad(loss_fn)

    def step(params, opt_state, batch):
        loss, grads = baton.accumulate(vg, params, batch=batch) if pipelined else vg(params, batch)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step


def test_scan_stages_outside_jit_is_one_scan():
    params, batch = init(), batch_of()
    np.testing.assert_allclose(scanned_loss(params, batch), unrolled_loss(params, batch),
                               rtol=1e-6)
    split = dict(params, layers=baton.split_stacks(params["layers"], 4))
    np.testing.assert_allclose(scanned_loss(split, batch), unrolled_loss(params, batch),
                               rtol=1e-6)
    assert split["layers"]["w"].sizes == [2, 2, 2, 2]
    np.testing.assert_array_equal(baton.join_stacks(split)["layers"]["w"], params["layers"]["w"])


@pytest.mark.parametrize("split,schedule,ranks", [(True, baton.OneFOneB(), 4),
                                                  (False, baton.ZBH1(), 4),
                                                  (True, baton.ZBV(), 2)],
                         ids=["split-1f1b", "plain-zbh1", "split-zbv"])
def test_scanned_stack_in_four_stages_matches_unrolled(split, schedule, ranks):
    params, batch = init(), batch_of()
    mine = dict(params, layers=baton.split_stacks(params["layers"], 4)) if split else params
    mesh = baton.PipelineMesh(jax.devices()[:ranks], ranks=ranks)
    ps = baton.jit(step_of(scanned_loss, True), mesh=mesh, schedule=schedule, microbatches=4)
    ref = jax.jit(step_of(unrolled_loss, False))
    p1, s1, p2, s2 = mine, OPT.init(mine), params, OPT.init(params)
    for _ in range(2):
        p1, s1, l1, g1 = ps(p1, s1, batch)
        p2, s2, l2, g2 = ref(p2, s2, batch)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        for got, want in ((g1, g2), (p1, p2)):
            got = baton.join_stacks(got)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    step = ps.last
    if split:
        # each stage's layers (and their optimizer state) live on the rank that runs them only
        stacks = [x for x in jax.tree.leaves((p1, s1), is_leaf=lambda x: isinstance(
            x, baton.Stacked)) if isinstance(x, baton.Stacked)]
        assert len(stacks) == 6  # w and b, and Adam's mu and nu of each
        for x in stacks:
            for g, piece in enumerate(x.pieces):
                want = set(step.mesh.rank_devices[step.stage_rank[g]])
                assert piece.sharding.device_set == want, (g, piece.sharding)


def test_stacks_split_along_another_axis():
    w = jnp.arange(3 * 8 * 2, dtype=jnp.float32).reshape(3, 8, 2)  # layers on axis 1
    split = baton.split_stacks({"w": w, "b": jnp.ones((8,))}, 4,
                               axis=lambda path, x: 1 if x.ndim > 1 else 0)
    assert split["w"].sizes == [2, 2, 2, 2] and split["w"].axis == 1
    assert split["w"].shape == w.shape and split["b"].axis == 0
    np.testing.assert_array_equal(split["w"].pieces[1], w[:, 2:4])
    np.testing.assert_array_equal(baton.join_stacks(split)["w"], w)
    # a pytree round trip keeps the axis
    again = jax.tree.map(lambda x: x + 0, split)
    assert again["w"].axis == 1
    with pytest.raises(baton.ConfigError, match="another axis"):
        baton.scan_stages(lambda c, layer: c, jnp.zeros(()), split)
    with pytest.raises(baton.ConfigError, match="has no axis 3"):
        baton.split_stacks(w, 2, axis=3)
