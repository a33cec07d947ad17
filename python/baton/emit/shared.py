"""One compiled program for several ranks of one process (``SharedProgram``).

XLA's CPU compile time goes with the number of kernels a program holds, and every rank
program compiles its own copy of its block's kernels plus its table's (``bench/results/
compile.md``). Ranks of one process that run the same work on different parameters (the
middle ranks of a pipeline of equal blocks) can share one program instead: an SPMD program
(``shard_map``) over their devices, traced and compiled once, in which each device runs its
own rank's table.

Which ranks can share, and how a member maps onto the group's first rank: ``share_match.py``
(``share_groups``).

What differs between them becomes data: each device reads its own rows of the table (the
steps padded with no-op rows to the longest), its own ring slot of each microbatch, and its
own parameters (each input is the members' arrays side by side along the leading axis, one
block per device, placed without a copy); the rings have the most slots any member needs.
The transfers are the first rank's FFI calls: its context routes each device's calls to that
device's rank (``RankComm.set_route``), whose context runs the first rank's (peer, channel,
stage) as its own (``RankComm.set_alias``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import ExecutionError
from .share_match import Share, _Jaxprs, _stages

_AX = "baton_ranks"


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
        self.slots = None  # [members * kinds, M] int32, set by the lowering (rings)
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
        (its rank program's, with the lead's pools mapped) and the rings sized for the
        largest. Returns (pool -> slots) for the program."""
        M = self.lead.cs.M
        sizes = dict(lead_rings)
        tables = []
        for s in self.shares:
            back = {(k, s.stage[st]): (k, st) for k, st in self.lead.lives}
            s.prog._pool({ks: pool_of[back[ks]] for ks in s.prog.lives})
            for p, n in s.prog.rings.items():
                sizes[p] = max(sizes.get(p, 0), n)
            t = np.zeros((max(1, len(self.kinds)), M), np.int32)
            for j, ks in enumerate(self.kinds):
                mk = (ks[0], s.stage[ks[1]])
                if mk in s.prog.slots:
                    t[j] = s.prog.slots[mk]
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
