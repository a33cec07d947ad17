"""MaxText on two cores: Baton's pipeline as 2 ranks in 2 processes pinned to one core each,
against MaxText's own pipeline parallelism on 2 CPU devices in one process on the same two
cores. Prints a markdown table (and writes it with --md).

    .venv-maxtext/bin/python bench/maxtext_pinned.py [--schedules 1f1b,zbh1] [--steps 5]
                                                      [--repeat 1] [--md FILE]

The model, batch and optimizer are bench/maxtext.py's (MaxText's llama2-7b config shrunk to 8
layers, ``scan_layers=True``, batch 16 in 8 microbatches, MaxText's AdamW and clipping).

* **MaxText ICI PP**: MaxText's ``train_step`` as its trainer jits it (bench/maxtext.py's
  ``_maxtext_trainer``) with ``ici_pipeline_parallelism=2``, one layer per stage and circular
  repeats (8 layers = 2 stages x 4 repeats); ``JAX_NUM_CPU_DEVICES=2``, XLA's default threads,
  both cores.
* **Baton**: ``python -m baton.launch --nprocs 2``; rank r is pinned to core r with one CPU
  device and one XLA thread, the scanned stack cut into 2 stages of 4 layers, talking Gloo.
  Each process traces the step, plans it and compiles only its own rank's program. The two
  processes meet at a barrier before their first call, so its timer starts when both can call.

Columns: ``first call s`` is the wall time of the first step call until its outputs are ready
(trace, plan, compile, run; persistent compilation cache off), Baton's slowest process;
``/ MaxText's, same round``: that over MaxText's first call launched just before it (each of
``--repeat`` rounds launches MaxText, then each schedule, so drift of the machine's speed hits
both); ``CPU s`` is the process's CPU time over that call (user + system, every thread;
Baton: per rank); ``step ms`` the median of ``--steps`` calls after two warm-up calls. With
``--repeat``, each column is the median over the rounds' fresh launches. A benchmark, not a
test.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from timing import ONE_THREAD, publish  # (bench/, imported before it leaves the path)

# This file's folder off the path, or `import maxtext` finds bench/maxtext.py.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [q for q in sys.path if os.path.abspath(q or ".") != _HERE]
RANKS = 2


def _bench_maxtext():
    """bench/maxtext.py as a module (its name would shadow MaxText's package)."""
    spec = importlib.util.spec_from_file_location("bench_maxtext",
                                                  os.path.join(_HERE, "maxtext.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _line(text: str) -> None:
    """One line on stdout in one write: the two ranks share the pipe, and ``print`` writes
    the text and its newline apart, so their lines could interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _timed(fn) -> tuple[float, float]:
    import jax

    w, c = time.perf_counter(), _cpu()
    jax.block_until_ready(fn())
    return time.perf_counter() - w, _cpu() - c


def _steady(call, steps: int) -> float:
    import jax

    for _ in range(2):
        jax.block_until_ready(call())
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def part_maxtext(args) -> dict:
    bm = _bench_maxtext()
    bm._no_persistent_cache()
    import jax
    from flax.core.spmd import logical_axis_rules
    from maxtext.utils import sharding

    from baton.integrations import maxtext as bmt

    cfg = bmt.load_config("llama2", batch=bm.BATCH, ici_pipeline_parallelism=RANKS,
                          ici_fsdp_parallelism=1, num_pipeline_microbatches=bm.MICROBATCHES,
                          num_layers_per_pipeline_stage=1, **{**bm.MODEL, "scan_layers": True})
    step_fn, state, mesh = bm._maxtext_trainer(cfg)
    data_sharding = sharding.get_input_data_sharding(cfg, mesh, rules=cfg.logical_axis_rules)
    batch = jax.device_put(bmt.synthetic_batch(cfg, 0), data_sharding)
    box = {"state": jax.block_until_ready(state)}

    def call():
        with jax.set_mesh(mesh), logical_axis_rules(cfg.logical_axis_rules):
            box["state"], metrics = step_fn(box["state"], batch)
        return metrics["scalar"]["learning/loss"]

    first, cpu = _timed(call)
    step = _steady(call, args.steps)
    return dict(name=f"MaxText ICI PP (circular, {RANKS} stages x "
                f"{int(cfg.num_pipeline_repeats)} repeats), 1 process, 2 cores",
                first=first, cpu=[cpu], step=step)


def _barrier() -> None:
    """Waits until every process gets here. Each process initializes its own stage's
    parameters first, and one finishes that up to 0.3 s before the other: without the barrier
    the earlier one's first call would count that wait. (It connects the process group, a
    few milliseconds, before the timer.)"""
    from baton.running.distributed import Router, process_group

    router = Router(process_group("gloo"), 60.0)
    router.allgather("ready")
    router.finish()


def part_baton(args) -> dict:
    rank = int(os.environ["BATON_RANK"])
    os.sched_setaffinity(0, {rank})
    bm = _bench_maxtext()
    bm._no_persistent_cache()
    import jax

    import baton
    from baton.integrations import maxtext as bmt

    clk = bm._Clock()
    sched = baton.schedule_from_name(args.schedules)
    stages = sched.stages(RANKS)
    m = bmt.build("llama2", batch=bm.BATCH, **bm.MODEL)
    p = m.init_params(stages=stages)
    o = jax.block_until_ready(m.init_opt_state(p))
    batch = m.make_batch(0)
    step = m.pipeline_step(m.mesh, sched, microbatches=bm.MICROBATCHES, stages=stages)
    box = {"p": p, "o": o}

    def call():
        box["p"], box["o"], loss = step(box["p"], box["o"], batch)
        return loss

    _barrier()  # both processes start their first call together
    prof_dir = os.environ.get("BATON_BENCH_PROFILE")  # a folder: cProfile of the first call
    if prof_dir:
        import cProfile

        prof = cProfile.Profile()
        first, cpu = clk.span("first", _timed, lambda: prof.runcall(call))
        prof.dump_stats(os.path.join(prof_dir, f"first-rank{rank}.prof"))
    else:
        first, cpu = clk.span("first", _timed, call)
    t = _steady(call, args.steps)
    res = dict(rank=rank, first=first, cpu=cpu, step=t,
               xla_compiles=clk.during["first"]["xla_n"], xla_s=clk.during["first"]["xla"],
               compiles=clk.compiles)
    _line("RANK " + json.dumps(res))
    return res


def _launch(args, part: str) -> list[dict]:
    me = os.path.abspath(__file__)
    env = dict(os.environ)
    cmd = [sys.executable, me, "--part", part, "--steps", str(args.steps),
           "--schedules", args.schedules]
    if part == "baton":
        env.update(JAX_NUM_CPU_DEVICES="1", XLA_FLAGS=ONE_THREAD)
        cmd = [sys.executable, "-m", "baton.launch", "--nprocs", str(RANKS), *cmd[1:]]
    else:
        env.update(JAX_NUM_CPU_DEVICES=str(RANKS),
                   XLA_FLAGS=_bench_maxtext().NO_CONCURRENT_SCHED)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    out = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines()
           if line.startswith(("RANK ", "RESULT "))]
    if p.returncode or not out:
        raise SystemExit(f"{part}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return out


def _row(name: str, runs: list[dict]) -> str:
    """One table row from ``runs`` (per launch: ``first`` wall s, ``cpu`` s per process,
    ``step`` s, ``ratio``: first over MaxText's in the same round), medians over launches."""
    med = statistics.median
    first = med(r["first"] for r in runs)
    cpus = [med(r["cpu"][i] for r in runs) for i in range(len(runs[0]["cpu"]))]
    step = med(r["step"] for r in runs)
    ratio = f"{med(r['ratio'] for r in runs):.2f}" if "ratio" in runs[0] else "1"
    return (f"| {name} | {first:.1f} | {ratio} | {' + '.join(f'{c:.1f}' for c in cpus)} "
            f"| {step * 1e3:.0f} | {len(runs)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="1f1b,zbh1")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--md", default=None, help="also write the table there (appended as a dated "
                    "section to an existing results file)")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part == "maxtext":
        _line("RESULT " + json.dumps(part_maxtext(args)))
        return
    if args.part == "baton":
        part_baton(args)
        return
    names = args.schedules.split(",")
    mt, runs = [], {n: [] for n in names}
    for _ in range(args.repeat):  # rounds: MaxText, then each schedule (drift hits all alike)
        mt.append(_launch(args, "maxtext")[0])
        for name in names:
            one = argparse.Namespace(**{**vars(args), "schedules": name})
            ranks = sorted(_launch(one, "baton"), key=lambda r: r["rank"])
            runs[name].append(dict(first=max(r["first"] for r in ranks),
                                   cpu=[r["cpu"] for r in ranks],
                                   step=max(r["step"] for r in ranks),
                                   ratio=max(r["first"] for r in ranks) / mt[-1]["first"]))
            got = runs[name][-1]
            print(f"round {len(mt)}: MaxText {mt[-1]['first']:.2f} s, Baton {name} "
                  f"{max(r['first'] for r in ranks):.2f} s, ratio {got['ratio']:.3f}, CPU "
                  f"{' + '.join(f'{c:.2f}' for c in got['cpu'])}", file=sys.stderr, flush=True)
    rows = [_row(mt[0]["name"], mt)]
    for name in names:
        rows.append(_row(f"Baton {name}, {RANKS} processes pinned to cores 0 and 1", runs[name]))
    import jax

    bm = _bench_maxtext()
    head = ["| run | first call s | / MaxText's, same round | CPU s (per process) | step ms "
            "| launches |", "|---|---|---|---|---|---|"]
    text = "\n".join([
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, JAX {jax.__version__}, MaxText 0.2.5",
        f"- model: bench/maxtext.py's ({bm.MODEL['base_num_decoder_layers']} layers, "
        f"`scan_layers=True`, batch {bm.BATCH} in {bm.MICROBATCHES} microbatches); persistent "
        "compilation cache off",
        f"- command: `.venv-maxtext/bin/python bench/maxtext_pinned.py --schedules "
        f"{args.schedules} --steps {args.steps} --repeat {args.repeat}`",
        "",
        *head, *rows, ""])
    publish(text, args.md)


if __name__ == "__main__":
    main()
