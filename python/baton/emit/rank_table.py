"""A rank's loop as a table (``RankProgram`` on one-device ranks, loop form ``"table"``).

The loop is one ``fori_loop`` whose body holds each *unit* of the rank once (each distinct
task, each distinct transfer stretch with its microbatches as symbols), each a two-branch
``lax.switch`` run when the step's row names it; buffers live in rings, one per set of kinds
of equal avals, a slot per buffer as the rank program assigns it (``rings.ring_layout``). So
every task is compiled once per rank.

``build_table`` makes the table from a rank's items (its steps, units and rows, and when
each ringed buffer lives); ``lower_table`` traces the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .. import _core
from .. import _jax_compat as jc
from .rings import _ring_aval, _ring_in, _symbolic, table_steps
from .rolling import Item, ItemOp, _exes, item_reads, item_writes
from .task_env import _parts_of, _run_task, _Token
from ..planning.tasks import kind_name

G = _core.graph
_SYM = {ItemOp.SEND: ">", ItemOp.POST: "+", ItemOp.WAIT: "<"}


@dataclass
class Table:
    """A rank's table: its ``steps`` (``table_steps``), the distinct transfer ``stretches``
    (microbatches as symbols) and tasks (``units``: (kind, stage)), and one row per step
    (``rows``: stretch, task unit, task microbatch, then the stretch's microbatches; -1:
    none)."""

    steps: list
    stretches: list[tuple]
    units: list[tuple]  # (task kind, stage)
    rows: np.ndarray


def build_table(items) -> Table:
    """The table of a rank's ``items``: its steps, units and rows."""
    steps = table_steps(items)
    stretches: list[tuple] = []  # symbolic transfer stretches
    units: list[tuple] = []  # (kind, stage) of each task unit
    rows = []
    for st, task in steps:
        row = [-1, -1, 0]
        if st:
            pat, ms = _symbolic(st)
            if pat not in stretches:
                stretches.append(pat)
            row[0] = stretches.index(pat)
            row += ms
        if task is not None:
            if task[1:3] not in units:
                units.append(task[1:3])
            row[1] = units.index(task[1:3])
            row[2] = task[3]
        rows.append(row)
    width = max(len(r) for r in rows)
    table_rows = np.asarray([r + [0] * (width - len(r)) for r in rows], np.int32)
    return Table(steps, stretches, units, table_rows)


def describe_table(units, stretches, n_rows, pools, rings) -> str:
    """The table: its steps, its units (tasks, and transfer stretches with symbolic
    microbatches: ``>Act0`` send, ``+Grad1`` receive posted, ``<Grad1`` received) and the
    slots of each ring, e.g. ``table 16 steps; tasks F0 B0; transfers [>Act0.a] [+Grad1.a];
    rings Stash0:2``."""
    tasks = " ".join(f"{kind_name(k)}{s}" for k, s in units)
    tr = " ".join("[" + " ".join(f"{_SYM[op]}{k.name}{s}.{chr(97 + m)}"
                                 for op, k, s, m, _ in pat) + "]"
                  for pat in stretches)
    ring_text = " ".join(sorted("+".join(f"{k.name}{s}" for k, s in kinds) + f":{rings[pool]}"
                                for pool, kinds in pools.items()))
    return f"table {n_rows} steps; tasks {tasks}; transfers {tr}; rings {ring_text}"


def unit_sequence(steps) -> list[str]:
    """The units the steps run, in order: ``F0``, or a stretch as ``>Act0 +Grad1``."""
    out = []
    for st, task in steps:
        if st:
            out.append(" ".join(f"{_SYM[op]}{k.name}{s}" for op, k, s, _, _ in st))
        if task is not None:
            out.append(f"{kind_name(task.kind)}{task.stage}")
    return out


def ring_avals(prog, outer, mbs):
    """The avals of every ringed buffer kind of ``prog`` (a table ``RankProgram``): received
    ones from the plan's layouts, the ones a task makes from tracing each task unit once,
    abstractly, in stream order."""
    cs = prog.cs
    avals: dict[tuple, list] = {}  # (BufKind, stage) -> avals
    for st, _ in prog.steps:
        for op, k, s, _, _ in st:
            if op == ItemOp.WAIT:
                avals[(k, s)] = list(cs.buffers.layout(k, s))

    def discover():
        done = set()
        marks, prog.marks = prog.marks, False
        try:
            for _, task in prog.steps:
                if task is None or task[1:3] in done:
                    continue
                done.add(task[1:3])
                _, kind, s, _, _ = task

                def get(key):
                    return [jc.from_wire(jnp.zeros(_ring_aval(a).shape,
                                                   _ring_aval(a).dtype), a.dtype)
                            for a in avals[key[:2]]]

                def put(key, v):
                    avals[key[:2]] = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in v]

                _run_task(cs, kind, s, 0, outer, lambda v, _m: mbs[v][0], get, put,
                          lambda i, _m, x: None, lambda fn, args: fn(*args))
        finally:
            prog.marks = marks
        return 0

    jax.eval_shape(discover)
    return avals


def lower_table(prog, env, outer, whole_mb, token) -> None:
    """Traces ``prog``'s loop (a table ``RankProgram``) into ``env`` as one ``fori_loop``
    over its table (one row per step). The body holds each unit once: every transfer stretch
    and every task of the rank, each a two-branch ``lax.switch`` (branch 0 passes its
    operands through, branch 1 runs the unit) that runs when the row names it. Buffers live
    in rings (one per set of kinds of equal avals, a slot per buffer: ``ring_layout``),
    weight-gradient sums and stacked outputs in the loop's carry; a unit's switch takes as
    operands only what it reads, and returns only what it writes, so XLA updates them in
    place (a pass-through in branch 0 is not copied). So each task is compiled once per
    rank, whatever the schedule, and the token that threads every unit keeps the stream's
    order."""
    cs = prog.cs
    M = cs.M
    share = prog.share if prog.shared_in is not None else None
    # (shared by several ranks, shared.py: the units of every member, in this one's frame)
    t_units, t_stretches = (share.units, share.stretches) if share else (prog.units,
                                                                         prog.stretches)
    mbs = {v: whole_mb(v) for v in sorted({v for k, s in t_units for exe in _exes(cs, k, s)
                                           for v in exe.in_groups[1]})}
    avals = ring_avals(prog, outer, mbs)
    pool_of, rings = _rings(prog, share, avals)
    acc, stk = _part_carry(cs, t_units)
    if share is None:
        table = jnp.asarray(prog.rows)
        slot_of = {ks: jnp.asarray(sl) for ks, sl in prog.slots.items()}
    else:  # this device's rank's rows and slots (program inputs)
        table, slots = prog.shared_in
        slot_of = {ks: slots[j] for j, ks in enumerate(share.kinds)}
    body = _TableBody(prog, outer, mbs, avals, pool_of, slot_of, table, t_units,
                      t_stretches).body
    _, acc, stk, token.dep = jax.lax.fori_loop(0, share.T if share else len(prog.rows),
                                              body, (rings, acc, stk, token.dep))
    env.acc.update(acc)
    for i, x in stk.items():
        env.stack_rows[i] = [(0, M, 1, x)]


def _rings(prog, share, avals) -> tuple[dict, dict]:
    """Pools ``prog``'s kinds of equal avals into rings (``ring_layout``; shared by several
    ranks: sized for every member, shared.py) and records the bytes of one buffer of each
    kind. Returns (``(kind, stage)`` -> pool, pool -> the ring's arrays, zeros)."""
    prog._pool({ks: tuple((_ring_aval(a).shape, np.dtype(_ring_aval(a).dtype).str)
                          for a in avals[ks]) for ks in prog.lives})
    pool_of = prog.pool_of
    # bytes of one buffer of each kind (ring_bytes: what the rings hold)
    prog.buffer_bytes = {ks: sum(int(np.prod(_ring_aval(a).shape)) *
                                 np.dtype(_ring_aval(a).dtype).itemsize for a in avals[ks])
                         for ks in prog.lives}
    sizes = prog.rings
    if share is not None:  # (shared by several ranks: shared.py; each its rows, slots)
        sizes = share.rings(prog.rings, pool_of)
        for sh in share.shares[1:]:
            sh.prog.buffer_bytes = {(k, sh.stage[s]): prog.buffer_bytes[(k, s)]
                                    for k, s in prog.lives}
    rings = {pool: [jnp.zeros((R, *_ring_aval(a).shape), _ring_aval(a).dtype)
                    for a in avals[prog.pools[pool][0]]] for pool, R in sizes.items()}
    return pool_of, rings


def _part_carry(cs, t_units) -> tuple[dict, dict]:
    """The loop's initial sums and stacked outputs of the parts the task units add to."""
    parts = sorted({i for k, s in t_units for i in _parts_of(cs, k, s)})
    acc, stk = {}, {}
    for i in parts:
        aval = cs.traced.avals[cs.parts[i].body]
        if cs.parts[i].reduce == G.Reduce.Stack:
            stk[i] = jnp.zeros((cs.M, *aval.shape), aval.dtype)
        else:
            acc[i] = jnp.zeros(aval.shape, aval.dtype)
    return acc, stk


@dataclass
class _Unit:
    """One unit of the table's body: it runs when the row's column ``col`` is ``id``;
    ``ms``: the row's columns of its microbatches; ``rd`` / ``wr``: the rings it reads only /
    writes; ``ps``: the parts it adds to."""

    col: int
    id: int
    items: tuple | list
    ms: list[int]
    rd: list
    wr: list
    ps: list


class _TableBody:
    """The body of a table's ``fori_loop`` (``lower_table``): each unit's ``lax.switch``."""

    def __init__(self, prog, outer, mbs, avals, pool_of, slot_of, table, t_units,
                 t_stretches):
        self.prog, self.cs = prog, prog.cs
        self.outer, self.mbs, self.avals = outer, mbs, avals
        self.pool_of, self.slot_of, self.table = pool_of, slot_of, table
        self.units: list[_Unit] = []
        for j, pat in enumerate(t_stretches):
            n = 1 + max(it.mb for it in pat)
            self.units.append(_Unit(0, j, pat, list(range(3, 3 + n)), *self._io(pat)))
        for j, (kind, s) in enumerate(t_units):
            it = Item(ItemOp.RUN, kind, s, 0, -1)
            self.units.append(_Unit(1, j, (it,), [2], *self._io([it])))

    def _io(self, items):
        """(ring kinds read, ring kinds written, parts added to) of a unit's items."""
        cs, pool_of = self.cs, self.pool_of
        rd = {pool_of[key[:2]] for it in items for key in item_reads(cs, it)
              if key[:2] in pool_of}
        wr = {pool_of[key[:2]] for it in items for key in item_writes(cs, it)
              if key[:2] in pool_of}
        ps = {i for it in items if it.op == ItemOp.RUN for i in _parts_of(cs, it.kind, it.stage)}
        return sorted(rd - wr), sorted(wr), sorted(ps)

    def body(self, t, carry):
        """One step of the loop: row ``t``'s units run, the others pass through."""
        rg, ac, sk, dep = carry
        rg, ac, sk = dict(rg), dict(ac), dict(sk)
        row = self.table[t]
        for u in self.units:
            w = ({ks: rg[ks] for ks in u.wr}, {i: ac[i] for i in u.ps if i in ac},
                 {i: sk[i] for i in u.ps if i in sk}, dep)
            r = {ks: rg[ks] for ks in u.rd if ks in rg}
            w_rings, w_acc, w_stk, dep = jax.lax.switch(
                (row[u.col] == u.id).astype(jnp.int32),
                [lambda w, r, row: w, self._branch(u.items, u.ms)], w, r, row)
            rg.update(w_rings)
            ac.update(w_acc)
            sk.update(w_stk)
        return rg, ac, sk, dep

    def _branch(self, items, ms):
        """A unit's running branch: its items on the rings (``w`` written, ``r`` read) at the
        row's microbatches."""
        pool_of, slot_of, avals, mbs = self.pool_of, self.slot_of, self.avals, self.mbs

        def branch(w, r, row):
            w_rings, w_acc, w_stk, dep = w
            w_rings = {ks: list(v) for ks, v in w_rings.items()}
            w_acc, w_stk = dict(w_acc), dict(w_stk)
            r_rings = dict(r)
            local: dict[tuple, list] = {}

            def mat(j):
                return row[ms[j]]

            def get(key):
                if key in local:
                    return local[key]
                k, s, j = key
                pool = pool_of[(k, s)]
                src = w_rings[pool] if pool in w_rings else r_rings[pool]
                slot = slot_of[(k, s)][mat(j)]
                return [jc.from_wire(jax.lax.dynamic_index_in_dim(x, slot, keepdims=False),
                                     a.dtype) for x, a in zip(src, avals[(k, s)])]

            def put(key, v):
                local[key] = v
                k, s, j = key
                if (k, s) in pool_of:
                    pool, slot = pool_of[(k, s)], slot_of[(k, s)][mat(j)]
                    w_rings[pool] = [
                        jax.lax.dynamic_update_index_in_dim(x, _ring_in(y), slot, 0)
                        for x, y in zip(w_rings[pool], v)]

            def add(i, j, x):
                if i in w_acc:
                    w_acc[i] = w_acc[i] + x
                else:
                    w_stk[i] = jax.lax.dynamic_update_index_in_dim(w_stk[i], x, mat(j), 0)

            def mb(v, j):  # microbatch ``j`` of loop input ``v``
                return jax.lax.dynamic_index_in_dim(mbs[v], mat(j), keepdims=False)

            tok = _Token(dep)
            self.prog._items(list(items), 0, self.outer, mb, get, put, add, lambda: w_acc, tok)
            return w_rings, w_acc, w_stk, tok.dep

        return branch
