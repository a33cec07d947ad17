"""Which ranks of one process can share one compiled program (``share_groups``; the
program itself: ``shared.py``).

Two one-device ranks can share when the second is the first *shifted*: its stages map onto
the first's in order (``stage``), its peers are the first's shifted by the rank difference,
and

* each task of a mapped stage is the same computation: the same jaxpr text and constants
  (``jax.make_jaxpr`` of the task function on its input avals; none that places values on
  devices: sharding constraints, ``shard_map``, ``device_put``. A one-device rank's tasks
  hold no sharding constraint on its own device: there it is the identity, removed when the
  tasks are made, ``retarget.OnRank.drop``), reading the mapped loop inputs (equal avals;
  literals equal) and adding into the mapped loop output parts (equal avals and reduction);
* its table uses only units (tasks and transfer stretches, microbatches as symbols) that
  are the first's mapped, and rings only kinds the first rings; no task has skip edges.

One process runs one multi-device program at a time on XLA:CPU (its client serializes them,
so two such programs waiting on each other's transfers would deadlock): a process shares one
group, the largest (``share_groups``). Ranks on GPUs (NCCL contexts) are not grouped yet.
"""

from __future__ import annotations

import jax
import numpy as np

from .. import _core
from .rolling import _exes
from ..planning.tasks import unit_order

_PLACED = ("sharding_constraint", "shard_map", "device_put")  # primitives that name devices


def _stages(cs, rank) -> list[int]:
    return [s for s, r in enumerate(cs.stage_rank) if r == rank]


def _stage_map(cs, lead: int, rank: int) -> dict[int, int] | None:
    """The lead's stages onto the member's: its own stages in order, and every other stage
    whose buffers the lead's tasks read or write (the plan's inputs and outputs of each task
    of its rank program's units: an activation of the stage before, a gradient of the stage
    after, ...) onto the stage at the same distance from the image of the task's stage;
    None when that is ambiguous or out of range."""
    progs = cs.rank_ir().programs
    ls, ps = list(progs[lead].stages), list(progs[rank].stages)
    if len(ls) != len(ps):
        return None
    own = dict(zip(ls, ps))
    out = dict(own)
    plan = cs.core_plan
    skips = (_core.BufKind.Skip, _core.BufKind.SkipGrad)
    for unit in progs[lead].units:
        for task in unit.tasks:
            for b in [*plan.task_inputs(task), *plan.task_outputs(task)]:
                key = plan.buffer_key(b)
                if key.kind in skips or key.stage in own:
                    continue
                img = own[task.stage] + (key.stage - task.stage)
                if not 0 <= img < cs.num_stages or out.setdefault(key.stage, img) != img:
                    return None
    return out


class _Jaxprs:
    """The jaxpr text and constants of functions of a step's values (a task's ``plain``, a
    segment's ``fn``), each made once, on the avals of the values it takes."""

    def __init__(self, cs):
        self.cs = cs
        self.memo: dict = {}

    def key(self, fn, ins):
        k = id(fn)
        if k not in self.memo:
            avals = self.cs.traced.avals
            closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(avals[v].shape, avals[v].dtype)
                                          for v in ins])
            self.memo[k] = (str(closed.jaxpr), [np.asarray(c) for c in closed.consts])
        return self.memo[k]

    def same(self, a, b) -> bool:
        """Functions ``a`` and ``b`` (each ``(fn, input ids)``) are the same computation. Not
        when they name devices: a sharding constraint or ``shard_map`` is moved onto its rank's
        own sub-mesh (``retarget.on_rank``), which a jaxpr's text does not show, and a
        ``device_put`` may name a device. (The constraints a one-device rank's tasks held are
        gone: ``OnRank.drop``; any left, e.g. into host memory, refuse.)"""
        (ta, ca), (tb, cb) = self.key(*a), self.key(*b)
        if any(p in ta for p in _PLACED):
            return False
        return ta == tb and len(ca) == len(cb) and all(
            x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
            for x, y in zip(ca, cb))


def _task(exe):
    return exe.plain, [v for g in exe.in_groups for v in g]


class Share:
    """How member rank ``prog`` maps onto the group's first rank ``lead``: its stages
    (``stage``), loop inputs (``outer``: lead's outer value -> member's), loop output parts
    (``parts``), and its units and transfer stretches in the lead's frame."""

    def __init__(self, lead, prog, stage, outer, parts, units, stretches):
        self.lead, self.prog = lead, prog
        self.stage, self.outer, self.parts = stage, outer, parts
        self.units, self.stretches = units, stretches  # the member's, in the lead's frame
        self.shift = prog.rank - lead.rank

    def rows(self, units, stretches) -> np.ndarray:
        """The member's table rows with the shared program's unit numbering."""
        su = [stretches.index(p) for p in self.stretches]
        uu = [units.index(u) for u in self.units]
        rows = self.prog.rows.copy()
        rows[:, 0] = [su[x] if x >= 0 else -1 for x in self.prog.rows[:, 0]]
        rows[:, 1] = [uu[x] if x >= 0 else -1 for x in self.prog.rows[:, 1]]
        return rows

    def alias(self, stretches) -> tuple[list, list]:
        """(lead's (peer, channel, stage), member's) of every transfer of ``stretches``
        (the shared program's, in the lead's frame) that this member can make."""
        chan = self.lead.cs.buffers.channel
        R = self.lead.cs.num_ranks
        frm, to = [], []
        for pat in stretches:
            for _, k, s, _, peer in pat:
                if s in self.stage and 0 <= peer + self.shift < R:
                    frm.append((peer, chan(k, s), s))
                    to.append((peer + self.shift, chan(k, self.stage[s]), self.stage[s]))
        return frm, to


def match(lead, prog, jaxprs: _Jaxprs) -> Share | None:
    """How ``prog``'s rank maps onto ``lead``'s (see the module docstring), or None when it
    cannot share ``lead``'s program."""
    cs = lead.cs
    if not (lead.table and prog.table):
        return None
    stage = _stage_map(cs, lead.rank, prog.rank)
    if stage is None:
        return None
    shift = prog.rank - lead.rank
    R = cs.num_ranks
    inv = {v: k for k, v in stage.items()}
    if len(inv) != len(stage):
        return None
    # the member's tasks and transfer stretches in the lead's frame (the shared program
    # holds those of every member)
    if not all(s in inv for _, s in prog.units):
        return None
    units = [(k, inv[s]) for k, s in prog.units]
    stretches = []
    for pat in prog.stretches:
        if any(st not in inv or not 0 <= p - shift < R for _, _, st, _, p in pat):
            return None
        stretches.append(tuple(it._replace(stage=inv[it.stage], peer=it.peer - shift)
                               for it in pat))
    if not all(s in stage for _, s in lead.lives):
        return None
    lk = {(k, stage[s]) for k, s in lead.lives}
    if not set(prog.lives) <= lk:
        return None
    # tasks: the same computation on mapped inputs and parts
    lits = cs.traced.literals
    avals = cs.traced.avals
    outer: dict[int, int] = {}
    parts: dict[int, int] = {}
    for (kind, s), exe in cs.tasks.items():
        if cs.stage_rank[s] != lead.rank:
            continue
        other = cs.tasks.get((kind, stage[s]))
        if other is None or exe.skip_in or other.skip_in or exe.out_order != other.out_order:
            return None
        if [len(g) for g in exe.in_groups] != [len(g) for g in other.in_groups]:
            return None
        for v0, v in zip(exe.in_groups[0] + exe.in_groups[1],
                         other.in_groups[0] + other.in_groups[1]):
            (o0, mb0), (o, mb) = cs.loop_src[v0], cs.loop_src[v]
            if mb0 != mb or outer.setdefault(o0, o) != o:
                return None
            if (o0 in lits) != (o in lits):
                return None
            if o0 in lits and not _same_literal(lits[o0], lits[o]):
                return None
            elif (avals[o0].shape, avals[o0].dtype) != (avals[o].shape, avals[o].dtype):
                return None
        for i0, i in zip([*exe.body[0], *exe.body[1]], [*other.body[0], *other.body[1]]):
            p0, p = cs.parts[i0], cs.parts[i]
            b0, b = avals[p0.body], avals[p.body]
            if (parts.setdefault(i0, i) != i or p0.reduce != p.reduce
                    or (b0.shape, b0.dtype) != (b.shape, b.dtype)):
                return None
    if sorted(outer[o] for o in lead.needs) != sorted(prog.needs):
        return None
    if sorted(parts.get(i, -1) for i in lead.mine) != sorted(prog.mine):
        return None
    for kind, s in sorted(set(lead.units) | set(units), key=unit_order):
        a, b = _exes(cs, kind, s), _exes(cs, kind, stage[s])
        if len(a) != len(b) or not all(jaxprs.same(_task(x), _task(y)) for x, y in zip(a, b)):
            return None
    return Share(lead, prog, stage, outer, parts, units, stretches)


def _same_literal(a, b) -> bool:
    """Whether two constants of a traced step are equal (typed PRNG keys by their key data,
    which NumPy cannot hold)."""

    def host(x):
        dtype = getattr(x, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            return str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x))
        return None, np.asarray(x)

    (ia, a), (ib, b) = host(a), host(b)
    return ia == ib and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def share_groups(progs) -> list[list[Share]]:
    """The ranks of ``progs`` (one process's ``RankProgram``s, by rank) grouped: each group
    a list of ``Share`` (the first the lead's own, identity) of ranks that can share one
    program. Only the largest group of two or more is kept (one multi-device program at a
    time per process; see the module docstring); every other rank is its own group."""
    if not progs:
        return []
    jaxprs = _Jaxprs(progs[0].cs)
    groups: list[list[Share]] = []
    for p in progs:
        for g in groups:
            sh = match(g[0].prog, p, jaxprs)
            if sh is not None:
                g.append(sh)
                break
        else:
            groups.append([_identity(p)])
    big = max(groups, key=len)
    if len(big) < 2:
        return groups
    out = []
    for g in groups:
        if g is big:
            out.append(g)
        else:
            out.extend([s] if s is g[0] else [_identity(s.prog)] for s in g)
    return sorted(out, key=lambda g: g[0].prog.rank)


def _identity(p) -> Share:
    cs = p.cs
    return Share(p, p, {s: s for s in range(cs.num_stages)}, {o: o for o in p.needs},
                 {i: i for i in p.mine}, list(getattr(p, "units", [])),
                 list(getattr(p, "stretches", [])))
