"""Throughput of a 2-rank pipeline run as 2 processes pinned to separate cores, against the
non-pipelined baseline run as one process pinned to one core (issue 5's headline measurement).

    python bench/pinned.py [--schedule 1f1b] [--microbatches 8] [--steps 5] [--dim 256]
                           [--md bench/results/pinned.md]

* baseline: one process pinned to core 0, XLA with one thread; ``jax.jit`` of the training step
  with ``accumulate`` as a ``lax.scan`` over the microbatches (no Baton at run time).
* baton: ``python -m baton.launch --nprocs 2``; rank r pinned to core r, one XLA thread and one CPU
  device each, talking Gloo; the same GPT cut into 2 stages, one per process.
Each prints the median wall time of ``--steps`` steps after 2 warm-up steps. The ideal speed-up of
1F1B with p = 2 and m microbatches is m(F+B) / ((m+p-1)(F+B)) * p = 2m/(m+1) (16/9 = 1.78 for m = 8).
A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _setup(core: int):
    os.sched_setaffinity(0, {core})
    os.environ["XLA_FLAGS"] = ONE_THREAD
    os.environ["JAX_NUM_CPU_DEVICES"] = "1"
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def _timed(fn, steps):
    import jax

    for _ in range(2):
        jax.block_until_ready(fn())
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _cfg(args, stages):
    import gpt

    return gpt.GPTConfig(vocab=256, seq=args.seq, dim=args.dim, heads=4, layers=8, stages=stages)


def baseline(args):
    _setup(0)
    import jax
    import optax

    import gpt
    from baton.frontend import primitives

    cfg = _cfg(args, 1)
    model, params, opt, opt_state, _, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, args.mb_size * args.microbatches)

    def step(params, opt_state, batch):
        loss, grads = primitives.accumulate(
            jax.value_and_grad(lambda p, b: gpt.loss_fn(model, p, b)), params, batch=batch,
            microbatches=args.microbatches)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    f = jax.jit(step)
    t = _timed(lambda: f(params, opt_state, batch), args.steps)
    print("RESULT " + json.dumps({"step": t}), flush=True)


def worker(args):
    rank = int(os.environ["BATON_RANK"])
    _setup(rank)
    import jax

    import baton
    import gpt

    cfg = _cfg(args, 2)
    _, params, _, opt_state, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, args.mb_size * args.microbatches)
    sched = baton.schedule_from_name(args.schedule)
    step = baton.jit(train_step, schedule=sched, microbatches=args.microbatches)
    state = {"p": params, "o": opt_state}

    def call():
        state["p"], state["o"], loss = step(state["p"], state["o"], batch)
        return loss

    t = _timed(call, args.steps)
    if rank == 0:
        print("RESULT " + json.dumps({"step": t}), flush=True)


def _result(cmd, env=None, timeout=900):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"no result from {' '.join(cmd)} (exit {p.returncode}):\n"
                     f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--md")
    ap.add_argument("--role", choices=["main", "baseline", "worker"], default="main")
    args = ap.parse_args()
    if args.role == "baseline":
        return baseline(args)
    if args.role == "worker":
        return worker(args)

    common = ["--schedule", args.schedule, "--microbatches", str(args.microbatches),
              "--mb-size", str(args.mb_size), "--seq", str(args.seq), "--dim", str(args.dim),
              "--steps", str(args.steps)]
    me = os.path.abspath(__file__)
    base = _result([sys.executable, me, "--role", "baseline", *common])
    pipe = _result([sys.executable, "-m", "baton.launch", "--nprocs", "2", me, "--role",
                    "worker", *common])
    tokens = args.mb_size * args.microbatches * args.seq
    m = args.microbatches
    rows = [
        "| run | processes | step ms | tokens/s | speed-up |",
        "|---|---|---|---|---|",
        f"| jax.jit + lax.scan, 1 process on core 0, 1 XLA thread | 1 | {1e3 * base['step']:.1f} "
        f"| {tokens / base['step']:.0f} | 1.00 |",
        f"| Baton {args.schedule}, 2 ranks = 2 processes on cores 0 and 1, 1 XLA thread each | 2 "
        f"| {1e3 * pipe['step']:.1f} | {tokens / pipe['step']:.0f} "
        f"| {base['step'] / pipe['step']:.2f} (ideal {2 * m / (m + 1):.2f}) |",
    ]
    head = [
        "# Pinned 2-process pipeline vs 1-process baseline",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        f"- model: examples/gpt.py, 8 blocks, dim {args.dim}, seq {args.seq}; {m} microbatches "
        f"of {args.mb_size}; AdamW",
        "- command: `python bench/pinned.py " + " ".join(sys.argv[1:]) + "`",
        "",
    ]
    text = "\n".join(head + rows) + "\n"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
