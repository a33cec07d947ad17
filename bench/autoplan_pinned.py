"""Automatic planning measured where the simulator's machine model holds: every rank a process
pinned to a core of its own.

    python bench/autoplan_pinned.py --budget 1800 --md bench/results/autoplan_pinned.md

The simulator (and so the search) assumes every rank computes on a processor of its own. On
this 2-core machine that is true for 2 ranks as 2 processes pinned to cores 0 and 1 (XLA on
one thread each, Gloo between them; ``bench/pinned.py`` measured its predictions within 5%);
it is not for 4 ranks on 2 cores (``bench/autoplan.py``). So this benchmark plans and measures
the issue's unbalanced GPT (vocabulary 4096, dim 64, 12 blocks, a candidate boundary after
every block: 12 segments; batch 16 x seq 32; AdamW) on 2 ranks:

1. segment costs: ``baton.measure_segments`` in one process pinned to core 0 (one XLA thread,
   as each rank runs), at every microbatch count the search considers;
2. the link: ``baton.profile`` of the hand-chosen plan (uniform: 6 blocks per stage, 1F1B,
   M=8, remat min) run as 2 pinned processes (Gloo latency and bandwidth between them), which
   replaces the device-to-device copy ``measure_segments`` timed;
3. the search (``baton.search_segments``, no JAX) over every family, M in {1, 2, 4, 8, 16},
   remat keep and min;
4. measured step times (2 pinned processes, median of --steps calls after 2 warm-ups) of the
   automatic plan, the search's other top candidates, the uniform plan, and the grid (cuts x
   family x M x remat: every contiguous split for 2 stages, every one for the 4 stages of the
   v=2 families) in random order until --budget seconds; each launch measures --batch-size
   configurations in turn;
5. a memory budget below the uniform plan's predicted peak: the plan the search picks under
   it, run in one process with the live arrays per device sampled (``step.memory(...,
   measure=True)``), measured peak next to the budget.

``--role bias --reuse RAW`` prints, from a ``--raw`` file, how the predictions err per
microbatch count (measured / predicted step, and each profiled run's traced loop against the
simulation of its own task times).

A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from timing import command_line, machine_lines, median_step, pin_to_core

ME = os.path.abspath(__file__)
RANKS = 2
MICROBATCHES = [1, 2, 4, 8, 16]


def _model(args):
    import gpt

    cfg = gpt.GPTConfig(vocab=args.vocab, dim=args.dim, seq=32, heads=4, layers=args.layers,
                        stages=args.layers)
    _, params, _, opt_state, train_step, _ = gpt.make(cfg)
    return train_step, params, opt_state, gpt.synthetic_batch(cfg, args.batch)


def role_segments(args):
    pin_to_core(0)
    import baton

    train_step, p, s, b = _model(args)
    t = time.perf_counter()
    costs = baton.measure_segments(train_step, p, s, b, microbatches=MICROBATCHES,
                                   runs=args.runs, use_cache=False)
    costs["measured"]["wall"] = time.perf_counter() - t
    print("RESULT " + json.dumps(costs), flush=True)


def _candidate(d):
    from baton.autoplan import Candidate

    return Candidate(d["schedule"], d["v"], d["M"], d["cuts"], [d["remat"]] * len(d["cuts"]),
                     0.0, 0.0, [], True)


def role_measure(args):
    """Under ``baton.launch --nprocs 2``: every configuration of --configs in turn."""
    rank = int(os.environ["BATON_RANK"])
    pin_to_core(rank)
    import gc

    import jax

    import baton

    train_step, p0, s0, b = _model(args)
    with open(args.configs, encoding="utf-8") as f:
        configs = json.load(f)
    for d in configs:
        res = {"config": d}
        step = st = None
        try:
            step = baton.jit(train_step, **_candidate(d).jit_kwargs())
            st = {"p": p0, "o": s0}

            def call():
                st["p"], st["o"], loss = step(st["p"], st["o"], b)
                return loss

            res["step"] = median_step(call, args.steps, warmup=4)
            if d.get("profile"):
                prof = baton.profile(step, st["p"], st["o"], b, runs=args.steps)
                res["link"] = {k: prof.link[k] for k in ("latency", "bandwidth")}
                res["loop_measured"] = prof.measured["step_time"]
                res["loop_predicted"] = prof.predicted["step_time"]
                # "F0", "B1", ...: mean in steps
                res["task_times"] = json.loads(prof.to_json())["task_times"]
        except baton.BatonError as e:  # a schedule that refuses (ranks, M) refuses everywhere
            res["error"] = f"{type(e).__name__}: {e}"[:300]
        if rank == 0:
            print("RESULT " + json.dumps(res), flush=True)
        step = st = None
        gc.collect()
        jax.clear_caches()


def role_memory(args):
    """One process, 2 CPU devices: the plan of --configs[0] with live arrays sampled."""
    os.environ["JAX_NUM_CPU_DEVICES"] = "2"
    sys.path.insert(0, os.path.join(os.path.dirname(ME), "..", "examples"))
    import jax

    import baton

    train_step, p, s, b = _model(args)
    with open(args.configs, encoding="utf-8") as f:
        d = json.load(f)[0]
    mesh = baton.PipelineMesh(jax.devices()[:RANKS], ranks=RANKS)
    step = baton.jit(train_step, mesh=mesh, **_candidate(d).jit_kwargs())
    p, s, _ = step(p, s, b)
    mem = step.memory(p, s, b, measure=True)
    print("RESULT " + json.dumps({"measured": [max(r.values()) for r in _per_rank(mem)],
                                  "table": mem.table()}), flush=True)


def _per_rank(mem):
    """Measured peak bytes per device, grouped by rank."""
    return [{d: mem.measured[d] for d in devs} for devs in mem.rank_devices]


def _verdict(measured, budget) -> str:
    if any(x != x for x in measured):  # NaN: the memory run failed
        return "not measured against"
    return "under" if max(measured) <= budget else "OVER"


def _run(cmd, timeout=3600):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if not out:
        raise SystemExit(f"no result from {' '.join(cmd)} (exit {p.returncode}):\n"
                         f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return out


def _common(args):
    return ["--vocab", str(args.vocab), "--dim", str(args.dim), "--batch", str(args.batch),
            "--steps", str(args.steps), "--layers", str(args.layers),
            "--runs", str(args.runs)]


def _measure(args, configs):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(configs, f)
    try:
        return _run([sys.executable, "-m", "baton.launch", "--nprocs", "2", "--timeout", "900",
                     ME, "--role", "measure", "--configs", f.name, *_common(args)])
    finally:
        os.unlink(f.name)


def _cfg(c) -> dict:
    return {"schedule": c.schedule, "v": c.virtual_stages, "M": c.microbatches,
            "cuts": list(c.cuts), "remat": c.remat[0]}


def _name(d) -> str:
    return f"{d['schedule']} M={d['M']} cuts={d['cuts']} remat={d['remat']}"


def _key(d) -> tuple:
    return (d["schedule"], d["v"], d["M"], tuple(d["cuts"]), d["remat"])


def role_bias(args) -> int:
    """Prints how the search's prediction errs per microbatch count, from a ``--raw`` file
    (``--reuse``): measured / predicted step (the cost model the file holds, through the same
    simulator the search uses) by count, and for the profiled runs the traced loop against
    the simulation of that run's own task times."""
    import statistics

    from baton import _core
    from baton.autoplan import costs_at

    with open(args.reuse, encoding="utf-8") as f:
        raw = json.load(f)
    costs = raw["costs"]
    by_m: dict = {}
    loops: dict = {}
    for r in raw["results"]:
        c = r["config"]
        if not r.get("step"):
            continue
        try:
            e = _core.autoplan_evaluate(json.dumps(costs_at(costs, c["M"])), c["schedule"],
                                        RANKS, c["v"], c["M"], c["cuts"],
                                        [c["remat"]] * len(c["cuts"]))
        except Exception:  # a configuration the generator refuses
            continue
        by_m.setdefault(c["M"], []).append(r["step"] / e["step_time"])
        if r.get("loop_measured"):
            loops.setdefault(c["M"], []).append(r["loop_measured"] / r["loop_predicted"])
    print(f"{args.reuse}: measured / predicted step by microbatch count\n")
    print("| M | runs | median | min | max | profiled runs | traced loop / its simulation |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m in sorted(by_m):
        v, lp = by_m[m], loops.get(m, [])
        print(f"| {m} | {len(v)} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} "
              f"| {len(lp)} | {statistics.median(lp) if lp else float('nan'):.2f} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["main", "segments", "measure", "memory", "bias"],
                    default="main")
    ap.add_argument("--configs")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--budget", type=float, default=1800, help="seconds for the grid")
    ap.add_argument("--batch-size", type=int, default=20, help="configurations per launch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=12,
                    help="blocks, each a segment (even: the uniform plan cuts in the middle)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per segment measurement")
    ap.add_argument("--top", type=int, default=None,
                    help="measure only the search's best TOP candidates (default: all it ranks)")
    ap.add_argument("--md", help="also write the report here")
    ap.add_argument("--raw", default="/tmp/autoplan_pinned_raw.json",
                    help="every measurement so far (JSON), rewritten after each launch")
    ap.add_argument("--reuse", help="a --raw file of an earlier run: its segment costs and "
                    "measurements are reused, only what it lacks is measured")
    args = ap.parse_args()
    if args.role == "segments":
        return role_segments(args)
    if args.role == "measure":
        return role_measure(args)
    if args.role == "memory":
        return role_memory(args)
    if args.role == "bias":
        return role_bias(args)

    import baton

    lines = [f"# Automatic planning on 2 pinned ranks, measured\n", *machine_lines(),
             command_line("autoplan_pinned.py"), ""]
    raw = {"results": []}
    if args.reuse:
        with open(args.reuse, encoding="utf-8") as f:
            raw = json.load(f)
    done = {_key(r["config"]): r for r in raw["results"]}

    def measure(configs):
        todo = [d for d in configs if _key(d) not in done or (
            d.get("profile") and "loop_measured" not in done[_key(d)])]
        for i in range(0, len(todo), args.batch_size):
            for r in _measure(args, todo[i:i + args.batch_size]):
                done[_key(r["config"])] = r
                raw["results"].append(r)
            if args.raw:
                with open(args.raw, "w", encoding="utf-8") as f:
                    json.dump(raw, f)
        return [done[_key(d)] for d in configs]

    if "costs" not in raw:
        raw["costs"] = _run([sys.executable, ME, "--role", "segments", *_common(args)])[0]
    costs = raw["costs"]
    L = args.layers
    uniform = {"schedule": "1f1b", "v": 1, "M": 8, "cuts": [0, L // 2], "remat": "min",
               "profile": True}
    uni = measure([uniform])[0]
    costs["link"] = uni["link"]
    # the step's time outside the loop that the segments' updates do not account for (the
    # multi-process step's own dispatch and exchanges): the uniform run's step less its
    # traced loop and its slowest rank's updates
    upd = max(sum(g["update"] for g in costs["segments"][:L // 2]),
              sum(g["update"] for g in costs["segments"][L // 2:]))
    costs["step_overhead"] = max(uni["step"] - uni["loop_measured"] - upd, 0.0)
    t0 = time.perf_counter()
    rows = baton.search_segments(costs, RANKS, microbatches=MICROBATCHES)
    t_search = time.perf_counter() - t0
    best = dict(_cfg(rows.best), profile=True)

    def predicted(d):
        from baton import _core
        from baton.autoplan import costs_at

        r = _core.autoplan_evaluate(json.dumps(costs_at(costs, d["M"])),
                                    d["schedule"], RANKS, d["v"], d["M"], d["cuts"],
                                    [d["remat"]] * len(d["cuts"]))
        return float(r["step_time"]), [int(x) for x in r["peak_memory"]]

    lines += [
        f"Model: GPT vocab {args.vocab}, dim {args.dim}, {L} blocks with a candidate boundary "
        f"after each ({L} segments), batch {args.batch} x seq 32, AdamW; {RANKS} ranks as 2 "
        "processes pinned to cores 0 and 1, one XLA thread each, Gloo between them. Step "
        f"times: median of {args.steps} calls after 4 warm-ups.\n",
        f"Planning: segment costs measured in {costs['measured']['wall']:.1f} s (one process "
        f"pinned to core 0, at every M searched); link from the profiled uniform run: "
        f"latency {costs['link']['latency'] * 1e6:.0f} us, bandwidth "
        f"{costs['link']['bandwidth'] / 1e9:.2f} GB/s; step overhead (that run's step less its "
        f"traced loop and its slowest rank's optimizer update) "
        f"{costs['step_overhead'] * 1e3:.1f} ms; outside the loop on one rank "
        f"{costs['measured']['outside'] * 1e3:.1f} ms; per microbatch count M: the scale "
        "that makes the isolated task times add up to the probe's untraced loop, and the "
        "per-task saving of merged segments: " + ", ".join(
            f"M={m}: {c['scale']:.2f}, {c['task_overhead'] * 1e3:.2f} ms"
            for m, c in costs["measured"]["calibration"].items())
        + f"; search {t_search:.3f} s.\n",
        "Top candidates (predicted):\n", str(rows), ""]

    # the top candidates, then the grid in random order
    first = [best] + [_cfg(c) for c in rows[1:args.top]]
    seen = {_key(d) for d in first} | {_key(uniform)}
    cuts2 = [[0, c] for c in range(1, L)]
    cuts4 = [[0, *c] for c in itertools.combinations(range(1, L), 3)]
    grid = []
    for fam in ("gpipe", "1f1b", "eager1f1b", "zbh1", "zbh2"):
        for m, r, c in itertools.product(MICROBATCHES, ("keep", "min"), cuts2):
            grid.append({"schedule": fam, "v": 1, "M": m, "cuts": c, "remat": r})
    for fam in ("interleaved", "zbv", "dualpipev"):
        for m, r, c in itertools.product(MICROBATCHES, ("keep", "min"), cuts4):
            grid.append({"schedule": fam, "v": 2, "M": m, "cuts": c, "remat": r})
    random.Random(args.seed).shuffle(grid)
    first = [dict(d, profile=True) for d in first]
    results = measure(first)
    t_end = time.perf_counter() + args.budget
    # grid configurations already measured (--reuse) count; new ones while the budget lasts
    chunk = []
    for d in grid:
        if _key(d) in seen:
            continue
        if _key(d) in done:
            results.append(done[_key(d)])
        elif time.perf_counter() < t_end:
            chunk.append(d)
            if len(chunk) == args.batch_size:
                results += measure(chunk)
                chunk = []
    if chunk and time.perf_counter() < t_end:
        results += measure(chunk)
    n_grid = sum(1 for r in results[len(first):] if "step" in r)
    ok = [r for r in results if "step" in r]
    auto = results[0] if "step" in results[0] else None
    t_auto = auto["step"] if auto else float("nan")
    fastest = min(ok + [uni], key=lambda r: r["step"])

    lines += [
        f"Measured: the automatic plan, the search's other top candidates, the uniform plan "
        f"and {n_grid} grid configurations of {len(grid)} (random order, {args.budget:g} s "
        f"budget; refused by their schedule: "
        f"{sum(1 for r in results if 'error' in r)}). Fastest 15:\n",
        "| configuration | predicted (ms) | measured (ms) | pred/meas | vs automatic |",
        "|---|---|---|---|---|"]

    def row(label, r):
        p, _ = predicted(r["config"])
        return (f"| {label}{_name(r['config'])} | {p * 1e3:.1f} | {r['step'] * 1e3:.1f} | "
                f"{p / r['step']:.2f} | {r['step'] / t_auto:.3f}x |")

    lines.append(row("**automatic**: ", auto) if auto else "| automatic: failed | | | | |")
    lines.append(row("uniform (hand choice): ", uni))
    top = {_key(d) for d in first}
    for r in sorted(ok, key=lambda r: r["step"])[:15]:
        if auto is not None and r is auto:
            continue
        label = "top candidate: " if _key(r["config"]) in top else "grid: "
        lines.append(row(label, r))
    lines.append("")
    if auto:
        lines += [
            f"- automatic vs fastest measured ({_name(fastest['config'])}): "
            f"{t_auto / fastest['step']:.3f}x; vs the uniform 1F1B plan: "
            f"{t_auto / uni['step']:.3f}x.",
            f"- automatic plan, predicted step (simulated loop) {rows.best.step_time * 1e3:.1f} "
            f"ms vs measured step {t_auto * 1e3:.1f} ms: {rows.best.step_time / t_auto:.3f}; "
            f"traced loop span {auto['loop_measured'] * 1e3:.1f} ms vs the profile's "
            f"simulation {auto['loop_predicted'] * 1e3:.1f} ms.",
            f"- uniform plan: predicted {predicted(uniform)[0] * 1e3:.1f} ms, measured "
            f"{uni['step'] * 1e3:.1f} ms; traced loop span {uni['loop_measured'] * 1e3:.1f} ms.",
        ]
    # baton.autoplan(measure_top=k)'s rule: the search's top k, run on the devices, the
    # fastest measured kept (here k = every top candidate, measured as 2 pinned processes)
    fin = [r for r in results[:len(first)] if "step" in r]
    if fin:
        pick = min(fin, key=lambda r: r["step"])
        p_pick = predicted(pick["config"])[0]
        lines += [
            f"- **automatic with the finalists measured** (`autoplan(measure_top={len(first)})`: "
            f"the fastest of the {len(fin)} top candidates run): {_name(pick['config'])}, "
            f"measured {pick['step'] * 1e3:.1f} ms, predicted {p_pick * 1e3:.1f} ms "
            f"(pred/meas {p_pick / pick['step']:.3f}); vs fastest measured "
            f"{pick['step'] / fastest['step']:.3f}x; vs the uniform 1F1B plan "
            f"{pick['step'] / uni['step']:.3f}x.",
        ]
    errs = [r["step"] / predicted(r["config"])[0] for r in ok]
    if errs:
        errs.sort()
        lines.append(f"- measured/predicted over all {len(ok)} measured configurations: "
                     f"median {errs[len(errs) // 2]:.3f}, 10th-90th percentile "
                     f"{errs[len(errs) // 10]:.3f}-{errs[(9 * len(errs)) // 10]:.3f}.")
    # memory budget below the uniform plan's predicted peak
    uni_peak = max(predicted(uniform)[1])
    lines.append("")
    try:
        for frac in (0.8, 0.85, 0.9, 0.95):
            budget = int(uni_peak * frac)
            try:
                tight = baton.search_segments(costs, RANKS, memory_per_device=budget,
                                              microbatches=MICROBATCHES).best
                break
            except baton.ConfigError as e:
                lines.append(f"- budget {frac} x the uniform plan's peak: {e}")
        else:
            raise baton.ConfigError("no budget of 0.8-0.95 x the uniform plan's peak fits")
        td = _cfg(tight)
        tm = measure([td])[0]

        def live_peaks(d):
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump([d], f)
            try:
                return _run([sys.executable, ME, "--role", "memory", "--configs", f.name,
                             *_common(args)])[0]
            except SystemExit as e:  # report what failed, keep the rest of the report
                return {"measured": [float("nan")] * RANKS, "table": str(e)[-2000:]}
            finally:
                os.unlink(f.name)

        mem = live_peaks(td)
        mem_uni = live_peaks({k: v for k, v in uniform.items() if k != "profile"})
        lines += [
            f"Memory budget {budget / 2**20:.2f} MiB per device ({frac} x the uniform plan's "
            f"predicted peak {uni_peak / 2**20:.2f} MiB): the search picks {_name(td)}, "
            f"predicted peak per rank "
            f"{', '.join(f'{x / 2**20:.2f}' for x in tight.peak_memory)} MiB; measured peak "
            f"of live arrays per device (`step.memory(measure=True)`, one process, 2 devices) "
            f"{', '.join(f'{x / 2**20:.2f}' for x in mem['measured'])} MiB: "
            f"{_verdict(mem['measured'], budget)} the budget. The uniform plan's measured "
            f"peak: {', '.join(f'{x / 2**20:.2f}' for x in mem_uni['measured'])} MiB "
            f"({_verdict(mem_uni['measured'], budget)} the budget). Step "
            f"{tm.get('step', float('nan')) * 1e3:.1f} ms measured ({tight.step_time * 1e3:.1f} "
            f"predicted) vs {t_auto * 1e3:.1f} ms unconstrained.\n",
            "Under the budget:", "```", mem["table"], "```",
            "Uniform 1F1B:", "```", mem_uni["table"], "```"]
    except baton.ConfigError as e:
        lines.append(f"Memory budget {budget} B: {e}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
