"""2-rank Baton steps and the 1-process baseline, alternating in the same two pinned processes.

    python bench/pinned_ab.py [--schedules 1f1b,eager1f1b] [--dim 256] [--rounds 10]
                              [--md bench/results/pinned.md]

``bench/pinned.py`` runs every configuration in processes of its own, and this VM's timings move
5-10% from one launch to the next. That is as large as the differences the 2-rank targets are
about. Here one launch of two processes (``python -m baton.launch --nprocs 2``, rank r pinned to
core r, one XLA thread each, ``retain_host_memory`` in both) builds every step once. Each round
then runs:

* the baseline on rank 0: ``jax.jit`` + ``lax.scan`` on core 0, while rank 1 waits in a barrier
  (a blocking receive: its core stays idle, as in a separate baseline launch);
* each Baton schedule on both ranks.

A barrier separates the calls. Every call is timed on rank 0 from its start until its outputs
are ready: all of them, the updated parameters and optimizer state included (Baton's loss comes
from rank 1, so the time covers the whole pipeline; rank 0's own optimizer update must not run
on into the next timed call). Both sides
see the same processes, allocator and machine phase. The speed-up of a schedule is the
baseline's median over its own median. A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from timing import (SCHEDULE_NAMES, baseline_step, command_line, gpt_config, machine_lines,
                    pin_to_core, publish)

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args):
    rank = int(os.environ["BATON_RANK"])
    pin_to_core(rank)
    import jax

    import baton
    import gpt
    from baton import runtime
    from baton.running.distributed import Router, process_group

    runtime.retain_host_memory()
    m = args.microbatches
    group = process_group("gloo")

    def barrier():
        r = Router(group, 120.0)
        r.allgather("b")
        r.finish()

    base = baseline_step(args, args.mb_size) if rank == 0 else None

    steps = {}
    runners = {}
    for key in _keys(args):
        name, how = key.split("/")
        sched = baton.schedule_from_name(name)
        _, params, _, opt_state, train_step, _ = gpt.make(gpt_config(args, sched.stages(2)))
        batch = gpt.synthetic_batch(gpt_config(args, sched.stages(2)), args.mb_size * m)
        st = baton.jit(train_step, schedule=sched, microbatches=m,
                       engine="compiled" if how == "program" else "interpreter")
        runners[key] = st
        state = {"p": params, "o": opt_state}

        def call(st=st, state=state, batch=batch):
            state["p"], state["o"], loss = st(state["p"], state["o"], batch)
            # everything this rank computed (its stages' updated parameters and optimizer
            # state, the loss): waiting on the loss alone would leave the optimizer running
            # into the next timed call, the baseline's
            return state["p"], state["o"], loss

        steps[key] = call

    def timed(fn):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - t

    times = {"baseline": []}
    times.update({k: [] for k in steps})
    for rnd in range(args.rounds + 2):  # 2 warm-up rounds (compiles)
        barrier()
        if rank == 0:
            t = timed(base)
            if rnd >= 2:
                times["baseline"].append(t)
        for name, call in steps.items():
            barrier()
            t = timed(call)
            if rnd >= 2:
                times[name].append(t)
    if rank == 0:
        # how each step ran: its loop as one program per rank, or on the executor (and why)
        ran = {k: st.last_run.stats.get("rank_program") and "program"
               or "executor (engine='interpreter')" for k, st in runners.items()}
        print("RESULT " + json.dumps({"times": times, "ran": ran}), flush=True)


def _keys(args):
    return [f"{name}/{how}" for name in args.schedules.split(",")
            for how in args.modes.split(",")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="1f1b,eager1f1b")
    ap.add_argument("--modes", default="program,executor",
                    help="how each schedule runs: 'program' (baton.jit's default: each rank's "
                    "loop as one XLA program where the schedule allows), 'executor' "
                    "(engine='interpreter')")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    cmd = [sys.executable, "-m", "baton.launch", "--nprocs", "2", os.path.abspath(__file__),
           "--worker", "--schedules", args.schedules, "--modes", args.modes, "--dim",
           str(args.dim), "--rounds", str(args.rounds), "--microbatches", str(args.microbatches),
           "--mb-size", str(args.mb_size), "--seq", str(args.seq)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=HERE)
    res = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if not res:
        raise SystemExit(f"no result from {' '.join(cmd)}:\n{p.stdout[-2000:]}\n"
                         f"{p.stderr[-3000:]}")
    times, ran = res[0]["times"], res[0]["ran"]
    b = statistics.median(times["baseline"])
    rows = ["| step | median ms | min-max ms | speed-up vs baseline |", "|---|---|---|---|",
            f"| jax.jit + lax.scan, rank 0's process (core 0) | {1e3 * b:.1f} "
            f"| {1e3 * min(times['baseline']):.1f}-{1e3 * max(times['baseline']):.1f} | 1.00 |"]
    for key in _keys(args):
        name, how = key.split("/")
        t = statistics.median(times[key])
        rows.append(f"| Baton {SCHEDULE_NAMES.get(name, name)}, 2 ranks (cores 0 and 1), "
                    f"{ran[key]} | {1e3 * t:.1f} "
                    f"| {1e3 * min(times[key]):.1f}-{1e3 * max(times[key]):.1f} "
                    f"| {b / t:.2f} |")
    head = [
        "# 2-rank Baton and the baseline, alternating in the same pinned processes",
        "",
        *machine_lines(),
        f"- model: examples/gpt.py, 8 blocks, dim {args.dim}, seq {args.seq}; "
        f"{args.microbatches} microbatches of {args.mb_size}; AdamW; one XLA thread per process",
        command_line("pinned_ab.py"),
        f"- {args.rounds} rounds after 2 warm-up rounds; each round: the baseline on rank 0 "
        "(rank 1 idle in a barrier), then each Baton step on both ranks; medians",
        "",
    ]
    publish("\n".join(head + rows) + "\n", args.md)


if __name__ == "__main__":
    main()
