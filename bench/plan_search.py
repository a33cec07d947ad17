"""Planning-time benchmark of the automatic planner (baton.planning.plan.autoplan_segments).

Random segment costs (seeded) for 8/16/32/64 segments on 4 and 8 ranks, every
schedule family, microbatch counts dividing the batch up to 4*ranks; plus an
unbalanced 64-segment model (a large first and last segment, like an embedding
and an LM head) under a memory budget. Each case runs with the default node
budget (exact unless the budget runs out; then approximate with a certified
gap) and, where it finishes quickly, with no budget (exact).

    .venv/bin/python bench/plan_search.py [--out bench/results/plan_search.md] [--no-exact]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

from baton.planning.plan import autoplan_segments

MiB = 2**20


def segments(n: int, seed: int, unbalanced: bool = False, batch: int = 64) -> dict:
    rnd = random.Random(seed)
    segs = []
    for k in range(n):
        f = 1e-3 * (1 + 0.3 * rnd.random())
        edge = k in (0, n - 1)
        if unbalanced and k == 0:
            f *= 4  # embedding
        if unbalanced and k == n - 1:
            f *= 6  # LM head
        b = 2 * f * (1 + 0.1 * rnd.random())
        i = 0.55 * b
        segs.append(
            dict(
                name=f"layer{k}",
                f=f,
                b=b,
                i=i,
                w=b - i,
                overhead=2e-5,
                act_bytes=8 * MiB,
                stash_bytes=int(40 * MiB * (1 + rnd.random())),
                min_stash_bytes=8 * MiB,
                min_recompute=0.4 * f,
                wstash_bytes=4 * MiB,
                param_bytes=(300 if unbalanced and edge else 50) * MiB,
                opt_bytes=(600 if unbalanced and edge else 100) * MiB,
                temp_bytes=16 * MiB,
            )
        )
    return dict(
        batch=batch,
        ref_microbatch=8,
        link=dict(latency=2e-5, bandwidth=25e9),
        fused_factor=0.9,
        segments=segs,
    )


def run(costs, ranks, memory, node_budget):
    t0 = time.perf_counter()
    rows = autoplan_segments(costs, ranks, memory, top=3, node_budget=node_budget)
    wall = time.perf_counter() - t0
    return rows, wall


def fmt_row(name, n, ranks, memory, mode, rows, wall):
    s = rows.stats
    best = rows[0]
    quality = "exact" if s["exact"] else f"certified gap {100 * s['gap']:.1f}%"
    plan = f"{best['schedule']} v={best['virtual_stages']} M={best['microbatches']}"
    return (
        f"| {name} | {n} | {ranks} | all 8 | {memory or 'unlimited'} | {mode} | {s['seconds']:.3f} "
        f"| {s['configurations']} | {s['partitions']} | {s['simulated']} | {s['pruned']} "
        f"| {plan} | {best['step_time'] * 1e3:.2f} ms | {quality} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "plan_search.md"))
    ap.add_argument("--no-exact", action="store_true", help="skip the runs without node budget")
    ap.add_argument("--smoke", action="store_true",
                    help="one small case of each kind (8 segments, 4 ranks), for bench/smoke.py")
    args = ap.parse_args()

    cases = []
    for n in (8,) if args.smoke else (8, 16, 32, 64):
        for ranks in (4,) if args.smoke else (4, 8):
            cases.append((f"random-{n}", segments(n, seed=n * 10 + ranks), ranks, None))
    big, wide = (8, 4) if args.smoke else (64, 8)
    cases.append((f"unbalanced-{big}", segments(big, seed=7, unbalanced=True), wide, None))
    for memory in () if args.smoke else ("6GiB", "4GiB"):
        cases.append(("unbalanced-64", segments(64, seed=7, unbalanced=True), 8, memory))

    lines = [
        "| case | segments | ranks | families | memory/rank | mode | search s | configs "
        "| partitions | simulated | pruned | best plan | step | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, costs, ranks, memory in cases:
        n = len(costs["segments"])
        rows = None
        try:
            rows, wall = run(costs, ranks, memory, 20000)
            lines.append(fmt_row(name, n, ranks, memory, "default (budget 20000)", rows, wall))
        except Exception as e:  # noqa: BLE001 - report and go on
            lines.append(f"| {name} | {n} | {ranks} | all 8 | {memory} | default | - | - | - | - "
                         f"| - | {type(e).__name__}: {e} | - | - |")
        print(lines[-1], flush=True)
        if not args.no_exact and (n <= 16 or (n == 32 and ranks == 4)):
            exact, wall = run(costs, ranks, memory, 0)
            lines.append(fmt_row(name, n, ranks, memory, "exact (no budget)", exact, wall))
            print(lines[-1], flush=True)
            if rows is not None and not rows.stats["exact"]:
                same = rows[0]["step_time"] == exact[0]["step_time"]
                notes.append(
                    f"* {name}, {ranks} ranks: the default run's best step time "
                    f"{'equals' if same else 'differs from'} the exact optimum "
                    f"({rows[0]['step_time'] * 1e3:.3f} vs {exact[0]['step_time'] * 1e3:.3f} ms)."
                )

    header = (
        "# Automatic planning: search time\n\n"
        "`bench/plan_search.py` (Release build of `_core`; "
        f"{platform.machine()}, {os.cpu_count()} CPUs shared with other jobs, so times are "
        "upper bounds). Random segment costs (seeded; 1 ms +-30% forward per segment, "
        "backward ~2x, 8 MiB activations, 40-80 MiB stash), batch 64 (reference microbatch "
        "8), every family (GPipe, 1F1B, Eager 1F1B, Interleaved v=2, ZB-H1, ZB-H2, ZB-V, "
        "DualPipeV), M in the divisors of 64 up to 4*ranks, remat keep/min/full per stage. "
        "`search s` is the C++ search (AutoplanStats::seconds). `result`: exact, or the "
        "certified gap (best row / smallest bound of what the node budget left unexplored; "
        "a loose upper bound on the real gap).\n\n"
    )
    text = header + "\n".join(lines) + "\n"
    if notes:
        text += "\n" + "\n".join(notes) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
