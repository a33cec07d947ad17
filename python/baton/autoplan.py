"""Automatic pipeline planning: stage cuts, schedule, microbatches and rematerialization chosen
together under a memory budget.

    rows = baton.autoplan(train_step, params, opt_state, batch, ranks=4,
                          memory_per_device="2GiB")
    print(rows)                       # ranked candidates: cuts, schedule, M, remat, time, memory
    step = rows.best.jit(train_step, mesh=mesh)          # pin it (or copy its arguments)

    step = baton.jit(train_step, mesh=mesh, schedule=baton.Auto(memory_per_device="2GiB"))

The model marks *candidate* cut points with ``stage_boundary`` at a finer grain than the stages
it wants (e.g. after every layer), or none at all with ``baton.auto_stage(loss_fn)`` (Baton
proposes them). The pieces between consecutive candidates are *segments*. Baton measures each
segment once on one device (``measure_segments``: forward and backward seconds from
``baton.profile`` of a one-rank pipeline with every candidate a stage boundary, input-/weight-
gradient split and rematerialization costs from the traced flops, activation, stash, parameter,
optimizer-state and XLA temporary bytes from the partition and XLA's memory analysis) at two
microbatch sizes (a fixed per-task overhead plus a part proportional to the microbatch), caches
the costs on disk by the traced program's fingerprint, and hands them to the C++ search
(``baton-plan --auto`` runs the same search on a cost file; see docs/ARCHITECTURE.md,
"Automatic planning").

Modules: ``segment_costs`` (the measurement and its cache), ``candidates`` (the ranked rows),
``auto_schedule`` (``baton.Auto``, which runs :func:`autoplan` once it registers itself there);
this one: the search over measured costs and the finalists measured on the mesh.
"""

from __future__ import annotations

import re
import time

import jax
import numpy as np

from .auto_schedule import Auto, set_planner
from .candidates import Candidate, Candidates
from .errors import ConfigError
from .tracing.trace import trace_step
from .planning.plan import autoplan_segments
from .segment_costs import _batch_size, measure_segments

__all__ = ["measure_segments", "autoplan", "search_segments", "costs_at", "host_copy_bandwidth",
           "Auto", "Candidate", "Candidates"]


def _search_costs(costs: dict) -> dict:
    return {k: v for k, v in costs.items() if k not in ("measured", "cached", "by_microbatches")}


def costs_at(costs: dict, microbatches: int) -> dict:
    """The segment costs (C++ layout) the search uses at ``microbatches``: the times measured
    at that count when ``measure_segments`` measured it (activation-sized bytes scaled from the
    reference count, as the C++ ``SegmentCosts::scaled`` does), else ``costs`` itself (the
    C++ search scales its times by the microbatch size)."""
    out = _search_costs(costs)
    at = (costs.get("by_microbatches") or {}).get(str(int(microbatches)))
    if at is None:
        return out
    batch = int(costs["batch"])
    k = (batch // int(microbatches)) / int(costs["ref_microbatch"])
    segs = []
    for g, (f, b, i, w, rec) in zip(costs["segments"], at["times"]):
        g = dict(g, f=f, b=b, i=i, w=w, min_recompute=rec, overhead=0.0)
        for key in ("act_bytes", "stash_bytes", "min_stash_bytes", "wstash_bytes",
                    "temp_bytes"):
            g[key] = int(round(g.get(key, 0) * k))
        segs.append(g)
    return dict(out, segments=segs, ref_microbatch=batch // int(microbatches),
                task_overhead=at["task_overhead"])


def autoplan(fn, *args, ranks: int, memory_per_device=None, microbatches=None,
             families=None, remat=("keep", "min"), top: int = 10, runs: int = 3,
             measure_at=None, device=None, cache_dir=None, use_cache: bool = True,
             gap: float = 0.0, update_in_place: bool = False, measure_top: int = 0,
             mesh=None, steps: int = 5, offload: bool = False,
             host_memory=None) -> Candidates:
    """Ranked plans for ``fn`` (a training step whose model marks candidate cut points with
    ``stage_boundary``, or uses ``baton.auto_stage``) on ``ranks`` pipeline ranks under
    ``memory_per_device`` (bytes or e.g. ``"20GiB"``; None: unlimited). Searches every
    contiguous grouping of the segments into stages, the schedule ``families`` (default: all
    eight), the microbatch counts ``microbatches`` (default: the divisors of the batch up to
    4 x ranks) and the rematerialization modes ``remat`` (one per plan: "keep" every residual
    or Baton's "min" stash, what ``baton.jit(remat=...)`` runs), minimising the simulated step
    time (exact branch and bound, C++). Segment costs are measured once (``measure_segments``,
    at ``measure_at``: the counts to measure, default every candidate count) and
    cached. ``update_in_place``: the step donates its parameters and optimizer state
    (``baton.jit(donate_argnums=...)``); otherwise the update after the loop holds the new
    ones beside the old, which a rank's peak counts. ``measure_top`` = k > 0 (with ``mesh``,
    the ``PipelineMesh`` the plan will run on): the k best fitting candidates are then run on
    ``mesh`` (``steps`` timed calls after two warm-ups each, median, on the caller's
    arguments, which stay valid) and ranked first by measured step time
    (``Candidate.measured_step``): the prediction prunes the search, the devices pick among
    the finalists. ``offload``: a plan over the budget may offload its ranks' stashes to host
    memory (``baton.jit(offload=...)``), within ``host_memory`` per rank (None: unlimited),
    the copies at the host copy rate measured here (:func:`host_copy_bandwidth`) unless the
    costs carry ``host_link_bandwidth``. Raises ``ConfigError`` naming the smallest peak and
    its rank when nothing fits."""
    t0 = time.perf_counter()
    traced = trace_step(fn, args, 1)
    batch = _batch_size(traced)
    if microbatches is None:
        microbatches = [m for m in range(1, 4 * ranks + 1) if batch % m == 0]
    microbatches = sorted(set(int(m) for m in microbatches))
    if measure_at is None:
        measure_at = microbatches
    costs = measure_segments(fn, *args, microbatches=measure_at, runs=runs, device=device,
                             cache_dir=cache_dir, use_cache=use_cache)
    if offload and not costs.get("host_link_bandwidth"):
        costs = dict(costs, host_link_bandwidth=host_copy_bandwidth())
    out = search_segments(costs, ranks, memory_per_device=memory_per_device,
                          microbatches=microbatches, families=families, remat=remat, top=top,
                          gap=gap, update_in_place=update_in_place, offload=offload,
                          host_memory=host_memory)
    out.stats["measure_seconds"] = time.perf_counter() - t0 - out.stats["search_seconds"]
    if measure_top:
        if mesh is None:
            raise ConfigError("autoplan: measure_top needs the mesh the plan will run on "
                              "(mesh=baton.PipelineMesh(...))")
        t1 = time.perf_counter()
        measure_finalists(out, fn, args, mesh, int(measure_top), steps)
        out.stats["finalists_seconds"] = time.perf_counter() - t1
    return out


def measure_finalists(rows: Candidates, fn, args, mesh, k: int, steps: int = 5) -> None:
    """Runs the first ``k`` fitting candidates of ``rows`` on ``mesh`` (each as its own
    ``baton.jit``, without donation, so the caller's arguments stay valid; two warm-up calls,
    then the median of ``steps`` timed calls), sets their ``measured_step``, and reorders
    ``rows`` in place: the measured ones first, fastest first, then the rest as ranked."""
    fits = [c for c in rows if c.fits][:max(k, 0)]
    for c in fits:
        step = c.jit(fn, mesh)
        times = []
        for i in range(2 + max(steps, 1)):
            t = time.perf_counter()
            jax.block_until_ready(step(*args))
            if i >= 2:
                times.append(time.perf_counter() - t)
        c.measured_step = float(np.median(times))
    rest = [c for c in rows if c not in fits]
    rows[:] = sorted(fits, key=lambda c: c.measured_step) + rest


def host_copy_bandwidth(nbytes: int = 64 << 20, runs: int = 5) -> float:
    """Bytes per second of one copy between device buffers and the host pool as the CPU
    backend runs an offload or fetch (a ``memcpy`` into or out of ``HostSlots``): the median
    of ``runs`` copies of ``nbytes`` into a fresh buffer."""
    src = np.ones(nbytes, np.uint8)
    times = []
    for _ in range(max(runs, 1)):
        dst = np.empty_like(src)
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / max(float(np.median(times)), 1e-9)


def search_segments(costs: dict, ranks: int, memory_per_device=None, microbatches=None,
                    families=None, remat=("keep", "min"), top: int = 10,
                    gap: float = 0.0, update_in_place: bool = False, offload: bool = False,
                    host_memory=None) -> Candidates:
    """The search half of :func:`autoplan` on segment costs already measured (the dict
    ``measure_segments`` returns, possibly edited: e.g. its ``link`` replaced by one measured
    between the processes that will run the plan). No JAX work. ``microbatches`` default: the
    divisors of the batch up to 4 x ranks. ``offload`` / ``host_memory``: as
    :func:`autoplan` (the costs must carry ``host_link_bandwidth``, bytes per second). Raises
    ``ConfigError`` naming the smallest peak and its rank when nothing fits."""
    t1 = time.perf_counter()
    if offload and not costs.get("host_link_bandwidth", 0) > 0:
        raise ConfigError("autoplan: offload needs the costs' host_link_bandwidth (bytes per "
                          "second of a copy to or from host memory; autoplan() measures it)")
    if microbatches is None:
        batch = int(costs.get("batch", 1))
        microbatches = [m for m in range(1, 4 * ranks + 1) if batch % m == 0]
    rows: list[Candidate] = []
    stats: dict = {}
    errors = []
    measured = set((costs.get("by_microbatches") or {}).keys())
    # counts with their own measured costs are searched one by one, the others together
    groups = [[m] for m in microbatches if str(m) in measured]
    rest = [m for m in microbatches if str(m) not in measured]
    if rest:
        groups.append(rest)
    for mode, ms in ((mode, ms) for mode in remat for ms in groups):
        try:
            found = autoplan_segments(costs_at(costs, ms[0]) if len(ms) == 1 else
                                      _search_costs(costs), ranks, memory_per_device, top=top,
                                      families=families, microbatches=ms, remat=[mode],
                                      gap=gap, update_in_place=update_in_place,
                                      offload=offload, host_memory=host_memory)
        except ConfigError as e:  # nothing fits with this mode
            errors.append(str(e))
            continue
        for k, v in found.stats.items():
            if isinstance(v, (int, float)):
                stats[f"{mode}.{k}"] = stats.get(f"{mode}.{k}", 0) + v
        for r in found:
            rows.append(Candidate(r["schedule"], int(r["virtual_stages"]),
                                  int(r["microbatches"]), list(r["cuts"]), list(r["remat"]),
                                  float(r["step_time"]), float(r["bubble_fraction"]),
                                  [int(b) for b in r["peak_memory"]], bool(r["fits"]),
                                  offload=list(r["offload"]),
                                  peak_host=[int(b) for b in r["peak_host"]]))
    if not rows:
        raise ConfigError(_smallest_peak_error(errors))
    rows.sort(key=lambda c: (not c.fits, c.step_time))
    out = Candidates(rows[:top])
    out.segments = costs
    stats["search_seconds"] = time.perf_counter() - t1
    out.stats = stats
    return out


def _smallest_peak_error(errors: list[str]) -> str:
    """One message for a search where nothing fits: of the searches' errors (one per remat
    mode and microbatch group, each naming its smallest peak and rank), the one whose peak
    is smallest; every error when none names a peak."""
    peaks = []
    for e in errors:
        m = re.search(r"smallest peak found is .*?\((\d+) bytes\)", e)
        if m:
            peaks.append((int(m.group(1)), e))
    if not peaks:
        return "autoplan: no plan fits: " + "; ".join(errors)
    return (min(peaks)[1].rstrip(".") + f" (the smallest over the {len(errors)} searches: "
            f"every remat mode and microbatch count)")


set_planner(autoplan)
