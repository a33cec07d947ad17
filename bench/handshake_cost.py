"""Cost of the whole-program handshake's description (``handshake.describe``) next to the
trace and plan of the same step: the GPT example, 8 layers, 4 stages, 1F1B, 4 microbatches,
on 8 CPU devices in one process. Prints one line; run from the repository root:

    .venv/bin/python bench/handshake_cost.py
"""
import os
import sys
import time

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import jax  # noqa: E402

import baton  # noqa: E402
import gpt  # noqa: E402
from baton.running import handshake  # noqa: E402

cfg = gpt.GPTConfig(stages=4, layers=8)
model, params, opt, st, step, ref = gpt.make(cfg, eps=1e-6)
batch = gpt.synthetic_batch(cfg, 8)
fn = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:4], ranks=4),
               schedule=baton.OneFOneB(), microbatches=4)
t0 = time.perf_counter()
cs = fn.compile(params, st, batch)
t1 = time.perf_counter()
comps = handshake.describe(fn, cs)
t2 = time.perf_counter()
digest = {n: handshake._hash(lines) for n, lines in comps}
t3 = time.perf_counter()
lines = [x for _, ls in comps for x in ls]
print(f"compile (trace+plan) {t1 - t0:.2f}s describe {t2 - t1:.3f}s hash {t3 - t2:.4f}s; "
      f"{len(comps)} components, {len(lines)} lines, {sum(map(len, lines)) / 1e3:.0f} kB")
