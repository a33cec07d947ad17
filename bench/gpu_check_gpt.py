"""A one-rank pipelined GPT step (baton.jit) against jax.jit of the same step on a GPU:
results to rtol 1e-5 (f32 matmuls at "highest" precision in both) and ms/step. Run by
bench/gpu_check.py with examples/ on PYTHONPATH; prints an ``equal:`` and a ``time:`` line."""

import statistics, time
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
import baton, gpt
assert jax.default_backend() == "gpu", jax.default_backend()
m, mb = 8, 8
cfg = gpt.GPTConfig(vocab=512, seq=128, dim=256, heads=4, layers=4, stages=1)
model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
batch = gpt.synthetic_batch(cfg, mb * m)
base = jax.jit(gpt.scan_step(model, opt, m))
step = baton.jit(train_step, schedule=baton.OneFOneB(), microbatches=m,
                 mesh=baton.PipelineMesh(jax.devices()[:1], ranks=1))
want = jax.block_until_ready(base(params, opt_state, batch))
got = jax.block_until_ready(step(params, opt_state, batch))
la, lb = jax.tree.leaves(got), jax.tree.leaves(want)
assert len(la) == len(lb)
worst = 0.0
for a, b in zip(la, lb):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    worst = max(worst, float(np.max(np.abs(a - b) / (np.abs(b) + 1e-7), initial=0.0)))

def timed(fn, n=10):
    jax.block_until_ready(fn(params, opt_state, batch))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(params, opt_state, batch))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3

tb, ts = timed(base), timed(step)
print(f"equal: rtol 1e-5 ({len(la)} arrays, worst rel {worst:.1e})")
print(f"time: jax.jit {tb:.2f} ms/step, baton 1 rank {ts:.2f} ms/step ({ts / tb:.2f}x); "
      f"GPT dim {cfg.dim} seq {cfg.seq} layers {cfg.layers}, {m} x {mb}")
