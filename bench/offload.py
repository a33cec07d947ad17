"""Activation offload in the simulator: each schedule's rank programs with every stage's stash
offloaded to host memory between its forward and its backward (OFFLOAD after the forward,
FETCH one RUN ahead of the backward; docs/RANK_IR.md "Offload"), simulated against the same
programs without offload. Prints two tables:

1. unit costs (a 1F1B stage's F = 1, B = 2, I = W = 1; a chunk of a V or interleaved schedule
   costs its share), one stash of a 1F1B stage = 1 unit of bytes, at several values of k, the
   time to move one stash over the host link divided by that stage's forward time: step time
   and the largest rank's device-memory peak relative to the same schedule without offload,
   and the largest rank's host-memory peak;
2. k of one transformer layer on real hardware, from cited constants (below), and what full
   offload does to 1F1B, interleaved and V-Half there;
3. PipeOffload's published findings beside what the simulator says of the same situation
   (the cluster row: the cluster search with and without offload).

Those tables are the planner's simulator over the verified rank programs. The last table is
measured on the CPU: examples/mlp.py pipelined on 2 ranks (one CPU device each), each
schedule with and without ``offload="stash"``; per rank, the temporary bytes of XLA's buffer
assignment of its compiled program (``memory_analysis()``) and the peak bytes its host slots
held (``RankComm.host_bytes``), and the memory model's device and host peaks per rank,
predicted against measured (``step.memory(measure=True)``), the loss and gradients checked
equal.

    .venv/bin/python bench/offload.py [--ranks 4] [--microbatches 16] [--no-measure] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")  # (before JAX starts: table 3's 2 ranks)

import baton  # noqa: E402
from baton import _core, scale  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

SCHEDULES = ["1f1b", "interleaved", "zbh1", "zbv", "vhalf", "vmin"]
KS = [0.25, 1.0, 1.5, 2.0, 4.0]
STASH = 1000  # bytes of one 1F1B stage's stash per microbatch (the unit of the tables)


@dataclasses.dataclass(frozen=True)
class Outcome:
    step: float
    device_peak: int  # the largest rank's activation peak, bytes
    host_peak: int  # the largest rank's host peak, bytes


def simulate(name: str, ranks: int, m: int, k: float | None, only_rank0: bool = False,
             first_chunks: bool = False) -> Outcome:
    """``name``'s plan simulated over its rank programs; ``k`` None: no offload; otherwise
    every stage (or, ``only_rank0``, rank 0's stages; ``first_chunks``, stages 0..ranks-1:
    each rank's first chunk of an interleaved schedule) offloads its stash over a host link
    on which one 1F1B stage's stash takes ``k`` forward times."""
    p = baton.plan(name, ranks=ranks, microbatches=m)
    stages = p.num_stages
    share = ranks / stages  # a chunk of a V or interleaved schedule is this much of a stage
    costs = _core.CostModel.uniform(1.0 * share, 2.0 * share, 1.0 * share, 1.0 * share)
    per_stage = []
    for s in range(stages):
        c = costs.stage(s)
        c.stash_bytes = int(STASH * share)
        per_stage.append(c)
    costs.stages = per_stage
    offload = [_core.Offload.NONE] * stages
    if k is not None:
        costs.host_link_bandwidth = STASH / k
        rank_of = list(p.schedule.stage_rank)
        chosen = [(not only_rank0 or rank_of[s] == 0) and (not first_chunks or s < ranks)
                  for s in range(stages)]
        offload = [_core.Offload.STASH if c else _core.Offload.NONE for c in chosen]
    ir = _core.build_rank_ir(p.core, offload=offload, fetch_lookahead=1)
    r = _core.simulate_rank_ir(ir, costs)
    return Outcome(r.step_time, max(r.peak_activation), max(r.peak_host_bytes))


def unit_table(ranks: int, m: int, ks: list[float]) -> list[str]:
    head = ("| schedule | without offload: step, device peak | " +
            " | ".join(f"k = {k:g}: step, device peak, host peak" for k in ks) + " |")
    rows = [head, "|" + "---|" * (2 + len(ks))]
    for name in SCHEDULES:
        base = simulate(name, ranks, m, None)
        cells = [name, f"{base.step:g}, {base.device_peak / STASH:g}"]
        for k in ks:
            o = simulate(name, ranks, m, k)
            cells.append(f"{o.step / base.step:.2f}x, {o.device_peak / base.device_peak:.2f}x, "
                         f"{o.host_peak / STASH:g}")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


# Constants of table 2, each with its source.
PEAK_BF16 = scale.load_cluster("h100")["peak_bf16"]  # H100 SXM dense bf16 (its datasheet)
MFU = 0.45  # assumption: inside the 0.38-0.55 of published dense bf16 H100 runs (scale.md)
HOST_LINKS = {
    # the H100 hardware file's host link (python/baton/scale/clusters/h100.json, its source)
    "H100 SXM, PCIe Gen5 x16": scale.load_cluster("h100")["host_link"]["bandwidth"],
    # NVIDIA GH200 datasheet: NVLink-C2C 900 GB/s total -> 450 GB/s per direction
    "GH200, NVLink-C2C": 450e9,
}


def layer_k(hidden: int, seq: int, host_bandwidth: float) -> float:
    """k of one transformer layer: its stash over the host link / its forward time. Stash
    bytes per token 34 * hidden in bf16 with a fused attention kernel (Korthikanti et al.
    2022, arXiv:2205.05198, sec. 4.1, the 5*a*s/h attention term dropped); forward FLOPs per
    token 24 * hidden^2 * (1 + seq / (6 * hidden)) (Narayanan et al. 2021, arXiv:2104.04473,
    eq. 3 without the vocabulary term, divided by 3 for the forward alone). Both scale with
    tokens, so k does not depend on the microbatch or on tensor parallelism with sequence
    parallelism."""
    move = 34 * hidden / host_bandwidth
    compute = 24 * hidden**2 * (1 + seq / (6 * hidden)) / (PEAK_BF16 * MFU)
    return move / compute


LAYERS = [("hidden 4096, seq 4096 (Llama 3 8B)", 4096, 4096),
          ("hidden 8192, seq 8192 (Llama 3 70B)", 8192, 8192),
          ("hidden 16384, seq 8192 (Llama 3 405B)", 16384, 8192)]


def hardware_table(ranks: int, m: int) -> list[str]:
    rows = ["| model layer | host link | k | 1F1B: step, device peak | interleaved: step, "
            "device peak | V-Half: step, device peak |", "|---|---|---|---|---|---|"]
    for label, hidden, seq in LAYERS:
        for link, bw in HOST_LINKS.items():
            k = layer_k(hidden, seq, bw)
            cells = [label, link, f"{k:.2f}"]
            for name in ["1f1b", "interleaved", "vhalf"]:
                base, o = simulate(name, ranks, m, None), simulate(name, ranks, m, k)
                cells.append(f"{o.step / base.step:.2f}x, {o.device_peak / base.device_peak:.2f}x")
            rows.append("| " + " | ".join(cells) + " |")
    return rows


MEASURED = ["gpipe", "1f1b", "zbh1", "zbv", "vhalf"]


def measure(name: str, m: int, dim: int) -> list[str]:
    """Rows of table 3 for one schedule: the default program without offload, the rolled
    program without offload and the (rolled) program with it."""
    import jax
    import numpy as np

    import mlp

    sched = baton.schedule_from_name(name)
    stages = sched.stages(2)
    key = jax.random.PRNGKey(0)
    params = mlp.init_params(key, stages, dim=dim)
    batch = mlp.synthetic_batch(key, 64 * m, dim=dim)
    vg = jax.value_and_grad(mlp.make_loss())
    mesh = baton.PipelineMesh(jax.devices()[:2], ranks=2)
    rows, ref = [], None
    for label, offload, form in [("no offload (default form)", None, "auto"),
                                 ("no offload (rolled)", None, "rolled"),
                                 ("offload stash", "stash", "rolled")]:
        ps = baton.jit(lambda p, b: baton.accumulate(vg, p, batch=b), mesh=mesh,
                       schedule=sched, microbatches=m, offload=offload, loop_form=form)
        got = ps(params, batch)
        mem = ps.memory(params, batch, measure=True)
        leaves = [np.asarray(x) for x in jax.tree.leaves(got)]
        ref = ref or leaves
        same = all(np.array_equal(a, b) for a, b in zip(ref, leaves))
        progs = sorted(ps.last.engine.local_progs, key=lambda p: p.rank)
        temp = [p.compiled.memory_analysis().temp_size_in_bytes for p in progs]
        host = [p.comm.host_bytes()[1] for p in progs]
        devs = [d for ds in mem.rank_devices for d in ds]
        model = ", ".join(f"{mem.predicted(d) / 1024:.0f} / {mem.measured[d] / 1024:.0f}"
                          for d in devs)
        model_host = ", ".join(f"{mem.host.get(d, 0) / 1024:.0f} / "
                               f"{(mem.measured_host or {}).get(d, 0) / 1024:.0f}" for d in devs)
        rows.append(f"| {name} | {label} | {progs[0].form} | "
                    + " | ".join(f"{t / 1024:.0f}" for t in temp)
                    + f" | {max(temp) / 1024:.0f} | " + " | ".join(f"{h / 1024:.0f}" for h in host)
                    + f" | {model} | {model_host} | {'yes' if same else 'NO'} |")
    return rows


def free_k(name: str, ranks: int, m: int, tolerance: float = 0.01) -> float:
    """The largest k (to 1/64) at which full offload keeps ``name``'s step within
    ``tolerance`` of the step without it (64 when even that is)."""
    base = simulate(name, ranks, m, None).step
    lo, hi = 0.0, 64.0
    if simulate(name, ranks, m, hi).step <= base * (1 + tolerance):
        return hi
    while hi - lo > 1 / 64:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulate(name, ranks, m, mid).step <= base * (1 + tolerance) \
            else (lo, mid)
    return lo


def pipeoffload_rows(ranks: int, m: int, cluster: bool) -> list[str]:
    """PipeOffload's (Wan, Qi et al., ICML 2025) findings beside what Baton's simulator says
    of the same situation."""
    rows = ["| PipeOffload (paper) | Baton (simulated) |", "|---|---|"]
    ks = ", ".join(f"{n} {free_k(n, ranks, m):.2f}" for n in ("1f1b", "interleaved", "zbv"))
    spans = "; ".join(
        f"{link} {min(ls):.2f}-{max(ls):.2f}" for link, ls in
        ((link, [layer_k(h, q, bw) for _, h, q in LAYERS]) for link, bw in HOST_LINKS.items()))
    rows.append("| \"in the majority of standard configurations, at least half, and potentially "
                "all, of the activations can be offloaded with negligible overhead\" (abstract) | "
                f"full offload stays within 1% of the step up to k = {ks} ({ranks} ranks, {m} "
                f"microbatches); one Llama 3 layer's k (table above): {spans} |")
    base = simulate("interleaved", ranks, m, None)
    first = simulate("interleaved", ranks, m, 0.25, first_chunks=True)
    rows.append("| interleaved 1F1B: offloading each device's first chunk (the longer-lived "
                "one) cuts the peak activation memory by only about half (Figure 2) | "
                f"offloading stages 0..{ranks - 1} of interleaved (v = 2) at k = 0.25: largest "
                f"rank's device peak {first.device_peak / base.device_peak:.2f}x |")
    if cluster:
        prof = scale.profile_model("llama3-405b")
        kw = dict(top=1, pp=[32], tp=[8], fsdp=False, tp_overlap=True, dp_overlap=True,
                  gap=0.0)
        hw = scale.load_cluster("h100")
        c2c = dict(hw, host_link=dict(hw["host_link"], bandwidth=HOST_LINKS["GH200, NVLink-C2C"]))
        plain = scale.plan_cluster(prof, hw, 16384, 2048, offload=False, **kw).plans[0]
        pcie = scale.plan_cluster(prof, hw, 16384, 2048, **kw).plans[0]
        off = scale.plan_cluster(prof, c2c, 16384, 2048, **kw).plans[0]

        def recomputing(p):
            return sum(r != "keep" for r in p.remat)

        def desc(p):
            return (f"{p.schedule} v{p.virtual_stages}, {recomputing(p)} of {len(p.remat)} "
                    f"stages recompute, {p.offload.count('stash')} offload their stash, MFU "
                    f"{100 * p.mfu:.1f}%, {p.memory.total / 2**30:.1f} GiB on the fullest GPU, "
                    f"{max(p.peak_host, default=0) / 2**30:.1f} GiB on the host of the rank that "
                    "holds most there")

        rows.append(
            "| with offload, a deeper pipeline beats tensor parallelism by up to 19% at lower "
            "memory (GPT-3-like models, Megatron-LM) | Llama 3 405B, 16,384 H100, pp 32 x tp "
            f"8 (search gap 0): without offload {desc(plain)}; offload searched over "
            f"PCIe: {desc(pcie)} ({100 * (plain.step_time / pcie.step_time - 1):+.1f}% "
            f"throughput); over a GH200-class NVLink-C2C: {desc(off)} "
            f"({100 * (plain.step_time / off.step_time - 1):+.1f}% throughput) |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="2 ranks, 4 microbatches, two k")
    ap.add_argument("--no-measure", action="store_true", help="the simulated tables only")
    a = ap.parse_args()
    ranks, m, ks = (2, 4, [1.0, 4.0]) if a.smoke else (a.ranks, a.microbatches, KS)
    print(f"## Full offload on unit costs ({ranks} ranks, {m} microbatches; step and device "
          f"peak relative to the same schedule without offload, host peak in 1F1B-stage "
          f"stashes)\n")
    print("\n".join(unit_table(ranks, m, ks)))
    print("\n## Offloading rank 0's stages only, k = 2\n")
    print("| schedule | step | device peak (largest rank) | host peak |")
    print("|---|---|---|---|")
    for name in SCHEDULES:
        base, o = simulate(name, ranks, m, None), simulate(name, ranks, m, 2.0, only_rank0=True)
        print(f"| {name} | {o.step / base.step:.2f}x | {o.device_peak / base.device_peak:.2f}x "
              f"| {o.host_peak / STASH:g} |")
    print(f"\n## One transformer layer's k on real hardware, full offload ({ranks} ranks, {m} "
          f"microbatches, bf16, MFU {MFU})\n")
    print("\n".join(hardware_table(ranks, m)))
    print("\n## PipeOffload's findings beside the simulator\n")
    print("\n".join(pipeoffload_rows(ranks, m, cluster=not a.smoke)))
    if a.no_measure:
        return
    mm, dim = (4, 16) if a.smoke else (8, 128)
    print(f"\n## Measured on the CPU: examples/mlp.py (width {dim}, 64 rows per microbatch), 2 "
          f"ranks, {mm} microbatches; KiB\n")
    print("| schedule | program | loop form | XLA temp rank 0 | XLA temp rank 1 | largest | "
          "host slots peak rank 0 | host slots peak rank 1 | step.memory device peak, "
          "predicted / measured, rank 0, rank 1 | step.memory host peak, predicted / measured, "
          "rank 0, rank 1 | loss and gradients equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in MEASURED[:2] if a.smoke else MEASURED:
        print("\n".join(measure(name, mm, dim)))


if __name__ == "__main__":
    main()
