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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from typing import Any

import jax
import numpy as np

from . import _core
from .errors import ConfigError
from .frontend.mesh import PipelineMesh
from .frontend.trace import trace_step

__all__ = ["measure_segments", "autoplan", "search_segments", "costs_at", "Auto", "Candidate",
           "Candidates"]

G = _core.graph
def _task(part, kind, s):
    for t in part.tasks:
        if t.kind == kind and t.stage == s:
            return t
    return None


def _bytes(prog, vals) -> int:
    return int(sum(prog.value_bytes(v) for v in vals))


def _batch_size(traced) -> int:
    for _, outer, is_mb in traced.loop_inputs:
        if is_mb:
            return int(traced.avals[outer].shape[0])
    raise ConfigError("autoplan: the step's microbatch loop has no batch input")


def _fingerprint(traced, device) -> str:
    h = hashlib.sha256()
    h.update(traced.program.to_text().encode())
    h.update(repr([(tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", "")))
                   for a in traced.avals]).encode())
    h.update(f"{device.platform}/{device.device_kind}/{jax.__version__}".encode())
    return h.hexdigest()[:24]


def _cache_dir(cache_dir) -> str:
    if cache_dir is not None:
        return os.fspath(cache_dir)
    return os.environ.get("BATON_CACHE_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "baton"))


def _commit(args, device):
    """``args`` with every jax array placed on ``device`` (committed), as a training loop
    feeds a step its previous outputs; uncommitted arrays take a slower path on every call."""
    return jax.tree.map(lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x,
                        args)


def _wall(probe, args, runs: int) -> float:
    """Median wall time of ``max(runs, 3)`` untraced calls after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(probe(*args))
    walls = []
    for _ in range(max(runs, 3)):
        t = time.perf_counter()
        jax.block_until_ready(probe(*args))
        walls.append(time.perf_counter() - t)
    return float(np.median(walls))


def _outside_times(step, device, runs: int) -> dict[int, float]:
    """Seconds per stage of the code outside the loop (the stage's segments before and after
    it: the optimizer update), each segment timed alone as the multi-rank step calls it (its
    own jitted program, on zeros of its inputs' shapes: the update does the same work for any
    values); median of ``max(runs, 3)`` calls after a warm-up."""
    tr = step.traced

    def zeros(aval):
        if jax.numpy.issubdtype(aval.dtype, jax.dtypes.prng_key):  # typed PRNG keys
            impl = aval.dtype._impl
            data = jax.random.key_data(jax.random.key(0, impl=impl))
            return jax.random.wrap_key_data(
                np.zeros(tuple(aval.shape) + data.shape, data.dtype), impl=impl)
        return np.zeros(aval.shape, aval.dtype)

    out: dict[int, float] = {}
    for seg in list(step.pre_segments) + list(step.post_segments):
        args = [tr.literals[v] if v in tr.literals else
                jax.device_put(zeros(tr.avals[v]), device) for v in seg.inputs]
        jax.block_until_ready(seg.fn(*args))
        walls = []
        for _ in range(max(runs, 3)):
            t = time.perf_counter()
            jax.block_until_ready(seg.fn(*args))
            walls.append(time.perf_counter() - t)
        out[seg.stage] = out.get(seg.stage, 0.0) + float(np.median(walls))
    return out


def _probe(fn, device, stages: int, microbatches: int, boundaries=None):
    from .frontend.api import PipelinedFunction
    from .schedules import Interleaved1F1B

    return PipelinedFunction(fn, PipelineMesh([device], ranks=1),
                             Interleaved1F1B(virtual_stages=stages) if stages > 1 else "1f1b",
                             microbatches, remat=False, fuse_forward_backward=False,
                             boundaries=boundaries)


def _profile_at(fn, args, device, stages: int, microbatches: int, runs: int,
                boundaries=None):
    """``fn`` as a one-rank pipeline of ``stages`` stages (every candidate boundary a stage, or
    the ``boundaries`` given), ``microbatches`` per step, each task timed alone
    (``costs="isolated"``). Returns the per-stage (f, b, XLA temporaries), the simulated loop
    from those times, the wall time of untraced steps, the traced loop span, and the step."""
    from . import profile

    probe = _probe(fn, device, stages, microbatches, boundaries)
    args = _commit(args, device)
    wall = _wall(probe, args, runs)
    prof = profile(probe, *args, runs=runs, warmup=1, steps=1, costs="isolated")
    out = []
    for s in range(stages):
        sc = prof.cost_model.stages[s]
        temp = max([int(prof.xla_memory.get(f"{k}{s}", {}).get("temp_size_in_bytes", 0))
                    for k in ("F", "B")] + [0])
        out.append((float(sc.f), float(sc.b), temp))
    return (out, float(prof.predicted["step_time"]), wall, float(prof.measured["step_time"]),
            probe.last)


def measure_segments(fn, *args, microbatches=(4, 8), runs: int = 3, device=None,
                     cache_dir=None, use_cache: bool = True) -> dict:
    """The segment costs of ``fn`` (a training step with one ``baton.accumulate`` whose model
    marks candidate cut points with ``stage_boundary``) in the layout of
    ``baton-plan --auto --segments`` (see ``cpp/include/baton/autoplan.h``). Measured on
    ``device`` (default: the first device) at each of the microbatch counts ``microbatches``
    (the search uses a count's own costs, ``by_microbatches``; for a count not measured it
    scales the reference costs, those of the largest count measured, in proportion to the
    microbatch size; see docs/ARCHITECTURE.md); cached under
    ``cache_dir`` (``$BATON_CACHE_DIR``, default ``~/.cache/baton``) by the traced program's
    fingerprint: a second call for the same step is a file read."""
    device = device or jax.devices()[0]
    ms = sorted(set(int(m) for m in np.atleast_1d(microbatches)))
    traced = trace_step(fn, args, ms[0])
    batch = _batch_size(traced)
    for m in ms:
        if m < 1 or batch % m:
            raise ConfigError(f"autoplan: {m} microbatches do not divide the batch of {batch}")
    key = f"segments-v5-{_fingerprint(traced, device)}-{'-'.join(map(str, ms))}-{runs}.json"
    path = os.path.join(_cache_dir(cache_dir), key)
    if use_cache and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
        out["cached"] = path
        return out
    t0 = time.perf_counter()
    S = traced.num_stages
    # per count M: the S-stage probe (tasks timed alone, simulated loop P, wall W) and the
    # whole model as one stage (wall W1); the time outside the loop U: each stage's
    # segments before and after the loop timed alone (_outside_times)
    probes = {m: _profile_at(fn, args, device, S, m, runs) for m in ms}
    per_stage = _outside_times(probes[ms[-1]][4], device, runs)
    outside = sum(per_stage.values())
    whole_wall = {m: _wall(_probe(fn, device, 1, m, []), _commit(args, device), runs)
                  for m in ms}
    cal = {}
    for m in ms:
        _, p12, w12, _, _ = probes[m]
        loop12, loop1 = max(w12 - outside, 0.0), max(whole_wall[m] - outside, 0.0)
        scale = loop12 / p12 if p12 > 0 and loop12 > 0 else 1.0
        saved = max(loop12 - loop1, 0.0) / (2 * max(S - 1, 1) * m)
        cal[m] = {"scale": scale, "task_overhead": saved, "wall": w12, "simulated_loop": p12,
                  "whole_wall": whole_wall[m]}
    ref = ms[-1]  # costs are given at the smallest microbatch (most microbatches)
    step = probes[ref][4]
    prog = step.traced.program
    keep = G.partition(prog, False, False)
    small = G.partition(prog, False, True)
    split = G.partition(prog, True, False)
    params = {outer for _, outer, is_mb in step.traced.loop_inputs if not is_mb}
    opt_by_stage: dict[int, set] = {}
    inputs = set(step.traced.step_inputs)
    for seg in step.post_segments:
        opt_by_stage.setdefault(seg.stage, set()).update(
            v for v in seg.inputs if v in inputs and v not in params)

    def times(m):
        """Per segment [f, b, i, w, min_recompute] at m microbatches, calibrated."""
        k = cal[m]["scale"]
        rows = []
        for s, (f_t, b_t, _) in enumerate(probes[m][0]):
            F, B = _task(keep, "F", s), _task(keep, "B", s)
            Bm = _task(small, "B", s)
            Ii, Ww = _task(split, "I", s), _task(split, "W", s)
            share = Ii.cost / (Ii.cost + Ww.cost) if Ii.cost + Ww.cost > 0 else 0.5
            recompute = max(Bm.cost - B.cost, 0.0)
            f, b = f_t * k, b_t * k
            rows.append([f, b, b * share, b * (1 - share),
                         f * recompute / F.cost if F.cost > 0 else 0.0])
        return rows

    segments = []
    for s, (f, b, i, w, rec) in enumerate(times(ref)):
        F, B = _task(keep, "F", s), _task(keep, "B", s)
        Fm = _task(small, "F", s)
        Ii = _task(split, "I", s)
        param_vals = set(F.invariant_in) | set(B.invariant_in)
        segments.append({
            "name": f"segment {s}", "f": f, "b": b, "i": i, "w": w, "overhead": 0.0,
            "act_bytes": _bytes(prog, F.act_out),
            "stash_bytes": _bytes(prog, F.stash_out),
            "min_stash_bytes": _bytes(prog, Fm.stash_out),
            "min_recompute": rec,
            "wstash_bytes": _bytes(prog, Ii.wstash_out),
            "param_bytes": _bytes(prog, param_vals),
            "opt_bytes": _bytes(prog, opt_by_stage.get(s, ())),
            "temp_bytes": int(probes[ref][0][s][2]),
        })
    # each segment's seconds outside the loop, as timed: ranks run their stages' updates in
    # parallel after their loop
    for s_, g in enumerate(segments):
        g["update"] = per_stage.get(s_, 0.0)
    link = _measure_link(max([s["act_bytes"] for s in segments] + [8]), runs)
    out = {"batch": batch, "ref_microbatch": batch // ref, "link": link, "fused_factor": 1.0,
           "task_overhead": cal[ref]["task_overhead"], "segments": segments,
           "by_microbatches": {str(m): {"task_overhead": cal[m]["task_overhead"],
                                        "times": times(m)} for m in ms},
           "measured": {"microbatches": ms, "seconds": time.perf_counter() - t0,
                        "device": str(device), "outside": outside,
                        "calibration": {str(m): cal[m] for m in ms}}}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)
    return out


def _measure_link(nbytes: int, runs: int) -> dict:
    """Latency and bandwidth of a device-to-device copy between the first two devices (none
    with one device)."""
    devs = jax.devices()
    if len(devs) < 2:
        return {"latency": 0.0, "bandwidth": 0.0}
    pts = []
    for n in (4, max(nbytes, 8)):
        x = jax.device_put(np.zeros(max(n // 4, 1), np.float32), devs[0])
        jax.block_until_ready(jax.device_put(x, devs[1]))
        ts = []
        for _ in range(max(runs, 3)):
            t = time.perf_counter()
            jax.block_until_ready(jax.device_put(x, devs[1]))
            ts.append(time.perf_counter() - t)
        pts.append((n, float(np.median(ts))))
    (n0, t0), (n1, t1) = pts
    bw = (n1 - n0) / (t1 - t0) if n1 > n0 and t1 > t0 else 0.0
    return {"latency": max(t0, 0.0), "bandwidth": bw}


@dataclasses.dataclass
class Candidate:
    """One ranked plan: the stage cuts (first segment of each stage), schedule, microbatches
    and rematerialization, with the simulator's step time, bubble and peak memory per rank."""

    schedule: str
    virtual_stages: int
    microbatches: int
    cuts: list
    remat: list
    step_time: float
    bubble: float
    peak_memory: list
    fits: bool
    # seconds per step measured on the mesh (``autoplan(measure_top=k)``), else None
    measured_step: float | None = None

    @property
    def boundaries(self) -> list[int]:
        """The candidate ``stage_boundary`` calls (indices) that end stages."""
        return [c - 1 for c in self.cuts[1:]]

    def spec(self):
        from .schedules import schedule_from_name

        v = self.virtual_stages if self.schedule == "interleaved" else None
        return schedule_from_name(self.schedule, v)

    def jit_kwargs(self) -> dict:
        """``baton.jit`` arguments that run this plan (pin them in a script)."""
        return {"schedule": self.spec(), "microbatches": self.microbatches,
                "remat": all(r == "min" for r in self.remat), "boundaries": self.boundaries}

    def jit(self, fn, mesh, **kwargs):
        from .frontend.api import jit

        return jit(fn, mesh=mesh, **self.jit_kwargs(), **kwargs)


class Candidates(list):
    """Ranked :class:`Candidate` rows (best first), with ``segments`` (the measured costs)
    and ``stats`` (search statistics, planning seconds)."""

    segments: dict
    stats: dict

    @property
    def best(self) -> Candidate:
        return self[0]

    def __str__(self) -> str:
        head = ("| # | schedule | M | stage cuts (first segment) | remat | step (ms) | measured "
                "(ms) | bubble | peak per rank (MiB) | fits |\n"
                "|---|---|---|---|---|---|---|---|---|---|")
        rows = []
        for k, c in enumerate(self):
            name = c.schedule + (f" v{c.virtual_stages}" if c.schedule == "interleaved" else "")
            meas = "" if c.measured_step is None else f"{c.measured_step * 1e3:.2f}"
            rows.append(
                f"| {k} | {name} | {c.microbatches} | {c.cuts} | {c.remat[0]} | "
                f"{c.step_time * 1e3:.2f} | {meas} | {c.bubble:.1%} | "
                f"{', '.join(f'{b / 2**20:.1f}' for b in c.peak_memory)} | "
                f"{'yes' if c.fits else 'no'} |")
        return "\n".join([head, *rows])


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
             mesh=None, steps: int = 5) -> Candidates:
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
    the finalists. Raises ``ConfigError`` naming the smallest peak and its rank when nothing
    fits."""
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
    out = search_segments(costs, ranks, memory_per_device=memory_per_device,
                          microbatches=microbatches, families=families, remat=remat, top=top,
                          gap=gap, update_in_place=update_in_place)
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


def search_segments(costs: dict, ranks: int, memory_per_device=None, microbatches=None,
                    families=None, remat=("keep", "min"), top: int = 10,
                    gap: float = 0.0, update_in_place: bool = False) -> Candidates:
    """The search half of :func:`autoplan` on segment costs already measured (the dict
    ``measure_segments`` returns, possibly edited: e.g. its ``link`` replaced by one measured
    between the processes that will run the plan). No JAX work. ``microbatches`` default: the
    divisors of the batch up to 4 x ranks. Raises ``ConfigError`` naming the smallest peak
    and its rank when nothing fits."""
    from .planning import autoplan_segments

    t1 = time.perf_counter()
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
                                      gap=gap, update_in_place=update_in_place)
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
                                  [int(b) for b in r["peak_memory"]], bool(r["fits"])))
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


@dataclasses.dataclass
class Auto:
    """``baton.jit(schedule=baton.Auto(...))``: plan on the first call (``autoplan`` with these
    arguments and the mesh's rank count) and run the best plan. ``.chosen`` holds it."""

    memory_per_device: Any = None
    microbatches: Any = None
    families: Any = None
    remat: tuple = ("keep", "min")
    runs: int = 3
    cache_dir: Any = None
    # run the k best predicted plans on the mesh (``runs`` timed steps each) and keep the
    # fastest measured (0: the best predicted)
    measure_top: int = 0
    chosen: Any = None
    candidates: Any = None

    def plan(self, fn, args, ranks: int, update_in_place: bool = False,
             mesh: Any = None) -> Candidate:
        self.candidates = autoplan(fn, *args, ranks=ranks,
                                   memory_per_device=self.memory_per_device,
                                   microbatches=self.microbatches, families=self.families,
                                   remat=self.remat, runs=self.runs, cache_dir=self.cache_dir,
                                   update_in_place=update_in_place,
                                   measure_top=self.measure_top, mesh=mesh,
                                   steps=max(self.runs, 1))
        self.chosen = self.candidates.best
        return self.chosen
