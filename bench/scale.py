"""Baton's cluster cost model against published training runs (bench/results/scale.md).

For each published configuration (baton.scale.published.RUNS): the configuration fed, the
published throughput and memory, Baton's prediction of that exact configuration and the
ratio, and the predicted breakdown of the step (compute by kind, exposed communication by
kind, remat, bubble) and of the memory. Then the series checks (the change of MFU across
a source's series, published vs predicted) and Baton's best plan for each distinct
(model, GPUs, batch, precision) with its breakdown. Nothing is fitted: every constant of
the hardware files is a cited measurement or a stated assumption.

    python bench/scale.py [--no-best] [--search-16k]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from baton import scale
from baton.scale import published as P
from baton.scale.plan import overlap_name

PARTS = [f.name for f in dataclasses.fields(scale.plan.TimeBreakdown)]


def _config(r: P.PublishedRun, remat: str) -> str:
    parts = [f"pp{r.pp} tp{r.tp} dp{r.dp}"]
    if r.ep > 1:
        parts.append(f"ep{r.ep}")
    if r.fsdp:
        parts.append("fsdp")
    parts.append(r.schedule + (f" v{r.v}" if r.schedule == "interleaved" else ""))
    parts.append(f"B{r.global_batch} M{r.microbatches} remat {remat}")
    parts.append("fp8" if r.fp8 else "bf16")
    ov = "+".join(n for n, on in (("tp", r.tp_overlap), ("dp", r.dp_overlap)) if on)
    parts.append(f"overlap {ov or '-'}")
    parts.append(f"grad {r.grad_reduce_bytes:g} B")
    if not r.flash_attention:
        parts.append("unfused attn")
    if r.attention_kernel:
        parts.append(f"attention {r.attention_kernel}")
    if r.stash_bytes < 2:
        parts.append("stash fp8")
    if not r.sequence_parallel and r.tp > 1:
        parts.append("no SP")
    if r.ep > 1:
        parts.append(f"dispatch {'fp8' if r.dispatch_bytes < 2 else 'bf16'}"
                     + (f", <= {r.ep_node_limit} nodes/token" if r.ep_node_limit else ""))
    return ", ".join(parts)


def _breakdown(plan) -> str:
    t = plan.time
    return " ".join(f"{k} {100 * getattr(t, k) / plan.step_time:.0f}" for k in PARTS
                    if getattr(t, k) / plan.step_time >= 0.005)


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-best", action="store_true", help="skip the best-plan searches")
    ap.add_argument("--search-16k", action="store_true", help="time the 16,384-GPU search")
    a = ap.parse_args()
    t0 = time.perf_counter()
    profiles: dict = {}
    cs = P.compare_all(profiles)
    print(f"{len(cs)} published runs predicted in {time.perf_counter() - t0:.1f} s "
          f"(model traces included)\n")
    print("| run | source | GPUs | configuration fed | published | predicted | ratio | "
          "memory GiB (pub / pred: params, grads, optim, activ) | step (s) | step breakdown, % "
          "(average pipeline rank) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    unit = {"megatron_tflops": "TFLOP/s/GPU (Megatron)", "model_tflops": "TFLOP/s/GPU",
            "mfu": "MFU", "tps": "tokens/s/GPU"}
    for c in cs:
        r, p = c.run, c.plan
        m = p.memory
        pub_mem = f"{r.published_mem_gib:g}" if r.published_mem_gib else "-"
        mem = (f"{pub_mem} / {_gib(m.total)}{'' if p.fits else ' (over)'}: {_gib(m.params)}, "
               f"{_gib(m.grads)}, {_gib(m.optimizer)}, {_gib(m.activations)}")
        print(f"| {r.name} | {r.source} | {r.gpus} | {_config(r, c.remat)} | {r.published:.4g} "
              f"{unit[r.metric]} | {c.predicted:.4g} | {c.ratio:.2f} | {mem} | "
              f"{p.step_time:.3g} | {_breakdown(p)} |")
    s = P.summary(cs)
    print(f"\nmedian |predicted/published - 1| = {100 * s['median_abs_error']:.1f}%, largest "
          f"{100 * s['max_abs_error']:.1f}%, {s['within_20']} of {s['runs']} within +-20%")
    print("\n| series | published MFU | predicted MFU | published change (points) | predicted "
          "change (points) | within 5 points |")
    print("|---|---|---|---|---|---|")
    for x in P.series(cs, profiles):
        ok = abs(x["predicted_change"] - x["published_change"]) <= 5
        print(f"| {x['series']} | {100 * x['published'][0]:.1f} -> {100 * x['published'][1]:.1f}"
              f" | {100 * x['predicted'][0]:.1f} -> {100 * x['predicted'][1]:.1f} | "
              f"{x['published_change']:+.1f} | {x['predicted_change']:+.1f} | "
              f"{'yes' if ok else 'no'} |")
    print("\nAssumptions where a source is silent, per run:")
    for r in P.RUNS:
        print(f"- {r.name}: {r.assumptions}")
    if not a.no_best:
        print("\n| searched for | best plan | MFU | step (s) | vs published config | "
              "step breakdown, % | memory GiB |")
        print("|---|---|---|---|---|---|---|")
        seen = set()
        for c in cs:
            r = c.run
            key = (r.model, r.cluster, r.gpus, r.global_batch, r.fp8)
            if key in seen:
                continue
            seen.add(key)
            t = time.perf_counter()
            try:
                res = scale.plan_cluster(profiles[r.model], r.cluster, r.gpus, r.global_batch,
                                         fp8=r.fp8, top=1, dispatch_bytes=r.dispatch_bytes,
                                         ep_node_limit=r.ep_node_limit,
                                         attention_kernel=r.attention_kernel,
                                         stash_bytes=r.stash_bytes)
            except ValueError as e:
                print(f"| {r.name} | no plan: {str(e)[:80]} | - | - | - | - | - |")
                continue
            b = res.plans[0]
            print(f"| {r.model}, {r.gpus} x {r.cluster}, B{r.global_batch}"
                  f"{', fp8' if r.fp8 else ''} | pp{b.pp} tp{b.tp} dp{b.dp}"
                  f"{' ep' + str(b.ep) if b.ep > 1 else ''}{' fsdp' if b.fsdp else ''} "
                  f"overlap {overlap_name(b)} {b.schedule}"
                  f"{' v' + str(b.virtual_stages) if b.schedule == 'interleaved' else ''} "
                  f"M{b.microbatches} remat {','.join(sorted(set(b.remat)))} "
                  f"({time.perf_counter() - t:.1f} s) | {100 * b.mfu:.1f}% | "
                  f"{b.step_time:.3g} | {c.plan.step_time / b.step_time:.2f}x | "
                  f"{_breakdown(b)} | {_gib(b.memory.total)} |")
    if a.search_16k:
        t = time.perf_counter()
        res = scale.plan_cluster(profiles["llama3-405b"], "h100", 16384, 2048, top=5)
        print(f"\n16,384-GPU search (llama3-405b, global batch 2048 x 8192): "
              f"{time.perf_counter() - t:.1f} s wall, core {res.stats['seconds']:.1f} s")
        print(res.table())
        print(res.breakdown())


if __name__ == "__main__":
    main()
