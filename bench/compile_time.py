"""First-call cost of a pipelined step (trace + plan + compile + one run) against a plain
``jax.jit`` of the same step, and the steady calls after it. Prints a table.

    python bench/compile_time.py [--ranks 4] [--layers 4] [--schedules 1f1b,zbh1,interleaved]
                                 [--unshared] [--md FILE]

The model is examples/gpt.py (dim 32, ``--layers`` blocks, ``--ranks`` stages per rank count
of the schedule), 8 microbatches of 2 sequences, AdamW, on ``--ranks`` CPU devices of one
process. "plain jax.jit" is the training step with ``accumulate`` as a ``lax.scan`` over the
same microbatches on one device. First call: wall time of call 1 (outputs ready); its compile
part is call 1 minus the median steady call. Compilations counted with jax.monitoring's
backend-compile events. ``--unshared``: each schedule also with ``share_programs=False`` (one
program per rank; by default ranks that do the same work share one, ``emit/shared.py``).
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
from timing import publish  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import baton  # noqa: E402
import gpt  # noqa: E402

COMPILES: list[float] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: COMPILES.append(secs) if "backend_compile" in name else None)


def timed_calls(fn, params, st, batch, calls=6):
    out = []
    counts = []
    for _ in range(calls):
        COMPILES.clear()
        t0 = time.perf_counter()
        params, st, loss = fn(params, st, batch)
        jax.block_until_ready((params, st, loss))
        out.append(time.perf_counter() - t0)
        counts.append((len(COMPILES), sum(COMPILES)))
    return out, counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--schedules", default="1f1b,zbh1,interleaved")
    ap.add_argument("--unshared", action="store_true",
                    help="also run each schedule with share_programs=False")
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    rows = []
    for name in a.schedules.split(","):
        sched = baton.schedule_from_name(name)
        stages = sched.stages(a.ranks)
        cfg = gpt.GPTConfig(stages=stages, layers=max(a.layers, stages))
        model, params, opt, st, step, ref = gpt.make(cfg, eps=1e-6)
        batch = gpt.synthetic_batch(cfg, 16)
        if not rows:  # the plain step: accumulate as a lax.scan over the same microbatches
            plain = jax.jit(gpt.scan_step(model, opt, 8))
            times, counts = timed_calls(plain, params, st, batch)
            rows.append(("plain jax.jit + lax.scan (1 device)", times, counts))
        for share in (True, False) if a.unshared else (True,):
            ps = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:a.ranks],
                                                         ranks=a.ranks),
                           schedule=sched, microbatches=8, share_programs=share)
            times, counts = timed_calls(ps, params, st, batch)
            progs = len(ps.last.engine.local_units)
            how = "" if share else ", share_programs=False"
            rows.append((f"baton.jit {name}, {a.ranks} ranks{how} ({progs} loop programs)",
                         times, counts))
    base = rows[0][1][0] - statistics.median(rows[0][1][1:])
    lines = [
        f"# First-call and steady-call cost ({datetime.date.today()}, {platform.node()}, "
        f"{os.cpu_count()} CPUs, jax {jax.__version__})",
        "",
        f"`python bench/compile_time.py --ranks {a.ranks} --layers {a.layers} --schedules "
        f"{a.schedules}{' --unshared' if a.unshared else ''}`: GPT dim 32, 8 microbatches "
        f"of 2, AdamW. Times in seconds.",
        "",
        "| step | call 1 | steady call (median of 2-6) | compile part of call 1 | "
        "/ plain | XLA compiles in call 1 (s) | compiles in calls 2-6 |",
        "|---|---|---|---|---|---|---|",
    ]
    for what, times, counts in rows:
        steady = statistics.median(times[1:])
        part = times[0] - steady
        lines.append(f"| {what} | {times[0]:.2f} | {steady:.3f} | {part:.2f} | "
                     f"{part / base:.2f}x | {counts[0][0]} ({counts[0][1]:.2f}) | "
                     f"{sum(c[0] for c in counts[1:])} |")
        print(lines[-1], flush=True)
    publish("\n".join(lines) + "\n", a.md)


if __name__ == "__main__":
    main()
