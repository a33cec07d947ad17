"""Step timing and output shared by the benchmarks (imports JAX only when called, so a
benchmark can set XLA flags and CPU affinity first)."""

from __future__ import annotations

import statistics
import time


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
