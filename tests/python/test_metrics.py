"""Training metrics (``baton.metrics``): model FLOPs counted from the traced step, and the
TensorBoard event file ``examples/train_lm.py`` writes, read back with TensorBoard's own
reader: step time, tokens/s, MFU, each rank's idle fraction and memory peak."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import baton
from baton import metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
B, D, L = 8, 8, 4


def _loss(params, batch):
    x, y = batch
    for i, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if i < len(params) - 1:
            x = baton.stage_boundary(x)
    return jnp.mean((x - y) ** 2)


def _step(params, batch):
    return baton.accumulate(jax.value_and_grad(_loss), params, batch=batch)


def test_model_flops_counts_the_matmuls_of_forward_and_backward():
    """L layers x@w on a (B, D) batch: forward 2BD^2 per layer, backward 2BD^2 for dW and
    2BD^2 for dx except at the first layer (the batch has no gradient): 6BD^2L - 2BD^2,
    whatever the microbatch count."""
    params = [jnp.eye(D) * 0.5 for _ in range(L)]
    batch = (jnp.ones((B, D)), jnp.zeros((B, D)))
    for m in (1, 4):
        fn = baton.jit(_step, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2),
                       microbatches=m, layout=baton.Layout())
        fn.compile(params, batch)
        assert metrics.model_flops(fn) == 6 * B * D * D * L - 2 * B * D * D


def test_step_metrics_before_a_call_is_refused():
    fn = baton.jit(_step, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2))
    with pytest.raises(baton.ConfigError, match="not been compiled"):
        metrics.model_flops(fn)


def test_train_lm_writes_tensorboard_metrics(tmp_path):
    """examples/train_lm.py --tensorboard: every measured step has step time, tokens/s, MFU,
    and for both ranks the idle fraction and memory peak, all in their physical range."""
    pytest.importorskip("tensorboard", reason="the event file reader (tensorboard) is a "
                        "test dependency: scripts/setup.sh installs it")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    args = ["--ranks", "2", "--schedule", "ZBVZeroBubble", "--microbatch-size", "2",
            "--batch", "8", "--seq", "16", "--dim", "32", "--heads", "2", "--layers", "4",
            "--steps", "3", "--tensorboard", str(logdir)]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "train_lm.py"), *args],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    n_params = int(re.search(r"\(([\d,]+) parameters\)", p.stdout)[1].replace(",", ""))

    ea = EventAccumulator(str(logdir))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    want = {"step/time_s", "step/tokens_per_s", "step/mfu", "step/model_flops", "loss",
            "rank0/idle", "rank1/idle", "rank0/memory_peak_bytes", "rank1/memory_peak_bytes"}
    assert want <= tags, tags

    def values(tag):
        return {e.step: e.value for e in ea.Scalars(tag)}

    assert sorted(values("step/time_s")) == [2, 3]  # the first call compiles: not measured
    tokens = 8 * 16
    for s, t in values("step/time_s").items():
        assert 0 < t < 60
        assert values("step/tokens_per_s")[s] == pytest.approx(tokens / t, rel=1e-3)
        assert 0 < values("step/mfu")[s] <= 1
        for r in (0, 1):
            assert 0 <= values(f"rank{r}/idle")[s] < 1
            # at least the rank's share of the parameters (fp32) and AdamW's two moments
            mem = values(f"rank{r}/memory_peak_bytes")[s]
            assert 4 * 3 * n_params / 4 < mem < 1e9, (r, mem, n_params)
    # matmul FLOPs: 6 per parameter per token (forward and backward), plus attention's
    # scores and mixing (12 x layers x seq x dim per token), minus the embedding's lookup
    flops = next(iter(values("step/model_flops").values()))
    approx = 6 * n_params * tokens + 12 * 4 * 16 * 32 * tokens
    assert 0.7 * approx < flops < 1.3 * approx, (flops, approx)
