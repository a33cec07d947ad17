"""The code before and after a step's microbatch loop, run around any engine's loop
(``run_around``): the one orchestrator of a step outside its loop, in one process or in one
process of a group.

A step is: the segments before the loop (``CompiledStep.pre_segments``), the loop (the
engine's: ``ProgramEngine.run_local`` / ``run_rank``, ``Interpreter.run_local`` /
``run_rank``), the combine of each loop output made by several stages (``CompiledStep
.combine``), and the segments after the loop. ``Route`` says where the values outside the
loop are and moves them: in one process every value is here and nothing moves; in a process
group a value another process holds is sent by a ``distributed.Router`` before the segment,
the combine or the loop that reads it, and an output this process does not hold is a
``Remote``. Every process of a group walks the same sequence, so their transfers pair up.
(A one-rank step compiles all of this into one program: ``emit/single_program.py``.)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .distributed import Remote
from .run_options import RunOptions


class Route:
    """Where each value outside the loop is held (``where``: value -> processes; ``made``:
    value -> the rank that made it, named by a ``Remote``), and the ``router`` that moves
    values between processes (None: one process, which holds everything)."""

    def __init__(self, step, router=None, me: int = 0):
        self.step = step
        self.router = router
        self.me = me
        self.where: dict[Any, set] = {}
        self.made: dict[Any, int] = {}

    def procs(self, rank: int):
        """The processes that run ``rank`` (one process: this one)."""
        return self.step.mesh.procs(rank) if self.router is not None else (self.me,)

    def need(self, keys, procs, vals: dict) -> None:
        """Makes ``keys`` present on ``procs`` (a process group: sent by their holders)."""
        if self.router is not None:
            self.router.need(keys, procs, vals, self.where)

    def held(self, key, rank: int) -> None:
        """``key`` is held by the processes of ``rank``, which made it."""
        if self.router is not None:
            self.where.setdefault(key, set()).update(self.procs(rank))
            self.made.setdefault(key, rank)

    def ready(self, seg, vals: dict) -> bool:
        """Brings segment ``seg``'s inputs to its rank's processes; whether this process runs
        it."""
        procs = self.procs(self.step.stage_rank[seg.stage])
        lits = self.step.traced.literals
        self.need([v for v in seg.inputs if v not in lits], procs, vals)
        return self.me in procs

    def ran(self, seg) -> None:
        """Segment ``seg`` ran on its rank's processes: its outputs are held there (a value
        copied on several stages is held by each)."""
        for v in seg.outputs:
            self.held(v, self.step.stage_rank[seg.stage])


def run_around(step, flat_args: list, loop: Callable[[dict], tuple], route: Route,
               opts: RunOptions, shared: Callable[[], Any] | None = None,
               before_post: Callable[[], None] | None = None) -> tuple[list, Any]:
    """One step of ``step`` outside its loop, around ``loop(vals) -> (final parts,
    LoopRecord)``; returns (the flat outputs, the ``LoopRecord``). ``shared()``: the segments
    after the loop that run as one program for several ranks (one process only), asked once
    the loop ran; ``before_post()``: called between the combine and the segments after the
    loop."""
    tr = step.traced
    lits = tr.literals
    one = route.router is None
    vals: dict[Any, Any] = {}
    if one:
        vals.update(zip(tr.step_inputs, flat_args))
    else:
        route.where = route.router.holders(tr.step_inputs, flat_args, vals)
    step._run_segments(step.pre_segments, vals, route=route)
    for r in range(step.num_ranks):
        route.need([o for o in step.loop_needs[r] if o not in lits], route.procs(r), vals)
    final, record = loop(vals)
    for i, part in enumerate(step.parts):
        if i in final:
            vals[("part", i)] = final[i]
        route.held(("part", i), step.stage_rank[part.stage])
    del final
    for outer, idx in step.by_outer.items():
        home = step.home(idx)
        if len(idx) > 1:
            route.need([("part", i) for i in idx], route.procs(home), vals)
        if route.me in route.procs(home):
            vals[outer] = step.combine(idx, {i: vals[("part", i)] for i in idx})
        route.held(outer, home)
    for key in [k for k in vals if isinstance(k, tuple) and k[:1] == ("part",)]:
        del vals[key]  # (partial sums of a value several stages make: combined above)
    if before_post is not None:
        before_post()
    step._run_segments(step.post_segments, vals, free=one,
                       shared=shared() if shared is not None else None, opts=opts,
                       route=route)
    if one:
        return [vals[v] if v in vals else lits[v] for v in tr.step_outputs], record
    return _group_outputs(step, vals, route), record


def _group_outputs(step, vals, route) -> list:
    """This process's outputs: per-microbatch outputs sent to every process first; an
    output held elsewhere is a ``Remote`` naming the rank that made it."""
    tr = step.traced
    router = route.router
    seen = set()
    for v in tr.step_outputs:
        if v in step._broadcast and v not in seen:
            seen.add(v)
            for q in range(router.g.world_size):
                router.need([v], q, vals, route.where)
    outs = []
    for v in tr.step_outputs:
        if v in tr.literals:
            outs.append(tr.literals[v])
        elif route.me in route.where[v]:
            outs.append(vals[v])
        else:
            aval = tr.avals[v]
            rank = route.made.get(v, step.mesh.ranks_of(min(route.where[v]))[0])
            outs.append(Remote(tuple(aval.shape), np.dtype(aval.dtype), rank))
    router.finish()
    return outs
