"""Pipelines composed with data parallelism on 8 CPU devices: tokens/s of the GPT for the same
global batch as pipe 4 x data 2, pipe 8, and data 8 (a plain ``jax.jit`` data-parallel step,
the batch sharded over the 8 devices, the microbatch loop a ``lax.scan``). Prints a table.

    python bench/spmd.py [--dim 128] [--seq 64] [--batch 32] [--microbatches 8] [--steps 5]
                         [--schedules 1f1b,zbh1] [--md bench/results/spmd.md]

* in one process: pipe 8 runs on the compiled engine (one device per rank); pipe 4 x data 2
  on the interpreter (``engine="interpreter"``: XLA:CPU runs one multi-device program at a time
  per process, so the compiled engine refuses ranks of several devices there);
* launched (``python -m baton.launch --nprocs 4``, 2 CPU devices per process): pipe 4 x data 2
  on the compiled engine, each rank's program SPMD over its 2 devices, shard-to-shard transfers.

Every row checks its first step's loss against the plain step's (rtol 1e-4). On this machine
(2 cores shared by all 8 "devices") the table measures overheads, not scaling. A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

WORKER = r'''
import json, os, sys, time
sys.path.insert(0, {examples!r})
import jax, numpy as np
from jax.sharding import Mesh
import baton, gpt
a = json.loads(sys.argv[1])
cfg = gpt.GPTConfig(vocab=256, seq=a["seq"], dim=a["dim"], heads=4, layers=8, stages=a["stages"])
model, params, opt, st, step, _ = gpt.make(cfg)
batch = gpt.synthetic_batch(cfg, a["batch"])
mesh = Mesh(np.array(jax.local_devices()), ("data",))
ps = baton.jit(step, mesh=mesh, schedule=baton.schedule_from_name(a["schedule"]),
               microbatches=a["microbatches"])
params, st, loss = ps(params, st, batch)
first = float(loss)
ts = []
for _ in range(a["steps"]):
    t = time.perf_counter()
    params, st, loss = ps(params, st, batch)
    jax.block_until_ready(loss)
    ts.append(time.perf_counter() - t)
if ps.rank == 0:
    print("RESULT " + json.dumps(dict(first=first, ts=ts, how=ps.last_run.stats.get(
        "rank_program", "interpreter"))), flush=True)
'''


def timed(fn, steps):
    import time

    import jax

    out = fn()
    jax.block_until_ready(out)
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return out, sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedules", default="1f1b,zbh1")
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import baton
    import gpt
    from timing import command_line, machine_lines, publish

    tokens = a.batch * a.seq
    rows = []

    def cfg_for(stages):
        return gpt.GPTConfig(vocab=256, seq=a.seq, dim=a.dim, heads=4, layers=8, stages=stages)

    # data 8: plain jax.jit, the batch sharded over the 8 devices
    cfg = cfg_for(1)
    model, params, opt, st, _, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, a.batch)
    dmesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    batch8 = jax.device_put(batch, NamedSharding(dmesh, P("data")))
    params8 = jax.device_put(params, NamedSharding(dmesh, P()))
    st8 = jax.device_put(st, NamedSharding(dmesh, P()))
    plain = jax.jit(gpt.scan_step(model, opt, a.microbatches))
    (_, _, loss0), t = timed(lambda: plain(params8, st8, batch8), a.steps)
    ref_loss = float(loss0)
    rows.append(("data 8: jax.jit + lax.scan, batch over 8 devices", "-", t))

    for name in a.schedules.split(","):
        sched = baton.schedule_from_name(name)
        # pipe 8 (one process, compiled engine)
        if sched.stages(8) <= 8:
            c = cfg_for(sched.stages(8))
            model, params, opt, st, step, _ = gpt.make(c)
            ps = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:8], ranks=8),
                           schedule=sched, microbatches=a.microbatches)
            (_, _, loss), t = timed(lambda: ps(params, st, batch), a.steps)
            assert abs(float(loss) - ref_loss) <= 1e-4 * abs(ref_loss), (float(loss), ref_loss)
            rows.append((f"pipe 8, {name}, one process", "compiled", t))
        # pipe 4 x data 2 (one process: the interpreter)
        c = cfg_for(sched.stages(4))
        model, params, opt, st, step, _ = gpt.make(c)
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("pipe", "data"))
        ps = baton.jit(step, mesh=baton.PipelineMesh(mesh), schedule=sched,
                       microbatches=a.microbatches, engine="interpreter")
        (_, _, loss), t = timed(lambda: ps(params, st, batch), a.steps)
        assert abs(float(loss) - ref_loss) <= 1e-4 * abs(ref_loss), (float(loss), ref_loss)
        rows.append((f"pipe 4 x data 2, {name}, one process", "interpreter", t))
        # pipe 4 x data 2, one process per rank (compiled, SPMD over each rank's 2 devices)
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "worker.py")
            with open(script, "w") as f:
                f.write(WORKER.format(examples=os.path.join(HERE, "..", "examples")))
            args = dict(seq=a.seq, dim=a.dim, batch=a.batch, microbatches=a.microbatches,
                        steps=a.steps, schedule=name, stages=sched.stages(4))
            env = dict(os.environ, JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu")
            p = subprocess.run([sys.executable, "-m", "baton.launch", "--nprocs", "4",
                                "--timeout", "900", script, json.dumps(args)],
                               capture_output=True, text=True, timeout=960, env=env)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                rows.append((f"pipe 4 x data 2, {name}, 4 processes", "FAILED",
                             float("nan")))
                print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
            else:
                r = json.loads(line[0][7:])
                assert abs(r["first"] - ref_loss) <= 1e-4 * abs(ref_loss), (r["first"], ref_loss)
                rows.append((f"pipe 4 x data 2, {name}, 4 processes x 2 devices",
                             "compiled", sorted(r["ts"])[len(r["ts"]) // 2]))

    out = ["# Pipelines with data parallelism inside stages, 8 CPU devices", ""]
    out += machine_lines()
    out += [f"- model: examples/gpt.py, 8 blocks, dim {a.dim}, seq {a.seq}; global batch "
            f"{a.batch} ({a.microbatches} microbatches), AdamW; every row's first loss equals "
            f"the plain step's (rtol 1e-4)",
            command_line('spmd.py'),
            "- step ms: median of the steps after one warm-up step", "",
            "| run | engine | step ms | tokens/s | vs data 8 |", "|---|---|---|---|---|"]
    base = rows[0][2]
    for run, eng, t in rows:
        out.append(f"| {run} | {eng} | {t * 1e3:.1f} | {tokens / t:.0f} | {base / t:.2f}x |")
    publish("\n".join(out) + "\n", a.md)


if __name__ == "__main__":
    main()
