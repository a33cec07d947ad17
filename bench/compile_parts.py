"""Where the first call's XLA compile time goes, rank program by rank program. Prints a table.

    python bench/compile_parts.py [--ranks 4] [--schedule 1f1b] [--md FILE]

The model and step are ``bench/compile_time.py``'s (examples/gpt.py, dim 32, one block per
stage, 8 microbatches of 2, AdamW) with ``share_programs=False``, so every rank has its own
program. For each rank, compiled alone and one after another (caches cold for each):

* ``program``: the rank's loop program as it runs (``RankProgram``: its table, rings, transfer
  calls and task branches);
* ``tasks only``: each of the rank's task units once, in stream order, straight-line in one
  ``jax.jit`` (received buffers as zeros): the kernels the rank cannot do without.

Then the same rank programs traced into **one** ``jax.jit`` on one device (``one module``: it
compiles, it is never run), against the sum of their separate compiles, and the plain step
(``jax.jit`` + ``lax.scan`` of the whole model on one device). Compile seconds are wall
time of ``Lowered.compile()``; XLA:CPU's compile uses about 1.6 of the two cores. A
diagnosis, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from timing import publish  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import baton  # noqa: E402
import gpt  # noqa: E402
from baton.running import engine  # noqa: E402
from baton.emit.task_env import _run_task  # noqa: E402


def compile_secs(lowered) -> float:
    t0 = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - t0


def tasks_only(p, args):
    """A jitted function running each of rank program ``p``'s task units once, in order."""
    cs = p.cs

    def fn(args):
        vals = dict(zip(p.needs, args))
        lits = cs.traced.literals

        def outer(v):
            o, _ = cs.loop_src[v]
            return vals[o] if o in vals else lits[o]

        whole = p._whole_mb(outer, {})
        env = {(k, s): [jnp.zeros(a.shape, a.dtype) for a in cs.buffers.layout(k, s)]
               for st, _ in p.steps for op, k, s, _, _ in st if op == baton._core.ItemOp.WAIT}
        outs: list = []
        for k, s in p.units:
            _run_task(cs, k, s, 0, outer, lambda v, _m: whole(v)[0],
                      lambda key: env[key[:2]], lambda key, v: env.__setitem__(key[:2], v),
                      lambda i, _m, x: outs.append(x), lambda f, a: f(*a))
        return outs + [x for v in env.values() for x in v]

    return jax.jit(fn).lower(args)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    sched = baton.schedule_from_name(a.schedule)
    stages = sched.stages(a.ranks)
    cfg = gpt.GPTConfig(stages=stages, layers=stages)
    model, params, opt, st, step, _ = gpt.make(cfg, eps=1e-6)
    batch = gpt.synthetic_batch(cfg, 16)
    plain = compile_secs(jax.jit(gpt.scan_step(model, opt, 8)).lower(params, st, batch))
    rows: list[tuple] = []
    combined: list[float] = []

    def diagnose(progs, vals):
        for p in progs:
            args = p._args(vals)
            rows.append((p.rank, " ".join(f"{k}{s}" for k, s in p.units),
                         len(p.stretches), compile_secs(p.lower(vals)),
                         compile_secs(tasks_only(p, args))))
        shapes = [[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in p._args(vals)]
                  for p in progs]
        one = jax.jit(lambda xs: [p._program(x) for p, x in zip(progs, xs)])
        combined.append(compile_secs(one.lower(shapes)))
        raise SystemExit  # (nothing runs: the programs were compiled for the table only)

    engine.compile_all = diagnose
    ps = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:a.ranks], ranks=a.ranks),
                   schedule=sched, microbatches=8, share_programs=False)
    try:
        ps(params, st, batch)
    except SystemExit:
        pass
    lines = [
        f"# Compile time by rank program ({datetime.date.today()}, {platform.node()}, "
        f"{os.cpu_count()} CPUs, jax {jax.__version__})",
        "",
        f"`python bench/compile_parts.py --ranks {a.ranks} --schedule {a.schedule}`: GPT dim 32, "
        f"one block per stage, 8 microbatches of 2, `share_programs=False`. Seconds of "
        f"`Lowered.compile()`.",
        "",
        "| rank | task units | transfer stretches | program | tasks only | program - tasks |",
        "|---|---|---|---|---|---|",
    ]
    for r, units, n, prog, tasks in rows:
        lines.append(f"| {r} | {units} | {n} | {prog:.2f} | {tasks:.2f} | {prog - tasks:.2f} |")
    total = sum(r[3] for r in rows)
    lines += [
        "",
        "| compile | seconds |",
        "|---|---|",
        f"| every rank program, one after another (sum) | {total:.2f} |",
        f"| the same programs traced into one module | {combined[0]:.2f} |",
        f"| plain jax.jit + lax.scan of the whole step | {plain:.2f} |",
    ]
    publish("\n".join(lines) + "\n", a.md)


if __name__ == "__main__":
    main()
