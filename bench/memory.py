"""Predicted vs measured peak memory per device of pipelines composed with SPMD, on 8 CPU
devices in one process. Ranks of several devices run on the interpreter (in one process the
compiled engine refuses them); the configurations marked "compiled" run the default compiled
engine, whose measurement adds each loop program's XLA allocation to the live arrays sampled
as the programs start.

    JAX_NUM_CPU_DEVICES=8 python bench/memory.py [--dim 64] [--seq 32] [--batch 32]
        [--microbatches 4] [--schedules 1f1b,interleaved,zbh1,dualpipev]
        [--md bench/results/memory.md]

Configurations: the GPT (examples/gpt.py, ``param_specs(params, tensor=, fsdp=)``) as pipe 2
x data 2 x tensor 2, pipe 2 x fsdp 4, pipe 4 x data 2, and the MoE GPT (examples/moe_gpt.py)
as pipe 2 x expert 2 x data 2. Each configuration runs in its own process (so no other
configuration's arrays are live): one warm-up step, then ``step.memory(params, opt_state,
batch, measure=True)`` on the warm-up step's outputs (the arguments as a training loop passes
them): the model (see python/baton/measure/memory.py) and one step with the live jax arrays
sampled per device. Prints one markdown table per configuration and schedule. DualPipeV
runs at least 2 x ranks microbatches (8 for pipe 4), the others ``--microbatches``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples")
CONFIGS = {
    "gpt pipe 2 x data 2 x tensor 2": dict(model="gpt", mesh=(2, {"data": 2, "tensor": 2}),
                                           tensor="tensor"),
    "gpt pipe 2 x fsdp 4": dict(model="gpt", mesh=(2, {"fsdp": 4}), fsdp="fsdp"),
    "gpt pipe 4 x data 2": dict(model="gpt", mesh=(4, {"data": 2})),
    "moe gpt pipe 2 x expert 2 x data 2": dict(model="moe", mesh=(2, {"expert": 2, "data": 2})),
    "gpt pipe 4 compiled": dict(model="gpt", mesh=(4, {}), engine="compiled"),
    "gpt pipe 1 compiled": dict(model="gpt", mesh=(1, {}), engine="compiled"),
}


def run_one(name: str, schedule: str, a: dict) -> dict:
    sys.path.insert(0, EXAMPLES)
    import gc

    import jax
    import numpy as np
    from jax.sharding import Mesh

    import baton

    c = CONFIGS[name]
    pipe, axes = c["mesh"]
    shape = (pipe, *axes.values())
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape),
                ("pipe", *axes))
    pm = baton.PipelineMesh(mesh)
    sched = baton.schedules.schedule_from_name(schedule)
    stages = sched.stages(pm.num_ranks)
    if c["model"] == "gpt":
        import gpt

        cfg = gpt.GPTConfig(vocab=256, seq=a["seq"], dim=a["dim"], heads=4,
                            layers=max(4, stages), stages=stages)
        _, params, _, st, step, _ = gpt.make(cfg)
        specs = gpt.param_specs(params, tensor=c.get("tensor"), fsdp=c.get("fsdp"))
        batch = gpt.synthetic_batch(cfg, a["batch"])
    else:
        import moe_gpt

        moe_gpt.use_mesh(mesh)
        cfg = moe_gpt.MoEConfig(vocab=256, seq=a["seq"], dim=a["dim"], heads=4,
                                layers=max(4, stages), stages=stages, expert_axis="expert")
        _, params, _, st, step, _ = moe_gpt.make(cfg)
        specs = moe_gpt.param_specs(params)
        batch = moe_gpt.synthetic_batch(cfg, a["batch"])
    m = a["microbatches"]
    if schedule == "dualpipev" and pm.num_ranks == 1:
        return None  # (DualPipeV needs 2 ranks or more)
    if schedule == "dualpipev":  # it needs microbatches >= 2 x ranks
        m = max(m, 2 * pm.num_ranks)
    ps = baton.jit(step, mesh=pm, schedule=sched, microbatches=m,
                   param_shardings=specs, engine=c.get("engine", "interpreter"))
    p, s, _ = ps(params, st, batch)  # warm-up: the arguments then sit where a step leaves them
    del params, st, _
    gc.collect()
    t0 = time.perf_counter()
    mem = ps.memory(p, s, batch, measure=True)
    secs = time.perf_counter() - t0
    n_static = sum(x.nbytes for x in jax.tree.leaves((p, s, batch)))
    return {"table": mem.table(), "worst": mem.worst_ratio(), "seconds": secs,
            "schedule": mem.schedule, "arg_bytes": n_static, "microbatches": m}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedules", default="1f1b,interleaved,zbh1,dualpipev")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--md", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    a = {k: getattr(args, k) for k in ("dim", "seq", "batch", "microbatches")}
    if args.one:
        name, schedule = json.loads(args.one)
        print("RESULT " + json.dumps(run_one(name, schedule, a)))
        return
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8")
    out = ["# Predicted vs measured peak memory per device (pipelines x SPMD)", "",
           f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
           f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, "
           f"Python {platform.python_version()}",
           f"- models: examples/gpt.py and examples/moe_gpt.py, 4 blocks (one per stage when "
           f"there are more stages), dim {a['dim']}, seq {a['seq']}, vocab 256; global batch "
           f"{a['batch']} in {a['microbatches']} microbatches; AdamW",
           "- command: `JAX_NUM_CPU_DEVICES=8 python bench/memory.py "
           f"--md bench/results/memory.md` (8 CPU devices, one process per configuration; "
           "the interpreter, but for the configurations marked compiled)",
           "- predicted: `step.memory(...)` (max(static + copies + loop, update), see "
           "docs/ARCHITECTURE.md, \"Measurement and memory\"); measured: the peak over one step (the "
           "microbatch loop and the optimizer update after it) of the live jax arrays' bytes "
           "per device (`jax.live_arrays()`), plus the running task's or update segment's XLA "
           "temporaries at samples taken inside it; ratio = predicted / measured; \"update\": "
           "the same over the segments after the loop only", ""]
    worst = []
    for name in args.configs.split(","):
        for schedule in args.schedules.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--one",
                   json.dumps([name, schedule])] + sum(
                       ([f"--{k}", str(v)] for k, v in a.items()), [])
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
            if res.returncode != 0 or not line:
                raise SystemExit(f"{name} {schedule} failed:\n{res.stdout}\n{res.stderr}")
            r = json.loads(line[0][7:])
            if r is None:
                continue
            worst.append((name, r["schedule"], r["worst"]))
            block = [f"## {name}, {r['schedule']}", "",
                     f"model + measurement {r['seconds']:.1f} s; worst predicted / measured "
                     f"{r['worst']:.3f}; {r['microbatches']} microbatches", "", r["table"], ""]
            print("\n".join(block), flush=True)
            out += block
    out += ["## Worst ratio per run", "", "| configuration | schedule | worst ratio |",
            "|---|---|---:|"]
    out += [f"| {n} | {s} | {w:.3f} |" for n, s, w in worst]
    text = "\n".join(out) + "\n"
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
