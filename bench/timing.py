"""Step timing and output shared by the benchmarks (imports JAX only when called, so a
benchmark can set XLA flags and CPU affinity first)."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

# XLA:CPU on one thread (the pinned benchmarks: one core per process).
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
# Schedule generator names as the tables print them.
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "eager1f1b": "Eager 1F1B",
                  "interleaved": "Interleaved 1F1B (v=2)", "zbh1": "ZB-H1", "zbh2": "ZB-H2",
                  "zbv": "ZB-V", "dualpipev": "DualPipeV"}


def pin_to_core(core: int, cpu_devices: int = 1) -> None:
    """Pins this process to ``core`` with XLA on one thread and ``cpu_devices`` CPU devices,
    and puts examples/ on the path (call before JAX starts)."""
    os.sched_setaffinity(0, {core})
    os.environ["XLA_FLAGS"] = ONE_THREAD
    os.environ["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def gpt_config(args, stages: int, layers: int = 8):
    """The benchmarks' GPT (examples/gpt.py) at ``args.seq`` and ``args.dim``."""
    import gpt

    return gpt.GPTConfig(vocab=256, seq=args.seq, dim=args.dim, heads=4, layers=layers,
                         stages=stages)


def baseline_step(args, mb_size: int):
    """The benchmarks' non-pipelined baseline as a zero-argument call: one ``jax.jit`` of the
    whole GPT's training step, the microbatch loop a ``lax.scan`` (``gpt.scan_step``)."""
    import jax

    import gpt

    cfg = gpt_config(args, 1)
    model, params, opt, opt_state, _, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, mb_size * args.microbatches)
    f = jax.jit(gpt.scan_step(model, opt, args.microbatches))
    return lambda: f(params, opt_state, batch)


def machine_lines() -> list[str]:
    """The date, machine and commit lines of a report."""
    return [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        f"- commit: {_commit()}",
    ]


def _commit() -> str:
    """The checkout's commit (short hash, ``+`` when the tree has local changes), or
    ``unknown`` outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, text=True, capture_output=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+" if dirty else "")


def command_line(script: str) -> str:
    """The report line naming the command that wrote it (``bench/<script>`` and its arguments)."""
    return f"- command: `python bench/{script} " + " ".join(sys.argv[1:]) + "`"


def median_step(fn, steps: int, warmup: int = 0) -> float:
    """Median wall time (seconds) of ``steps`` calls of ``fn``, each waited for, after
    ``warmup`` untimed calls."""
    return first_and_median(fn, steps, warmup)[1]


def first_and_median(fn, steps: int, warmup: int = 0) -> tuple[float, float]:
    """(wall time of the first call of ``fn``, the first of the ``warmup`` calls when there
    are any: trace, compile and one step; the median of the ``steps`` calls after them)."""
    import jax

    first = None
    for _ in range(warmup):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        if first is None:
            first = time.perf_counter() - t
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return (out[0] if first is None else first), statistics.median(out)


def publish(text: str, md: str | None) -> None:
    """Prints a benchmark's markdown report and, with ``md``, writes it there too: a new file
    is the report as it is; an existing one (a benchmark's results file, which keeps every
    run) gets the report appended as a dated section, its headings one level down."""
    print(text)
    if not md:
        return
    if not (os.path.exists(md) and os.path.getsize(md) > 0):
        with open(md, "w", encoding="utf-8") as f:
            f.write(text)
        return
    lines = text.rstrip("\n").split("\n")
    date = next((ln[len("- date: "):] for ln in lines if ln.startswith("- date: ")), "undated")
    title = lines[0].lstrip("# ") if lines and lines[0].startswith("# ") else "run"
    body = lines[1:] if lines and lines[0].startswith("# ") else lines
    section = [f"## {date}: {title}"] + ["#" + ln if ln.startswith("#") else ln for ln in body]
    with open(md, "a", encoding="utf-8") as f:
        f.write("\n" + "\n".join(section) + "\n")
