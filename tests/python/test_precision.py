"""Precision of the microbatch sums: gradients of bfloat16 parameters are summed over the
microbatches in float32 (``accumulate(accumulate_dtype="float32")``, the default) and cast back
to bfloat16 once; ``accumulate_dtype=None`` sums in bfloat16. The sums are chosen so that
bfloat16 sums lose the small terms: 1 + 3 x 2^-8 is 1 in bfloat16 one term at a time (the
spacing of bfloat16 numbers at 1 is 2^-7) and 1.015625 when summed in float32 and rounded once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import baton

D = 4
BF = jnp.bfloat16
# one row per microbatch: 1, then three rows of 2^-8
X = jnp.array([[1.0] * D] + [[2.0 ** -8] * D] * 3, jnp.float32).astype(BF)
WIDE = float(jnp.asarray(1.0 + 3 * 2.0 ** -8, jnp.float32).astype(BF))  # 1.015625


def loss(params, x):
    h = baton.stage_boundary(params["a"] * x)
    return jnp.sum(params["b"] * h)  # d/da = b * x = x


def params():
    return {"a": jnp.ones((D,), BF), "b": jnp.ones((D,), BF)}


@pytest.mark.parametrize("dtype, want", [("float32", WIDE), (None, 1.0)])
def test_pipelined_sums(dtype, want):
    def step(p, x):
        return baton.accumulate(jax.grad(loss), p, batch=x, reduce="sum",
                                accumulate_dtype=dtype)

    fn = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2),
                   schedule="1f1b", microbatches=4)
    g = fn(params(), X)
    assert g["a"].dtype == BF  # cast back to the parameter's type
    np.testing.assert_array_equal(np.asarray(g["a"], np.float32), np.full(D, want, np.float32))


def test_sums_outside_a_pipeline_too():
    """The same rule in accumulate's plain lax.scan (outside baton.jit)."""
    g = baton.accumulate(jax.grad(loss), params(), batch=X, reduce="sum", microbatches=4)
    np.testing.assert_array_equal(np.asarray(g["a"], np.float32), np.full(D, WIDE))
    g = baton.accumulate(jax.grad(loss), params(), batch=X, reduce="sum", microbatches=4,
                         accumulate_dtype=None)
    np.testing.assert_array_equal(np.asarray(g["a"], np.float32), np.full(D, 1.0))


def test_float32_sums_stay_float32():
    p = jax.tree.map(lambda v: v.astype(jnp.float32), params())
    g = baton.accumulate(jax.grad(loss), p, batch=X.astype(jnp.float32), reduce="mean",
                         microbatches=4)
    assert g["a"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g["a"]), (1 + 3 * 2 ** -8) / 4, rtol=1e-7)


def test_token_weighted_loss_recipe():
    """The README's recipe: per-microbatch loss sums and token counts, reduce="sum", one
    division: equals plain JAX's mean over the real tokens of a padded batch, where
    reduce="mean" of per-microbatch means would not (the microbatches have 3 and 1 real rows)."""
    import optax

    def loss_terms(w, batch):
        x, y, mask = batch
        err = jnp.sum((jnp.tanh(baton.stage_boundary(x @ w["a"])) @ w["b"] - y) ** 2, axis=-1)
        return jnp.sum(err * mask), jnp.sum(mask)

    opt = optax.sgd(0.1)

    def step(w, st, batch):
        (loss_sum, count), grad_sum = baton.accumulate(
            jax.value_and_grad(loss_terms, has_aux=True), w, batch=batch, reduce="sum")
        grads = jax.tree.map(lambda g: g / count, grad_sum)
        upd, st = opt.update(grads, st, w)
        return optax.apply_updates(w, upd), st, loss_sum / count

    k = jax.random.split(jax.random.key(3), 4)
    w = {"a": jax.random.normal(k[0], (D, D)), "b": jax.random.normal(k[1], (D, D))}
    x, y = jax.random.normal(k[2], (8, D)), jax.random.normal(k[3], (8, D))
    mask = jnp.array([1, 1, 1, 0, 1, 0, 0, 0], jnp.float32)  # 3 + 1 real rows
    fn = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2), microbatches=2)
    new_w, _, loss = fn(w, opt.init(w), (x, y, mask))

    def ref(w):
        s, n = loss_terms(w, (x, y, mask))
        return s / n

    want_loss, g = jax.value_and_grad(ref)(w)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(new_w),
                         jax.tree.leaves(jax.tree.map(lambda p, d: p - 0.1 * d, w, g))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
