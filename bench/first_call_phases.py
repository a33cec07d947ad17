"""A pipelined step's first call, phase by phase, on examples/gpt.py with every rank in one
process. Prints a table.

    python bench/first_call_phases.py [--ranks 4] [--schedules 1f1b,zbh1] [--repeat 3]
                                      [--tree DIR ...] [--md FILE]

Each measurement runs in a fresh process (JAX's in-memory caches would hide the compiles; the
persistent compilation cache is off). Phases, in seconds:

* ``trace and plan``: wall time of ``PipelinedFunction.compile`` (trace the step, partition,
  plan, verify, build the rank programs and the task functions; nothing is compiled by XLA);
  ``of which JAX traces``: the seconds of JAX's tracing events inside it (the user's step
  traced to a jaxpr, mostly), and ``Baton's own``: the rest (the export of the jaxpr, the C++
  build, the task functions and segments);
* the first call after it, wall time to outputs ready, and inside it the seconds of JAX's
  compile events (``jax.monitoring``): ``to jaxpr`` (tracing Baton's programs),
  ``lowering`` (jaxpr to StableHLO) and ``XLA compile``. Programs compile on several threads,
  so these sums can exceed the call's wall time;
* ``steady``: the median of the three calls after the first.

``--tree DIR``: also measure the Baton of another checkout (its ``python`` folder first on
the path, its ``_core`` built there), to compare two commits on the same model and machine;
rows name each tree's commit. The model is this checkout's examples/gpt.py (dim 32, one block
per stage, 8 microbatches of 2, AdamW). A benchmark, not a test.
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
ROOT = os.path.dirname(HERE)
PHASES = ("trace_plan", "plan_jax", "first_call", "to_jaxpr", "lowering", "xla_compile", "steady")
EVENTS = {"to_jaxpr": "jaxpr_trace_duration", "lowering": "jaxpr_to_mlir_module_duration",
          "xla_compile": "backend_compile"}


def measure(ranks: int, schedule: str) -> dict:
    """One fresh process's phases (run with ``--child``)."""
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    import jax

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import baton
    import gpt

    seen = {k: 0.0 for k in EVENTS}

    def on_event(name, secs, **kw):
        for k, part in EVENTS.items():
            if part in name:
                seen[k] += secs

    sched = baton.schedule_from_name(schedule)
    stages = sched.stages(ranks)
    cfg = gpt.GPTConfig(stages=stages, layers=stages)
    model, params, opt, st, step, ref = gpt.make(cfg, eps=1e-6)
    batch = gpt.synthetic_batch(cfg, 16)
    fn = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:ranks], ranks=ranks),
                   schedule=sched, microbatches=8)
    jax.block_until_ready((params, st, batch))
    jax.monitoring.register_event_duration_secs_listener(on_event)
    t0 = time.perf_counter()
    fn.compile(params, st, batch)
    trace_plan = time.perf_counter() - t0
    plan_jax = seen["to_jaxpr"]
    seen.update({k: 0.0 for k in EVENTS})
    t0 = time.perf_counter()
    params, st, loss = fn(params, st, batch)
    jax.block_until_ready((params, st, loss))
    first = time.perf_counter() - t0
    events = dict(seen)
    steady = []
    for _ in range(3):
        t0 = time.perf_counter()
        params, st, loss = fn(params, st, batch)
        jax.block_until_ready((params, st, loss))
        steady.append(time.perf_counter() - t0)
    return dict(trace_plan=trace_plan, plan_jax=plan_jax, first_call=first, steady=statistics.median(steady),
                **events)


def commit_of(tree: str) -> str:
    try:
        return subprocess.check_output(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                                       text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def run_child(tree: str, ranks: int, schedule: str) -> dict:
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    # this checkout: the Baton this Python imports (installed, or this tree in development);
    # another: its python folder first on the path
    first = [] if tree == ROOT else [os.path.join(tree, "python")]
    env["PYTHONPATH"] = os.pathsep.join(first + [HERE] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--ranks",
                          str(ranks), "--schedules", schedule], env=env, capture_output=True,
                         text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"{tree} {schedule}: the measuring process failed:\n"
                           f"{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--schedules", default="1f1b,zbh1")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per row (median)")
    ap.add_argument("--tree", action="append", default=[],
                    help="another checkout whose Baton to measure too")
    ap.add_argument("--md", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.ranks, a.schedules)))
        return
    sys.path.insert(0, HERE)
    from timing import publish

    trees = a.tree + [ROOT]
    results = {(t, s): [] for t in trees for s in a.schedules.split(",")}
    for _ in range(a.repeat):  # rounds: every tree and schedule once per round
        for key in results:
            results[key].append(run_child(key[0], a.ranks, key[1]))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    lines = [
        f"# First call, phase by phase ({now} UTC, {platform.node()}, {os.cpu_count()} CPUs)",
        "",
        f"`python bench/first_call_phases.py --ranks {a.ranks} --schedules {a.schedules} "
        f"--repeat {a.repeat}" + "".join(f" --tree {t}" for t in a.tree) + "`: examples/gpt.py, "
        f"{a.ranks} ranks in one process, 8 microbatches of 2; seconds, median of "
        f"{a.repeat} fresh processes.",
        "",
        "| Baton at | schedule | trace and plan | of which JAX traces | Baton's own | "
        "first call | to jaxpr | lowering | XLA compile | steady step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (tree, sched), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in PHASES}
        own = statistics.median(r["trace_plan"] - r["plan_jax"] for r in runs)
        lines.append(f"| {commit_of(tree)} | {sched} | {med['trace_plan']:.3f} | "
                     f"{med['plan_jax']:.3f} | {own:.3f} | {med['first_call']:.2f} | {med['to_jaxpr']:.2f} | {med['lowering']:.2f} | "
                     f"{med['xla_compile']:.2f} | {med['steady'] * 1e3:.1f} ms |")
        print(lines[-1], flush=True)
    publish("\n".join(lines) + "\n", a.md)


if __name__ == "__main__":
    main()
