"""Baton on 1 rank against the plain ``jax.jit`` + ``lax.scan`` step, interleaved in one process.

    python bench/one_rank.py [--schedules 1f1b,gpipe,zbh1] [--dims 256,512] [--rounds 8]
                             [--md bench/results/one_rank.md]

One process pinned to core 0 with one XLA thread (as in bench/pinned.py) builds both steps for
the same GPT (no stage boundaries) and then alternates them: baseline step, Baton step,
baseline step, ... ``--rounds`` times after 2 warm-up rounds, each call waited for. The ratio of
the medians is Baton's cost over the baseline with launch-to-launch noise (5-10% on this VM)
taken out: both see the same process, allocator and machine phase. Both run with
``retain_host_memory`` (baton.jit's default). A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from timing import (SCHEDULE_NAMES, command_line, gpt_config, machine_lines, pin_to_core,
                    publish)


def measure(args):
    pin_to_core(0)
    import jax

    import baton
    import gpt
    from baton import runtime

    runtime.retain_host_memory()
    m = args.microbatches
    cfg = gpt_config(args, 1)
    model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, args.mb_size * m)

    base = jax.jit(gpt.scan_step(model, opt, m))
    step = baton.jit(train_step, schedule=baton.schedule_from_name(args.schedule),
                     microbatches=m, mesh=baton.PipelineMesh(jax.devices()[:1], ranks=1))

    def timed(fn):
        t = time.perf_counter()
        jax.block_until_ready(fn(params, opt_state, batch))
        return time.perf_counter() - t

    for _ in range(2):
        timed(base), timed(step)
    a, b = [], []
    for _ in range(args.rounds):
        a.append(timed(base))
        b.append(timed(step))
    print("RESULT " + json.dumps({"base": a, "baton": b}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="1f1b,gpipe,zbh1")
    ap.add_argument("--dims", default="256,512")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--md")
    ap.add_argument("--schedule", help=argparse.SUPPRESS)
    ap.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.schedule:
        return measure(args)
    rows = ["| model | schedule | baseline ms | Baton 1 rank ms | Baton / baseline |",
            "|---|---|---|---|---|"]
    for dim in (int(d) for d in args.dims.split(",") if d):
        for sched in (s for s in args.schedules.split(",") if s):
            cmd = [sys.executable, os.path.abspath(__file__), "--schedule", sched, "--dim",
                   str(dim), "--rounds", str(args.rounds), "--microbatches",
                   str(args.microbatches), "--mb-size", str(args.mb_size), "--seq", str(args.seq)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            res = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if not res:
                raise SystemExit(f"no result from {' '.join(cmd)}:\n{p.stderr[-3000:]}")
            a, b = statistics.median(res[0]["base"]), statistics.median(res[0]["baton"])
            rows.append(f"| GPT dim {dim} | {SCHEDULE_NAMES.get(sched, sched)} | {1e3 * a:.1f} "
                        f"| {1e3 * b:.1f} | {b / a:.3f} |")
            print(rows[-1], flush=True)
    head = [
        "# Baton on 1 rank vs jax.jit + lax.scan, interleaved in one process",
        "",
        *machine_lines(),
        f"- model: examples/gpt.py, 8 blocks, seq {args.seq}; {args.microbatches} microbatches "
        f"of {args.mb_size}; AdamW; one process on core 0, one XLA thread",
        command_line("one_rank.py"),
        f"- medians of {args.rounds} alternating calls of each step (after 2 warm-up rounds)",
        "",
    ]
    publish("\n".join(head + rows) + "\n", args.md)


if __name__ == "__main__":
    main()
