"""Automatic planning on an unbalanced model, measured.

    JAX_NUM_CPU_DEVICES=4 python bench/autoplan.py --budget 600 > bench/results/autoplan.md

The GPT example with a large vocabulary (embedding and tied LM head much heavier than a
block), 12 blocks, a stage_boundary after every block (12 segments), 4 ranks, batch 16.
Prints markdown: the planning time (segment measurement, search), then measured step times
(median of --steps calls after a warm-up) of the automatic plan, of the hand choice (uniform
3 blocks per stage, 1F1B, 8 microbatches) and of a grid of configurations (cuts x schedule x
microbatches x remat) in random order until --budget seconds are spent; the predicted step
time of each next to it; and the plan under a memory budget below the uniform plan's
predicted peak.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import gpt  # noqa: E402

import baton  # noqa: E402
from baton import _core  # noqa: E402
from baton.autoplan import Candidate  # noqa: E402

RANKS = 4


def measure(fn, mesh, args, kw, steps):
    ps = baton.jit(fn, mesh=mesh, **kw)
    p, s, b = args
    p, s, _ = ps(p, s, b)  # compile + first call
    jax.block_until_ready(p)
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        p, s, loss = ps(p, s, b)
        jax.block_until_ready((p, loss))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _evaluate(costs, c: Candidate) -> dict:
    """The simulator on one configuration (its cuts and remat), as the search evaluates it."""
    return _core.autoplan_evaluate(
        json.dumps(baton.costs_at(costs, c.microbatches)),
        c.schedule, RANKS, c.virtual_stages, c.microbatches, c.cuts, c.remat)


def predicted(costs, c: Candidate) -> float:
    return float(_evaluate(costs, c)["step_time"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=600, help="seconds for the grid")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=12,
                    help="blocks, each a segment (a multiple of 4: the uniform plan)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per segment measurement")
    args = ap.parse_args()
    L = args.layers
    if L < 4 or L % 4:
        ap.error("--layers must be a positive multiple of 4")
    cfg = gpt.GPTConfig(vocab=args.vocab, dim=args.dim, seq=32, heads=4, layers=L, stages=L)
    model, params, opt, st, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, args.batch)
    mesh = baton.PipelineMesh(jax.devices()[:RANKS], ranks=RANKS)
    xs = (params, st, batch)

    t0 = time.perf_counter()
    rows = baton.autoplan(train_step, *xs, ranks=RANKS, runs=args.runs, use_cache=False)
    t_plan = time.perf_counter() - t0
    costs = rows.segments
    t0 = time.perf_counter()
    again = baton.autoplan(train_step, *xs, ranks=RANKS, runs=args.runs)
    t_again = time.perf_counter() - t0
    best = rows.best

    print(f"# Automatic planning, measured ({time.strftime('%Y-%m-%d')}, 2 shared CPUs, "
          f"jax {jax.__version__})\n")
    print(f"`python bench/autoplan.py --budget {args.budget:g}`: GPT vocab {cfg.vocab}, dim "
          f"{cfg.dim}, {L} blocks with a boundary after each ({L} segments), {RANKS} ranks, "
          f"batch {args.batch} x seq {cfg.seq}, AdamW. Step times: median of {args.steps} "
          f"calls after the first.\n")
    print(f"Planning: segment measurement {rows.stats['measure_seconds']:.1f} s, search "
          f"{rows.stats['search_seconds']:.2f} s (C++: " + ", ".join(
              f"{k} {v:.3f} s" for k, v in rows.stats.items() if k.endswith(".seconds"))
          + f"); a second plan of the same step (costs from the cache) {t_again:.2f} s "
          f"({t_plan / max(t_again, 1e-9):.0f}x faster).\n")
    print("Top candidates (predicted):\n")
    print(str(rows))
    print()

    uniform = Candidate("1f1b", 1, 8, [0, L // 4, L // 2, 3 * L // 4], ["min"] * 4, 0, 0, [],
                        True)
    table = []
    t_auto = measure(train_step, mesh, xs, best.jit_kwargs(), args.steps)
    table.append(("automatic: " + _name(best), best.step_time, t_auto))
    t_uni = measure(train_step, mesh, xs, uniform.jit_kwargs(), args.steps)
    table.append((f"uniform {L // 4} blocks/stage, 1F1B, M=8, remat min",
                  predicted(costs, uniform), t_uni))
    # the grid: contiguous cuts x families x M x remat, in random order, until the budget
    cuts4 = [[0, *c] for c in itertools.combinations(range(1, L), 3)]
    cuts8 = [[0, *c] for c in itertools.combinations(range(1, L), 7)]
    grid = []
    for fam in ("gpipe", "1f1b", "eager1f1b", "zbh1", "zbh2"):
        for m in (4, 8, 16):
            for r in ("keep", "min"):
                grid += [Candidate(fam, 1, m, c, [r] * 4, 0, 0, [], True) for c in cuts4]
    for fam, v in (("interleaved", 2), ("zbv", 2), ("dualpipev", 2)):
        for m in (4, 8, 16):
            for r in ("keep", "min"):
                grid += [Candidate(fam, v, m, c, [r] * 8, 0, 0, [], True) for c in cuts8]
    random.Random(args.seed).shuffle(grid)
    t_end = time.perf_counter() + args.budget
    measured = []
    for c in grid:
        if time.perf_counter() > t_end:
            break
        try:
            t = measure(train_step, mesh, xs, c.jit_kwargs(), args.steps)
        except baton.BatonError:
            continue  # a schedule that refuses this (ranks, M)
        measured.append((c, t))
    print(f"Measured ({len(measured)} grid configurations of {len(grid)} in {args.budget:g} s, "
          "random order):\n")
    print("| configuration | predicted (ms) | measured (ms) | vs automatic |\n|---|---|---|---|")
    for name, p, m in table:
        print(f"| {name} | {p * 1e3:.1f} | {m * 1e3:.1f} | {m / t_auto:.2f}x |")
    for c, m in sorted(measured, key=lambda x: x[1])[:10]:
        print(f"| grid: {_name(c)} | {predicted(costs, c) * 1e3:.1f} | {m * 1e3:.1f} | "
              f"{m / t_auto:.2f}x |")
    if measured:
        fastest = min(m for _, m in measured)
        print(f"\nAutomatic plan vs the fastest measured grid configuration: "
              f"{t_auto / fastest:.3f}x; vs the uniform 1F1B split: {t_auto / t_uni:.3f}x.")
    # a memory budget the uniform plan exceeds
    uni_peak = max(_peak(costs, uniform))
    budget = int(uni_peak * 0.8)
    try:
        tight = baton.autoplan(train_step, *xs, ranks=RANKS, memory_per_device=budget,
                               runs=args.runs)
        tb = tight.best
        t_tight = measure(train_step, mesh, xs, tb.jit_kwargs(), args.steps)
        print(f"\nMemory budget {budget / 2**20:.2f} MiB per rank (0.8x the uniform plan's "
              f"predicted peak {uni_peak / 2**20:.2f} MiB): {_name(tb)}, predicted peak "
              f"{max(tb.peak_memory) / 2**20:.2f} MiB, step {t_tight * 1e3:.1f} ms measured "
              f"({tb.step_time * 1e3:.1f} predicted) vs {t_auto * 1e3:.1f} ms unconstrained.")
    except baton.ConfigError as e:
        print(f"\nMemory budget {budget} B: {e}")
    return 0


def _peak(costs, c):
    return list(_evaluate(costs, c)["peak_memory"])


def _name(c: Candidate) -> str:
    v = f" v{c.virtual_stages}" if c.schedule == "interleaved" else ""
    return f"{c.schedule}{v} M={c.microbatches} cuts={c.cuts} remat={c.remat[0]}"


if __name__ == "__main__":
    sys.exit(main())
