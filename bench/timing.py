"""Step timing and output shared by the benchmarks (imports JAX only when called, so a
benchmark can set XLA flags and CPU affinity first)."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time

# XLA:CPU on one thread (the pinned benchmarks: one core per process).
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
# Schedule generator names as the tables print them.
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "eager1f1b": "Eager 1F1B",
                  "interleaved": "Interleaved 1F1B (v=2)", "zbh1": "ZB-H1", "zbh2": "ZB-H2",
                  "zbv": "ZB-V", "dualpipev": "DualPipeV"}


def machine_lines() -> list[str]:
    """The date and machine lines of a report."""
    return [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
    ]


def command_line(script: str) -> str:
    """The report line naming the command that wrote it (``bench/<script>`` and its arguments)."""
    return f"- command: `python bench/{script} " + " ".join(sys.argv[1:]) + "`"


def median_step(fn, steps: int, warmup: int = 0) -> float:
    """Median wall time (seconds) of ``steps`` calls of ``fn``, each waited for, after
    ``warmup`` untimed calls."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def publish(text: str, md: str | None) -> None:
    """Prints a benchmark's markdown report and, with ``md``, writes it there too."""
    print(text)
    if md:
        with open(md, "w", encoding="utf-8") as f:
            f.write(text)
