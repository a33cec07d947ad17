"""Which schedule when: each schedule's simulated step, bubble and peak activation memory on 4
ranks (baton.plan + simulate, no JAX), for the README's "Choosing a schedule" table.

    python bench/schedule_choice.py [--ranks 4] [--microbatches 8 32]

Costs: one rank's share of the model per microbatch takes F = 1 forward and B = 2 backward
(I = W = 1 when split), a rank with v stages runs each in 1/v of that; one rank's stash of one
microbatch is 1 unit (1/v per stage); transfers take no time and the weight-gradient stash of
the zero-bubble schedules is not counted (the simulator's ``wstash_bytes`` = 0). Real costs:
``baton.profile`` / ``baton.autoplan`` on the model.
"""

from __future__ import annotations

import argparse

import baton

SCHEDULES = [("GPipe", baton.GPipe()), ("1F1B", baton.OneFOneB()),
             ("Interleaved1F1B v=2", baton.Interleaved1F1B(2)), ("ZBH1", baton.ZBH1()),
             ("ZBH2", baton.ZBH2()), ("ZBV", baton.ZBV()), ("DualPipeV", baton.DualPipeV()),
             ("VMin", baton.VMin()), ("VHalf", baton.VHalf())]
UNIT = 1000  # bytes standing for one rank's stash of one microbatch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 32])
    a = ap.parse_args(argv)
    print(f"| schedule | stages on {a.ranks} ranks | M | step (F = 1) | bubble (mean over ranks) "
          f"| peak stash (largest rank, one rank's per-microbatch stash = 1) |")
    print("|---|---|---|---|---|---|")
    for name, spec in SCHEDULES:
        s = spec.stages(a.ranks)
        v = s / a.ranks
        costs = {"default": {"f": 1.0 / v, "b": 2.0 / v, "i": 1.0 / v, "w": 1.0 / v,
                             "stash_bytes": int(UNIT / v), "wstash_bytes": 0},
                 "link": {"latency": 0.0, "bandwidth": 1e12}}
        for m in a.microbatches:
            r = baton.plan(spec, a.ranks, m).simulate(costs)
            bubble = sum(r.bubble) / len(r.bubble)
            print(f"| {name} | {s} | {m} | {r.step_time:.1f} | {100 * bubble:.1f}% | "
                  f"{max(r.peak_activation) / UNIT:.1f} |")


if __name__ == "__main__":
    main()
