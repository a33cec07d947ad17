"""Two processes on one GPU: a pipelined GPT (examples/gpt.py, small) trained by two ranks
whose processes share the GPU, so the engine stages their transfers through pinned host
memory over Gloo; compared with jax.jit of the same steps. Run by bench/gpu_check.py as

    CUDA_VISIBLE_DEVICES=0 python -m baton.launch --nprocs 2 \\
        bench/gpu_check_shared.py OUT 1f1b,zbh1,interleaved

(examples/ on PYTHONPATH). For each schedule, process 0 writes ``OUT/<schedule>.json``: the
transfers the engine chose (``staged``, ``nccl``; ``None`` on CPU, whose ranks use Gloo
directly), the pinned bytes the staging holds, whether the first step's parameters and
optimizer state and every step's loss equal jax.jit's (rtol 1e-5, atol 1e-4: ``ATOL``),
the largest difference, and ms/step of both (median of the steps after the first). On CPU
(the dry run) the same runs over Gloo without staging.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402

import baton  # noqa: E402
import gpt  # noqa: E402
from baton.running.distributed import process_group  # noqa: E402

SCHEDULES = {  # name -> (schedule, stages)
    "1f1b": (lambda: baton.OneFOneB(), 2),
    "zbh1": (lambda: baton.ZBH1(), 2),
    "interleaved": (lambda: baton.Interleaved1F1B(virtual_stages=2), 4),
}
M = 4  # microbatches
MB = 2  # sequences per microbatch
STEPS = 3  # the first compiles; the others are timed
# The first step's state and every step's loss. AdamW's first update moves each element by
# about its learning rate (1e-3) whatever the gradient's size, so where a gradient is near
# zero a rounding difference (ZB-H1's weight-gradient tasks sum in another order) moves the
# parameter by a fraction of 1e-3: measured up to 1.7e-5 on CPU. ATOL is 10 % of one step.
RTOL, ATOL = 1e-5, 1e-4


def run(name: str, rank: int, out: str) -> None:
    make_sched, stages = SCHEDULES[name]
    cfg = gpt.GPTConfig(vocab=256, seq=64, dim=128, heads=4, layers=4, stages=stages)
    model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, M * MB)
    fn = baton.jit(train_step, schedule=make_sched(), microbatches=M, timeout=120)
    p, s, losses, times, first = params, opt_state, [], [], None
    for i in range(STEPS):
        t = time.perf_counter()
        p, s, loss = fn(p, s, batch)
        losses.append(float(loss))  # (every process gets the loss: it waits for the step)
        times.append(time.perf_counter() - t)
        if i == 0:  # the first step's results, compared below (collective: both processes)
            first = fn.gather((p, s))
    eng = fn.last.engine
    comm = eng.rank_progs[0].comm if eng.rank_progs else None
    if rank != 0:
        return
    base = jax.jit(gpt.scan_step(model, opt, M))
    bp, bs, blosses, btimes, bfirst = params, opt_state, [], [], None
    for i in range(STEPS):
        t = time.perf_counter()
        bp, bs, bl = jax.block_until_ready(base(bp, bs, batch))
        blosses.append(float(bl))
        btimes.append(time.perf_counter() - t)
        if i == 0:
            bfirst = (bp, bs)
    # the first step's parameters, optimizer state and loss (later steps' AdamW updates
    # amplify rounding where gradients are near zero); every step's loss
    got = [np.asarray(x, np.float64) for x in jax.tree.leaves(first)] + [np.asarray(losses)]
    want = [np.asarray(x, np.float64) for x in jax.tree.leaves(bfirst)] + [np.asarray(blosses)]
    equal = len(got) == len(want) and all(
        a.shape == b.shape and np.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(got, want))
    worst = max((float(np.max(np.abs(a - b), initial=0.0))
                 for a, b in zip(got, want) if a.shape == b.shape), default=float("inf"))
    off = [(f"#{j} {a.shape}: max |diff| {np.max(np.abs(a - b)):.1e}, max |jit| "
            f"{np.max(np.abs(b), initial=0.0):.1e}") if a.shape == b.shape
           else f"#{j}: shape {a.shape}, jax.jit's {b.shape}"
           for j, (a, b) in enumerate(zip(got, want))
           if a.shape != b.shape or not np.allclose(a, b, rtol=RTOL, atol=ATOL)][:3]
    if len(got) != len(want):
        off.insert(0, f"{len(got)} arrays, jax.jit's {len(want)}")
    res = dict(schedule=name, mismatches=off, platform=jax.default_backend(),
               transfers=eng.transfers,
               staging_bytes=int(getattr(comm, "staging_bytes", 0) or 0), equal=bool(equal),
               worst_abs=worst, arrays=len(got), losses=losses,
               ms_baton=statistics.median(times[1:]) * 1e3,
               ms_jit=statistics.median(btimes[1:]) * 1e3, dim=cfg.dim, seq=cfg.seq,
               layers=cfg.layers, stages=stages, microbatches=M)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(res, f)


def main(out: str, names: list[str]) -> None:
    rank = process_group().rank
    for name in names:
        if name not in SCHEDULES:
            raise SystemExit(f"gpu_check_shared.py: unknown schedule {name!r} "
                             f"(known: {', '.join(SCHEDULES)})")
        run(name, rank, out)
        print(f"rank {rank} {name} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
