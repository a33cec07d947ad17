"""One compiled program for several ranks of one process (``SharedProgram``).

XLA's CPU compile time goes with the number of kernels a program holds, and every rank
program compiles its own copy of its block's kernels plus its table's (``bench/results/
compile.md``). Ranks of one process that run the same work on different parameters (the
middle ranks of a pipeline of equal blocks) can share one program instead: an SPMD program
(``shard_map``) over their devices, traced and compiled once, in which each device runs its
own rank's table.

Two one-device ranks can share when the second is the first *shifted*: its stages map onto
the first's in order (``stage``), its peers are the first's shifted by the rank difference,
and

* each task of a mapped stage is the same computation: the same jaxpr text and constants
  (``jax.make_jaxpr`` of the task function on its input avals; none that places values on
  devices: sharding constraints, ``shard_map``, ``device_put``), reading the mapped loop
  inputs (equal avals; literals equal) and adding into the mapped loop output parts (equal
  avals and reduction);
* its table uses only units (tasks and transfer stretches, microbatches as symbols) that
  are the first's mapped, and rings only kinds the first rings; no task has skip edges.

What differs between them becomes data: each device reads its own rows of the table (the
steps padded with no-op rows to the longest), its own ring slot of each microbatch, and its
own parameters (each input is the members' arrays side by side along the leading axis, one
block per device, placed without a copy); the rings have the most slots any member needs.
The transfers are the first rank's FFI calls: its context routes each device's calls to that
device's rank (``RankComm.set_route``), whose context runs the first rank's (peer, channel,
stage) as its own (``RankComm.set_alias``).

One process runs one multi-device program at a time on XLA:CPU (its client serializes them,
so two such programs waiting on each other's transfers would deadlock): a process shares one
group, the largest (``share_groups``). Ranks on GPUs (NCCL contexts) are not grouped yet.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import _core
from .rings import ring_slots
from .rolling import _exes

_AX = "baton_ranks"
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
        ``device_put`` may name a device."""
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
        stretches.append(tuple((op, k, inv[st], m, p - shift) for op, k, st, m, p in pat))
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
    for kind, s in sorted(set(lead.units) | set(units)):
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


def _stack(xs, devices, sharding):
    """The members' arrays (one per device of ``devices``, equal avals) as one array split
    over the devices along its leading axis (no copy); a scalar as one element each (through
    the host)."""
    if xs[0].ndim == 0:
        xs = [jax.device_put(np.asarray(x).reshape(1), d) for x, d in zip(xs, devices)]
    shape = (len(xs) * xs[0].shape[0], *xs[0].shape[1:])
    return jax.make_array_from_single_device_arrays(shape, sharding, xs)


def _unstack(x, scalar: bool, devices) -> list:
    """The members' blocks of a stacked output, in the order of ``devices``."""
    pos = {int(d.id): j for j, d in enumerate(devices)}
    out: list[Any] = [None] * len(devices)
    for sh in x.addressable_shards:
        out[pos[int(sh.device.id)]] = sh.data.reshape(()) if scalar else sh.data
    return out


class SharedProgram:
    """The program of a group of ranks (``share_groups``): the lead's ``RankProgram``
    traced once inside a ``shard_map`` over the members' devices (see the module
    docstring). Runs like a ``RankProgram`` (``lower``, ``compiled``, ``__call__``,
    ``error``), for all its ranks at once."""

    def __init__(self, shares: list[Share]):
        self.shares = shares
        self.lead = shares[0].prog
        self.progs = [s.prog for s in shares]
        self.rank = self.lead.rank
        self.comm = self.lead.comm
        self.comms = [p.comm for p in self.progs]
        devs = [p.sub.devices.flat[0] for p in self.progs]
        self.devices = devs
        self.mesh = Mesh(np.array(devs), (_AX,))
        self.sharding = NamedSharding(self.mesh, PartitionSpec(_AX))
        # the units of every member, in the lead's frame
        self.units, self.stretches = [], []
        for s in shares:
            self.units += [u for u in s.units if u not in self.units]
            self.stretches += [p for p in s.stretches if p not in self.stretches]
        for sh, d in zip(shares[1:], devs[1:]):
            self.lead.comm.set_route(int(d.id), sh.prog.comm)
            sh.prog.comm.set_alias(*sh.alias(self.stretches))
        mine = [s.rows(self.units, self.stretches) for s in shares]
        T = max(len(r) for r in mine)
        W = max(r.shape[1] for r in mine)
        self.T = T
        rows = []
        for m in mine:
            r = np.zeros((T, W), np.int32)
            r[:, :2] = -1
            r[:len(m), :m.shape[1]] = m
            rows.append(r)
        self.rows = self._stack([jax.device_put(r, d) for r, d in zip(rows, devs)])
        self.kinds = sorted(self.lead.lives)  # the lead's ringed kinds, in slot-table order
        self.slots = None  # [members * kinds, M] int32, set by the lowering (ring_slots)
        self.post = None  # SharedSegments: their code after the loop (engine.post_groups)
        self.lead.share = self
        self.fn = jax.jit(self._program)
        self.compiled = None

    # -- inputs and outputs ------------------------------------------------------------------
    def _stack(self, xs):
        return _stack(xs, self.devices, self.sharding)

    def _unstack(self, x, scalar: bool) -> list:
        return _unstack(x, scalar, self.devices)

    def _args(self, vals):
        lead = self.lead
        per = []
        for s in self.shares:
            needs = [s.outer[o] for o in lead.needs]
            per.append(s.prog.cs.place(needs, [vals[o] for o in needs], s.prog.rank))
        return [self._stack([p[j] for p in per]) for j in range(len(lead.needs))]

    def _slots_arg(self):
        if self.slots is None:  # (before lowering: its aval)
            M = self.lead.cs.M
            return jax.ShapeDtypeStruct((len(self.progs) * max(1, len(self.kinds)), M),
                                        np.int32, sharding=self.sharding)
        return self.slots

    # -- the program -------------------------------------------------------------------------
    def _program(self, args, rows, slots):
        lead = self.lead
        scal = [a.ndim == 0 for a in (jax.ShapeDtypeStruct(lead.cs.traced.avals[o].shape,
                                                           lead.cs.traced.avals[o].dtype)
                                      for o in lead.needs)]

        def body(args, rows, slots):
            args = [a.reshape(()) if sc else a for a, sc in zip(args, scal)]
            lead.shared_in = (rows, slots)
            try:
                outs = lead._program(args)
            finally:
                lead.shared_in = None
            return [o.reshape(1) if o.ndim == 0 else o for o in outs]

        P = PartitionSpec(_AX)
        return jax.shard_map(body, mesh=self.mesh, in_specs=(P, P, P), out_specs=P,
                             check_vma=False)(args, rows, slots)

    def rings(self, lead_rings, pool_of):
        """Called by the lead's lowering once its rings are pooled: every member's slots
        (``ring_slots`` with the lead's pools, mapped) and the rings sized for the largest.
        Returns (pool -> slots) for the program."""
        cs = self.lead.cs
        M = cs.M
        sizes = dict(lead_rings)
        tables = []
        for s in self.shares:
            back = {(k, s.stage[st]): (k, st) for k, st in self.lead.lives}
            pool = {ks: pool_of[back[ks]] for ks in s.prog.lives}
            sl, rs = ring_slots(s.prog.lives, pool, M)
            s.prog._pool(pool)
            for p, n in rs.items():
                sizes[p] = max(sizes.get(p, 0), n)
            t = np.zeros((max(1, len(self.kinds)), M), np.int32)
            for j, ks in enumerate(self.kinds):
                mk = (ks[0], s.stage[ks[1]])
                if mk in sl:
                    t[j] = sl[mk]
            tables.append(t)
        self._tables = tables  # (placed by ``lower`` once traced)
        for s in self.shares:  # (what each rank's rings hold: the shared sizes)
            s.prog.rings = {p: sizes[p] for p in s.prog.rings}
        return sizes

    def lower(self, vals):
        out = self.fn.lower(self._args(vals), self.rows, self._slots_arg())
        self.slots = self._stack([jax.device_put(t, d)
                                  for t, d in zip(self._tables, self.devices)])
        return out

    def lowered_text(self) -> str:
        """The program's StableHLO, lowered from the loop inputs' avals (tests inspect its
        custom calls)."""
        lead, n = self.lead, len(self.progs)
        avals = lead.cs.traced.avals
        args = [jax.ShapeDtypeStruct((n * avals[o].shape[0], *avals[o].shape[1:])
                                     if avals[o].ndim else (n,), avals[o].dtype,
                                     sharding=self.sharding) for o in lead.needs]
        return self.fn.lower(args, self.rows, self._slots_arg()).as_text()

    def set_timeout(self, timeout) -> None:
        for p in self.progs:
            p.set_timeout(timeout)

    def __call__(self, vals) -> dict[int, Any]:
        lead = self.lead
        try:
            outs = (self.compiled or self.fn)(self._args(vals), self.rows, self.slots)
            jax.block_until_ready(outs)
        except BaseException as e:
            raise self.error(e) from e
        final: dict[int, Any] = {}
        for i0, x in zip(lead.mine, outs[1:]):
            scalar = lead.cs.traced.avals[lead.cs.parts[i0].body].ndim == 0
            for s, y in zip(self.shares, self._unstack(x, scalar)):
                final[s.parts[i0]] = y
        return final

    def error(self, e: BaseException):
        """``e`` as the step's ``ExecutionError``. XLA reports a failure of the program once
        every device's part has stopped, and does not say which part failed: a transfer
        error is the members' recorded failure (it names the rank where it started); any
        other (a task that raised on one device) names the group's ranks and is marked
        ``task_error`` (``engine.raise_origin`` prefers it to the timeouts it caused)."""
        from ..errors import ExecutionError

        if isinstance(e, ExecutionError):
            return e
        text = str(e)
        fails = [f for f in (p.comm.failure() for p in self.progs) if f is not None]
        if any(msg in text for _, msg in fails):
            return _failed(*fails[0])
        ranks = ", ".join(str(p.rank) for p in self.progs)
        msg = (f"ranks {ranks} (one shared program, baton.jit(share_programs=True); XLA "
               f"does not say which rank's part failed): {type(e).__name__}: {e}")
        for p in self.progs:
            if p.comm.attached:
                p.comm.abort(msg)
        err = ExecutionError(msg)
        err.failed_rank = self.lead.rank
        err.task_error = True
        return err


def _failed(origin, msg):
    from ..errors import ExecutionError

    err = ExecutionError(msg)
    err.failed_rank = origin
    return err


class SharedSegments:
    """The code after the loop (``CompiledStep.post_segments``) of a ``SharedProgram``'s ranks:
    a lead segment and the members' segments that are the same function (equal jaxpr text and
    constants on equal input avals, nothing placed on devices, nothing donated) run as one
    SPMD program over the group's devices, compiled once (each rank's optimizer update of
    equal blocks). ``starts``: segment index -> (the group's segment indices, its runner), run
    at the group's first index; ``skip``: the group's other indices."""

    def __init__(self, sp: SharedProgram, segs):
        cs = sp.lead.cs
        self.sp = sp
        self.starts: dict[int, tuple[list[int], Any]] = {}  # index -> (segment indices, fn)
        self.skip: set[int] = set()
        made = {v: j for j, seg in enumerate(segs) for v in seg.outputs}
        by_stage: dict[int, list[int]] = {}
        for j, seg in enumerate(segs):
            by_stage.setdefault(seg.stage, []).append(j)
        jaxprs = _Jaxprs(cs)
        avals = cs.traced.avals

        def same(a, b):
            return jaxprs.same((segs[a].fn, segs[a].inputs), (segs[b].fn, segs[b].inputs))

        lead_stages = _stages(cs, sp.lead.rank)
        for s0 in lead_stages:
            for k, j0 in enumerate(by_stage.get(s0, [])):
                if segs[j0].donate:
                    continue
                group, devs = [j0], [sp.devices[0]]
                for sh, d in zip(sp.shares[1:], sp.devices[1:]):
                    cand = by_stage.get(sh.stage.get(s0, -1), [])
                    if k >= len(cand) or segs[cand[k]].donate:
                        continue
                    jm = cand[k]
                    if ([(avals[v].shape, avals[v].dtype) for v in segs[jm].inputs]
                            != [(avals[v].shape, avals[v].dtype) for v in segs[j0].inputs]):
                        continue
                    if same(j0, jm):
                        group.append(jm)
                        devs.append(d)
                if len(group) < 2:
                    continue
                start = min(group)
                if any(made.get(v, -1) >= start for j in group for v in segs[j].inputs):
                    continue  # (an input made by a segment that runs after the group would)
                self.starts[start] = (group, self._runner(segs, group, devs))
                self.skip.update(j for j in group if j != start)

    def _runner(self, segs, group, devs):
        mesh = Mesh(np.array(devs), (_AX,))
        sharding = NamedSharding(mesh, PartitionSpec(_AX))
        cs = self.sp.lead.cs
        avals = cs.traced.avals
        lead = segs[group[0]]
        scal_in = [avals[v].ndim == 0 for v in lead.inputs]
        scal_out = [avals[v].ndim == 0 for v in lead.outputs]
        ranks = [cs.stage_rank[segs[j].stage] for j in group]

        def body(*args):
            args = [a.reshape(()) if sc else a for a, sc in zip(args, scal_in)]
            outs = lead.fn(*args)
            return [o.reshape(1) if sc else o for o, sc in zip(outs, scal_out)]

        P = PartitionSpec(_AX)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P, out_specs=P, check_vma=False))

        def run(vals):
            lits = cs.traced.literals
            per = [cs.place(segs[j].inputs, [vals[v] if v in vals else lits[v]
                                             for v in segs[j].inputs], r)
                   for j, r in zip(group, ranks)]
            outs = fn(*[_stack([p[i] for p in per], devs, sharding)
                        for i in range(len(lead.inputs))])
            for i, x in enumerate(outs):
                for j, y in zip(group, _unstack(x, scal_out[i], devs)):
                    vals[segs[j].outputs[i]] = y

        return run
