"""``baton.jit(donate_argnums=...)``: the optimizer update after the loop writes the new
parameters and optimizer state into the donated buffers (in place, as ``jax.jit`` does), the
donated arrays are deleted by the call, and the results are those of the step without
donation, bit for bit."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest

import baton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import gpt  # noqa: E402


def _steps(ranks, schedule, donate, steps=3):
    stages = schedule.stages(ranks)
    cfg = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=stages, stages=stages)
    _, params, _, st, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, 8)
    ps = baton.jit(train_step, mesh=baton.PipelineMesh(jax.devices()[:ranks], ranks=ranks),
                   schedule=schedule, microbatches=4, donate_argnums=(0, 1) if donate else ())
    p, s = params, st
    deleted = []
    for _ in range(steps):
        prev = (p, s)
        p, s, loss = ps(p, s, batch)
        jax.block_until_ready((p, s, loss))
        deleted.append([x.is_deleted() for x in jax.tree.leaves(prev)])
    return ps, (p, s, loss), deleted


@pytest.mark.parametrize("ranks,schedule", [(2, baton.OneFOneB()),
                                            pytest.param(2, baton.ZBH1(), marks=pytest.mark.heavy),
                                            (1, baton.OneFOneB())],
                         ids=["2-ranks-1f1b", "2-ranks-zbh1", "1-rank"])
def test_donated_arguments_are_updated_in_place(ranks, schedule):
    ps, got, deleted = _steps(ranks, schedule, donate=True)
    _, want, kept = _steps(ranks, schedule, donate=False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not any(any(d) for d in kept)  # without donation nothing is consumed
    # call 1 placed the caller's uncommitted arrays (copies: those were donated); from call 2
    # on the arguments are the previous step's outputs, and every one is consumed
    assert all(deleted[1]) and all(deleted[2]), deleted


def test_measuring_a_donating_step_keeps_the_arguments():
    """baton.profile and step.memory run steps on the caller's arguments more than once: a
    donating step copies them first, so the caller's stay valid."""
    stages = 2
    cfg = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=stages, stages=stages)
    _, params, _, st, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, 8)
    ps = baton.jit(train_step, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2),
                   schedule=baton.OneFOneB(), microbatches=4, donate_argnums=(0, 1))
    p, s, _ = ps(params, st, batch)
    prof = baton.profile(ps, p, s, batch, runs=2)
    assert prof.measured["step_time"] > 0
    mem = ps.memory(p, s, batch, measure=True)
    assert mem.measured
    assert not any(x.is_deleted() for x in jax.tree.leaves((p, s)))
    p2, s2, _ = ps(p, s, batch)  # and a real step still consumes them
    assert all(x.is_deleted() for x in jax.tree.leaves((p, s)))


def test_bad_donate_argnums_is_a_config_error():
    with pytest.raises(baton.ConfigError, match="donate_argnums"):
        baton.jit(lambda p: p, mesh=baton.PipelineMesh(jax.devices()[:1], ranks=1),
                  donate_argnums=(-1,))
