"""Where a 2-stage pipeline's time goes, task by task, without any runtime in the way.

    python bench/stage_costs.py [--dim 512] [--rounds 3] [--md bench/results/stage_costs.md]

One process pinned to core 0 with one XLA thread (as bench/pinned.py) compiles the GPT cut into
2 stages with ``baton.jit`` (1F1B), captures each task's arguments from one step, and then times
every loop below as ONE ``jax.jit`` of a ``lax.scan`` over the microbatches (no executor, no
transfers, no Python between tasks; the weight gradients summed in the carry, as in a step):

* ``FB1``: the last stage's fused forward+backward, as rank 1 runs it in 1F1B;
* ``FB0``: the first stage's forward+backward fused into one task (what rank 0 would cost if its
  forward and backward of a microbatch could run back to back);
* ``F0 + B0``: rank 0's 1F1B order: each iteration runs F0 of one microbatch and B0 of the
  previous one, whose stash F0 wrote an iteration earlier (carried in the scan);
* the whole model's forward+backward: the baseline's ``lax.scan`` body (gradients summed, no
  optimizer).

The rounds alternate the loops; each figure is the median per microbatch. The loops run twice, in
fresh processes: with core 1 idle, and with a copy of the baseline step running on core 1
throughout (what the other rank's process does to this core's caches and memory bandwidth).
A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from timing import (baseline_step, command_line, gpt_config, machine_lines, pin_to_core,
                    publish)

def contend(args):
    """Runs the baseline step on core 1 until killed."""
    pin_to_core(1)
    import jax

    from baton import runtime

    runtime.retain_host_memory()
    step = baseline_step(args, 4)
    print("READY", flush=True)
    while True:
        jax.block_until_ready(step())


def measure(args):
    pin_to_core(0, cpu_devices=2)
    import jax
    import jax.numpy as jnp

    import baton
    import gpt
    from baton._core import BufKind

    cfg = gpt_config(args, 2)
    _, params, _, opt_state, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, 4 * args.microbatches)
    M = args.microbatches
    step = baton.jit(train_step, schedule=baton.OneFOneB(), microbatches=M,
                     mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2), engine="interpreter")
    cs = step.compile(params, opt_state, batch)
    # each task's first arguments, (kind, stage) -> (running sums or None, args)
    cap = step.capture_task_args((params, opt_state, batch))
    dev = jax.devices()[0]
    vals = {}  # value id -> array, from every captured call
    for key, (_, targs) in cap.items():
        exe = cs.tasks[key]
        for v, a in zip((v for g in exe.in_groups for v in g), targs):
            vals[v] = jax.device_put(a, dev)

    def parts(exe):
        ids = [v for g in exe.in_groups for v in g]
        n = len(exe.in_groups[0])
        return [vals[v] for v in ids[:n]], [vals[v] for v in ids[n:]]

    def stacked(xs):
        return [jnp.stack([x] * M) for x in xs]

    def zeros(exe, args):
        return [jnp.zeros_like(g) for g in exe.split(jax.eval_shape(exe.plain, *args))[BufKind.WGrad]]

    def one(exe):
        inv, rest = parts(exe)
        acc0 = zeros(exe, inv + rest)

        @jax.jit
        def loop(inv, xs):
            def body(acc, x):
                got = exe.split(exe.plain(*inv, *x))
                return [a + g for a, g in zip(acc, got[BufKind.WGrad])], None

            return jax.lax.scan(body, acc0, xs)[0]

        return loop, (inv, stacked(rest))

    def pair(fe, be):
        finv, frest = parts(fe)
        binv, brest = parts(be)
        nst = len(be.in_groups[4])  # B's stash arguments come last
        bmb, stash0 = brest[:len(brest) - nst], brest[len(brest) - nst:]
        acc0 = zeros(be, binv + brest)

        @jax.jit
        def loop(finv, binv, xf, xb, stash0):
            def body(c, x):
                acc, stash = c
                made = fe.split(fe.plain(*finv, *x[0]))[BufKind.Stash]
                got = be.split(be.plain(*binv, *x[1], *stash))
                return ([a + g for a, g in zip(acc, got[BufKind.WGrad])], made), None

            return jax.lax.scan(body, (acc0, stash0), (xf, xb))[0][0]

        return loop, (finv, binv, stacked(frest), stacked(bmb), stash0)

    from baton import _core
    from baton.planning.tasks import FUSED_FB

    F, B = _core.TaskKind.F, _core.TaskKind.B  # the step's task keys: (kind, stage)
    loops = {}
    if (FUSED_FB, 1) in cs.tasks:
        loops["FB1 (rank 1's task)"] = one(cs.tasks[(FUSED_FB, 1)])
    loops["F0 + B0 (rank 0's 1F1B order)"] = pair(cs.tasks[(F, 0)], cs.tasks[(B, 0)])
    if (FUSED_FB, 0) in cs.tasks:
        loops["FB0 (stage 0 fused)"] = one(cs.tasks[(FUSED_FB, 0)])

    whole = gpt_config(args, 1)
    model, wp, _, _, _, _ = gpt.make(whole)
    mbs = jax.tree.map(lambda x: x.reshape(M, -1, *x.shape[1:]),
                       gpt.synthetic_batch(whole, 4 * M))

    @jax.jit
    def body_loop(p, bs):
        def body(acc, b):
            g = jax.grad(lambda p, b: gpt.loss_fn(model, p, b))(p, b)
            return jax.tree.map(jnp.add, acc, g), None

        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), bs)[0]

    loops["whole model (the baseline's scan body)"] = (body_loop, (wp, mbs))
    times = {k: [] for k in loops}
    for fn, a in loops.values():
        jax.block_until_ready(fn(*a))
    for _ in range(args.rounds):
        for k, (fn, a) in loops.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times[k].append((time.perf_counter() - t) / M)
    return {k: statistics.median(v) for k, v in times.items()}


def _contender(args):
    """A process running the baseline step on core 1 (started once it is running)."""
    bg = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "contend",
                           "--dim", str(args.dim), "--seq", str(args.seq),
                           "--microbatches", str(args.microbatches)],
                          stdout=subprocess.PIPE, text=True)
    if bg.stdout.readline().strip() != "READY":
        bg.kill()
        raise SystemExit("the contending baseline did not start")
    return bg


def measure_in_process(args, contended: bool):
    """``measure`` in a fresh process pinned to core 0 (core 1 idle or running the baseline)."""
    bg = _contender(args) if contended else None
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--role", "measure",
                            "--dim", str(args.dim), "--seq", str(args.seq),
                            "--microbatches", str(args.microbatches),
                            "--rounds", str(args.rounds)],
                           capture_output=True, text=True, timeout=1800)
    finally:
        if bg is not None:
            bg.kill()
            bg.wait()
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"no result (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--role", choices=["main", "measure", "contend"], default="main",
                    help=argparse.SUPPRESS)
    ap.add_argument("--md")
    args = ap.parse_args()
    if args.role == "contend":
        return contend(args)
    if args.role == "measure":
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    idle = measure_in_process(args, False)
    busy = measure_in_process(args, True)
    key = "whole model (the baseline's scan body)"
    rows = ["| loop | core 1 idle: ms per microbatch | / half the whole model "
            "| core 1 running the baseline: ms | / half the whole model | slowdown |",
            "|---|---|---|---|---|---|"]
    for k in idle:
        rows.append(f"| {k} | {1e3 * idle[k]:.1f} | {2 * idle[k] / idle[key]:.3f} "
                    f"| {1e3 * busy[k]:.1f} | {2 * busy[k] / busy[key]:.3f} "
                    f"| {busy[k] / idle[k]:.3f} |")
    head = [
        "# Stage task costs in lax.scan loops (no runtime)",
        "",
        *machine_lines(),
        f"- model: examples/gpt.py, 8 blocks, dim {args.dim}, seq {args.seq}, cut into 2 stages; "
        f"microbatches of 4; loops of {args.microbatches}; {args.rounds} rounds (median); "
        "each column a fresh process on core 0",
        command_line("stage_costs.py"),
        "",
    ]
    publish("\n".join(head + rows) + "\n", args.md)


if __name__ == "__main__":
    main()
