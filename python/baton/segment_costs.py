"""Segment costs for the automatic planner: each segment between candidate cut points measured
once on one device (``measure_segments``) and cached on disk by the traced program's
fingerprint. See :mod:`baton.autoplan` for the method."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _core
from .errors import ConfigError
from .frontend.api import PipelinedFunction
from .mesh import PipelineMesh
from .measure.profile import profile
from .tracing.trace import trace_step
from .schedules import Interleaved1F1B

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
    return PipelinedFunction(fn, PipelineMesh([device], ranks=1),
                             Interleaved1F1B(virtual_stages=stages) if stages > 1 else "1f1b",
                             microbatches, remat=False, fuse_forward_backward=False,
                             boundaries=boundaries)


class _StageTimes(NamedTuple):
    """A probe stage's forward and backward seconds and its XLA temporary bytes."""

    f: float
    b: float
    temp: int


@dataclasses.dataclass
class _Profiled:
    """A one-rank probe measured: per-stage times, the loop simulated from them, the wall time
    of untraced steps, the traced loop span, and the compiled step."""

    stages: list[_StageTimes]
    simulated_loop: float
    wall: float
    measured_loop: float
    step: Any


def _profile_at(fn, args, device, stages: int, microbatches: int, runs: int,
                boundaries=None) -> _Profiled:
    """``fn`` as a one-rank pipeline of ``stages`` stages (every candidate boundary a stage, or
    the ``boundaries`` given), ``microbatches`` per step, each task timed alone
    (``costs="isolated"``)."""
    probe = _probe(fn, device, stages, microbatches, boundaries)
    args = _commit(args, device)
    wall = _wall(probe, args, runs)
    prof = profile(probe, *args, runs=runs, warmup=1, steps=1, costs="isolated")
    out = []
    for s in range(stages):
        sc = prof.cost_model.stages[s]
        temp = max([int(prof.xla_memory.get((k, s), {})
                        .get("temp_size_in_bytes", 0))
                    for k in (_core.TaskKind.F, _core.TaskKind.B)] + [0])
        out.append(_StageTimes(float(sc.f), float(sc.b), temp))
    return _Profiled(out, float(prof.predicted["step_time"]), wall,
                     float(prof.measured["step_time"]), probe.last)


def _calibrate(fn, args, device, ms: list[int], probes: dict[int, _Profiled], outside: float,
               runs: int) -> dict[int, dict]:
    """Per count M: the scale from the simulated loop of the S-stage probe to its wall time
    (less the time outside the loop), and the per-task overhead saved by merging the S stages
    into one (the whole model as one stage, timed at M)."""
    S = len(probes[ms[0]].stages)
    whole_wall = {m: _wall(_probe(fn, device, 1, m, []), _commit(args, device), runs)
                  for m in ms}
    cal = {}
    for m in ms:
        p12, w12 = probes[m].simulated_loop, probes[m].wall
        loop12, loop1 = max(w12 - outside, 0.0), max(whole_wall[m] - outside, 0.0)
        scale = loop12 / p12 if p12 > 0 and loop12 > 0 else 1.0
        saved = max(loop12 - loop1, 0.0) / (2 * max(S - 1, 1) * m)
        cal[m] = {"scale": scale, "task_overhead": saved, "wall": w12, "simulated_loop": p12,
                  "whole_wall": whole_wall[m]}
    return cal


@dataclasses.dataclass
class _Partitions:
    """The reference probe's program partitioned three ways: as run (``keep``), with Baton's
    minimal stash (``small``) and with the backward split into input and weight gradients
    (``split``)."""

    prog: Any
    keep: Any
    small: Any
    split: Any

    @classmethod
    def of(cls, step) -> "_Partitions":
        prog = step.traced.program
        return cls(prog, G.partition(prog, False, False), G.partition(prog, False, True),
                   G.partition(prog, True, False))


def _times(parts: _Partitions, probe: _Profiled, scale: float) -> list[list[float]]:
    """Per segment [f, b, i, w, min_recompute] of a probe, calibrated by ``scale``."""
    rows = []
    for s, (f_t, b_t, _) in enumerate(probe.stages):
        F, B = _task(parts.keep, "F", s), _task(parts.keep, "B", s)
        Bm = _task(parts.small, "B", s)
        Ii, Ww = _task(parts.split, "I", s), _task(parts.split, "W", s)
        share = Ii.cost / (Ii.cost + Ww.cost) if Ii.cost + Ww.cost > 0 else 0.5
        recompute = max(Bm.cost - B.cost, 0.0)
        f, b = f_t * scale, b_t * scale
        rows.append([f, b, b * share, b * (1 - share),
                     f * recompute / F.cost if F.cost > 0 else 0.0])
    return rows


def _segments(parts: _Partitions, probe: _Profiled, scale: float,
              per_stage: dict[int, float]) -> list[dict]:
    """The segments of the C++ layout: the reference probe's calibrated times, the bytes of
    each segment's interfaces, parameters and optimizer state, its XLA temporaries and its
    seconds outside the loop (ranks run their stages' updates in parallel after their loop)."""
    step, prog = probe.step, parts.prog
    params = {outer for _, outer, is_mb in step.traced.loop_inputs if not is_mb}
    opt_by_stage: dict[int, set] = {}
    inputs = set(step.traced.step_inputs)
    for seg in step.post_segments:
        opt_by_stage.setdefault(seg.stage, set()).update(
            v for v in seg.inputs if v in inputs and v not in params)
    segments = []
    for s, (f, b, i, w, rec) in enumerate(_times(parts, probe, scale)):
        F, B = _task(parts.keep, "F", s), _task(parts.keep, "B", s)
        Fm = _task(parts.small, "F", s)
        Ii = _task(parts.split, "I", s)
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
            "temp_bytes": int(probe.stages[s].temp),
        })
    for s_, g in enumerate(segments):
        g["update"] = per_stage.get(s_, 0.0)
    return segments


def _write_cache(path: str, out: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


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
    per_stage = _outside_times(probes[ms[-1]].step, device, runs)
    outside = sum(per_stage.values())
    cal = _calibrate(fn, args, device, ms, probes, outside, runs)
    ref = ms[-1]  # costs are given at the smallest microbatch (most microbatches)
    parts = _Partitions.of(probes[ref].step)
    segments = _segments(parts, probes[ref], cal[ref]["scale"], per_stage)
    link = _measure_link(max([s["act_bytes"] for s in segments] + [8]), runs)
    out = {"batch": batch, "ref_microbatch": batch // ref, "link": link, "fused_factor": 1.0,
           "task_overhead": cal[ref]["task_overhead"], "segments": segments,
           "by_microbatches": {str(m): {"task_overhead": cal[m]["task_overhead"],
                                        "times": _times(parts, probes[m], cal[m]["scale"])}
                               for m in ms},
           "measured": {"microbatches": ms, "seconds": time.perf_counter() - t0,
                        "device": str(device), "outside": outside,
                        "calibration": {str(m): cal[m] for m in ms}}}
    _write_cache(path, out)
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
