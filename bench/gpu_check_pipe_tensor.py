"""Pipe 2 x tensor 2 on 4 GPUs in one process (run by bench/gpu_check.sh; needs 4 GPUs).

Two pipeline ranks of two GPUs each, the GPT's parameters tensor-parallel over ``tensor``:
each rank's program runs SPMD over its two GPUs, and its transfers go over NCCL with one
context per device slot (GPU j of rank 0 exchanges with GPU j of rank 1). The step must run on
the compiled engine over NCCL (no refusal) and equal the plain ``jax.jit`` of the same step.
Prints one summary line last; exits non-zero on any failure.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import baton  # noqa: E402

sys.path.insert(0, "examples")
import gpt  # noqa: E402


def main() -> None:
    assert jax.default_backend() == "gpu", jax.default_backend()
    devs = jax.devices()
    assert len(devs) >= 4, f"needs 4 GPUs, found {len(devs)}"
    m = 4
    cfg = gpt.GPTConfig(vocab=512, seq=128, dim=256, heads=4, layers=4, stages=2)
    model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, 8 * m)
    base = jax.jit(gpt.scan_step(model, opt, m))
    mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("pipe", "tensor"))
    step = baton.jit(train_step, mesh=baton.PipelineMesh(mesh, axis="pipe"),
                     schedule=baton.OneFOneB(), microbatches=m,
                     param_shardings=gpt.param_specs(params, tensor="tensor"), timeout=120)
    assert step.loop_transport() == "nccl", step.loop_transport()
    want = jax.block_until_ready(base(params, opt_state, batch))
    got = jax.block_until_ready(step(params, opt_state, batch))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=1e-5, atol=1e-7)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(step(params, opt_state, batch))
        ts.append(time.perf_counter() - t)
    print(f"pipe 2 x tensor 2: equal to jax.jit (rtol 1e-5), 1F1B {m} microbatches, "
          f"{statistics.median(ts) * 1e3:.2f} ms/step")


if __name__ == "__main__":
    main()
