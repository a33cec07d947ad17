"""Per-device memory of a pipelined step: a model, and what the run actually holds.

    mem = step.memory(params, opt_state, batch, measure=True)   # step: a baton.jit function
    print(mem.table())          # per rank and device: predicted by component, measured, ratio

**Model** (per device d of rank r; every size the bytes of d's shard of the value, from its
sharding: the user's spec over the rank's sub-mesh, or the layout XLA gave a task's output):

    static(d)       the step's arguments on r: each parameter, optimizer state and other input
                    on the rank of the smallest stage that reads it, in its placement
                    (``CompiledStep.placement``); the batch where the caller put it
    copies(d)       loop inputs another rank also reads (a tied weight, placed there for the
                    loop) and the batch split into microbatches (kept for the loop)
    accumulators(d) the running sums of r's stages (weight gradients, mean/sum outputs) in the
                    layout of the task outputs that make them; stacked outputs M times
    buffers(d)      the simulator's peak_total of r with each buffer sized per device (the
                    tasks' compiled output layouts: boundary values split over the batch
                    axes, stashes as XLA laid them out); for a rank the compiled engine runs
                    as a table, its rings instead, held for the whole loop
                    (``memory_rings.py``: the rank program's slots per pool of equal avals)
    transient(d)    max over r's tasks of XLA's temp_size_in_bytes of its program plus the
                    new running sums it writes (the old ones stay until it returns: the sums
                    are not donated); for a B that runs as I then W (a split partition's B:
                    DualPipeV), I's weight stash, held from I's start until W is done, plus
                    the larger of I's and W's
    loop(d)         the peak over the simulated loop of: live buffers + the running sums of
                    r's stages made by then + (during a RUN) its task's temporaries and new
                    sums; at most buffers + accumulators + transient. A table: its rings +
                    every sum + the largest of a task's temporaries, new sums and the buffers
                    it reads (sliced out of the rings)
    update(d)       the peak over the segments after the loop (the optimizer update), in the
                    order the step runs them: static + the values they read that the loop or
                    the code before it made (the combined gradients) until their last reader
                    + what earlier segments made (until its last reader, or to the end if the
                    step returns it) + the segment's outputs (an output written into a
                    donated input's buffer adds nothing) + its XLA temporaries on its rank's
                    devices
    predicted(d) = max(static + copies + loop, update)
    host(d)         a step that offloads (``baton.jit(offload=...)``): the most bytes of d's
                    stashes in host memory at once, from the same simulation over the step's
                    own rank programs (whose device peaks count a stash on the host as gone);
                    measured as the rank's host slots' peak (``RankComm.host_bytes``)

The tasks are compiled on the layouts of the arguments the loop hands them, and the segments
after the loop on theirs (``measure/task_args.capture``, derived from the plan without
running the step: ``task_args.py``), so the layouts and temporaries are those of the programs
the step runs.

**Measurement** (``measure=True``: one more call on the step's own engine): the bytes of every
live ``jax.Array`` per device (``jax.live_arrays()``, each array's shards per device from
its sharding), sampled at the start of the loop and, after the loop, once each segment's
outputs exist, with its temporaries added (``PostSegment(j)``). Inside the loop:

* the compiled engine (the default) runs each rank's loop as one program, which live arrays
  cannot see into: the sample taken as the programs start (their arguments placed) adds, on
  each rank's devices, the allocation XLA assigned its program (temporaries plus outputs not
  written into donated arguments; ``compiled.memory_analysis()``). A one-rank step is one
  program, so its whole step is that sample.
* the interpreter (``engine="interpreter"``) samples after every task's outputs are computed
  (its inputs and old running sums still held), after every RUN and every received transfer,
  adding, at a sample taken inside a task, that task's temp_size_in_bytes on its rank's
  devices.

A donating step consumes copies of the caller's donated arrays (``memory`` keeps the caller's
valid); the originals are subtracted from every sample, as if the caller had given them up.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from .. import _core
from .. import _jax_compat as jc
from ..errors import ConfigError
from ..planning.step_costs import cost_model_of
from ..planning.tasks import MB, BufKind, kind_name, task_exes, unit_order
from ..running.run_options import PostSegment
from .memory_live import LivePeak, measure_live, per_device, program_bytes
from .memory_rings import buffer_outputs, table_loop
from .profile import xla_memory

G = _core.graph
# the model's components per device; predicted = max(static + copies + loop, update)
COMPONENTS = ("static", "copies", "accumulators", "buffers", "transient", "loop", "update")


@dataclasses.dataclass
class Memory:
    """Per device (id) bytes of each model component, the measured peak (None until
    measured), and each rank's device ids."""

    rank_devices: list[list[int]]
    parts: dict  # component -> {device id: bytes}
    temps: dict  # (kind, stage) -> XLA temp_size_in_bytes (per device)
    measured: dict | None = None  # device id -> peak bytes (live arrays + temporaries)
    schedule: str = ""
    measured_update: dict | None = None  # the same, over the segments after the loop
    # host memory (an offloading step): device id -> the most bytes of its stashes held in
    # host memory at once, simulated over the step's rank programs, and measured (the rank's
    # host slots' peak over the measured call; None until measured)
    host: dict = dataclasses.field(default_factory=dict)
    measured_host: dict | None = None

    def predicted(self, d: int) -> int:
        p = self.parts
        return max(p["static"].get(d, 0) + p["copies"].get(d, 0) + p["loop"].get(d, 0),
                   p.get("update", {}).get(d, 0))

    def rows(self) -> list[dict]:
        out = []
        for r, devs in enumerate(self.rank_devices):
            for d in devs:
                row = {"rank": r, "device": d, **{c: self.parts[c].get(d, 0)
                                                   for c in COMPONENTS},
                       "predicted": self.predicted(d)}
                if self.measured is not None:
                    row["measured"] = self.measured.get(d, 0)
                    row["ratio"] = row["predicted"] / row["measured"] if row["measured"] \
                        else float("nan")
                if self.measured_update:
                    m = row["measured update"] = self.measured_update.get(d, 0)
                    row["update ratio"] = row["update"] / m if m else float("nan")
                if self.host:
                    row["host"] = self.host.get(d, 0)
                    if self.measured_host is not None:
                        row["measured host"] = self.measured_host.get(d, 0)
                out.append(row)
        return out

    def table(self) -> str:
        """A markdown table (KiB): per rank and device, the components, predicted total,
        measured peak and predicted / measured."""
        cols = ["rank", "device", *COMPONENTS, "predicted"]
        if self.measured is not None:
            cols += ["measured", "ratio"]
        if self.measured_update:
            cols += ["measured update", "update ratio"]
        if self.host:
            cols += ["host"] + (["measured host"] if self.measured_host is not None else [])
        plain = ("rank", "device", "ratio", "update ratio")
        lines = ["| " + " | ".join(c if c in plain else c + " KiB" for c in cols) + " |",
                 "|" + "---:|" * len(cols)]
        for row in self.rows():
            cells = [str(row[c]) if c in ("rank", "device") else
                     f"{row[c]:.3f}" if c in plain else f"{row[c] / 1024:.1f}" for c in cols]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def worst_ratio(self) -> float:
        """The predicted / measured ratio furthest from 1 over the devices."""
        rs = [r["ratio"] for r in self.rows()]
        return max(rs, key=lambda x: abs(x - 1.0))


def _readers(step) -> dict[int, int]:
    """Step input -> the smallest stage that reads it (in the loop or outside it)."""
    first: dict[int, int] = {}

    def see(v, s):
        if v not in first or s < first[v]:
            first[v] = s

    for (_, s), exe in step.tasks.items():
        for lv in exe.in_groups[0] + exe.in_groups[1]:
            see(step.loop_src[lv][0], s)
    for seg in step.pre_segments + step.post_segments:
        for v in seg.inputs:
            see(v, seg.stage)
    inputs = set(step.traced.step_inputs)
    return {v: s for v, s in first.items() if v in inputs}


def _static_and_copies(step, flat_args) -> tuple[dict, dict]:
    vals = dict(zip(step.traced.step_inputs, flat_args))
    home = _readers(step)
    batch = {o for o, mb in step.loop_src.values() if mb}
    static: dict = {}
    copies: dict = {}
    for v, s in home.items():
        x = vals[v]
        if v in batch:  # not placed: where the caller put it, and split for the loop
            if isinstance(x, jax.Array):
                per_device([x], static)
                per_device([x], copies)
            else:
                sd = jc.one_device_sharding(jax.devices()[0])
                per_device([(sd, np.shape(x), np.result_type(x))], copies)
            continue
        r = step.stage_rank[s]
        per_device([(step.placement(v, x, r), np.shape(x), x.dtype)], static)
    for r in range(step.num_ranks):  # loop inputs placed on a rank besides their home
        for v in step.loop_needs[r]:
            if v in home and v not in batch and step.stage_rank[home[v]] != r:
                x = vals[v]
                per_device([(step.placement(v, x, r), np.shape(x), x.dtype)], copies)
    return static, copies


def _compiled_tasks(step, captured) -> dict:
    """(kind, stage) -> (task outputs by group as (sharding, shape, dtype), temp bytes,
    the new running sums' per-device bytes)."""
    out = {}
    for (kind, s), (acc, args) in sorted(captured.items(), key=lambda kv: unit_order(kv[0])):
        exe = step.tasks[(kind, s)]
        fn = exe.fn
        if acc is not None:
            fn, args = exe.fn_acc, [acc, *args]
        lowered = fn.lower(*args)
        comp = lowered.compile()
        mem = xla_memory(comp)
        if mem is None:
            raise ConfigError(f"memory model: the backend gives no memory analysis for task "
                              f"{kind_name(kind)}{s} (its XLA temporaries are unknown)")
        outs = [(sh, tuple(a.shape), a.dtype)
                for sh, a in zip(comp.output_shardings, jax.tree.leaves(lowered.out_info))]
        sums = per_device([outs[j] for j in exe.acc_pos]) if acc is not None else {}
        out[(kind, s)] = (exe.split(outs), int(mem["temp_size_in_bytes"]), sums)
    return out


def _buffers(step, compiled) -> tuple[dict, dict]:
    """Per-device bytes of each plan buffer (kind, stage or edge) and of each stage's
    running sums, from the tasks' output layouts."""
    bufs: dict = {}
    sums: dict = {}
    parts = step.parts
    M = step.M
    for key, items in buffer_outputs(compiled):
        bufs[key] = per_device(items)
    for (kind, s), (groups, _, _) in compiled.items():
        exe = step.tasks[(kind, s)]
        stacked: list = []
        for g, idx in ((BufKind.WGrad, exe.body[0]), (MB, exe.body[1])):
            for item, i in zip(groups[g], idx):
                if parts[i].reduce == G.Reduce.Stack:
                    stacked.append(item)
                else:
                    per_device([item], sums.setdefault(s, {}))
        if stacked:
            bufs[(BufKind.WGrad, s)] = per_device(
                [it for it, i in zip(groups[BufKind.WGrad], exe.body[0])
                 if parts[i].reduce == G.Reduce.Stack])
            per_device(stacked, sums.setdefault(s, {}), times=M)
    return bufs, sums


def _loop_peak(step, sim, j, compiled, sums, bufs) -> tuple[dict, dict]:
    """Per rank: the peak over the simulated loop of device position ``j``: the live
    buffers (``sim.memory``) plus the running sums of the rank's stages that exist by then
    (from the start of the stage's first task that makes them), plus, during a RUN, its
    tasks' largest XLA temporaries and new sums (the old ones are still held), and for a B
    the partition runs as I then W, I's weight stash while I and W run (the plan sees one B);
    and per rank the largest such RUN transient."""
    first: dict[int, float] = {}  # stage -> start of its first task with running sums
    extra: dict[tuple, int] = {}  # (rank, action) -> temp + new sums of its costliest task
    for run in sim.runs:
        dv = step.mesh.rank_devices[run.rank][j].id
        best = 0
        for kind, s, _ in step.buffers.tasks_of(run.rank, run.action):
            exes = task_exes(step.tasks, kind, s)
            # a B run as I then W: I's weight stash (its output, which the plan's one B does
            # not have) exists from I's start until W is done
            between = bufs.get((BufKind.WStash, s), {}).get(dv, 0) if len(exes) > 1 else 0
            for exe in exes:
                _, temp, new = compiled[(exe.kind, exe.stage)]
                best = max(best, between + temp + new.get(dv, 0))
                if exe.acc_parts:
                    first[s] = min(first.get(s, run.start), run.start)
        extra[(run.rank, run.action)] = best
    out, most = {}, {}
    for r in range(step.num_ranks):
        dv = step.mesh.rank_devices[r][j].id
        mine = [(first[s], sums.get(s, {}).get(dv, 0)) for s in first
                if step.stage_rank[s] == r]

        def held(t, strict):
            return sum(n for t0, n in mine if (t0 < t if strict else t0 <= t))

        samples = sorted((m.time, m.total) for m in sim.memory[r])
        peak = max([tot + held(t, False) for t, tot in samples] + [0])
        for run in sim.runs:
            if run.rank != r:
                continue
            during = [tot for t, tot in samples if run.start <= t < run.end]
            before = [tot for t, tot in samples if t <= run.start]
            buf = max(during or before[-1:] or [0])
            peak = max(peak, buf + held(run.start, True) + extra[(r, run.action)])
        out[r] = peak
        most[r] = max([n for (q, _), n in extra.items() if q == r] + [0])
    return out, most


def _simulated(step, bufs, compiled, sums) -> tuple[dict, dict, dict, dict]:
    """Per device: the simulator's peak_total of its rank with every buffer sized for that
    device, the loop peak, the largest transient of a RUN (``_loop_peak``) and, for a step
    that offloads, its host peak; one simulation per device position within a rank. An
    offloading step is simulated over its own rank programs (their OFFLOAD and FETCH
    instructions hold a stash on the host in between), any other over its plan."""
    base = cost_model_of(step).to_json()
    offloads = any(o == _core.Offload.STASH for o in step.offload)
    peak, loop, transient, host = {}, {}, {}, {}
    for j in range(step.mesh.devices_per_rank()):
        cm = _core.CostModel.from_json(base)

        def dev(s):
            return step.mesh.rank_devices[step.stage_rank[s]][j].id

        stages = list(cm.stages)
        for s, sc in enumerate(stages):
            for f, k in (("act_bytes", BufKind.Act), ("stash_bytes", BufKind.Stash),
                         ("grad_bytes", BufKind.Grad), ("wstash_bytes", BufKind.WStash),
                         ("wgrad_bytes", BufKind.WGrad)):
                setattr(sc, f, int(bufs.get((k, s), {}).get(dev(s), 0)))
        cm.stages = stages
        skips = list(cm.skips)
        edges = list(step.partition.skips)
        for e, sk in enumerate(skips):
            sk.act_bytes = int(bufs.get((BufKind.Skip, e), {}).get(dev(edges[e].src), 0))
            sk.grad_bytes = int(bufs.get((BufKind.SkipGrad, e), {}).get(dev(edges[e].dst), 0))
        cm.skips = skips
        sim = (_core.simulate_rank_ir(step.rank_ir(), cm) if offloads
               else step.plan.simulate(cm))
        lp, most = _loop_peak(step, sim, j, compiled, sums, bufs)
        for r in range(step.num_ranks):
            d = step.mesh.rank_devices[r][j].id
            peak[d] = int(sim.peak_total[r])
            loop[d] = int(lp[r])
            transient[d] = int(most[r])
            if offloads:
                host[d] = int(sim.peak_host_bytes[r])
    return peak, loop, transient, host


def _update_phase(step, layouts, static) -> tuple[dict, dict]:
    """Per device: the peak over the segments after the loop (the module docstring's
    update(d)), from each segment's argument layouts (``layouts[j]``, as the step handed
    them) and its compiled outputs and temporaries; and ``PostSegment(j)`` -> temporaries."""
    segs = step.post_segments
    inputs = set(step.traced.step_inputs)
    keep = set(step.traced.step_outputs)
    made_by = {v for seg in segs for v in seg.outputs}
    last: dict = {}
    live: dict = {}  # value (not a step input) -> per-device bytes, while it is held
    for j, (seg, args) in enumerate(zip(segs, layouts)):
        for v, x in zip(seg.inputs, args):
            last[v] = j
            if v not in inputs and v not in made_by and isinstance(x, jax.ShapeDtypeStruct):
                live[v] = per_device([(x.sharding, tuple(x.shape), x.dtype)])
    base = dict(static)
    peak = dict(static)
    temps: dict = {}
    for j, (seg, args) in enumerate(zip(segs, layouts)):
        lowered = seg.fn.lower(*args)
        comp = lowered.compile()
        mem = xla_memory(comp)
        if mem is None:
            raise ConfigError(f"memory model: the backend gives no memory analysis for "
                              f"segment {j} after the loop (stage {seg.stage})")
        temps[PostSegment(j)] = int(mem["temp_size_in_bytes"])
        made = {v: per_device([(sh, tuple(o.shape), o.dtype)])
                for v, sh, o in zip(seg.outputs, comp.output_shardings,
                                    jax.tree.leaves(lowered.out_info))}
        # a donated input's buffer holds one of the outputs: it leaves the static part
        reused = per_device([(args[i].sharding, tuple(args[i].shape), args[i].dtype)
                             for i in seg.donate])
        now = dict(base)
        for per in list(live.values()) + list(made.values()):
            for d, n in per.items():
                now[d] = now.get(d, 0) + n
        for d, n in reused.items():
            now[d] -= n
            base[d] -= n
        for dv in step.mesh.rank_devices[step.stage_rank[seg.stage]]:
            now[dv.id] = now.get(dv.id, 0) + temps[PostSegment(j)]
        for d, n in now.items():
            peak[d] = max(peak.get(d, 0), n)
        live.update(made)
        for v in [v for v in live if v not in keep and last.get(v, -1) <= j]:
            del live[v]
    return peak, temps


def memory(fn, args, measure: bool = False) -> Memory:
    """The per-device memory model of ``fn`` (a ``baton.jit`` function) on ``args``
    (see the module docstring); ``measure``: also run one step on the step's own engine
    sampling the live arrays (``Memory.measured``, ``measure_live``). One process only."""
    if fn.group is not None:
        raise ConfigError("step.memory(): one process only (in several processes each "
                          "process sees only its own ranks' arrays)")
    step = fn.compile(*args)
    flat = jax.tree.leaves(args)
    layouts: list = []
    captured = fn.capture_task_args(args, post=layouts, arrays=False)
    compiled = _compiled_tasks(step, captured)
    del captured
    bufs, sums = _buffers(step, compiled)
    static, copies = _static_and_copies(step, flat)
    acc: dict = {}
    for s, per in sums.items():
        for d, n in per.items():
            acc[d] = acc.get(d, 0) + n
    temps = {k: v[1] for k, v in compiled.items()}
    peak, loop, transient, host = _simulated(step, bufs, compiled, sums)
    for part, per in zip((peak, loop, transient), table_loop(step, compiled, acc)):
        part.update(per)  # ranks run as tables: their rings (memory_rings.py)
    update, post_temps = _update_phase(step, layouts, static)
    temps.update(post_temps)
    mem = Memory([[d.id for d in g] for g in step.mesh.rank_devices],
                 {"static": static, "copies": copies, "accumulators": acc,
                  "buffers": peak, "transient": transient, "loop": loop, "update": update},
                 temps, schedule=step.plan.schedule.name, host=host)
    if measure:
        progs = (step.engine.local_progs or []) if host else []
        for p in progs:
            p.comm.reset_host_peak()
        mem.measured, mem.measured_update = measure_live(fn, args, temps)
        if host:  # offloading ranks hold one device each (planning/offload.py)
            progs = step.engine.local_progs or []
            mem.measured_host = {step.mesh.rank_devices[p.rank][0].id: int(p.comm.host_bytes()[1])
                                 for p in progs}
    return mem


__all__ = ["Memory", "LivePeak", "memory", "measure_live", "per_device", "program_bytes"]
