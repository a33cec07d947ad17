"""Pipeline benchmark: a GPT-style model under every schedule on 1, 2 and 4 ranks. Prints a
markdown table (and writes it with --md).

    python bench/pipeline.py [--schedules gpipe,1f1b,...] [--ranks 1,2,4] [--microbatches 8]
                             [--steps 5] [--dim 128] [--md bench/results/pipeline.md]

Model: ``examples/gpt.py`` (embedding, 8 pre-norm blocks, final norm, LM head tied to the
embedding), cut into ``schedule.stages(ranks)`` stages, AdamW; sized so each task takes
milliseconds on a CPU. One CPU device per rank (``JAX_NUM_CPU_DEVICES``), single-process mode
(one executor thread per rank over the in-process transport).

Per (schedule, ranks):

* ``step ms``: median wall time of ``--steps`` untraced calls (the whole step: pipeline,
  optimizer update, blocking on the outputs); ``tokens/s`` = batch * sequence / step time.
* ``pipe meas ms`` / ``pipe pred ms``: the microbatch loop's span (first task start to last task
  end) measured in traced calls (``baton.profile``: median of ``--steps``) and predicted by the
  simulator with the profiled costs; ``pred/meas`` their ratio.
* ``bubble meas`` / ``bubble pred``: per rank, the idle fraction between the rank's first and
  last task (measured / simulated), as "r0/r1/...".
* ``peak meas`` / ``peak plan``: the largest per-rank peak of live buffers, measured by the
  executors / predicted by the simulator.

Baselines in the same run: ``jax.jit`` of the same step where ``accumulate`` is a ``lax.scan``
over the microbatches, on one device; Baton with 1 rank is the ``ranks = 1`` rows.

A benchmark, not a test: it never fails on timing. The machine is shared and small (2 CPUs):
all ranks of a single-process run share its cores, so more ranks cannot run faster here; the
table shows what each schedule costs and how well the simulator predicts it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

_RANKS_MAX = 4
os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(_RANKS_MAX))

import jax  # noqa: E402

import baton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import gpt  # noqa: E402
from timing import median_step  # noqa: E402

SCHEDULES = {
    "gpipe": baton.GPipe(),
    "1f1b": baton.OneFOneB(),
    "interleaved": baton.Interleaved1F1B(virtual_stages=2),
    "zbh1": baton.ZBH1(),
    "zbv": baton.ZBV(),
    "dualpipev": baton.DualPipeV(),
}
LAYERS = 8


def config(args, stages: int) -> gpt.GPTConfig:
    return gpt.GPTConfig(vocab=256, seq=args.seq, dim=args.dim, heads=4, layers=LAYERS,
                         stages=stages)


def per_rank(xs) -> str:
    return "/".join(f"{100 * x:.0f}" for x in xs)


def run_baton(args, name: str, ranks: int) -> dict | None:
    sched = SCHEDULES[name]
    try:
        stages = sched.stages(ranks)
    except baton.BatonError as e:
        return {"error": str(e)}
    if LAYERS % stages:
        return {"error": f"{stages} stages do not divide {LAYERS} layers"}
    cfg = config(args, stages)
    _, params, _, opt_state, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, args.mb_size * args.microbatches)
    mesh = baton.PipelineMesh(jax.devices()[:ranks], ranks=ranks)
    try:
        ps = baton.jit(train_step, mesh=mesh, schedule=sched, microbatches=args.microbatches)
        jax.block_until_ready(ps(params, opt_state, batch))  # compile
    except baton.BatonError as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    step = median_step(lambda: ps(params, opt_state, batch), args.steps)
    prof = baton.profile(ps, params, opt_state, batch, runs=3, steps=args.steps)
    m, p = prof.measured, prof.predicted
    return {
        "step": step,
        "tokens": args.mb_size * args.microbatches * args.seq / step,
        "meas": m["step_time"], "pred": p["step_time"],
        "bub_meas": m["bubble"], "bub_pred": p["bubble"],
        "peak_meas": max(m["peak_bytes"]), "peak_plan": max(p["peak_total"]),
    }


def run_scan_baseline(args) -> dict:
    cfg = config(args, 1)
    model, params, opt, opt_state, _, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, args.mb_size * args.microbatches)
    m = args.microbatches

    f = jax.jit(gpt.scan_step(model, opt, m))
    jax.block_until_ready(f(params, opt_state, batch))
    t = median_step(lambda: f(params, opt_state, batch), args.steps)
    return {"step": t, "tokens": args.mb_size * m * args.seq / t}


HEADER = ("| schedule | ranks | step ms | tokens/s | pipe meas ms | pipe pred ms | pred/meas "
          "| bubble meas % | bubble pred % | peak meas KiB | peak plan KiB |")


def row(name, ranks, r) -> str:
    if r is None or "error" in r:
        return f"| {name} | {ranks} | n/a: {r['error'] if r else ''} | | | | | | | | |"
    if "meas" not in r:
        return (f"| {name} | {ranks} | {r['step'] * 1e3:.1f} | {r['tokens']:.0f} "
                f"| | | | | | | |")
    return (f"| {name} | {ranks} | {r['step'] * 1e3:.1f} | {r['tokens']:.0f} "
            f"| {r['meas'] * 1e3:.1f} | {r['pred'] * 1e3:.1f} | {r['pred'] / r['meas']:.2f} "
            f"| {per_rank(r['bub_meas'])} | {per_rank(r['bub_pred'])} "
            f"| {r['peak_meas'] / 1024:.0f} | {r['peak_plan'] / 1024:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--md", default=None, help="also write the table to this markdown file")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    if max(ranks) > len(jax.devices()):
        sys.exit(f"need {max(ranks)} devices (JAX_NUM_CPU_DEVICES), have {len(jax.devices())}")
    lines = [HEADER, "|" + "|".join("---" for _ in range(HEADER.count("|") - 1)) + "|"]
    base = run_scan_baseline(args)
    lines.append(row("jax.jit + lax.scan (1 device)", 1, base))
    print("\n".join(lines), flush=True)
    for name in args.schedules.split(","):
        for r in ranks:
            lines.append(row(name, r, run_baton(args, name, r)))
            print(lines[-1], flush=True)
    cpus = os.cpu_count()
    head = [
        "# Pipeline benchmark (GPT-style model, every schedule)",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()}, {platform.machine()}, {cpus} CPUs, Python "
        f"{platform.python_version()}, JAX {jax.__version__} ({jax.default_backend()})",
        f"- model: examples/gpt.py, {LAYERS} blocks, dim {args.dim}, seq {args.seq}, vocab 256, "
        f"4 heads; {args.microbatches} microbatches of {args.mb_size} sequences; AdamW",
        f"- command: `python bench/pipeline.py --steps {args.steps}"
        + (f" --md {args.md}`" if args.md else "`"),
        "- method: see the docstring of bench/pipeline.py; bubbles per rank as r0/r1/...",
        "",
    ]
    text = "\n".join(head + lines) + "\n"
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
