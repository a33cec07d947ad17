"""Pipelines run as processes pinned to separate cores, against the non-pipelined baseline
pinned to one core (bench/results/pinned.md), with the simulator's prediction for every run.

    python bench/pinned.py [--schedules gpipe,1f1b,...] [--one-rank gpipe,1f1b,zbh1]
                           [--microbatches 8] [--steps 5] [--dim 256] [--malloc retain|default]
                           [--repeat 1] [--md bench/results/pinned.md]

* baseline: one process pinned to core 0, XLA with one thread; ``jax.jit`` of the training step
  with ``accumulate`` as a ``lax.scan`` over the microbatches (no Baton at run time).
* 2 ranks: ``python -m baton.launch --nprocs 2``; rank r pinned to core r, one XLA thread and one
  CPU device each, talking Gloo; the same GPT cut into ``schedule.stages(2)`` stages.
* 1 rank: Baton in one process pinned to core 0 (the model without stage boundaries).
* machine ceiling: two copies of the baseline at once, on cores 0 and 1.
``--repeat`` rounds each launch the baseline and then every configuration (the VM's speed drifts
within an hour, so each configuration is compared with its own round's baseline).
Every run prints the median wall time of ``--steps`` whole steps after 2 warm-up steps (the
step's outputs ready), then ``baton.profile`` measures each task alone, the link, and
``--steps`` traced steps: the microbatch loop's measured span (first task start to last task
end) next to the simulator's prediction from those profiled costs.
The ideal speed-up of 1F1B with p = 2 and m microbatches is 2m/(m+1) (16/9 = 1.78 for m = 8).
A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from timing import (SCHEDULE_NAMES, baseline_step, command_line, first_and_median, gpt_config,
                    machine_lines, pin_to_core, publish)


def baseline(args):
    pin_to_core(args.core)
    if args.malloc == "retain":  # as baton.jit does (retain_host_memory=True)
        from baton import runtime

        runtime.retain_host_memory()
    first, t = first_and_median(baseline_step(args, args.mb_size), args.steps, warmup=2)
    print("RESULT " + json.dumps({"step": t, "first": first}), flush=True)


def worker(args):
    """One rank of the pipeline (``--role worker`` under baton.launch), or the whole pipeline
    on 1 rank (``--role single``)."""
    single = args.role == "single"
    rank = 0 if single else int(os.environ["BATON_RANK"])
    pin_to_core(rank)
    import jax

    import baton
    import gpt

    sched = baton.schedule_from_name(args.schedule)
    ranks = 1 if single else 2
    cfg = gpt_config(args, sched.stages(ranks))
    _, params, _, opt_state, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, args.mb_size * args.microbatches)
    kw = {"mesh": baton.PipelineMesh(jax.devices()[:1], ranks=1)} if single else {}
    step = baton.jit(train_step, schedule=sched, microbatches=args.microbatches,
                     retain_host_memory=args.malloc == "retain",
                     **kw)
    state = {"p": params, "o": opt_state}

    def call():
        state["p"], state["o"], loss = step(state["p"], state["o"], batch)
        return loss

    first, t = first_and_median(call, args.steps, warmup=2)
    res = {"step": t, "first": first}
    prof = baton.profile(step, state["p"], state["o"], batch, runs=args.steps)
    res["measured"] = prof.measured
    res["predicted"] = prof.predicted
    res["tasks"] = json.loads(prof.to_json())["task_times"]  # "F0", "B1", ...
    res["link"] = {k: prof.link[k] for k in ("latency", "bandwidth")}
    res["summary"] = prof.summary()
    if args.trace and rank == 0:
        prof.trace.write(args.trace)
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)


def _result(cmd, timeout=900):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"no result from {' '.join(cmd)} (exit {p.returncode}):\n"
                     f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def _pair_run(cmd):
    """Two copies of ``cmd`` at once, on cores 0 and 1: the machine's own two-core scaling
    (shared caches and memory bandwidth), which bounds any 2-process speed-up."""
    ps = [subprocess.Popen(cmd + ["--core", str(c)], stdout=subprocess.PIPE, text=True)
          for c in (0, 1)]
    steps = []
    for p in ps:
        out, _ = p.communicate(timeout=900)
        steps += [json.loads(line[7:])["step"] for line in out.splitlines()
                  if line.startswith("RESULT ")]
    if len(steps) != 2:
        raise SystemExit(f"no result from the paired baselines {' '.join(cmd)}")
    return steps


def _rounds(base_cmd, cmds, repeat):
    """``repeat`` rounds; each launches the baseline, then every command of ``cmds``, once.
    This VM's speed drifts by several percent within an hour, so a configuration is compared
    with the baseline of its own round: its speed-up is the median over rounds of
    baseline step / its step. Returns the baseline's results and, per command, its results,
    both in round order."""
    base, per = [], [[] for _ in cmds]
    for _ in range(repeat):
        base.append(_result(base_cmd))
        for i, cmd in enumerate(cmds):
            per[i].append(_result(cmd))
    return base, per


def _median_result(rs):
    """The launch with the median step time, with every launch's step under ``all_steps``
    (in round order)."""
    r = dict(sorted(rs, key=lambda x: x["step"])[len(rs) // 2])
    r["all_steps"] = [x["step"] for x in rs]
    return r


def _mib(xs):
    return "/".join(f"{x / 2.0 ** 20:.1f}" for x in xs)


def _pct(xs):
    return "/".join(f"{100 * x:.0f}" for x in xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules",
                    default="gpipe,1f1b,eager1f1b,interleaved,zbh1,zbv,dualpipev",
                    help="schedules run on 2 ranks (comma-separated)")
    ap.add_argument("--one-rank", default="gpipe,1f1b,zbh1",
                    help="schedules run on 1 rank (comma-separated; empty: none)")
    ap.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of launches (the baseline, then every configuration); rows "
                    "report the median launch and the median per-round speed-up")
    ap.add_argument("--malloc", choices=["retain", "default"], default="retain",
                    help="host allocator for every run, baseline included: 'retain' keeps freed "
                    "memory (baton.jit's default), 'default' is glibc's")
    ap.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--md")
    ap.add_argument("--trace", help="write rank 0's last profiled step trace here (workers)")
    ap.add_argument("--role", choices=["main", "baseline", "worker", "single"], default="main")
    args = ap.parse_args()
    if args.role == "baseline":
        return baseline(args)
    if args.role in ("worker", "single"):
        return worker(args)

    common = ["--malloc", args.malloc,
              "--microbatches", str(args.microbatches), "--mb-size", str(args.mb_size),
              "--seq", str(args.seq), "--dim", str(args.dim), "--steps", str(args.steps)]
    me = os.path.abspath(__file__)
    runs = [(s, "single") for s in args.one_rank.split(",") if s]
    runs += [(s, "worker") for s in args.schedules.split(",") if s]
    cmds = []
    for sched, role in runs:
        cmd = [me, "--role", role, "--schedule", sched, *common]
        if role == "worker":
            cmd = ["-m", "baton.launch", "--nprocs", "2", *cmd]
        cmds.append([sys.executable, *cmd])
    pair = _pair_run([sys.executable, me, "--role", "baseline", *common])
    bases, per = _rounds([sys.executable, me, "--role", "baseline", *common], cmds, args.repeat)
    base = _median_result(bases)
    tokens = args.mb_size * args.microbatches * args.seq
    m = args.microbatches
    rows = [
        "| run | step ms | tokens/s | speed-up | loop meas ms | loop pred ms | pred/meas "
        "| bubble meas % | bubble pred % | peak act meas MiB | peak act plan MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| jax.jit + lax.scan, 1 process on core 0 | {1e3 * base['step']:.1f} "
        f"| {tokens / base['step']:.0f} | 1.00 | | | | | | | |",
        f"| 2 copies of the baseline at once, cores 0 and 1 (machine ceiling) "
        f"| {1e3 * max(pair):.1f} | {2 * tokens / max(pair):.0f} "
        f"| {2 * base['step'] / max(pair):.2f} | | | | | | | |",
    ]
    details = []
    for (sched, role), rs in zip(runs, per):
        r = _median_result(rs)
        ratios = [b["step"] / x["step"] for b, x in zip(bases, rs)]
        speedup = sorted(ratios)[len(ratios) // 2]
        meas, pred = r["measured"], r["predicted"]
        where = "1 rank, 1 process on core 0" if role == "single" else \
            "2 ranks, 2 processes on cores 0 and 1"
        ideal = f" (ideal {2 * m / (m + 1):.2f})" if (role, sched) == ("worker", "1f1b") else ""
        rows.append(
            f"| Baton {SCHEDULE_NAMES.get(sched, sched)}, {where} | {1e3 * r['step']:.1f} "
            f"| {tokens / r['step']:.0f} | {speedup:.2f}{ideal} "
            f"| {1e3 * meas['step_time']:.1f} | {1e3 * pred['step_time']:.1f} "
            f"| {pred['step_time'] / meas['step_time']:.2f} | {_pct(meas['bubble'])} "
            f"| {_pct(pred['bubble'])} | {_mib(meas['peak_activation'])} "
            f"| {_mib(pred['peak_activation'])} |")
        details.append(f"- {sched}, {role}: task times (ms) " + ", ".join(
            f"{k} {1e3 * v:.2f}" for k, v in sorted(r["tasks"].items()))
            + f"; link latency {1e6 * r['link']['latency']:.0f} us; step ms per round: "
            + ", ".join(f"{1e3 * x:.1f}" for x in r["all_steps"])
            + "; speed-up per round: " + ", ".join(f"{x:.3f}" for x in ratios))
        print(rows[-1], flush=True)
    # call 1 of each process (rank 0's for a pipeline: it returns once every rank's part of
    # the step is done): trace, plan, compile (each process its own rank's programs, on its
    # own core), the transport's connection and one step
    firsts = ["", "First call (the median launch's; rank 0's process for a pipeline):", "",
              "| run | call 1 s | step s | call 1 - step s | / baseline's |", "|---|---|---|---|---|",
              f"| jax.jit + lax.scan, 1 process on core 0 | {base['first']:.2f} "
              f"| {base['step']:.2f} | {base['first'] - base['step']:.2f} | 1.00 |"]
    for (sched, role), rs in zip(runs, per):
        r = _median_result(rs)
        part = r["first"] - r["step"]
        firsts.append(f"| Baton {SCHEDULE_NAMES.get(sched, sched)}, {role} | {r['first']:.2f} "
                      f"| {r['step']:.2f} | {part:.2f} "
                      f"| {part / (base['first'] - base['step']):.2f} |")
    head = [
        "# Pinned pipelines vs the 1-process baseline",
        "",
        *machine_lines(),
        f"- model: examples/gpt.py, 8 blocks, dim {args.dim}, seq {args.seq}; {m} microbatches "
        f"of {args.mb_size}; AdamW; one XLA thread per process",
        command_line("pinned.py"),
        f"- {args.repeat} round(s); each launches the baseline, then every configuration, once "
        "(separate processes, in that order): a row's step ms is its median launch, its "
        "speed-up the median over rounds of the round's baseline step / its step",
        "- step ms: median wall time of a whole step (loop, optimizer, outputs ready), as "
        "`baton.jit` runs it by default (each rank's loop as one XLA program); loop meas/pred: "
        "the microbatch loop's span, measured in traced steps (median; traced steps run the "
        "same compiled programs with their task markers and transfer records on) and "
        "simulated with the profiled task and link costs; bubble and peak activation per "
        "rank (r0/r1).",
        "- machine ceiling: two independent copies of the baseline run at once on the two "
        "cores; its speed-up is their combined throughput (the slower copy's step), a practical "
        "upper bound for any 2-process run on this machine.",
        f"- host allocator: {args.malloc} for every run, baseline included"
        + (" (`baton.runtime.retain_host_memory`, as `baton.jit` does by default)"
           if args.malloc == "retain" else " (glibc's defaults)") + ".",
        "",
    ]
    base_runs = ", ".join(f"{1e3 * x:.1f}" for x in base["all_steps"])
    details.insert(0, f"- baseline: step ms per round: {base_runs}; "
                   "two copies at once: " + ", ".join(f"{1e3 * x:.1f}" for x in pair))
    notes = ["", "Profiled costs (task means inside steps):", ""]
    publish("\n".join(head + rows + firsts + notes + details) + "\n", args.md)


if __name__ == "__main__":
    main()
