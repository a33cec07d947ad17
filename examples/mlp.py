"""A small MLP cut into pipeline stages (plain JAX), trained with Optax AdamW.

Options exercise what a stage may contain: ``remat`` wraps each layer in
``jax.checkpoint``; ``scan`` runs a stage's layers with ``lax.scan`` over stacked
weights; ``aux`` makes the loss function also return a per-microbatch metric that
``baton.accumulate(..., reduce=(("mean", "stack"), "mean"))`` stacks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import baton


def init_params(key, stages: int, layers_per_stage: int = 1, dim: int = 16, scan: bool = False):
    params = []
    for s in range(stages):
        ks = jax.random.split(jax.random.fold_in(key, s), layers_per_stage)
        ws = [jax.random.normal(k, (dim, dim)) / jnp.sqrt(dim) for k in ks]
        bs = [jnp.zeros((dim,)) for _ in ks]
        if scan:
            params.append({"w": jnp.stack(ws), "b": jnp.stack(bs)})
        else:
            params.append([{"w": w, "b": b} for w, b in zip(ws, bs)])
    return params


def layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def forward(params, x, remat: bool = False, scan: bool = False):
    f = jax.checkpoint(layer) if remat else layer
    h = x
    for s, stage in enumerate(params):
        if scan:
            h, _ = jax.lax.scan(lambda c, p: (f(p, c), None), h, stage)
        else:
            for p in stage:
                h = f(p, h)
        if s < len(params) - 1:
            h = baton.stage_boundary(h)
    return h


def make_loss(remat: bool = False, scan: bool = False, aux: bool = False):
    def loss_fn(params, batch):
        x, y = batch
        out = forward(params, x, remat, scan)
        loss = jnp.mean((out - y) ** 2)
        if aux:
            return loss, jnp.mean(jnp.abs(out))
        return loss

    return loss_fn


def make_steps(loss_fn, opt, aux: bool = False):
    """(pipelined-style step using baton.accumulate, single-device reference step)."""
    vg = jax.value_and_grad(loss_fn, has_aux=aux)
    reduce = (("mean", "stack"), "mean") if aux else "mean"

    def train_step(params, opt_state, batch):
        out, grads = baton.accumulate(vg, params, batch=batch, reduce=reduce)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    def reference_step(params, opt_state, batch):
        out, grads = vg(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    return train_step, reference_step


def synthetic_batch(key, batch: int = 16, dim: int = 16):
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (batch, dim)), jnp.sin(jax.random.normal(ky, (batch, dim)))
