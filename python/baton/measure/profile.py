"""Profile-driven costs: measure a pipelined step's tasks and transfers, get a CostModel.

    prof = baton.profile(step, params, opt_state, batch, runs=5)
    prof.cost_model           # seconds per task (median), real buffer bytes, measured link
    print(prof.summary())     # predicted (simulated with those costs) vs measured, per rank
    print(step.summary())     # the plan summary now uses the profiled costs and adds the table

How: every task's arguments are derived from the plan in the layouts the loop hands them
(on its rank's devices; ``measure/task_args.capture``, ``task_args.py``: nothing runs
to get them; the step's own arguments where they are the task's inputs, zeros for the
buffers and running sums); then each task's jit is timed alone, blocking on its outputs,
``runs`` times after ``warmup`` calls, and the median kept (per task: the step's
``(kind, stage)`` keys, ``kind`` a ``TaskKind`` or ``FUSED_FB`` for a fused F+B). A
transfer is timed on a small and on the largest activation/gradient buffer (in one process:
``jax.device_put`` to the next rank's devices; over Gloo: half a ping-pong round trip);
latency = small time, bandwidth from the difference. With ``costs="step"`` (the default) the
cost model then uses what the tasks and transfers cost inside ``steps`` traced steps: the
mean RUN span per task, and the median transfer time from send start to receive (minus the bytes
at the ping-pong bandwidth) as latency. Tasks run slower inside a step than alone (their
inputs are not in cache, other tasks' buffers come and go), and a transfer waits for the
transport threads on a busy core, so these predict the step better. ``steps`` further traced
calls, alternating with those, give the measured step time (median), each rank's bubble and
the peak live buffers, which ``summary()`` puts next to the simulator's prediction. The traced
steps run what users run: the step's own engine (the compiled programs by default, one-rank
steps included, whose peak bytes are then their trace's replay with the plan's sizes). XLA's
memory analysis of each task (``compiled.memory_analysis()``) is kept where JAX provides it.
Multi-process mode: collective; each process times its own stages' tasks and the results are
exchanged, so every process gets the same cost model.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Any

import jax
import numpy as np

from .. import _core
from ..errors import ConfigError
from ..planning.step_costs import cost_model_of
from ..planning.tasks import FUSED_FB, TaskKind, task_name, unit_order
from .traces import Trace, span_bubbles

__all__ = ["Profile", "profile"]

_TINY = 1e-9  # seconds: every task keeps a positive duration (see step_costs.cost_model_of)
_TAG_PROFILE = (1 << 45) + (1 << 20)  # see tracing._TAG_CLOCK


@dataclasses.dataclass
class Profile:
    cost_model: Any  # baton.CostModel, times in seconds
    # (kind, stage) -> seconds (the cost model's); kind a TaskKind, or FUSED_FB (F+B fused),
    # the keys of the step's tasks (CompiledStep.tasks)
    task_times: dict
    task_samples: dict  # same keys -> list of seconds
    link: dict  # latency (s), bandwidth (bytes/s; 0 = infinite), sizes measured
    xla_memory: dict  # same keys -> memory analysis fields (bytes), where JAX exposes it
    measured: dict  # step_time (median s), step_times, bubble, peak_bytes, peak_activation
    predicted: dict  # step_time, bubble, peak_total, peak_activation (simulator)
    trace: Trace | None = None  # the median measured step
    costs: str = "step"  # where task_times / link come from: "step" or "isolated"
    task_times_isolated: dict = dataclasses.field(default_factory=dict)
    link_isolated: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        m, p = self.measured, self.predicted
        ratio = p["step_time"] / m["step_time"] if m["step_time"] > 0 else float("nan")
        lines = [
            f"profiled: step predicted {p['step_time'] * 1e3:.3f} ms, measured "
            f"{m['step_time'] * 1e3:.3f} ms (median of {len(m['step_times'])}; "
            f"predicted/measured {ratio:.2f})",
            "rank  bubble pred  bubble meas  peak total plan  peak total meas  peak act plan"
            "  peak act meas",
        ]
        for r in range(len(p["bubble"])):
            lines.append(
                f"{r:4d} {p['bubble'][r] * 100:11.1f}% {m['bubble'][r] * 100:11.1f}% "
                f"{p['peak_total'][r]:16d} {m['peak_bytes'][r]:16d} "
                f"{p['peak_activation'][r]:14d} {m['peak_activation'][r]:14d}")
        tasks = ", ".join(f"{task_name(k)} {v * 1e3:.3f}" for k, v in _ordered(self.task_times))
        how = "mean inside steps" if self.costs == "step" else "median alone"
        lines.append(f"task times (ms, {how}): {tasks}")
        if self.costs == "step":
            alone = ", ".join(f"{task_name(k)} {v * 1e3:.3f}"
                              for k, v in _ordered(self.task_times_isolated))
            lines.append(f"task times (ms, median alone): {alone}")
        lat, bw = self.link["latency"], self.link["bandwidth"]
        lines.append(f"link: latency {lat * 1e6:.1f} us, bandwidth "
                     + (f"{bw / 2**30:.2f} GiB/s" if bw > 0 else "infinite"))
        return "\n".join(lines)

    def to_json(self) -> str:
        """The profile as JSON; per-task dicts keyed by the tasks' names (``tasks.task_name``:
        "F0", "FB3")."""
        d = {k: getattr(self, k) for k in ("link", "measured", "predicted", "costs",
                                           "link_isolated")}
        for k in ("task_times", "task_samples", "xla_memory", "task_times_isolated"):
            d[k] = {task_name(t): v for t, v in _ordered(getattr(self, k))}
        d["cost_model"] = json.loads(self.cost_model.to_json())
        return json.dumps(d)


def _ordered(by_task: dict) -> list:
    """The items of a dict keyed by task (kind, stage), by kind name then stage."""
    return sorted(by_task.items(), key=lambda kv: unit_order(kv[0]))


def _median_time(fn, args, runs: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t)
    return out


def _xla_memory(fn, args) -> dict | None:
    try:
        return xla_memory(fn.lower(*args).compile())
    except Exception:  # noqa: BLE001  (not every backend / JAX version exposes it)
        return None


def xla_memory(compiled) -> dict | None:
    """``compiled.memory_analysis()`` as a dict of byte fields (per device for an SPMD
    program), or None where the backend gives none."""
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes", "generated_code_size_in_bytes")
    return {f: int(getattr(ma, f)) for f in fields if hasattr(ma, f)}


def _fit_link(small: tuple[int, float], big: tuple[int, float]) -> dict:
    (n0, t0), (n1, t1) = small, big
    bw = (n1 - n0) / (t1 - t0) if n1 > n0 and t1 > t0 else 0.0
    return {"latency": max(t0, 0.0), "bandwidth": bw, "sizes": [n0, n1], "times": [t0, t1]}


def _local_link(step, nbytes: int, runs: int) -> dict:
    """One process: ``jax.device_put`` from rank 0's devices to rank 1's (blocking)."""
    if step.num_ranks < 2:
        return {"latency": 0.0, "bandwidth": 0.0, "sizes": [], "times": []}
    pts = []
    for n in (4, max(nbytes, 8)):
        x = jax.device_put(np.zeros(n // 4, np.float32), step.mesh.replicated(0))
        dst = step.mesh.replicated(1)
        ts = _median_time(lambda a: jax.device_put(a, dst), [x], runs, 1)
        pts.append((n, statistics.median(ts)))
    return _fit_link(*pts)


def _group_link(group, nbytes: int, runs: int, timeout: float) -> dict:
    """Multi-process: half the round trip of a ping-pong between ranks 0 and 1."""
    t, me = group.transport, group.rank
    res = None
    if group.world_size >= 2 and me in (0, 1):
        pts = []
        tag = _TAG_PROFILE
        for n in (4, max(nbytes, 8)):
            x = np.zeros(n // 4, np.float32)
            ts = []
            for k in range(runs + 1):
                if me == 0:
                    t0 = time.perf_counter()
                    t.isend(1, tag, [x]).wait(timeout)
                    t.irecv(1, tag + 1).wait(timeout)
                    ts.append((time.perf_counter() - t0) / 2)
                else:
                    y = t.irecv(0, tag).wait(timeout)
                    t.isend(0, tag + 1, [np.asarray(y[0])]).wait(timeout)
                tag += 2
            if me == 0:
                pts.append((n, statistics.median(ts[1:])))
        if me == 0:
            res = _fit_link(*pts)
    blobs = t.exchange(json.dumps(res), timeout)
    got = json.loads(blobs[0])
    return got or {"latency": 0.0, "bandwidth": 0.0, "sizes": [], "times": []}


def _traced(fn, args) -> Trace:
    fn._call(args, record=True, keep_args=True)
    return fn.last_trace


def _task_key(run: dict) -> tuple | None:
    """The task (kind, stage) one traced RUN ran, from its typed fields (``kind``: a
    ``TaskKind``): ``(FUSED_FB, s)`` for a fused F(s,m)+B(s,m); None for other fused pairs
    (no single task to credit)."""
    s = run["stage"]
    if "second_kind" not in run:
        return (run["kind"], s)
    if ((run["kind"], run["second_kind"]) == FUSED_FB and run["second_stage"] == s
            and run["second_microbatch"] == run["microbatch"]):
        return (FUSED_FB, s)
    return None


def _step_task_times(traces: list, fallback: dict) -> dict:
    """Mean span per task (kind, stage) over the RUNs of ``traces`` (every rank, every
    step): a step is a sum of task times, and inside steps their spread is skewed (a task
    that shares its core with transfer threads runs long), so the mean predicts the sum
    where the median would not; tasks that never ran keep ``fallback`` (isolated) times."""
    spans: dict[tuple, list[float]] = {}
    for tr in traces:
        for r in tr.runs:
            k = _task_key(r)
            if k is not None:
                spans.setdefault(k, []).append(r["end"] - r["start"])
    out = dict(fallback)
    out.update({k: statistics.fmean(v) for k, v in spans.items()})
    return out


def _step_link(traces: list, fallback: dict) -> dict:
    """Latency as it is inside the steps: the median over transfers of (receive completed -
    send started) minus the bytes at the ping-pong bandwidth; that bandwidth kept. (The
    executor posts a receive before the RUN that precedes it, so the receiver is almost
    always waiting when the data leaves; the median ignores the rest.)"""
    bw = fallback.get("bandwidth", 0.0)
    lat = []
    for tr in traces:
        for x in tr.transfers:
            lat.append(max(x["end"] - x["start"] - (x["bytes"] / bw if bw > 0 else 0.0), 0.0))
    if not lat:
        return dict(fallback)
    return dict(fallback, latency=statistics.median(lat), transfers=len(lat))


def _stage_cost(s: int, fc: Any, times: dict, split: bool):
    """One stage's StageCost (seconds) from task times; byte sizes from ``fc``."""
    sc = _core.StageCost()
    for f in ("act_bytes", "stash_bytes", "grad_bytes", "wstash_bytes", "wgrad_bytes"):
        setattr(sc, f, getattr(fc, f))
    t = {kind: v for (kind, stage), v in times.items() if stage == s}
    F, B, I, W = TaskKind.F, TaskKind.B, TaskKind.I, TaskKind.W
    if FUSED_FB in t and F not in t and B not in t:
        # only fused (F+B of a microbatch as one program): split by the flop estimate
        share = fc.f / (fc.f + fc.b) if fc.f + fc.b > 0 else 1 / 3
        t[F], t[B] = t[FUSED_FB] * share, t[FUSED_FB] * (1 - share)
    sc.f = max(t.get(F, 0.0), _TINY)
    if split:
        sc.i = max(t.get(I, 0.0), _TINY)
        sc.w = max(t.get(W, 0.0), _TINY)
        sc.b = max(t.get(B, sc.i + sc.w), _TINY)
    else:
        sc.b = max(t.get(B, 0.0), _TINY)
        sc.i = sc.w = sc.b / 2
    if FUSED_FB in t:  # F and B of one microbatch run as one program
        sc.fb = max(t[FUSED_FB], _TINY)
    return sc


def _isolated(fn, args, step, runs: int, warmup: int) -> tuple[dict, dict]:
    """Each task's run times alone ((kind, stage) -> seconds per run) and XLA memory
    analysis, on the arguments in the loop's layouts (``measure/task_args.capture``);
    with several processes each times its own ranks' tasks and every process gets all of
    them (exchanged by the task's position in the step's tasks, which every process has)."""
    samples: dict[tuple, list[float]] = {}
    xla: dict[tuple, dict] = {}
    captured = fn.capture_task_args(args)
    for key, (acc, a) in _ordered(captured):
        exe = step.tasks[key]
        task = exe.fn
        if acc is not None:  # as it runs in the loop: adding to the running sums
            task, a = exe.fn_acc, [acc, *a]
        samples[key] = _median_time(task, a, runs, warmup)
        mem = _xla_memory(task, a)
        if mem is not None:
            xla[key] = mem
    if fn.group is not None:
        keys = sorted(step.tasks, key=unit_order)
        pos = {k: i for i, k in enumerate(keys)}
        mine = [[[pos[k], v] for k, v in samples.items()], [[pos[k], v] for k, v in xla.items()]]
        for b in fn.group.transport.exchange(json.dumps(mine), fn.timeout):
            smp, xm = json.loads(b)
            samples.update((keys[i], v) for i, v in smp)
            xla.update((keys[i], v) for i, v in xm)
    return samples, xla


def profile(fn: Any, *args, runs: int = 5, warmup: int = 1, steps: int | None = None,
            costs: str = "step") -> Profile:
    """Measures ``fn`` (a ``baton.jit`` function) on ``args`` and returns a :class:`Profile`
    whose ``cost_model`` (seconds) the planner and simulator use; ``fn.summary()`` and
    ``fn.simulate()`` use it from then on. ``runs``: timed calls per task; ``steps``: traced
    whole steps for the measured step time (default ``runs``). ``costs``: ``"step"`` (task
    and link costs measured inside ``steps`` traced steps, which are then not the ones
    compared with the prediction; the two sets alternate) or ``"isolated"`` (each task
    timed alone, the link by ping-pong)."""
    if not isinstance(runs, int) or runs < 1 or warmup < 0:
        raise ConfigError(f"baton.profile: runs must be >= 1 and warmup >= 0 "
                          f"(got runs={runs!r}, warmup={warmup!r})")
    if costs not in ("step", "isolated"):
        raise ConfigError(f"baton.profile: costs must be 'step' or 'isolated' (got {costs!r})")
    steps = runs if steps is None else steps
    step = fn.compile(*args)
    step.use_profile(None)  # flop-based costs while measuring (buffer sizes)
    flop_costs = cost_model_of(step)
    # 1.-2. each task timed alone on the arguments the loop hands it
    samples, xla = _isolated(fn, args, step, runs, warmup)
    times = {k: statistics.median(v) for k, v in samples.items()}
    # 3. transfers
    big = max([int(c.act_bytes) for c in flop_costs.stages]
              + [int(c.grad_bytes) for c in flop_costs.stages] + [8])
    if fn.group is None:
        link = _local_link(step, big, runs)
    else:
        link = _group_link(fn.group, big, runs, fn.timeout)
    iso_times, iso_link = times, link
    # 4. costs inside real steps (default): the mean RUN span per task over `steps` traced
    # calls, link latency from their transfers. Those calls alternate with the `steps`
    # measured ones (5.), so a machine whose speed drifts during profiling moves both sets
    # alike (two sets run one after the other differed by up to 15% on a shared VM).
    n = max(steps, 1)
    traced = [_traced(fn, args) for _ in range(2 * n if costs == "step" else n)]
    ctx, traces = (traced[0::2], traced[1::2]) if costs == "step" else ([], traced)
    if costs == "step":
        times = _step_task_times(ctx, iso_times)
        link = _step_link(ctx, iso_link)
    split = step.partition.split_backward
    cm = _core.CostModel()
    cm.stages = [_stage_cost(s, fc, times, split) for s, fc in enumerate(flop_costs.stages)]
    cm.skips = flop_costs.skips
    lc = _core.LinkCost()
    lc.latency = float(link["latency"])
    lc.bandwidth = float(link["bandwidth"])
    cm.link = lc
    cm.validate()
    # 5. measured steps (not those the costs came from) vs the simulator's prediction
    order = sorted(range(len(traces)), key=lambda i: traces[i].step_time)
    med = traces[order[len(order) // 2]]
    sim = step.plan.simulate(cm)
    R = step.num_ranks
    measured = {"step_time": med.step_time, "step_times": [t.step_time for t in traces],
                "bubble": med.bubble,
                # the interpreter counts its buffers' arrays; a compiled step's memory is
                # XLA's, so its trace's replay (the plan's sizes at measured times) stands in
                "peak_bytes": list(fn.last_run.stats.get("peak_bytes", med.peak_total)),
                "peak_activation": [max(t.peak_activation[r] for t in traces) for r in range(R)]}
    runs_ = list(sim.runs)
    predicted = {"step_time": (max(r.end for r in runs_) - min(r.start for r in runs_))
                 if runs_ else 0.0,
                 "bubble": span_bubbles(runs_, R), "peak_total": list(sim.peak_total),
                 "peak_activation": list(sim.peak_activation)}
    prof = Profile(cm, times, samples, link, xla, measured, predicted, med, costs,
                   iso_times, iso_link)
    step.use_profile(prof)
    return prof
