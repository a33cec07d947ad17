"""Measured traces of pipelined steps, in the simulator's trace layout.

    trace = baton.trace(step, params, opt_state, batch, path="step.json")  # one traced call
    trace.bubble            # per rank: idle fraction between its first and last task
    step = baton.jit(..., trace=True); step(...); step.write_trace("step.json")

While tracing, every rank's executor records (posted, started, completed) per instruction
(``record_events``) and every task callback blocks until its outputs are computed, so a RUN's
span is the task's real compute time (JAX dispatch is asynchronous: without blocking a RUN
lasts only as long as its dispatch). With tracing off nothing is recorded or blocked.

The trace is ONE Chrome/Perfetto JSON for the whole job, in the layout of
``Plan.to_trace`` (``render.h`` ``to_chrome_trace``): pid 0, tid r = "rank r", one "X" per
RUN named after the action ("F3.1", "F0.3+B7.1") with cat F/B/I/W/fused and args {stage,
microbatch, instr, action}; one "X" per transfer on a "link a->b" track with a flow arrow
to the receiving rank; "memory rank r" counters (live stash+wstash and total bytes,
replayed from the measured events with the plan's buffer sizes). Times are microseconds from
the step's first event. In multi-process mode every process's events are gathered over the
transport (one all-gather) and put on rank 0's clock: rank 0 estimates each rank's clock
offset by ping-pong (the sample with the shortest round trip, offset = t_peer - midpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

from .. import _core

__all__ = ["Event", "Trace", "build_trace", "buffer_bytes", "trace"]

_K = _core.BufKind
_FIELDS = {_K.Act: "act_bytes", _K.Grad: "grad_bytes", _K.Stash: "stash_bytes",
           _K.WStash: "wstash_bytes", _K.WGrad: "wgrad_bytes"}


def buffer_bytes(core_plan: Any, costs: Any) -> list[int]:
    """Bytes of every buffer id as the simulator counts them (cost.h: act/grad bytes of the
    producing stage, stash/wstash/wgrad bytes of its stage, a skip edge's from
    ``CostModel.skips``); ids and kinds from the plan (``Plan.buffer_key``)."""
    skips = {(c.src, c.dst): c for c in costs.skips}
    edges = list(core_plan.skips)
    out = []
    for b in range(core_plan.num_buffer_ids()):
        k = core_plan.buffer_key(b)
        kind = k.kind
        if kind in (_K.Skip, _K.SkipGrad):
            c = skips.get((edges[k.stage].src, edges[k.stage].dst))
            out.append(0 if c is None else int(c.act_bytes if kind == _K.Skip else c.grad_bytes))
            continue
        sc = costs.stages[k.stage] if k.stage < len(costs.stages) else costs.default_stage
        out.append(int(getattr(sc, _FIELDS[kind])))
    return out


def _category(act) -> str:
    if act.is_fused:
        return "fused"
    return act.first.kind.name


@dataclasses.dataclass
class Trace:
    """A measured step: per-rank task spans, transfers and memory, times in seconds from the
    step's first event (on rank 0's clock)."""

    schedule: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    # dicts: rank, instr, action, name, cat, kind (a _core.TaskKind), stage, microbatch,
    # start, end; a fused action's also second_kind, second_stage, second_microbatch
    runs: list
    # dicts: src, dst, buffer, name, send_instr, recv_instr, posted, start, recv_posted, end,
    # bytes
    transfers: list
    memory: list  # per rank: [(time, activation, total)]
    peak_activation: list
    peak_total: list
    offsets_ns: list  # per rank clock offset applied (0 in single-process mode)
    outputs: Any = None

    # -- derived measures -------------------------------------------------------
    @property
    def step_time(self) -> float:
        """From the first task's start to the last task's end, over all ranks (seconds)."""
        if not self.runs:
            return 0.0
        return max(r["end"] for r in self.runs) - min(r["start"] for r in self.runs)

    @property
    def busy(self) -> list[float]:
        out = [0.0] * self.num_ranks
        for r in self.runs:
            out[r["rank"]] += r["end"] - r["start"]
        return out

    @property
    def bubble_fraction(self) -> float:
        """1 - sum(busy) / (ranks * step_time), as the simulator reports it."""
        t = self.step_time
        return max(0.0, 1.0 - sum(self.busy) / (self.num_ranks * t)) if t > 0 else 0.0

    @property
    def bubble(self) -> list[float]:
        """Per rank: 1 - busy / (last task end - first task start) of that rank."""
        return span_bubbles(self.runs, self.num_ranks)

    def rank_order(self, rank: int) -> list[str]:
        """Names of the rank's tasks in the order they started."""
        return [r["name"] for r in sorted((r for r in self.runs if r["rank"] == rank),
                                          key=lambda r: r["start"])]

    # -- output --------------------------------------------------------------------
    def to_chrome(self) -> dict:
        us = 1e6
        P = self.num_ranks
        ev: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0,
                           "args": {"name": f"baton {self.schedule}"}}]
        for r in range(P):
            ev.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                       "args": {"name": f"rank {r}"}})
            ev.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r,
                       "args": {"sort_index": r}})
        for r in self.runs:
            args = {"stage": r["stage"], "microbatch": r["microbatch"], "instr": r["instr"],
                    "action": r["action"]}
            if "second_stage" in r:
                args["second_stage"] = r["second_stage"]
                args["second_microbatch"] = r["second_microbatch"]
            ev.append({"name": r["name"], "cat": r["cat"], "ph": "X", "pid": 0, "tid": r["rank"],
                       "ts": r["start"] * us, "dur": (r["end"] - r["start"]) * us, "args": args})
        links = sorted({(t["src"], t["dst"]) for t in self.transfers})
        link_tid = {link: P + k for k, link in enumerate(links)}
        for (a, b), tid in link_tid.items():
            ev.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                       "args": {"name": f"link {a}->{b}"}})
            ev.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid,
                       "args": {"sort_index": tid}})
        for k, t in enumerate(self.transfers):
            tid = link_tid[(t["src"], t["dst"])]
            ev.append({"name": t["name"], "cat": "transfer", "ph": "X", "pid": 0, "tid": tid,
                       "ts": t["start"] * us, "dur": (t["end"] - t["start"]) * us,
                       "args": {"src": t["src"], "dst": t["dst"], "bytes": t["bytes"],
                                "posted": t["posted"] * us, "send_instr": t["send_instr"],
                                "recv_instr": t["recv_instr"]}})
            ev.append({"name": t["name"], "cat": "transfer", "ph": "s", "id": k, "pid": 0,
                       "tid": tid, "ts": t["start"] * us})
            ev.append({"name": t["name"], "cat": "transfer", "ph": "f", "id": k, "pid": 0,
                       "tid": t["dst"], "ts": t["end"] * us})
        for r, samples in enumerate(self.memory):
            for tm, a, tot in samples:
                ev.append({"name": f"memory rank {r}", "ph": "C", "pid": 0, "tid": r,
                           "ts": tm * us, "args": {"activation": a, "total": tot}})
        return {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": {"schedule": self.schedule, "ranks": P, "stages": self.num_stages,
                              "microbatches": self.num_microbatches, "measured": True,
                              "step_time": self.step_time, "time_unit": "s",
                              "bubble_fraction": self.bubble_fraction,
                              "bubble": self.bubble, "busy": self.busy,
                              "peak_activation": self.peak_activation,
                              "peak_total": self.peak_total, "clock_offsets_ns": self.offsets_ns}}

    def to_json(self) -> str:
        return json.dumps(self.to_chrome())

    def write(self, path: str | os.PathLike) -> str:
        text = self.to_json()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return text

    def summary(self) -> str:
        lines = [f"measured step {self.schedule}: {self.num_ranks} ranks, "
                 f"{self.num_microbatches} microbatches, step {self.step_time * 1e3:.3f} ms",
                 "rank   busy ms  bubble  peak act B  peak total B"]
        for r in range(self.num_ranks):
            lines.append(f"{r:4d} {self.busy[r] * 1e3:9.3f} {self.bubble[r] * 100:6.1f}% "
                         f"{self.peak_activation[r]:11d} {self.peak_total[r]:13d}")
        return "\n".join(lines)


def span_bubbles(runs, num_ranks: int) -> list[float]:
    """Per rank, the idle fraction between its first task's start and its last task's end
    (``runs``: dicts or objects with rank/start/end)."""
    lo = [None] * num_ranks
    hi = [None] * num_ranks
    busy = [0.0] * num_ranks
    for r in runs:
        rank, s, e = (r["rank"], r["start"], r["end"]) if isinstance(r, dict) else (
            r.rank, r.start, r.end)
        lo[rank] = s if lo[rank] is None else min(lo[rank], s)
        hi[rank] = e if hi[rank] is None else max(hi[rank], e)
        busy[rank] += e - s
    out = []
    for r in range(num_ranks):
        span = (hi[r] - lo[r]) if lo[r] is not None else 0.0
        out.append(max(0.0, 1.0 - busy[r] / span) if span > 0 else 0.0)
    return out


OpCode = _core.OpCode
# the engines' opcode names (``Executor.events()``: ``_core.opcode_name``) read as the enum
_OPCODE_OF_NAME = {_core.opcode_name(op): op for op in OpCode.__members__.values()}


class Event(NamedTuple):
    """One instruction's recorded times (ns; 0: did not happen) as the engines report them
    (``Executor.events()``, ``RankProgram.events()``): its index in the rank's stream,
    opcode (``_core.OpCode``; the engines report its name), buffer id and peer (-1: none)."""

    instr: int
    op: "_core.OpCode"
    buffer: int
    peer: int
    posted: int
    started: int
    completed: int


def build_trace(core_plan: Any, events: list, sizes: list[int] | None = None,
                offsets_ns: list[int] | None = None) -> Trace:
    """A Trace from every rank's executor events (``Executor.events()`` tuples: instr, op,
    buffer, peer, posted, started, completed in ns). ``offsets_ns[r]`` is subtracted from
    rank r's times (its clock minus rank 0's). ``sizes``: bytes per buffer id."""
    sched = core_plan.schedule
    P, S, M = sched.num_ranks, sched.num_stages, sched.num_microbatches
    offsets_ns = list(offsets_ns or [0] * P)
    sizes = sizes or [0] * core_plan.num_buffer_ids()
    evs = []
    for r in range(P):
        off = offsets_ns[r]
        evs.append([Event(i, _OPCODE_OF_NAME[op], b, p, po - off if po else 0,
                           st - off if st else 0, co - off if co else 0)
                     for i, op, b, p, po, st, co in events[r]])
    t0 = min((e.posted for rank in evs for e in rank if e.posted), default=0)

    def sec(t_ns):
        return (t_ns - t0) / 1e9

    runs = []
    for r in range(P):
        prog = core_plan.programs[r]
        acts = sched.rank_actions[r]
        for i, op, b, p, po, st, co in evs[r]:
            if op != OpCode.RUN:
                continue
            a = prog[i].action
            act = acts[a]
            d = {"rank": r, "instr": i, "action": a, "name": str(act), "cat": _category(act),
                 "kind": act.first.kind, "stage": act.first.stage,
                 "microbatch": act.first.microbatch,
                 "start": sec(st or po), "end": sec(max(co, st or po))}
            if act.is_fused:
                d["second_kind"] = act.second.kind
                d["second_stage"] = act.second.stage
                d["second_microbatch"] = act.second.microbatch
            runs.append(d)
    runs.sort(key=lambda d: (d["rank"], d["start"]))
    recvs = {(r, e.buffer, e.peer): e for r in range(P) for e in evs[r] if e.op == OpCode.RECV}
    transfers = []
    for src in range(P):
        for i, op, b, dst, po, st, co in evs[src]:
            if op != OpCode.SEND:
                continue
            rv = recvs.get((dst, b, src))
            start = st or po
            end = rv.completed if rv is not None and rv.completed else co or start
            transfers.append({"src": src, "dst": dst, "buffer": b,
                              "name": core_plan.describe_buffer(b), "send_instr": i,
                              "recv_instr": rv.instr if rv is not None else -1,
                              "posted": sec(po), "start": sec(start),
                              "recv_posted": sec(rv.posted) if rv is not None and rv.posted
                              else None,
                              "end": sec(max(end, start)), "bytes": sizes[b]})
    memory, peak_act, peak_tot = _replay_memory(core_plan, evs, sizes, sec)
    return Trace(sched.name, P, S, M, runs, transfers, memory, peak_act, peak_tot, offsets_ns)


def _replay_memory(core_plan, evs, sizes, sec):
    """Live bytes per rank over time, as the simulator counts them (a RUN allocates its
    outputs at its start, a RECV at its post, a FREE releases at its time or when the
    rank's send of the buffer completed, whichever is later), at the measured times."""
    memory, peak_act, peak_tot = [], [], []
    for r, rank_evs in enumerate(evs):
        send_done = {}
        for i, op, b, p, po, st, co in rank_evs:
            if op == OpCode.SEND:
                send_done[b] = max(send_done.get(b, 0), co)
        changes = []  # (time_ns, order, buffer, +1/-1); releases first at equal times
        acts = core_plan.schedule.rank_actions[r]
        internal = set()  # made and used inside a fused action: no buffer memory
        for i, op, b, p, po, st, co in rank_evs:
            if op == OpCode.RUN:
                act = acts[core_plan.programs[r][i].action]
                outs = set(core_plan.task_outputs(act.first))
                if act.is_fused:
                    inside = outs & set(core_plan.task_inputs(act.second))
                    internal |= inside
                    outs -= inside
                    outs.update(core_plan.task_outputs(act.second))
                for ob in sorted(outs):
                    changes.append((st or po, 1, ob, 1))
            elif op == OpCode.RECV:
                changes.append((po, 1, b, 1))
            elif op == OpCode.FREE and b not in internal:
                changes.append((max(co, send_done.get(b, 0)), 0, b, -1))
        changes.sort()
        act = tot = 0
        pa = pt = 0
        samples = []
        for t, _, b, sign in changes:
            n = sizes[b] * sign
            tot += n
            if core_plan.buffer_key(b).kind in (_K.Stash, _K.WStash):
                act += n
            pa, pt = max(pa, act), max(pt, tot)
            samples.append((sec(t), act, tot))
        memory.append(samples)
        peak_act.append(pa)
        peak_tot.append(pt)
    return memory, peak_act, peak_tot


def trace(fn: Any, *args, path: str | os.PathLike | None = None) -> Trace:
    """Runs one step of ``fn`` (a ``baton.jit`` function) with tracing on and returns its
    :class:`Trace` (``.outputs`` holds the step's outputs); written to ``path`` when given.
    Multi-process mode: collective; every process gets the same merged trace."""
    outs = fn._call(args, record=True)
    tr = fn.last_trace
    tr.outputs = outs
    if path is not None:
        tr.write(path)
    return tr
