"""Flax NNX layer stacks under ``nnx.scan`` cut into pipeline stages (``baton.nnx_scan_stages``).

The model keeps 8 layers as one module made with ``nnx.vmap`` (every weight with a leading
layer axis) and runs them with an ``nnx.scan``-transformed function. The plain-JAX reference
calls that function on the whole stack under ``jax.jit``; the pipelined step calls it once per
stage group (4 stages) under ``baton.jit``. Losses, gradients and parameters agree over 3 AdamW
steps (rtol 1e-5) under 1F1B and ZB-H1, with the stack split per stage (``split_stacks`` on
the ``nnx.State``: each rank holds only its layers) and with the stack whole.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

nnx = pytest.importorskip("flax.nnx")

import baton  # noqa: E402

D, L, STAGES = 16, 8, 4
OPT = optax.adamw(1e-2, eps=1e-6, weight_decay=0.01)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(self.norm(x)))


@nnx.split_rngs(splits=L)
@nnx.vmap(in_axes=(0,), out_axes=0)
def make_blocks(rngs):
    return Block(rngs)


@nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
def forward(x, block):
    return block(x)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(D, D, rngs=rngs)
        self.blocks = make_blocks(rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x, stages=None):
        x = self.embed(x)
        if stages is None:
            x = forward(x, self.blocks)                        # the model as written
        else:
            x = baton.nnx_scan_stages(forward, x, self.blocks, stages)
        return self.head(x)


def batch_of(n=16):
    k1, k2 = jax.random.split(jax.random.PRNGKey(4))
    return {"x": jax.random.normal(k1, (n, D)), "y": jax.random.normal(k2, (n, 1))}


def model_parts():
    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    return graphdef, params


def split_blocks(params):
    """``params`` with the stack's arrays split into one piece per stage."""
    out = jax.tree.map(lambda x: x, params)  # a copy of the nnx.State, same structure
    out["blocks"] = baton.split_stacks(params["blocks"], STAGES)
    return out


def loss_of(graphdef, stages):
    def loss(params, batch):
        model = nnx.merge(graphdef, params)
        return ((model(batch["x"], stages) - batch["y"]) ** 2).mean()

    return loss


def step_of(loss_fn, pipelined):
    vg = jax.value_and_grad(loss_fn)

    def step(params, opt_state, batch):
        loss, grads = baton.accumulate(vg, params, batch=batch) if pipelined else vg(params, batch)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step


def test_groups_outside_jit_equal_one_scan():
    graphdef, params = model_parts()
    batch = batch_of()
    want = loss_of(graphdef, None)(params, batch)
    np.testing.assert_allclose(loss_of(graphdef, STAGES)(params, batch), want, rtol=1e-6)
    split = split_blocks(params)
    np.testing.assert_allclose(loss_of(graphdef, STAGES)(split, batch), want, rtol=1e-6)
    groups = baton.nnx_stack_groups(nnx.merge(graphdef, split).blocks)
    assert [g.lin.kernel.shape for g in groups] == [(2, D, D)] * STAGES
    joined = baton.join_stacks(split)
    np.testing.assert_array_equal(joined["blocks"]["lin"]["kernel"],
                                  params["blocks"]["lin"]["kernel"])


def test_bad_stacks_are_refused():
    graphdef, params = model_parts()
    model = nnx.merge(graphdef, params)
    with pytest.raises(baton.ConfigError, match="9 stages for 8 layers"):
        baton.nnx_scan_stages(forward, jnp.ones((2, D)), model.blocks, 9)
    with pytest.raises(baton.ConfigError, match="pass stages="):
        baton.nnx_scan_stages(forward, jnp.ones((2, D)), model.blocks)
    with pytest.raises(baton.ConfigError, match="must be an nnx.Module"):
        baton.nnx_scan_stages(forward, jnp.ones((2, D)), {"w": jnp.ones((L, D))}, 2)

    class Sowing(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            y = self.lin(x)
            self.sow(nnx.Intermediate, "act", y.mean())
            return y

    make = nnx.split_rngs(splits=4)(nnx.vmap(Sowing, in_axes=(0,), out_axes=0))
    stack = make(nnx.Rngs(1))
    run = nnx.scan(lambda x, b: b(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    with pytest.raises(baton.ConfigError, match="created variables inside the stack"):
        baton.nnx_scan_stages(run, jnp.ones((2, D)), stack, 2)


@pytest.mark.parametrize("split,schedule", [(True, baton.OneFOneB()), (False, baton.ZBH1()),
                                            pytest.param(True, baton.ZBH1(),
                                                         marks=pytest.mark.heavy)],
                         ids=["split-1f1b", "whole-zbh1", "split-zbh1"])
def test_nnx_scan_stack_in_four_stages_matches_plain_jax(split, schedule):
    graphdef, params = model_parts()
    batch = batch_of()
    mine = split_blocks(params) if split else params
    mesh = baton.PipelineMesh(jax.devices()[:4], ranks=4)
    ps = baton.jit(step_of(loss_of(graphdef, STAGES), True), mesh=mesh, schedule=schedule,
                   microbatches=4)
    ref = jax.jit(step_of(loss_of(graphdef, None), False))
    p1, s1, p2, s2 = mine, OPT.init(mine), params, OPT.init(params)
    for _ in range(3):
        p1, s1, l1, g1 = ps(p1, s1, batch)
        p2, s2, l2, g2 = ref(p2, s2, batch)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        for got, want in ((g1, g2), (p1, p2)):
            got = baton.join_stacks(got)
            assert jax.tree.structure(got) == jax.tree.structure(want)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    step = ps.last
    assert step.traced.num_stages == STAGES
    if split:  # each stage's layers and their Adam moments live on the rank that runs them
        stacks = [x for x in jax.tree.leaves((p1, s1), is_leaf=lambda x: isinstance(
            x, baton.Stacked)) if isinstance(x, baton.Stacked)]
        assert len(stacks) == 4 * 3  # kernel, bias, norm scale and bias; params, mu, nu
        for x in stacks:
            for g, piece in enumerate(x.pieces):
                want = set(step.mesh.rank_devices[step.stage_rank[g]])
                assert piece.sharding.device_set == want, (g, piece.sharding)
