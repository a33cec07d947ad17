"""The small pipelined training step several tests share: examples/mlp.py cut into
``schedule.stages(ranks)`` stages, ``accumulate(value_and_grad(loss))`` over the batch."""

from __future__ import annotations

import os
import sys

import jax

import baton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import mlp  # noqa: E402


def make(schedule, ranks, microbatches, seed=0, layers_per_stage=1, **kw):
    """(baton.jit step, params, batch); ``kw`` goes to ``baton.jit``."""
    key = jax.random.PRNGKey(seed)
    params = mlp.init_params(key, schedule.stages(ranks), layers_per_stage=layers_per_stage)
    batch = mlp.synthetic_batch(key, 4 * microbatches)
    vg = jax.value_and_grad(mlp.make_loss())
    ps = baton.jit(lambda p, b: baton.accumulate(vg, p, batch=b),
                   mesh=baton.PipelineMesh(jax.devices()[:ranks], ranks=ranks),
                   schedule=schedule, microbatches=microbatches, **kw)
    return ps, params, batch


def make_train(schedule, ranks, opt, microbatches=4, seed=1, batch_size=16, **kw):
    """(baton.jit step: ``accumulate`` then an Optax update, params, optimizer state, batch);
    ``kw`` goes to ``baton.jit``."""
    import optax

    key = jax.random.PRNGKey(seed)
    params = mlp.init_params(key, schedule.stages(ranks))
    batch = mlp.synthetic_batch(key, batch_size)
    vg = jax.value_and_grad(mlp.make_loss())

    def step(p, st, b):
        loss, g = baton.accumulate(vg, p, batch=b)
        upd, st = opt.update(g, st, p)
        return optax.apply_updates(p, upd), st, loss

    ps = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:ranks], ranks=ranks),
                   schedule=schedule, microbatches=microbatches, **kw)
    return ps, params, opt.init(params), batch
