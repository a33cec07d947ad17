"""Pipeline-buffer memory of the table rank programs: the bytes their rings hold, with kinds
of equal avals sharing one ring (what the programs use) and with one ring per buffer kind
(before commit b98cbd1), against the most bytes of buffers ever live at once (the schedule's
peak, a lower bound for any rings), and XLA's memory analysis of each compiled rank program
(temporaries: the rings are loop carries, so they live there). Prints a table.

    python bench/table_memory.py [--ranks 4] [--dim 128] [--schedules ...] [--md FILE]

The model is examples/gpt.py (``--dim``, 2 blocks per stage), 8 microbatches of 2 sequences,
AdamW, on ``--ranks`` CPU devices of one process (the compiled engine, one program per rank).
A benchmark, not a test: the numbers are bytes, exact for a given program.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
from timing import publish  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import baton  # noqa: E402
import gpt  # noqa: E402

ALL = "gpipe,1f1b,eager1f1b,interleaved,zbh1,zbh2,zbv,dualpipev"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--schedules", default=ALL)
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    mib = 1 << 20
    lines = [
        f"# Pipeline buffers of the table rank programs ({datetime.date.today()}, "
        f"{platform.node()}, {os.cpu_count()} CPUs, jax {jax.__version__})",
        "",
        f"`python bench/table_memory.py --ranks {a.ranks} --dim {a.dim}`: GPT dim {a.dim}, seq 16, "
        "2 blocks per stage, 8 microbatches of 2, AdamW; one process, one CPU device per rank. "
        "MiB per rank (ranks 0..R-1). *live peak*: the most bytes of buffers live at once; "
        "*shared rings*: the rings the programs hold (kinds of equal avals share one; ranks "
        "sharing one program: rings sized for every member); *per-kind "
        "rings*: one ring per buffer kind; *XLA temp*: `memory_analysis().temp_size_in_bytes` "
        "of each compiled rank program.",
        "",
        "| schedule | live peak | shared rings | per-kind rings | XLA temp |",
        "|---|---|---|---|---|",
    ]
    for name in a.schedules.split(","):
        sched = baton.schedule_from_name(name)
        stages = sched.stages(a.ranks)
        cfg = gpt.GPTConfig(stages=stages, layers=2 * stages, dim=a.dim, heads=4, vocab=256)
        model, params, opt, st, step, ref = gpt.make(cfg, eps=1e-6)
        batch = gpt.synthetic_batch(cfg, 16)
        ps = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:a.ranks], ranks=a.ranks),
                       schedule=sched, microbatches=8)
        jax.block_until_ready(ps(params, st, batch))
        engine = [cs for cs in ps._cache.values()][0].engine
        progs = engine.local_progs
        compiled = {m.rank: q.compiled for q in engine.local_units  # (a shared program: its
                    for m in getattr(q, "progs", [q])}             # members' one executable)

        def col(f):
            return " / ".join(f"{f(p) / mib:.2f}" for p in progs)

        lines.append(f"| {name} | {col(lambda p: p.live_buffer_peak())} | "
                     f"{col(lambda p: p.ring_bytes())} | "
                     f"{col(lambda p: p.ring_bytes(pooled=False))} | "
                     f"{col(lambda p: compiled[p.rank].memory_analysis().temp_size_in_bytes)} |")
        print(lines[-1], flush=True)
    publish("\n".join(lines) + "\n", a.md)


if __name__ == "__main__":
    main()
