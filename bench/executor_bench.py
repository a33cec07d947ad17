"""Executor overhead per instruction: the C++ executor vs a bare Python loop. Prints a table.

    python bench/executor_bench.py [--schedules 1f1b,zbv] [--ranks 1,2] [--microbatches 16]
                                   [--steps 20] [--md FILE]

Each RUN calls a trivial jitted task (``x + 1`` on 8 float32s); each ACCUMULATE a jitted add.
Rows:

* ``executor``: ``Executor.run`` over the plan's rank IR, in one process with the in-process
  transport (``LocalHub``; with 2 ranks, one long-lived thread per rank). Includes the GIL
  hand-offs, the nanobind crossing, the value bookkeeping, POST/WAIT/FREE handling.
* ``bare loop``: the same jitted functions called in a plain Python loop, once per RUN and per
  ACCUMULATE of the plan in program order, results kept in a dict: the floor any runtime pays.
* ``executor, no-op tasks``: the executor with callbacks that return a cached array without calling
  JAX: the executor's own cost plus the Python callback.

``us/instr`` divides a step's wall time by the number of instructions of all ranks;
``overhead us/instr`` = (executor - bare loop) / instructions. Median of ``--steps`` steps after
2 warm-ups. The issue's later target: overhead below 30 us per instruction.

A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import baton
from baton import runtime as rt


@jax.jit
def task(x):
    return x + 1.0


@jax.jit
def add(a, b):
    return a + b


def make_tasks(acc, jax_tasks=True):
    x0 = jnp.zeros(8, jnp.float32)
    cached = task(x0)

    def run(r, a, in_ids, ins, out_ids):
        if not jax_tasks:
            return [[cached]] * len(out_ids)
        y = task(ins[0][0] if ins else x0)
        return [[y]] * len(out_ids)

    def accumulate(r, b, v):
        if jax_tasks:
            acc[r] = add(acc.get(r, x0), v[0])

    return rt.make_tasks(run, accumulate, to_jax=False)


def exec_step_times(plan, ranks, steps, jax_tasks):
    hub = rt.LocalHub(ranks)
    ts = [hub.transport(r) for r in range(ranks)]
    accs = [{} for _ in range(ranks)]
    exs = [rt.Executor(plan.rank_ir(), r, ts[r], make_tasks(accs[r], jax_tasks), timeout=60.0)
           for r in range(ranks)]
    # One long-lived thread per rank beyond the first (thread start-up is not executor cost).
    start, done = threading.Barrier(ranks), threading.Barrier(ranks)
    stop = [False]

    def worker(e):
        while True:
            start.wait()
            if stop[0]:
                return
            e.run()
            done.wait()

    th = [threading.Thread(target=worker, args=(e,)) for e in exs[1:]]
    for t in th:
        t.start()
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        start.wait()
        exs[0].run()
        done.wait()
        for acc in accs:
            for v in acc.values():
                v.block_until_ready()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    stop[0] = True
    start.wait()
    for t in th:
        t.join()
    for t in ts:
        t.close()
    return times


def bare_step_times(order, steps):
    x0 = jnp.zeros(8, jnp.float32)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        env, last, acc = {}, x0, x0
        for k, what in enumerate(order):
            if what == "run":
                last = task(last)
                env[k] = last
            else:
                acc = add(acc, last)
        acc.block_until_ready()
        last.block_until_ready()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedules", default="1f1b,zbv")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--md", help="also write the table, machine and command to this Markdown file")
    a = ap.parse_args()
    header = (f"| {'schedule':<8} | {'ranks':>5} | {'instrs':>6} | {'RUNs':>5} | "
              f"{'row':<22} | {'ms/step':>8} | {'us/instr':>8} | {'overhead us/instr':>17} |")
    sep = "|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|"
    print(header)
    print(sep)
    rows = []
    for name in a.schedules.split(","):
        for ranks in (int(r) for r in a.ranks.split(",")):
            plan = baton.plan(name, ranks=ranks, microbatches=a.microbatches)
            progs = plan.core.programs
            n_instr = sum(len(p) for p in progs)
            # The bare loop calls the same functions once per RUN / ACCUMULATE, in rank-major
            # program order, in one thread.
            order = [("run" if ins.op == baton.OpCode.RUN else "acc") for p in progs for ins in p
                     if ins.op in (baton.OpCode.RUN, baton.OpCode.ACCUMULATE)]
            n_run = order.count("run")
            ex = statistics.median(exec_step_times(plan, ranks, a.steps, True))
            noop = statistics.median(exec_step_times(plan, ranks, a.steps, False))
            bare = statistics.median(bare_step_times(order, a.steps))
            for row_name, t, over in (("executor", ex, (ex - bare)),
                                      ("bare loop", bare, None),
                                      ("executor, no-op tasks", noop, None)):
                o = f"{over / n_instr * 1e6:>17.1f}" if over is not None else f"{'':>17}"
                row = (f"| {name:<8} | {ranks:>5} | {n_instr:>6} | {n_run:>5} | {row_name:<22} | "
                       f"{t * 1e3:>8.2f} | {t / n_instr * 1e6:>8.1f} | {o} |")
                rows.append(row)
                print(row, flush=True)
    if a.md:
        with open(a.md, "w") as f:
            f.write("# Executor overhead benchmark\n\n")
            f.write(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n")
            f.write(f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, "
                    f"{platform.platform()}, Python {platform.python_version()}, "
                    f"JAX {jax.__version__} ({jax.default_backend()})\n")
            f.write(f"- command: `python {' '.join(sys.argv)}`\n")
            f.write("- method: see the docstring of bench/executor_bench.py\n\n")
            f.write(header + "\n" + sep + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
